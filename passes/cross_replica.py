"""A value of each replica's slice made the whole batch's: every replica's copy of one tensor
reduced across the replicas by a CollectiveReduceV2 of its own (the helper of the passes that
do this for a loss's denominator, the batch's longest sequence and the state the step moves:
global-denominators, global-extremes, global-state), or, where one client runs every replica
and there are no collectives (the ps strategies), combined by one node that reads them all.
Every replica's reduction has the same group and instance keys, so TF's collective executor
pairs them up."""

from __future__ import annotations

import numpy as np

from graphxform import opdefs
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import numpy_dtype, replica_prefix
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


def combine_copies(ir, build, replicas: int, tensor: str, scope: str, device: str,
                   merge: str = "Add", final: str = "Id") -> str:
    """One node outside every replica, on ``device``, combining every replica's copy of
    ``tensor`` as reduce_copies does, through graph edges (the ps strategies, whose one client
    runs every replica in one step, have no collectives): their AddN (over the number of
    replicas for ``final`` Div), Maximum or Minimum. Returns its tensor name."""
    node, port = parse_tensor(tensor)
    dtype = opdefs.output_dtype(ir, replica_prefix(0) + node, port)
    copies = [tensor_name(replica_prefix(i) + node, port) for i in range(replicas)]
    if merge == "Add":
        combined = build.op(scope + "sum", "AddN", copies, device=device, T=dtype, N=replicas)
        if final == "Div":
            count = build.const(scope + "replicas", replicas, numpy_dtype(dtype), device=device)
            combined = build.op(scope + "mean", "RealDiv", [combined, count], device=device,
                                T=dtype)
        return combined + ":0"
    combined = copies[0]
    for k, other in enumerate(copies[1:], start=1):
        combined = build.op(f"{scope}{merge.lower()}_{k}", {"Max": "Maximum",
                                                           "Min": "Minimum"}[merge],
                            [combined, other], device=device, T=dtype) + ":0"
    return combined


def whole_batch_copies(ir, build, devices: list, tensor: str, instance: int, scope: str,
                       merge: str = "Add", final: str = "Id",
                       shared_on: str | None = None) -> list[tuple[str, str]]:
    """(replica prefix, the whole batch's value) per replica for replica 0's ``tensor``:
    reduce_copies' collectives, or with ``shared_on`` (the ps strategies) combine_copies' one
    node on that device, read by every replica."""
    if shared_on is None:
        return reduce_copies(ir, build, devices, tensor, instance, scope, merge=merge,
                             final=final)
    one = combine_copies(ir, build, len(devices), tensor, scope, shared_on, merge=merge,
                         final=final)
    return [(replica_prefix(i), one) for i in range(len(devices))]

