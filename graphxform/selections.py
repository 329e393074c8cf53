"""A loss that averages over the elements a mask of the batch selects: tf.boolean_mask, or a
gather of tf.where's indices, as sequence taggers drop their padding before the mean.

One device divides by how many elements the whole batch's mask selects; a replica, by how many
its slice's selects, and the average of the replicas' means is not the batch's (nor is the
average of their gradients) unless every slice selects as many. That count is a sum over the
batch (each example's true entries, times the elements per selected row), like the mask's sum:
global-denominators makes it the whole batch's where it is the count of the selection itself
(``tf.size(sel)``, ``tf.shape(sel)[0]``: ``selection_counted``), and rewrites a Mean over every
axis of a selection into its Sum over that count (``averaged_selection``). The contract refuses
the other averages over a selection, naming it."""

from __future__ import annotations

from graphxform.ir import parse_tensor
from graphxform.replica_values import (CROSS_ENTROPY_OPS, DIVIDE_OPS, ELEMENTWISE_OPS,
                                       ELEMENTWISE_UNARY_OPS, LINEAR_UNARY_OPS, LOSS_TERM_OPS)


def loss_means(ir, loss: str) -> list[tuple[str, str]]:
    """The averages the value of ``loss`` (a tensor name) is a sum or multiple of, each as
    (the averaging node, the tensor it counts the elements of): Means, and divisions by the
    Size of a tensor (``reduce_sum(x) / tf.size(x)``) or by its rows (``tf.shape(x)[0]``, the
    product of ``tf.shape(x)``)."""
    found, seen, stack = [], set(), [parse_tensor(loss)[0]]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        op, inputs = ir.op(node), ir.inputs(node)
        if op == "Mean":
            found.append((node, inputs[0][0]))
        elif op in DIVIDE_OPS and len(inputs) == 2:
            count = inputs[1][0]
            while ir.op(count) in ("Cast", "Identity") and ir.inputs(count):
                count = ir.inputs(count)[0][0]
            if ir.op(count) in ("StridedSlice", "Prod") and ir.inputs(count):
                count = _rows_or_size(ir, count)
            if count is not None and ir.op(count) in ("Size", "Shape"):
                found.append((node, ir.inputs(count)[0][0]))
            stack.append(inputs[0][0])
        elif op in LOSS_TERM_OPS:
            stack.extend(src for src, _ in inputs)
    return found


def _rows_or_size(ir, count: str):
    """The Shape node whose rows (``tf.shape(x)[0]``) or product ``count`` takes, or None."""
    from graphxform.nodes import const_value
    inputs = ir.inputs(count)
    shape = inputs[0][0]
    if ir.op(shape) != "Shape":
        return None
    if ir.op(count) == "StridedSlice":
        begin = const_value(ir, inputs[1][0]) if len(inputs) > 1 else None
        return shape if begin is not None and begin.reshape(-1)[:1].tolist() == [0] else None
    return shape


# ops whose output's rows are their (first) inputs' rows: where a selection's count carries on
_ROWS_KEPT = frozenset({
    *LINEAR_UNARY_OPS, *ELEMENTWISE_UNARY_OPS, *ELEMENTWISE_OPS, *CROSS_ENTROPY_OPS, "Cast",
    "Softmax", "LogSoftmax", "MatMul", "Select", "Sum", "Mean", "Max", "Min", "ExpandDims",
    "Squeeze"})
_GATHERS = frozenset({"Gather", "GatherV2", "GatherNd", "ResourceGather"})
# what tf.boolean_mask and tf.where(mask)[:, 0] put between tf.where and the gather
MASK_INDEX_OPS = frozenset({"Squeeze", "Reshape", "Cast", "Identity"})
_INDEX_OPS = MASK_INDEX_OPS | {"StridedSlice"}


def mask_of(ir, indices: str, through=MASK_INDEX_OPS):
    """The (node, port) of the mask whose true entries ``indices`` (a node) are, back through
    ``through`` ops to a one-input tf.where; None when they are something else."""
    while ir.op(indices) in through:
        indices = ir.inputs(indices)[0][0]
    inputs = ir.inputs(indices)
    return inputs[0] if ir.op(indices) == "Where" and len(inputs) == 1 else None


def where_counted(ir, tensor: str):
    """The tf.where (a one-input Where node) whose rows ``tensor`` (a node) counts, through
    casts: ``tf.shape(tf.where(m))[0]``, or their size or the product of their shape (as many
    times the mask's rank); None for anything else. Like ``tf.math.count_nonzero(m)``, that
    is a sum over the mask's entries, which the replicas' counts add up to where the mask
    holds values of the batch's examples."""
    from graphxform import opdefs
    while ir.op(tensor) in ("Cast", "Identity") and ir.inputs(tensor):
        tensor = ir.inputs(tensor)[0][0]
    if ir.op(tensor) == "StridedSlice" and opdefs.recorded_dims(ir, tensor, 0) not in ([], [1]):
        return None  # not the rows alone
    if ir.op(tensor) in ("StridedSlice", "Prod") and ir.inputs(tensor):
        tensor = _rows_or_size(ir, tensor)
    if tensor is None or ir.op(tensor) not in ("Size", "Shape") or not ir.inputs(tensor):
        return None
    where = ir.inputs(tensor)[0][0]
    return where if mask_of(ir, where, through=()) is not None else None


# ops whose output's length their input's values decide, not its shape
VALUE_SIZED_OPS = frozenset({
    "Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2", "ListDiff",
    "DynamicPartition", "NonMaxSuppression", "NonMaxSuppressionV2", "NonMaxSuppressionV3",
    "NonMaxSuppressionV4", "NonMaxSuppressionV5"})
# the families of those whose count over the whole batch is no sum of the slices' counts: what
# the count is, the API that makes it, and why (batch_mixing's and global-denominators'
# refusals name them so)
UNSUMMED_COUNTS = {
    "Unique": ("the distinct values the batch holds", "tf.unique",
               "a value found in several slices is one"),
    "ListDiff": ("the values tf.setdiff1d keeps where the batch's are those it removes",
                 "tf.setdiff1d", "a value found in several slices is removed once"),
    "NonMaxSuppression": ("the boxes non-max suppression keeps", "tf.image.non_max_suppression",
                          "each box is kept or suppressed by the other examples' boxes")}


def value_sized_family(op: str) -> str:
    """``op``'s family in UNSUMMED_COUNTS (its versions share one), or ``op`` itself."""
    return next((family for family in UNSUMMED_COUNTS if op.startswith(family)), op)


def of_the_batch(ir, reads: set, sources: set) -> bool:
    """Whether value sources ``reads`` hold the batch: one of ``sources`` (its splits), or a
    random draw shaped by it, a mask drawn per example (random-network-distillation trains its
    predictor on a random subset of the batch), whose values only its shape takes from the
    batch."""
    from graphxform.training import RANDOM_OPS
    return not reads.isdisjoint(sources) or any(
        ir.op(n) in RANDOM_OPS and not ir.ancestors(n).isdisjoint(sources) for n in reads)


def selected_rows(ir, counted: str, sources: set, any_size: bool = False):
    """A gather by the indices tf.where finds in a mask computed from the batch, whose rows
    reach ``counted`` through ops that keep rows; with ``any_size``, also any op whose
    output's length the batch's values decide (tf.unique of the labels); None when there is
    none."""
    return RowSelections(ir, sources, any_size).of(counted)


class RowSelections:
    """``selected_rows`` for many tensors of one graph and batch (a loss's every mean): the
    walks up from them share most of the graph (a transformer's 96 layer-norm means all reach
    the embedding), so the nodes a walk that found nothing went through are kept, and later
    walks stop there: nothing they reach is such a gather either. A walk that finds one ends
    there, and the nodes it saw are not kept (it saw only part of what they reach)."""

    def __init__(self, ir, sources: set, any_size: bool = False):
        self.ir, self.sources, self.any_size = ir, sources, any_size
        self.found_nothing = set()

    def of(self, counted: str):
        ir, sources = self.ir, self.sources
        seen, stack = set(), [counted]
        while stack:
            node = stack.pop()
            if node in seen or node in self.found_nothing:
                continue
            seen.add(node)
            op = ir.op(node)
            if op in _GATHERS:
                mask = mask_of(ir, ir.inputs(node)[1][0], through=_INDEX_OPS)
                if mask is not None and of_the_batch(ir, ir.value_sources(mask[0]), sources):
                    return node
            if self.any_size and op in VALUE_SIZED_OPS:
                if not sources.isdisjoint(ir.value_sources(node)):
                    return node
            elif op in _ROWS_KEPT:
                stack.extend(src for src, _ in ir.inputs(node))
        self.found_nothing |= seen
        return None


def what_is_counted(ir, node: str, prefix: str = "") -> str:
    """How a refusal names a count of the rows of ``node`` (what selected_rows found; a name
    in a copy whose ``prefix`` is dropped), and why no total of the replicas' is the whole
    batch's."""
    op, name = ir.op(node), node[len(prefix):]
    alone = ("each replica would count its own slice's, and the slices' counts do not add up "
             "to the whole batch's")
    family = UNSUMMED_COUNTS.get(value_sized_family(op))
    if family is not None:
        what, api, why = family
        return f"a count of {what} ('{name}', {api}): {alone} ({why})"
    if op == "Where":
        return (f"a count of the rows tf.where finds ('{name}') in a mask not shown to hold each "
                "example's own values, so the replicas' counts are not shown to add up to the "
                "whole batch's")
    what = (f"the examples tf.dynamic_partition puts in a part ('{name}')"
            if op == "DynamicPartition" else
            f"the rows '{name}' ({op}) keeps with a mask (tf.boolean_mask)")
    return (f"a count of {what}, which each replica would count in its own slice and which "
            "graphxform does not make the whole batch's (it does the count of a selection "
            "itself, tf.size(sel) cast to float or tf.shape(sel)[0], and the rows tf.where "
            "finds, in a mask of the examples, and the mask's sum)")


# ops whose output has their input's shape: the Size of one is the Size of the selection
_SHAPE_KEPT = frozenset({*LINEAR_UNARY_OPS, *ELEMENTWISE_UNARY_OPS, "Cast"})


def selection_of(ir, node: str):
    """The gather whose output ``node`` is, through ops that keep its shape (and cross
    entropies of selected logits, one loss per row), where the gather picks rows (axis 0) by
    tf.where's indices of a mask (tf.boolean_mask, tf.gather(x, tf.where(m)[:, 0]),
    tf.gather_nd(x, tf.where(m))); None for anything else."""
    from graphxform.nodes import const_value
    while (ir.op(node) in _SHAPE_KEPT or ir.op(node) in CROSS_ENTROPY_OPS) and ir.inputs(node):
        node = ir.inputs(node)[0][0]
    op, inputs = ir.op(node), ir.inputs(node)
    if op not in _GATHERS or len(inputs) < 2 or op == "ResourceGather":
        return None
    if op == "GatherV2":
        axis = const_value(ir, inputs[2][0]) if len(inputs) > 2 else None
        if axis is None or axis.reshape(-1).tolist() != [0] or \
                ir.attrs(node).get("batch_dims") is not None and ir.attrs(node)["batch_dims"].i:
            return None
    return node if mask_of(ir, inputs[1][0], through=_INDEX_OPS) is not None else None


def selection_mask(ir, gather: str):
    """The (node, port) of the mask whose true entries ``gather`` (selection_of's) picks."""
    return mask_of(ir, ir.inputs(gather)[1][0], through=_INDEX_OPS)


def _counts_whole(ir, node: str, port: int) -> bool:
    """Whether the Size of ``node:port`` is a sum over its rows: every other dimension is
    recorded as known, so each selected row has as many elements on every replica."""
    from graphxform import opdefs
    dims = opdefs.recorded_dims(ir, node, port)
    return dims is not None and len(dims) >= 1 and all(d >= 0 for d in dims[1:])


def selection_counted(ir, tensor: str):
    """The gather (selection_of's) whose selected elements ``tensor`` (a node) counts, through
    casts: ``tf.size(sel)``, the product of ``tf.shape(sel)`` (when sel's other dimensions are
    known), or its rows ``tf.shape(sel)[0]``; None for anything else. Like the mask's sum,
    that is a sum over the batch where the mask holds values of the batch's examples."""
    from graphxform import opdefs
    while ir.op(tensor) in ("Cast", "Identity") and ir.inputs(tensor):
        tensor = ir.inputs(tensor)[0][0]
    rows = ir.op(tensor) == "StridedSlice"
    if rows and opdefs.recorded_dims(ir, tensor, 0) not in ([], [1]):
        return None  # not the rows alone
    if ir.op(tensor) in ("StridedSlice", "Prod") and ir.inputs(tensor):
        tensor = _rows_or_size(ir, tensor)
    if tensor is None or ir.op(tensor) not in ("Size", "Shape") or not ir.inputs(tensor):
        return None
    counted, port = ir.inputs(tensor)[0]
    if not rows and not _counts_whole(ir, counted, port):
        return None
    return selection_of(ir, counted)


def averaged_selection(ir, mean: str):
    """The gather whose selection the Mean node ``mean`` averages over every axis of (so its
    count is ``tf.size(sel)``, a sum over the batch: its other dimensions are known), or
    None."""
    from graphxform import opdefs
    from graphxform.nodes import const_value
    inputs = ir.inputs(mean)
    if ir.op(mean) != "Mean" or len(inputs) != 2 or not _counts_whole(ir, *inputs[0]):
        return None
    rank = len(opdefs.recorded_dims(ir, *inputs[0]))
    axes = const_value(ir, inputs[1][0])
    if axes is None or {int(a) % rank for a in axes.reshape(-1)} != set(range(rank)):
        return None
    return selection_of(ir, inputs[0][0])
