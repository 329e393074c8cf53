"""Checks that a GraphIR is a well-formed TF graph: run after every pass by the pipeline.

The pipeline checks only what a pass changed (see ``GraphIR.take_changes``): the nodes it added
or rewired, copies of nodes no check had seen (in one replica: the others mirror it), and
cycles through the edges it added; the full ``check_structure`` looks at every node.
``check_imports`` is the TensorFlow-level check `apply` ends with (graphxform/import_check.py)."""

from __future__ import annotations

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import CONTROL_KEY, CONTROL_KEYS, SINGLE_EDGE_PORTS, GraphIR

LOOP_BACK_OPS = {"NextIteration", "RefNextIteration"}


def structural_errors(ir: GraphIR, limit: int = 10, nodes=None, new_edges=None) -> list[str]:
    """Every data input names an existing output port, ports are dense, cycles only through
    while-loop back edges. ``nodes``: check only these, and only cycles through them, or with
    ``new_edges`` (the nodes that gained in-edges, those edges' sources) only cycles through
    such edges. Returns up to ``limit`` messages."""
    g = ir.g
    checked = g._node if nodes is None else _in_graph(g._node, nodes)
    counts = _OutputCounts(ir)
    errors = _input_errors(g, checked, counts, limit)
    if len(errors) >= limit:
        return errors[:limit]
    unknown = sorted(counts.unknown)
    errors += [f"unknown op type {op}" for op in unknown[: limit - len(errors)]]
    if not errors:
        if nodes is None:
            errors += _cycle_errors(ir)
        else:
            down, up = (checked, checked) if new_edges is None else new_edges
            if down and up:
                errors += _cycle_errors(ir, _cycle_candidates(g, down, up))
    return errors


def _in_graph(node_table: dict, nodes) -> list:
    """The nodes of ``nodes`` still in the graph. Where they are a large share of it (every
    node, after loading), in graph order: the nodes' dicts were made in that order, and
    reading them so reads memory in order, about twice as fast as a set's order, which is
    its hashes'; the few a pass changed are taken as they come."""
    if isinstance(nodes, (set, frozenset)) and len(nodes) * 10 >= len(node_table):
        return [name for name in node_table if name in nodes]
    return [name for name in nodes if name in node_table]


_VARIES = -1  # an op whose output count depends on its attrs
_UNKNOWN = float("inf")  # the bound of an op with no OpDef: any port passes (reported apart)


class _OutputCounts(dict):
    """Op type -> the bound a data edge's source port must stay under: the op's output count
    when its attrs do not change it (most ops; read once per op type), ``_VARIES`` when they
    do (then ``of_node`` reads the node's own count, once per node), ``_UNKNOWN`` for an op
    with no OpDef (those ops are kept in ``unknown``)."""

    def __init__(self, ir: GraphIR):
        super().__init__()
        self.ir = ir
        self.unknown = set()
        self.by_node = {}

    def __missing__(self, op: str):
        found = opdefs.op_def(self.ir, op)
        if found is None:
            self.unknown.add(op)
            bound = _UNKNOWN
        elif any(arg.number_attr or arg.type_list_attr for arg in found.output_arg):
            bound = _VARIES
        else:
            bound = len(found.output_arg)
        self[op] = bound
        return bound

    def of_node(self, name: str) -> int | None:
        """The output count of ``name`` (None when its op is unknown)."""
        count = self.by_node.get(name, _UNREAD)
        if count is _UNREAD:
            bound = self[self.ir.g._node[name]["op"]]
            count = self.by_node[name] = (None if bound == _UNKNOWN else bound
                                          if bound != _VARIES else
                                          opdefs.num_outputs(self.ir, name))
        return count


_UNREAD = object()


def _input_errors(g, names, counts: _OutputCounts, limit: int) -> list[str]:
    """What is wrong with the data inputs of ``names`` (up to about ``limit`` messages): a
    source port past its node's outputs, ports not dense. One loop over every checked node's
    in-edges, which is most of what the check costs."""
    pred, node_table = g._pred, g._node
    single_ports = SINGLE_EDGE_PORTS
    errors = []
    for name in names:
        ports = []
        for src, keyed in pred[name].items():
            if keyed is CONTROL_KEYS:
                continue
            single = single_ports.get(id(keyed))
            if single is not None:  # one plain data edge: (dst_port, src_port)
                ports.append(single[0])
                if single[1] >= counts[node_table[src]["op"]]:
                    errors += _port_error(counts, node_table, name, src, single[1])
                continue
            for key, edge in keyed.items():
                if key == CONTROL_KEY:
                    continue
                ports.append(key)
                if edge["src_port"] >= counts[node_table[src]["op"]]:
                    errors += _port_error(counts, node_table, name, src, edge["src_port"])
        if len(ports) > 1:
            if sorted(ports) != list(range(len(ports))):
                errors.append(f"node '{name}' has data inputs at ports {sorted(ports)} "
                              "(not dense)")
        elif ports and ports[0] != 0:
            errors.append(f"node '{name}' has data inputs at ports {ports} (not dense)")
        if len(errors) >= limit:
            break
    return errors


def _port_error(counts: _OutputCounts, node_table, name: str, src: str,
                src_port: int) -> list[str]:
    """The message for ``name`` reading ``src``:``src_port`` past its outputs (none when
    ``src``'s op has as many outputs as its attrs say and the port is among them)."""
    count = counts.of_node(src)
    if count is None or src_port < count:
        return []
    return [f"node '{name}' reads {src}:{src_port}, but {src} ({node_table[src]['op']}) has "
            f"{count} output(s)"]


def _cycle_candidates(g, heads, tails) -> set | None:
    """The nodes a cycle through an edge from ``tails`` to ``heads`` could use: those reached
    from a head and reaching a tail. Searches down and up a level at a time, always on the
    side that has seen less; the first to finish bounds the other, so a pass that rewired a
    few nodes near the end (or the start) of a big graph costs little. None (every node)
    when the seeds are a large share of the graph anyway."""
    if (len(heads) + len(tails)) * 2 > len(g):
        return None
    down_seen, up_seen = set(heads), set(tails)
    down, up = set(down_seen), set(up_seen)
    while down and up:
        if len(down_seen) <= len(up_seen):
            down = _next_level(g._succ, down, down_seen)
        else:
            up = _next_level(g._pred, up, up_seen)
    if not down:
        return reached_within(g._pred, tails, within=down_seen)
    return reached_within(g._succ, heads, within=up_seen)


def _next_level(adj, level: set, seen: set, within: set | None = None) -> set:
    """The neighbours (in ``adj``) of ``level`` not yet ``seen`` (and ``within``); adds them to
    ``seen``. Set operations over whole levels run at C speed."""
    found = set().union(*map(adj.__getitem__, level))
    found -= seen
    if within is not None:
        found &= within
    seen |= found
    return found


def reached_within(adj, seeds, within: set) -> set:
    """``seeds`` and every node reached from them through ``adj`` (a graph's succ or pred)
    without leaving ``within``, a level at a time in set operations at C speed."""
    seen = set(seeds)
    level = set(seen)
    while level:
        level = _next_level(adj, level, seen, within)
    return seen


def _cycle_errors(ir: GraphIR, within: set | None = None) -> list[str]:
    """Kahn's algorithm over the graph (or the nodes ``within``) minus while-loop back edges,
    counting each node's distinct inputs (several edges between two nodes wait together)."""
    g = ir.g
    pred = g._pred
    if within is None:
        pending = dict(zip(pred, map(len, pred.values())))
        back = set(ir.nodes_of(LOOP_BACK_OPS))
        after = g._succ
    else:
        pending, after = _edges_within(pred, within)
        back = {n for n in within if g._node[n]["op"] in LOOP_BACK_OPS}
    for node in back:
        for dst in after[node]:
            pending[dst] -= 1
    seen = 0
    # a graph TF wrote is mostly in topological order already: one sweep in graph order (which
    # reads memory in order) takes most of it, Kahn's stack what the sweep had to pass by
    passed = []
    for node in pending:
        if pending[node]:
            passed.append(node)
            continue
        seen += 1
        if node in back:
            continue
        for dst in after[node]:
            pending[dst] -= 1
    ready = [n for n in passed if pending[n] == 0]
    while ready:
        node = ready.pop()
        seen += 1
        if node in back:
            continue
        for dst in after[node]:
            left = pending[dst] = pending[dst] - 1
            if not left:
                ready.append(dst)
    if seen == len(pending):
        return []
    stuck = sorted(n for n, count in pending.items() if count > 0)
    return ["cycle not through a while-loop back edge, among: " + ", ".join(stuck[:5])]


def _edges_within(pred: dict, within: set) -> tuple[dict, dict]:
    """Per node of ``within``: how many of its inputs are in ``within``, and which nodes of
    ``within`` it feeds. Read from the inputs' side: a ResNet's batch-norm updates each feed
    hundreds of gradient ops outside ``within`` but read a handful of nodes."""
    inside = {n: pred[n].keys() & within for n in within}
    after = {n: [] for n in within}
    for dst, srcs in inside.items():
        for src in srcs:
            after[src].append(dst)
    return {n: len(srcs) for n, srcs in inside.items()}, after


def check_structure(ir: GraphIR, changed_only: bool = False) -> None:
    """Raise on structural errors. ``changed_only``: check the nodes added or rewired since the
    last such check (every node of a freshly loaded graph), as the pipeline does after each
    pass; the full check (the default) sees every node."""
    if changed_only:
        changes = ir.take_changes()
        errors = structural_errors(ir, nodes=changes.nodes,
                                   new_edges=(changes.linked_to, changes.linked_from))
    else:
        errors = structural_errors(ir)
    if errors:
        raise GraphxformError("; ".join(errors))


def check_imports(ir: GraphIR, keep_until_exit: bool = False) -> dict:
    """The TF-level check: TensorFlow's importer accepts the graph emit writes. Copies that
    are byte for byte another replica's are proven alike instead of imported again (see
    graphxform/import_check.py). TF would also refuse a cycle, which may run through such a
    copy, so edges no structural check has seen (the pipeline ran without one) are searched
    for cycles first. Returns what was imported. ``keep_until_exit``: see
    graphxform.import_check.check (for a command that ends without teardown)."""
    from graphxform import import_check
    changes = ir.take_changes()
    if changes.linked_to:
        errors = structural_errors(ir, nodes=(), new_edges=(changes.linked_to,
                                                            changes.linked_from))
        if errors:
            raise GraphxformError("TensorFlow rejects the graph: " + "; ".join(errors))
    return import_check.check(ir, keep_until_exit=keep_until_exit)
