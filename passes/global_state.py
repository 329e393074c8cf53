"""global-state: a non-trainable variable the step moves from the batch (a count of the
examples seen, a running mean of the reward kept as a baseline, the largest loss so far)
moves in every replica as it does on one device.

Each replica has its own copy of such a variable (no gradient of it is all-reduced) and its
write reads the replica's slice: it counts 8 examples where one device counts 16, averages 8
rewards. The copies drift apart and the checkpoint saves replica 0's. Where the value a write
stores or adds is a sum, count, mean, max or min over the batch (graphxform.replica_values),
one device's value is the replicas' values combined so: every replica's write reads that
combination (a CollectiveReduceV2) instead, all copies make one device's write and stay equal.
Where the value is a function of such statistics and of values equal on every replica
(quantization-aware training's range, an exponential moving average of the batch's max:
``assign_moving_average(rmax, reduce_max(h), decay)``), the statistics nearest to the value
are combined, for the nodes on the way to the write, and the value is then one device's (its
class is found again with them equal). Statistics inside a gradient are never combined.
Under the ps strategies the variable is one, on a ps task, written by replica 0's update alone
(insert-accumulators drops the others'), which then read replica 0's slice: there one node
on the variable's task combines every replica's value (an AddN, say), and the update reads it.

The value often reads the variable itself (``b.assign(0.9 * b + 0.1 * mean(r))``, an
``assign_moving_average``): it is classified as if the copies were equal, which holds once all
of the variable's writes are combined, so a variable is synchronised only when each of its
writes can be, and the classification is repeated without the variables that cannot (a value
reading one of those may differ after all). Left as it is, for the contract check to refuse:
a scatter of the slice's rows (a memory bank), a value no rule classes, a write inside a legacy
cond or while loop (a collective there would wait for replicas whose branch is not taken).

Batch norm's moving statistics are the documented exception (each replica's own, unless
--sync-batch-norm), and metrics' local totals are not saved: merge-fetches serves them added
up."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from graphxform import opdefs, replica_values
from graphxform.ir import tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.cross_replica import whole_batch_copies
from graphxform.pipeline import Pass, PassResult
from graphxform.training import gradient_scope

SCOPE = "global_state/"
INSTANCE_KEYS = 1 << 21  # apart from all-reduce's (1, 2, ..., 1 << 24 on) and the other passes'
WRITES = frozenset({"Assign", "AssignVariableOp", "AssignAdd", "AssignAddVariableOp",
                     "AssignSub", "AssignSubVariableOp"})
_FRAME_OPS = frozenset({"Switch", "RefSwitch", "Enter", "RefEnter"})
_FLOATS = frozenset({1, 2, 14, 19})  # float, double, bfloat16, half
# how one device's value follows from the replicas' values: (merge, final)
_COMBINE = {replica_values.SUM: ("Add", "Id"), replica_values.COUNT: ("Add", "Id"),
            replica_values.MEAN: ("Add", "Div"), replica_values.MAX: ("Max", "Id"),
            replica_values.MIN: ("Min", "Id")}
_EQUAL = frozenset({replica_values.IDENTICAL, replica_values.SAME})


def kept_equal(var) -> bool:
    """Whether the contract keeps ``var`` equal on every replica when the step moves it: it is
    saved (not a metric's local total) and not batch norm's moving statistics (by name or by
    structure: graphxform/moving_statistics.py)."""
    return not var.local and not var.moving_statistic


def state_variables(tg) -> list:
    """The variables the contract requires to stay equal on every replica although no
    gradient updates them: non-trainable ones a training step writes that it keeps equal."""
    return sorted((v for v in tg.variables.values()
                   if v.role == "statistic" and v.updates and kept_equal(v)),
                  key=lambda v: v.name)


@dataclasses.dataclass
class GlobalState(Pass):
    """``shared``: the ps strategies' form. The variable is one, on a ps task, and one client
    runs every replica: one node reads every replica's value and combines it, every replica's
    write reads that, and insert-accumulators keeps replica 0's write alone."""
    name = "global-state"
    shared: bool = False

    def run(self, ir, ctx):
        if len(ctx.devices) < 2:
            return PassResult(modified=False)
        first = replica_prefix(0)
        held = (lambda v: v.name in ir) if self.shared else (lambda v: first + v.name in ir)
        writes = {v.name: [w for w in v.updates if first + w in ir]
                  for v in state_variables(ctx.training) if held(v)}
        writes = {name: found for name, found in writes.items() if found}
        if not writes:
            return PassResult(modified=False)
        plan = _plan(ir, writes)
        build = Builder(ir, self.name)
        keys = itertools.count(INSTANCE_KEYS)
        combined = []
        for (node, port), (merge, final, readers, name) in _statistics(plan).items():
            key = next(keys)
            tensor = tensor_name(node[len(first):], port)
            scope = f"{SCOPE}{key - INSTANCE_KEYS}/"
            shared_on = ir.node(name)["device"] if self.shared else None
            for prefix, value in whole_batch_copies(ir, build, ctx.devices, tensor, key,
                                                    scope, merge, final, shared_on):
                mine = {prefix + r[len(first):] for r in readers}
                ir.replace_all_uses_with(f"{prefix}{node[len(first):]}:{port}", value,
                                         where=mine.__contains__)
            combined.append(tensor)
        if not combined:
            return PassResult(modified=False, summary={"left to the contract": sorted(
                set(writes) - set(plan))})
        return PassResult(modified=True, summary={
            "kept equal": sorted(plan), "writes combined across replicas": combined,
            "collectives_per_replica": 0 if self.shared else len(combined)})


def _statistics(plan: dict) -> dict:
    """{(statistic, port): (merge, final, its readers to rewire, a variable it moves)}: each
    statistic of the batch the plan combines once, for every write that reads it."""
    found = {}
    for name in sorted(plan):
        for _write, combos in plan[name]:
            for source, merge, final, readers in combos:
                if source in found:
                    found[source][2].update(readers)
                else:
                    found[source] = (merge, final, set(readers), name)
    return found


def _plan(ir, writes: dict) -> dict:
    """{variable: [(write, [((statistic, port), merge, final, readers)]) for each write whose
    value needs combining]} (replica 0's copies) for the variables all of whose writes can be
    combined (or need not be)."""
    first = replica_prefix(0)
    settled = set(writes)
    while settled:
        copies = set()
        for name in settled:
            for write in writes[name]:
                copies.update(n for n in ir.ancestors(first + write) if n.startswith(first))
        classify = functools.partial(replica_values.classify, ir, first, copies=sorted(copies),
                                     settled={first + name for name in settled})
        values = classify()
        plan, failed = {}, set()
        for name in sorted(settled):
            steps = [_combination(ir, values, classify, first + write) for write in writes[name]]
            if any(step is False for step in steps):
                failed.add(name)
            else:
                plan[name] = [(w, step) for w, step in zip(writes[name], steps) if step]
        if not failed:
            return plan
        settled -= failed
    return {}


def _combination(ir, values, classify, write: str):
    """How replica 0's ``write`` must combine across replicas what it reads: a list of
    ((statistic, port), merge, final, readers), the statistics of the batch to combine and
    the nodes to read the combination; None when the value is equal on every replica already;
    False when no combination gives one device's value.

    The value is a statistic itself (a count, the batch's max: the write reads its
    combination), or a function of such statistics that is equal on every replica once each
    reads their combinations (an exponential moving average of the batch's max,
    ``assign_moving_average(rmax, reduce_max(h))``, reads the state and the batch's max): the
    statistics its value reads nearest to the value, whose readers there are of no such class,
    are combined for those readers, and the value's class is found again with them equal."""
    if ir.op(write) not in WRITES or len(ir.inputs(write)) < 2:
        return False
    if any(ir.op(n) in _FRAME_OPS for n in ir.ancestors(write)):
        return False
    source = ir.input(write, 1)
    kind = values.of(*source)
    if kind in _EQUAL:
        return None
    if kind in _COMBINE:
        statistics = {source: {write}}
    else:
        statistics = _nearest_statistics(ir, values, source)
        if not statistics:
            return False
        equal = {stat: replica_values.IDENTICAL for stat in statistics}
        if classify(forced=equal).of(*source) not in _EQUAL:
            return False
    combos = []
    for stat, readers in sorted(statistics.items()):
        merge, final = _COMBINE[values.of(*stat)]
        if final == "Div" and opdefs.output_dtype(ir, *stat) not in _FLOATS:
            return False  # a mean of integers is not the replicas' mean
        combos.append((stat, merge, final, readers))
    return combos


def _nearest_statistics(ir, values, source) -> dict | None:
    """{(statistic, port): {its readers on the way to ``source``}}: the tensors ``source``'s
    value reads (through data edges: what it merely waits on, the optimizer's update, is not
    its value) that are a sum, count, mean, max or min over the batch and are read there by a
    node of no such class (the ones that would make the value one device's, combined); None
    when one of them feeds another (combining both would count one twice) or lies in a
    gradient (its insides are the gradient's, scaled for the replica's slice)."""
    first = replica_prefix(0)
    reads = {n for n in ir.value_sources(source[0]) if n.startswith(first)}
    found = {}
    for node in reads:
        if values.of(node, 0) in _COMBINE or values.of(node, 0) in _EQUAL:
            continue
        for src, port in ir.inputs(node):
            if src in reads and values.of(src, port) in _COMBINE:
                found.setdefault((src, port), set()).add(node)
    stats = {node for node, _ in found}
    if any(gradient_scope(n[len(first):]) for n in stats | {r for rs in found.values()
                                                           for r in rs}):
        return None
    if any(stats & (set(ir.ancestors(node)) - {node}) for node in stats):
        return None
    return found
