"""GraphIR: a TF graph as a networkx.MultiDiGraph, plus the rest of its MetaGraph.

Node key = node name. Node data: ``op``, ``device``, ``attr`` (the NodeDef's AttrValue map, kept
as protos), ``origin`` (name in the loaded graph, None for created nodes) and ``created_by`` (the
pass that made it, None for loaded nodes). A data edge carries ``src_port``/``dst_port``; a control
edge carries ``control=True``. Passes change the graph only through the methods below. Edge
attribute dicts are never changed in place (rewiring replaces edges), so copies share them.

Each node keeps a NodeDef (its attrs and rare fields). Its ``input`` list stays valid, so emitting
the node is serializing it, until a method changes the node's in-edges: that marks the node dirty
and emit rebuilds its inputs from the edges. A copy made by ``copy_nodes``/``copy_nodes_many``
borrows a frozen snapshot of its original's NodeDef (see ``BorrowedNode``) until something asks
for its ``attr`` or its NodeDef, so a node copied once per replica is never copied as a proto: emit
writes the copies of one prefix that nothing changed as one block of bytes (graphxform/wire.py),
which is why a copy tells its ``Replica`` when it changes. The same methods record which nodes
changed since the last structural check, so the pipeline's verify only looks at those.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import operator
from typing import Callable, Iterable, Iterator

import networkx as nx

from graphxform.errors import GraphxformError

CONTROL_KEY = -1  # edge key of a control edge; data edges are keyed by their dst_port
SHAPE_ONLY_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # read a tensor's shape only
_RUN = 16  # a node with this many neighbours has its control-only ones left out by identity


class FrozenDict(dict):
    """An edge attr dict or key dict (``_succ[u][v]``, which is also ``_pred[v][u]``). Equal ones
    are shared between edges and node pairs (every control-only pair has the same key dict, and
    copies share their originals'), so none is ever changed in place: GraphIR replaces a pair's
    key dict to add or remove an edge, and networkx's own edge mutators fail loudly here."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("graphxform shares edge dicts between edges; change edges through "
                        "GraphIR's methods, not networkx's")

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _refuse

    def __reduce__(self):
        return type(self), (dict(self),)


CONTROL_EDGE = FrozenDict(control=True)
CONTROL_KEYS = FrozenDict({CONTROL_KEY: CONTROL_EDGE})  # key dict of a control-only pair
_DATA_KEYS = {}  # (dst_port, src_port) -> key dict of a pair joined by that one data edge
# the id of each key dict of _DATA_KEYS -> its (dst_port, src_port): most data edges share one,
# so a reader gets an edge's ports with one lookup (they live as long as the module, and so
# keep their ids)
SINGLE_EDGE_PORTS = {}


# What GraphIR.take_changes returns: the nodes to check, and the edges that could close a
# cycle (the nodes that gained an in-edge, the sources of those edges).
Changes = collections.namedtuple("Changes", "nodes linked_to linked_from")


def data_keys(dst_port: int, src_port: int) -> FrozenDict:
    """The shared key dict of a node pair joined by one data edge src:src_port -> dst_port."""
    keys = _DATA_KEYS.get((dst_port, src_port))
    if keys is None:
        edge = FrozenDict(src_port=src_port, dst_port=dst_port)
        keys = _DATA_KEYS[(dst_port, src_port)] = FrozenDict({dst_port: edge})
        SINGLE_EDGE_PORTS[id(keys)] = (dst_port, src_port)
    return keys


def join_edge(succ: dict, pred: dict, src: str, dst: str, key: int, edge: dict) -> None:
    """Add one edge straight into networkx's adjacency dicts (networkx's add_edge costs several
    times this), replacing the pair's key dict rather than changing it."""
    keys = pred[dst].get(src)
    if keys is None:
        if key == CONTROL_KEY:
            keys = CONTROL_KEYS
        elif set(edge) == {"src_port", "dst_port"}:
            keys = data_keys(key, edge["src_port"])
        else:
            keys = FrozenDict({key: _frozen(edge)})
    else:
        keys = FrozenDict({**keys, key: _frozen(edge)})
    succ[src][dst] = pred[dst][src] = keys


def _frozen(edge: dict) -> FrozenDict:
    return edge if isinstance(edge, FrozenDict) else FrozenDict(edge)


def split_edge(succ: dict, pred: dict, src: str, dst: str, key: int) -> None:
    """Remove one edge (it must exist), replacing the pair's key dict rather than changing it."""
    rest = {k: edge for k, edge in pred[dst][src].items() if k != key}
    if rest:
        succ[src][dst] = pred[dst][src] = FrozenDict(rest)
    else:
        del succ[src][dst]
        del pred[dst][src]


def parse_tensor(name: str) -> tuple[str, int]:
    """'a:1' -> ('a', 1); 'a' -> ('a', 0). Control inputs ('^a') are not tensors."""
    node, sep, port = name.rpartition(":")
    if sep and port.isdigit():
        return node, int(port)
    return name, 0


def tensor_name(node: str, port: int = 0) -> str:
    return f"{node}:{port}"


def _input_string(node: str, port: int) -> str:
    return node if port == 0 else f"{node}:{port}"


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic garbage collector. Building or copying a graph allocates many dicts that
    all stay alive; meanwhile the collector would walk them again and again, a large share of
    the run. Afterwards they move straight to the oldest generation (freeze + unfreeze moves
    lists, it walks nothing) instead of being walked by the next young collection; garbage
    made meanwhile is still collected, by a later full collection."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # leave anyone else's frozen objects alone
            gc.freeze()
            gc.unfreeze()
        gc.enable()


class BorrowedNode(dict):
    """Node data of a copy that still borrows its original's NodeDef: a frozen snapshot, taken
    when the copy was made and shared by every copy of that original, which nothing ever
    changes. The copy's own NodeDef (snapshot + its name, device, renamed inputs and colocation)
    is made only when first needed: on the first ``data["attr"]`` (copy-on-write: the map handed
    out is the copy's own, so mutating it never reaches the original or another copy), on
    ``GraphIR.proto(name)``. Emit never needs it (it writes the copy's bytes from its replica's
    block, graphxform/wire.py), and reading ``op``, ``device`` and the rest, or attrs through
    ``GraphIR.attrs``, costs nothing extra."""

    __slots__ = ("_plan", "_replica", "_proto")

    def __missing__(self, key):
        if key != "attr":
            raise KeyError(key)
        return self.materialise().attr

    def get(self, key, default=None):
        if key == "attr":
            return self["attr"]
        return dict.get(self, key, default)

    def __contains__(self, key) -> bool:
        return key == "attr" or dict.__contains__(self, key)

    def copy(self) -> dict:
        return {**self, "attr": self["attr"]}

    def __reduce__(self):
        return dict, (self.copy(),)

    # Every way of changing node data in place tells the replica first: emit writes the copies
    # that nothing changed from one block of bytes, and the rest one by one.
    def _touched(self) -> None:
        self._replica.touched.add(self._plan[0])

    def __setitem__(self, key, value):
        self._touched()
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._touched()
        dict.__delitem__(self, key)

    def update(self, *args, **kwargs):
        self._touched()
        dict.update(self, *args, **kwargs)

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        self._touched()
        return dict.setdefault(self, key, default)

    def pop(self, key, *default):
        self._touched()
        return dict.pop(self, key, *default)

    def popitem(self):
        self._touched()
        return dict.popitem(self)

    def clear(self):
        self._touched()
        dict.clear(self)

    def materialise(self):
        """This copy's own NodeDef (made once)."""
        proto = self._proto
        if proto is None:
            self._touched()
            proto = self._proto = self.fill(self._plan[1].__class__())
            dict.__setitem__(self, "attr", proto.attr)
        return proto

    def fill(self, out):
        """Write this copy's NodeDef into the empty NodeDef ``out``."""
        replica = self._replica
        return copy_node_def(out, self._plan, replica.prefix, dict.__getitem__(self, "device"),
                             replica.mapping)


def copy_node_def(out, plan: tuple, prefix: str, device: str, copied):
    """Write into the empty NodeDef ``out`` the NodeDef of the copy of ``plan``'s original
    named ``prefix + name`` (see ``_copy_plan``): the snapshot (which lacks what every
    copy rewrites: a clean node's inputs, a ``_class`` naming copied nodes) plus the copy's
    name, device, inputs and colocation, where inputs and colocation targets in ``copied``
    (the originals copied with it) get the prefix too."""
    name, snapshot, texts, colocation, inputs_copied = plan
    out.CopyFrom(snapshot)
    out.name = prefix + name
    out.device = device
    if texts:
        out.input.extend(renamed_inputs(texts, inputs_copied, copied, prefix))
    if colocation:
        out.attr["_class"].list.s.extend(colocation_items(colocation, prefix))
    return out


def colocation_items(colocation: list, prefix: str) -> list[bytes]:
    """A copy's ``_class`` items from its plan's colocation items (see ``_copy_plan``): kept
    as they are, or pointing at the copy named ``prefix`` of a copied node."""
    loc = b"loc:@" + prefix.encode()
    return [item if node is None else loc + node for item, node in colocation]


class Replica:
    """The copies one prefix of a ``copy_nodes_many`` call made, in order, and what they borrow:
    emit writes the copies that nothing changed since as one block (graphxform/wire.py)."""

    __slots__ = ("mapping", "prefix", "device", "plans", "bases", "names", "copies", "touched",
                 "outside", "unchecked")

    def __init__(self, mapping: dict, names: list, prefix: str, device, plans: list,
                 bases: list, outside: list = (), unchecked: list = ()):
        self.mapping = mapping  # original -> copy name (of replica 0's copy for first_only ones)
        self.names = names  # per original: its copy's name, made or not
        self.prefix = prefix
        self.device = device  # every copy's device; None: the original's, or per copy
        self.plans = plans  # per original (see _copy_plan), most shared by every prefix
        self.bases = bases  # per original: the node data each copy started from
        self.copies = []  # per original: its copy's node data, None where not made
        # originals whose copy changed in place (node data, its own NodeDef) or went away;
        # copies whose in-edges changed are in GraphIR._dirty instead
        self.touched = set()
        self.outside = outside  # the nodes outside the copied set that copies read, as made
        self.unchecked = unchecked  # the originals no structural check had seen, by index

    def planned_otherwise(self, first: "Replica") -> list[int]:
        """The indices at which this replica has a plan of its own rather than ``first``'s,
        a replica of the same call (the copies that read ``first``'s first_only copies)."""
        if self.plans is first.plans:
            return []
        return [k for k, (mine, theirs) in enumerate(zip(self.plans, first.plans))
                if mine is not theirs]


class _CopyShape:
    """What every copy of a set of originals takes from them, read once for all prefixes:
    per original its plan (see ``_copy_plan``), the node data to start from, its inputs with
    their key dicts (its pred dict in ``srcs``, which copying leaves alone; by index in
    ``ins``), its consumers that are copied too with theirs (by index, ``outs``); the inputs
    from outside the set (which gain a consumer per copy); which copies start dirty."""

    def __init__(self, ir: "GraphIR", names: list, copied: set, created_by: str | None,
                 take_over: bool = False):
        node_table, pred, succ, dirty = ir.g._node, ir.g._pred, ir.g._succ, ir._dirty
        # what can be read for all originals at once is, at C speed (most of the originals
        # of a training step are alike: all their inputs and consumers are copied too)
        datas = list(map(node_table.__getitem__, names))
        srcs, users = list(map(pred.__getitem__, names)), list(map(succ.__getitem__, names))
        self.bases = [{"op": data["op"], "device": data["device"], "origin": data["origin"],
                       "created_by": created_by or data["created_by"]} for data in datas]
        self.srcs = srcs
        inside = list(map(copied.issuperset, srcs))
        # neighbours by index: an original's position in ``names``, an input from outside
        # the set's in ``extra`` after them (a replica renames them all with one list)
        position = dict(zip(names, range(len(names))))
        self.outside, self.extra = [], []
        for k in itertools.compress(range(len(names)), map(operator.not_, inside)):
            for src, keys in srcs[k].items():
                if src not in copied:
                    self.outside.append((src, keys, k))
                    if src not in position:
                        position[src] = len(names) + len(self.extra)
                        self.extra.append(src)
        at = position.__getitem__
        self.ins = list(zip(map(list, map(map, itertools.repeat(at), srcs)),
                            map(list, map(dict.values, srcs))))
        self.outs = [(list(map(at, dsts)), list(dsts.values())) if dsts.keys() <= copied else
                     ([at(d) for d in dsts if d in copied],  # others keep reading the original
                      [keys for d, keys in dsts.items() if d in copied])
                     for dsts in users]
        self.dirty = [name for name in names if name in dirty]
        protos = map(ir._protos.get, names)
        self.plans = [_copy_plan(proto or data.materialise(), name, copied, name in dirty,
                                 whole, take_over)
                      for proto, data, name, whole in zip(protos, datas, names, inside)]
        if take_over:  # their NodeDefs no longer hold their inputs
            dirty.update(names)
        self.names, self.skip, self._made_edges, self._skipped = names, frozenset(), None, []

    def skipped(self) -> list[int]:
        """The indices of the originals in ``skip``."""
        if self._skipped is None:
            self._skipped = [k for k, name in enumerate(self.names) if name in self.skip]
        return self._skipped

    def made_edges(self) -> tuple[list, list]:
        """``ins`` and ``outs`` of the originals whose copies are made (not in ``skip``)."""
        if not self.skip:
            return self.ins, self.outs
        if self._made_edges is None:
            made = [name not in self.skip for name in self.names]
            self._made_edges = (list(itertools.compress(self.ins, made)),
                                list(itertools.compress(self.outs, made)))
        return self._made_edges

    def without(self, first_only: set, first_prefix: str) -> "_CopyShape":
        """The shape of the copies that leave out ``first_only`` and read the copies named
        ``first_prefix`` of it instead: those inputs are from outside now (the plans of the
        copies reading them name those copies outright), and consumers in it are not theirs."""
        other = _CopyShape.__new__(_CopyShape)
        other.__dict__.update(vars(self))
        other.skip, other._skipped = frozenset(first_only), None
        other.plans = list(self.plans)
        other.outside = [(src, keys, k) for src, keys, k in self.outside
                         if self.names[k] not in first_only]
        other.dirty = [name for name in self.dirty if name not in first_only]
        for k, (name, srcs) in enumerate(zip(self.names, self.srcs)):
            if name not in first_only and not first_only.isdisjoint(srcs):
                other.outside += [(src, keyed, k) for src, keyed in srcs.items()
                                  if src in first_only]
                original, snapshot, texts, colocation, _ = self.plans[k]
                if texts is not None:
                    texts = [_renamed_input(text, first_only, first_prefix) for text in texts]
                other.plans[k] = (original, snapshot, texts, colocation, False)
        gone = {k for k, name in enumerate(self.names) if name in first_only}
        other.outs = [(dsts, keys) if gone.isdisjoint(dsts) else
                      ([d for d in dsts if d not in gone],
                       [keyed for d, keyed in zip(dsts, keys) if d not in gone])
                      for dsts, keys in self.outs]
        return other


class GraphIR:
    """One graph plus the MetaGraph fields that travel with it.

    ``meta`` is the MetaGraphDef with ``graph_def.node`` emptied (versions, function library,
    collections, saver_def, signatures stay in it); ``kind`` is "meta" or "graph" (bare GraphDef).
    """

    def __init__(self, meta, kind: str = "meta", source: str | None = None):
        self.g = nx.MultiDiGraph()
        self.meta = meta
        self.kind = kind
        self.source = source
        # name -> NodeDef: attrs, rare fields, inputs (valid unless dirty); copies that borrow
        # their original's NodeDef are not in it (their node data is a BorrowedNode)
        self._protos = {}
        self._dirty = set()  # nodes whose NodeDef input list no longer matches their in-edges
        self._unverified = set()  # nodes added or rewired since the last take_unverified()
        self._rewired = set()  # of those, the ones that gained an in-edge once they existed
        self._rewired_from = set()  # the sources of those in-edges
        self._taken = False  # whether take_changes ran: before, every node is new to it
        self._unverified_copies = []  # Replicas made since then: all their copies are new
        self._replicas = []  # every Replica made, in order (see replicas())
        self._emit_cache = {}  # what emit keeps of the Replicas' blocks (graphxform/wire.py)
        self._by_op = None  # op -> its nodes in graph order, within indexed_by_op()

    # ---------------------------------------------------------------- reading
    def __contains__(self, name: str) -> bool:
        return name in self.g

    def __len__(self) -> int:
        return len(self.g)

    def has_scope(self, prefix: str) -> bool:
        """Whether any node name starts with ``prefix`` (one C-level sweep over the names)."""
        return any(map(str.startswith, self.g._node, itertools.repeat(prefix)))

    def nodes(self) -> Iterator[str]:
        return iter(self.g)

    def node_items(self) -> Iterable[tuple[str, dict]]:
        """(name, node data) of every node, in graph order."""
        return self.g._node.items()

    def node(self, name: str) -> dict:
        try:
            return self.g._node[name]
        except KeyError:
            raise GraphxformError(f"no node named '{name}' in the graph") from None

    def op(self, name: str) -> str:
        return self.g._node[name]["op"]

    def op_types(self) -> set[str]:
        """The ops of the graph's nodes."""
        if self._by_op is not None:
            return set(self._by_op)
        return {data["op"] for data in self.g._node.values()}

    def nodes_of(self, ops) -> list[str]:
        """The nodes whose op is one of ``ops``, in graph order (from the index while an
        ``indexed_by_op`` block holds one)."""
        if self._by_op is None:
            return [name for name, data in self.g._node.items() if data["op"] in ops]
        lists = [self._by_op[op] for op in set(ops) if op in self._by_op]
        if len(lists) <= 1:
            return list(lists[0]) if lists else []
        found = set().union(*lists)
        return [name for name in self.g._node if name in found]

    @contextlib.contextmanager
    def indexed_by_op(self):
        """A block of reading (the checks after the passes, each asking ``nodes_of`` for
        other ops) in which ``nodes_of`` reads an index of every node by op, built once,
        instead of sweeping the graph per call. Adding or removing a node drops the index;
        nothing in the block may change a node's op. Blocks nest (the inner one uses the
        outer's index)."""
        if self._by_op is not None:
            yield self
            return
        by_op = {}
        for name, data in self.g._node.items():
            found = by_op.get(data["op"])
            if found is None:
                by_op[data["op"]] = [name]
            else:
                found.append(name)
        self._by_op = by_op
        try:
            yield self
        finally:
            self._by_op = None

    def attrs(self, name: str):
        """The node's attr map, for reading only. A copy that still borrows its original's
        NodeDef answers from the shared snapshot (which may lack the copy's ``_class``), so
        reading attrs, as verify does for every output count, never makes it its own NodeDef."""
        data = self.g._node[name]
        if type(data) is BorrowedNode and data._proto is None:
            return data._plan[1].attr
        return data["attr"]

    def inputs(self, name: str) -> list[tuple[str, int]]:
        """Data inputs as (src, src_port), in dst_port order."""
        found = []
        for src, edges in self.g._pred[name].items():
            if edges is CONTROL_KEYS:
                continue
            ports = SINGLE_EDGE_PORTS.get(id(edges))
            if ports is not None:  # the usual one data edge between the two
                found.append((ports[0], src, ports[1]))
                continue
            for key, data in edges.items():
                if key != CONTROL_KEY:
                    found.append((key, src, data["src_port"]))
        if len(found) > 1:
            found.sort()
        return [(src, port) for _, src, port in found]

    def input(self, name: str, dst_port: int) -> tuple[str, int]:
        for src, edges in self.g._pred[name].items():
            data = edges.get(dst_port)
            if data is not None:
                return src, data["src_port"]
        raise GraphxformError(f"node '{name}' has no input {dst_port}")

    def control_inputs(self, name: str) -> list[str]:
        return [src for src, edges in self.g._pred[name].items() if CONTROL_KEY in edges]

    def consumers(self, name: str, port: int | None = None) -> list[tuple[str, int]]:
        """Data consumers of node ``name`` (of its output ``port`` if given) as (dst, dst_port)."""
        found = []
        succ = self.g._succ[name]
        for dst, edges in data_pairs(succ):
            for key, data in edges.items():
                if key != CONTROL_KEY and (port is None or data["src_port"] == port):
                    found.append((dst, key))
        return found

    def control_consumers(self, name: str) -> list[str]:
        return [dst for dst, edges in self.g._succ[name].items() if CONTROL_KEY in edges]

    def successors(self, name: str) -> Iterable[str]:
        return self.g._succ[name].keys()

    def predecessors(self, name: str) -> Iterable[str]:
        return self.g._pred[name].keys()

    def data_descendants(self, sources) -> set[str]:
        """``sources`` and every node that reads, through data edges, something they compute
        (what merely waits on them is left out)."""
        succ, seen, stack = self.g._succ, set(sources), list(sources)
        while stack:
            for dst, keys in data_pairs(succ[stack.pop()]):
                if dst not in seen and (len(keys) > 1 or CONTROL_KEY not in keys):
                    seen.add(dst)
                    stack.append(dst)
        return seen

    def descendants(self, sources) -> set[str]:
        """``sources`` and every node that runs after one of them, through data and control
        edges."""
        return _reached(self.g._succ, sources)

    def ancestors(self, name: str) -> set[str]:
        """``name`` and every node it depends on, through data and control inputs (what
        networkx.ancestors finds, plus ``name``, without its generic BFS)."""
        return _reached(self.g._pred, [name])

    def ancestors_of(self, sinks) -> set[str]:
        """``sinks`` and every node one of them depends on (one sweep for all)."""
        return _reached(self.g._pred, sinks)

    def value_sources(self, name: str, stop_at=frozenset(), stop=None) -> set[str]:
        """``name`` and every node its value depends on: through data inputs, not control
        inputs, and not through ops that read only a tensor's shape (a count of examples is
        the same on equal slices; a Shape of a variable does not read it), nor through ops in
        ``stop_at`` or nodes for which ``stop(name)`` holds."""
        seen, stack = {name}, [name]
        while stack:
            node = stack.pop()
            if self.op(node) in SHAPE_ONLY_OPS or self.op(node) in stop_at or \
                    (stop is not None and stop(node)):
                continue
            for src, _ in self.inputs(node):
                if src not in seen:
                    seen.add(src)
                    stack.append(src)
        return seen

    def proto(self, name: str):
        """The NodeDef that holds this node's attrs. Its name is the node's; its op and device
        may lag the node data, and its input list is stale while the node is dirty. (A copy that
        still borrows its original's NodeDef gets its own here.)"""
        proto = self._protos.get(name)
        if proto is None:
            return self.g._node[name].materialise()
        return proto

    def is_dirty(self, name: str) -> bool:
        """Whether ``name``'s in-edges changed since its NodeDef input list was written; emit
        then rebuilds the list from the edges instead of copying it."""
        return name in self._dirty

    def edge_inputs(self, name: str) -> list[str]:
        """``name``'s TF input list built from its edges: data inputs in dst_port order, then
        control inputs. A clean node's NodeDef holds the same list."""
        data, controls = [], []
        for src, keyed in self.g._pred[name].items():
            for key, edge in keyed.items():
                if key == CONTROL_KEY:
                    controls.append("^" + src)
                else:
                    port = edge["src_port"]
                    plain = port == 0 and "spelled_port" not in edge
                    data.append((key, src if plain else f"{src}:{port}"))
        data.sort()
        return [text for _, text in data] + controls

    def take_unverified(self) -> set[str]:
        """Nodes added or rewired since the last call (every node of a freshly built IR) and
        the copies an incremental structural check must look at (see ``take_changes``); the
        record starts empty again. Removed nodes drop out."""
        return self.take_changes().nodes

    def take_changes(self) -> "Changes":
        """What an incremental structural check must look at since the last call (the record
        starts empty again; removed nodes drop out): the nodes to check (added, rewired,
        copies: see below), and the edges that could close a cycle, as the nodes that gained
        an in-edge once they existed and those edges' sources (every node, the first time).
        The graph had no cycle, and a cycle through new nodes or copies needs an edge into an
        older node, which rewiring made; removing edges closes none.

        A copy is well formed when its original was: it reads copies of the original's inputs
        (the same ops and attrs, so the same outputs) or the same nodes. So of the copies one
        ``copy_nodes_many`` call made, those of its first prefix whose originals no check had
        seen yet are listed (the other prefixes' copies mirror them), and those that changed
        in place since. (A copy whose in-edges changed is listed as rewired.)"""
        changed, self._unverified = self._unverified, set()
        rewired, self._rewired = (self._rewired if self._taken else changed), set()
        sources, self._rewired_from = (self._rewired_from if self._taken else changed), set()
        self._taken = True
        node_table, copies, firsts = self.g._node, set(changed), {}
        for replica in self._unverified_copies:
            first = firsts.setdefault(id(replica.bases), replica)
            picked = ([(replica.names[k], replica.copies[k]) for k in replica.unchecked]
                      if first is replica else [])
            for name in map(replica.mapping.__getitem__, replica.touched):
                data = node_table.get(name)
                if type(data) is BorrowedNode and data._replica is replica:
                    picked.append((name, data))
            copies.update(name for name, copy in picked
                          if copy is not None and node_table.get(name) is copy)
        self._unverified_copies = []
        linked_to = rewired & node_table.keys()
        # the first time, every node gained its edges: the same set twice
        linked_from = linked_to if sources is rewired else sources & node_table.keys()
        return Changes(copies, linked_to, linked_from)

    def replicas(self) -> list:
        """Every ``Replica`` made so far, in order: what the copies borrow and which of them
        changed since (emit and the TF import check read them; passes never need to)."""
        return self._replicas

    def _touch(self, name: str, linked_from: str | None = None) -> None:
        """``name``'s in-edges changed: its NodeDef inputs are stale and it needs verifying;
        ``linked_from``: the source of an edge it gained (which could close a cycle)."""
        self._dirty.add(name)
        self._unverified.add(name)
        if linked_from is not None:
            self._rewired.add(name)
            self._rewired_from.add(linked_from)

    # --------------------------------------------------------------- mutation
    def add_node(self, name: str, op: str, inputs: Iterable[str] = (), *, device: str = "",
                 attr: dict | None = None, created_by: str | None = None,
                 origin: str | None = None) -> str:
        """Add a node; ``inputs`` are TF input strings ('a', 'a:1', '^a'); ``attr`` maps names to
        AttrValue protos (copied). Returns the name."""
        from tensorflow.core.framework import node_def_pb2
        proto = node_def_pb2.NodeDef(name=name, op=op, device=device)
        if attr:
            for key, value in attr.items():
                proto.attr[key].CopyFrom(value)
        self._insert(name, proto, device, inputs, origin, created_by)
        return name

    def add_nodes(self, template, rows: Iterable[tuple], *,
                  created_by: str | None = None) -> list[str]:
        """``add_node`` for nodes that differ only in name, inputs and device, as a pass adds
        them by the thousand (per variable per replica; merge-fetches one per name of the
        input): each a copy of the NodeDef ``template`` (op and attrs) with its (name, inputs,
        device) from ``rows``, added in order (a row may read an earlier row's node). Returns
        the names.

        The same as calling ``add_node`` per row, with what ``_insert`` does per node done
        inline and what it records (NodeDefs, unverified names) recorded once for all."""
        node_table, succ, pred = self.g._node, self.g._succ, self.g._pred
        new_proto, op, names, protos = type(template), template.op, [], []
        self._by_op = None
        try:
            for name, inputs, device in rows:
                if name in node_table:
                    raise GraphxformError(f"node '{name}' already exists")
                proto = new_proto()
                proto.CopyFrom(template)
                proto.name = name
                if device:
                    proto.device = device
                node_table[name] = {"op": op, "device": device, "attr": proto.attr,
                                    "origin": None, "created_by": created_by}
                succ[name] = {}
                names.append(name)
                protos.append(proto)
                if not inputs:
                    pred[name] = {}
                    continue
                written = _link_new(name, inputs, node_table, succ, pred)
                if written is None:
                    self._dirty.add(name)  # its inputs are written out from the edges on emit
                else:
                    proto.input.extend(written)
        finally:  # also for the nodes added before a row failed, as add_node would have
            self._protos.update(zip(names, protos))
            self._unverified.update(names)
        return names

    def _insert(self, name: str, proto, device: str, inputs: Iterable[str],
                origin: str | None, created_by: str | None) -> None:
        """A new node ``name`` whose NodeDef ``proto`` holds its name, op, device and attrs;
        its inputs are linked and, unless that takes the edges, written into the NodeDef."""
        node_table = self.g._node
        if name in node_table:
            raise GraphxformError(f"node '{name}' already exists")
        self._by_op = None
        self._protos[name] = proto
        node_table[name] = {"op": proto.op, "device": device, "attr": proto.attr,
                            "origin": origin, "created_by": created_by}
        self.g._succ[name], self.g._pred[name] = {}, {}
        self._unverified.add(name)
        written = _link_new(name, inputs, node_table, self.g._succ, self.g._pred) \
            if inputs else []
        if written is None:
            self._dirty.add(name)  # its inputs are written out from the edges on emit
        elif written:
            proto.input.extend(written)

    def _add_edge(self, src: str, dst: str, key: int, edge: dict) -> None:
        """One edge; the caller has checked that ``src`` exists and marks ``dst`` touched."""
        join_edge(self.g._succ, self.g._pred, src, dst, key, edge)

    def _remove_edge(self, src: str, dst: str, key: int) -> None:
        split_edge(self.g._succ, self.g._pred, src, dst, key)

    def _require(self, src: str, dst: str) -> None:
        if src not in self.g:
            raise GraphxformError(f"node '{dst}' has input '{src}', which is not in the graph")

    def remove_node(self, name: str, safe: bool = True) -> None:
        """Remove a node; with ``safe`` refuse while anything still consumes it."""
        users = self.g._succ[name]
        if safe and users:
            first = ", ".join(sorted(users)[:3])
            raise GraphxformError(f"cannot remove '{name}': still used by {first}")
        for dst in users:
            self._touch(dst)
        data = self.g._node[name]
        self.g.remove_node(name)
        self._forget(name, data)

    def remove_nodes(self, names: Iterable[str], safe: bool = True) -> None:
        """Remove a set of nodes at once; with ``safe`` refuse while a node outside the set
        still consumes one of them."""
        order = list(dict.fromkeys(names))  # in the caller's order: graph order, for replicate
        names = set(order)
        node_table, succ, pred, protos = self.g._node, self.g._succ, self.g._pred, self._protos
        users = list(map(succ.__getitem__, order))
        leaving = _indices_not(map(names.issuperset, users))
        if safe and leaving:
            name = order[leaving[0]]
            outside = next(dst for dst in users[leaving[0]] if dst not in names)
            raise GraphxformError(f"cannot remove '{name}': still used by {outside}")
        # networkx's remove_nodes_from unlinks every edge from both ends; only the edges that
        # leave the set need unlinking at the far end (replicate removes whole training steps),
        # so the rest is a few sweeps over the names at C speed
        for k in leaving:
            for dst in users[k]:
                if dst not in names:
                    del pred[dst][order[k]]
                    self._touch(dst)
        sources = list(map(pred.pop, order))
        for k in _indices_not(map(names.issuperset, sources)):
            for src in sources[k]:
                if src not in names:
                    del succ[src][order[k]]
        collections.deque(map(succ.__delitem__, order), maxlen=0)
        removed = list(map(node_table.pop, order))
        self._by_op = None
        collections.deque(map(protos.pop, order, itertools.repeat(None)), maxlen=0)
        borrowed = map(operator.is_, map(type, removed), itertools.repeat(BorrowedNode))
        for data in itertools.compress(removed, borrowed):
            data._touched()
        self._dirty.difference_update(names)
        self._unverified.difference_update(names)
        self._rewired.difference_update(names)
        if hasattr(nx, "_clear_cache"):
            nx._clear_cache(self.g)

    def _forget(self, name: str, data: dict) -> None:
        """What the IR keeps beside the graph about the removed node ``name`` (its node data
        was ``data``) goes too."""
        self._by_op = None
        self._protos.pop(name, None)
        if type(data) is BorrowedNode:
            data._touched()
        self._dirty.discard(name)
        self._unverified.discard(name)
        self._rewired.discard(name)

    def remove_dead(self, roots: Iterable[str], keep: Callable[[str], bool]) -> int:
        """Remove ``roots`` and then their inputs, as long as nothing consumes them and
        ``keep(name)`` is False. Returns how many nodes went.

        A node goes when it has no consumers left, so only its in-edges need unlinking: done
        here, while the node is at hand, rather than by networkx's remove_node (which unlinks
        from both ends) or a later remove_nodes sweep (sync-init removes some 20k nodes)."""
        node_table, succ, pred = self.g._node, self.g._succ, self.g._pred
        stack, removed = list(roots), 0
        while stack:
            name = stack.pop()
            if name not in node_table or succ[name] or keep(name):
                continue
            inputs = pred.pop(name)
            for src in inputs:
                del succ[src][name]
            del succ[name]
            self._forget(name, node_table.pop(name))
            removed += 1
            stack.extend(inputs)
        if removed and hasattr(nx, "_clear_cache"):
            nx._clear_cache(self.g)
        return removed

    def set_input(self, dst: str, dst_port: int, tensor: str) -> None:
        """Point input ``dst_port`` of ``dst`` at ``tensor``."""
        src, _ = self.input(dst, dst_port)
        new_src, new_port = parse_tensor(tensor)
        self._require(new_src, dst)
        self._remove_edge(src, dst, dst_port)
        self._add_edge(new_src, dst, dst_port, data_keys(dst_port, new_port)[dst_port])
        self._touch(dst, new_src)

    def replace_all_uses_with(self, old: str, new: str,
                              where: Callable[[str], bool] | None = None) -> int:
        """Rewire consumers of ``old`` to ``new``; returns how many edges moved.

        Node names ('a' -> 'b') move every data consumer of each output port to the same port of
        ``new`` and every control consumer too. Tensor names ('a:1' -> 'b:0') move the data
        consumers of that one output. ``where(consumer)`` limits which consumers move.
        """
        whole_node = ":" not in old
        old_node, old_port = parse_tensor(old)
        new_node, new_port = parse_tensor(new)
        self._require(new_node, old_node)
        moves = []
        for dst, edges in self.g._succ[old_node].items():
            if where is not None and not where(dst):
                continue
            for key, data in edges.items():
                if key == CONTROL_KEY:
                    if whole_node:
                        moves.append((dst, key, None))
                elif whole_node:
                    moves.append((dst, key, data["src_port"]))
                elif data["src_port"] == old_port:
                    moves.append((dst, key, new_port))
        for dst, key, port in moves:
            self._remove_edge(old_node, dst, key)
            if key == CONTROL_KEY:
                self._add_edge(new_node, dst, CONTROL_KEY, CONTROL_EDGE)
            else:
                self._add_edge(new_node, dst, key, data_keys(key, port)[key])
            self._touch(dst, new_node)
        return len(moves)

    def add_control_input(self, node: str, src: str) -> None:
        self._require(src, node)
        self._add_edge(src, node, CONTROL_KEY, CONTROL_EDGE)
        self._touch(node, src)

    def remove_control_input(self, node: str, src: str) -> None:
        if self.g.has_edge(src, node, key=CONTROL_KEY):
            self._remove_edge(src, node, CONTROL_KEY)
            self._touch(node)

    def copy_nodes(self, names: Iterable[str], prefix: str, *, device=None,
                   created_by: str | None = None) -> dict[str, str]:
        """Copy ``names`` as ``prefix + name``; edges among copied nodes follow the copies, inputs
        from outside keep pointing at the originals. ``device`` is a string or a function of the
        original name. Colocation attrs (``_class: loc:@x``) follow copies too. Returns
        {original: copy}.

        A copy of a clean node gets its input list rewritten here, so it is clean too."""
        return self.copy_nodes_many(names, [prefix], devices=[device], created_by=created_by)[0]

    def copy_nodes_many(self, names: Iterable[str], prefixes: list[str], *, devices=None,
                        created_by: str | None = None, first_only: Iterable[str] = (),
                        originals_go: bool = False) -> list[dict[str, str]]:
        """``copy_nodes`` once per prefix (with ``devices[i]`` for ``prefixes[i]``), in that
        order, reading each original once: what every copy needs from it (input names,
        colocation targets, which inputs and consumers are copied too) is worked out first.

        Nodes in ``first_only`` (a subset of ``names`` that nothing outside it reads but
        other copied nodes, and that no copied node outside it colocates with) are copied for
        the first prefix only: the other prefixes' copies read the first prefix's copies of
        them, and their mappings name those.

        ``originals_go`` promises that the caller removes the originals next, changing nothing
        of theirs before: the copies then take the originals' NodeDefs as their snapshots
        instead of copying them."""
        names = list(names)
        first_only = set(first_only)
        devices = [None] * len(prefixes) if devices is None else list(devices)
        clash = self._copy_clash(names, prefixes)
        if clash is not None:
            raise GraphxformError(f"cannot copy to '{clash}': it already exists")
        mappings = []
        with paused_gc():
            unchecked = list(itertools.compress(range(len(names)),
                                                map(self._unverified.__contains__, names)))
            shape = _CopyShape(self, names, set(names), created_by, originals_go)
            for k, (prefix, device) in enumerate(zip(prefixes, devices)):
                if k == 1 and first_only:
                    shape = shape.without(first_only, prefixes[0])
                # each replica's names are made just before its copies: still in the cache
                # when the graph's tables hash them
                news = list(map(prefix.__add__, names))
                mapping = dict(zip(names, news))
                replica = Replica(mapping, news, prefix, device, shape.plans, shape.bases,
                                  shape.extra, unchecked)
                if k >= 1 and first_only:
                    mapping.update((name, mappings[0][name]) for name in first_only)
                mappings.append(mapping)
                self._copy_replica(shape, replica)
        if hasattr(nx, "_clear_cache"):
            nx._clear_cache(self.g)
        return mappings

    def _copy_clash(self, names: list, prefixes: list) -> str | None:
        """The first copy name that is taken already or that two copies would share. When no
        node name starts with a prefix and no prefix starts another, none can be: that is
        one sweep over the names instead of a lookup per copy."""
        starts = tuple(prefixes)
        if (len(set(names)) == len(names) and len(set(prefixes)) == len(prefixes)
                and not any(b.startswith(a) for a in prefixes for b in prefixes if a != b)
                and not any(map(str.startswith, self.g._node, itertools.repeat(starts)))):
            return None
        new_names = [prefix + name for prefix in prefixes for name in names]
        if not self.g._node.keys().isdisjoint(new_names):
            return next(new for new in new_names if new in self.g._node)
        if len(set(new_names)) < len(new_names):
            return next(new for new in new_names if new_names.count(new) > 1)
        return None

    def _copy_replica(self, shape: "_CopyShape", replica: "Replica") -> None:
        """One copy of each node, borrowing the snapshot of its original's NodeDef (see
        BorrowedNode), with its in-edges and its out-edges to other copies written straight
        into networkx's adjacency dicts, a whole replica per dict update; copies share their
        originals' key dicts (they hold no node names)."""
        mapping, plans, skip = replica.mapping, replica.plans, shape.skip
        get, rename = mapping.get, mapping.__getitem__
        device = replica.device
        fixed = None if callable(device) else device
        copies = list(map(BorrowedNode, shape.bases))
        if fixed is not None:
            setitem, key = dict.__setitem__, "device"
            for copy in copies:
                setitem(copy, key, fixed)
        for copy, plan in zip(copies, plans):
            copy._plan = plan
            copy._replica = replica
            copy._proto = None
        for k in shape.skipped():  # never made: emit and the graph see None
            copies[k] = None
        if callable(device):  # each copy has its own: those not the original's are written alone
            replica.device = None
            for copy, name in zip(copies, shape.names):
                found = copy is not None and device(name)
                if found and found != copy["device"]:
                    dict.__setitem__(copy, "device", found)
                    replica.touched.add(name)
        replica.copies = copies
        news = replica.names if not skip else list(itertools.compress(replica.names, copies))
        made = copies if not skip else list(itertools.compress(copies, copies))
        g = self.g
        g._node.update(zip(news, made))
        self._by_op = None
        self._dirty.update(map(rename, shape.dirty))
        self._unverified_copies.append(replica)
        self._replicas.append(replica)
        # one dict per copy each way is most of the cost of copying (see _adjacency)
        ins, outs = shape.made_edges()
        table = list(mapping.values())  # by index: the copies (or replica 0's), then extra
        table += shape.extra
        g._pred.update(zip(news, _adjacency(ins, table)))
        succ = g._succ
        for src, keys, k in shape.outside:  # inputs from outside gain a consumer
            succ[get(src, src)][replica.names[k]] = keys
        succ.update(zip(news, _adjacency(outs, table)))

    # -------------------------------------------------------------- printing
    def node_line(self, name: str) -> str:
        data = self.g.nodes[name]
        args = [_input_string(src, port) for src, port in self.inputs(name)]
        args += ["^" + src for src in self.control_inputs(name)]
        attrs = " ".join(f"{key}={format_attr(data['attr'][key])}"
                         for key in sorted(data["attr"]) if not key.startswith("_output_shapes"))
        text = f"{name} = {data['op']}({', '.join(args)})"
        if data["device"]:
            text += f" @{data['device']}"
        if attrs:
            text += f" {{{attrs}}}"
        if data["created_by"]:
            text += f"  # {data['created_by']}"
        return text

    def __str__(self) -> str:
        """One line per node, in graph order: deterministic, for golden tests and diffs."""
        return "\n".join(self.node_line(name) for name in self.g) + "\n"

    def unique_name(self, base: str) -> str:
        if base not in self.g:
            return base
        for i in itertools.count(1):
            if f"{base}_{i}" not in self.g:
                return f"{base}_{i}"
        raise AssertionError  # unreachable

    def unique_scope(self, base: str) -> str:
        """``base/``, or ``base_1/``, ``base_2/``, ... : the first scope no node lives under
        (a node named ``base`` alone does not make ``base/`` taken, nor the reverse)."""
        for candidate in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(1))):
            if not self.has_scope(candidate + "/"):
                return candidate + "/"
        raise AssertionError  # unreachable


_PLAIN_KEYS = [data_keys(port, 0) for port in range(64)]  # a port-0 input's, by its port
_AFTER_CARET = operator.itemgetter(slice(1, None))


def _link_new(name: str, inputs: Iterable[str], node_table: dict, succ: dict,
              pred: dict) -> list[str] | None:
    """The in-edges of the new node ``name`` (in ``node_table``, without in-edges yet) from
    its TF ``inputs``, written straight into the adjacency: an input from a node not yet
    feeding ``name`` takes the shared key dict of its kind. Returns the input list
    ``edge_inputs`` would write (so the node's NodeDef can hold it), or None when that takes
    the edges (a node feeding ``name`` twice, a control input before data)."""
    if type(inputs) is not list:
        inputs = list(inputs)
    if len(inputs) == 1:  # most nodes a pass adds: an Identity, a Cast, ...
        text = inputs[0]
        if text[:1] != "^" and ":" not in text and text in node_table:
            pred[name] = {text: _PLAIN_KEYS[0]}
            succ[text][name] = _PLAIN_KEYS[0]
            return inputs
    elif _link_plain(name, inputs, node_table, succ, pred):
        return inputs
    pred[name] = {}
    return _link_each(name, inputs, node_table, succ, pred)


def _link_plain(name: str, inputs: list[str], node_table: dict, succ: dict,
                pred: dict) -> bool:
    """``_link_new`` for the usual inputs, in bulk: port 0 of distinct existing nodes, then
    control inputs on other existing nodes (a ConcatV2 of every replica's copy, a NoOp
    waiting on them), whose input list is ``inputs`` as it is. False, linking nothing, for
    any other (then ``_link_each`` links them one at a time)."""
    waits = sum(map(str.startswith, inputs, itertools.repeat("^")))
    reads = len(inputs) - waits
    head = "".join(inputs[:reads])  # no caret in it: the ``waits`` control inputs come last
    if reads > len(_PLAIN_KEYS) or ":" in head or "^" in head:
        return False
    sources = inputs
    if waits:
        sources = inputs[:reads] + list(map(_AFTER_CARET, inputs[reads:]))
    keys = _PLAIN_KEYS[:reads] + [CONTROL_KEYS] * waits if waits else _PLAIN_KEYS[:reads]
    preds = dict(zip(sources, keys))
    if len(preds) < len(sources) or not preds.keys() <= node_table.keys():
        return False  # a node feeding ``name`` twice, or a missing one
    pred[name] = preds
    collections.deque(map(operator.setitem, map(succ.__getitem__, sources),
                          itertools.repeat(name), keys), maxlen=0)
    return True


def _link_each(name: str, inputs: list[str], node_table: dict, succ: dict,
               pred: dict) -> list[str] | None:
    """``_link_new`` for any inputs, one edge at a time."""
    preds = pred[name]
    written, port, whole, controls = [], 0, True, False
    for text in inputs:
        if text[:1] == "^":
            src, key, keys = text[1:], CONTROL_KEY, CONTROL_KEYS
            controls = True
            written.append(text)
        else:  # parse_tensor and data_keys, inlined
            src, sep, tail = text.rpartition(":")
            if sep and tail.isdigit():
                src_port = int(tail)
            else:
                src, src_port = text, 0
            key, keys = port, _DATA_KEYS.get((port, src_port)) or data_keys(port, src_port)
            port += 1
            whole = whole and not controls
            written.append(src if src_port == 0 else f"{src}:{src_port}")
        if src in preds:  # a second edge from the same node
            join_edge(succ, pred, src, name, key, keys[key])
            whole = False
        elif src in node_table:
            succ[src][name] = preds[src] = keys
        else:
            raise GraphxformError(f"node '{name}' has input '{src}', which is not in the graph")
    return written if whole else None


def _reached(adjacency: dict, sources) -> set[str]:
    """``sources`` and every node reached from them through ``adjacency`` (succ or pred)."""
    seen, stack = set(sources), list(sources)
    while stack:
        for node in adjacency[stack.pop()]:
            if node not in seen:
                seen.add(node)
                stack.append(node)
    return seen


def _indices_not(flags) -> list[int]:
    """The indices at which ``flags`` (an iterable of bools) is false, swept at C speed."""
    return list(itertools.compress(itertools.count(), map(operator.not_, flags)))


def data_pairs(adjacent: dict):
    """The (neighbour, key dict) pairs of ``adjacent`` (a node's pred or succ dict) that may
    hold a data edge: a node with many neighbours is often waited on or waits on many
    (batch norm updates on every gradient op), and those control-only pairs share one key
    dict, left out here by identity. Callers still skip control keys."""
    if len(adjacent) < _RUN:
        return adjacent.items()
    return [(node, keys) for node, keys in adjacent.items() if keys is not CONTROL_KEYS]


def _adjacency(edges: list, names: list) -> list[dict]:
    """One adjacency dict per (neighbour indices, key dicts) in ``edges``, each neighbour
    named ``names[index]``. Most nodes have one or two neighbours each way: those dicts are
    built as displays, several times cheaper than dict(zip(...))."""
    return [{names[i[0]]: k[0]} if len(i) == 1 else
            {names[i[0]]: k[0], names[i[1]]: k[1]} if len(i) == 2 else
            dict(zip(map(names.__getitem__, i), k)) if i else {}
            for i, k in edges]


def _copy_plan(proto, name: str, copied: set, dirty: bool, inputs_copied: bool,
               take_over: bool) -> tuple:
    """What every copy of ``name`` (whose NodeDef is ``proto``) needs: (name, frozen snapshot
    of its NodeDef, input names or None when ``name`` (and so the copy) is dirty, colocation
    items or None, are all inputs copied). The snapshot is taken now, so later changes to the
    original (through an attr map handed out before the copy, say) never reach the copies;
    with ``take_over`` (the original goes next) it is the original's NodeDef itself, which
    then no longer holds the original's inputs. It leaves out what each copy writes itself: its
    name and device, a clean node's input list, and ``_class`` when that names a copied node
    (colocation items are then (item, None) to keep, or (item, node name bytes) to point at
    the copy)."""
    if take_over:
        snapshot = proto
    else:
        snapshot = type(proto)()
        snapshot.CopyFrom(proto)
    snapshot.name = snapshot.device = ""  # every copy has its own (emit writes the rest as is)
    texts = None
    if not dirty:
        texts = list(proto.input)
        if texts:
            del snapshot.input[:]
    colocation = None
    attr = proto.attr
    if "_class" in attr:
        marked = [(item, item[5:] if node is not None and node in copied else None)
                  for item, node in colocation_targets(attr["_class"])]
        if any(node is not None for _, node in marked):
            colocation = marked
            del snapshot.attr["_class"]
    return name, snapshot, texts, colocation, inputs_copied


def colocation_targets(attr_value) -> list[tuple[bytes, str | None]]:
    """Each ``_class`` item with the node it colocates with ('loc:@x' -> x; None otherwise)."""
    return [(item, item[5:].decode() if item.startswith(b"loc:@") else None)
            for item in attr_value.list.s]


def renamed_inputs(texts: list[str], all_copied: bool, copied, prefix: str) -> list[str]:
    """A NodeDef input list with the inputs in ``copied`` renamed to their copies."""
    if all_copied:
        caret = "^" + prefix
        return [caret + t[1:] if t[0] == "^" else prefix + t for t in texts]
    return [_renamed_input(t, copied, prefix) for t in texts]


def _renamed_input(text: str, copied, prefix: str) -> str:
    """One NodeDef input, renamed to its copy if its node is in ``copied``."""
    if text[0] == "^":
        return "^" + prefix + text[1:] if text[1:] in copied else text
    return prefix + text if parse_tensor(text)[0] in copied else text


def format_attr(value) -> str:
    """A short, stable text form of an AttrValue for the one-line printer."""
    kind = value.WhichOneof("value")
    if kind == "type":
        return _dtype_name(value.type)
    if kind == "shape":
        return _shape_text(value.shape)
    if kind == "s":
        return repr(value.s.decode(errors="replace"))
    if kind in ("i", "f", "b"):
        return str(getattr(value, kind))
    if kind == "tensor":
        t = value.tensor
        return f"<{_dtype_name(t.dtype)}{_shape_text(t.tensor_shape)}>"
    if kind == "func":
        return f"@{value.func.name}"
    if kind == "placeholder":
        return f"${value.placeholder}"
    if kind == "list":
        lst = value.list
        for field in ("s", "i", "f", "b", "type", "shape", "tensor", "func"):
            items = getattr(lst, field)
            if items:
                if field == "type":
                    parts = [_dtype_name(x) for x in items]
                elif field == "shape":
                    parts = [_shape_text(x) for x in items]
                elif field == "s":
                    parts = [repr(x.decode(errors="replace")) for x in items]
                elif field in ("tensor", "func"):
                    parts = [f"<{field}>" for _ in items]
                else:
                    parts = [str(x) for x in items]
                return "[" + ", ".join(parts) + "]"
        return "[]"
    return "?"


def _dtype_name(enum_value: int) -> str:
    from tensorflow.core.framework import types_pb2
    name = types_pb2.DataType.Name(enum_value)
    return name[3:].lower() if name.startswith("DT_") else name


def _shape_text(shape) -> str:
    if shape.unknown_rank:
        return "[*]"
    return "[" + ",".join("?" if d.size < 0 else str(d.size) for d in shape.dim) + "]"
