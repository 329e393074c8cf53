"""half-precision: a float16 backward pass computes in every replica what it computes on one device.

Each replica's loss is the mean of its own slice, so every gradient in its backward pass is N
times one device's at the same example; the strategies' mean across replicas undoes the
factor after the fact. In float16 (mixed precision with loss scaling: NVIDIA's float32 master
weights, tf_keras' mixed_float16 with a LossScaleOptimizer) the factor is not harmless: a loss
scale chosen to keep one device just inside float16's range (65504) overflows in a replica, and
every value rounds at another magnitude. So here, in every replica:

- the step's tf.gradients seed (``<scope>grad_ys_0``, a Fill of ones; a tape's ones) holds 1/N,
  or stays 1 for a loss shown a sum over the batch, whose copies carry no factor: each
  replica's backward pass then computes exactly one device's per-example gradients;
- every gradient the step applies is multiplied by N where it is born, in float32 (a float32
  master weight's gradient, after the backward pass's last float16 op), so that the mean across
  replicas is the sum over the slices, which one device's gradient is.

The node born with the gradient keeps its name (``<grad>`` becomes ``Mul(<grad>/unscaled, N)``),
so every pass after this one, and the training analysis, find the gradient where they did.
A step this cannot hold (no single seed of ones, a gradient born in float16 or at a node's
second output, tower gradients: ``obstacle``) is left as it is, and the contract refuses it
naming why."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.gradient_scale import half_precision_gradient
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, const_value, numpy_dtype, replica_prefix
from graphxform.opdefs import output_dtype
from graphxform.passes.summed_losses import scale_seed, seed_of, seed_value, summed_loss
from graphxform.pipeline import Pass, PassResult

SCALED = "/unscaled"  # the born gradient's op, renamed; the name itself is now its times N
_WIDE_FLOATS = {1, 2}  # float32, float64: where the gradient is multiplied by N


@dataclasses.dataclass
class HalfPrecision(Pass):
    name = "half-precision"

    def run(self, ir, ctx):
        replicas = len(ctx.devices)
        if replicas < 2:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        handled = ctx.state.setdefault(self.name, set())
        for step in ctx.training.steps:
            if not _half(ir, step) or obstacle(ir, ctx.training, step, replicas) is not None:
                continue  # the contract refuses it, naming the obstacle
            seed, born = seed_of(ir, ctx.training, step)[0], _born(ir, ctx.training, step)
            factor = 1 if summed_loss(ir, step) else 1 / replicas
            for i in range(replicas):
                prefix = replica_prefix(i)
                if factor != 1:
                    scale_seed(ir, build, prefix, seed, factor)
                for node in born:
                    _times_replicas(ir, build, prefix + node, replicas)
            handled.add(step.name)
        return PassResult(modified=bool(handled), summary={"steps": len(handled)})


def obstacle(ir, tg, step, replicas: int) -> str | None:
    """Why this pass cannot carry ``step``'s gradients at one device's scale, or None."""
    applied = _applied(tg, step)
    if applied is None:
        return "it averages tower gradients"
    if not applied or not step.loss:
        return ("the gradients it applies, and the loss they are of, cannot be found where "
                "tf.gradients made them")
    seed = seed_of(ir, tg, step)
    if seed is None or any(seed_value(ir, replica_prefix(i) + seed[0]) != 1
                           for i in range(replicas)):
        return ("its gradients do not all start from one seed of ones of its loss (one "
                "tf.gradients call or tape of the listed loss, no grad_ys)")
    for node, port in applied:
        copy = replica_prefix(0) + node
        if port != 0 or copy not in ir or output_dtype(ir, copy, 0) not in _WIDE_FLOATS:
            return (f"the gradient '{node}:{port}' is born in float16 or at an output other "
                    "than its op's first (float32 master weights receive theirs in float32)")
    return None


def _half(ir, step) -> bool:
    """Whether replica 0's copy of ``step``'s backward pass computes in float16."""
    prefix = replica_prefix(0)

    def name_of(name):
        return prefix + name if prefix + name in ir else name
    return half_precision_gradient(ir, step.closure, name_of) is not None


def _born(ir, tg, step) -> list[str]:
    """The nodes (input names) whose first output is a gradient ``step`` applies."""
    return sorted({node for node, _ in _applied(tg, step)})


def _applied(tg, step) -> list[tuple] | None:
    """(node, port) of each gradient (a sparse one's values) ``step`` applies; None for a
    towers' average (graphxform/towers.py), which this pass leaves alone."""
    found = []
    for var in tg.variables.values():
        for gradient in var.gradients_applied_in(step.closure):
            if gradient.towers:
                return None
            found.append(parse_tensor(gradient.tensor if gradient.kind == "dense"
                                      else gradient.values))
    return found


def _times_replicas(ir, build: Builder, copy: str, replicas: int) -> None:
    """``copy`` becomes N times what it was: its op moves to ``copy/unscaled``."""
    data = ir.node(copy)
    device, dtype = data.get("device", ""), output_dtype(ir, copy, 0)
    moved = ir.add_node(ir.unique_name(copy + SCALED), ir.op(copy), ir.edge_inputs(copy),
                        device=device, attr=dict(ir.attrs(copy)), created_by=build.created_by)
    n = build.const(ir.unique_name(copy + "/replicas"), np.asarray(replicas,
                                                                   numpy_dtype(dtype)),
                    device=device)
    build.replace(copy, "Mul", [moved, n], device=device, T=dtype)


def holds(ir, tg, step, replicas: int) -> bool:
    """Whether every replica's copy of ``step`` seeds its gradients with one device's scale
    (1/N; 1 for a summed loss) and multiplies each gradient it applies by N where it is born
    (this pass ran on it): what the contract checks before it accepts a float16 backward
    pass."""
    seed, applied = seed_of(ir, tg, step), _applied(tg, step)
    if seed is None or not applied:
        return False
    factor = 1 if summed_loss(ir, step) else 1 / replicas
    for i in range(replicas):
        prefix = replica_prefix(i)
        value = seed_value(ir, prefix + seed[0])
        if value is None or not np.isclose(value, factor, rtol=1e-3, atol=0):
            return False
        if not all(port == 0 and _times_n(ir, prefix + node, replicas)
                   for node, port in applied):
            return False
    return True


def _times_n(ir, node: str, replicas: int) -> bool:
    """Whether ``node`` is a Mul of its moved op by a Const holding N."""
    if node not in ir or ir.op(node) != "Mul":
        return False
    inputs = ir.inputs(node)
    if len(inputs) != 2 or SCALED not in inputs[0][0]:
        return False
    value = const_value(ir, inputs[1][0])
    return value is not None and value.size == 1 and value.reshape(-1)[0] == replicas
