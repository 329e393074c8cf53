"""TensorBoard event files of a graph, for the graph viewer TF users already have.

An event file is a TFRecord file of ``Event`` protos: the file version first, then one event
holding the serialized GraphDef (what TensorBoard's graph dashboard reads). Every graph goes to
a run directory of its own (for a `--dump-dir`, one run per stage: ``00_input``,
``01_strip-saver``, ...), so TensorBoard's run selector steps through the pipeline."""

from __future__ import annotations

import glob
import os
import socket
import time

from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR

STAGE_SUFFIXES = (".pbtxt", ".meta", ".pb")


def write_events(ir: GraphIR, run_dir: str) -> str:
    """Write ``ir``'s GraphDef as an event file in ``run_dir``; returns the file's path."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    from graphxform import metagraph
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise GraphxformError(f"--tensorboard {run_dir}: cannot create: {e.strerror}") from None
    now = time.time()
    path = os.path.join(run_dir, f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
                                 f".{os.getpid()}.graphxform")
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2")
                     .SerializeToString())
        writer.write(event_pb2.Event(wall_time=now, step=0,
                                     graph_def=metagraph.to_bytes(ir, graph_only=True))
                     .SerializeToString())
    return path


def stages(dump_dir: str) -> list[str]:
    """The stage files of an `apply --dump-dir` directory, in pipeline order."""
    found = sorted(p for p in glob.glob(os.path.join(dump_dir, "*"))
                   if p.endswith(STAGE_SUFFIXES))
    if not found:
        raise GraphxformError(f"{dump_dir}: no stages (NN_<pass>.pbtxt) to write; give a "
                              "model file or an `apply --dump-dir` directory")
    return found


def write_model(model: str, out_dir: str) -> list[str]:
    """Event files for ``model`` (one run named after it), or for every stage of a dump
    directory (one run per stage). Returns the run directories written."""
    from graphxform import metagraph
    paths = stages(model) if os.path.isdir(model) else [model]
    runs = []
    for path in paths:
        run = os.path.join(out_dir, os.path.splitext(os.path.basename(path))[0])
        write_events(metagraph.load(path), run)
        runs.append(run)
    return runs
