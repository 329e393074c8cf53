"""Stateful ops in the training step, and how each replica treats them: batch-norm statistics,
counters, random ops, queues and the rest. Nothing here is an error; it says why replicas (or
the transformed graph and the single-device one) can differ, op by op."""

from __future__ import annotations

import collections

from graphxform import opdefs
from graphxform.inspector.findings import CheckResult
from graphxform.inspector.scopes import fold_name
from graphxform.inspector.shapes import describe
from graphxform.ir import GraphIR

QUEUE_PREFIXES = ("QueueDequeue", "IteratorGetNext", "ReaderRead")
RANDOM_PREFIXES = ("Random", "TruncatedNormal", "Multinomial", "ParameterizedTruncatedNormal",
                   "StatelessRandom", "StatelessTruncatedNormal", "StatelessMultinomial")
_INT_TYPES = {3, 9, 4, 6, 5, 17, 22, 23}
# stateful ops that say nothing about replicas: variables and their reads, the step's plumbing
_ORDINARY = {"VarHandleOp", "VariableV2", "ReadVariableOp", "ResourceGather",
             "ResourceGatherNd", "VariableShape", "NoOp", "Placeholder",
             "PlaceholderWithDefault", "VarIsInitializedOp", "Assert", "Print", "PrintV2",
             "SaveV2", "RestoreV2", "MergeV2Checkpoints", "DestroyResourceOp"}
_SKIP_PREFIXES = ("Collective", "Accumulator", "SparseAccumulator", "ConditionalAccumulator",
                  "SparseConditionalAccumulator", "Apply", "ResourceApply", "SparseApply",
                  "ResourceSparseApply", "Assign", "ResourceScatter", "Scatter", "FIFOQueue",
                  "QueueEnqueue", "Nccl")


def check(ir: GraphIR, view=None) -> CheckResult:
    """``view``: graphxform.inspector.updates.View (None: the whole graph is the step)."""
    result = CheckResult("stateful")
    closure = set().union(*(c for _, c in view.closures)) if view and view.closures \
        else set(ir.nodes())
    kinds = {}  # op type -> whether its nodes are worth a line
    by_fold = collections.defaultdict(list)
    for node in closure:
        op = ir.op(node)
        if op not in kinds:
            kinds[op] = _interesting(ir, op)
        if kinds[op]:
            by_fold[fold_name(node)[0]].append(node)
    groups = collections.defaultdict(list)  # (kind, treatment) -> [(name, nodes)]
    for folded, copies in sorted(by_fold.items()):
        groups[_treatment(ir, sorted(copies))].append((folded, copies))
    if view is not None:
        for key, found in _variables(ir, view, closure).items():
            groups[key] += found
    for (kind, treatment), found in sorted(groups.items()):
        names = [name for name, _ in found]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        result.info(f"{len(names)} {kind}: {treatment} ({shown})",
                    [n for _, nodes in found for n in nodes])
    counts = collections.Counter()
    for (kind, _), found in groups.items():
        counts[kind] += len(found)
    result.summary = (f"{sum(counts.values())} stateful op(s) or variable(s) in the step" +
                      (": " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
                       if counts else ""))
    return result


def _interesting(ir: GraphIR, op: str) -> bool:
    if op.startswith(RANDOM_PREFIXES) or op.startswith(QUEUE_PREFIXES):
        return True
    return not (op in _ORDINARY or op.startswith(_SKIP_PREFIXES)) and opdefs.is_stateful(ir, op)


def _treatment(ir: GraphIR, copies: list) -> tuple:
    """(kind, how the replicas treat it) for a stateful op and its replicas' copies."""
    op = ir.op(copies[0])
    many = len(copies) > 1
    if op.startswith(RANDOM_PREFIXES) and not op.startswith("RandomShuffleQueue"):
        if op.startswith("Stateless"):
            seeds = {describe(ir, *ir.inputs(c)[1]) for c in copies if len(ir.inputs(c)) > 1}
            same = len(seeds) <= 1
        else:
            seeds = {(_int(ir, c, "seed"), _int(ir, c, "seed2")) for c in copies}
            if seeds == {(0, 0)}:
                return ("random ops", "unseeded: each replica draws different numbers" if many
                        else "unseeded: draws differ from run to run")
            same = len(seeds) == 1
        if not many:
            return ("random ops", "one copy shared by every replica")
        return ("random ops", "the same seed in every replica: they all draw the same numbers"
                if same else "a different seed per replica: each draws its own numbers")
    if op.startswith(QUEUE_PREFIXES):
        return ("queues and iterators", "each replica takes its own elements" if many else
                "one dequeue, shared by every replica")
    return ("other stateful ops", f"{op}: " + ("a copy per replica" if many else
                                              "one copy shared by every replica"))


def _int(ir, node, attr) -> int:
    attrs = ir.attrs(node)
    return attrs[attr].i if attr in attrs else 0


def _variables(ir: GraphIR, view, closure: set) -> dict:
    """Batch-norm statistics and counters: (kind, treatment) -> [(original name, copies)]."""
    from graphxform import contract
    found = collections.defaultdict(list)
    for name, var in sorted(view.input_view.variables.items()):
        if var.trainable or var.role in ("slot", "optimizer_state", "trainable"):
            continue
        copies = view.copies.get(name, [])
        writes = {c: sorted(contract._writes(ir, c, closure)) for c in copies}
        if not any(writes.values()):
            continue
        counter = var.dtype in _INT_TYPES
        kind = "counters" if counter else "statistics (batch norm, moving averages)"
        if len(copies) > 1:
            treatment = ("each replica keeps its own copy and updates it from its own slice "
                         "(replica 0's is the one saved and fetched)")
        else:
            (copy,) = copies
            count = len(writes[copy])
            treatment = f"one shared copy, written {count} times per step" if count > 1 else \
                "one shared copy, updated once per step"
            readers = {src for w in writes[copy] for src, _ in ir.inputs(w)}
            if not counter and count == 1 and any(r.startswith("replica_0/") for r in readers):
                treatment += " from replica 0's slice"
        found[(kind, treatment)].append((name, copies))
    return found
