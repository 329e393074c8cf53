"""Train the original and the transformed graph from the same checkpoint on the same feeds and
compare: every variable, each step's loss at every step, the fetches, and whether every replica
of a variable still holds the same value. Both graphs run the same steps: the original's
(every train op the user runs, in order), by name.

Differences are scaled, not relative: ``max|expected - got| / scale``. A variable's scale is the
largest of its max|value| after training, its max|initial value| and a floor of
``FLOOR_FRACTION`` of the root mean square of all the model's trainable variables. A tensor
that is ~0 (a bias whose gradient is mathematically zero) is so judged against the size of the
model, not against its own ~0: float noise of 1e-9 passes, a real 1e-3 error still fails, and a
variable of normal size is compared relative to itself as before. A loss or fetch is scaled by
its largest magnitude over the steps."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile

import numpy as np

from graphxform import fetch_races, functions, input_pipeline, moving_statistics, training
from graphxform.plan import ClusterPlan
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR, parse_tensor
from graphxform.nodes import const_value, replica_prefix
from graphxform.runtime import servers
from graphxform.runtime.local import Feeds, Runner, cpus_by_job, needed_inputs

FLOOR_FRACTION = 1e-2  # of the RMS of the trainable variables: the smallest scale a variable gets
TINY = 1e-12  # the scale of last resort (a model whose variables are all zero)
FUSED_BATCH_NORM = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}
RANDOM_PREFIXES = ("Random", "StatelessRandom", "StatelessTruncated", "StatelessMultinomial",
                   "StatefulRandom", "StatefulStandardNormal", "StatefulTruncatedNormal",
                   "StatefulUniform", "RngReadAndSkip")


@dataclasses.dataclass
class Difference:
    name: str
    scaled: float  # largest |expected - got| / scale
    replica_spread: float = 0.0  # largest scaled gap between replica copies
    scale: float = 0.0


@dataclasses.dataclass
class Report:
    steps: int
    rtol: float
    variables: list  # Difference per variable
    fetches: list  # Difference per step's loss and per fetched tensor (over all steps)
    step_losses: dict  # step name -> [(original, transformed) per step]; None: no loss found
    reasons: list  # why the graphs cannot match, when they cannot
    floor: float = 0.0  # the smallest scale a variable was compared at
    notes: list = dataclasses.field(default_factory=list)  # how both graphs were run

    @property
    def losses(self) -> list:
        """The first step's (original, transformed) losses, per step."""
        return next(iter(self.step_losses.values()), [])

    @property
    def worst(self) -> float:
        return max([d.scaled for d in self.variables + self.fetches] +
                   [d.replica_spread for d in self.variables] + [0.0])

    @property
    def ok(self) -> bool:
        return self.worst <= self.rtol


def magnitude(value) -> float:
    array = np.asarray(value, dtype=np.float64)
    return float(np.max(np.abs(array))) if array.size else 0.0


def scaled_difference(expected, got, scale: float) -> float:
    """max|expected - got| / scale; NaN where the other is not NaN counts as infinite."""
    a = np.asarray(expected, dtype=np.float64)
    b = np.asarray(got, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    gap = np.abs(a - b)
    both_nan = np.isnan(a) & np.isnan(b)
    gap = np.where(both_nan, 0.0, np.where(np.isnan(gap), np.inf, gap))
    return float(np.max(gap)) / max(scale, TINY)


def scale_floor(values: dict, names) -> float:
    """FLOOR_FRACTION of the root mean square of the named variables' values, pooled."""
    squares, count = 0.0, 0
    for name in names:
        array = np.asarray(values.get(name, ()), dtype=np.float64)
        if array.size and np.isfinite(array).all():
            squares += float(np.sum(array * array))
            count += array.size
    return FLOOR_FRACTION * math.sqrt(squares / count) if count else 0.0


def compare_variables(expected: dict, got: dict, initial: dict, floor: float) -> list:
    """A Difference per variable of ``expected``; ``got`` holds the transformed graph's values
    (one shared copy under the original name, or one per replica)."""
    found = []
    for name in sorted(expected):
        copies = [got[name]] if name in got else [
            got[replica_prefix(i) + name] for i in range(len(got))
            if replica_prefix(i) + name in got]
        scale = max(magnitude(expected[name]), magnitude(initial.get(name, ())), floor)
        if not copies:
            found.append(Difference(name, float("inf"), scale=scale))
            continue
        spread = max(scaled_difference(copies[0], c, scale) for c in copies)
        found.append(Difference(name, scaled_difference(expected[name], copies[0], scale),
                                spread, scale))
    return found


def compare_series(name: str, expected: list, got: list) -> Difference:
    """One tensor over the steps, scaled by its largest magnitude over them."""
    pairs = [(e, g) for e, g in zip(expected, got) if e is not None or g is not None]
    if any(e is None or g is None for e, g in pairs):
        return Difference(name, float("inf"))
    scale = max([magnitude(e) for e, _ in pairs] + [0.0])
    return Difference(name, max([scaled_difference(e, g, scale) for e, g in pairs] + [0.0]),
                      scale=scale)


# batch norm's moving statistics as tf.compat.v1.layers, tf_keras and tf_slim name them
MOVING_STATISTIC = moving_statistics.NAMED


def mismatch_reasons(ir: GraphIR, tg: training.TrainingGraph, synced_batch_norm=False,
                     consistent_random=False, running_totals=frozenset(),
                     state_kept_equal=False) -> list[str]:
    """Why a synchronous replicated graph cannot match the single-device one step for step,
    each naming what it found and the option that would make it match (none for what the
    transformed graph already synchronised). ``running_totals``: the metrics' variables whose
    copies the transformed graph serves added up or averaged (see merged_running_totals).
    ``state_kept_equal``: the contract proved the transformed graph keeps the state the step
    moves from the batch equal on every replica (passes/global-state), as in every
    synchronous strategy."""
    reasons = []
    from_inputs = fed_from_inputs(ir, tg)
    batch_norm = _batch_norm_evidence(ir, tg, from_inputs)
    others = [name for name in batch_norm if name in tg.variables
              and not tg.variables[name].moving_statistic]
    batch_norm = [name for name in batch_norm if name not in others]
    others = [] if state_kept_equal else others
    if others:
        reasons.append("non-trainable variables updated from the batch in the step "
                       f"({_some(others)}) are kept per replica, each updated from its own "
                       "slice: they move apart from one device's, and from each other; "
                       "fetching them gives replica 0's")
    unreachable = functions.batch_norm_in_function(ir, tg.train_closure)
    if unreachable:
        reasons.append("batch norm in training mode inside the functions the step calls (a "
                       "tf.cond with control flow v2 on a training flag that is a tensor: "
                       f"{_some([f'{call} ({op})' for call, op in unreachable])}): each "
                       "replica normalises its slice with that slice's own mean and variance, "
                       "and --sync-batch-norm cannot reach into function bodies")
    elif batch_norm and not synced_batch_norm:
        reasons.append("batch norm in training mode: each replica normalises its slice with that "
                       "slice's own mean and variance and updates the moving averages from it "
                       f"({_some(batch_norm)}); --sync-batch-norm (--strategy allreduce) uses the "
                       "global batch's")
    metrics = sorted(v.name for v in tg.variables.values()
                     if v.local and any(u in from_inputs for u in v.updates)
                     and v.name not in running_totals)
    if metrics:
        reasons.append("local variables updated from the batch in the step (tf.compat.v1.metrics' "
                       f"totals and counts: {_some(metrics)}) are kept per replica, each from "
                       "its own slices, and are not running sums or means of it: fetching them, "
                       "or a metric's value or update_op, gives replica 0's figure, not the "
                       "global batch's")
    seeded, out_of_reach, unseeded = _random_ops(ir, tg, from_inputs)
    if seeded and not consistent_random:
        reasons.append("random ops run in the step (dropout, sampling) and each replica draws "
                       f"its own numbers for its slice ({_some(seeded)}); --consistent-random "
                       "(--strategy allreduce) gives each replica its slice of the single-device "
                       "draw")
    if out_of_reach:
        reasons.append("random ops run in the step where each replica draws its own numbers for "
                       "its slice and --consistent-random cannot reach them: inside a legacy "
                       "while loop over the batch, afresh at every iteration, or from values of "
                       f"each example (as tf.random.categorical) ({_some(out_of_reach)})")
    if unseeded:
        reasons.append("random ops without a seed (seed=seed2=0) run in the step and draw "
                       f"different numbers in every session, so they cannot match even on one "
                       f"device ({_some(unseeded)}); set a graph seed "
                       "(tf.compat.v1.set_random_seed) and use --consistent-random")
    inside = functions.random_in_function(ir, tg.train_closure)
    if inside:
        reasons.append("random ops inside the functions the step calls (a tf.cond or while "
                       f"loop body with control flow v2: "
                       f"{_some([f'{call} ({op})' for call, op in inside])}) draw for each "
                       "replica's slice, and --consistent-random cannot reach into function "
                       "bodies")
    for dtype, (low, rounding) in _low_precision_sums(ir, tg).items():
        reasons.append(f"the step computes in {dtype} ({_some(low)}), whose sums round at "
                       f"about {rounding}: each replica sums its own slice before the replicas' "
                       "sums are added, so the result rounds differently from one device's by "
                       "about that much; compare with --rtol 1e-2")
    shuffles = _unseeded_shuffles(ir, tg)
    if shuffles:
        reasons.append("the input pipeline shuffles without a seed "
                       f"({_some(shuffles)}): every session reads the examples in another "
                       "order, even on one device; set a graph seed "
                       "(tf.compat.v1.set_random_seed) or the shuffle's own")
    racing = _racing_queues(ir, tg)
    if racing:
        reasons.append("the input pipeline's queue runners race to fill its queues "
                       f"({_some(racing)}): which examples a step reads depends on their "
                       "threads' timing, even with a seed, so no two sessions read the same "
                       "batches, even on one device (tf.compat.v1.train.batch with "
                       "num_threads=1, or tf.data with a seeded shuffle, reads the same)")
    return reasons


def _racing_queues(ir: GraphIR, tg) -> list[str]:
    """The pipeline's queues whose contents depend on thread timing: a RandomShuffleQueue
    (``shuffle_batch``) samples whatever its runners have enqueued so far, and a queue that
    several threads fill (``num_threads`` > 1) gets their examples interleaved as they come."""
    if not tg.pipeline:
        return []
    found = []
    for queue, enqueues in sorted(input_pipeline.queue_runners(ir).items()):
        if queue not in tg.pipeline.nodes or queue not in ir:
            continue
        if ir.op(queue).startswith("RandomShuffleQueue"):
            found.append(f"{queue}: a RandomShuffleQueue")
        elif len(enqueues) > 1:
            found.append(f"{queue}: filled by {len(enqueues)} threads")
    return found


def _low_precision_sums(ir: GraphIR, tg) -> dict:
    """The step's ops that reduce over an axis (matmuls, convolutions, sums) in bfloat16 or
    float16, by dtype name, with the dtype's rounding: the partial sums a replica forms over
    its own slice round at that precision. {dtype: (names, rounding)}."""
    from graphxform.opdefs import output_dtype
    found = {}
    for name in sorted(tg.train_closure):
        if name in ir and ir.op(name) in _SUMMING_OPS:
            low = _LOW_PRECISION.get(output_dtype(ir, name, 0))
            if low is not None:
                found.setdefault(low[0], ([], low[1]))[0].append(name)
    return found


_SUMMING_OPS = {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Sum",
                "Mean", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput",
                "Conv3D", "DepthwiseConv2dNative", "BiasAddGrad", "UnsortedSegmentSum"}
_LOW_PRECISION = {14: ("bfloat16", "4e-3"), 19: ("float16", "5e-4")}  # DataType enum


def _unseeded_shuffles(ir: GraphIR, tg) -> list[str]:
    """The input pipeline's shuffles with seed = seed2 = 0 (tf.data passes them as inputs,
    queues as attrs): TF draws a fresh seed for each."""
    found = []
    for name in sorted(tg.pipeline.nodes if tg.pipeline else ()):
        op = ir.op(name)
        if "Shuffle" not in op:
            continue
        attrs = ir.attrs(name)
        if "seed" in attrs and "seed2" in attrs:
            seeds = [attrs["seed"].i, attrs["seed2"].i]
        else:
            seeds = [const_value(ir, src) for src, _ in ir.inputs(name)[2:4]]
        if len(seeds) == 2 and all(seed is not None and not seed for seed in seeds):
            found.append(name)
    return found


def _some(names: list, limit: int = 3) -> str:
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _batch_norm_evidence(ir: GraphIR, tg, from_inputs: set) -> list[str]:
    """What computes statistics over the batch in the step: variables updated there from the
    inputs (batch norm's moving averages, but not an average of the weights), fused batch norm
    in training mode, and ``tf.nn.moments`` over axis 0."""
    found = sorted(v.name for v in tg.variables.values() if not v.local and (
        v.role == "statistic" and any(u in from_inputs for u in v.updates)
        or v.moving_statistic == moving_statistics.BY_STRUCTURE))  # also moved in a v2 cond
    for name in sorted(tg.train_closure):
        op = ir.op(name)
        if op in FUSED_BATCH_NORM and _is_training(ir, name) and not _per_example(ir, name):
            found.append(name)
        elif op == "SquaredDifference" and _moments_over_batch(ir, name):
            found.append(name.rsplit("/", 1)[0])
    return found


def fed_from_inputs(ir: GraphIR, tg) -> set:
    """Every node of the forward pass that reads an input placeholder's data (or a batch of the
    input pipeline's), directly or not
    (not through gradients: loss-scale state updated from a finite check of the gradients is
    no batch statistic)."""
    seen = {i.name for i in tg.inputs if i.name in ir}
    seen.update(r.node for r in (tg.pipeline.reads if tg.pipeline else ()) if r.node in ir)
    stack = list(seen)
    while stack:
        for dst, _ in ir.consumers(stack.pop()):
            if dst not in seen and not training.gradient_scope(dst):
                seen.add(dst)
                stack.append(dst)
    return seen


def _is_training(ir: GraphIR, name: str) -> bool:
    attrs = ir.attrs(name)
    return attrs["is_training"].b if "is_training" in attrs else True


def _per_example(ir: GraphIR, name: str) -> bool:
    """Fused batch norm over an input reshaped to a leading 1 (how tf_keras's LayerNormalization
    runs): its statistics never mix examples."""
    src, _ = ir.input(name, 0)
    if ir.op(src) != "Reshape":
        return False
    shape, _ = ir.input(src, 1)
    if ir.op(shape) == "Pack":
        shape, _ = ir.input(shape, 0)
    value = const_value(ir, shape)
    return value is not None and value.size > 0 and value.reshape(-1)[0] == 1


def _moments_over_batch(ir: GraphIR, name: str) -> bool:
    """``tf.nn.moments``' variance: SquaredDifference(x, StopGradient(Mean(x, axes))) with axis
    0 among the axes (layer norm's moments, over the last axis, mix no examples)."""
    x, _ = ir.input(name, 0)
    stop, _ = ir.input(name, 1)
    if ir.op(stop) != "StopGradient":
        return False
    mean, _ = ir.input(stop, 0)
    if ir.op(mean) != "Mean" or ir.input(mean, 0)[0] != x:
        return False
    axes = const_value(ir, ir.input(mean, 1)[0])
    return axes is None or 0 in axes.reshape(-1).tolist()


def _random_ops(ir: GraphIR, tg, from_inputs: set) -> tuple[list, list, list]:
    """Random ops in the step that make replicas differ from one device: (seeded, out of
    reach, unseeded). An op with seed and seed2 attrs both 0 is seeded afresh by every
    session, so it differs even between two runs of one graph. A seeded op differs only when
    what it draws depends on the batch (dropout's mask, shaped like the slice): each replica
    then draws the first numbers of the sequence for its slice. Out of reach of
    --consistent-random (and not among the seeded): a draw inside a legacy while loop over the
    batch (map_fn, dynamic_rnn), afresh at every iteration, and one from values of each
    example (tf.random.categorical's logits); a tf.random.Generator's RngReadAndSkip by its
    draw's count goes with its draw (passes/consistent_random.py). A candidate sampler
    (nce_loss) draws ``num_sampled`` ids whatever the batch, the same in every replica as on
    one device."""
    from graphxform.passes.consistent_random import SHAPED_RANDOM_OPS, counted_skip
    fixed = {i.fixed_batch for i in tg.inputs if i.fixed_batch}
    seeded, out_of_reach, unseeded = [], [], []
    # a tf.random.Generator's skip by its draw's count: the whole-batch draw skips the whole's
    counted = [counted_skip(ir, n) for n in tg.train_closure if ir.op(n) in SHAPED_RANDOM_OPS]
    skips = {found[0] for found in counted if found}
    ahead = _ahead_of_defaults(ir, tg)
    looped = set().union(*[members for members in functions.legacy_loop_frames(ir)
                           if not members.isdisjoint(from_inputs)])
    for name in sorted(tg.train_closure):
        op = ir.op(name)
        attrs = ir.attrs(name)
        has_seed = ("seed" in attrs and "seed2" in attrs
                    and op not in training.SEEDED_DETERMINISTIC_OPS)
        if not (has_seed or op in training.RANDOM_OPS or op.startswith(RANDOM_PREFIXES)):
            continue
        if has_seed and attrs["seed"].i == 0 and attrs["seed2"].i == 0:
            unseeded.append(name)
        elif op.endswith("CandidateSampler") or (ahead is not None and name not in ahead):
            continue
        elif name in looped:
            out_of_reach.append(name)
        elif _drawn_per_example(ir, name, from_inputs, fixed):
            (seeded if op in SHAPED_RANDOM_OPS or name in skips else out_of_reach).append(name)
    return seeded, out_of_reach, unseeded


def _ahead_of_defaults(ir: GraphIR, tg) -> set | None:
    """The step's nodes it reaches other than through a PlaceholderWithDefault's default
    (None: the graph has none). A default is computed once for the whole batch in the
    transformed graph too (replicate's ``global_default``), so what it draws matches."""
    if not ir.nodes_of(("PlaceholderWithDefault",)):
        return None
    seen, stack = set(), [parse_tensor(step.name)[0] for step in tg.steps]
    while stack:
        name = stack.pop()
        if name in seen or name not in ir:
            continue
        seen.add(name)
        if ir.op(name) != "PlaceholderWithDefault":
            stack.extend(ir.predecessors(name))
    return seen


def _drawn_per_example(ir: GraphIR, name: str, from_inputs: set, fixed: set) -> bool:
    """Whether what a random op draws depends on the batch: an input computed from the
    placeholders, or a constant shape whose leading entry is the graph's fixed batch (also
    through ``[c[0]]``, tf.shape of a fixed batch folded into a Const c)."""
    from graphxform.passes.consistent_random import leading_const
    for src, _ in ir.inputs(name):
        if src in from_inputs:
            return True
        const = leading_const(ir, src)
        value = const_value(ir, const) if const else None
        if value is not None and value.ndim == 1 and value.size and int(value[0]) in fixed:
            return True
    return False


def compare(original: GraphIR, transformed: GraphIR, feeds_path: str | None = None,
            steps: int = 5, batch_size: int | None = None, fetches=(), rtol: float = 1e-5,
            train_op: str | None = None, unmerged=frozenset()) -> Report:
    """``unmerged``: the original names the transformed graph serves from replica 0's copy
    (merge-fetches' summary): a fetch of one is named among the reasons, and a tower's loss
    among them is not compared."""
    tg = training.analyze(original, train_op=train_op)
    tg.require_train_op("verify")
    fetches = [_tensor_of(original, name) for name in fetches]
    _require_numbers(original, fetches)
    feeds = Feeds(needed_inputs(original, tg.inputs, fetches), feeds_path, batch_size)
    # a fetch that runs a write no step runs, in no order with the step: both graphs read it
    # after the steps (the transformed graph's replicas would each pick their own order)
    alone = fetch_races.fetched_beside(original, tg, fetches, tg.steps[-1])
    notes = [f"--fetch {name} runs {why.describe()}: both graphs fetch it in a session.run "
             "of its own after the steps" for name, why in alone.items()]
    with tempfile.TemporaryDirectory(prefix="graphxform-verify-") as tmp:
        with Runner(original, fetches=fetches, steps=tg.steps, apart=alone) as run:
            run.initialize(feeds)
            initial = run.variable_values()
            start = run.save(os.path.join(tmp, "start"))
            before = [run.step(feeds.batch(k)) for k in range(steps)]
            expected = run.variable_values()
        with _transformed_runner(transformed, fetches, tg.steps, alone) as run:
            run.restore(start, feeds)
            after = [run.step(feeds.batch(k)) for k in range(steps)]
            got = run.variable_values()
        _join_shards(got, expected)
        floor = scale_floor(expected, [v.name for v in tg.trainable])
        variables = compare_variables(expected, got, initial, floor)
        noise = None
        if max(d.scaled for d in variables) > rtol and _reorderable(original, tg):
            noise = _reordered_noise(original, tg, feeds, start, steps,
                                     (expected, initial, floor))
    unmerged = set(unmerged)
    first_only = {s.name for s in tg.steps
                  if any(parse_tensor(t)[0] in unmerged for t in s.towers)}
    step_losses = {s.name: [(b.losses[s.name], None if s.name in first_only else a.losses[s.name])
                            for b, a in zip(before, after)] for s in tg.steps}
    series = [compare_series(s.loss, [b for b, _ in step_losses[s.name]],
                             [a for _, a in step_losses[s.name]]) for s in tg.steps if s.loss]
    towers = [t for s in tg.steps for t in s.towers if parse_tensor(t)[0] not in unmerged]
    series += [compare_series(t, [b.towers[t] for b in before], [a.towers[t] for a in after])
               for t in dict.fromkeys(towers)]
    series += [compare_series(name, [b.fetches[name] for b in before],
                              [a.fetches[name] for a in after]) for name in fetches]
    plan = ClusterPlan.from_ir(transformed)
    asynchronous = plan is not None and plan.is_async
    apart = (transformed.has_scope("model_average/") or _exchanges_nothing(transformed, plan)
             or asynchronous)
    reasons = mismatch_reasons(original, tg,
                               synced_batch_norm=transformed.has_scope("sync_batch_norm/"),
                               consistent_random=transformed.has_scope("consistent_random/"),
                               running_totals=merged_running_totals(transformed),
                               state_kept_equal=not apart)
    if transformed.has_scope("model_average/"):
        reasons.append("model-average: the workers' copies train apart between averaging "
                       "rounds (and optimizer slots are never averaged); only --interval 1 with "
                       "plain SGD on a mean of per-example terms is synchronous data "
                       "parallelism (each replica divides by its own slice's totals and takes "
                       "its own slice's longest sequence)")
    elif _exchanges_nothing(transformed, plan):
        reasons.append("the replicas never exchange gradients (--strategy independent): each "
                       "trains on its own slice of the batch, a ceiling for scaling, not a "
                       "drop-in replacement")
    if asynchronous:
        reasons.append("--async: the workers apply their gradients to the shared variables in "
                       "no fixed order, without waiting for each other, each gradient computed "
                       "from the variables as that worker read them (perhaps before another's "
                       "update), not one step's average over the whole batch")
    races = [race.describe() for race in fetch_races.races(
        original, tg, [f for f in fetches if f not in alone])]
    reasons += races
    if races and not apart:
        reasons.append("the transformed graph runs the step's own reads and writes among these "
                       "in one order, the same on every replica (passes/order_races.py: the "
                       "reads its loss and update compute from, then the optimizer's update, "
                       "then its other writes), which a run of the original may or may not take")
    failing = [d.name for d in series if d.scaled > rtol and d.name in fetches]
    served = [name for name in fetches if parse_tensor(name)[0] in unmerged]
    served += [name for name in served_from_replica_0(transformed, failing)
               if name not in served]
    if served:
        reasons.append(f"the fetches {_some(served)} are served from replica 0's copy: "
                       "merge-fetches could not show how the replicas' copies make the whole "
                       "batch's value (apply lists them among the names it could not merge; "
                       "a tf_keras metric whose total a placeholder can set, as fit()'s "
                       "reset_metrics does, is one), so they give replica 0's figure")
    losses = [t for s in tg.steps if s.name in first_only for t in s.towers
              if parse_tensor(t)[0] in unmerged]
    if losses:
        reasons.append(f"the transformed graph gives replica 0's value for the towers' losses "
                       f"{_some(list(dict.fromkeys(losses)))}, not the whole batch's: "
                       "merge-fetches could not merge them across replicas, so they are not "
                       "compared")
    # a race moves the reordered run too: the noise is then no sign of rounding
    if noise is not None and noise > rtol and not races:
        reasons.append(f"the original itself moves by up to {noise:.2e} (scaled) when each "
                       "batch's examples come in reverse order, which for per-example work "
                       "changes only the order of float sums: this graph amplifies rounding "
                       "that much (tiny batches through batch norm, say), so differences of "
                       "that size are not the transformation's; try a larger --batch-size or "
                       "fewer --steps")
    return Report(steps, rtol, variables, series, step_losses, reasons, floor, notes)


_NOT_NUMBERS = {7: "string", 20: "resource", 21: "variant"}  # DataType enum values


def _tensor_of(ir: GraphIR, name: str) -> str:
    """``name`` as a tensor: an op's name is its output 0 (fetched as an op, it gives None on
    both sides, which would compare equal whatever the graphs compute); refuses an op
    without outputs."""
    from graphxform import opdefs
    if ":" in name or name not in ir:
        return name
    if not opdefs.num_outputs(ir, name):
        raise GraphxformError(f"cannot compare fetch '{name}': {ir.op(name)} has no outputs "
                              "(verify compares values; `graphxform run --fetch` runs ops)")
    return name + ":0"


def _require_numbers(ir: GraphIR, fetches: list) -> None:
    """Refuse a fetch verify cannot compare: a string (a merged summary), a variable's handle."""
    from graphxform import opdefs
    for name in fetches:
        node, port = parse_tensor(name)
        kind = _NOT_NUMBERS.get(opdefs.output_dtype(ir, node, port)) if node in ir else None
        if kind:
            raise GraphxformError(
                f"cannot compare fetch '{name}': it is {kind}, not numbers (a summary, a "
                "variable's handle); fetch the values it holds instead (a variable's "
                "ReadVariableOp or read, the tensors a summary records)")


def served_from_replica_0(transformed: GraphIR, fetches) -> list[str]:
    """Of ``fetches``, those whose name in ``transformed`` is merge-fetches' Identity (or
    IdentityN output) of replica 0's copy where that copy is not shown equal on every
    replica: the names merge-fetches could not merge (graphxform/replica_values.py)."""
    from graphxform import replica_values
    prefix = replica_prefix(0)
    found, values = [], None
    for fetch in fetches:
        node, port = parse_tensor(fetch)
        copy = prefix + node
        if copy not in transformed or node not in transformed:
            continue
        op = transformed.op(node)
        inputs = transformed.inputs(node)
        served = (op == "Identity" and inputs[:1] == [(copy, port)]
                  or op == "IdentityN" and port < len(inputs) and inputs[port] == (copy, port))
        if not served:
            continue
        if values is None:
            values = replica_values.classify(transformed, prefix)
        if values.of(copy, port) != replica_values.IDENTICAL:
            found.append(fetch)
    return found


def merged_running_totals(transformed: GraphIR) -> set:
    """The variables whose replica copies hold running sums or means of the batch (a metric's
    total and count; graphxform/replica_values.py), which merge-fetches serves added up or
    averaged: what reads them gives the single-device figure."""
    from graphxform import replica_values
    prefix = replica_prefix(0)
    if not transformed.has_scope(prefix):
        return set()
    values = replica_values.classify(transformed, prefix)
    return {name[len(prefix):] for name in transformed.nodes_of(training.VARIABLE_OPS)
            if name.startswith(prefix)
            and values.of(name) in (replica_values.SUM, replica_values.MEAN)}


def _reorderable(original: GraphIR, tg) -> bool:
    """Whether reversing each fed batch changes nothing but float rounding: no random ops in
    the step (a mask drawn per position would fall on other examples) and no input pipeline
    (its batches are not fed)."""
    seeded, out_of_reach, unseeded = _random_ops(original, tg, fed_from_inputs(original, tg))
    return not (seeded or out_of_reach or unseeded or tg.pipeline
                or functions.random_in_function(original, tg.train_closure))


def _reordered_noise(original: GraphIR, tg, feeds, start: str, steps: int, compared) -> float:
    """The largest scaled difference between the original's variables after ``steps`` steps
    from ``start`` and those of the same run with every batched input's rows reversed:
    the rounding this graph amplifies, below which no comparison can tell anything."""
    expected, initial, floor = compared
    with Runner(original, steps=tg.steps) as run:
        run.restore(start, feeds)
        for k in range(steps):
            run.step(_reversed_rows(feeds.batch(k), feeds.inputs))
        again = run.variable_values()
    return max([d.scaled for d in compare_variables(expected, again, initial, floor)] + [0.0])


def _reversed_rows(feed: dict, inputs) -> dict:
    """``feed`` with the examples of every batched input, dense or sparse, in reverse order."""
    from graphxform.runtime import sparse_batches
    out = dict(feed)
    for inp in inputs:
        name = f"{inp.name}:0"
        if inp.batched and name in feed:
            out[name] = feed[name][::-1]
    for parts in training.sparse_groups(inputs).values():
        names = [f"{p.name}:0" for p in parts]
        if all(n in feed for n in names):
            pool = tuple(feed[n] for n in names)
            rows = sparse_batches.rows(pool)
            out.update(zip(names, sparse_batches.take(pool, np.arange(rows)[::-1])))
    return out


def _exchanges_nothing(transformed: GraphIR, plan=None) -> bool:
    """Replicated, yet no op combines the replicas' gradients (--strategy independent). Not
    async ps, which has none either: its workers exchange gradients through the shared
    variables, each applying its own."""
    from graphxform.replica_spread import CROSS_REPLICA_OPS
    if plan is not None and plan.is_async:
        return False
    return (transformed.has_scope("split_inputs/") and not transformed.nodes_of(CROSS_REPLICA_OPS)
            and not transformed.has_scope("replicated/"))


def _join_shards(got: dict, expected: dict) -> None:
    """A variable partition-variables split into `<name>/part_<k>` is compared whole."""
    for name in expected:
        if name not in got and f"{name}/part_0" in got:
            parts = []
            while f"{name}/part_{len(parts)}" in got:
                parts.append(got.pop(f"{name}/part_{len(parts)}"))
            if parts:
                got[name] = np.concatenate(parts, axis=0)


@contextlib.contextmanager
def _transformed_runner(transformed: GraphIR, fetches, steps, apart=None):
    """A Runner for the transformed graph running the original's ``steps``; a cluster graph
    gets its cluster's servers in this process on 127.0.0.1 ports (fresh ones where the step
    runs collectives) and a session on its chief."""
    plan = ClusterPlan.from_ir(transformed)
    if plan is None:
        with Runner(transformed, fetches=fetches, steps=steps, apart=apart) as run:
            yield run
        return
    job, task = plan.chief.split(":")
    leader = plan.collective_leader
    from graphxform.inspector.collectives import COLLECTIVE_OPS
    if leader or transformed.op_types() & COLLECTIVE_OPS:
        started = servers.InProcessCluster(servers.local_cluster(plan.job_sizes()),
                                           cpus=cpus_by_job(transformed),
                                           collective_leader=leader)
    else:  # a ps graph: servers an earlier verify in this process left idle will do
        started = servers.reused_cluster(plan.job_sizes(), cpus_by_job(transformed))
    with started as running:
        config = servers.session_config(plan.filters_of(job, int(task)),
                                        collective_leader=leader)
        with Runner(transformed, fetches=fetches, target=running.target(job, int(task)),
                    config=config, steps=steps, apart=apart) as run:
            yield run


def format_report(report: Report) -> str:
    lines = [f"scaled difference = max|original - transformed| / scale; a variable's scale is "
             f"the largest of its max|value|, its max|initial value| and "
             f"{FLOOR_FRACTION:g} x the RMS of the trainable variables ({report.floor:.2e}); "
             "a loss's or fetch's, its largest |value| over the steps",
             f"{'variable':40} {'scaled diff':>13} {'replica spread':>15}"]
    for d in sorted(report.variables, key=lambda d: -d.scaled):
        lines.append(f"{d.name:40} {d.scaled:13.2e} {d.replica_spread:15.2e}")
    for d in report.fetches:
        lines.append(f"{'fetch ' + d.name:40} {d.scaled:13.2e}")
    lines += _loss_table(report.step_losses)
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(f"{verdict}: largest scaled difference {report.worst:.2e} after "
                 f"{report.steps} steps (tolerance {report.rtol:.0e})")
    # a reason stands however the run went; after a PASS it is why other data or settings
    # may not match (model-average with plain SGD at --interval 1 does, say)
    head = "cannot match exactly" if not report.ok else "may not match in general"
    for reason in report.reasons:
        lines.append(f"{head}: {reason}")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)


def _loss_table(step_losses: dict) -> list[str]:
    """Each step's loss at every step; one line when no step's loss was found."""
    with_loss = {name: pairs for name, pairs in step_losses.items()
                 if any(a is not None for a, _ in pairs)}
    if not with_loss:
        names = ", ".join(step_losses) or "the train op"
        return [f"loss: none found for {names} (compare a tensor with --fetch NAME)"]
    several = len(step_losses) > 1
    width = max(len(n) for n in step_losses) if several else 0
    lines = ["step  " + (f"{'train op':{width}}  " if several else "") +
             "loss (original)  loss (transformed)"]
    for k in range(len(next(iter(with_loss.values())))):
        for name, pairs in step_losses.items():
            a, b = pairs[k]
            label = f"{name:{width}}  " if several else ""
            lines.append(f"{k + 1:4}  {label}{_number(a):>15}  {_number(b):>18}")
    return lines


def _number(value) -> str:
    return "-" if value is None else f"{value:.7f}"
