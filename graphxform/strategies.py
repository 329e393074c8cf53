"""A strategy is a function from options to a Pipeline; `graphxform apply --strategy NAME` and
the Python API call the same function."""

from __future__ import annotations

from graphxform import allreduce_spec
from graphxform.passes.all_reduce import DEFAULT_BUCKET_BYTES, AllReduce
from graphxform.passes.consistent_random import ConsistentRandom
from graphxform.passes.drop_in_saver import DropInSaver
from graphxform.passes.global_denominators import GlobalDenominators
from graphxform.passes.global_extremes import GlobalExtremes
from graphxform.passes.global_state import GlobalState
from graphxform.passes.hybrid import (PARTITION_MIN_BYTES, ChoosePlacement,
                                     HybridWorkerSteps, OnSide, PartitionPsSide,
                                     UnshareReplicated)
from graphxform.passes.insert_accumulators import InsertAccumulators
from graphxform.passes.merge_fetches import MergeFetches
from graphxform.passes.model_average import ModelAverage
from graphxform.passes.model_average import worker_devices as model_average_devices
from graphxform.passes.order_races import OrderRaces
from graphxform.passes.partition_variables import PartitionVariables
from graphxform.passes.place_variables import PlaceVariables
from graphxform.passes.replicate import Replicate, require_single_device
from graphxform.passes.replicated_all_reduce import ReplicatedAllReduce
from graphxform.passes.rewire_consumers import RewireConsumers
from graphxform.passes.share_variables import ShareVariables
from graphxform.passes.split_inputs import SplitInputs
from graphxform.passes.strip_saver import StripSaver
from graphxform.passes.half_precision import HalfPrecision
from graphxform.passes.summed_losses import SummedLosses
from graphxform.passes.sync_batch_norm import SyncBatchNorm
from graphxform.passes.sync_init import SyncInit
from graphxform.passes.unpin_devices import UnpinDevices
from graphxform.passes.worker_steps import DEFAULT_TIMEOUT_S, WorkerSteps, replica_devices
from graphxform.pipeline import Pipeline


def allreduce(bucket_bytes: int = DEFAULT_BUCKET_BYTES, sparse_as_dense: bool = False,
              fetch_mean=(), fetch_concat=(), verify: bool = True,
              dump_dir: str | None = None, sync_batch_norm: bool = False,
              consistent_random: bool = False, on_cluster: bool = False,
              hierarchical: bool = False,
              collective_timeout_s: float = DEFAULT_TIMEOUT_S) -> Pipeline:
    """In-graph replication with collective all-reduce (devices come from the PassContext).
    ``sync_batch_norm``: batch norms use the global batch's statistics;
    ``consistent_random``: random ops draw what one device would draw. ``on_cluster``: the
    replicas are on a cluster's worker tasks: global_step is mirrored per replica and each
    task's part of the step is written into the graph (``hierarchical``: reduce inside each
    worker, then across workers)."""
    return Pipeline([
        OrderRaces(),
        *([UnpinDevices()] if on_cluster else []),
        StripSaver(),
        SyncInit(),
        Replicate(mirror_global_step=on_cluster),
        SplitInputs(),
        *([SyncBatchNorm()] if sync_batch_norm else []),
        *([ConsistentRandom()] if consistent_random else []),
        GlobalDenominators(),
        HalfPrecision(),  # both after: a sum over the batch's total is a sum only once it
        SummedLosses(),  # is the whole batch's
        GlobalExtremes(),
        AllReduce(bucket_bytes=bucket_bytes, sparse_as_dense=sparse_as_dense,
                  hierarchical=hierarchical),
        RewireConsumers(),
        GlobalState(),
        MergeFetches(mean=tuple(fetch_mean), concat=tuple(fetch_concat)),
        DropInSaver(),
        *([WorkerSteps(timeout_s=collective_timeout_s)] if on_cluster else []),
    ], verify=verify, dump_dir=dump_dir)


def replicated(all_reduce_spec: str | None = None, gradient_repacking: int = 0,
               agg_small_grads_max_bytes: int = 0, agg_small_grads_max_group: int = 10,
               fetch_mean=(), fetch_concat=(), verify: bool = True, dump_dir: str | None = None,
               sync_batch_norm: bool = False, consistent_random: bool = False) -> Pipeline:
    """tf_cnn_benchmarks' replicated mode: as allreduce, with the gradients reduced as an
    all-reduce spec says (graphxform.allreduce_spec), optionally repacked or aggregated."""
    allreduce_spec.parse(all_reduce_spec or "collective")  # a malformed spec fails first
    pipeline = allreduce(fetch_mean=fetch_mean, fetch_concat=fetch_concat, verify=verify,
                         dump_dir=dump_dir, sync_batch_norm=sync_batch_norm,
                         consistent_random=consistent_random)
    at = next(i for i, p in enumerate(pipeline.passes) if isinstance(p, AllReduce))
    pipeline.passes[at] = ReplicatedAllReduce(
        spec=all_reduce_spec or "collective", gradient_repacking=gradient_repacking,
        agg_small_grads_max_bytes=agg_small_grads_max_bytes,
        agg_small_grads_max_group=agg_small_grads_max_group)
    return pipeline


def independent(fetch_mean=(), fetch_concat=(), verify: bool = True,
                dump_dir: str | None = None) -> Pipeline:
    """Every replica trains on its slice alone, no gradient exchange: a ceiling for scaling
    measurements, not a drop-in replacement (replicas drift apart; the saver keeps replica 0)."""
    pipeline = allreduce(fetch_mean=fetch_mean, fetch_concat=fetch_concat, verify=verify,
                         dump_dir=dump_dir)
    pipeline.passes = [p for p in pipeline.passes  # each replica's own mean is its own
                       if not isinstance(p, (AllReduce, RewireConsumers, GlobalDenominators,
                                             GlobalExtremes, GlobalState, HalfPrecision,
                                             SummedLosses))]
    # the replicas train apart by design: a pair left unordered is no new divergence
    pipeline.passes = [OrderRaces(strict=False) if isinstance(p, OrderRaces) else p
                       for p in pipeline.passes]
    return pipeline


def model_average(interval: int = 1, fetch_mean=(), fetch_concat=(), verify: bool = True,
                  dump_dir: str | None = None, on_cluster: bool = False) -> Pipeline:
    """TF's ModelAverageOptimizer: every replica trains its own copy with the original
    optimizer, and every ``interval`` local steps the copies are averaged into centre variables
    and copied back (passes/model_average.py); global_step counts averaging rounds.
    ``on_cluster``: the replicas are on a cluster's worker tasks and the centres on its ps
    tasks; global_step is mirrored per replica and each task's step written into the graph."""
    pipeline = independent(fetch_mean=fetch_mean, fetch_concat=fetch_concat, verify=verify,
                           dump_dir=dump_dir)
    saver = next(i for i, p in enumerate(pipeline.passes) if isinstance(p, DropInSaver))
    pipeline.passes.insert(saver, ModelAverage(interval=interval))
    if on_cluster:
        pipeline.passes = [Replicate(mirror_global_step=True) if isinstance(p, Replicate)
                           else p for p in pipeline.passes]
        pipeline.passes.insert(saver, WorkerSteps())
        pipeline.passes.insert(0, UnpinDevices())
    return pipeline


def ps(ps_tasks: int = 1, staleness: int = 0, asynchronous: bool = False,
       fetch_mean=(), fetch_concat=(), verify: bool = True,
       dump_dir: str | None = None) -> Pipeline:
    """Parameter servers: variables balanced by bytes over the ps tasks, one copy each; every
    worker's gradients aggregated in accumulators on the ps and applied once per step (replica
    devices and the cluster come from the PassContext)."""
    return Pipeline([
        OrderRaces(strict=False),  # one copy of each variable, stepped by one run
        UnpinDevices(),
        StripSaver(),
        PlaceVariables(ps_tasks=ps_tasks),
        ShareVariables(),
        Replicate(),
        SplitInputs(),
        *([] if asynchronous else [GlobalDenominators(shared=True), HalfPrecision(),
                                   SummedLosses(),
                                   GlobalExtremes(shared=True), GlobalState(shared=True)]),
        InsertAccumulators(staleness=staleness, asynchronous=asynchronous),
        MergeFetches(mean=tuple(fetch_mean), concat=tuple(fetch_concat)),
        DropInSaver(),
    ], verify=verify, dump_dir=dump_dir)


def partitioned_ps(ps_tasks: int = 1, partitions: int | None = None,
                   partition_min_bytes: int = 0, staleness: int = 0, asynchronous: bool = False,
                   fetch_mean=(), fetch_concat=(), verify: bool = True,
                   dump_dir: str | None = None) -> Pipeline:
    """ps with every trainable variable of at least ``partition_min_bytes`` split along axis 0
    into ``partitions`` shards (default: one per ps task), placed like separate variables."""
    pipeline = ps(ps_tasks, staleness, asynchronous, fetch_mean, fetch_concat, verify, dump_dir)
    shards = ps_tasks if partitions is None else partitions  # 0 reaches the pass, which refuses
    at = next(i for i, p in enumerate(pipeline.passes) if isinstance(p, StripSaver)) + 1
    pipeline.passes.insert(at, PartitionVariables(partitions=shards, min_bytes=partition_min_bytes))
    return pipeline


def hybrid(ps_tasks: int = 1, sparse_as_dense_below: int = 0, placement=None,
           partitions: int | None = None, partition_min_bytes: int = PARTITION_MIN_BYTES,
           bucket_bytes: int = DEFAULT_BUCKET_BYTES, fetch_mean=(), fetch_concat=(),
           verify: bool = True, dump_dir: str | None = None) -> Pipeline:
    """Parallax: variables with dense gradients replicated and all-reduced, variables with
    sparse gradients on the ps tasks behind sparse accumulators (passes/hybrid.py);
    ``sparse_as_dense_below`` bytes and ``placement`` ({variable: "allreduce" | "ps"}) decide
    the borderline. A ps-side variable of at least ``partition_min_bytes`` (default 256 KiB)
    is split along axis 0 into ``partitions`` shards (default: one per ps task)."""
    shards = ps_tasks if partitions is None else partitions  # 0 reaches the pass, which refuses
    return Pipeline([
        OrderRaces(),
        UnpinDevices(),
        StripSaver(),
        ChoosePlacement(sparse_as_dense_below=sparse_as_dense_below,
                        overrides=dict(placement or {})),
        PartitionPsSide(partitions=shards, min_bytes=partition_min_bytes),
        OnSide(PlaceVariables(ps_tasks=ps_tasks), side="ps", hide_other=True),
        OnSide(ShareVariables(), side="ps"),
        UnshareReplicated(),
        SyncInit(),
        Replicate(),
        SplitInputs(),
        GlobalDenominators(),
        HalfPrecision(),
        SummedLosses(),
        GlobalExtremes(),
        OnSide(AllReduce(bucket_bytes=bucket_bytes, sparse_as_dense=True), side="allreduce"),
        RewireConsumers(),
        GlobalState(),
        OnSide(InsertAccumulators(), side="ps"),
        HybridWorkerSteps(),
        MergeFetches(mean=tuple(fetch_mean), concat=tuple(fetch_concat)),
        DropInSaver(),
    ], verify=verify, dump_dir=dump_dir)


STRATEGIES = {"allreduce": allreduce, "replicated": replicated, "independent": independent,
              "ps": ps, "partitioned-ps": partitioned_ps, "model-average": model_average,
              "hybrid": hybrid}
NOT_DROP_IN = {"independent"}  # documented as such: the contract check proves only the start
# strategies whose devices are a cluster's worker tasks (hybrid: its ps side needs ps tasks)
CLUSTER_STRATEGIES = {"ps", "partitioned-ps", "hybrid"}


def transform(ir, strategy: str = "allreduce", devices=None, train_op: str | None = None,
              cluster=None, **options):
    """Analyse ``ir``, run the strategy's pipeline on it in place and prove the result keeps
    the drop-in contract (graphxform.contract; refuses otherwise); returns the Pipeline (its
    ``timings`` say what each pass did). Cluster strategies take ``cluster`` (a
    graphxform.cluster.Cluster) and default ``devices`` to one per worker task; so do
    allreduce and model-average given a cluster (their replicas on the workers, and the chief
    job's task; model-average's centres on the ps tasks)."""
    from graphxform import training
    from graphxform.errors import GraphxformError
    from graphxform.pipeline import PassContext
    if strategy not in STRATEGIES:
        raise GraphxformError(f"unknown strategy '{strategy}' (known: {', '.join(STRATEGIES)})")
    if strategy in CLUSTER_STRATEGIES:
        for flag in ("sync_batch_norm", "consistent_random", "hierarchical"):
            if options.get(flag):
                raise GraphxformError(f"--{flag.replace('_', '-')} is an option of --strategy "
                                      f"allreduce (not yet of {strategy})")
            options.pop(flag, None)
        if cluster is None:
            raise GraphxformError(f"strategy {strategy} needs a cluster: give --cluster FILE or "
                                  "set TF_CONFIG")
        if not cluster.tasks("ps"):
            raise GraphxformError(f"{cluster.source}: strategy {strategy} needs a 'ps' job")
        devices = devices or cluster.worker_devices()
        options.setdefault("ps_tasks", len(cluster.tasks("ps")))
    elif strategy == "allreduce" and cluster is not None:
        devices = devices or replica_devices(cluster)
        options["on_cluster"] = True
    elif strategy == "model-average" and cluster is not None:
        devices = devices or model_average_devices(cluster)
        options["on_cluster"] = True
    elif options.get("hierarchical"):
        raise GraphxformError("--hierarchical reduces inside each worker, then across workers: "
                              "it needs --strategy allreduce with --cluster F (or TF_CONFIG)")
    if strategy in ("model-average", "independent"):
        for flag in ("sync_batch_norm", "consistent_random"):
            if options.pop(flag, False):
                raise GraphxformError(f"--{flag.replace('_', '-')} is an option of --strategy "
                                      f"allreduce and replicated, not {strategy}")
    devices = list(devices or ["/device:CPU:0"])
    ctx = PassContext(training=training.analyze(ir, train_op=train_op), devices=devices,
                      cluster=cluster, strategy=strategy)
    if len(devices) > 1 and not _asynchronous(strategy, options):
        from graphxform import contract
        require_single_device(ir)
        contract.check_input(ir, ctx.training)
    if len(devices) > 1:  # the input's towers, before replicate renames them (merge-fetches)
        from graphxform import towers
        ctx.state["towers"] = towers.layout(ir, ctx.training)
    pipeline = STRATEGIES[strategy](**options)
    pipeline.run(ir, ctx)
    with ir.indexed_by_op():  # the graph changes no more
        _prove(ir, ctx, pipeline, strategy, options)
    return pipeline


def _asynchronous(strategy: str, options: dict) -> bool:
    """Whether the replicas train apart (ps --async, independent, model-average), so the
    per-step contract does not hold and is not checked."""
    return (options.get("asynchronous", False) or strategy in NOT_DROP_IN
            or strategy == "model-average")


def _prove(ir, ctx, pipeline, strategy: str, options: dict) -> None:
    """The contract check and `graphxform check`'s checks on the transformed graph (refuses a
    graph that fails them)."""
    from graphxform import contract
    devices = ctx.devices
    closures = contract.step_closures(ir, ctx.training)
    ordered = ctx.state.get("order-races", {}).get("ordered", ())
    pipeline.contract = contract.check(ir, ctx.training, len(devices),
                                       asynchronous=_asynchronous(strategy, options),
                                       closures=closures, ordered=ordered)
    if strategy == "model-average":  # its own invariant in place of the per-step one
        pipeline.contract = contract.check_model_average(ir, ctx.training, len(devices),
                                                         closures)
    # `graphxform check`'s checks that can fail, but updates: the contract has just proven
    # them from the input's own analysis
    from graphxform.inspector import check
    pipeline.check = check.run(ir, skip=("updates", "stateful"), input_analysis=ctx.training,
                               replicas=len(devices), closures=closures)
    check.require_ok(pipeline.check)
