"""Checks that a GraphIR is a well-formed TF graph: run after every pass by the pipeline.

The pipeline checks only what a pass changed (the nodes it added or rewired, and cycles through
them); `graphxform verify` and the full ``check_structure`` look at every node."""

from __future__ import annotations

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import CONTROL_KEY, GraphIR

LOOP_BACK_OPS = {"NextIteration", "RefNextIteration"}


def structural_errors(ir: GraphIR, limit: int = 10, nodes=None) -> list[str]:
    """Every data input names an existing output port, ports are dense, cycles only through
    while-loop back edges. ``nodes``: check only these, and only cycles through them. Returns
    up to ``limit`` messages."""
    g = ir.g
    checked = g if nodes is None else [n for n in nodes if n in g]
    errors = []
    arity = {}
    for name in checked:
        errors += _input_errors(ir, name, arity)
        if len(errors) >= limit:
            return errors[:limit]
    unknown = sorted({g._node[n]["op"] for n, count in arity.items() if count is None})
    errors += [f"unknown op type {op}" for op in unknown[: limit - len(errors)]]
    if not errors:
        within = None if nodes is None else _cycle_candidates(g, checked)
        errors += _cycle_errors(ir, within)
    return errors


def _input_errors(ir: GraphIR, name: str, arity: dict) -> list[str]:
    """What is wrong with ``name``'s data inputs; ``arity`` caches output counts (None: unknown
    op) of the nodes read."""
    g = ir.g
    errors, ports = [], []
    for src, keyed in g._pred[name].items():
        for key, edge in keyed.items():
            if key == CONTROL_KEY:
                continue
            ports.append(key)
            if src not in arity:
                arity[src] = opdefs.num_outputs(ir, src)
            count = arity[src]
            if count is not None and edge["src_port"] >= count:
                errors.append(f"node '{name}' reads {src}:{edge['src_port']}, but "
                              f"{src} ({g._node[src]['op']}) has {count} output(s)")
    if ports and sorted(ports) != list(range(len(ports))):
        errors.append(f"node '{name}' has data inputs at ports {sorted(ports)} (not dense)")
    return errors


class _Reach:
    """A depth-first search through ``adj`` (succ or pred) from ``seeds``, a node per step,
    optionally kept ``within`` a set."""

    def __init__(self, adj, seeds, within=None):
        self.adj, self.within = adj, within
        self.seen = set(seeds)
        self.stack = list(self.seen)

    def step(self) -> bool:
        if not self.stack:
            return False
        for nxt in self.adj[self.stack.pop()]:
            if nxt not in self.seen and (self.within is None or nxt in self.within):
                self.seen.add(nxt)
                self.stack.append(nxt)
        return True

    def run(self) -> set:
        while self.step():
            pass
        return self.seen


def _cycle_candidates(g, seeds) -> set | None:
    """The nodes a cycle through a seed could use: those both reached from a seed and reaching
    one. Searches down and up in step; the first to finish bounds the other, so a pass that
    rewired a few nodes near the end (or the start) of a big graph costs little. None (every
    node) when the seeds are a large share of the graph anyway."""
    if len(seeds) * 4 > len(g):
        return None
    down, up = _Reach(g._succ, seeds), _Reach(g._pred, seeds)
    while down.step() and up.step():
        pass
    if not down.stack:
        return _Reach(g._pred, seeds, within=down.seen).run()
    return _Reach(g._succ, seeds, within=up.seen).run()


def _cycle_errors(ir: GraphIR, within: set | None = None) -> list[str]:
    """Kahn's algorithm over the graph (or the nodes ``within``) minus while-loop back edges."""
    g = ir.g
    nodes = g._node
    members = nodes if within is None else within
    back = {n for n in members if nodes[n]["op"] in LOOP_BACK_OPS}
    pending = {n: sum(len(keyed) for src, keyed in g._pred[n].items()
                      if src in members and src not in back)
               for n in members}
    ready = [n for n, count in pending.items() if count == 0]
    seen = 0
    while ready:
        node = ready.pop()
        seen += 1
        if node in back:
            continue
        for dst, keyed in g._succ[node].items():
            if dst in pending:
                pending[dst] -= len(keyed)
                if pending[dst] == 0:
                    ready.append(dst)
    if seen == len(pending):
        return []
    stuck = sorted(n for n, count in pending.items() if count > 0)
    return ["cycle not through a while-loop back edge, among: " + ", ".join(stuck[:5])]


def check_structure(ir: GraphIR, changed_only: bool = False) -> None:
    """Raise on structural errors. ``changed_only``: check the nodes added or rewired since the
    last such check (every node of a freshly loaded graph), as the pipeline does after each
    pass; the full check (the default) sees every node."""
    nodes = ir.take_unverified() if changed_only else None
    errors = structural_errors(ir, nodes=nodes)
    if errors:
        raise GraphxformError("; ".join(errors))


def check_imports(ir: GraphIR) -> None:
    """The TF-level check: the emitted GraphDef imports into a fresh tf.Graph."""
    import tensorflow as tf

    from graphxform.metagraph import to_graphdef
    graph_def = to_graphdef(ir)
    try:
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, tf.errors.OpError) as e:
        first = str(e).strip().splitlines()[0]
        raise GraphxformError(f"TensorFlow rejects the graph: {first}") from None
