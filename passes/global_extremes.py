"""global-extremes: the batch's longest sequence, where a step's loss is shaped by it, is the
whole batch's in every replica.

``tf.sequence_mask(lengths)`` with no ``maxlen`` is as wide as the batch's longest length, a
Max over the examples (graphxform/batch_extremes.py finds those that reach a loss). A replica
computes it from its slice, so it pads to another width: a mean over the padded tokens divides
by another count, and a mask meant to match the fed sequences no longer does. The whole
batch's Max is the Max of the replicas' Maxes, so each replica's copy gets a
CollectiveReduceV2 (merge Max, or Min for a Min) and everything in the replica that read it,
forward and gradient, reads that instead: every replica then pads exactly as one device does,
and its per-example terms are one device's. Under the ps strategies (``shared``), which have no
collectives, one chain of Maximum (Minimum) on the first replica's device reads every
replica's copy instead."""

from __future__ import annotations

import dataclasses
import itertools

from graphxform.batch_extremes import batch_extremes
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.cross_replica import whole_batch_copies
from graphxform.pipeline import Pass, PassResult

SCOPE = "global_extremes/"
INSTANCE_KEYS = 1 << 20  # apart from all-reduce's (1, 2, ..., 1 << 24 on) and the other passes'


@dataclasses.dataclass
class GlobalExtremes(Pass):
    name = "global-extremes"
    shared: bool = False

    def run(self, ir, ctx):
        if len(ctx.devices) < 2:
            return PassResult(modified=False)
        found = []
        for step in ctx.training.steps:
            found += [n for n in batch_extremes(ir, ctx.training, step)[0] if n not in found]
        if not found:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        first = replica_prefix(0)
        for key, node in zip(itertools.count(INSTANCE_KEYS), found):
            _reduce_each(ir, build, ctx.devices, node[len(first):], key, self.shared)
        return PassResult(modified=True, summary={
            "the whole batch's": [n[len(first):] for n in found],
            "collectives_per_replica": 0 if self.shared else len(found)})


def _reduce_each(ir, build, devices: list, node: str, instance: int, shared: bool) -> None:
    """Every replica's copy of ``node`` (a Max or Min) reduced across the replicas by the same
    op (``shared``: combined by one chain); what the replica read it from reads the result."""
    merge = ir.op(replica_prefix(0) + node)
    scope = f"{SCOPE}{instance - INSTANCE_KEYS}/"
    for prefix, reduced in whole_batch_copies(ir, build, devices, node, instance, scope,
                                              merge=merge,
                                              shared_on=devices[0] if shared else None):
        ir.replace_all_uses_with(prefix + node + ":0", reduced,
                                 where=lambda n, p=prefix: n.startswith(p))
