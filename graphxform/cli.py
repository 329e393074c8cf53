"""The `graphxform` command. Errors are one line on stderr and a non-zero exit; --debug shows
the traceback."""

from __future__ import annotations

import atexit
import errno
import json
import os
import signal
import sys
import threading
import traceback

import click

from graphxform import cleanup, tf_import
from graphxform.runtime.servers import DEFAULT_TIMEOUT_S, LOCAL_TIMEOUT_S
from graphxform.errors import GraphxformError, clip

EXIT_ERROR = 1
EXIT_USAGE = 2
MESSAGE_LIMIT = 1000  # a last guard: our messages clip what they quote, this clips the rest
debug_option = click.option("--debug", is_flag=True, help="Show the Python traceback on errors.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphxform")
def cli():
    """Turn a single-device TensorFlow training graph (model.meta) into a distributed one, run
    it, check it trains the same, and draw what changed."""


def _analysis(path, train_op=None):
    from graphxform import metagraph, training
    ir = metagraph.load(path)
    return ir, training.analyze(ir, train_op=train_op)


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@click.option("--train-op", help="Name of the train op when the graph has no 'train_op' collection.")
@debug_option
def inspect(model, as_json, train_op, debug):
    """Show what a training graph holds: variables, updates, gradients, slots, inputs."""
    from graphxform.inspector import report
    ir, tg = _analysis(model, train_op)
    doc = report.inspect_document(ir, tg)
    from graphxform.fetch_races import beside_steps, beside_warnings
    for line in beside_warnings(beside_steps(ir, tg)):
        click.echo(f"graphxform: warning: {line}", err=True)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(report.inspect_text(doc))


@cli.command()
@click.argument("model", type=click.Path())
@click.option("-o", "--output", help="OUT.dot, OUT.svg, OUT.png, OUT.pdf or OUT.html.")
@click.option("--format", "fmt", type=click.Choice(["dot", "svg", "png", "pdf", "html"]),
              help="Output format (default: -o's extension; without -o, MODEL.<format>).")
@click.option("--depth", type=click.IntRange(min=1),
              help="Open this many name-scope levels (default: as many as --boxes allows).")
@click.option("--boxes", default=150, show_default=True, type=click.IntRange(min=1),
              help="Largest number of boxes the default picture opens scopes up to.")
@click.option("--scope", default="", help="Draw only this name scope, opened as far as fits.")
@click.option("--color-by", "--color", "color_by", default="device", show_default=True,
              type=click.Choice(["device", "replica", "pass"]),
              help="Colour boxes by device, by which replicas hold them, or by the pass that "
              "made them.")
@click.option("--no-fold", is_flag=True, help="Draw each replica's copies apart.")
@click.option("--tensorboard", "tensorboard_dir", type=click.Path(file_okay=False),
              help="Write TensorBoard event files into this directory (MODEL may be an "
              "`apply --dump-dir`: one run per stage).")
@debug_option
def viz(model, output, fmt, depth, boxes, scope, color_by, no_fold, tensorboard_dir, debug):
    """Draw a graph: replicas folded into one box, name scopes collapsed to at most --boxes
    boxes, parallel edges bundled; or write it for TensorBoard."""
    from graphxform import metagraph
    from graphxform.inspector import viz as viz_mod
    if tensorboard_dir:
        from graphxform.inspector import tensorboard
        for run in tensorboard.write_model(model, tensorboard_dir):
            click.echo(f"wrote {run}")
        if not output and not fmt:
            return
    if not output and not fmt:
        raise click.UsageError("give -o OUT (or --format, or --tensorboard DIR)")
    if os.path.isdir(model):  # a --dump-dir is a model only for --tensorboard
        raise click.BadParameter(f"File '{model}' is a directory.", param_hint="'MODEL'")
    output = output or f"{os.path.splitext(model)[0]}.{fmt}"
    ir = metagraph.load(model)
    viz_mod.output_format(output, fmt)
    metagraph.check_output_path(output, model)
    note = viz_mod.write(ir, output, fmt, depth=depth, scope=scope, color_by=color_by,
                         boxes=boxes, fold=not no_fold)
    click.echo(note or f"wrote {output}", err=bool(note))


@cli.command()
@click.argument("a", type=click.Path(dir_okay=False))
@click.argument("b", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@click.option("--format", "fmt", type=click.Choice(["dot", "svg", "png", "pdf", "html"]),
              help="Draw B's collapsed picture with the changes coloured (A's removed nodes "
              "where they were).")
@click.option("-o", "--output", help="Where the picture goes (default: B with .diff.<format>).")
@click.option("--depth", type=click.IntRange(min=1), help="As for viz.")
@click.option("--boxes", default=150, show_default=True, type=click.IntRange(min=1),
              help="As for viz.")
@click.option("--scope", default="", help="As for viz.")
@debug_option
def diff(a, b, as_json, fmt, output, depth, boxes, scope, debug):
    """What B added, removed, replaced and rewired relative to A, by scope and by the pass
    that made it (from B's provenance; names alone otherwise)."""
    from graphxform import metagraph
    from graphxform.inspector import diff as diff_mod
    from graphxform.inspector import viz as viz_mod
    first, second = metagraph.load(a), metagraph.load(b)
    if output and not fmt:
        fmt = viz_mod.output_format(output)
    if fmt:
        output = output or f"{os.path.splitext(b)[0]}.diff.{fmt}"
        viz_mod.output_format(output, fmt)
        metagraph.check_output_path(output, b)
    found = diff_mod.compare(first, second)
    click.echo(json.dumps(found.to_dict(), indent=2) if as_json else found.text())
    if fmt:
        note = diff_mod.write_picture(found, first, second, output, fmt, boxes, depth, scope)
        click.echo(note or f"wrote {output}", err=True)


@cli.command(name="check")
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@click.option("--train-op", help="Train op name when the graph has no 'train_op' collection.")
@debug_option
def check_command(model, as_json, train_op, debug):
    """Check a transformed graph before anyone runs it: collectives match on every replica
    and task, variables update once per step from cross-replica gradients, accumulators wait
    for every worker, losses are averaged; stateful ops listed. Exit 1 on errors."""
    from graphxform import metagraph
    from graphxform.inspector import check as check_mod
    report = check_mod.run(metagraph.load(model), train_op=train_op)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.text())
    if not report.ok:
        sys.exit(EXIT_ERROR)


def _devices(replicas, devices):
    from graphxform import cluster
    names = [d for d in (devices or "").split(",") if d.strip()] or None
    return cluster.local_devices(replicas, names)


def default_output(model: str, strategy: str) -> str:
    stem = model[: -len(".meta")] if model.endswith(".meta") else model
    return f"{stem}.{strategy}.meta"


def _transform(model, options, no_verify=False, dump_dir=None, keep_original=True):
    """Load MODEL (twice with ``keep_original``: the original, and the one transformed) and run
    the strategy the options name; the original is None without ``keep_original``."""
    from graphxform import cluster, metagraph, strategies, verify as verify_mod
    strategy = options["strategy"]
    kwargs = {}
    _refuse_foreign_options(strategy, options)
    if strategy in strategies.CLUSTER_STRATEGIES:
        found, _ = cluster.load_cluster(options["cluster"])
        if options["devices"] or options["replicas"]:
            raise GraphxformError(f"--strategy {strategy} places replicas on the cluster's "
                                   "workers: use --replicas-per-worker, not --replicas/--devices")
        device_list = found.worker_devices(options["replicas_per_worker"],
                                           options["worker_device"])
        kwargs = {"cluster": found, "staleness": options["staleness"],
                  "asynchronous": options["async_"]}
        if strategy == "hybrid":
            kwargs = {"cluster": found, **_hybrid_options(options)}
        if strategy in ("partitioned-ps", "hybrid"):
            kwargs["partitions"] = options["partitions"]
            if options["partition_min_bytes"] is not None:  # else the strategy's default
                kwargs["partition_min_bytes"] = options["partition_min_bytes"]
    elif strategy in ("allreduce", "model-average") and (options["cluster"] or (
            os.environ.get("TF_CONFIG") and not options["replicas"] and not options["devices"])):
        from graphxform.passes.model_average import worker_devices
        from graphxform.passes.worker_steps import replica_devices
        found, _ = cluster.load_cluster(options["cluster"])
        if options["devices"] or options["replicas"]:
            raise GraphxformError(f"--strategy {strategy} with --cluster places replicas on the "
                                  "cluster's workers: use --replicas-per-worker, not "
                                  "--replicas/--devices")
        place = replica_devices if strategy == "allreduce" else worker_devices
        device_list = place(found, options["replicas_per_worker"], options["worker_device"])
        kwargs = {**_local_strategy_options(strategy, options), "cluster": found}
        if strategy == "allreduce":
            kwargs["hierarchical"] = options["hierarchical"]
    else:
        for flag, default in CLUSTER_ONLY_OPTIONS.items():
            if options[flag] != default:
                raise GraphxformError(f"--{flag.replace('_', '-')} places replicas on a "
                                      "cluster's workers (--cluster F or TF_CONFIG); on this "
                                      "machine's devices use --replicas or --devices")
        if options["cluster"]:
            raise GraphxformError(f"--strategy {strategy} runs on local devices; --cluster is "
                                   "for ps, partitioned-ps, hybrid, allreduce and model-average")
        device_list = _devices(options["replicas"], options["devices"])
        kwargs = _local_strategy_options(strategy, options)
    if options.get("hierarchical") and not kwargs.get("hierarchical"):
        raise GraphxformError("--hierarchical is an option of --strategy allreduce with "
                              "--cluster F (or TF_CONFIG)")
    for flag in ("sync_batch_norm", "consistent_random"):
        if options.get(flag):
            kwargs[flag] = True
    from graphxform.pipeline import refuse_oversized_output
    refuse_oversized_output(model, len(device_list))  # before loading: it can be big
    ir = metagraph.load(model)
    original = metagraph.load(model) if keep_original else None
    pipeline = strategies.transform(ir, strategy, devices=device_list,
                                    train_op=options["train_op"], verify=not no_verify,
                                    dump_dir=dump_dir, **kwargs)
    verify_mod.check_imports(ir, keep_until_exit=_ends_without_teardown)
    from graphxform.fetch_races import beside_warnings
    for t in pipeline.timings:
        for line in beside_warnings(t.summary.get("unordered_beside", [])):
            click.echo(f"graphxform: warning: {line}", err=True)
    return original, ir, pipeline


# options only some strategies read, with their defaults: given to another, they would be
# silently ignored
STRATEGY_ONLY_OPTIONS = {
    "staleness": (0, ("ps", "partitioned-ps")),
    "async_": (False, ("ps", "partitioned-ps")),
    "partitions": (None, ("partitioned-ps", "hybrid")),
    "partition_min_bytes": (None, ("partitioned-ps", "hybrid")),
    "sparse_as_dense_below": (0, ("hybrid",)),
    "placement_file": (None, ("hybrid",)),
}


# options that place replicas on a cluster's workers, with their defaults
CLUSTER_ONLY_OPTIONS = {"replicas_per_worker": 1, "worker_device": "CPU"}


def _refuse_foreign_options(strategy: str, options: dict) -> None:
    for key, (default, owners) in STRATEGY_ONLY_OPTIONS.items():
        if options.get(key, default) != default and strategy not in owners:
            flag = "--" + key.rstrip("_").replace("_", "-")
            raise GraphxformError(f"{flag} is an option of --strategy {' and '.join(owners)}, "
                                  f"not of {strategy}")


def _hybrid_options(options: dict) -> dict:
    """hybrid's options (its placement file read and checked)."""
    placement = {}
    if options["placement_file"]:
        path = options["placement_file"]
        try:
            with open(path) as f:
                placement = json.load(f)
        except OSError as e:
            raise GraphxformError(f"--placement-file {path}: {e.strerror}") from None
        except ValueError as e:
            raise GraphxformError(f"--placement-file {path}: not JSON ({e})") from None
        if not isinstance(placement, dict):
            raise GraphxformError(f"--placement-file {path}: expected an object mapping "
                                  "variable names to \"allreduce\" or \"ps\"")
    return {"sparse_as_dense_below": options["sparse_as_dense_below"],
            "placement": placement}


def _local_strategy_options(strategy: str, options: dict) -> dict:
    """The options of the strategies that run on one process's devices."""
    replicated = {"all_reduce_spec": options["all_reduce_spec"],
                  "gradient_repacking": options["gradient_repacking"],
                  "agg_small_grads_max_bytes": options["agg_small_grads_max_bytes"],
                  "agg_small_grads_max_group": options["agg_small_grads_max_group"]}
    if strategy == "replicated":
        return replicated
    if options.get("interval", 1) != 1 and strategy != "model-average":
        raise GraphxformError("--interval is an option of --strategy model-average")
    given = [k for k, v in replicated.items() if v != REPLICATED_DEFAULTS[k]]
    if given:
        raise GraphxformError(f"--{given[0].replace('_', '-')} is an option of --strategy "
                              "replicated")
    if strategy == "independent":
        return {}
    if strategy == "model-average":
        return {"interval": options["interval"]}
    return {"bucket_bytes": options["bucket_bytes"],
            "sparse_as_dense": options["sparse_as_dense"]}


REPLICATED_DEFAULTS = {"all_reduce_spec": None, "gradient_repacking": 0,
                       "agg_small_grads_max_bytes": 0, "agg_small_grads_max_group": 10}

strategy_options = [
    click.option("--strategy", default="allreduce", show_default=True,
                 type=click.Choice(["allreduce", "replicated", "independent", "ps",
                                    "partitioned-ps", "hybrid", "model-average"]),
                 help="How to distribute the training step."),
    click.option("--sparse-as-dense-below", default=0, show_default=True,
                 type=click.IntRange(min=0),
                 help="hybrid: a variable with sparse gradients smaller than this many bytes "
                 "is all-reduced as dense instead of living on a ps task."),
    click.option("--placement-file", type=click.Path(dir_okay=False),
                 help="hybrid: JSON mapping variable names to \"allreduce\" or \"ps\", "
                 "overriding the choice by gradient kind."),
    click.option("--all-reduce-spec", default=None,
                 help="replicated: tf_cnn_benchmarks' spec, e.g. pscpu, xring#2, "
                 "pscpu:32k:xring, collective (default: collective)."),
    click.option("--gradient-repacking", default=0, show_default=True,
                 type=click.IntRange(min=0),
                 help="replicated: concatenate the gradients, then reduce them in N packs."),
    click.option("--agg-small-grads-max-bytes", default=0, show_default=True,
                 type=click.IntRange(min=0),
                 help="replicated: concatenate runs of gradients of at most this many bytes."),
    click.option("--agg-small-grads-max-group", default=10, show_default=True,
                 type=click.IntRange(min=1),
                 help="replicated: at most this many small gradients to a group."),
    click.option("--interval", default=1, show_default=True, type=click.IntRange(min=1),
                 help="model-average: average the replicas' copies every K local steps."),
    click.option("--replicas", type=int, help="Number of replicas (local CPU devices)."),
    click.option("--devices", help="Comma-separated TF device names, one per replica "
                 "(e.g. /device:GPU:0,/device:GPU:1)."),
    click.option("--train-op", help="What the user runs to train, when the 'train_op' "
                 "collection does not say: an op or tensor name, or several, comma-separated, "
                 "run in that order."),
    click.option("--sync-batch-norm", is_flag=True,
                 help="allreduce: batch norms normalise with the whole global batch's "
                 "statistics (exact like one device; 3 collectives per batch norm per step)."),
    click.option("--consistent-random", is_flag=True,
                 help="allreduce: random ops with a batch dimension (dropout) draw what one "
                 "device would draw for the whole batch; each replica keeps its slice."),
    click.option("--bucket-bytes", default=32 * 1024 * 1024, show_default=True,
                 type=click.IntRange(min=1), help="Largest fused all-reduce bucket."),
    click.option("--sparse-as-dense", is_flag=True,
                 help="All-reduce sparse gradients as dense tensors instead of gathering them."),
    click.option("--cluster", type=click.Path(dir_okay=False),
                 help="ClusterSpec JSON (jobs ps, worker, optionally chief) for ps strategies, "
                 "or workers (and a chief) for allreduce across tasks; default: TF_CONFIG."),
    click.option("--replicas-per-worker", default=1, show_default=True,
                 type=click.IntRange(min=1), help="Replicas (devices) on each worker task."),
    click.option("--hierarchical", is_flag=True,
                 help="allreduce on a cluster: sum inside each worker, one collective per "
                 "bucket across workers, then broadcast inside the worker."),
    click.option("--worker-device", type=click.Choice(["CPU", "GPU"]), default="CPU",
                 show_default=True, help="ps, allreduce on a cluster: the device type of the "
                 "workers' replicas."),
    click.option("--staleness", default=0, show_default=True, type=click.IntRange(min=0),
                 help="ps: let a worker run up to K steps ahead of the slowest (gradients up to "
                 "K steps old still count)."),
    click.option("--async", "async_", is_flag=True,
                 help="ps: no aggregation; each worker applies its own gradient when ready."),
    click.option("--partitions", type=click.IntRange(min=1),
                 help="partitioned-ps, hybrid (its ps side): shards per variable (default: "
                 "one per ps task)."),
    click.option("--partition-min-bytes", type=click.IntRange(min=0),
                 help="partitioned-ps, hybrid (its ps side): variables smaller than this stay "
                 "whole (default: 0 for partitioned-ps; 262144, i.e. 256 KiB, for hybrid)."),
]


def with_options(options):
    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@with_options(strategy_options)
@click.option("-o", "--output", help="Where to write (default: MODEL with .<strategy>.meta).")
@click.option("--no-verify", is_flag=True, help="Skip the structural check after each pass.")
@click.option("--dump-dir", type=click.Path(file_okay=False),
              help="Write NN_<pass>.pbtxt and .dot after every pass.")
@click.option("--explain", is_flag=True,
              help="Print, per variable, the decision taken (replicated, shared on a ps task, "
              "partitioned), where its gradient is combined, the bytes per step, and why.")
@debug_option
def apply(model, output, no_verify, dump_dir, explain, debug, **options):
    """Transform MODEL with a strategy and write the distributed graph."""
    from graphxform import metagraph
    strategy = options["strategy"]
    output = output or default_output(model, strategy)
    metagraph.check_output_path(output, model)
    if dump_dir:
        _prepare_dump_dir(dump_dir)
    original, ir, pipeline = _transform(model, options, no_verify, dump_dir,
                                        keep_original=explain)
    metagraph.save(ir, output)
    summary = {}
    for t in pipeline.timings:
        summary.update(t.summary)
    click.echo(f"wrote {output}: {strategy}, {summary.get('replicas')} replicas, "
               f"{len(ir)} nodes")
    if "buckets" in summary:
        gradients = next(t.summary.get("collectives_per_replica", 0)
                         for t in pipeline.timings if "buckets" in t.summary)
        others = [(t.name, t.summary["collectives_per_replica"]) for t in pipeline.timings
                  if t.summary.get("collectives_per_replica") and "buckets" not in t.summary]
        click.echo(f"  collectives per replica per step: "
                   f"{gradients + sum(n for _, n in others)} ({summary['buckets']} dense "
                   f"buckets, {summary.get('sparse_gathers', 0)} sparse gathers x3"
                   + "".join(f", {n} {name}" for name, n in others) + ")")
        click.echo(f"  dense bytes all-reduced per replica per step: "
                   f"{summary.get('dense_bytes_reduced', 0)}")
    if "workers" in summary:
        click.echo(f"  {summary['workers']} workers, {summary.get('ps_tasks')} ps tasks, "
                   f"{summary.get('aggregated', 0)} variables aggregated in accumulators")
    if "worker_tasks" in summary:
        how = ("hierarchical: summed inside each worker, then one collective per bucket across "
               f"{summary['hierarchical_workers']} workers" if "hierarchical_workers" in summary
               else "every replica in one collective group")
        click.echo(f"  {summary['worker_tasks']} worker tasks x {summary['replicas_per_worker']} "
                   f"replicas, {how}; collectives fail after {summary['collective_timeout_s']:g}"
                   " s without a member (launch/run --cluster: --timeout)")
    for t in pipeline.timings:
        if t.name == "choose-placement":
            split = next((p.summary for p in pipeline.timings
                          if p.name == "partition-variables"), {})
            for variable, decision in sorted(t.summary.items()):
                if variable in split.get("partitioned_into", {}):
                    decision += f", partitioned into {split['partitioned_into'][variable]}"
                elif variable in split.get("kept_whole", {}):
                    decision += f", whole ({split['kept_whole'][variable]})"
                click.echo(f"  {variable}: {decision}")
        if t.name == "sync-batch-norm":
            count = t.summary.get("batch_norms_synchronised", 0)
            click.echo(f"  sync-batch-norm: {count} batch norm(s) synchronised, "
                       f"{t.summary.get('collectives_per_replica', 0)} collectives per replica "
                       "per step" if count else "  sync-batch-norm: nothing to synchronise "
                       "(no training-mode batch norm in the step)")
        if t.name == "consistent-random":
            count = t.summary.get("random_ops_rewritten", 0)
            click.echo(f"  consistent-random: {count} random op(s) draw the whole batch"
                       if count else "  consistent-random: nothing to synchronise (no random "
                       "op with a batch dimension in the step)")
            for name in t.summary.get("unseeded_random_ops", []):
                click.echo(f"  consistent-random: '{name}' is unseeded (seed = seed2 = 0): it "
                           "cannot match even on one device; set a graph-level seed")
    proven = getattr(pipeline, "contract", {}).get("variables", 0)
    click.echo(f"  contract: {proven} variable copies proven to update once per step from "
               "cross-replica values, replicas start equal")
    checked = getattr(pipeline, "check", None)
    if checked is not None:
        warnings = sum(f.level == "warning" for f in checked.findings)
        ran = ", ".join(r.name for r in checked.results if r.ran)
        click.echo(f"  check: ok ({ran}" + (f"; {warnings} warning(s): run `graphxform "
                                             f"check {output}`" if warnings else "") + ")")
    unmerged = summary.get("unmerged", [])
    if unmerged:
        more = f" and {len(unmerged) - 3} more" if len(unmerged) > 3 else ""
        click.echo(f"  note: {len(unmerged)} original names could not be merged across replicas "
                   f"and give replica 0's value: {', '.join(unmerged[:3])}{more}")
    for t in pipeline.timings:
        idle = not t.modified and not any(t.summary.values())  # sync-init plans, changes nothing
        click.echo(f"  {t.name:18} {t.seconds * 1000:8.1f} ms" + ("  (nothing to do)" if idle
                                                                  else ""))
    if explain:
        from graphxform import training
        from graphxform.inspector import explain as explain_mod
        from graphxform.inspector.updates import replica_count
        decisions = explain_mod.explain(
            training.analyze(original, train_op=options["train_op"]), ir, strategy,
            replica_count(ir), summary, options.get("bucket_bytes"))
        click.echo(explain_mod.text(decisions))


def _prepare_dump_dir(dump_dir: str) -> None:
    """Make --dump-dir before the passes run, so a bad one fails at once in one line."""
    try:
        os.makedirs(dump_dir, exist_ok=True)
    except OSError as e:
        raise GraphxformError(f"--dump-dir {dump_dir}: cannot create: {e.strerror}") from None
    if not os.access(dump_dir, os.W_OK | os.X_OK):
        raise GraphxformError(f"--dump-dir {dump_dir}: not writable")


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--feeds", type=click.Path(dir_okay=False),
              help=".npz of input arrays keyed by placeholder name (default: synthetic data).")
@click.option("--batch-size", type=int, help="Global batch per step.")
@click.option("--restore", help="Checkpoint prefix to start from (default: initialise).")
@click.option("--save", "save_to", help="Checkpoint prefix to write after the last step.")
@click.option("--fetch", "fetches", multiple=True, help="Tensor to print each step (repeatable).")
@click.option("--train-op", help="Train op name when the graph has no 'train_op' collection.")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False),
              help="cluster graphs: ClusterSpec JSON; run this task's part of each step on "
              "TensorFlow's gRPC runtime (default: TF_CONFIG).")
@click.option("--job", help="cluster graphs: this task's job (worker or chief; default: "
              "TF_CONFIG).")
@click.option("--task", "task_index", type=click.IntRange(min=0),
              help="cluster graphs: this task's index in its job (default: TF_CONFIG).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True),
              help="seconds any blocking op or wait may take: a cluster task then stops, "
              f"naming the peer that died or froze (default {DEFAULT_TIMEOUT_S:g}); a local "
              f"run stops a session.run still blocked (default {LOCAL_TIMEOUT_S:g}).")
@debug_option
def run(model, steps, feeds, batch_size, restore, save_to, fetches, train_op, cluster_file, job,
        task_index, timeout, debug):
    """Train MODEL (original or transformed) for some steps, printing the loss. A cluster graph
    (ps, partitioned-ps, hybrid, allreduce --cluster) runs one task of its cluster: `--cluster F
    --job worker --task I` (or TF_CONFIG)."""
    from graphxform import metagraph
    from graphxform.runtime.local import Feeds, Runner
    ir = metagraph.load(model)
    for checkpoint in (restore, save_to):  # what a saver killed mid-save left there
        if checkpoint:
            cleanup.sweep_checkpoint_temps(checkpoint)
    if _on_cluster(ir, cluster_file, job, task_index):
        from graphxform.runtime import task as task_mod
        found, job, task_index = task_mod.resolve_task(cluster_file, job, task_index)
        task_mod.run_task(ir, found, job, task_index, steps, feeds=feeds, batch_size=batch_size,
                          restore=restore, save=save_to, fetches=fetches,
                          timeout_s=timeout or DEFAULT_TIMEOUT_S,
                          echo=_echo_flush, fail=_fail_now)
        from graphxform.runtime.launch import finish_child
        finish_child()
        return
    with Runner(ir, train_op=train_op, fetches=fetches, timeout_s=timeout) as runner:
        for name, why in runner.apart.items():
            click.echo(f"graphxform: note: --fetch {name} runs {why.describe()}: it is "
                       "fetched in a session.run of its own after the steps", err=True)
        source = Feeds(runner.inputs, feeds, batch_size)
        if restore:
            runner.restore(restore, source)
        else:
            runner.initialize(source)
        with _progress(steps) as bar:
            for k in bar:
                result = runner.step(source.batch(k))
                parts = [f"step {k + 1}"] + _losses_text(result.losses)
                parts += [f"{name} {_short(value)}" for name, value in result.fetches.items()]
                click.echo("  ".join(parts))
        if save_to:
            click.echo(f"saved {runner.save(save_to)}")


def _losses_text(losses: dict) -> list[str]:
    """``loss X`` for a graph with one step; ``<step> loss X`` for each of several."""
    if len(losses) == 1:
        (loss,) = losses.values()
        return [] if loss is None else [f"loss {loss:.6f}"]
    return [f"{name} loss {loss:.6f}" for name, loss in losses.items() if loss is not None]


def _progress(steps: int):
    """A progress bar on a terminal; nothing at all in a log or a pipe."""
    if sys.stderr.isatty():
        return click.progressbar(range(steps), label="training", file=sys.stderr, show_pos=True)
    import contextlib
    return contextlib.nullcontext(range(steps))


def _on_cluster(ir, cluster_file, job, task_index) -> bool:
    """Whether `run` runs one task of a cluster: --cluster/--job/--task, or a cluster graph
    with TF_CONFIG set; a cluster graph with neither is an error (it names no local devices)."""
    from graphxform.plan import ClusterPlan
    if cluster_file or job or task_index is not None:
        return True
    if ClusterPlan.from_ir(ir) is None:
        return False
    if os.environ.get("TF_CONFIG"):
        return True
    raise GraphxformError(f"{ir.source} was built for a cluster: give --cluster F --job J "
                          "--task I (or set TF_CONFIG), or try it with `graphxform launch`")


def _echo_flush(text: str) -> None:
    click.echo(text)
    sys.stdout.flush()


def _fail_now(message: str) -> None:
    """A cluster task's one-line error, then the end of the process at once: TF's teardown
    could wait on the peer that stopped answering."""
    from graphxform.runtime.faults import hard_exit
    _error(message)
    hard_exit(EXIT_ERROR)


def _short(value) -> str:
    """A fetched value in a few characters: a number, else its dtype and shape."""
    import numpy as np
    if value is None:  # --fetch named an op (its outputs are NAME:0, ...)
        return "(an op: ran)"
    array = np.asarray(value)
    if array.size == 1 and array.dtype.kind in "biuf":
        return f"{array.item():.6g}"
    if array.size == 1:
        return clip(repr(array.item()), 60)
    return f"{array.dtype}{list(array.shape)}"


@cli.command(name="verify")
@click.argument("model", type=click.Path(dir_okay=False))
@with_options(strategy_options)
@click.option("--steps", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--feeds", type=click.Path(dir_okay=False), help=".npz of input arrays.")
@click.option("--batch-size", type=int, help="Global batch per step.")
@click.option("--fetch", "fetches", multiple=True, help="Also compare this tensor (repeatable).")
@click.option("--rtol", default=1e-5, show_default=True, type=click.FloatRange(min=0),
              help="Largest scaled difference that passes: |original - transformed| over the "
              "variable's size (at least 1% of the RMS of the model's trainable variables).")
@debug_option
def verify_command(model, steps, feeds, batch_size, fetches, rtol, debug, **options):
    """Transform MODEL, then run the same train op(s) on both from the same checkpoint and
    compare every variable and each step's loss (a cluster graph runs on its cluster's servers,
    started in this process on 127.0.0.1)."""
    from graphxform import equivalence
    original, ir, pipeline = _transform(model, options)
    unmerged = [name for t in pipeline.timings for name in t.summary.get("unmerged", ())]
    report = equivalence.compare(original, ir, feeds, steps=steps, batch_size=batch_size,
                                 fetches=fetches, rtol=rtol, train_op=options["train_op"],
                                 unmerged=unmerged)
    click.echo(equivalence.format_report(report))
    if not report.ok:
        sys.exit(EXIT_ERROR)


@cli.command()
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False),
              help="ClusterSpec JSON (default: TF_CONFIG).")
@click.option("--job", help="This task's job, e.g. ps (default: TF_CONFIG).")
@click.option("--task", "task_index", type=click.IntRange(min=0),
              help="This task's index in its job (default: TF_CONFIG, else 0).")
@click.option("--cpus", default=1, show_default=True, type=click.IntRange(min=1),
              help="CPU devices the server offers.")
@click.option("--timeout", default=DEFAULT_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Stop, naming the task, when a peer is gone or silent this long during a run.")
@click.option("--graph", "graph_file", type=click.Path(dir_okay=False),
              help="A cluster graph this server will run ops of with one client (your own "
              "session on the chief): its CPU devices and collective group leader come from it.")
@debug_option
def serve(cluster_file, job, task_index, cpus, timeout, graph_file, debug):
    """Start one task's TensorFlow gRPC server (a ps task, or any task of a graph run with one
    client) and block until SIGTERM/Ctrl-C; stop when a peer dies or freezes during a run."""
    from graphxform.runtime import serve as serve_mod
    from graphxform.runtime import task as task_mod
    found, job, task_index = task_mod.resolve_task(cluster_file, job, task_index)
    leader = None
    if graph_file:
        from graphxform import metagraph
        graph = metagraph.load(graph_file)
        plan = task_mod.plan_of(graph, per_task=False)
        plan.check_cluster(found)
        cpus, leader = max(cpus, task_mod.cpus_needed(graph, job, task_index)), \
            plan.collective_leader
    serve_mod.serve(found, job, task_index, cpus, timeout_s=timeout, echo=_echo_flush,
                    fail=_fail_now, collective_leader=leader)
    from graphxform.runtime.launch import finish_child
    finish_child()


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--feeds", type=click.Path(dir_okay=False),
              help=".npz of input arrays keyed by placeholder name (default: synthetic data).")
@click.option("--batch-size", type=int, help="Global batch per step (every worker reads it).")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False),
              help="Run on this cluster's 127.0.0.1 ports (default: the cluster MODEL was "
              "built for, on free ports).")
@click.option("--restore", help="Checkpoint prefix (or directory) the chief starts from.")
@click.option("--save", "save_to", help="Checkpoint prefix the chief writes (as PREFIX-STEP).")
@click.option("--timeout", default=DEFAULT_TIMEOUT_S, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="Seconds any blocking op or wait may take before a task fails.")
@debug_option
def launch(model, steps, feeds, batch_size, cluster_file, restore, save_to, timeout, debug):
    """Start the cluster a graph was built for (ps, allreduce, hybrid) as local processes, train,
    print the mean loss over workers per step, and tear everything down."""
    from graphxform import metagraph
    from graphxform.cluster import load_cluster
    from graphxform.runtime.launch import Launch
    from graphxform.runtime.task import plan_of
    plan = plan_of(metagraph.load(model))
    found = load_cluster(cluster_file)[0] if cluster_file else None
    for path in (feeds, restore):
        if path and not os.path.exists(path) and not os.path.exists(path + ".index"):
            raise GraphxformError(f"{path}: no such file")
    absolute = lambda p: os.path.abspath(p) if p else p
    Launch(absolute(model), plan, found, steps=steps, feeds=absolute(feeds),
           batch_size=batch_size, timeout_s=timeout, save=absolute(save_to),
           restore=absolute(restore), debug=debug, echo=_echo_flush,
           warn=lambda text: click.echo(text, err=True)).run()


@cli.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--strategy", default="allreduce", show_default=True,
              help="any strategy apply takes (an unknown name is a one-line error).")
@with_options([o for o in strategy_options  # theirs but --strategy, which is ours above
               if all(p.name != "strategy" for p in o(lambda: None).__click_params__)])
@click.option("--batch-size", default=32, show_default=True, type=int,
              help="Global batch per step, split evenly across replicas.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document for machines.")
@debug_option
def cost(model, batch_size, as_json, debug, **options):
    """Bytes each task (device, for allreduce) sends and receives per training step, per
    variable, measured on the transformed graph next to the strategy's textbook minimum."""
    from graphxform.inspector import cost as cost_mod
    cost_mod.check_request(options["strategy"], batch_size)
    original, ir, _ = _transform(model, options)
    report = cost_mod.measure(original, ir, batch_size=batch_size, strategy=options["strategy"],
                              train_op=options["train_op"])
    if report.links:  # allreduce across workers: the other variant's links beside these
        other = dict(options, hierarchical=report.links[0].variant == "flat")
        _, other_ir, _ = _transform(model, other)
        report.links += cost_mod.measure(original, other_ir, batch_size=batch_size,
                                         train_op=options["train_op"]).links
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else
               cost_mod.format_text(report))


def main(argv=None):
    """Entry point: run the CLI; every error is one line on stderr and a non-zero exit
    (--debug adds the traceback). A signal unwinds the command, so nothing is left behind."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    with cleanup.signals_unwind():
        sys.exit(_main(argv, debug))


# set by console_main: this process ends without teardown, so what is only freed for the
# sake of a longer life (TF's graph imported by the check) need not be
_ends_without_teardown = False


def console_main():
    """The `graphxform` command: main, then end the process without the interpreter's
    teardown, which would free every object of a large graph one by one and unload TF's
    modules (a few tenths of a second on a 200k-node output, after the work is done). By then
    outputs are written and closed and children waited for; exit handlers still run. Another
    non-daemon thread still running gets the usual exit, which waits for it. (Teardown can also
    abort: TF's own threads may still be blocked in a collective whose peer is gone, and
    destroying what they hold kills the process with SIGABRT after the error was said.)"""
    global _ends_without_teardown
    _ends_without_teardown = True
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        if any(t.is_alive() and not t.daemon for t in threading.enumerate()
               if t is not threading.main_thread()):
            raise
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more can reach it
                pass
        os._exit(code)


def _main(argv: list, debug: bool) -> int:
    try:
        if not {"-h", "--help", "--version"} & set(argv) and argv:
            tf_import.core(quiet=not debug)  # the API itself only when a command needs it
        # not cli.main: it turns EOFError into "Aborted!" and prints usage errors on 3 lines
        with cli.make_context("graphxform", argv) as ctx:
            cli.invoke(ctx)
        sys.stdout.flush()  # a full disk or a closed pipe is this command's error, said below
        return 0
    except click.exceptions.Exit as e:  # --help, --version
        return e.exit_code
    except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # a bare `graphxform`
        click.echo(e.ctx.get_help())
        return 0
    except click.UsageError as e:
        where = e.ctx.command_path if e.ctx else "graphxform"
        _error(f"{_sentence(e.format_message())} (try '{where} --help')")
        return EXIT_USAGE
    except click.ClickException as e:
        _error(_sentence(e.format_message()))
        return e.exit_code
    except GraphxformError as e:
        if debug:
            traceback.print_exc()
        _error(str(e))
        return EXIT_ERROR
    except cleanup.Terminated as e:
        return _stopped(e)
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("graphxform: interrupted", err=True)
        return 130
    except BrokenPipeError:  # `graphxform inspect M | head`: the reader has all it wants
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_ERROR
    except Exception as e:  # a bug: still one line unless --debug
        stopped = cleanup.terminated_by()  # a signal TF's error handling turned into e
        if stopped is not None:
            return _stopped(stopped)
        if isinstance(e, OSError) and e.filename is None and e.errno in OUTPUT_ERRNOS:
            _error(f"cannot write to standard output: {e.strerror}")  # our files name theirs
            return EXIT_ERROR
        if debug:
            traceback.print_exc()
        _error(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)")
        return EXIT_ERROR


def _stopped(e) -> int:
    click.echo("graphxform: interrupted" if e.signum == signal.SIGINT
               else f"graphxform: stopped by {e.name}", err=True)
    return e.exit_code


# a write to standard output that failed for want of room or a working device
OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _sentence(message: str) -> str:
    """click's "Invalid value for '--x': ..." as the rest of our one-line errors read."""
    message = " ".join(message.split()).rstrip(".")
    return message[:1].lower() + message[1:]


def _error(message: str) -> None:
    click.echo(f"graphxform: error: {clip(message, MESSAGE_LIMIT)}", err=True)


if __name__ == "__main__":  # how launch starts its tasks
    console_main()
