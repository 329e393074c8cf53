"""summed-losses: a step whose loss is a sum over the batch (``reduction=SUM``; a sum divided by
a constant batch size, as the TF1 PTB language model and tf.nn.compute_average_loss write it)
trains with the sum of the replicas' gradients, not their mean.

Every synchronous strategy averages the replicas' gradients, which is one device's gradient
when each replica's loss is the mean of its slice. A replica's copy of a summed loss is its
slice's share of the batch's sum (the N copies add up to it), so the single-device gradient is
the replicas' sum: N times their mean. tf.gradients starts differentiating from a seed,
``<scope>grad_ys_0``, a Fill of ones; filling it with N instead multiplies every gradient of
that call by N, in each replica, before any reduction, whatever the strategy reduces with. It
is the same factor a mean loss's gradients already carry (a replica's mean divides by B/N, not
B), so what the contract asks of custom gradients and float16 holds alike.

A tf.GradientTape in graph mode seeds ``tape.gradient(loss)`` with ``ones`` (a Const of ones,
or a Fill for a target of unknown shape) outside its ``gradient_tape/`` scope, read by the ops
of the gradient of the op that made the loss; in each replica those readers read N instead.

It runs after global-denominators: tkipf/gcn's and many seq2seq losses sum each example's
masked loss over the batch's total of the mask (``reduce_sum(l * m / reduce_sum(m))``), which
is a sum over the batch (the replicas' copies add up to one device's loss) only once every
replica divides by the whole batch's total.

tf.gradients differentiates the sum of its ys's elements, so ys of one value per example
(``minimize`` of an unreduced cross entropy; DDPG's actor, ``tf.gradients(actions, params,
-action_gradients)`` with the critic's gradients fed per example) is a sum over the batch too.
grad_ys the user gives (``grad_ys_0`` is then an Identity of it) is scaled by N (a Mul before
that Identity) where each example's rows weigh that example's own ys (a batch tensor of the
examples) or it is the same on every replica (a constant): the objective, the sum of ys times
grad_ys, is then a sum over the batch.

A step qualifies when its loss is shown a sum (graphxform.replica_values) and every gradient
its updates apply comes from one tf.gradients call (or one tape's gradient) with one seed that
is shown to start the loss's gradient; anything else (several losses differentiated at once,
grad_ys mixing the batch) is left as it is, and the contract refuses it as before."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import replica_values
from graphxform.ir import parse_tensor, tensor_name
from graphxform.nodes import Builder, const_value, numpy_dtype, replica_prefix, tensor_proto
from graphxform.pipeline import Pass, PassResult
from graphxform.training import TAPE_SCOPE, gradient_scope


@dataclasses.dataclass
class SummedLosses(Pass):
    name = "summed-losses"

    def run(self, ir, ctx):
        replicas = len(ctx.devices)
        if replicas < 2:
            return PassResult(modified=False)
        build = Builder(ir, self.name)
        scaled = []
        for step in ctx.training.steps:
            if step.name in ctx.state.get("half-precision", ()) or not summed_loss(ir, step):
                continue  # half-precision carries its gradients at one device's scale
            found = seed_of(ir, ctx.training, step)
            if found is None:
                continue  # the contract refuses it
            seed = found[0]
            if any(seed_scale(ir, replica_prefix(i) + seed) != 1 for i in range(replicas)):
                continue  # not a seed of ones: the contract refuses it
            if not given_seed_sums(ir, step, seed):
                continue  # grad_ys mixing the batch: the contract refuses it
            for i in range(replicas):
                scale_seed(ir, build, replica_prefix(i), seed, replicas)
            scaled.append(step.name)
        return PassResult(modified=bool(scaled), summary={"steps": len(scaled)})


def summed_loss(ir, step) -> bool:
    """Whether what replica 0's copy of ``step`` differentiates is a sum over the batch: its
    loss is one, or holds one value per example (replica_values.differentiated)."""
    if not step.loss:
        return False
    node, port = parse_tensor(step.loss)
    copy = replica_prefix(0) + node
    if copy not in ir or not _may_be_sum(ir, copy):
        return False
    copies = [n for n in ir.ancestors(copy) if n.startswith(replica_prefix(0))]
    values = replica_values.classify(ir, replica_prefix(0), copies=copies)
    return replica_values.differentiated(values.of(copy, port)) == replica_values.SUM


_SCALINGS = {"Identity", "Snapshot", "Neg", "Mul", "RealDiv", "Div", "DivNoNan", "Cast"}


def _may_be_sum(ir, node: str, depth: int = 0) -> bool:
    """Whether ``node`` could be a sum over the batch or hold one value per example: anything
    but a constant or a tf.reduce_mean over the batch axis, reached through scalings. A cheap
    filter before the classification, which costs a walk over the whole forward pass (a mean
    loss, the common case, is passed over at once); the contract classifies every loss again,
    so a sum this filter missed is refused, never trained."""
    op = ir.op(node)
    if op == "Const":
        return False
    if op == "Mean":
        axes = const_value(ir, ir.input(node, 1)[0])
        return axes is None or 0 not in axes.reshape(-1)
    if op in _SCALINGS and depth <= 16:
        return any(_may_be_sum(ir, src, depth + 1) for src, _ in ir.inputs(node)[:2])
    return True


def given_seed_sums(ir, step, seed: str) -> bool:
    """Whether the seed of ``step``'s gradients (named as in the input graph) is one the
    objective stays a sum over the batch with once scaled: ones (tf.gradients' own), or the
    grad_ys the user gave (an Identity of it, read in replica 0) where that is a batch tensor
    of the examples' own rows or the same on every replica (replica_values)."""
    copy = replica_prefix(0) + seed
    if copy not in ir or ir.op(copy) != "Identity":
        return True
    given = given_seed(ir, copy)
    copies = [n for n in ir.ancestors(copy) if n.startswith(replica_prefix(0))]
    values = replica_values.classify(ir, replica_prefix(0), copies=copies)
    return values.of(*given) in replica_values.BATCHED | {replica_values.IDENTICAL}


def given_seed(ir, copy: str) -> tuple:
    """The grad_ys tensor the user gave, where ``copy`` (a replica's copy of a tf.gradients
    seed) is the Identity of it tf.gradients makes, past the Mul this pass scales it by."""
    given = ir.input(copy, 0)
    if ir.node(given[0]).get("created_by") == SummedLosses.name:  # scaled already
        given = ir.input(given[0], 0)
    return given


def seed_of(ir, tg, step) -> tuple[str, tuple] | None:
    """``(seed, readers)``: the one seed of the one gradient computation whose gradients the
    step's updates apply, and (for a tape) the gradient ops that read it; names of the input
    graph, found through replica 0's copies in ``ir``. None where there is no such seed.
    tf.gradients' seed is ``<scope>grad_ys_0``, a Fill only its call reads; a tape's is found
    by ``_tape_seed``."""
    scopes = {gradient_scope(parse_tensor(t)[0]) for v in tg.variables.values()
              for g in v.gradients_applied_in(step.closure) for t in g.tensors}
    if len(scopes) != 1 or None in scopes:
        return None
    scope = scopes.pop()
    if TAPE_SCOPE.search(scope):
        return _tape_seed(ir, scope, step)
    seed = scope + "grad_ys_0"
    if seed not in step.closure or scope + "grad_ys_1" in step.closure:
        return None
    return seed, ()


def _tape_seed(ir, scope: str, step) -> tuple[str, tuple] | None:
    """The seed of a tape's ``tape.gradient(loss)`` and its readers, where they are shown to
    start the gradient of the step's loss. The seed is the one Const or Fill of one repeated
    value (ones, or N once this pass ran) outside every gradients scope that only ops of
    ``scope`` read (a forward constant is read by its forward op too). TF names a forward op's
    gradient ops after the op's name scope; the readers must lie in the loss's, and every
    forward op of that scope whose inputs or outputs a gradient op named there reads (whose
    gradient was taken there) must be the loss or feed it: so what the readers differentiate
    is the loss, not another op of its scope (a mean beside a listed sum)."""
    if not step.loss:
        return None
    prefix = replica_prefix(0)
    inside = {n for n in step.closure if prefix + n in ir}

    def consumers(n):
        return {d[len(prefix):] for d, _ in ir.consumers(prefix + n) if d.startswith(prefix)}

    def inputs(n):
        return [src[len(prefix):] for src, _ in ir.inputs(prefix + n) if src.startswith(prefix)]

    def fed(n):  # its inputs, and what those a pass made read (global-denominators' Sum of
        # a selection, where a Mean's gradient reads the selection's shape)
        return [f for src in inputs(n) for f in [src] + (
            inputs(src) if ir.node(prefix + src).get("origin") is None else [])]

    seeds = [n for n in inside if gradient_scope(n) is None
             and ir.op(prefix + n) in ("Const", "Fill") and seed_value(ir, prefix + n)
             and consumers(n) and all(gradient_scope(d) == scope for d in consumers(n))]
    if len(seeds) != 1:
        return None
    seed, loss = seeds[0], parse_tensor(step.loss)[0]
    readers = tuple(sorted(consumers(seed)))
    named = {r[len(scope):].rpartition("/")[0] for r in readers}
    if len(named) != 1 or named.copy().pop() not in _forward_scopes(loss):
        return None
    named = named.pop()
    gradient = [n for n in inside if gradient_scope(n) == scope
                and n[len(scope):].rpartition("/")[0] == named]
    read = {src for n in gradient for src in inputs(n)}
    read |= {shaped for src in read if ir.op(prefix + src) in _SHAPES
             for shaped in inputs(src)[:1]}
    # forward ops of that scope, the step's or not (the loss is not: a tape's gradient of a
    # reduction reads its input's shape, not its value)
    forward = {n[len(prefix):] for n in ir.nodes() if n.startswith(prefix + named)}
    differentiated = {n for n in forward if gradient_scope(n) is None
                      and named in _forward_scopes(n) and ir.op(prefix + n) != "Const"
                      and (n in read or any(src in read for src in fed(n)))}
    feeds_loss = {n[len(prefix):] for n in ir.ancestors(prefix + loss)} | {loss}
    if loss not in differentiated or not differentiated <= feeds_loss:
        return None
    return seed, readers


_SHAPES = {"Shape", "Size", "Rank"}


def _forward_scopes(op: str) -> tuple[str, str]:
    """The name scopes a tape may name forward op ``op``'s gradient after: the scope it was
    made in, or, for an op named as the scope it opened (tf.math.divide_no_nan's
    'div_no_nan'), that scope."""
    return op.rpartition("/")[0], op


def scale_seed(ir, build, prefix: str, seed: str, value) -> None:
    """Make replica ``prefix``'s copy of ``seed`` (of ones) start its gradient from ``value``
    (N here; 1/N for passes/half_precision.py): a Fill fills with it; a Const of ones (a
    tape's, which only the readers of the loss's gradient read) holds it; grad_ys the user
    gave (the Identity tf.gradients names the seed) is multiplied by it before that Identity."""
    copy = prefix + seed
    if ir.op(copy) == "Identity":
        device = ir.node(copy).get("device", "")
        dtype = ir.attrs(copy)["T"].type
        factor = build.const(ir.unique_name(copy + "/replicas"),
                             np.asarray(value, dtype=numpy_dtype(dtype)), device=device)
        scaled = build.op(ir.unique_name(copy + "/scaled"), "Mul",
                          [tensor_name(*ir.input(copy, 0)), factor + ":0"], device=device, T=dtype)
        ir.set_input(copy, 0, scaled + ":0")
    elif ir.op(copy) == "Fill":
        dtype = numpy_dtype(ir.attrs(copy)["T"].type)
        filled = build.const(ir.unique_name(copy + "/replicas"), np.asarray(value, dtype=dtype),
                             device=ir.node(copy).get("device", ""))
        ir.set_input(copy, 1, filled + ":0")
    else:
        held = const_value(ir, copy)
        held = tensor_proto((held * value).astype(held.dtype))
        build.replace(copy, "Const", (), device=ir.node(copy).get("device", ""),
                      dtype=held.dtype, value=held)


def seeds_scaled(ir, tg, step, replicas: int) -> bool:
    """Whether every replica's copy of ``step``'s seed starts its gradient from ``replicas``
    (this pass ran on it): what the contract checks before it accepts a summed loss."""
    found = seed_of(ir, tg, step)
    return found is not None and all(
        seed_scale(ir, replica_prefix(i) + found[0]) == replicas
        for i in range(replicas)) and given_seed_sums(ir, step, found[0])


def seed_scale(ir, node: str):
    """How many times the user's seed ``node`` starts its gradient from: for tf.gradients'
    own (ones) or a tape's, its one value; for grad_ys the user gave (an Identity of it), the
    factor this pass multiplied it by, or 1. None where neither can be read."""
    if node not in ir or ir.op(node) != "Identity":
        return seed_value(ir, node)
    given = ir.input(node, 0)[0]
    if ir.node(given).get("created_by") == SummedLosses.name and ir.op(given) == "Mul":
        return seed_value(ir, ir.input(given, 1)[0])
    return 1


def seed_value(ir, node: str):
    """The one value a Fill of a Const fills with, or a Const of one repeated value holds;
    else None."""
    if node not in ir:
        return None
    op = ir.op(node)
    value = (const_value(ir, ir.inputs(node)[1][0]) if op == "Fill" and len(ir.inputs(node)) > 1
             else const_value(ir, node) if op == "Const" else None)
    if value is None or not value.size or (value != value.reshape(-1)[0]).any():
        return None
    return value.reshape(-1)[0].item()
