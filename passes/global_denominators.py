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
through it): graphxform.contract.batch_denominators finds them, and the contract refuses
what is left."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.contract import batch_denominators
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.all_reduce import GROUP_KEY
from graphxform.pipeline import Pass, PassResult

SCOPE = "global_denominators/"
INSTANCE_KEYS = 1 << 23  # apart from the all-reduce pass's buckets and sparse gathers


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
                found += [d for d in batch_denominators(ir, (first + node, port))
                          if d not in found]
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

