"""rewire-consumers: everything that read a replica's local gradient reads the reduced one.

Every consumer in the replica outside a gradients scope moves (data and control alike): the
optimizer, and the post-processing between tf.gradients and it (clipping, loss-scale division,
finite checks, gradient summaries), which so sees the cross-replica gradient. The collectives
themselves live outside the replica's scope and keep reading the local value."""

from __future__ import annotations

import dataclasses

from graphxform.nodes import replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.training import gradient_scope


@dataclasses.dataclass
class RewireConsumers(Pass):
    name = "rewire-consumers"

    def run(self, ir, ctx):
        state = ctx.state.get("all-reduce")
        if not state:
            return PassResult(modified=False)
        moved = 0
        for i, local, reduced in state["rewires"]:
            prefix = replica_prefix(i)
            moved += ir.replace_all_uses_with(
                local, reduced, where=lambda n, p=prefix: n.startswith(p)
                and not gradient_scope(n[len(p):]))
        return PassResult(modified=moved > 0, summary={"edges": moved})
