"""Checks that a GraphIR is a well-formed TF graph: run after every pass by the pipeline."""

from __future__ import annotations

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import CONTROL_KEY, GraphIR

LOOP_BACK_OPS = {"NextIteration", "RefNextIteration"}


def structural_errors(ir: GraphIR, limit: int = 10) -> list[str]:
    """Every data input names an existing output port, ports are dense, cycles only through
    while-loop back edges. Returns up to ``limit`` messages."""
    errors = []
    g = ir.g
    arity = {}
    for name in g:
        ports = []
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
                                  f"{src} ({g.nodes[src]['op']}) has {count} output(s)")
        if ports and sorted(ports) != list(range(len(ports))):
            errors.append(f"node '{name}' has data inputs at ports {sorted(ports)} (not dense)")
        if len(errors) >= limit:
            return errors
    unknown = sorted({g.nodes[n]["op"] for n in g if arity.get(n, 0) is None})
    errors += [f"unknown op type {op}" for op in unknown[: limit - len(errors)]]
    if not errors:
        errors += _cycle_errors(ir)
    return errors


def _cycle_errors(ir: GraphIR) -> list[str]:
    """Kahn's algorithm over the graph minus while-loop back edges."""
    g = ir.g
    nodes = g.nodes
    back = {n for n in g if nodes[n]["op"] in LOOP_BACK_OPS}
    pending = {n: sum(len(keyed) for src, keyed in g._pred[n].items() if src not in back)
               for n in g}
    ready = [n for n, count in pending.items() if count == 0]
    seen = 0
    while ready:
        node = ready.pop()
        seen += 1
        if node in back:
            continue
        for dst, keyed in g._succ[node].items():
            pending[dst] -= len(keyed)
            if pending[dst] == 0:
                ready.append(dst)
    if seen == len(pending):
        return []
    stuck = sorted(n for n, count in pending.items() if count > 0)
    return ["cycle not through a while-loop back edge, among: " + ", ".join(stuck[:5])]


def check_structure(ir: GraphIR) -> None:
    errors = structural_errors(ir)
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
