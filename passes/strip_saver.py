"""strip-saver: remove the graph's Saver subgraph and saver_def.

A Saver reads and assigns the variables by their single-device nodes; once those are replicated
or moved it would be stale. `drop-in-saver` builds the replacement at the end, keeping the
removed saver_def's settings (``max_to_keep``, ``keep_checkpoint_every_n_hours``), which this
pass leaves it in ``ctx.state``: the user's Saver would otherwise keep other checkpoints."""

from __future__ import annotations

import dataclasses

from graphxform.pipeline import Pass, PassResult


@dataclasses.dataclass
class StripSaver(Pass):
    name = "strip-saver"

    def run(self, ir, ctx):
        scope = ctx.training.saver_scope
        if scope is None:
            return PassResult(modified=False)
        doomed = [n for n in ir.nodes() if n.startswith(scope)]
        ir.remove_nodes(doomed)
        saver_def = type(ir.meta.saver_def)()
        saver_def.CopyFrom(ir.meta.saver_def)
        ctx.state[self.name] = {"saver_def": saver_def}
        ir.meta.ClearField("saver_def")
        if "savers" in ir.meta.collection_def:
            del ir.meta.collection_def["savers"]
        return PassResult(modified=True, summary={"removed": len(doomed)})
