"""split-inputs: the original placeholders stay the entry point; replica i gets the i-th even
slice of the global batch along axis 0.

A global batch that does not divide by the number of replicas fails at run time in the node
`split_inputs/<input>/split`, which `graphxform run` turns into a one-line error."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "split_inputs/"


@dataclasses.dataclass
class SplitInputs(Pass):
    name = "split-inputs"

    def run(self, ir, ctx):
        build = Builder(ir, self.name)
        replicas = len(ctx.devices)
        split = []
        for inp in ctx.training.inputs:
            if not inp.batched or not ir.consumers(inp.name):
                continue
            scope = f"{SCOPE}{inp.name}/"
            axis = build.const(scope + "axis", 0, np.int32)
            node = build.op(scope + "split", "Split", [axis, inp.name], num_split=replicas,
                            T=inp.dtype)
            for i in range(replicas):
                prefix = replica_prefix(i)
                ir.replace_all_uses_with(f"{inp.name}:0", f"{node}:{i}",
                                         where=lambda n, p=prefix: n.startswith(p))
            split.append(inp.name)
        return PassResult(modified=bool(split), summary={"inputs": split})
