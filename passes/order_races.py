"""order-races: one order, the same in every replica, for what the input's step runs in none.

A step may read or write a variable in no order with another write of it (WGAN's weight
clipping, ``p.assign(tf.clip_by_value(p, -c, c))``, grouped with the critic's optimizer step;
graphxform/fetch_races.py). On one device TF picks one order per run. Replicas that each keep a
copy of the variable each pick their own: one clips and then steps, another steps and then
clips, and the copies part and stay apart, a state no run of the original on one device gives.

Runs first, on the input graph, so that `replicate` copies the order into every replica (and a
shared copy, ps's, runs it once): it adds a control edge for every pair
``fetch_races.step_orders`` finds, in the order it chooses (reads the loss and the optimizer
compute from, then the optimizer's writes, then the other writes: clipping after the step, as
the WGAN authors mean it). Any acyclic order is a run one device may make, so the emitted graph
trains as the original may. An edge that would close a cycle, leave a legacy while loop's frame
or hang a node outside a ``tf.cond`` branch on one inside it (it would never run when the
branch is not taken) cannot be added: refused, naming the two ops, unless both are increments
(``assign_add``), which add up alike in either order, or unless ``strict`` is off: ps keeps
one copy of every variable, which one run steps and clips in one of the original's orders, and
independent and model-average replicas train apart by design; there the pair is left as the
original has it.

The edge makes the later op wait on the earlier one wherever it runs: running the clipping on
its own, outside the step, now runs the step's update first.

A write no step runs (wiseodd's WGAN fetches its clipping beside the critic's step,
``sess.run([D_solver, D_loss, clip_D])``) gets no edge: run on its own it would run a step
too. Fetched with a step, each replica orders the two its own way; the pass lists these
(``fetch_races.beside_steps``, in its summary as ``unordered_beside``), `apply` warns about
them, and `run`/`verify` run such a fetch in a session.run of its own after the step."""

from __future__ import annotations

import dataclasses

from graphxform import fetch_races
from graphxform.errors import ContractError
from graphxform.pipeline import Pass, PassResult


@dataclasses.dataclass
class OrderRaces(Pass):
    name = "order-races"
    strict: bool = True  # refuse a pair it cannot order (replicas that keep copies would part)

    def run(self, ir, ctx):
        if "replicate" in ctx.state:
            raise ContractError("order-races must run before replicate (every replica copies "
                                "the order it adds)")
        orders = fetch_races.step_orders(ir, ctx.training)
        added = []
        if orders:
            frames = _frames(ir)
            guards = fetch_races.Guards(ir)
        # neighbouring phases first: the step's update before the clipping's read orders the
        # forward pass's reads before the clipping's write through it, with no edge of its own
        for order in sorted(orders, key=lambda o: o.phases[1] - o.phases[0]):
            if fetch_races.runs_before(ir, order.before, order.after):
                continue  # an edge added before orders them already
            problem = _problem(ir, order, frames, guards)
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
            ir.add_control_input(order.after, order.before)
            added.append((order.before, order.after))
        # a write no step runs cannot wait on the step: run alone, it would run a step too
        beside = (fetch_races.beside_steps(ir, ctx.training)
                  if self.strict and len(ctx.devices) > 1 else [])
        ctx.state[self.name] = {"ordered": added, "beside": beside}
        return PassResult(modified=bool(added), summary={"ordered": len(added),
                                                         "unordered_beside": beside})


def _problem(ir, order, frames: dict, guards) -> str | None:
    """Why ``order.before`` cannot be made to run before ``order.after`` (None: it can)."""
    if order.after in ir.ancestors(order.before):
        return "the other order is forced by what the step added before: a cycle"
    if frames.get(order.before) != frames.get(order.after):
        return "a control edge cannot cross a while loop's frame"
    if not guards.of(order.before) <= guards.of(order.after):
        return (f"'{order.before}' runs in a tf.cond branch '{order.after}' is not in, and "
                "would stop it when the branch is not taken")
    return None


def _frames(ir) -> dict:
    """{node: the index of its innermost legacy while loop (the smallest frame holding it)}."""
    from graphxform.functions import legacy_loop_frames
    found = {}
    for index, members in enumerate(sorted(legacy_loop_frames(ir), key=len, reverse=True)):
        found.update(dict.fromkeys(members, index))
    return found
