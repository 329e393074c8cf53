"""Which values of a replicated graph differ between replicas, and which replicas' slices of
the batch each value depends on: the facts the contract check and consistent-random rest on.

Two properties per node, found by a monotone worklist over data edges (while loops' back
edges are just edges; values only ever grow, so it ends):

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
reads: batch-norm statistics updated per replica feed the next step. The sweep is a worklist
(see ``ReplicaSpread._sweep``); it finds the least fixed point, loops included.
"""

from __future__ import annotations

import heapq
import re

from graphxform.ir import CONTROL_KEY, GraphIR, data_pairs
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

    def __init__(self, ir: GraphIR, replicas: int, step: set | None = None):
        """``step``: the nodes a training step runs, when known: only their writes and random
        draws count (initializers run once, and sync-init makes them equal)."""
        self.ir = ir
        self.step = step
        self.all = (1 << replicas) - 1
        self.differs: set = set()
        self.coverage: dict = {}
        self._splits = {n for n in ir.nodes_of(("Split", "SplitV"))
                        if n.startswith(SPLIT_SCOPE)}
        self._sweep()

    def covers_all(self, node: str) -> bool:
        return self.coverage.get(node, 0) in (0, self.all)

    def replicas_of(self, node: str) -> list[int]:
        mask = self.coverage.get(node, 0)
        return [i for i in range(self.all.bit_length()) if mask >> i & 1]

    def _sweep(self) -> None:
        """A worklist over data edges, in graph order: a node is (re)computed when one of its
        inputs grew, smallest position first. Graph order is topological apart from what the
        passes rewired and loops' back edges, so most nodes are computed once, after their
        inputs; the few that are not are computed again when an input grows, until nothing
        grows (values only grow, so it ends, at the least fixed point). A write that changed a
        variable's state sends the variable's reads through the worklist too. With ``step``,
        only the step's nodes are computed: the contract asks about nothing else.

        The rule for one node is written inline (it runs once or more per node of the step,
        in every replica: a call per node cost a third of the sweep)."""
        ir, step, everything = self.ir, self.step, self.all
        nodes, succ, pred = ir.g._node, ir.g._succ, ir.g._pred
        order = list(nodes)
        position = dict(zip(order, range(len(order))))
        draws = ir.nodes_of([op for op in ir.op_types() if op.startswith(RANDOM_PREFIXES)])
        self._unseeded = unseeded = {n for n in draws if _unseeded_random(ir, n)
                                     and (step is None or n in step)}
        splits, sources = self._splits, set(ir.nodes_of(LOCAL_SOURCE_OPS))
        queued = splits | sources | unseeded
        heap = [position[n] for n in queued]
        heapq.heapify(heap)
        cover, differing = self.coverage, self.differs
        replicated = everything > 1
        pop, push, search = heapq.heappop, heapq.heappush, _REPLICA.search
        while heap:
            node = order[pop(heap)]
            queued.discard(node)
            op = nodes[node]["op"]
            in_replica = replicated and "replica_" in node and search(node) is not None
            differs, coverage = False, 0
            if node in splits:
                coverage = everything
            elif node in sources or node in unseeded:
                differs = in_replica
            for src, keyed in data_pairs(pred[node]):
                if src in splits:
                    for key, edge in keyed.items():
                        if key != CONTROL_KEY:
                            coverage |= 1 << edge["src_port"]
                            differs = differs or in_replica
                elif (src in cover or src in differing) and (
                        len(keyed) > 1 or CONTROL_KEY not in keyed):
                    coverage |= cover.get(src, 0)
                    differs = differs or (in_replica and src in differing)
            if op in CROSS_REPLICA_OPS:
                differs, coverage = False, everything if coverage else 0
            if not self._set(node, differs, coverage):
                continue
            changed = [node]
            if is_mutating_op(op) and (differs or coverage != everything) and (
                    step is None or node in step):
                # a write from values equal everywhere and covering every replica (an update
                # from the all-reduced gradient) changes nothing its reads could be refused for
                changed += [src for src in pred[node] if nodes[src]["op"] in VARIABLE_OPS
                            and self._set(src, differs, coverage)]
            for grown in changed:
                for dst, keyed in data_pairs(succ[grown]):
                    if (dst not in queued and (len(keyed) > 1 or CONTROL_KEY not in keyed)
                            and (step is None or dst in step)):
                        queued.add(dst)
                        push(heap, position[dst])

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
