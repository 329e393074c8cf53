"""global-state: a non-trainable variable the step moves from the batch (a count of the
examples seen, a running mean of the reward kept as a baseline, the largest loss so far)
moves in every replica as it does on one device.

Each replica has its own copy of such a variable (no gradient of it is all-reduced) and its
write reads the replica's slice: it counts 8 examples where one device counts 16, averages 8
rewards. The copies drift apart and the checkpoint saves replica 0's. Where the value a write
stores or adds is a sum, count, mean, max or min over the batch (graphxform.replica_values),
one device's value is the replicas' values combined so: every replica's write reads that
combination (a CollectiveReduceV2) instead, all copies make one device's write and stay equal.
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
import itertools

from graphxform import opdefs, replica_values
from graphxform.ir import tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.cross_replica import whole_batch_copies
from graphxform.pipeline import Pass, PassResult

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
    saved (not a metric's local total) and not batch norm's moving statistics."""
    from graphxform.equivalence import MOVING_STATISTIC
    return not var.local and not MOVING_STATISTIC.search(var.name)


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
        for name in sorted(plan):
            for write, (merge, final) in plan[name]:
                source = ir.input(first + write, 1)
                key = next(keys)
                tensor = tensor_name(source[0][len(first):], source[1])
                scope = f"{SCOPE}{key - INSTANCE_KEYS}/"
                shared_on = ir.node(name)["device"] if self.shared else None
                for prefix, value in whole_batch_copies(ir, build, ctx.devices, tensor, key,
                                                        scope, merge, final, shared_on):
                    ir.set_input(prefix + write, 1, value)
                combined.append(write)
        if not combined:
            return PassResult(modified=False, summary={"left to the contract": sorted(
                set(writes) - set(plan))})
        return PassResult(modified=True, summary={
            "kept equal": sorted(plan), "writes combined across replicas": combined,
            "collectives_per_replica": 0 if self.shared else len(combined)})


def _plan(ir, writes: dict) -> dict:
    """{variable: [(write, (merge, final)) for each write whose value needs combining]} for
    the variables all of whose writes can be combined (or need not be)."""
    first = replica_prefix(0)
    settled = set(writes)
    while settled:
        copies = set()
        for name in settled:
            for write in writes[name]:
                copies.update(n for n in ir.ancestors(first + write) if n.startswith(first))
        values = replica_values.classify(ir, first, copies=sorted(copies),
                                         settled={first + name for name in settled})
        plan, failed = {}, set()
        for name in sorted(settled):
            steps = [_combination(ir, values, first + write) for write in writes[name]]
            if any(step is False for step in steps):
                failed.add(name)
            else:
                plan[name] = [(w, step) for w, step in zip(writes[name], steps) if step]
        if not failed:
            return plan
        settled -= failed
    return {}


def _combination(ir, values, write: str):
    """How replica 0's ``write`` must combine its value across replicas: (merge, final); None
    when the value is equal on every replica already; False when no combination gives one
    device's value."""
    if ir.op(write) not in WRITES or len(ir.inputs(write)) < 2:
        return False
    source = ir.input(write, 1)
    kind = values.of(*source)
    if kind in _EQUAL:
        return None
    combine = _COMBINE.get(kind)
    if combine is None:
        return False
    if combine[1] == "Div" and opdefs.output_dtype(ir, *source) not in _FLOATS:
        return False  # a mean of integers is not the replicas' mean
    if any(ir.op(n) in _FRAME_OPS for n in ir.ancestors(write)):
        return False
    return combine
