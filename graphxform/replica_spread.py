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
reads: batch-norm statistics updated per replica feed the next step. A write counts with the
value it has once everything it reads is settled (an update from the all-reduced gradient
covers every replica and taints nothing, however its inputs were reached), so the result does
not depend on the order nodes are visited in: the sweep (``ReplicaSpread._sweep``) settles
the data edges to their least fixed point, then carries the writes to their variables, and
goes on until nothing grows.

Asked about a few nodes (``asked``: the contract asks about what updates read), it computes
only what they depend on: their data inputs, back to cross-replica ops (all-reduce: not
differing, covering every replica once any slice reaches them, which a search along data
edges back to a split shows), and for a variable the step's writes of it. That is the same
fixed point on fewer nodes: an all-reduced update depends on the gradient's unpacking, not on
the forward and backward passes of eight replicas.
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

    def __init__(self, ir: GraphIR, replicas: int, step: set | None = None,
                 asked=None):
        """``step``: the nodes a training step runs, when known: only their writes and random
        draws count (initializers run once, and sync-init makes them equal). ``asked``: the
        only nodes the caller will ask about (of ``step``); None: every node."""
        self.ir = ir
        self.step = step
        self.all = (1 << replicas) - 1
        self.differs: set = set()
        self.coverage: dict = {}
        # the contract, which asks, reads under ir.indexed_by_op(): a lookup per op then
        self._one_op_at_a_time = asked is not None
        self._splits = {n for n in self._nodes_of(("Split", "SplitV"))
                        if n.startswith(SPLIT_SCOPE)}
        self._reduced: set = set()  # cross-replica ops a slice is known to reach
        self._reaching: set = set()  # nodes a slice reaches along data edges
        self._not_reaching: set = set()  # nodes no slice reaches so
        if asked is None:
            self._sweep(step)
            return
        self._mutating = {n for n in self._nodes_of(
            [op for op in ir.op_types() if is_mutating_op(op)]) if step is None or n in step}
        order = self._needed(asked)
        self._sweep(set(order), order)

    def _nodes_of(self, ops) -> set:
        """The nodes whose op is one of ``ops``. Under an op index (``_one_op_at_a_time``),
        one lookup per op: ``nodes_of`` given several ops sweeps the graph to put their
        nodes in graph order, which a set does not need."""
        if not self._one_op_at_a_time:
            return set(self.ir.nodes_of(ops))
        present = self.ir.op_types()
        return set().union(*(self.ir.nodes_of((op,)) for op in set(ops) if op in present))

    def covers_all(self, node: str) -> bool:
        return self.coverage.get(node, 0) in (0, self.all)

    def replicas_of(self, node: str) -> list[int]:
        mask = self.coverage.get(node, 0)
        return [i for i in range(self.all.bit_length()) if mask >> i & 1]

    def unseeded_source(self, node: str) -> str | None:
        """The unseeded random op (of the step) nearest ``node`` along data edges through
        differing values, when one is why ``node`` differs; else None."""
        pred, unseeded = self.ir.g._pred, self._unseeded
        seen, frontier = {node}, [node]
        while frontier:
            found = sorted(n for n in frontier if n in unseeded)
            if found:
                return found[0]
            frontier = [src for n in frontier for src, keyed in data_pairs(pred[n])
                        if src in self.differs and src not in seen and not seen.add(src)
                        and (len(keyed) > 1 or CONTROL_KEY not in keyed)]
        return None

    def _needed(self, asked) -> list:
        """The nodes the values of ``asked`` depend on: data inputs, and for a variable the
        step's writes of it; a cross-replica op that a slice of the batch reaches along data
        edges ends the search (its value is known, whatever else reaches it). In depth-first
        post-order: each node after what it depends on but for loops' back edges (and a
        variable after its writes, which read it), the order the sweep computes them in."""
        nodes, succ, pred, step = self.ir.g._node, self.ir.g._succ, self.ir.g._pred, self.step
        mutating, reduced = self._mutating, self._reduced
        needed, order = set(), []

        def depends_on(node: str) -> list:
            op = nodes[node]["op"]
            if op in CROSS_REPLICA_OPS and self._slice_reaches(node):
                reduced.add(node)
                return []
            found = [src for src, keyed in data_pairs(pred[node])
                     if len(keyed) > 1 or CONTROL_KEY not in keyed]
            if op in VARIABLE_OPS:
                found += [dst for dst in succ[node] if dst in mutating]
            return found

        for root in asked:
            if root in needed or (step is not None and root not in step):
                continue
            needed.add(root)
            path = [(root, iter(depends_on(root)))]
            while path:
                for dep in path[-1][1]:
                    if dep in needed:
                        continue
                    needed.add(dep)
                    deps = depends_on(dep)
                    if needed.issuperset(deps):  # most: a read of a variable already seen
                        order.append(dep)
                        continue
                    path.append((dep, iter(deps)))
                    break
                else:
                    order.append(path.pop()[0])
        return order

    def _slice_reaches(self, node: str) -> bool:
        """Whether a split's output reaches ``node`` along data edges (then the sweep would
        give it a non-zero coverage, whatever the variables hold). Depth first, stopping at
        the first split; a search that finds none has seen everything it could reach, and
        remembers that for the next."""
        pred, splits = self.ir.g._pred, self._splits
        known_yes, known_no = self._reaching, self._not_reaching
        seen, path = {node}, [(node, iter(data_pairs(pred[node])))]
        while path:
            current, inputs = path[-1]
            for src, keyed in inputs:
                if len(keyed) == 1 and CONTROL_KEY in keyed:
                    continue
                if src in splits or src in known_yes:
                    known_yes.update(name for name, _ in path)
                    return True
                if src not in seen and src not in known_no:
                    seen.add(src)
                    path.append((src, iter(data_pairs(pred[src]))))
                    break
            else:
                path.pop()
        known_no.update(seen)
        return False

    def _sweep(self, domain: set | None, order: list | None = None) -> None:
        """A worklist over data edges, in graph order: a node is (re)computed when one of its
        inputs grew, smallest position first. Graph order is topological apart from what the
        passes rewired and loops' back edges, so most nodes are computed once, after their
        inputs; the few that are not are computed again when an input grows, until nothing
        grows (values only grow, so it ends, at the least fixed point). Then the writes whose
        values differ or cover only some replicas carry to their variables, whose reads go
        through the worklist again, until no variable grows. Only the nodes of ``domain``
        (None: every node) are computed, in ``order`` if given (all of ``domain``, inputs
        first), else in graph order.

        The rule for one node is written inline (it runs once or more per node of the step,
        in every replica: a call per node cost a third of the sweep)."""
        ir, step, everything = self.ir, self.step, self.all
        nodes, succ, pred = ir.g._node, ir.g._succ, ir.g._pred
        if order is None:
            order = list(nodes) if domain is None or len(domain) * 4 > len(nodes) else \
                [n for n in nodes if n in domain]
        position = dict(zip(order, range(len(order))))
        draws = self._nodes_of([op for op in ir.op_types() if op.startswith(RANDOM_PREFIXES)])
        self._unseeded = unseeded = {n for n in draws if _unseeded_random(ir, n)
                                     and (step is None or n in step)}
        splits, sources, reduced = self._splits, self._nodes_of(LOCAL_SOURCE_OPS), self._reduced
        queued = splits | sources | unseeded | reduced
        if domain is not None:
            queued &= domain
        heap = [position[n] for n in queued]
        heapq.heapify(heap)
        cover, differing = self.coverage, self.differs
        replicated = everything > 1
        pop, push, search = heapq.heappop, heapq.heappush, _REPLICA.search
        writes = set()  # writes whose value grew since they were last carried

        def enqueue(grew: str) -> None:
            for dst, keyed in data_pairs(succ[grew]):
                if (dst not in queued and (len(keyed) > 1 or CONTROL_KEY not in keyed)
                        and (domain is None or dst in domain)):
                    queued.add(dst)
                    push(heap, position[dst])

        while heap or writes:
            if not heap:  # the data edges are settled: carry the writes
                for grew in self._carry(writes):
                    enqueue(grew)
                writes = set()
                continue
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
                differs = False
                coverage = everything if coverage or node in reduced else 0
            if not self._set(node, differs, coverage):
                continue
            if is_mutating_op(op) and (step is None or node in step):
                writes.add(node)
            enqueue(node)

    def _carry(self, writes: set) -> list[str]:
        """Give each variable that ``writes`` write their values, where those differ or cover
        only some replicas (a write from values equal everywhere and covering every replica,
        an update from the all-reduced gradient, changes nothing its reads could be refused
        for); returns the variables that grew."""
        nodes, pred, everything = self.ir.g._node, self.ir.g._pred, self.all
        grown = []
        for write in writes:
            differs, coverage = write in self.differs, self.coverage.get(write, 0)
            if differs or coverage != everything:
                grown += [src for src in pred[write] if nodes[src]["op"] in VARIABLE_OPS
                          and self._set(src, differs, coverage)]
        return grown

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


def combines_every_replica(ir: GraphIR, name: str) -> bool:
    """Whether ``name``, outside every replica, adds up (AddN) or takes the largest or
    smallest (a chain of Maximum or Minimum) of each replica's copy of one tensor:
    passes/cross_replica.combine_copies' node, the ps strategies' stand-in for an all-reduce.
    Its value is the whole batch's, the same for every replica that reads it."""
    op = ir.op(name)
    if op not in ("AddN", "Maximum", "Minimum") or _REPLICA.search(name):
        return False
    leaves, stack = [], [name]
    while stack:
        node = stack.pop()
        for src, port in ir.inputs(node):
            if op != "AddN" and ir.op(src) == op and not _REPLICA.search(src):
                stack.append(src)  # the chain's previous link
            else:
                leaves.append((src, port))
    copies = {(src.split("/", 1)[1], port) for src, port in leaves
              if src.startswith("replica_")}
    if len(copies) != 1 or len(leaves) < 2:
        return False
    rest, _ = next(iter(copies))
    return (sorted(src for src, _ in leaves) == sorted(f"replica_{i}/{rest}"
                                                      for i in range(len(leaves)))
            and f"replica_{len(leaves)}/{rest}" not in ir)
