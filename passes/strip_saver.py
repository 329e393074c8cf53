"""strip-saver: remove the graph's Saver subgraph and saver_def.

A Saver reads and assigns the variables by their single-device nodes; once those are replicated
or moved it would be stale. `drop-in-saver` builds the replacement at the end."""

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
        ir.meta.ClearField("saver_def")
        if "savers" in ir.meta.collection_def:
            del ir.meta.collection_def["savers"]
        return PassResult(modified=True, summary={"removed": len(doomed)})
