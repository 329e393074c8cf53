"""Which values of a replicated graph differ between replicas, and which replicas' slices of
the batch each value depends on: the facts the contract check and consistent-random rest on.

Two properties per node, found by one monotone worklist sweep over data edges (while loops'
back edges are just edges; values only ever grow, so it ends):

- ``differs``: a replica's node (one with a ``replica_<i>`` path component) whose value may
  differ from the other replicas' copies: it reads its replica's slice of the batch (a
  split-inputs output), an unseeded random op, an input queue, or another differing value.
  Cross-replica ops (collective all-reduce and all-gather, accumulators' take_grad) end it:
  every member gets the same result. A node outside every replica is one instance, read by all,
  so it never differs.
- ``coverage``: the replicas whose slices reach the value (a bit mask). Slice i covers replica
  i; a cross-replica op covers all; anything else, the union of its inputs. A value outside
  every replica that combines all replicas' slices (an AddN on one device, the last hop of a
  ring) covers all of them; one that reads replica 0 alone covers {0} and so ignores the
  others' data.

A write that makes a variable differ (or narrows its coverage) carries to the variable's
reads: batch-norm statistics updated per replica feed the next step.
"""

from __future__ import annotations

import re

from graphxform.ir import GraphIR
from graphxform.training import VARIABLE_OPS, is_mutating_op

CROSS_REPLICA_OPS = {"CollectiveReduceV2", "CollectiveReduce", "CollectiveGatherV2",
                     "CollectiveGather", "CollectiveBcastRecv", "CollectiveBcastRecvV2",
                     "NcclAllReduce", "AccumulatorTakeGradient",
                     "ResourceAccumulatorTakeGradient", "SparseAccumulatorTakeGradient"}
LOCAL_SOURCE_OPS = {"QueueDequeueV2", "QueueDequeueManyV2", "QueueDequeueUpToV2",
                    "IteratorGetNext"}
RANDOM_PREFIXES = ("Random", "TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal")
SPLIT_SCOPE = "split_inputs/"
_REPLICA = re.compile(r"(?:^|/)replica_\d+/")


class ReplicaSpread:
    """``differs`` (a set of nodes) and ``coverage`` (node -> bit mask) of a replicated graph
    with ``replicas`` replicas (see the module docstring)."""

    def __init__(self, ir: GraphIR, replicas: int):
        self.ir = ir
        self.all = (1 << replicas) - 1
        self.differs: set = set()
        self.coverage: dict = {}
        self._sweep()

    def covers_all(self, node: str) -> bool:
        return self.coverage.get(node, 0) in (0, self.all)

    def replicas_of(self, node: str) -> list[int]:
        mask = self.coverage.get(node, 0)
        return [i for i in range(self.all.bit_length()) if mask >> i & 1]

    def _sweep(self) -> None:
        ir = self.ir
        work = [n for n in ir.nodes() if self._is_source(n)]
        queued = set(work)
        while work:
            node = work.pop()
            queued.discard(node)
            for changed in self._update(node):
                for dst in ir.successors(changed):
                    if dst not in queued:
                        queued.add(dst)
                        work.append(dst)

    def _is_source(self, node: str) -> bool:
        ir = self.ir
        return ((node.startswith(SPLIT_SCOPE) and ir.op(node) in ("Split", "SplitV"))
                or ir.op(node) in LOCAL_SOURCE_OPS or _unseeded_random(ir, node))

    def _update(self, node: str) -> list[str]:
        """Recompute ``node`` from its inputs; returns the nodes whose state changed (``node``,
        and the variables a write op gives its state to)."""
        ir = self.ir
        op = ir.op(node)
        in_replica = self.all > 1 and bool(_REPLICA.search(node))  # one replica: all of it
        differs, coverage = False, 0
        if node.startswith(SPLIT_SCOPE) and op in ("Split", "SplitV"):
            coverage = self.all
        elif op in LOCAL_SOURCE_OPS or _unseeded_random(ir, node):
            differs = in_replica
        for src, port in ir.inputs(node):
            if src.startswith(SPLIT_SCOPE) and ir.op(src) in ("Split", "SplitV"):
                coverage |= 1 << port
                differs = differs or in_replica
            else:
                coverage |= self.coverage.get(src, 0)
                differs = differs or (in_replica and src in self.differs)
        if op in CROSS_REPLICA_OPS:
            differs, coverage = False, self.all if coverage else 0
        changed = [node] if self._set(node, differs, coverage) else []
        if changed and is_mutating_op(op):
            changed += [src for src, _ in ir.inputs(node)
                        if ir.op(src) in VARIABLE_OPS and self._set(src, differs, coverage)]
        return changed

    def _set(self, node: str, differs: bool, coverage: int) -> bool:
        """Grow ``node``'s state; True when it grew."""
        grew = differs and node not in self.differs
        if grew:
            self.differs.add(node)
        old = self.coverage.get(node, 0)
        if old | coverage != old:
            self.coverage[node] = old | coverage
            grew = True
        return grew


def _unseeded_random(ir: GraphIR, node: str) -> bool:
    op = ir.op(node)
    if not op.startswith(RANDOM_PREFIXES) or op.startswith("RandomShuffleQueue"):
        return False
    attrs = ir.attrs(node)
    return not (attrs["seed"].i if "seed" in attrs else 0) and not (
        attrs["seed2"].i if "seed2" in attrs else 0)
