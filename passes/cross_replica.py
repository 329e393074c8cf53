"""A value of each replica's slice made the whole batch's: every replica's copy of one tensor
reduced across the replicas by a CollectiveReduceV2 of its own (the helper of the passes that
do this for a loss's denominator, the batch's longest sequence and the state the step moves:
global-denominators, global-extremes, global-state). Every replica's reduction has the same
group and instance keys, so TF's collective executor pairs them up."""

from __future__ import annotations

import numpy as np

from graphxform import opdefs
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import replica_prefix
from graphxform.passes.all_reduce import GROUP_KEY  # every replica, one member each


def reduce_copies(ir, build, devices: list, tensor: str, instance: int, scope: str,
                  merge: str = "Add", final: str = "Id") -> list[tuple[str, str]]:
    """(replica prefix, reduced tensor) per replica, for every replica's copy of ``tensor``
    (its name in replica 0 without the prefix, 'node' or 'node:port'): merged by ``merge``
    (Add, Max, Min), then ``final`` (Id, or Div for the mean). The nodes go under
    ``scope`` + the replica's prefix; nothing reads them yet."""
    node, port = parse_tensor(tensor)
    dtype = opdefs.output_dtype(ir, replica_prefix(0) + node, port)
    reduced = []
    for i, device in enumerate(devices):
        prefix = replica_prefix(i)
        where = scope + prefix
        size = build.const(where + "group_size", len(devices), np.int32, device=device)
        key = build.const(where + "group_key", GROUP_KEY, np.int32, device=device)
        instance_key = build.const(where + "instance_key", instance, np.int32, device=device)
        made = build.op(where + "reduced", "CollectiveReduceV2",
                        [tensor_name(prefix + node, port), size, key, instance_key],
                        device=device, T=dtype, merge_op=merge, final_op=final)
        reduced.append((prefix, made + ":0"))
    return reduced
