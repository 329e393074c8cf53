"""order-races: one order, the same in every replica, for what the input's step runs in none.

A step may read or write a variable in no order with another write of it (WGAN's weight
clipping, ``p.assign(tf.clip_by_value(p, -c, c))``, grouped with the critic's optimizer step;
graphxform/fetch_races.py). On one device TF picks one order per run. Replicas that each keep a
copy of the variable each pick their own: one clips and then steps, another steps and then
clips, and the copies part and stay apart, a state no run of the original on one device gives.

Runs first, on the input graph, so that `replicate` copies the order into every replica (and a
shared copy, ps's, runs it once): it orders every pair ``fetch_races.step_orders`` finds, in
the order it chooses (reads the loss and the optimizer compute from, then the optimizer's
writes, then the other writes: clipping after the step, as the WGAN authors mean it). Any
acyclic order is a run one device may make, so the emitted graph trains as the original may.

The order holds inside the step only. A control edge makes the later op wait on the earlier
one wherever it runs, and the user may run the later op on its own (WGAN code clips the
initial weights once, ``sess.run(clip_D)``): it would then run the earlier op and everything
that op needs too, the step's update with its gradient. So the edge goes on the later op
itself only where that adds nothing with an effect to such a run (reads and pure arithmetic:
BERT's increment of global_step waiting on the learning rate's read of it). Otherwise the step
runs ordered copies (``order_races/<name>``, one scope per step) of the later op and of
everything of the step that waits on it (the clipping's read, its clip_by_value, its assign
and the read of its value), and the step's op (tf.group's NoOp) reads the copies instead; the
originals keep their names, run by no step, and run alone as they did. The analysis in
``ctx.training`` follows (the copies are the step's writes and reads of its variables, so
later passes place and share them as the originals were), `replicate` copies the copies like
any node, merge-fetches serves the originals' names, and the contract proves the order on
the copies the step runs. An original fetched in one session.run beside the step runs once
more, outside the order, as a write no step runs does (below; `inspect` on the output names
them so).

A pair that cannot be ordered so is refused, naming the two ops: an edge that would close a
cycle, leave a legacy while loop's frame or hang a node outside a ``tf.cond`` branch on one
inside it (it would never run when the branch is not taken), and copies that would take the
step's loss, an optimizer's update or control flow along (the loss fetched alone, or the
optimizer's update run alone, would run the step). Not refused: two increments
(``assign_add``), which add up alike in either order, and any pair when ``strict`` is off: ps
keeps one copy of every variable, which one run steps and clips in one of the original's
orders, and independent and model-average replicas train apart by design; there the pair is
left as the original has it.

A write no step runs (wiseodd's WGAN fetches its clipping beside the critic's step,
``sess.run([D_solver, D_loss, clip_D])``) gets no order: nothing can order it against the
step in that one session.run only. Fetched with a step, each replica orders the two its own
way; the pass lists these (``fetch_races.beside_steps``, in its summary as
``unordered_beside``), `apply` warns about them, and `run`/`verify` run such a fetch in a
session.run of its own after the step."""

from __future__ import annotations

import dataclasses

from graphxform import fetch_races, opdefs
from graphxform.errors import ContractError
from graphxform.ir import parse_tensor
from graphxform.pipeline import Pass, PassResult
from graphxform.training import (PLACEHOLDER_OPS, VARIABLE_OPS, gradient_scope,
                                 is_apply_op)

SCOPE = "order_races"
# legacy control flow: a copy of part of a frame or of a cond's Merge is not one
_CONTROL_FLOW = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch",
                           "Merge", "RefMerge", "NextIteration", "RefNextIteration",
                           "LoopCond"})


@dataclasses.dataclass
class OrderRaces(Pass):
    name = "order-races"
    strict: bool = True  # refuse a pair it cannot order (replicas that keep copies would part)

    def run(self, ir, ctx):
        if "replicate" in ctx.state:
            raise ContractError("order-races must run before replicate (every replica copies "
                                "the order it adds)")
        tg = ctx.training
        orders = fetch_races.step_orders(ir, tg)
        # a write no step runs cannot wait on the step: run alone, it would run a step too
        beside = (fetch_races.beside_steps(ir, tg)
                  if self.strict and len(ctx.devices) > 1 else [])
        added, copied = [], 0
        if orders:
            frames = _frames(ir)
            guards = fetch_races.Guards(ir)
            stepped = _stepped(ir, tg)
            steps = {step.name: _Step(ir, tg, step, stepped) for step in tg.steps}
        # neighbouring phases first: the step's update before the clipping's read orders the
        # forward pass's reads before the clipping's write through it, with no edge of its own
        for order in sorted(orders, key=lambda o: o.phases[1] - o.phases[0]):
            step = steps[order.step]
            before, after = step.runs(order.before), step.runs(order.after)
            if fetch_races.runs_before(ir, before, after):
                continue  # an order added before orders them already
            problem = _problem(ir, before, after, frames, guards)
            late = None if problem else step.late(before, after)
            if late:
                problem = step.uncopyable(before, late)
            accumulate = {ir.op(order.before), ir.op(order.after)} <= fetch_races.ACCUMULATING
            if problem and (accumulate or not self.strict or len(ctx.devices) < 2):
                continue
            if problem:
                raise ContractError(
                    f"step '{order.step}' runs '{order.before}' ({ir.op(order.before)}) and "
                    f"'{order.after}' ({ir.op(order.after)}), which read or write variable "
                    f"'{order.variable}', in no order, and each replica would pick its own, so "
                    f"their copies of it would part; they cannot be ordered ({problem}): order "
                    "them in the model (tf.control_dependencies) or train on one device")
            if late:
                after = step.copy(late, after, self.name)
                copied += len(late)
            ir.add_control_input(after, before)
            added.append((before, after))
        ctx.state[self.name] = {"ordered": added, "beside": beside}
        return PassResult(modified=bool(added), summary={"ordered": len(added),
                                                         "copied": copied,
                                                         "unordered_beside": beside})


class _Step:
    """One step of the input as the pass orders it: which copies it runs in place of which of
    its ops (``runs``), and what of it must be copied for an op to wait only inside it."""

    def __init__(self, ir, tg, step, stepped: set):
        self.ir, self.tg, self.step, self.stepped = ir, tg, step, stepped
        self.root = parse_tensor(step.name)[0]
        losses = [parse_tensor(t)[0] for t in (step.loss, *step.towers) if t]
        self.loss = ir.ancestors_of([t for t in losses if t in ir])
        self.copies = {}  # original -> the copy the step runs instead
        self.scope = None

    def runs(self, name: str) -> str:
        return self.copies.get(name, name)

    def late(self, before: str, after: str) -> list | None:
        """What the step must run copies of for ``after`` to wait on ``before`` in it only:
        None (no copy) where the edge adds nothing with an effect to a run of ``after`` alone,
        or ``after`` runs in the step only (it is the step, or a copy); else ``after`` and
        what of the step runs after it, its op aside."""
        if after == self.root or after in self.copies.values():
            return None
        if not _effects(self.ir, before, after):
            return None
        waiting = self.ir.descendants([after]) & self.step.closure
        return sorted(waiting - {self.root} - set(self.copies.values()))

    def uncopyable(self, before: str, late: list) -> str | None:
        """Why ``late`` cannot be copied for the step alone to wait on ``before`` (None: it
        can)."""
        fed = next((n for n in late if n in self.loss), None)
        if fed:
            return (f"the step's loss would wait on '{before}' through '{fed}', so fetching "
                    "the loss alone would run it")
        update = next((n for n in late if n in self.stepped or is_apply_op(self.ir.op(n))
                       or gradient_scope(n)), None)
        if update:
            return (f"'{update}' computes or applies a gradient and would wait on '{before}' "
                    "wherever it runs, alone too")
        flow = next((n for n in late if self.ir.op(n) in _CONTROL_FLOW), None)
        if flow:
            return (f"'{flow}' ({self.ir.op(flow)}) would wait on '{before}', and a copy for "
                    "the step alone cannot take part of a tf.cond or while loop")
        return None

    def copy(self, late: list, after: str, created_by: str) -> str:
        """Copy ``late`` for the step, which then runs the copies in place of the originals;
        returns ``after``'s copy. The analysis follows, as partition-variables' does: the
        copies are the step's writes and reads of its variables (the passes after place,
        share and prove them), the originals are no longer the step's."""
        ir = self.ir
        if self.scope is None:
            self.scope = ir.unique_scope(SCOPE)
        mapping = ir.copy_nodes(late, self.scope, created_by=created_by)
        readers = {self.root, *self.copies.values()}
        for name, copy in mapping.items():
            ir.replace_all_uses_with(name, copy, where=readers.__contains__)
        self.copies.update(mapping)
        self.step.closure = (self.step.closure - set(late)) | set(mapping.values())
        others = [s.closure for s in self.tg.steps if s is not self.step]
        for var in self.tg.variables.values():  # an original another step runs stays its
            var.updates = [w for u in var.updates for w in (
                [mapping[u]] + [u] * any(u in c for c in others) if u in mapping else [u])]
            var.reads += [mapping[r] for r in var.reads if r in mapping]
        return mapping[after]


def _effects(ir, before: str, after: str) -> bool:
    """Whether ``after``, made to wait on ``before`` and run alone, would run something more
    with an effect or that needs a feed: a write, a random draw, an input pipeline's next
    batch, a placeholder, a variable it does not read (reads of those it reads, and
    arithmetic, count as none)."""
    more = ir.ancestors(before) - ir.ancestors(after)
    return any(ir.op(n) in PLACEHOLDER_OPS or ir.op(n) in VARIABLE_OPS
               or (ir.op(n) != "ReadVariableOp" and opdefs.is_stateful(ir, ir.op(n)))
               for n in more)


def _stepped(ir, tg) -> set:
    """What the gradients reach: the optimizer's updates and what follows them."""
    born = [parse_tensor(t)[0] for v in tg.variables.values() if v.gradient
            for t in v.gradient.tensors if t]
    born = [b for b in born if b in ir]
    return ir.descendants(born) if born else set()


def _problem(ir, before: str, after: str, frames: dict, guards) -> str | None:
    """Why ``before`` cannot be made to run before ``after`` (None: it can)."""
    if after in ir.ancestors(before):
        return "the other order is forced by what the step added before: a cycle"
    if frames.get(before) != frames.get(after):
        return "a control edge cannot cross a while loop's frame"
    if not guards.of(before) <= guards.of(after):
        return (f"'{before}' runs in a tf.cond branch '{after}' is not in, and would stop it "
                "when the branch is not taken")
    return None


def _frames(ir) -> dict:
    """{node: the index of its innermost legacy while loop (the smallest frame holding it)}."""
    from graphxform.functions import legacy_loop_frames
    found = {}
    for index, members in enumerate(sorted(legacy_loop_frames(ir), key=len, reverse=True)):
        found.update(dict.fromkeys(members, index))
    return found
