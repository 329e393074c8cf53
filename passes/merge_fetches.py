"""merge-fetches: original fetch names return the whole-batch value.

The train op and every other sink NoOp of the input graph (an `init`, a group) become a NoOp
that runs all replicas' copies. The loss (and `mean` fetches) become the mean of the replicas'
values, which for a mean over equal slices is the mean over the whole batch; `concat` fetches
(per-example outputs) are concatenated along the batch axis in replica order."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs
from graphxform.errors import GraphxformError
from graphxform.ir import parse_tensor
from graphxform.nodes import Builder, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "merge_fetches/"


@dataclasses.dataclass
class MergeFetches(Pass):
    name = "merge-fetches"
    mean: tuple = ()
    concat: tuple = ()

    def run(self, ir, ctx):
        tg = ctx.training
        n = len(ctx.devices)
        build = Builder(ir, self.name)
        merged = []
        sinks = [name for name in dict.fromkeys([tg.train_op, *tg.noop_sinks]) if name not in ir]
        for name in sinks:
            build.op(name, "NoOp", ["^" + replica_prefix(i) + name for i in range(n)])
            merged.append(name)
        means = list(self.mean) + [t for t in tg.losses if t not in self.mean]
        for tensor in means:
            merged += self._merge(ir, build, tensor, n, "mean")
        for tensor in self.concat:
            merged += self._merge(ir, build, tensor, n, "concat")
        _restore_collection_names(ir, set(merged))
        return PassResult(modified=bool(merged), summary={"merged": merged})

    def _merge(self, ir, build, tensor, n, how):
        node, port = parse_tensor(tensor)
        if node in ir:
            return []  # shared, or merged already
        if replica_prefix(0) + node not in ir:
            raise GraphxformError(f"cannot merge fetch '{tensor}': no such node in the graph")
        if port != 0:
            raise GraphxformError(f"cannot merge fetch '{tensor}': only output 0 can be merged")
        copies = [f"{replica_prefix(i)}{node}:0" for i in range(n)]
        dtype = opdefs.output_dtype(ir, replica_prefix(0) + node, 0)
        scope = f"{SCOPE}{node}/"
        axis = build.const(scope + "axis", 0, np.int32)
        if how == "mean":
            stacked = build.op(scope + "stack", "Pack", copies, N=n, T=dtype)
            build.op(node, "Mean", [stacked, axis], T=dtype)
        else:
            build.op(node, "ConcatV2", copies + [axis], N=n, T=dtype)
        return [node]


def _restore_collection_names(ir, merged) -> None:
    """Collections that listed replica copies of a merged node list the original name again."""
    for col in ir.meta.collection_def.values():
        if not col.HasField("node_list"):
            continue
        out = []
        for value in col.node_list.value:
            bare = value.lstrip("^")
            head = bare.split("/", 1)
            if bare.startswith("replica_") and len(head) == 2 and head[1].split(":")[0] in merged:
                original = ("^" if value.startswith("^") else "") + head[1]
                if original not in out:
                    out.append(original)
            else:
                out.append(value)
        del col.node_list.value[:]
        col.node_list.value.extend(out)
