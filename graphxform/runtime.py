"""Run a (original or transformed) training graph in a local TF session: the devices it needs,
initialise or restore, feeds from a .npz pool or synthetic ones, steps, save."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from graphxform import cluster, metagraph, training
from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR

DEFAULT_BATCH = 32


class Feeds:
    """Global batches for the graph's input placeholders.

    With a .npz (keys = placeholder names), step k takes rows [k*B, (k+1)*B) of each batched
    input's pool, wrapping around; inputs without a batch dimension are fed as stored. Without
    one, synthetic data of the placeholders' shapes (seeded, so runs repeat)."""

    def __init__(self, inputs, path: str | None = None, batch_size: int | None = None,
                 seed: int = 0):
        self.inputs = list(inputs)
        self.pool = {}
        if path:
            try:
                with np.load(path) as data:
                    self.pool = {k: data[k] for k in data.files}
            except FileNotFoundError:
                raise GraphxformError(f"{path}: no such file") from None
            except (OSError, ValueError) as e:
                raise GraphxformError(f"{path}: not a readable .npz of feeds ({e})") from None
            missing = [i.name for i in self.inputs if i.name not in self.pool]
            if missing:
                raise GraphxformError(f"{path}: no array for input '{missing[0]}' (keys: "
                                      f"{', '.join(sorted(self.pool)) or 'none'})")
        batched = [len(self.pool[i.name]) for i in self.inputs if i.batched and i.name in self.pool]
        self.batch_size = batch_size or (min(batched + [DEFAULT_BATCH]) if batched else DEFAULT_BATCH)
        if self.batch_size < 1:
            raise GraphxformError(f"--batch-size must be at least 1, not {self.batch_size}")
        self.rng = np.random.default_rng(seed)
        self._synthetic = {}

    def batch(self, step: int) -> dict:
        feed = {}
        for inp in self.inputs:
            if inp.name in self.pool:
                data = self.pool[inp.name]
                if inp.batched:
                    rows = (np.arange(self.batch_size) + step * self.batch_size) % len(data)
                    data = data[rows]
                feed[f"{inp.name}:0"] = data
            else:
                feed[f"{inp.name}:0"] = self._fake(inp)
        return feed

    def _fake(self, inp):
        if inp.name not in self._synthetic:
            from tensorflow.python.framework import dtypes
            dtype = dtypes.as_dtype(inp.dtype)
            if inp.shape is None:
                raise GraphxformError(f"input '{inp.name}' has unknown rank; pass --feeds")
            shape = [self.batch_size if (k == 0 and inp.batched) else max(d, 1)
                     for k, d in enumerate(inp.shape)]
            if dtype.is_floating:
                value = self.rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
            elif dtype.is_integer:
                value = self.rng.integers(0, 2, shape).astype(dtype.as_numpy_dtype)
            elif dtype.is_bool:
                value = self.rng.integers(0, 2, shape).astype(bool)
            else:
                raise GraphxformError(f"cannot make synthetic data for input '{inp.name}' "
                                      f"({dtype.name}); pass --feeds")
            self._synthetic[inp.name] = value
        return self._synthetic[inp.name]


def replicas_of(ir: GraphIR) -> int:
    """How many ways a transformed graph splits its batch (1 for a single-device graph)."""
    splits = [ir.node(n)["attr"]["num_split"].i for n in ir.nodes()
              if n.startswith("split_inputs/") and ir.op(n) == "Split"]
    return max(splits, default=1)


@dataclasses.dataclass
class StepResult:
    loss: float | None
    fetches: dict


class Runner:
    """A session over one MetaGraph; the devices it places on are created locally."""

    def __init__(self, ir: GraphIR, train_op: str | None = None, fetches=(),
                 threads: int = 0, target: str = "", config=None):
        """``target``/``config``: a TF server's session target and its ConfigProto (a cluster
        graph); by default a local session with the CPU devices the graph names."""
        import tensorflow as tf
        tf1 = tf.compat.v1
        self.tf1 = tf1
        self.analysis = training.analyze(ir, train_op=train_op)
        self.train_op = self.analysis.require_train_op("run")
        self.loss = self.analysis.loss
        self.replicas = replicas_of(ir)
        self.fetches = list(fetches)
        meta = metagraph.to_metagraph(ir)
        devices = {ir.node(n)["device"] for n in ir.nodes()}
        self.graph = tf.Graph()
        with self.graph.as_default():
            try:
                self.saver = tf1.train.import_meta_graph(meta, clear_devices=False)
            except (ValueError, KeyError, tf.errors.OpError) as e:
                raise GraphxformError(f"TensorFlow cannot import {ir.source or 'the graph'}: "
                                      f"{_first_line(e)}") from None
            if self.saver is None:  # no saver_def: save the global variables by op name
                self.saver = tf1.train.Saver(allow_empty=True)
            self.variables = tf1.global_variables()
            if self.variables:
                self.init_op = tf1.global_variables_initializer()
            else:  # no variable collections (a bare GraphDef): run the initializers found
                self.init_op = tf.group(*[self.graph.get_operation_by_name(v.initializer)
                                          for v in self.analysis.variables.values()
                                          if v.initializer])
            for name in self.fetches + ([self.loss] if self.loss else []):
                try:
                    self.graph.as_graph_element(name)
                except (KeyError, ValueError):
                    raise GraphxformError(f"no tensor named '{name}' to fetch") from None
        if config is None:
            config = tf1.ConfigProto(device_count={"CPU": cluster.cpu_devices_needed(devices)},
                                     allow_soft_placement=True,
                                     inter_op_parallelism_threads=threads,
                                     intra_op_parallelism_threads=threads)
        self.session = tf1.Session(target, graph=self.graph, config=config)

    def close(self):
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def initialize(self):
        self.session.run(self.init_op)

    def restore(self, prefix: str):
        """Restore a checkpoint prefix, or the latest checkpoint of a directory."""
        import os

        import tensorflow as tf
        if os.path.isdir(prefix):
            latest = tf.train.latest_checkpoint(prefix)
            if latest is None:
                raise GraphxformError(f"{prefix}: no checkpoint in this directory")
            prefix = latest
        try:
            with self.graph.as_default():  # tf1 Saver takes its eager path outside a graph
                self.saver.restore(self.session, prefix)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot restore checkpoint {prefix}: {_first_line(e)}") from None

    def save(self, prefix: str) -> str:
        import tensorflow as tf
        try:
            with self.graph.as_default():
                return self.saver.save(self.session, prefix, write_meta_graph=False)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot save checkpoint {prefix}: {_first_line(e)}") from None

    def step(self, feed: dict) -> StepResult:
        import tensorflow as tf
        self._check_batch(feed)
        names = ([self.loss] if self.loss else []) + self.fetches
        try:
            values = self.session.run([self.train_op] + names, feed)[1:]
        except tf.errors.OpError as e:
            raise GraphxformError(_explain(e)) from None
        got = dict(zip(names, values))
        return StepResult(loss=float(np.mean(got[self.loss])) if self.loss else None,
                          fetches={k: got[k] for k in self.fetches})

    def _check_batch(self, feed):
        if self.replicas <= 1:
            return
        for inp in self.analysis.inputs:
            value = feed.get(f"{inp.name}:0")
            if inp.batched and value is not None and len(value) % self.replicas:
                raise GraphxformError(f"batch of {len(value)} rows for input '{inp.name}' does "
                                      f"not divide evenly across {self.replicas} replicas")

    def variable_values(self) -> dict:
        """Every global variable's value by node name (replica copies under their own names)."""
        return self.session.run({v.op.name: v for v in self.variables})


def cpus_by_job(ir: GraphIR) -> dict:
    """job -> how many CPU devices each of its tasks must offer for the graph's placements."""
    import tensorflow as tf
    found = {}
    for name in ir.nodes():
        device = ir.node(name)["device"]
        if not device:
            continue
        spec = tf.DeviceSpec.from_string(device)
        if spec.job and spec.device_type == "CPU" and spec.device_index is not None:
            found[spec.job] = max(found.get(spec.job, 1), spec.device_index + 1)
    return found


def _first_line(error) -> str:
    """What TF said, in one line naming the node (not "Graph execution error:")."""
    from graphxform.errors import tf_error_line
    return tf_error_line(error)


def _explain(error) -> str:
    """One line for a TF runtime error, naming the node."""
    match = re.search(r"split_inputs/([^/]+)/split", str(error))
    if match:
        return f"the batch for input '{match.group(1)}' does not divide evenly across replicas"
    return f"TensorFlow failed at {_first_line(error)}"
