"""A strategy is a function from options to a Pipeline; `graphxform apply --strategy NAME` and
the Python API call the same function."""

from __future__ import annotations

from graphxform.passes.all_reduce import DEFAULT_BUCKET_BYTES, AllReduce
from graphxform.passes.drop_in_saver import DropInSaver
from graphxform.passes.merge_fetches import MergeFetches
from graphxform.passes.replicate import Replicate
from graphxform.passes.rewire_consumers import RewireConsumers
from graphxform.passes.split_inputs import SplitInputs
from graphxform.passes.strip_saver import StripSaver
from graphxform.passes.sync_init import SyncInit
from graphxform.pipeline import Pipeline


def allreduce(bucket_bytes: int = DEFAULT_BUCKET_BYTES, sparse_as_dense: bool = False,
              fetch_mean=(), fetch_concat=(), verify: bool = True,
              dump_dir: str | None = None) -> Pipeline:
    """In-graph replication with collective all-reduce (devices come from the PassContext)."""
    return Pipeline([
        StripSaver(),
        Replicate(),
        SplitInputs(),
        AllReduce(bucket_bytes=bucket_bytes, sparse_as_dense=sparse_as_dense),
        RewireConsumers(),
        SyncInit(),
        MergeFetches(mean=tuple(fetch_mean), concat=tuple(fetch_concat)),
        DropInSaver(),
    ], verify=verify, dump_dir=dump_dir)


STRATEGIES = {"allreduce": allreduce}


def transform(ir, strategy: str = "allreduce", devices=None, train_op: str | None = None,
              **options):
    """Analyse ``ir`` and run the strategy's pipeline on it in place; returns the Pipeline
    (its ``timings`` say what each pass did)."""
    from graphxform import training
    from graphxform.errors import GraphxformError
    from graphxform.pipeline import PassContext
    if strategy not in STRATEGIES:
        raise GraphxformError(f"unknown strategy '{strategy}' (known: {', '.join(STRATEGIES)})")
    devices = list(devices or ["/device:CPU:0"])
    ctx = PassContext(training=training.analyze(ir, train_op=train_op),
                      devices=devices)
    pipeline = STRATEGIES[strategy](**options)
    pipeline.run(ir, ctx)
    return pipeline
