"""global-denominators: a loss that divides by a total of the batch's data (a weighted mean,
sum(w * l) / sum(w): tf.compat.v1.losses given `weights`; a masked mean) divides, in every
replica, by the whole batch's denominator, so the averaged gradients are one device's.

All-reduce averages the replicas' gradients, which is the single-device gradient when each
replica's loss is its slice's share of the batch's loss. For S / M with S and M sums over the
batch, replica i computes S_i / M_i, and the mean of those is not S / M unless every M_i is the
same. Dividing by mean_j M_j instead makes replica i's loss S_i / (M / N), whose mean over the
replicas is S / M, and whose gradient (M does not depend on the variables) averages to the
single-device one. So each such denominator gets a CollectiveReduceV2 (mean) per replica, and
everything in the replica that read it, the forward division and the gradient's, reads the
mean instead. A numerator that is a mean A over the batch (A_i / M_i) needs the replicas' sum
M instead: A_i / M averages to A / M. Where the rules cannot tell a sum from a mean (a loop's
outputs), the reduction that makes the numerator a scalar says; failing that, the graph is
refused rather than guessed. Per-example values over a total (tkipf/gcn's mask /
tf.reduce_mean(mask), each example's loss weighted by it) need the whole batch's total itself
(the replicas' mean of a mean, their sum of a sum): then each example's quotient is one
device's, and the loss over them is a mean or sum of per-example terms like any other.

A denominator that is a function of the batch's totals but not one itself (a guarded count,
max(sum(w), 1); sum(w) + eps; per-class counts from tf.math.unsorted_segment_mean) is not
averaged: the mean of f(M_i) is not f(M). Its totals are reduced instead (sums summed, means
averaged), so every replica computes the single-device f(M), divided by N where the numerator
is a sum (its share is S_i, with mean S / N). What cannot be traced to totals that way is left
for the contract to refuse.

A denominator qualifies when it depends on the batch's values (not only on its shape: a count
of examples is the same on every equal slice) and on no variable (then the gradient would flow
through it): graphxform.contract.batch_denominators finds them, and the contract refuses
what is left. The rows tf.where finds in a mask of the examples (tf.shape(tf.where(m))[0])
are counted by a total like the mask's sum, and so are the elements tf.boolean_mask selects
with such a mask (tf.size(sel), tf.shape(sel)[0]); a tf.reduce_mean over every axis of a
selection is first rewritten into its Sum over tf.size(sel), forward and gradient, so that
count is the one made the whole batch's. A count the slices' do not add up to (the distinct
values tf.unique finds in the batch) is refused, named."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from graphxform import opdefs, replica_values
from graphxform.contract import batch_denominators
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import Builder, replica_prefix
from graphxform.passes.cross_replica import whole_batch_copies
from graphxform.pipeline import Pass, PassResult

SCOPE = "global_denominators/"
INSTANCE_KEYS = 1 << 23  # apart from the all-reduce pass's buckets and sparse gathers
_NUMPY_FLOATS = {1: np.float32, 2: np.float64, 19: np.float16}  # float, double, half
EXAMPLE = "per-example value"  # a numerator of per-example values (_kind_of_numerator)


@dataclasses.dataclass
class GlobalDenominators(Pass):
    """``shared``: the ps strategies' form. One client runs every replica and there are no
    collectives: one node on the first replica's device combines the replicas' copies of a
    total and every replica reads it (the accumulators average the replicas' gradients, as
    all-reduce does, so the same totals make them one device's)."""
    name = "global-denominators"
    shared: bool = False

    def run(self, ir, ctx):
        tg = ctx.training
        replicas = len(ctx.devices)
        first = replica_prefix(0)
        if replicas < 2:
            return PassResult(modified=False)
        losses = [(first + node, port) for node, port in
                  (parse_tensor(step.loss) for step in tg.steps if step.loss)
                  if first + node in ir]
        classes = functools.cache(lambda: _classes(ir, first, losses))
        build = Builder(ir, self.name)
        summed = _sum_selected_means(ir, build, ctx.devices, losses, classes)
        if summed:
            classes = functools.cache(lambda: _classes(ir, first, losses))  # new nodes
        found = []  # (denominator, loss) in replica 0
        for loss in losses:  # a denominator may divide several terms (and losses): once
            found += [(d, loss) for d in dict.fromkeys(batch_denominators(ir, loss, classes))
                      if d not in {seen for seen, _ in found}]
        if not found:
            return PassResult(modified=bool(summed))
        keys = itertools.count(INSTANCE_KEYS)
        values = classes()
        recomputed, reduced = [], 0
        for k, (tensor, loss) in enumerate(found):
            scope = f"{SCOPE}{k}/"
            top = _numerator_kind(ir, values, tensor, loss)
            plan = _recompute_plan(ir, values, tensor, top)
            if plan is None:  # a total: its replicas' mean or sum
                _require_total(ir, values, tensor, loss)
                _reduce_each(ir, build, ctx.devices, tensor, next(keys),
                             _total_reduction(ir, values, tensor, top), scope,
                             consumers=lambda n, p: n.startswith(p), shared=self.shared)
                reduced += 1
                continue
            leaves, interior, scale = plan
            for leaf, final in leaves:
                _reduce_each(ir, build, ctx.devices, leaf, next(keys), final, scope,
                             consumers=lambda n, p: n.startswith(p) and n[len(p):] in interior,
                             shared=self.shared)
            reduced += len(leaves)
            if scale:
                _divide_each(ir, build, ctx.devices, tensor, scope)
            recomputed.append(tensor[len(first):])
        return PassResult(modified=True, summary={
            "denominators": [d[len(first):] for d, _ in found],
            "means over a selection summed": summed,
            "recomputed from the batch's totals": recomputed,
            "collectives_per_replica": 0 if self.shared else reduced})


def _sum_selected_means(ir, build, devices: list, losses: list, classes) -> list:
    """Rewrite each Mean over every axis of a selection a mask of the examples makes
    (tf.reduce_mean(tf.boolean_mask(l, m)): selections.averaged_selection) that a loss is a
    sum or multiple of into Sum(sel) / Cast(Size(sel)), in every replica, keeping its name,
    and point its gradient's division by the count (tf.gradients' or a tape's ``Mean_grad``)
    at that Cast: the division by a count of the selection that the loop in ``run`` makes the
    whole batch's, as for tf.reduce_sum(sel) / tf.size(sel). Returns the Means (names of the
    input graph); refuses one whose mask or gradient is not shown to be what that needs."""
    from graphxform.contract import ContractError
    from graphxform.selections import averaged_selection, loss_means
    from graphxform.replica_spread import SPLIT_SCOPE
    from graphxform.selections import of_the_batch, selection_mask
    first = replica_prefix(0)
    splits = functools.cache(  # a sweep of the graph, only where a Mean averages a selection
        lambda: {n for n in ir.nodes_of({"Split"}) if n.startswith(SPLIT_SCOPE)})
    means = list(dict.fromkeys(  # a mask of the weights selects as many on every replica
        mean for loss in losses for mean, _ in loss_means(ir, tensor_name(*loss))
        if averaged_selection(ir, mean) is not None and of_the_batch(
            ir, ir.value_sources(selection_mask(ir, averaged_selection(ir, mean))[0]),
            splits())))
    for k, mean in enumerate(means):
        gather = averaged_selection(ir, mean)
        if not _selected_by_a_batch_mask(ir, classes(), gather):
            raise ContractError(
                f"the loss averages ('{mean[len(first):]}') over the elements that "
                f"'{gather[len(first):]}' ({ir.op(gather)}) picks with a mask not shown to hold "
                "each example's own values: the replicas' counts of them are not shown to add "
                "up to the whole batch's; compute the mask from each example alone, or train "
                "on one device")
        name = mean[len(first):]
        for i, device in enumerate(devices):
            prefix = replica_prefix(i)
            _sum_selected_mean(ir, build, prefix + name, f"{prefix}{SCOPE}mean_{k}/", device)
    return [m[len(first):] for m in means]


# the ops between a Mean gradient's Shape of the Mean's input and its count of the elements
_COUNT_OPS = frozenset({"Const", "Cast", "Prod", "GatherV2", "Gather", "FloorMod", "FloorDiv",
                        "Add", "AddV2", "Maximum", "Range", "Identity"})


def _sum_selected_mean(ir, build, mean: str, scope: str, device: str) -> None:
    """One replica's copy ``mean`` as its Sum over the selection's Size (_sum_selected_means)."""
    from graphxform.contract import ContractError
    from graphxform.training import gradient_scope
    data, axes = ir.inputs(mean)
    selected = tensor_name(*data)
    attrs = ir.attrs(mean)
    dtype, shapes = attrs["T"].type, attrs.get("_output_shapes")
    total = build.op(f"{scope}sum", "Sum", [selected, tensor_name(*axes)], device=device,
                     T=dtype, Tidx=attrs["Tidx"].type, keep_dims=attrs["keep_dims"].b)
    size = build.op(f"{scope}size", "Size", [selected], device=device,
                    T=opdefs.output_dtype(ir, *data), out_type=3)
    count = build.op(f"{scope}count", "Cast", [size + ":0"], device=device, SrcT=3, DstT=dtype)
    divisions = _mean_gradient_divisions(ir, mean, data)
    within = {gradient_scope(d) for d in divisions}
    differentiated = {gradient_scope(n) for n, _ in ir.consumers(data[0], data[1])} - {None}
    if not differentiated <= within:
        raise ContractError(
            f"the loss averages ('{mean}') over a selection of the batch, and the division "
            f"by its count in the gradient {sorted(differentiated - within)[0]!r} computes "
            "was not found, so it cannot be made the whole batch's; write the loss as "
            "tf.reduce_sum(sel) / tf.cast(tf.size(sel), tf.float32)")
    controls = ir.control_inputs(mean)
    build.replace(mean, "RealDiv", [total + ":0", count + ":0"], device=device, T=dtype)
    for src in controls:
        ir.add_control_input(mean, src)
    if shapes is not None:
        for node in (mean, total):
            ir.proto(node).attr["_output_shapes"].CopyFrom(shapes)
    for division in divisions:
        ir.set_input(division, 1, count + ":0")


def _mean_gradient_divisions(ir, mean: str, data: tuple) -> list:
    """The divisions of gradients of ``mean`` by its count of elements: RealDivs in a
    gradients scope of a Tile of the incoming gradient to the input's shape (the Sum's
    gradient) by a count computed from the Shape of the Mean's input ``data`` (or of its
    output) and constants alone."""
    from graphxform.training import gradient_scope
    shapes = {n for n, _ in ir.consumers(data[0], data[1])
              if ir.op(n) in ("Shape", "Size") and gradient_scope(n)}
    shapes |= {n for n, _ in ir.consumers(mean) if ir.op(n) == "Shape" and gradient_scope(n)}
    found = []
    for shape in shapes:
        for reader in {d for d, _ in ir.consumers(shape)}:
            if ir.op(reader) != "Tile":
                continue
            for division, port in ir.consumers(reader):
                if port == 0 and ir.op(division) == "RealDiv" and \
                        _counted_from(ir, ir.input(division, 1)[0], shapes):
                    found.append(division)
    return sorted(set(found))


def _counted_from(ir, node: str, shapes: set) -> bool:
    """Whether ``node`` computes from ``shapes`` (and constants) alone, by _COUNT_OPS."""
    seen, stack, reads = set(), [node], False
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in shapes:
            reads = True
            continue
        if ir.op(current) not in _COUNT_OPS:
            return False
        stack.extend(src for src, _ in ir.inputs(current))
    return reads


def _classes(ir, first: str, losses: list):
    """replica_values' classes of replica 0's copies the losses read."""
    from graphxform import replica_values
    copies = set()
    for node, _ in losses:
        copies.update(n for n in ir.ancestors(node) if n.startswith(first))
    return replica_values.classify(ir, first, copies=sorted(copies))


def _recompute_plan(ir, values, tensor: str, top: str):
    """How to make replica 0's ``tensor``, a denominator of a loss whose numerator is of class
    ``top`` and that is not itself a total, the whole batch's: (its totals and how each is
    reduced, the nodes between them and it, whether it is then divided by the number of
    replicas); None for a total (a sum, mean or count: reduced as it is), and for what is not
    computed from totals alone by nodes nothing else reads."""
    from graphxform.replica_values import BATCHED, COUNT, IDENTICAL, MEAN, SUM
    first = replica_prefix(0)
    node, port = parse_tensor(tensor)
    if _total_kind(ir, values, (node, port)) is not None or \
            opdefs.output_dtype(ir, node, port) not in _NUMPY_FLOATS:
        return None
    leaves, interior, seen, stack = [], set(), set(), [(node, port)]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        kind = _total_kind(ir, values, current) or values.of(*current)
        if kind in (SUM, COUNT, MEAN):
            if opdefs.output_dtype(ir, *current) not in _NUMPY_FLOATS:
                return None  # a count of ints: collectives here reduce floats
            leaves.append((tensor_name(*current), "Div" if kind == MEAN else "Id"))
            continue
        if kind == IDENTICAL:
            continue
        inputs = ir.inputs(current[0])
        if kind in BATCHED or not inputs or not current[0].startswith(first):
            return None
        interior.add(current[0])
        stack.extend(inputs)
    read_elsewhere = any(dst not in interior for n in interior - {node}
                         for dst in ir.g._succ[n])
    if not leaves or read_elsewhere:
        return None
    return leaves, {n[len(first):] for n in interior}, top not in (MEAN, EXAMPLE)


def _total_reduction(ir, values, tensor: str, top: str) -> str:
    """How the replicas' copies of ``tensor``, a total, combine so that the mean of the
    replicas' losses is one device's: S_i / (M / N) averages to S / M for a sum S over the
    batch (the replicas' mean of the denominator), A_i / M to A / M for a mean A (their
    sum); a mean over a mean is the mean of both; per-example values divide by the whole
    batch's total (EXAMPLE)."""
    from graphxform.replica_values import MEAN
    kind = _total_kind(ir, values, parse_tensor(tensor))
    if top == EXAMPLE:  # the whole batch's total itself
        return "Div" if kind == MEAN else "Id"
    if top == MEAN and kind != MEAN:
        return "Id"
    return "Div"


def _numerator_kind(ir, values, denominator: str, loss: tuple) -> str:
    """Whether what the loss's divisions by ``denominator`` divide is a sum (or count) or a
    mean over the batch (see _kind_of_numerator). Anything else is refused, and so are a sum
    and a mean divided by one total: dividing one by the wrong total would train silently
    wrong."""
    from graphxform.contract import ContractError
    first = len(replica_prefix(0))
    kinds = {}
    for found in _numerators(ir, denominator, ir.ancestors(loss[0])):
        kinds[found] = _kind_of_numerator(ir, values, found)
        if kinds[found] is None:
            raise ContractError(
                f"the loss '{tensor_name(*loss)[first:]}' divides "
                f"'{tensor_name(*found)[first:]}' by '{denominator[first:]}', a total of the "
                "batch, and that cannot be shown to be a sum or a mean over the batch, so which "
                "total of the replicas' stands in for the whole batch's cannot be told; write "
                "the loss as tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)")
    if len(set(kinds.values())) != 1:
        named = " and ".join(f"'{tensor_name(*t)[first:]}' (a {kind})"
                             for t, kind in sorted(kinds.items()))
        raise ContractError(
            f"the loss '{tensor_name(*loss)[first:]}' divides {named or 'nothing'} by "
            f"'{denominator[first:]}', a total of the batch: "
            + ("the replicas' sum of it would stand in for one and their mean for the other; "
               "divide each by a total of its own" if named else
               "no division by it was found on the loss's way"))
    return next(iter(kinds.values()))


def _kind_of_numerator(ir, values, current: tuple):
    """SUM or MEAN for a numerator: its class, or, where the rules cannot tell (read from a
    loop's outputs), the reduction that makes it a scalar, seen through ops that only scale
    it; EXAMPLE for per-example values (batch_mixing accepted their division only on the
    loss's way from its terms); else None."""
    from graphxform.replica_values import BATCHED, COUNT, IDENTICAL, SUM
    if values.of(*current) in BATCHED:
        return EXAMPLE
    while current is not None:
        kind = _total_kind(ir, values, current)
        if kind is not None:
            return SUM if kind == COUNT else kind
        node = current[0]
        op, inputs = ir.op(node), ir.inputs(node)
        scaled = [t for t in inputs if values.of(*t) != IDENTICAL]
        divides = op in replica_values.DIVIDE_OPS and scaled[:1] != inputs[:1]  # c / it
        current = scaled[0] if op in _SCALING_OPS and len(scaled) == 1 and not divides else None
    return None


def _require_total(ir, values, tensor: str, loss: tuple) -> None:
    """Refuse a denominator that is neither a total of the batch (a sum, mean or count, or a
    scalar Sum or Mean of what the rules cannot class) nor recomputed from totals: the
    replicas' mean of max(sum(w_i), 1) is not max(sum(w), 1) where a slice has no weight."""
    from graphxform.contract import ContractError
    node, port = parse_tensor(tensor)
    if _total_kind(ir, values, (node, port)) is not None:
        return
    from graphxform.contract import counted_by_values
    from graphxform.selections import what_is_counted
    first = len(replica_prefix(0))
    counted = counted_by_values(ir, node, skip=lambda n: _rows_of_a_batch_mask(ir, values, n))
    if counted is not None:  # what decides its length is named: no total stands in for it
        what = what_is_counted(ir, counted, replica_prefix(0))
        raise ContractError(
            f"the loss '{tensor_name(*loss)[first:]}' divides by '{node[first:]}' "
            f"({ir.op(node)}), which reads {what}; divide by a constant, or by a sum over the "
            "batch (tf.reduce_sum(tf.cast(mask, tf.float32)))")
    raise ContractError(
        f"the loss '{tensor_name(*loss)[first:]}' divides by '{node[first:]}' ({ir.op(node)}), "
        "a function of the batch's totals that cannot be recomputed from them here (its "
        "totals are not shown to be sums or means, or something else reads its parts): the "
        "replicas' mean of it is not its value on the whole batch; divide by "
        "tf.reduce_sum(mask) itself, or by a constant")


def _rows_of_a_batch_mask(ir, values, node: str) -> bool:
    """Whether ``node`` is tf.where of a mask of the batch's examples: its rows' count is a
    total (_total_kind), and not what a refusal of a denominator reading it names."""
    from graphxform.selections import mask_of
    mask = mask_of(ir, node, through=())
    return mask is not None and _of_the_examples(ir, values, mask)


def _total_kind(ir, values, tensor: tuple):
    """SUM, MEAN or COUNT for a total of the batch: its class, or, where the rules cannot
    tell (what a loop read), a Sum or Mean recorded as a scalar, or the count of rows tf.where
    finds in a mask of the batch's examples (a sum of each example's count); else None."""
    from graphxform.contract import reduces_the_batch_axis
    from graphxform.replica_values import COUNT, MEAN, SUM, UNKNOWN
    from graphxform.selections import selection_counted, where_counted
    kind = values.of(*tensor)
    if kind in (SUM, MEAN, COUNT):
        return kind
    op = ir.op(tensor[0])
    if op in ("Sum", "Mean") and (_scalar(ir, tensor[0]) or kind == UNKNOWN and
                                  reduces_the_batch_axis(ir, tensor[0])):
        return SUM if op == "Sum" else MEAN  # of the batch, per timestep where not a scalar
    where = where_counted(ir, tensor[0]) if tensor[1] == 0 else None
    if where is not None and _rows_of_a_batch_mask(ir, values, where):
        return SUM  # each example's count of true entries, summed
    selection = selection_counted(ir, tensor[0]) if tensor[1] == 0 else None
    if selection is not None and _selected_by_a_batch_mask(ir, values, selection):
        return SUM  # the same, times the elements per selected row
    return None


def _selected_by_a_batch_mask(ir, values, gather: str) -> bool:
    """Whether ``gather`` (selections.selection_of's) picks with a mask of the batch's
    examples, so the count of what it selects is a sum over the batch."""
    from graphxform.selections import selection_mask
    return _of_the_examples(ir, values, selection_mask(ir, gather))


# ops that keep a mask's entries, so its count of true ones (boolean_mask flattens a
# [batch, time] mask by a shape it computes, which the classes cannot follow)
_ENTRIES_KEPT = frozenset({"Reshape", "Identity", "Squeeze", "ExpandDims"})


def _of_the_examples(ir, values, mask: tuple) -> bool:
    """Whether ``mask`` holds, through reshapes, the values of the replica's examples (its
    rows are the slice's), so the replicas' counts of its true entries add up to the
    batch's. The batch's longest length (tf.sequence_mask(lengths)'s width, a Max over the
    examples) counts as the whole batch's: global-extremes makes it so, after this pass."""
    from graphxform.replica_values import BATCHED, EXTREMES, IDENTICAL, classify
    while values.of(*mask) not in BATCHED and ir.op(mask[0]) in _ENTRIES_KEPT:
        mask = ir.inputs(mask[0])[0]
    if values.of(*mask) in BATCHED:
        return True
    read = [n for n in ir.ancestors(mask[0]) if n.startswith(replica_prefix(0))]
    extremes = {(n, 0): IDENTICAL for n in read if values.of(n) in EXTREMES}
    return bool(extremes) and classify(ir, replica_prefix(0), forced=extremes,
                                       copies=read).of(*mask) in BATCHED


_SCALING_OPS = frozenset({"Identity", "Neg", "Cast", "Mul", "StopGradient", "CheckNumerics",
                          "Snapshot", *replica_values.DIVIDE_OPS})


def _scalar(ir, node: str) -> bool:
    """Whether ``node``'s output is recorded as a scalar (a reduction over every axis)."""
    return opdefs.recorded_dims(ir, node, 0) == []


def _numerators(ir, denominator: str, forward: set) -> list:
    """What the loss's own divisions by ``denominator`` divide (not its gradient's): one per
    term an SSD or RetinaNet loss divides by its count of positive anchors."""
    from graphxform.replica_values import DIVIDE_OPS
    node, port = parse_tensor(denominator)
    return sorted({ir.input(dst, 0) for dst, dst_port in ir.consumers(node, port)
                   if dst_port == 1 and dst in forward and ir.op(dst) in DIVIDE_OPS})


def _copies(ir, devices: list, tensor: str):
    """(prefix, device, the replica's copy of replica 0's ``tensor``, its dtype) per replica."""
    first = replica_prefix(0)
    node, port = parse_tensor(tensor[len(first):])
    dtype = opdefs.output_dtype(ir, first + node, port)
    for i, device in enumerate(devices):
        prefix = replica_prefix(i)
        yield prefix, device, tensor_name(prefix + node, port), dtype


def _reduce_each(ir, build, devices: list, tensor: str, instance: int, final: str,
                 scope: str, consumers, shared: bool = False) -> None:
    """Each replica's copy of replica 0's ``tensor`` all-reduced (summed, or averaged with
    ``final`` "Div"), or with ``shared`` combined by one node; its consumers for which
    ``consumers(name, prefix)`` holds read that."""
    first = replica_prefix(0)
    node, port = parse_tensor(tensor[len(first):])
    scope = f"{scope}{instance - INSTANCE_KEYS}/"
    for prefix, reduced in whole_batch_copies(ir, build, devices, tensor[len(first):],
                                              instance, scope, final=final,
                                              shared_on=devices[0] if shared else None):
        ir.replace_all_uses_with(tensor_name(prefix + node, port), reduced,
                                 where=lambda n, p=prefix: consumers(n, p))


def _divide_each(ir, build, devices: list, tensor: str, scope: str) -> None:
    """Every replica reads its copy of replica 0's ``tensor`` over the number of replicas."""
    for prefix, device, local, dtype in _copies(ir, devices, tensor):
        count = build.const(f"{scope}{prefix}replicas", len(devices), _NUMPY_FLOATS[dtype],
                            device=device)
        ir.proto(count).attr[replica_values.REBATCHED_ATTR].s = replica_values.SAME.encode()
        share = build.op(f"{scope}{prefix}share", "RealDiv", [local, count], device=device,
                         T=dtype)
        ir.replace_all_uses_with(local, share + ":0",
                                 where=lambda n, p=prefix, s=share: n.startswith(p) and n != s)

