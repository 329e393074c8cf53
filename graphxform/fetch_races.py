"""Reads and writes of the original graph that race with the step's own updates.

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

The same holds inside the step: a write whose value comes from a read of a variable the step
also writes elsewhere, with no order between the two (WGAN's weight clipping,
``p.assign(tf.clip_by_value(p, -c, c))``, grouped with the critic's optimizer step), and two
writes of one variable in no order, which leave it with either write's value. Every write of
the variable in the step must be ordered against the read, not just one of them.

A read counts as ordered before an update when a path of data or control edges leads from it
to the update, but not through an op that reads only its input's shape (``Shape``, ``Size``,
``ZerosLike``, ...): Grappler folds those to constants wherever the shape is known, and the
order goes with them (``tf.gradients`` seeds the loss's gradient with ``Fill(Shape(loss))``,
which would otherwise order every read of the loss before every update). A read that comes
after an update (a path from the update to it) is ordered too. A ref variable's snapshot
(``w/read``) aliases the variable's buffer: it runs early, and the ops that consume it read the
variable when they run, so those consumers are what must be ordered.

``step_orders`` gives the order the transformation imposes on such a step (passes/order_races.py:
replicas that each picked their own would part). Any order that leaves the graph acyclic is a
run one device may make; the one chosen is what the code means: the step computes its loss and
its optimizer's updates from the state it starts with, so the reads those compute from come
first; then the optimizer's writes (what a gradient reaches); then the reads that feed only the
step's other writes (WGAN's clipping clips the stepped weights, a target network moves towards
the updated one); then those writes (the clipping, the soft update, BERT's increment of
global_step). Two writes of one variable in the same phase run in the order the code created
them.

A write no step runs cannot be ordered so (run on its own it would then run a step too), yet
code fetches some beside a step: wiseodd's WGAN runs ``sess.run([D_solver, D_loss, clip_D])``
with the clipping outside the train op. ``beside_steps`` finds the pairs such a session.run
would leave in no order (each replica would pick its own, and their copies part): `apply`
and `inspect` warn, and `run`/`verify` fetch what runs such a write (``fetched_beside``) in a
session.run of its own after the steps, one of the orders one device may take."""

from __future__ import annotations

import dataclasses
import itertools

from graphxform.ir import CONTROL_KEY, CONTROL_KEYS, SHAPE_ONLY_OPS, GraphIR, parse_tensor
from graphxform.verify import reached_within

# ops whose output depends on their input's shape alone (the input's value orders nothing)
_SHAPE_READERS = SHAPE_ONLY_OPS | {"ZerosLike", "OnesLike", "VariableShape"}
# ops that hand their input's buffer on without reading it: a ref variable's snapshot through
# them still aliases the variable
_ALIASING = frozenset({"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze",
                       "StopGradient", "PreventGradient", "Enter", "RefEnter", "Switch",
                       "RefSwitch", "Bitcast", "RefIdentity"})
# writes that add up the same in either order (two unordered `assign_add`s)
ACCUMULATING = frozenset({"AssignAdd", "AssignSub", "AssignAddVariableOp",
                          "AssignSubVariableOp", "ScatterAdd", "ScatterSub",
                          "ResourceScatterAdd", "ResourceScatterSub"})


@dataclasses.dataclass(frozen=True)
class Race:
    fetch: str  # what the step computes from the read (a fetched tensor, a write), or the step
    read: str  # what reads the variable unordered with ``update``, or another write of it
    variable: str
    update: str  # one of the step's writes of the variable
    kind: str = "read"  # "write": two writes; "write_reads": ``fetch`` is a write reading it

    def describe(self) -> str:
        if self.kind == "write":
            return (f"the original's step '{self.fetch}' writes '{self.variable}' with "
                    f"'{self.read}' and with '{self.update}', which nothing orders: TF runs "
                    "the two in either order, so the variable ends the step with either one's "
                    "value, and what reads it sees either, on one device as on several")
        what = f"write '{self.fetch}'" if self.kind == "write_reads" else f"'{self.fetch}'"
        return (f"the original's {what} reads '{self.variable}' through "
                f"'{self.read}', which nothing orders before or after the step's update of it "
                f"('{self.update}'): TF runs the two in either order, so what the read gives, "
                "and whatever the step computes from it, is the value from before the update "
                "in one run and from after it in another, on one device as on several")


def races(ir: GraphIR, tg, fetches=()) -> list[Race]:
    """Reads and writes of a variable that one run of a step makes in no order with a write of
    it: reads that each step's loss (fetched with its train op) or its writes' values depend
    on, or that each of ``fetches`` (tensor names, fetched with every train op) depends on, and
    pairs of writes; one race per variable and run."""
    runs = [(step.name, [step.loss] if step.loss else [], step.closure, True)
            for step in tg.steps]
    runs += [(fetch, [fetch], tg.train_closure, False) for fetch in fetches]
    found = []
    for name, outputs, run, with_writes in runs:
        updates = {var: [u for u in v.updates if u in run and u in ir]
                   for var, v in tg.variables.items()}
        updates = {var: u for var, u in updates.items() if u}
        targets = [parse_tensor(t)[0] for t in outputs]
        targets = [t for t in targets if t in ir]
        targets += sorted({u for us in updates.values() for u in us}) if with_writes else []
        if not targets:
            continue
        source_of = _value_sources(ir, targets)
        label = {parse_tensor(t)[0]: t for t in outputs}  # a fetched node by its tensor
        points = {var: [(p, t) for r in tg.variables[var].reads if r in source_of
                        for p, t in _read_points(ir, r, source_of)]
                  for var in updates}
        marked = [p for ps in points.values() for p, _ in ps]
        marked += [u for writes in updates.values() for u in writes]
        before = _ordered_after(ir, set(run) | set(targets), marked)
        guards = Guards(ir)

        def unordered(a, b):
            return (a != b and not (before(a, b) or before(b, a))
                    and not guards.exclusive(a, b))

        for var, writes in sorted(updates.items()):
            pair = next(((a, b) for i, a in enumerate(writes) for b in writes[i + 1:]
                         if with_writes and unordered(a, b)
                         and not {ir.op(a), ir.op(b)} <= ACCUMULATING), None)
            race = Race(name, pair[0], var, pair[1], kind="write") if pair else next(
                (Race(label.get(target, target), point, var, write,
                      kind="read" if target in label else "write_reads")
                 for point, target in points[var] for write in writes
                 if unordered(point, write)), None)
            if race:
                found.append(race)
    return found


@dataclasses.dataclass(frozen=True)
class Order:
    before: str  # a read point or write of ``variable`` the step runs in no order with ``after``
    after: str
    variable: str
    step: str
    phases: tuple = (0, 0)  # the phases (below) of ``before`` and ``after``


# the phases of ``step_orders``: reads the loss and the optimizer compute from, the optimizer's
# writes, reads that feed only other writes, other writes
_EARLY, _OPTIMIZER, _LATE, _OTHER = range(4)


def step_orders(ir: GraphIR, tg) -> list[Order]:
    """The pairs of each step, per variable, that nothing orders (as ``races`` finds them, but
    every pair), each as (before, after) in the order the module's docstring chooses."""
    created = dict(zip(ir.nodes(), itertools.count()))
    return [o for step in tg.steps for o in _run_orders(ir, tg, step, {}, created)]


@dataclasses.dataclass(frozen=True)
class Beside:
    write: str  # a write of a variable no step runs (WGAN's clipping fetched beside the step)
    step: str
    order: Order  # a pair one session.run of both would make in no order

    def describe(self) -> str:
        o = self.order
        return (f"'{self.write}', a write no step runs, which in one session.run with step "
                f"'{self.step}' would run in no order with it ('{o.before}' and '{o.after}' "
                f"of variable '{o.variable}')")


def beside_warnings(found: list) -> list[str]:
    """One line per step of ``beside_steps``' finds: what runs in no order with it, and how
    to run it exactly."""
    lines = []
    for step in dict.fromkeys(b.step for b in found):
        mine = [b for b in found if b.step == step]
        names = [f"'{b.write}'" for b in mine]
        some = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        o = mine[0].order
        lines.append(
            f"{some} write{'s' if len(names) == 1 else ''} variables step '{step}' uses, "
            f"outside every step ('{o.before}' and '{o.after}' of '{o.variable}' would run in "
            "no order): fetched in the same session.run as the step, TF orders them its own "
            "way, and each replica its own, so the replicas' copies can part; run them in a "
            "session.run of their own after the step to train exactly as one device")
    return lines


def outside_writes(ir: GraphIR, tg) -> dict:
    """{write: the variables it writes} of the ops that write a variable and that no step runs,
    its initializer and the saver's restore aside (the user runs them on their own, or fetches
    them beside a step: WGAN's weight clipping, a learning rate's assign)."""
    from graphxform.training import consumers_through_switches, is_mutating_op
    found = {}
    for var in tg.variables.values():
        if var.name not in ir:
            continue
        for write, _ in consumers_through_switches(ir, ir.consumers(var.name)):
            if (is_mutating_op(ir.op(write)) and write not in tg.train_closure
                    and write != var.initializer
                    and not (tg.saver_scope and write.startswith(tg.saver_scope))):
                found.setdefault(write, []).append(var.name)
    return found


def beside_steps(ir: GraphIR, tg, writes=None, steps=None) -> list[Beside]:
    """Each write no step runs (``writes``: {write: variables}, default ``outside_writes``)
    with each step (``steps``: default every one) whose run with it, in one session.run, makes
    a pair in no order that the step alone does not (``step_orders`` of the two together): one
    such pair per write and step, the optimizer's write and the other where there is one. Run
    in a session.run of its own, the write comes after the step (or before) as a whole."""
    writes = outside_writes(ir, tg) if writes is None else writes
    if not writes:
        return []
    created = {name: i for i, name in enumerate(ir.nodes())}
    reading = {}  # write -> the variables it reads
    for write in writes:
        upstream = ir.ancestors(write)
        reading[write] = {var for var, v in tg.variables.items()
                          if not upstream.isdisjoint(v.reads)}
    found = []
    for step in tg.steps if steps is None else steps:
        written = {var for var, v in tg.variables.items()
                   if not step.closure.isdisjoint(v.updates)}
        read = {var for var, v in tg.variables.items() if not step.closure.isdisjoint(v.reads)}
        own = None
        for write, variables in sorted(writes.items()):
            if set(variables).isdisjoint(written | read) and reading[write].isdisjoint(written):
                continue  # nothing of the step's it writes, nothing the step writes it reads
            if own is None:
                own = {(o.before, o.after) for o in _run_orders(ir, tg, step, {}, created)}
            pairs = [o for o in _run_orders(ir, tg, step, {write: variables}, created)
                     if (o.before, o.after) not in own]
            if pairs:  # the one naming the optimizer's write first, the telling one
                found.append(Beside(write, step.name, min(
                    pairs, key=lambda o: o.phases != (_OPTIMIZER, _OTHER))))
    return found


def fetched_beside(ir: GraphIR, tg, fetches, step) -> dict:
    """{fetch: a ``Beside``}: those of ``fetches`` (tensors or ops) that run a write no step
    runs (the read of a clipped variable that waits on its clipping) in no order with
    ``step``, were they fetched in one session.run with it (`run` and `verify` then fetch
    them in one of their own after the step)."""
    writes = outside_writes(ir, tg) if fetches else {}
    if not writes:
        return {}
    runs = {f: ir.ancestors(parse_tensor(f.lstrip("^"))[0]) for f in fetches
            if parse_tensor(f.lstrip("^"))[0] in ir}
    ran = {w: v for w, v in writes.items() if any(w in r for r in runs.values())}
    found = {b.write: b for b in beside_steps(ir, tg, ran, [step])} if ran else {}
    return {f: next(found[w] for w in sorted(found) if w in run)
            for f, run in runs.items() if not found.keys().isdisjoint(run)}


def _run_orders(ir: GraphIR, tg, step, extra: dict, created: dict) -> list[Order]:
    """``step_orders`` of one run of ``step`` and of the writes of ``extra`` ({write: the
    variables it writes}, each with what it reads)."""
    run = set(step.closure)
    for write in extra:
        run |= ir.ancestors(write) | {write}
    node_table = ir.g._node
    updates = {var: [u for u in v.updates if u in run and u in node_table]
               for var, v in tg.variables.items()}
    for write, variables in extra.items():
        for var in variables:
            updates[var].append(write)
    updates = {var: u for var, u in updates.items() if u}
    if not updates:
        return []
    writes = sorted({u for us in updates.values() for u in us})
    born = [parse_tensor(t)[0] for v in tg.variables.values() for g in v.gradients
            for t in g.tensors if t]
    stepped = ir.descendants([b for b in born if b in ir]) if born else set()
    optimizer = [w for w in writes if w in stepped and w not in extra]
    loss = [parse_tensor(step.loss)[0]] if step.loss else []
    loss = [t for t in loss if t in ir]
    early = _value_sources(ir, loss + optimizer)
    source_of = _value_sources(ir, [w for w in writes if w not in early], dict(early))
    points = {var: sorted({p for r in tg.variables[var].reads if r in source_of
                           for p, _ in _read_points(ir, r, source_of)})
              for var in updates}
    marked = [p for ps in points.values() for p in ps] + writes
    before = _ordered_after(ir, run | set(loss), marked)
    guards = Guards(ir)

    def phase(node, is_write):
        if is_write:
            return _OPTIMIZER if node in stepped and node not in extra else _OTHER
        return _EARLY if node in early else _LATE

    found = []
    for var in sorted(updates):
        events = sorted([(phase(p, False), created[p], p, False) for p in points[var]]
                        + [(phase(w, True), created[w], w, True) for w in updates[var]])
        for i, (a_phase, _, a, a_writes) in enumerate(events):
            for b_phase, _, b, b_writes in events[i + 1:]:
                if (a_writes or b_writes) and a != b and not (
                        before(a, b) or before(b, a) or guards.exclusive(a, b)):
                    found.append(Order(a, b, var, step.name, (a_phase, b_phase)))
    return found


def runs_before(ir: GraphIR, a: str, b: str) -> bool:
    """Whether a path of data or control edges leads from ``a`` to ``b``, not through a data
    input of a shape-only op (what ``races`` counts as an order: Grappler folds those)."""
    seen, stack = {b}, [b]
    while stack:
        node = stack.pop()
        only = set(ir.control_inputs(node)) if ir.op(node) in _SHAPE_READERS else None
        for src in ir.predecessors(node):
            if only is not None and src not in only:
                continue
            if src == a:
                return True
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return False


def _value_sources(ir: GraphIR, targets: list, source_of: dict | None = None) -> dict:
    """{node: the first of ``targets`` whose value depends on it} (``GraphIR.value_sources``
    of each, in one sweep); ``source_of``: such a dict to extend (its nodes are not swept
    again). Which target claims a node does not depend on the order a sweep takes."""
    source_of = {} if source_of is None else source_of
    node_table, pred = ir.g._node, ir.g._pred
    for target in targets:
        if target in source_of:
            continue
        source_of[target] = target
        stack = [target]
        while stack:
            node = stack.pop()
            if node_table[node]["op"] in _SHAPE_READERS:
                continue
            for src, keys in pred[node].items():
                if src not in source_of and keys is not CONTROL_KEYS and (
                        len(keys) > 1 or CONTROL_KEY not in keys):  # a data input
                    source_of[src] = target
                    stack.append(src)
    return source_of


def _read_points(ir: GraphIR, read: str, source_of: dict) -> list:
    """(node, target) pairs where ``read``'s value is taken: the read itself (a resource
    variable's ReadVariableOp copies it), or for a ref variable's snapshot the first
    consumers through aliasing ops that some target's value depends on (not a shape read)."""
    if ir.op(read) not in _ALIASING:
        return [(read, source_of[read])]
    points, seen, stack = [], {read}, [read]
    while stack:
        node = stack.pop()
        for dst, _ in ir.consumers(node):
            if dst in seen or dst not in source_of or ir.op(dst) in _SHAPE_READERS:
                continue
            seen.add(dst)
            if ir.op(dst) in _ALIASING:
                stack.append(dst)
            else:
                points.append((dst, source_of[dst]))
    return points or [(read, source_of[read])]


class Guards:
    """Which branch of which legacy ``tf.cond`` each node runs in: the (predicate, Switch
    output port) pairs it depends on, short of a Merge (after which both branches meet). Two
    nodes in opposite branches of one predicate never both run (loss scaling's reset of
    ``good_steps`` and its increment)."""

    def __init__(self, ir: GraphIR):
        self.ir, self._of = ir, {}

    def of(self, name: str) -> frozenset:
        if name not in self._of:
            found, seen, stack = set(), {name}, [name]
            while stack:
                node = stack.pop()
                if self.ir.op(node) in ("Merge", "RefMerge"):
                    continue
                for src, port in self.ir.inputs(node):
                    if self.ir.op(src) in ("Switch", "RefSwitch"):
                        found.add((self.ir.input(src, 1), port))
                for src in self.ir.predecessors(node):
                    if src not in seen:
                        seen.add(src)
                        stack.append(src)
            self._of[name] = frozenset(found)
        return self._of[name]

    def exclusive(self, a: str, b: str) -> bool:
        theirs = self.of(b)
        return any((pred, 1 - port) in theirs for pred, port in self.of(a))


def _ordered_after(ir: GraphIR, closure: set, marked: list):
    """``before(a, b)``: whether an ordering path leads from marked node ``a`` to marked node
    ``b``, over ``closure`` and the marked nodes' ancestors: a sweep in topological order, each
    node carrying a bitmask of the marked nodes before it. A legacy while loop is a cycle (its
    NextIteration feeds its Merge), so a graph with one is swept over its strongly connected
    components (networkx, slower: apply runs this on every graph)."""
    nodes = set(closure)
    for name in marked:
        if name not in nodes:
            nodes |= ir.ancestors(name)
    index = {name: i for i, name in enumerate(dict.fromkeys(marked))}
    node_table = ir.g._node
    # the nodes only whose control inputs order them (a shape read's data input does not)
    shape_readers = {n for n in nodes if node_table[n]["op"] in _SHAPE_READERS}
    if any(node_table[n]["op"] in ("NextIteration", "RefNextIteration") for n in nodes):
        return _ordered_after_loops(ir, nodes, shape_readers, index)
    mask = {}
    for name, i in index.items():
        mask[name] = mask.get(name, 0) | 1 << i
    # only what a marked node reaches can carry a mark: the sweep takes those alone (a third
    # of a transformer's step is not: constants, shapes, the input)
    reached = reached_within(ir.g._succ, index, nodes)
    _carry_masks(ir.g, reached, shape_readers & reached, mask)
    return lambda a, b: a != b and bool(mask.get(b, 0) >> index[a] & 1)


def _ordering_successors(succ: dict, name: str, nodes: set, shape_readers: set) -> list:
    """The nodes of ``nodes`` that ``name`` orders: those it feeds, shape reads only through
    a control edge."""
    return [dst for dst, keys in succ[name].items() if dst in nodes
            and (dst not in shape_readers or CONTROL_KEY in keys)]


def _carry_masks(g, nodes: set, shape_readers: set, mask: dict) -> None:
    """OR each node's ``mask`` into every node it orders (``_ordering_successors``), taking
    the acyclic ``nodes`` in topological order (Kahn's: a node is taken once every node
    ordering it was). A graph TF wrote is mostly in topological order already: one sweep in
    graph order (which reads memory in order) takes most nodes, Kahn's stack the rest."""
    pred, succ = g._pred, g._succ
    waiting = {}
    for name in g._node:
        if name not in nodes:
            continue
        if name in shape_readers:
            waiting[name] = sum(1 for src, keys in pred[name].items()
                                if src in nodes and CONTROL_KEY in keys)
        else:
            waiting[name] = len(pred[name].keys() & nodes)

    def take(name: str, ready: list | None) -> None:
        here = mask.get(name, 0)
        for dst, keys in succ[name].items():
            if dst in nodes and (dst not in shape_readers or CONTROL_KEY in keys):
                if here:
                    mask[dst] = mask.get(dst, 0) | here
                left = waiting[dst] = waiting[dst] - 1
                if not left and ready is not None:
                    ready.append(dst)

    passed = []
    for name, count in waiting.items():
        if count:
            passed.append(name)
        else:
            take(name, None)
    ready = [name for name in passed if not waiting[name]]
    while ready:
        take(ready.pop(), ready)


def _ordered_after_loops(ir: GraphIR, nodes: set, shape_readers: set, index: dict):
    """``_ordered_after`` where ``nodes`` hold a legacy while loop: over the condensation of
    their strongly connected components."""
    import networkx as nx
    order = nx.DiGraph()
    order.add_nodes_from(nodes)
    succ = ir.g._succ
    order.add_edges_from((a, b) for a in nodes
                         for b in _ordering_successors(succ, a, nodes, shape_readers))
    condensed = nx.condensation(order)
    component = condensed.graph["mapping"]
    mask = {}
    for name, i in index.items():
        mask[component[name]] = mask.get(component[name], 0) | 1 << i
    for c in nx.topological_sort(condensed):
        here = mask.get(c, 0)
        if here:
            for dst in condensed.successors(c):
                mask[dst] = mask.get(dst, 0) | here
    return lambda a, b: a != b and bool(mask.get(component[b], 0) >> index[a] & 1)
