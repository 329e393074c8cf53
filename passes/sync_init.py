"""sync-init: replicas > 0 start from replica 0's initial values.

Each replica's initializer assigns replica 0's initial-value tensor, which TF computes once per
run, so random initializers give every replica the same start. Replica i's own initial-value
subgraph becomes dead and is removed."""

from __future__ import annotations

import dataclasses

from graphxform.nodes import replica_prefix
from graphxform.pipeline import Pass, PassResult
from graphxform.passes.replicate import VARIABLE_DEF_COLLECTIONS


@dataclasses.dataclass
class SyncInit(Pass):
    name = "sync-init"

    def run(self, ir, ctx):
        shared = ctx.state["replicate"]["shared"]
        first = replica_prefix(0)
        synced = [var for var in ctx.training.variables.values()
                  if var.name not in shared and var.initializer and var.initial_value]
        removed = 0
        renamed = {}
        for i in range(1, len(ctx.devices)):
            prefix = replica_prefix(i)
            old_values = []
            for var in synced:
                init = prefix + var.initializer
                old_values.append(ir.input(init, 1)[0])
                ir.set_input(init, 1, first + var.initial_value)
                renamed[prefix + var.initial_value] = first + var.initial_value
            # all of the replica's old initial values at once: one sweep removes what is dead
            removed += ir.remove_dead(old_values, keep=lambda n, p=prefix: not n.startswith(p))
        count = len(synced) * (len(ctx.devices) - 1)
        _point_variable_defs(ir, renamed)
        return PassResult(modified=count > 0, summary={"synced": count, "removed": removed})


def _point_variable_defs(ir, renamed) -> None:
    """VariableDefs of replicas > 0 name replica 0's initial value."""
    from tensorflow.core.framework import variable_pb2
    for key in VARIABLE_DEF_COLLECTIONS:
        if key not in ir.meta.collection_def:
            continue
        col = ir.meta.collection_def[key]
        values = list(col.bytes_list.value)
        changed = False
        for k, raw in enumerate(values):
            vd = variable_pb2.VariableDef.FromString(raw)
            if vd.initial_value_name in renamed:
                vd.initial_value_name = renamed[vd.initial_value_name]
                values[k] = vd.SerializeToString()
                changed = True
        if changed:
            del col.bytes_list.value[:]
            col.bytes_list.value.extend(values)
