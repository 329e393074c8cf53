"""drop-in-saver: a Saver keyed by the original variable names and full shapes.

Saving writes replica 0's values (replicas are identical after every step); restoring assigns
every replica's copy. It writes what the input's Saver wrote, under the same checkpoint keys
(a Saver given a dict or a subset of the variables); without one, what TF's default Saver
writes: the global variables under their names, not the local ones (metrics' totals), which
local_variables_initializer starts. A variable `partition-variables` split is saved as the concatenation of its
shards and restored by slicing, so a checkpoint of the single-device graph restores into the transformed
graph and the reverse. Under model-average a trained variable is saved from its centre (what the
workers agreed on at the last round) and restored into the centre and every local copy. The
MetaGraph's saver_def points at it, so `import_meta_graph` users and `tf.compat.v1.train.Saver`
see a normal saver, and so does its `savers` collection, whose first Saver
MonitoredTrainingSession's Scaffold and Supervisor take."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform.errors import GraphxformError
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "save/"


@dataclasses.dataclass
class DropInSaver(Pass):
    name = "drop-in-saver"

    def run(self, ir, ctx):
        from tensorflow.core.framework import types_pb2
        from tensorflow.core.protobuf import saver_pb2
        tg = ctx.training
        shared = ctx.state["replicate"]["shared"]
        partitioned = ctx.state.get("partition-variables", {"shards": {}, "originals": {}})
        shards = partitioned["shards"]
        averaged = ctx.state.get("model-average", {})
        centres = averaged.get("centres", {})  # saved from the centre, restored to all copies
        build = Builder(ir, self.name)
        parts = {shard for found in shards.values() for shard, _, _ in found}
        candidates = {v.name: v for v in tg.variables.values() if v.name not in parts}
        candidates.update((v.name, v) for v in partitioned["originals"].values())
        keys, specs, variables = _saved(tg.saved, candidates)
        scope = ir.unique_scope(SCOPE.rstrip("/"))
        default = build.const(scope + "filename/input", "model", np.object_)
        filename = build.op(scope + "filename", "PlaceholderWithDefault", [default],
                            dtype=types_pb2.DT_STRING, shape=[])
        names = build.const(scope + "SaveV2/tensor_names", keys, np.object_)
        slices = build.const(scope + "SaveV2/shape_and_slices", specs, np.object_)
        values = []
        for k, var in enumerate(variables):
            if var.name in shards:
                values.append(self._concat(build, f"{scope}concat_{k}", var, shards[var.name]))
                continue
            source = var.name if var.name in shared else replica_prefix(0) + var.name
            source = centres.get(var.name, source)
            if var.kind == "resource":
                values.append(build.op(f"{scope}read_{k}", "ReadVariableOp", [source],
                                       device=ir.node(source)["device"], dtype=var.dtype))
            else:
                values.append(source)
        dtypes = [v.dtype for v in variables]
        save = build.op(scope + "SaveV2", "SaveV2", [filename, names, slices] + values,
                        dtypes=dtypes)
        done = build.op(scope + "control_dependency", "Identity", [filename, "^" + save], T=types_pb2.DT_STRING)
        restore = build.op(scope + "RestoreV2", "RestoreV2", [filename, names, slices],
                           dtypes=dtypes)
        assigns = []
        for k, var in enumerate(variables):
            if var.name in shards:
                targets = [(shard, self._slice(build, f"{scope}slice_{k}_{j}", f"{restore}:{k}",
                                               var, offset, rows))
                           for j, (shard, offset, rows) in enumerate(shards[var.name])]
            elif var.name in shared:
                targets = [(var.name, f"{restore}:{k}")]
            else:
                targets = [(replica_prefix(i) + var.name, f"{restore}:{k}")
                           for i in range(len(ctx.devices))]
            if var.name in centres:
                targets.append((centres[var.name], f"{restore}:{k}"))
            rows = [(f"{scope}assign_{k}_{i}", [target, value], ir.node(target)["device"])
                    for i, (target, value) in enumerate(targets)]
            if var.kind == "resource":
                assigns += build.ops("AssignVariableOp", rows, dtype=var.dtype)
            else:
                assigns += build.ops("Assign", rows, T=var.dtype)
        assigns += averaged.get("on_restore", [])  # a restored model starts a new round
        restore_all = build.op(scope + "restore_all", "NoOp", ["^" + a for a in assigns])
        # how many checkpoints the user's Saver keeps, as the input said (else TF's defaults)
        kept = ctx.state.get("strip-saver", {}).get("saver_def") or saver_pb2.SaverDef(
            max_to_keep=5, keep_checkpoint_every_n_hours=10000.0)
        ir.meta.saver_def.CopyFrom(saver_pb2.SaverDef(
            filename_tensor_name=f"{filename}:0", save_tensor_name=f"{done}:0",
            restore_op_name=restore_all, max_to_keep=kept.max_to_keep,
            keep_checkpoint_every_n_hours=kept.keep_checkpoint_every_n_hours,
            version=saver_pb2.SaverDef.V2))
        # the Saver MonitoredTrainingSession and Supervisor take (the first in the `savers`
        # collection); without one they make their own, which saves every replica's copy
        # under its own name
        savers = ir.meta.collection_def["savers"].bytes_list.value
        savers[:] = [ir.meta.saver_def.SerializeToString()]
        return PassResult(modified=True, summary={"variables": len(variables)})

    @staticmethod
    def _concat(build, name, var, shards) -> str:
        """The full value of a partitioned variable: its shards' reads, concatenated."""
        reads = []
        for j, (shard, _, _) in enumerate(shards):
            device = build.ir.node(shard)["device"]
            reads.append(build.op(f"{name}/read_{j}", "ReadVariableOp", [shard], device=device,
                                  dtype=var.dtype) if var.kind == "resource" else shard)
        axis = build.const(name + "/axis", 0, np.int32)
        return build.op(name, "ConcatV2", reads + [axis], N=len(reads), T=var.dtype)

    @staticmethod
    def _slice(build, name, tensor, var, offset, rows) -> str:
        """Rows [offset, offset + rows) of a restored full variable."""
        rank = len(var.shape)
        begin = build.const(name + "/begin", [offset] + [0] * (rank - 1), np.int32)
        size = build.const(name + "/size", [rows] + [-1] * (rank - 1), np.int32)
        return build.op(name, "Slice", [tensor, begin, size], T=var.dtype, Index=3)


def _saved(saved: dict | None, candidates: dict) -> tuple[list, list, list]:
    """(checkpoint keys, their slice specs, the variable each saves): what the input's Saver
    wrote (``saved``, key -> (variable, slice spec)), or without one what TF's default Saver
    writes: every global variable under its own name, and each part of a variable the user
    partitioned as its slice of the whole one's key (Variable.saved_as). Refuses a Saver this
    pass cannot rebuild."""
    if saved is None:
        chosen = sorted((v for v in candidates.values() if not v.local), key=lambda v: v.name)
        keys = [v.saved_as or (v.name, "") for v in chosen]
        return [key for key, _ in keys], [spec for _, spec in keys], chosen
    keys, specs, variables = [], [], []
    for key, entries in sorted(saved.items()):
        for variable, spec in entries:
            if variable is None or variable not in candidates:
                raise GraphxformError(
                    f"the input's Saver writes checkpoint key '{key}' from a value that is not "
                    "a variable's: a Saver rebuilt for the replicas could not write it, so "
                    "checkpoints would not move between the graphs")
            keys.append(key)
            specs.append(spec)
            variables.append(candidates[variable])
    return keys, specs, variables
