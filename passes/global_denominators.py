"""global-denominators: a loss that divides by a total of the batch's data (a weighted mean,
sum(w * l) / sum(w): tf.compat.v1.losses given `weights`; a masked mean) divides, in every
replica, by the mean over the replicas of that total.

All-reduce averages the replicas' gradients, which is the single-device gradient when each
replica's loss is its slice's share of the batch's loss. For S / M with S and M sums over the
batch, replica i computes S_i / M_i, and the mean of those is not S / M unless every M_i is the
same. Dividing by mean_j M_j instead makes replica i's loss S_i / (M / N), whose mean over the
replicas is S / M, and whose gradient (M does not depend on the variables) averages to the
single-device one. So each such denominator gets a CollectiveReduceV2 (mean) per replica, and
everything in the replica that read it, the forward division and the gradient's, reads the
mean instead.

A denominator qualifies when it depends on the batch's values (not only on its shape: a count
of examples is the same on every equal slice) and on no variable (then the gradient would flow
through it). What this pass does not find, the contract check still refuses."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.all_reduce import GROUP_KEY
from graphxform.passes.split_inputs import SCOPE as SPLIT_SCOPE
from graphxform.pipeline import Pass, PassResult
from graphxform.replica_values import DIVIDE_OPS
from graphxform.training import VARIABLE_OPS

SCOPE = "global_denominators/"
INSTANCE_KEYS = 1 << 23  # apart from the all-reduce pass's buckets and sparse gathers
_FLOATS = frozenset({1, 2, 14, 19})  # float double bfloat16 half: what the collective reduces
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # read a tensor's shape only
# how a loss's value passes on to what the user minimises
_THROUGH = frozenset({"Identity", "AddV2", "Add", "Sub", "Mul", "AddN", "Neg"})


@dataclasses.dataclass
class GlobalDenominators(Pass):
    name = "global-denominators"

    def run(self, ir, ctx):
        tg = ctx.training
        replicas = len(ctx.devices)
        first = replica_prefix(0)
        if replicas < 2:
            return PassResult(modified=False)
        found = []  # in replica 0
        for step in tg.steps:
            node, port = parse_tensor(step.loss) if step.loss else (None, 0)
            if node and first + node in ir:
                found += [d for d in denominators(ir, (first + node, port)) if d not in found]
        if not found:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        for k, tensor in enumerate(found):
            node, port = parse_tensor(tensor[len(first):])
            dtype = opdefs.output_dtype(ir, first + node, port)
            for i, device in enumerate(ctx.devices):
                prefix = replica_prefix(i)
                local = tensor_name(prefix + node, port)
                scope = f"{SCOPE}{k}/{prefix}"
                size = build.const(scope + "group_size", replicas, np.int32, device=device)
                key = build.const(scope + "group_key", GROUP_KEY, np.int32, device=device)
                instance = build.const(scope + "instance_key", INSTANCE_KEYS + k, np.int32,
                                       device=device)
                mean = build.op(scope + "mean", "CollectiveReduceV2",
                                [local, size, key, instance], device=device, T=dtype,
                                merge_op="Add", final_op="Div")
                ir.replace_all_uses_with(local, mean + ":0",
                                         where=lambda n, p=prefix: n.startswith(p))
        return PassResult(modified=True, summary={
            "denominators": [d[len(first):] for d in found]})


def denominators(ir, loss: tuple) -> list[str]:
    """The denominators the value of ``loss`` (node, port) divides by that are totals of the
    batch's values and depend on no variable (see the module docstring), and that this pass
    has not replaced by the replicas' mean already. The contract refuses what is left."""
    found, seen, stack = [], set(), [loss]
    sources = None  # the batch's splits, found when a division asks
    while stack:
        node, port = stack.pop()
        if (node, port) in seen:
            continue
        seen.add((node, port))
        op = ir.op(node)
        inputs = ir.inputs(node)
        if op in DIVIDE_OPS and len(inputs) == 2:
            bottom = inputs[1]
            if sources is None:
                sources = {n for n in ir.nodes_of({"Split"}) if n.startswith(SPLIT_SCOPE)}
            reads = _value_sources(ir, bottom[0])
            if (not bottom[0].startswith(SCOPE) and opdefs.output_dtype(ir, *bottom) in _FLOATS and not reads.isdisjoint(sources)
                    and not any(ir.op(n) in VARIABLE_OPS for n in reads)):
                found.append(tensor_name(*bottom))
            stack.append(inputs[0])
        elif op in _THROUGH:
            stack.extend(inputs)
    return found


def _value_sources(ir, node: str) -> set:
    """What ``node``'s value depends on through data edges, not through ops that read only a
    tensor's shape (a count of examples, an assert on shapes: the same on equal slices)."""
    seen, stack = {node}, [node]
    while stack:
        name = stack.pop()
        if ir.op(name) in _SHAPE_OPS:
            continue
        for src, _ in ir.inputs(name):
            if src not in seen:
                seen.add(src)
                stack.append(src)
    return seen
