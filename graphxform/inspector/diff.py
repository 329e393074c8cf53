"""`graphxform diff A B`: the nodes B added, removed, replaced and rewired relative to A,
grouped by scope and by the pass that made them.

A node of B that a pass made (its provenance: the IR's ``created_by``, in a file the
``_graphxform_pass`` attr) is *added* when A has no node of that name and *replaced* when A has
one (merge-fetches serves the input's names from new nodes). A node both graphs have that no
pass remade is *rewired* when its inputs differ and *changed* when only its device or attrs
do. Without provenance (graphs from elsewhere) nodes are matched by name alone and a new
node's pass is unknown. A removed node whose replicas' copies are in B was *replicated*:
its name says so (``replica_*/name``)."""

from __future__ import annotations

import collections
import dataclasses
import os

from graphxform.inspector.scopes import fold_name
from graphxform.ir import GraphIR

ADDED, REMOVED, REPLACED, REWIRED, CHANGED = "added", "removed", "replaced", "rewired", "changed"
STATUSES = (ADDED, REMOVED, REPLACED, REWIRED, CHANGED)
UNKNOWN_PASS = "(no provenance)"
IGNORED_ATTRS = {"_output_shapes"}  # recorded shapes, dropped when values change shape
EXAMPLES = 4  # names shown per group in the text report


@dataclasses.dataclass
class Change:
    name: str
    status: str
    made_by: str | None  # the pass that made (or rewired) it, when known
    detail: str = ""


@dataclasses.dataclass
class Diff:
    a: str
    b: str
    a_nodes: int
    b_nodes: int
    changes: list
    provenance: bool  # B records which pass made its nodes

    def of(self, status: str) -> list:
        return [c for c in self.changes if c.status == status]

    def made_by_passes(self) -> set:
        """Names B's passes made: added and replaced nodes."""
        return {c.name for c in self.changes if c.status in (ADDED, REPLACED)}

    def by_pass(self) -> dict:
        groups = collections.defaultdict(lambda: collections.Counter())
        for c in self.changes:
            groups[c.made_by or (UNKNOWN_PASS if c.status != REMOVED else "-")][c.status] += 1
        return dict(groups)

    def by_scope(self) -> dict:
        """Top-level scope (replicas folded) -> status -> names."""
        groups = collections.defaultdict(lambda: collections.defaultdict(list))
        for c in self.changes:
            groups[scope_of(c.name)][c.status].append(c.name)
        return groups

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "a_nodes": self.a_nodes, "b_nodes": self.b_nodes,
                "provenance": self.provenance,
                "counts": {s: len(self.of(s)) for s in STATUSES},
                "by_pass": {p: dict(c) for p, c in sorted(self.by_pass().items())},
                "by_scope": {s: {k: sorted(v) for k, v in groups.items()}
                             for s, groups in sorted(self.by_scope().items())},
                "changes": [dataclasses.asdict(c) for c in sorted(self.changes,
                                                                  key=lambda c: c.name)]}

    def text(self) -> str:
        counts = ", ".join(f"{len(self.of(s))} {s}" for s in STATUSES)
        lines = [f"diff {self.a} -> {self.b}: {self.a_nodes} -> {self.b_nodes} nodes; {counts}"]
        if not self.changes:
            lines.append("no differences")
            return "\n".join(lines)
        lines.append("by pass" + ("" if self.provenance else
                                  " (B has no provenance: passes unknown)") + ":")
        for made_by, statuses in sorted(self.by_pass().items()):
            said = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items()))
            lines.append(f"  {made_by:18} {said}")
        lines.append("by scope:")
        scopes = self.by_scope()
        width = min(max(map(len, scopes)), 40)
        for scope, groups in sorted(scopes.items()):
            for status in STATUSES:
                names = sorted(groups.get(status, ()))
                if not names:
                    continue
                passes = sorted({c.made_by for c in self.changes if c.name in set(names)
                                 and c.made_by})
                shown = ", ".join(names[:EXAMPLES]) + (
                    f" ... (+{len(names) - EXAMPLES})" if len(names) > EXAMPLES else "")
                by = f" by {', '.join(passes)}" if passes else ""
                lines.append(f"  {scope:{width}} {len(names):6} {status}{by}: {shown}")
        rewired = self.of(REWIRED)
        if rewired:
            lines.append("rewired:")
            for c in sorted(rewired, key=lambda c: c.name)[:20]:
                lines.append(f"  {c.name}: {c.detail}")
            if len(rewired) > 20:
                lines.append(f"  ... {len(rewired) - 20} more (--json lists them all)")
        return "\n".join(lines)


def scope_of(name: str) -> str:
    folded = fold_name(name)[0]
    head, sep, _ = folded.partition("/")
    return head + sep if sep else "(top level)"


def compare(a: GraphIR, b: GraphIR) -> Diff:
    a_table, b_table = a.g._node, b.g._node
    changes = []
    provenance = any(data["created_by"] for _, data in b.node_items())
    for name, data in b.node_items():
        made = data["created_by"]
        before = a_table.get(name)
        if before is None:
            changes.append(Change(name, ADDED, made))
            continue
        if made and made != before["created_by"] or data["op"] != before["op"]:
            changes.append(Change(name, REPLACED, made,
                                  f"{before['op']} -> {data['op']}"))
            continue
        old_inputs, new_inputs = a.edge_inputs(name), b.edge_inputs(name)
        if _inputs_differ(old_inputs, new_inputs):
            changes.append(Change(name, REWIRED, _rewired_by(b, old_inputs, new_inputs),
                                  _input_change(old_inputs, new_inputs)))
            continue
        what = _other_change(a, b, name, before, data)
        if what:
            changes.append(Change(name, CHANGED, None, what))
    for name in a.nodes():
        if name not in b_table:
            changes.append(Change(name, REMOVED, None, _where_now(b, name)))
    return Diff(os.path.basename(a.source or "A"), os.path.basename(b.source or "B"), len(a),
                len(b), changes, provenance)


def _inputs_differ(old: list, new: list) -> bool:
    data_old = [i for i in old if not i.startswith("^")]
    data_new = [i for i in new if not i.startswith("^")]
    return data_old != data_new or {i for i in old if i.startswith("^")} != {
        i for i in new if i.startswith("^")}


def _input_change(old: list, new: list) -> str:
    gone = [i for i in old if i not in new]
    came = [i for i in new if i not in old]
    parts = [f"-{i}" for i in gone[:3]] + [f"+{i}" for i in came[:3]]
    more = len(gone) + len(came) - len(parts)
    return ", ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _rewired_by(b: GraphIR, old: list, new: list) -> str | None:
    """The pass that made the first new input (who rewired it, as far as B can tell)."""
    for text in new:
        if text in old:
            continue
        node = text.lstrip("^").rsplit(":", 1)[0] if ":" in text else text.lstrip("^")
        if node in b:
            made = b.node(node)["created_by"]
            if made:
                return made
    return None


def _other_change(a: GraphIR, b: GraphIR, name: str, before: dict, data: dict) -> str:
    parts = []
    if before["device"] != data["device"]:
        parts.append(f"device {before['device'] or '(none)'} -> {data['device'] or '(none)'}")
    old, new = a.attrs(name), b.attrs(name)
    keys = (set(old) | set(new)) - IGNORED_ATTRS
    differing = sorted(k for k in keys if (k in old) != (k in new) or
                       (k in old and old[k] != new[k]))
    if differing:
        parts.append("attrs " + ", ".join(differing))
    return "; ".join(parts)


def _where_now(b: GraphIR, name: str) -> str:
    copies = [f"replica_{i}/{name}" for i in range(64) if f"replica_{i}/{name}" in b]
    return f"replicated as replica_*/{name} (x{len(copies)})" if copies else ""


def leaf_status(diff: Diff, folded) -> dict:
    """Leaf of a FoldedGraph (B's, with A's removed nodes as ghosts) -> its status: the
    strongest among its members."""
    rank = {s: k for k, s in enumerate(STATUSES)}
    status = {c.name: c.status for c in diff.changes}
    found = {}
    for leaf, members in enumerate(folded.members):
        mine = [status[m] for m in members if m in status]
        if mine:
            found[leaf] = min(mine, key=rank.__getitem__)
    return found


DIFF_COLOURS = {ADDED: "#4daf4a", REMOVED: "#e41a1c", REPLACED: "#984ea3", REWIRED: "#ff7f00",
                CHANGED: "#377eb8", "unchanged": "#eeeeee"}


def write_picture(diff: Diff, a: GraphIR, b: GraphIR, path: str, fmt: str,
                  boxes: int, depth: int | None, scope: str) -> str | None:
    """B's collapsed picture (A's removed nodes drawn where they were) coloured by status."""
    from graphxform.inspector import html, scopes, viz
    from graphxform.metagraph import write_atomic
    folded = scopes.FoldedGraph(b, ghosts=a)
    statuses = leaf_status(diff, folded)
    title = f"diff {diff.a} -> {diff.b}: " + ", ".join(f"{len(diff.of(s))} {s}"
                                                        for s in STATUSES)
    if fmt == "html":
        write_atomic(path, html.page(b, depth=depth, scope=scope, boxes=boxes, title=title,
                                     leaf_status=statuses, folded=folded, color_by="diff"))
        return None
    tree = scopes.build_tree(folded, scopes.saver_scope(b))
    root = tree.find(scope)
    pic = scopes.picture(folded, tree, scopes.choose_open(tree, root, boxes, depth), root)
    keys = [statuses.get(k, "unchanged") for k in range(len(folded))]
    return viz.write_dot(viz.picture_dot(pic, keys, title, DIFF_COLOURS), path, fmt)
