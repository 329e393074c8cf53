"""summed-losses: a step whose loss is a sum over the batch (``reduction=SUM``; a sum divided by
a constant batch size, as the TF1 PTB language model and tf.nn.compute_average_loss write it)
trains with the sum of the replicas' gradients, not their mean.

Every synchronous strategy averages the replicas' gradients, which is one device's gradient
when each replica's loss is the mean of its slice. A replica's copy of a summed loss is its
slice's share of the batch's sum (the N copies add up to it), so the single-device gradient is
the replicas' sum: N times their mean. tf.gradients starts differentiating from a seed,
``<scope>grad_ys_0``, a Fill of ones; filling it with N instead multiplies every gradient of
that call by N, in each replica, before any reduction, whatever the strategy reduces with. It
is the same factor a mean loss's gradients already carry (a replica's mean divides by B/N, not
B), so what the contract asks of custom gradients and float16 holds alike.

A step qualifies when its loss is shown a sum (graphxform.replica_values) and every gradient
its updates apply comes from one tf.gradients call with one seed; anything else (a
GradientTape's ones_like, several losses differentiated at once) is left as it is, and the
contract refuses it as before."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import replica_values
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, const_value, numpy_dtype, replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.training import gradient_scope


@dataclasses.dataclass
class SummedLosses(Pass):
    name = "summed-losses"

    def run(self, ir, ctx):
        replicas = len(ctx.devices)
        if replicas < 2:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        scaled = []
        for step in ctx.training.steps:
            if not summed_loss(ir, step):
                continue
            seed = seed_of(ctx.training, step)
            if seed is None:
                continue  # the contract refuses it
            fills = [replica_prefix(i) + seed for i in range(replicas)]
            if any(_fill_value(ir, fill) != 1 for fill in fills):
                continue  # grad_ys given by the user: the contract refuses it
            for fill in fills:
                dtype = numpy_dtype(ir.attrs(fill)["T"].type)
                value = build.const(ir.unique_name(fill + "/replicas"),
                                    np.asarray(replicas, dtype=dtype),
                                    device=ir.node(fill).get("device", ""))
                ir.set_input(fill, 1, value + ":0")
            scaled.append(step.name)
        return PassResult(modified=bool(scaled), summary={"steps": len(scaled)})


def summed_loss(ir, step) -> bool:
    """Whether replica 0's copy of ``step``'s loss is a sum over the batch."""
    if not step.loss:
        return False
    node, port = parse_tensor(step.loss)
    copy = replica_prefix(0) + node
    if copy not in ir or not _may_be_sum(ir, copy):
        return False
    copies = [n for n in ir.ancestors(copy) if n.startswith(replica_prefix(0))]
    values = replica_values.classify(ir, replica_prefix(0), copies=copies)
    return values.of(copy, port) == replica_values.SUM


_SUMS = {"Sum", "L2Loss", "AddN", "AddV2", "Add", "Sub"}
_SCALINGS = {"Identity", "Snapshot", "Neg", "Mul", "RealDiv", "Div", "DivNoNan", "Cast"}


def _may_be_sum(ir, node: str, depth: int = 0) -> bool:
    """Whether ``node`` could be a sum over the batch: a Sum, L2Loss, addition or difference,
    reached through scalings. A cheap filter before the classification, which costs a walk over the
    whole forward pass (a mean loss, the common case, is passed over at once); the contract
    classifies every loss again, so a sum this filter missed is refused, never trained."""
    op = ir.op(node)
    if op in _SUMS or depth > 16:
        return True
    inputs = ir.inputs(node)
    return op in _SCALINGS and any(_may_be_sum(ir, src, depth + 1) for src, _ in inputs[:2])


def seed_of(tg, step) -> str | None:
    """``<scope>grad_ys_0``, the one seed of the one tf.gradients call whose gradients the
    step's updates apply (names of the input graph), or None."""
    scopes = {gradient_scope(parse_tensor(t)[0]) for v in tg.variables.values()
              if v.applied_in(step.closure) for t in v.gradient.tensors}
    if len(scopes) != 1 or None in scopes:
        return None
    scope = scopes.pop()
    seed = scope + "grad_ys_0"
    if seed not in step.closure or scope + "grad_ys_1" in step.closure:
        return None
    return seed


def seeds_scaled(ir, tg, step, replicas: int) -> bool:
    """Whether every replica's copy of ``step``'s seed fills with ``replicas`` (this pass
    ran on it): what the contract checks before it accepts a summed loss."""
    seed = seed_of(tg, step)
    return seed is not None and all(
        _fill_value(ir, replica_prefix(i) + seed) == replicas for i in range(replicas))


def _fill_value(ir, fill: str):
    """The scalar a Fill of a Const fills with, or None."""
    if fill not in ir or ir.op(fill) != "Fill" or len(ir.inputs(fill)) < 2:
        return None
    value = const_value(ir, ir.inputs(fill)[1][0])
    return None if value is None or value.size != 1 else value.reshape(-1)[0].item()

