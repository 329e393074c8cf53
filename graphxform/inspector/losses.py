"""Losses and gradients averaged, not summed, across replicas where the original averaged.

Each replica computes its loss on its slice of the batch. When that loss is a mean over the
slice (what tf.losses and tf_keras give), the single-device loss is the mean of the replicas'
and so is the gradient: the served loss must be a Mean over the replicas, an all-reduce of
gradients must divide (``final_op`` Div), a dense accumulator must average (``MEAN``). A sum in
any of these places trains with an N-times gradient (N replicas or workers) or reports an
N-times loss. A loss that is a sum over the batch has its gradients scaled by N at their seed
(passes/summed_losses.py), so they too are averaged, and it is served as the replicas' sum."""

from __future__ import annotations

from graphxform.inspector.findings import CheckResult
from graphxform.ir import GraphIR, parse_tensor
from graphxform.nodes import replica_prefix

MEAN, SUM, UNKNOWN = "mean", "sum", "unknown"
_PASS_THROUGH = {"Identity", "StopGradient", "Snapshot", "CheckNumerics"}
_MEAN_OPS = {"Mean", "RealDiv", "Div", "DivNoNan"}
_SUM_OPS = {"Sum", "L2Loss"}
_ADD_OPS = {"AddN", "AddV2", "Add", "Sub"}
_SIGN_OPS = {"Neg"}  # -tf.reduce_mean(log_sigmoid(x)), BPR's loss: a mean still
_FLOAT_TYPES = {1, 2, 14, 19}


def kind(ir: GraphIR, node: str, depth: int = 0) -> str:
    """Whether ``node`` (a replica's loss) is a mean or a sum over its slice."""
    if depth > 12 or node not in ir:
        return UNKNOWN
    op = ir.op(node)
    inputs = ir.inputs(node)
    if op in (_PASS_THROUGH | _SIGN_OPS) and inputs:
        return kind(ir, inputs[0][0], depth + 1)
    if op in _MEAN_OPS:  # a sum divided by a constant (a fixed batch size) is still a sum
        if op != "Mean" and len(inputs) == 2 and _constant(ir, inputs[1][0]):
            return kind(ir, inputs[0][0], depth + 1)
        return MEAN
    if op == "Mul" and len(inputs) == 2:  # scaled by a constant
        consts = [_constant(ir, src) for src, _ in inputs]
        if any(consts) and not all(consts):
            return kind(ir, inputs[consts.index(False)][0], depth + 1)
    if op in _SUM_OPS:
        return SUM
    if op in _ADD_OPS:
        kinds = {kind(ir, src, depth + 1) for src, _ in inputs}
        return MEAN if MEAN in kinds else SUM if SUM in kinds else UNKNOWN
    return UNKNOWN


def sum_of_ratios_of_totals(ir: GraphIR, copy: str) -> bool:
    """Whether a replica's loss ``copy``, a Sum, sums ratios of the batch's totals over the
    axes they keep: seq2seq's sequence_loss averaged over the batch alone, then summed over
    time (sum_t S_t / W_t, S_t and W_t sums over the batch). global-denominators divides each
    replica's S_t by the replicas' mean of W_t (a value equal on every replica that is not
    the batch's: ``same``), so each ratio, and their sum, averages across the replicas to one
    device's: a mean, though its last op is a Sum."""
    from graphxform import replica_values
    from graphxform.contract import reduces_the_batch_axis
    from graphxform.replica_values import DIVIDE_OPS, MEAN as MEAN_CLASS, SAME, SUM as SUM_CLASS
    from graphxform.passes.global_denominators import SCOPE
    node = _through(ir, copy)
    if ir.op(node) != "Sum":
        return False
    quotient = _through(ir, ir.inputs(node)[0][0])
    inputs = ir.inputs(quotient)
    if ir.op(quotient) not in DIVIDE_OPS or len(inputs) != 2:
        return False
    divisor = _through(ir, inputs[1][0])
    if SCOPE not in divisor:  # a divisor global-denominators made: no other is trusted here
        return False
    prefix = replica_prefix(0)
    values = replica_values.classify(ir, prefix, copies=sorted(
        n for n in ir.ancestors(node) | {node} if n.startswith(prefix)))
    total = values.of(*inputs[0]) in (SUM_CLASS, MEAN_CLASS) or \
        reduces_the_batch_axis(ir, inputs[0][0])  # shaped by the longest length: unclassed
    return total and values.of(*inputs[1]) == SAME


def _through(ir: GraphIR, node: str) -> str:
    while ir.op(node) in _PASS_THROUGH and ir.inputs(node):
        node = ir.inputs(node)[0][0]
    return node


def _constant(ir: GraphIR, node: str) -> bool:
    while ir.op(node) in ("Cast", "Identity") and ir.inputs(node):
        node = ir.inputs(node)[0][0]
    return ir.op(node) == "Const"


def served(ir: GraphIR, node: str) -> str:
    """How the graph serves a replicated loss under its original name."""
    op = ir.op(node)
    if op == "Mean":
        return MEAN
    if op in {"AddN", "Sum", "AddV2", "Add"}:
        return SUM
    if op in _PASS_THROUGH:
        return "replica 0's"
    return UNKNOWN


def loss_tensors(ir: GraphIR, view=None) -> list[str]:
    names = []
    if "losses" in ir.meta.collection_def:
        col = ir.meta.collection_def["losses"]
        names += list(col.node_list.value) or [b.decode() for b in col.bytes_list.value]
    if view is not None:
        tg = view.input_view
        names += [s.loss for s in tg.steps if s.loss] + list(tg.losses)
    return list(dict.fromkeys(n.lstrip("^") for n in names))


def check(ir: GraphIR, view=None) -> CheckResult:
    """``view``: graphxform.inspector.updates.View, for the steps' losses (None: the
    'losses' collection alone)."""
    result = CheckResult("losses")
    replicas = view.replicas if view is not None else 0
    means = 0
    checked = []
    for tensor in loss_tensors(ir, view):
        node = parse_tensor(tensor)[0]
        copy = replica_prefix(0) + node
        if node not in ir or copy not in ir:
            continue
        checked.append(node)
        own, merged = kind(ir, copy), served(ir, node)
        means += own == MEAN
        if own == MEAN and merged == SUM:
            result.error(f"loss '{node}' is the sum of the replicas' losses, but each replica's "
                         f"'{copy}' is a mean over its slice: the loss fetched would be "
                         f"{replicas or 'N'} times the single-device loss", [node, copy])
        elif own == SUM and merged == MEAN and not sum_of_ratios_of_totals(ir, copy):
            result.error(f"loss '{node}' averages the replicas' losses, but each replica's "
                         f"'{copy}' is a sum over its slice: the single-device loss is their "
                         "sum", [node, copy])
        elif merged == "replica 0's":
            result.warning(f"loss '{node}' is replica 0's alone (the loss of one slice of the "
                           "batch)", [node, copy])
    reduces = _check_gradients(ir, result, means > 0 or not checked)
    result.summary = (f"{len(checked)} replicated loss(es)"
                      + (f" ({', '.join(checked[:3])})" if checked else "")
                      + f"; {reduces} gradient reduction(s)")
    if not checked and not reduces:
        result.ran = False
        result.summary = "no replicated loss and no gradient reduction"
    elif not result.findings:
        result.summary += ": averaged across replicas as the single-device graph averages"
    return result


# all-reduces of the batch's statistics, not of gradients: sync-batch-norm's sums, the totals
# global-denominators reduces (weights, masks, counts), global-extremes' longest lengths,
# global-state's values of the state the step moves (counts, means, extremes)
STATISTICS_SCOPES = ("sync_batch_norm/", "global_denominators/", "global_extremes/",
                     "global_state/")


def _check_gradients(ir, result, averaged: bool) -> int:
    """All-reduces of float gradients divide, dense accumulators average, a sparse
    accumulator's sum is divided; returns how many were looked at."""
    count = 0
    for node in ir.nodes_of({"CollectiveReduceV2", "CollectiveReduce"}):
        attrs = ir.attrs(node)
        if "T" in attrs and attrs["T"].type not in _FLOAT_TYPES:
            continue
        if node.startswith(STATISTICS_SCOPES):  # sums of batch statistics, not gradients
            continue
        count += 1
        final = attrs["final_op"].s.decode() if "final_op" in attrs else "?"
        merge = attrs["merge_op"].s.decode() if "merge_op" in attrs else "?"
        if averaged and (merge, final) != ("Add", "Div"):
            result.error(f"all-reduce '{node}' combines with merge_op={merge}, "
                         f"final_op={final}: the replicas' gradients are not averaged (a mean "
                         "loss needs Add then Div)", [node])
    for node in ir.nodes_of({"ConditionalAccumulator", "ResourceConditionalAccumulator"}):
        count += 1
        attrs = ir.attrs(node)
        reduction = attrs["reduction_type"].s.decode() if "reduction_type" in attrs else "MEAN"
        if averaged and reduction != "MEAN":
            result.error(f"accumulator '{node}' sums the workers' gradients "
                         f"(reduction_type={reduction}): the update would be the number of "
                         "workers times the single-device one", [node])
    for node in ir.nodes_of({"SparseConditionalAccumulator"}):
        count += 1
        attrs = ir.attrs(node)
        if attrs["reduction_type"].s.decode() != "SUM" if "reduction_type" in attrs else False:
            continue  # TF's sparse MEAN divides per row: insert-accumulators sums, then divides
        takes = [d for d, _ in ir.consumers(node) if ir.op(d) == "SparseAccumulatorTakeGradient"]
        divided = any(ir.op(user) in {"RealDiv", "Div", "Mul"}
                      for take in takes for user, port in ir.consumers(take, 1))
        if averaged and takes and not divided:
            result.error(f"sparse accumulator '{node}' sums the workers' gradients and nothing "
                         "divides the sum by the number of workers", [node] + takes)
    return count
