"""rewire-consumers: the optimizer's update ops read the reduced gradients.

Only consumers inside the replica's optimizer scope move (data and control alike); anything
else that reads a local gradient (a summary, say) keeps the local value."""

from __future__ import annotations

import dataclasses

from graphxform.nodes import replica_prefix
from graphxform.pipeline import Pass, PassResult


@dataclasses.dataclass
class RewireConsumers(Pass):
    name = "rewire-consumers"

    def run(self, ir, ctx):
        state = ctx.state.get("all-reduce")
        if not state:
            return PassResult(modified=False)
        moved = 0
        for i, local, reduced in state["rewires"]:
            scope = replica_prefix(i) + state["scope"]
            moved += ir.replace_all_uses_with(local, reduced, where=lambda n: n.startswith(scope))
        return PassResult(modified=moved > 0, summary={"edges": moved})
