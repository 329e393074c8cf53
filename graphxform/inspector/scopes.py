"""The collapsed picture every inspector view draws (DOT, HTML, diff colours).

A transformed graph has tens of thousands of nodes; a person reads about 150 boxes. Three
reductions, after TensorBoard's graph view (Wongsuphasawat et al., VAST'18):

- fold replicas: the copies ``replica_0/x`` .. ``replica_7/x`` are one *leaf* ``replica_*/x``
  badged ``x 8`` (any ``replica_<i>`` path component folds, so ``allreduce/bucket_0/replica_3/
  reduce`` does too); a leaf's inputs are the folded inputs of all its members;
- scopes: leaves hang in the tree of their name scopes, and a scope with many children gets
  *groups* of the children that share a name prefix (``conv4_block1_*``, ``layer_*``),
  TensorBoard's "series";
- collapse: a box is a leaf or a closed scope; scopes open largest first while the picture stays
  within the box budget, and Saver, gradient, optimizer and initializer scopes open last.
Edges between the leaves of two boxes are bundled into one edge that counts them.

Tree entries are numbered parents first, so one forward sweep finds each entry's box.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import re

from graphxform.errors import GraphxformError
from graphxform.ir import CONTROL_KEY, GraphIR

DEFAULT_BOXES = 150
MAX_CHILDREN = 24  # a scope with more children gets name-prefix groups
HUB_DEGREE = 16  # a box joined to more boxes is drawn aside, without its edges
REPLICA_PART = re.compile(r"(?<![^/])replica_(\d+)(?=/)")
FOLDED_REPLICA = "replica_*"
# scopes that open last: what people rarely want to see first
FOLD_FIRST = {"save", "gradients", "Initializer", "init", "GradientDescent", "Momentum", "Adam",
              "Adagrad", "AdagradDA", "RMSProp", "Ftrl", "Adadelta", "ProximalAdagrad",
              "ProximalGradientDescent", "Adamax", "Nadam", "SGD", "LazyAdam", "AdamW",
              "training", "optimizer"}
# nodes made by these passes re-serve the input's names or save it: scopes of nothing else
# open last too
FOLD_FIRST_PASSES = {"merge-fetches", "drop-in-saver"}
_NUMBERED = re.compile(r"_\d+$")
_DIGITS = re.compile(r"\d+")

SCOPE, GROUP, OP = "scope", "group", "op"


def fold_name(name: str) -> tuple[str, int | None]:
    """``replica_3/a/b`` -> (``replica_*/a/b``, 3); a name outside every replica -> (name, None)."""
    if "replica_" not in name:
        return name, None
    found = REPLICA_PART.search(name)
    if found is None:
        return name, None
    return REPLICA_PART.sub(FOLDED_REPLICA, name), int(found.group(1))


def original_name(name: str, created_by: str | None) -> str | None:
    """The name a node had in the input graph: a replica's copy drops its ``replica_<i>/``; a
    node a pass made (but replicate's copies) had none."""
    if created_by == "replicate":
        return REPLICA_PART.sub("", name, count=1).replace("//", "/").lstrip("/")
    return None if created_by else name


class FoldedGraph:
    """The graph with each replica's copies folded into one leaf (``fold=False``: one leaf per
    node). Per leaf: its folded name, its members (graph node names), the replicas they belong
    to, and its inputs as (leaf, port) with port -1 for a control input. ``ghosts``: another
    graph whose nodes missing here become leaves too (a diff draws what B removed from A)."""

    def __init__(self, ir: GraphIR, fold: bool = True, ghosts: GraphIR | None = None):
        self.ir = ir
        self.names: list[str] = []
        self.members: list[list[str]] = []
        self.replicas: list[set] = []
        self.leaf_of: dict[str, int] = {}
        self.ghosts = ghosts
        index: dict[str, int] = {}
        names = list(ir.nodes())
        if ghosts is not None:
            names += [name for name in ghosts.nodes() if name not in ir]
        for name in names:
            folded, replica = fold_name(name) if fold else (name, None)
            k = index.get(folded)
            if k is None:
                k = index[folded] = len(self.names)
                self.names.append(folded)
                self.members.append([name])
                self.replicas.append(set())
            else:
                self.members[k].append(name)
            if replica is not None:
                self.replicas[k].add(replica)
            self.leaf_of[name] = k
        self.ops = [self.data(m[0])["op"] for m in self.members]
        self.passes = [self.data(m[0])["created_by"] for m in self.members]
        self.replica_count = max((max(r) + 1 for r in self.replicas if r), default=0)
        self.inputs = self._inputs()

    def data(self, name: str) -> dict:
        """A member's node data (from the ghost graph for a ghost)."""
        found = self.ir.g._node.get(name)
        return found if found is not None else self.ghosts.g._node[name]

    def _inputs(self) -> list[list[tuple[int, int]]]:
        """Each leaf's inputs: its first member's in order (data by port, then control), then
        any leaf another member reads that the first does not (one C-level test per member)."""
        pred, leaf_of = self.ir.g._pred, self.leaf_of
        ghost_pred = self.ghosts.g._pred if self.ghosts is not None else {}
        out = []
        for members in self.members:
            found, known = {}, set()
            for k, member in enumerate(members):
                keyed_inputs = pred[member] if member in pred else ghost_pred[member]
                if k and known.issuperset(map(leaf_of.get, keyed_inputs)):
                    continue  # a replica's copy reading what the first member reads
                data = []
                for src, keyed in keyed_inputs.items():
                    leaf = leaf_of.get(src)
                    if leaf is None:
                        continue
                    for key, edge in keyed.items():
                        if key == CONTROL_KEY:
                            data.append((1 << 30, leaf, -1))
                        else:
                            data.append((key, leaf, edge["src_port"]))
                data.sort()
                for _, leaf, port in data:
                    found.setdefault((leaf, port), None)
                known = {leaf for leaf, _ in found}
            out.append(list(found))
        return out

    def __len__(self) -> int:
        return len(self.names)

    def devices(self, leaf: int) -> list[str]:
        return [self.data(m)["device"] for m in self.members[leaf]]


@dataclasses.dataclass
class ScopeTree:
    """Scopes, groups and leaves of a FoldedGraph; entry 0 is the root (the whole graph).
    Entries are numbered so that a parent comes before its children."""
    parent: list
    label: list
    kind: list
    path: list  # a scope's name with '/', a leaf's folded name, a group's prefix with '*'
    children: list
    leaf: list  # OP entries: their leaf index, else -1
    size: list  # leaves beneath
    fold_first: list
    entry_of_leaf: list

    def find(self, scope: str) -> int:
        """The entry for a user's ``--scope`` (a replica's name folds; '' is the root)."""
        if not scope:
            return 0
        folded = fold_name(scope.rstrip("/") + "/")[0]
        for k, path in enumerate(self.path):
            if path == folded:
                return k
        folded = folded.rstrip("/")
        for k, path in enumerate(self.path):
            if path == folded and self.kind[k] == OP:
                return k
        raise GraphxformError(f"no node under scope '{scope}'")

    def depth_below(self, entry: int, root: int) -> int:
        """Scope levels between ``root`` and ``entry`` (groups do not count)."""
        level, k = 0, self.parent[entry]
        while k != root and k >= 0:
            level += self.kind[k] == SCOPE
            k = self.parent[k]
        return level


def build_tree(folded: FoldedGraph, saver_scope: str | None = None) -> ScopeTree:
    """The scope tree of ``folded``'s leaves, with name-prefix groups under crowded scopes."""
    parts = _Parts()
    for k, name in enumerate(folded.names):
        pieces = name.split("/")
        parent = ""
        for depth in range(len(pieces) - 1):
            scope = parent + pieces[depth] + "/"
            if scope not in parts.kinds:
                parts.add(scope, SCOPE, pieces[depth] + "/", parent)
            parent = scope
        parts.add("\0" + name, OP, pieces[-1], parent, leaf=k)  # 'w' may also be a scope 'w/'
    for scope in [s for s, kind in parts.kinds.items() if kind == SCOPE]:
        if len(parts.children[scope]) > MAX_CHILDREN:
            parts.children[scope] = parts.grouped(scope, parts.children[scope], 1)
    return _numbered(parts, folded, saver_scope)


class _Parts:
    """The tree while it is built, keyed by path (scopes), '\0'+name (leaves) or a made-up
    key (groups)."""

    def __init__(self):
        self.children = collections.defaultdict(list)
        self.labels, self.kinds, self.leaves = {"": ""}, {"": SCOPE}, {"": -1}

    def add(self, key, kind, label, parent, leaf=-1):
        self.kinds[key], self.labels[key], self.leaves[key] = kind, label, leaf
        if parent is not None:
            self.children[parent].append(key)

    def grouped(self, scope: str, keys: list, tokens: int) -> list:
        """``keys`` with those that share their first ``tokens`` '_'-separated name tokens in
        groups (``conv4_block1_*``; a group still crowded splits on one more token); if that
        leaves too many, series of names that differ only in numbers (``block*_conv``)."""
        by_prefix = collections.OrderedDict()
        for key in keys:
            pieces = self.labels[key].rstrip("/").split("_")
            prefix = "_".join(pieces[:tokens]) if len(pieces) > tokens else ""
            by_prefix.setdefault(prefix or "\0" + key, []).append(key)
        only = next(iter(by_prefix))
        if len(by_prefix) == 1 and not only.startswith("\0") and tokens < 6:
            return self.grouped(scope, keys, tokens + 1)  # all share it: look further
        out = []
        for prefix, members in by_prefix.items():
            if len(members) == 1 or prefix.startswith("\0"):
                out.extend(members)
                continue
            group = self.group(scope, prefix + "_*", members)
            if len(members) > MAX_CHILDREN:
                self.children[group] = self.grouped(group, members, tokens + 1)
            out.append(group)
        return self.series(scope, out) if len(out) > MAX_CHILDREN else out

    def series(self, scope: str, keys: list) -> list:
        by_pattern = collections.OrderedDict()
        for key in keys:
            label = self.labels[key].rstrip("/")
            pattern = _DIGITS.sub("*", label)
            grouped = self.kinds[key] != GROUP and pattern != label
            by_pattern.setdefault(pattern if grouped else "\0" + key, []).append(key)
        out = []
        for pattern, members in by_pattern.items():
            if len(members) == 1 or pattern.startswith("\0"):
                out.extend(members)
            else:
                out.append(self.group(scope, pattern, members))
        return out

    def group(self, scope: str, label: str, members: list) -> str:
        key = f"{scope}\0{label}"
        self.add(key, GROUP, label, None)
        self.children[key] = members
        return key


def _numbered(parts: _Parts, folded: FoldedGraph, saver_scope) -> ScopeTree:
    keys, parent, k = [""], [-1], 0
    while k < len(keys):  # breadth first
        for child in parts.children.get(keys[k], ()):
            keys.append(child)
            parent.append(k)
        k += 1
    n = len(keys)
    tree = ScopeTree(parent=parent, label=[parts.labels[key] for key in keys],
                     kind=[parts.kinds[key] for key in keys], path=[""] * n,
                     children=[[] for _ in range(n)], leaf=[parts.leaves[key] for key in keys],
                     size=[0] * n, fold_first=[False] * n, entry_of_leaf=[0] * len(folded))
    for k in range(1, n):
        p = parent[k]
        tree.children[p].append(k)
        kind, label = tree.kind[k], tree.label[k]
        real_parent = p
        while tree.kind[real_parent] == GROUP:
            real_parent = tree.parent[real_parent]
        base = tree.path[real_parent]
        tree.path[k] = base + label
        bare = _NUMBERED.sub("", label.rstrip("/"))
        tree.fold_first[k] = tree.fold_first[p] or (kind == SCOPE and (
            bare in FOLD_FIRST or (saver_scope is not None and tree.path[k] == saver_scope)))
        if kind == OP:
            tree.entry_of_leaf[tree.leaf[k]] = k
    served = [0] * n  # leaves beneath made by a pass whose nodes people look at last
    for k in range(n - 1, 0, -1):
        if tree.kind[k] == OP:
            tree.size[k] += 1
            served[k] += folded.passes[tree.leaf[k]] in FOLD_FIRST_PASSES
        tree.size[parent[k]] += tree.size[k]
        served[parent[k]] += served[k]
    for k in range(1, n):
        tree.fold_first[k] = tree.fold_first[k] or (
            tree.kind[k] != OP and served[k] == tree.size[k])
    return tree


def choose_open(tree: ScopeTree, root: int = 0, boxes: int = DEFAULT_BOXES,
                depth: int | None = None) -> set:
    """The scopes and groups to draw open. With ``depth``, every scope less than ``depth``
    levels below ``root`` (the groups inside an open scope open with it). Otherwise open
    whole levels while the picture keeps at most ``boxes`` boxes, then the largest scopes that
    still fit (one that does not stays closed; smaller ones may); Saver, gradient, optimizer
    and initializer scopes, and scopes only merge-fetches or drop-in-saver made, open last."""
    opened = {root}
    if depth is not None:
        stack = list(tree.children[root])
        while stack:
            k = stack.pop()
            if tree.kind[k] == OP:
                continue
            if tree.kind[k] == GROUP or tree.depth_below(k, root) < depth - 1:
                opened.add(k)
                stack.extend(tree.children[k])
        return opened
    # whole levels first (a balanced picture), then the largest scopes that still fit
    count = len(tree.children[root])
    level = [k for k in tree.children[root] if tree.kind[k] != OP and not tree.fold_first[k]]
    while level:
        grown = count + sum(len(tree.children[k]) - 1 for k in level)
        if grown > boxes:
            break
        opened.update(level)
        count = grown
        level = [c for k in level for c in tree.children[k]
                 if tree.kind[c] != OP and not tree.fold_first[c]]
    heap = [(tree.fold_first[k], -tree.size[k], k) for p in opened for k in tree.children[p]
            if tree.kind[k] != OP and k not in opened]
    heapq.heapify(heap)
    while heap:
        _, _, k = heapq.heappop(heap)
        grown = count - 1 + len(tree.children[k])
        if grown <= boxes:
            opened.add(k)
            count = grown
            for c in tree.children[k]:
                if tree.kind[c] != OP:
                    heapq.heappush(heap, (tree.fold_first[c], -tree.size[c], c))
    return opened


@dataclasses.dataclass
class Box:
    entry: int
    path: str
    label: str
    kind: str
    ops: int  # leaves inside (ops of one replica)
    replicas: int  # copies folded into it (0: none)
    op: str | None = None  # an OP box's op type


@dataclasses.dataclass
class Picture:
    """What to draw: boxes, each leaf's box (-1: not drawn), bundled edges
    {(src box, dst box): [tensors, control edges]}, and the hubs: boxes joined to so many
    others (the Saver, served names, the optimizer) that their edges would hide the rest;
    views draw them aside, their edges left out (TensorBoard's "extracted" nodes)."""
    folded: FoldedGraph
    tree: ScopeTree
    boxes: list
    box_of_leaf: list
    edges: dict
    hubs: dict = dataclasses.field(default_factory=dict)  # box -> boxes it is joined to

    def drawn_edges(self) -> dict:
        """The bundled edges between boxes that are not hubs."""
        return {pair: counts for pair, counts in self.edges.items()
                if pair[0] not in self.hubs and pair[1] not in self.hubs}

    def leaves_of(self) -> list[list[int]]:
        found = [[] for _ in self.boxes]
        for leaf, box in enumerate(self.box_of_leaf):
            if box >= 0:
                found[box].append(leaf)
        return found


def picture(folded: FoldedGraph, tree: ScopeTree, opened: set, root: int = 0) -> Picture:
    """The boxes of ``opened`` under ``root`` and the bundled edges between them."""
    n = len(tree.parent)
    box_entry = [-2] * n  # -2: outside root; -1: open; else the entry drawn for it
    box_entry[root] = -1
    for k in range(root + 1, n):
        above = box_entry[tree.parent[k]]
        if above == -2:
            continue
        if above == -1:
            box_entry[k] = -1 if k in opened and tree.kind[k] != OP else k
        else:
            box_entry[k] = above
    if root != 0 and tree.kind[root] == OP:
        box_entry[root] = root
    index, boxes = {}, []
    for k in range(n):
        if box_entry[k] == k:
            index[k] = len(boxes)
            boxes.append(_box(folded, tree, k))
    box_of_leaf = [index.get(box_entry[tree.entry_of_leaf[leaf]], -1)
                   for leaf in range(len(folded))]
    edges = {}
    for leaf, inputs in enumerate(folded.inputs):
        dst = box_of_leaf[leaf]
        if dst < 0:
            continue
        for src_leaf, port in inputs:
            src = box_of_leaf[src_leaf]
            if src < 0 or src == dst:
                continue
            counts = edges.get((src, dst))
            if counts is None:
                counts = edges[(src, dst)] = [0, 0]
            counts[port < 0] += 1
    return Picture(folded, tree, boxes, box_of_leaf, edges, hubs(len(boxes), edges))


def hubs(count: int, edges: dict) -> dict:
    """Boxes with more than HUB_DEGREE neighbours: box -> neighbours."""
    neighbours = collections.Counter()
    for src, dst in edges:
        neighbours[src] += 1
        neighbours[dst] += 1
    return {box: n for box, n in neighbours.items() if n > HUB_DEGREE}


def _box(folded: FoldedGraph, tree: ScopeTree, k: int) -> Box:
    kind = tree.kind[k]
    replicas = 0
    if FOLDED_REPLICA in tree.path[k]:
        replicas = folded.replica_count
        if kind == OP:
            replicas = len(folded.replicas[tree.leaf[k]])
    return Box(entry=k, path=tree.path[k], label=tree.label[k], kind=kind, ops=tree.size[k],
               replicas=replicas, op=folded.ops[tree.leaf[k]] if kind == OP else None)


def collapsed(ir: GraphIR, boxes: int = DEFAULT_BOXES, depth: int | None = None,
              scope: str = "", fold: bool = True) -> Picture:
    """The default picture of ``ir``: replicas folded, scopes collapsed to ``boxes`` boxes
    (or opened to ``depth`` levels), under ``scope`` if given."""
    folded = FoldedGraph(ir, fold=fold)
    tree = build_tree(folded, saver_scope(ir))
    root = tree.find(scope)
    return picture(folded, tree, choose_open(tree, root, boxes, depth), root)


def saver_scope(ir: GraphIR) -> str | None:
    """The Saver's name scope ('save/') from the MetaGraph's saver_def, if it has one."""
    if ir.kind != "meta" or not ir.meta.HasField("saver_def"):
        return None
    tensor = ir.meta.saver_def.filename_tensor_name
    return tensor.rsplit("/", 1)[0] + "/" if "/" in tensor else None


COLOR_BY = ("device", "replica", "pass")


def leaf_keys(folded: FoldedGraph, color_by: str) -> list[str]:
    """What colours each leaf: its device(s), which replicas hold it, or the pass that made it."""
    if color_by == "device":
        return [device_pattern(folded.devices(k)) for k in range(len(folded))]
    if color_by == "replica":
        every = set(range(folded.replica_count))
        return ["shared (one copy)" if not r else "every replica" if r == every else
                "replica " + ",".join(map(str, sorted(r))) for r in folded.replicas]
    if color_by == "pass":
        return [p or "(input graph)" for p in folded.passes]
    raise GraphxformError(f"--color-by must be one of {', '.join(COLOR_BY)}, not '{color_by}'")


def device_pattern(devices: list[str]) -> str:
    """One device, or the pattern of several that differ only in numbers
    ('/device:CPU:0', '/device:CPU:1' -> '/device:CPU:*')."""
    distinct = sorted(set(devices))
    if len(distinct) == 1:
        return distinct[0] or "(no device)"
    shapes = {_DIGITS.sub("#", d) for d in distinct}
    if len(shapes) != 1:
        return "(several devices)"
    numbers = [_DIGITS.findall(d) for d in distinct]
    pieces = _DIGITS.split(distinct[0])
    out = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        values = {n[i] for n in numbers}
        out += (values.pop() if len(values) == 1 else "*") + piece
    return out


def box_keys(pic: Picture, keys: list[str]) -> list[tuple[str, collections.Counter]]:
    """Per box: the key most of its leaves have, and the count of each key."""
    counts = [collections.Counter() for _ in pic.boxes]
    for leaf, box in enumerate(pic.box_of_leaf):
        if box >= 0:
            counts[box][keys[leaf]] += 1
    return [(c.most_common(1)[0][0] if c else "", c) for c in counts]
