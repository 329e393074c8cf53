"""consistent-random: random ops draw what the single-device graph would draw.

A random op in the replicated step whose shape comes from the replica's slice of the batch
(dropout's RandomUniform over the activations) would draw a fresh mask per replica. Instead,
each replica's copy draws the whole global batch's values, with the op's own seeds and
attributes, exactly as the single-device op draws them (a stateful op's generator then also
advances as on one device, step after step), and keeps the rows of its own slice. Replicas
pay R times the drawing; nothing else changes.

A random op whose shape does not depend on the batch (a sampler, noise on weights) already
draws the same values on every replica, as its copies share its seeds. One with seed = seed2
= 0 draws differently on every run, even on one device: it is listed, not rewritten. One
inside a function body (dropout under ``tf.cond`` with control flow v2) is out of reach: the
option is refused (graphxform/functions.py).

A ``tf.random.Generator`` draw in graph mode (``gen.normal(tf.shape(x))``) is a stateless op
whose key and counter an ``RngReadAndSkip`` reads from the generator's state variable, which it
then advances by the draw's element count. The whole-batch draw advances it by the whole
batch's count too, so every replica's copy of the state moves as one device's does; a skip
counted from the batch that feeds no such draw is refused."""

from __future__ import annotations

import dataclasses

import numpy as np

from graphxform import opdefs, replica_values
from graphxform.contract import replica_local
from graphxform.errors import GraphxformError
from graphxform.functions import legacy_loop_frames, out_of_reach, random_in_function
from graphxform.training import RANDOM_OPS
from graphxform.nodes import Builder, const_value, replica_prefix
from graphxform.pipeline import Pass, PassResult

SCOPE = "consistent_random/"
SHAPED_RANDOM_OPS = {"RandomUniform", "RandomStandardNormal", "TruncatedNormal",
                     "RandomUniformInt", "StatelessRandomUniform", "StatelessRandomNormal",
                     "StatelessTruncatedNormal", "StatelessRandomUniformInt",
                     "StatelessRandomUniformV2", "StatelessRandomNormalV2",
                     "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
                     "StatelessRandomUniformFullIntV2"}
INT32, INT64 = 3, 9
GENERATOR_SKIP = "RngReadAndSkip"
# tf.random.Generator's ops that draw from its state themselves (Generator.binomial)
GENERATOR_DRAWS = {"StatefulRandomBinomial", "StatefulUniform", "StatefulUniformInt",
                   "StatefulUniformFullInt", "StatefulStandardNormal",
                   "StatefulStandardNormalV2", "StatefulTruncatedNormal"}


@dataclasses.dataclass
class ConsistentRandom(Pass):
    name = "consistent-random"

    def run(self, ir, ctx):
        prefix = replica_prefix(0)
        inside = random_in_function(ir, {prefix + n for n in ctx.training.train_closure})
        if inside:
            raise out_of_reach("--consistent-random", ir, prefix, inside,
                               "draws random numbers",
                               "a tf.cond or while loop body with control flow v2")
        random_ops = sorted(n[len(prefix):] for n in ir.nodes_of(SHAPED_RANDOM_OPS)
                            if n.startswith(prefix))
        unseeded = [n for n in random_ops if _unseeded(ir.attrs(prefix + n))]
        local = replica_local(ir, len(ctx.devices))
        _refuse_out_of_reach(ir, prefix, local)
        batched = [n for n in random_ops if n not in unseeded
                   and _batch_shaped(ir, ir.input(prefix + n, 0)[0], local)]
        _refuse_rows_not_examples(ir, prefix, batched)
        _refuse_uncounted_skips(ir, prefix, batched, local)
        build = Builder(ir, self.name)
        replicas = len(ctx.devices)
        for name in batched:
            for i in range(replicas):
                node = replica_prefix(i) + name
                if node in ir:
                    _draw_whole_batch(ir, build, node, i, replicas, ctx.devices[i])
        return PassResult(modified=bool(batched), summary={
            "random_ops_rewritten": len(batched), "unseeded_random_ops": unseeded})


def _refuse_out_of_reach(ir, prefix: str, local: set) -> None:
    """Refuse what the pass cannot give the single-device draws: a random op in a legacy
    while loop whose frame reads the replica's slice (dropout inside dynamic_rnn, a random
    flip per example in map_fn), which draws afresh at every iteration (a whole-batch draw
    hoisted out of its frame cannot run there; left alone, each replica replays replica 0's
    draws), and a random op drawing from values of the slice's examples (tf.random.categorical
    from each example's logits), which only a gather of every replica's values could draw as
    one device does. Unseeded ones are left to verify (they differ run to run anyway)."""
    frames = [members for members in legacy_loop_frames(ir)
              if any(n.startswith(prefix) for n in members) and not members.isdisjoint(local)]
    looped = set().union(*frames) if frames else set()
    for name in sorted(ir.nodes_of(RANDOM_OPS)):
        if not name.startswith(prefix) or _unseeded(ir.attrs(name)):
            continue
        op, original = ir.op(name), name[len(prefix):]
        if name in looped:
            raise GraphxformError(
                f"--consistent-random: '{original}' ({op}) draws random numbers inside a "
                "legacy while loop over the batch (tf.while_loop, dynamic_rnn or map_fn with "
                "control flow v1), afresh at every iteration, which the pass cannot give each "
                "replica's slice as one device draws it; drop the option")
        if op not in SHAPED_RANDOM_OPS and any(src in local for src, _ in ir.inputs(name)):
            raise GraphxformError(
                f"--consistent-random: '{original}' ({op}) draws from values of each "
                "example (as tf.random.categorical from logits), which the pass cannot give "
                "each replica's slice as one device draws it; drop the option")


def _refuse_rows_not_examples(ir, prefix: str, batched: list) -> None:
    """The pass gives replica i rows [i*b, (i+1)*b) of the global draw, which is one device's
    only where a draw's row k belongs to example k: its shape's first entry is the batch size
    itself (tf.shape(x), [tf.shape(x)[0], d]). A draw of [N * batch, 1] reshaped to [N, batch]
    (Dopamine's IQN quantiles) puts example k's numbers in rows k, b + k, ...: refuse."""
    for name in batched:
        shape = ir.input(prefix + name, 0)[0]
        if ir.op(shape) != "Const" and not _leads_with_batch_size(ir, shape):
            raise GraphxformError(
                f"--consistent-random: '{name}' ({ir.op(prefix + name)}) draws a shape whose "
                "first entry is computed from the batch size but is not the batch size itself "
                "(as [N * batch, 1], reshaped later), so its rows are not the examples and "
                "the pass cannot give each replica the single-device draws of its slice; "
                "drop the option")


def generator_skip(ir, draw: str) -> str | None:
    """The RngReadAndSkip whose output a stateless ``draw`` takes its key and counter from
    (through StridedSlice and Bitcast, as tf.random.Generator builds them), or None."""
    found = set()
    for port in (1, 2):  # key, counter
        if len(ir.inputs(draw)) <= port:
            return None
        src = ir.input(draw, port)[0]
        while ir.op(src) in ("StridedSlice", "Bitcast", "Identity"):
            src = ir.input(src, 0)[0]
        found.add(src)
    skip = found.pop() if len(found) == 1 else None
    return skip if skip is not None and ir.op(skip) == GENERATOR_SKIP else None


def counted_skip(ir, draw: str) -> tuple[str, str] | None:
    """(the skip, its count's Prod) where ``draw``'s generator skips by exactly the draw's
    element count, ``Cast(Prod(shape))`` of the draw's own shape tensor: a whole-batch draw
    then skips R times as far. None otherwise."""
    skip = generator_skip(ir, draw)
    if skip is None or len(ir.inputs(skip)) < 3:
        return None
    count = ir.input(skip, 2)[0]
    while ir.op(count) in ("Cast", "Identity"):
        count = ir.input(count, 0)[0]
    if ir.op(count) != "Prod" or ir.input(count, 0) != ir.input(draw, 0):
        return None
    return skip, count


def _refuse_uncounted_skips(ir, prefix: str, batched: list, local: set) -> None:
    """A generator skip counted from the replica's slice must be one a rewritten draw makes
    the whole batch's (``counted_skip``); any other (a draw the pass does not rewrite, a count
    it cannot scale, a Generator op drawing from its state itself, as binomial does) would
    advance each replica's generator by its slice's count alone."""
    counted = set()
    for name in batched:
        found = counted_skip(ir, prefix + name)
        if found:
            counted.add(found[0])
    for skip in sorted(ir.nodes_of((GENERATOR_SKIP, *GENERATOR_DRAWS))):
        if not skip.startswith(prefix) or skip in counted:
            continue
        if any(src in local for src, _ in ir.inputs(skip)[1:]):
            raise GraphxformError(
                f"--consistent-random: '{skip[len(prefix):]}' ({ir.op(skip)}) draws from a "
                "tf.random.Generator a count of numbers computed from the batch, which the "
                "pass cannot make the whole batch's, so each replica's generator would move "
                "by its slice's count alone; drop the option")


def _leads_with_batch_size(ir, shape: str) -> bool:
    """Whether the shape vector ``shape`` starts with a tensor's own first dimension:
    tf.shape(x), or a Pack or concat whose first part is tf.shape(x)[0] (or [:1]); or with
    the batch's size split-inputs wrote into a fixed batch's shape (``_rebatched``)."""
    op = ir.op(shape)
    while op in ("Identity", "Cast"):
        shape = ir.inputs(shape)[0][0]
        op = ir.op(shape)
    if op in ("Shape", "ShapeN"):
        return True
    if op in ("Pack", "ConcatV2") and ir.inputs(shape):
        first = ir.inputs(shape)[0][0]
        while ir.op(first) in ("Identity", "Cast"):
            first = ir.inputs(first)[0][0]
        if ir.op(first) == "StridedSlice" and ir.op(ir.inputs(first)[0][0]) in (
                "Shape", "ShapeN"):
            return True
    return _rebatched(ir, shape)


def leading_const(ir, shape: str) -> str | None:
    """The Const whose entry 0 is entry 0 of the shape vector ``shape``: the Const itself, or
    one a Pack or concat takes its first part from as ``c[0]`` (or ``c[:1]``). TF folds
    tf.shape of a tensor of static shape into a Const: tf.image.random_flip_left_right on a
    fixed batch draws ``[tf.shape(image)[0]]``, a Pack of such a slice."""
    while ir.op(shape) in ("Identity", "Cast"):
        shape = ir.inputs(shape)[0][0]
    if ir.op(shape) == "Const":
        return shape
    if ir.op(shape) not in ("Pack", "ConcatV2") or not ir.inputs(shape):
        return None
    first = ir.inputs(shape)[0][0]
    while ir.op(first) in ("Identity", "Cast"):
        first = ir.inputs(first)[0][0]
    if ir.op(first) != "StridedSlice" or len(ir.inputs(first)) < 2:
        return None
    source, begin = ir.inputs(first)[0][0], const_value(ir, ir.inputs(first)[1][0])
    if ir.op(source) != "Const" or begin is None or begin.reshape(-1)[:1].tolist() != [0]:
        return None
    return source


def _rebatched(ir, shape: str) -> bool:
    """Whether ``shape`` leads with a fixed batch's size that split-inputs made the slice's
    (a Const it marked as the batch's shape)."""
    const = leading_const(ir, shape)
    mark = ir.attrs(const).get(replica_values.REBATCHED_ATTR) if const else None
    return mark is not None and mark.s == replica_values.BATCH_SHAPE.encode()


def _batch_shaped(ir, shape: str, local: set) -> bool:
    """Whether a draw of ``shape`` is the replica's slice's: a shape read from the slice, or
    one led by a constant split-inputs rewrote from the global batch's size (a fixed batch)."""
    return shape in local or _rebatched(ir, shape)


def _unseeded(attrs) -> bool:
    """Stateless ops take their seed as an input: never unseeded in this sense."""
    if "seed" not in attrs and "seed2" not in attrs:
        return False
    return not attrs["seed"].i and not attrs["seed2"].i


def _draw_whole_batch(ir, build, node, index, replicas, device) -> None:
    """Replace ``node`` (replica ``index``'s copy) by the global draw's rows of its slice."""
    scope = SCOPE + node + "/"
    src, port = ir.input(node, 0)
    shape = f"{src}:{port}"
    index_type = opdefs.output_dtype(ir, src, port) or INT32
    value_type = opdefs.output_dtype(ir, node, 0)
    np_type = np.int64 if index_type == INT64 else np.int32

    def op(name, op_type, inputs, **attrs):
        return build.op(scope + name, op_type, inputs, device=device, **attrs)

    def const(name, value):
        return build.const(scope + name, value, np_type, device=device)

    rank = op("rank", "Size", [shape], T=index_type, out_type=index_type)
    axes = op("axes", "Range", [const("zero", 0), rank, const("one", 1)], Tidx=index_type)
    first = op("first_axis", "Cast", [op("is_first", "Equal", [axes, const("zero_2", 0)],
                                         T=index_type)], SrcT=10, DstT=index_type)
    rows = op("rows", "StridedSlice", [shape, const("begin", [0]), const("end", [1]),
                                       const("stride", [1])], T=index_type,
              Index=index_type, shrink_axis_mask=1)
    grow = op("grow", "AddV2", [op("extra", "Mul", [first, const("more", replicas - 1)],
                                   T=index_type), const("one_2", 1)], T=index_type)
    global_shape = op("global_shape", "Mul", [shape, grow], T=index_type)
    others = ["{}:{}".format(*ir.input(node, k)) for k in range(1, len(ir.inputs(node)))]
    draw = scope + "draw"
    ir.add_node(draw, ir.op(node), [global_shape + ":0", *others], device=device,
                attr=dict(ir.attrs(node)), created_by=build.created_by)
    skip = counted_skip(ir, node)
    if skip is not None:  # a tf.random.Generator's: skip the whole batch's count
        generator, prod = skip
        count = op("skip_count", "Prod", [global_shape, "{}:{}".format(*ir.input(prod, 1))],
                   T=index_type, Tidx=ir.attrs(prod)["Tidx"].type,
                   keep_dims=ir.attrs(prod)["keep_dims"].b)
        delta_type = opdefs.output_dtype(ir, *ir.input(generator, 2)) or 23  # uint64
        ir.set_input(generator, 2, op("skip_delta", "Cast", [count], SrcT=index_type,
                                      DstT=delta_type) + ":0")
    begin = op("slice_begin", "Mul", [first, op("offset", "Mul", [rows, const(
        "replica", index)], T=index_type)], T=index_type)
    piece = op("slice", "Slice", [draw, begin, shape], T=value_type, Index=index_type)
    build.replace(node, "Identity", [piece], device=device, T=value_type)
    # the replicas' rows together are the single-device draw: fetching it concatenates them
    ir.node(node)["attr"][replica_values.REBATCHED_ATTR].s = replica_values.BATCH.encode()
