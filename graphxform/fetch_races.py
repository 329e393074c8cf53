"""Fetches of the original graph whose value races with the step's own updates.

A loss such as Kendall et al.'s uncertainty weighting, ``exp(-s) * L + s``, reads the
variable ``s`` twice: once under ``Exp``, whose gradient needs that read, and once in the sum,
whose gradient is 1 and needs nothing. A resource variable gets one ReadVariableOp per use,
so the second read feeds only the loss, and nothing orders it against the optimizer's update
of ``s`` in the same ``session.run``: TF's executor runs it before the update in one run and
after it in the next. Fetching the loss with the train op then gives either value, on one
device as on many, and verify cannot blame the transformation for the difference. A DQN
whose train op groups the optimizer's step with a soft update of the target network reads the
target's variables for the loss in no order with that update either, and there the gradients
differ with the order too.

Only reads the fetch's value depends on count (a read whose output only a ``ZerosLike`` takes,
as tf_keras' RNN does for its first step's shape, changes nothing).

A read counts as ordered before an update when a path of data or control edges leads from it
to the update, but not through an op that reads only its input's shape (``Shape``, ``Size``,
``ZerosLike``, ...): Grappler folds those to constants wherever the shape is known, and the
order goes with them (``tf.gradients`` seeds the loss's gradient with ``Fill(Shape(loss))``,
which would otherwise order every read of the loss before every update). A read that comes
after an update (a path from the update to it) is ordered too."""

from __future__ import annotations

import dataclasses

from graphxform.ir import SHAPE_ONLY_OPS, GraphIR, parse_tensor

# ops whose output depends on their input's shape alone (the input's value orders nothing)
_SHAPE_READERS = SHAPE_ONLY_OPS | {"ZerosLike", "OnesLike", "VariableShape"}


@dataclasses.dataclass(frozen=True)
class Race:
    fetch: str  # the fetched tensor
    read: str  # the read no edge orders against the update
    variable: str
    update: str  # one of the step's writes of the variable

    def describe(self) -> str:
        return (f"the original's '{self.fetch}' reads '{self.variable}' through "
                f"'{self.read}', which nothing orders before or after the step's update of it "
                f"('{self.update}'): TF runs the two in either order, so what the read gives, "
                "and whatever the step computes from it, is the value from before the update "
                "in one run and from after it in another, on one device as on several")


def races(ir: GraphIR, tg, fetches=()) -> list[Race]:
    """Each step's loss, fetched with its train op, and each of ``fetches`` (tensor names,
    fetched with every train op) whose read of a variable that run updates is unordered
    against every such update; one race per variable and fetch."""
    runs = [(step.loss, step.closure) for step in tg.steps if step.loss]
    runs += [(fetch, tg.train_closure) for fetch in fetches]
    found = []
    for fetch, run in runs:
        node = parse_tensor(fetch)[0]
        if node not in ir:
            continue
        updates = {name: [u for u in var.updates if u in run]
                   for name, var in tg.variables.items()}
        reader_of = {read: name for name, var in tg.variables.items() if updates[name]
                     for read in var.reads}
        reads = sorted(r for r in ir.value_sources(node, stop_at=_SHAPE_READERS)
                       if r in reader_of)
        if not reads:
            continue
        writes = [u for r in reads for u in updates[reader_of[r]]]
        before = _ordered_after(ir, ir.ancestors(node), reads + writes)
        seen = set()
        for read in reads:
            variable = reader_of[read]
            if variable in seen or any(before(read, u) or before(u, read)
                                       for u in updates[variable]):
                continue
            seen.add(variable)
            found.append(Race(fetch, read, variable, updates[variable][0]))
    return found


def _ordered_after(ir: GraphIR, closure: set, marked: list):
    """``before(a, b)``: whether an ordering path leads from marked node ``a`` to marked node
    ``b``, over ``closure`` and the marked nodes' ancestors. A legacy while loop is a cycle
    (its NextIteration feeds its Merge), so the sweep runs over the graph's strongly connected
    components in topological order, each carrying a bitmask of the marked nodes before it."""
    import networkx as nx
    nodes = set(closure)
    for name in marked:
        if name not in nodes:
            nodes |= ir.ancestors(name)
    order = nx.DiGraph()
    order.add_nodes_from(nodes)
    for name in nodes:
        controls = set(ir.control_consumers(name))
        order.add_edges_from((name, dst) for dst in ir.successors(name) if dst in nodes
                             and (dst in controls or ir.op(dst) not in _SHAPE_READERS))
    condensed = nx.condensation(order)
    component = condensed.graph["mapping"]
    bits = {}
    for i, name in enumerate(dict.fromkeys(marked)):
        bits[component[name]] = bits.get(component[name], 0) | 1 << i
    index = {name: i for i, name in enumerate(dict.fromkeys(marked))}
    mask = {}
    for c in nx.topological_sort(condensed):
        here = mask.get(c, 0) | bits.get(c, 0)
        mask[c] = here
        for dst in condensed.successors(c):
            mask[dst] = mask.get(dst, 0) | here
    return lambda a, b: a != b and bool(mask[component[b]] >> index[a] & 1)
