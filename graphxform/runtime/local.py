"""Run a (original or transformed) training graph in a local TF session: the devices it needs,
initialise or restore, feeds from a .npz pool or synthetic ones, steps, save."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from graphxform import cluster, input_pipeline, metagraph, training
from graphxform.errors import GraphxformError, tf_error_line
from graphxform.ir import GraphIR
from graphxform.passes.split_inputs import uneven_batch
from graphxform.runtime import sparse_batches
from graphxform.runtime.input_threads import InputThreads
from graphxform.runtime.servers import LOCAL_TIMEOUT_S

DEFAULT_BATCH = 32


class Feeds:
    """Global batches for the graph's inputs, checked against the placeholders before step 1.

    With a .npz (keys = placeholder names), step k takes rows [k*B, (k+1)*B) of each batched
    input's array, wrapping around; other inputs are fed as stored. An optional input (a
    PlaceholderWithDefault, or one no step reads) that the file lacks is not fed: the graph's
    default is used. Without a file, synthetic data of the placeholders' shapes (seeded, so runs
    repeat) for every input that must be fed.

    A SparseTensor fed through sparse_placeholder's three placeholders is stored and cut by
    rows as graphxform/runtime/sparse_batches.py says.

    B is ``batch_size``, else the graph's fixed batch dimension, else the smallest batched array
    (at most 32). Each array must have its placeholder's rank and static non-batch dimensions.
    Dtypes: any float feeds a float placeholder (cast, as TF's own feed does); integers feed a
    float, integer or bool placeholder only when every value converts exactly; anything else
    (floats for an integer placeholder, say) is an error naming the file and the input."""

    def __init__(self, inputs, path: str | None = None, batch_size: int | None = None,
                 seed: int = 0):
        self.inputs = list(inputs)
        self.path = path
        self.pool = _load_pool(path, self.inputs) if path else {}
        self.sparse = _sparse_pools(path, self.inputs, self.pool)
        self.batch_size = _batch_size(self.inputs, self.pool, batch_size, self.sparse)
        self.rng = np.random.default_rng(seed)
        self._synthetic = {}

    def batch(self, step: int) -> dict:
        feed = {}
        for name, parts in self._sparse_batches(step):
            feed.update(parts)
        for inp in self.inputs:
            if inp.sparse:
                continue
            if inp.name in self.pool:
                data = self.pool[inp.name]
                if inp.batched:
                    rows = (np.arange(self.batch_size) + step * self.batch_size) % len(data)
                    data = data[rows]
                feed[f"{inp.name}:0"] = data
            elif not inp.optional:
                feed[f"{inp.name}:0"] = self._fake(inp)
        return feed

    def initializer_feed(self, inits) -> dict:
        """The feed of the iterator initializers ``inits`` (input_pipeline.IteratorInit): each
        placeholder they read, whole, from the .npz (a PlaceholderWithDefault only if there);
        one the file lacks is an error naming it."""
        feed = {}
        for init in inits:
            for name in init.placeholders + init.defaults:
                if name in self.pool:
                    feed[f"{name}:0"] = self.pool[name]
                elif name in init.placeholders:
                    raise GraphxformError(
                        f"iterator initializer '{init.op}' reads placeholder '{name}': pass "
                        f"its array in --feeds (a .npz keyed by placeholder name"
                        f"{'' if self.path is None else f'; {self.path} has none'}), fed whole "
                        "once before the first step as sess.run(iterator.initializer, "
                        "feed_dict=...) does")
        return feed

    def _sparse_batches(self, step: int):
        """(SparseTensor name, {placeholder tensor: array}) for each sparse input fed."""
        for name, parts in sorted(training.sparse_groups(self.inputs).items()):
            if name in self.sparse:
                pool = self.sparse[name]
                wanted = (np.arange(self.batch_size) + step * self.batch_size) % \
                    sparse_batches.rows(pool)
                batch = sparse_batches.take(pool, wanted)
            elif all(p.optional for p in parts):
                continue
            else:
                batch = self._fake_sparse(name, *parts)
            yield name, {f"{p.name}:0": value for p, value in zip(parts, batch)}

    def _fake_sparse(self, name: str, indices, values, shape) -> tuple:
        if name not in self._synthetic:
            from tensorflow.python.framework import dtypes
            self._synthetic[name] = sparse_batches.synthetic(
                self.rng, self.batch_size, max(indices.shape[1], shape.shape[0]),
                dtypes.as_dtype(values.dtype))
        return self._synthetic[name]

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


def _load_pool(path: str, inputs) -> dict:
    """The .npz's arrays for ``inputs``, each checked and cast to its placeholder's dtype."""
    arrays = _read_npz(path)
    missing = [i.name for i in inputs if i.name not in arrays and not i.optional]
    if missing:
        raise GraphxformError(f"{path}: no array for input '{missing[0]}' (keys: "
                              f"{', '.join(sorted(arrays)) or 'none'})")
    pool = {}
    for inp in inputs:
        if inp.name in arrays:
            _check_shape(path, inp, arrays[inp.name])
            pool[inp.name] = _as_input_dtype(path, inp, arrays[inp.name])
    return pool


def _sparse_pools(path: str | None, inputs, pool: dict) -> dict:
    """SparseTensor name -> (indices, values, shape) of the .npz, checked (see Feeds)."""
    found = {}
    for name, parts in sorted(training.sparse_groups(inputs).items()):
        arrays = [pool.get(p.name) for p in parts]
        if any(a is None for a in arrays):
            continue
        sparse_batches.check_pool(path, name, *arrays)
        found[name] = tuple(arrays)
    return found


def _read_npz(path: str) -> dict:
    import zipfile
    import zlib
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise GraphxformError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise GraphxformError(f"{path}: is a directory, not a .npz file") from None
    except OSError as e:
        raise GraphxformError(f"{path}: cannot read ({e.strerror or e})") from None
    except (ValueError, EOFError, zipfile.BadZipFile):
        raise GraphxformError(f"{path}: not a .npz file (a zip of arrays keyed by placeholder "
                              "name, as np.savez writes)") from None
    if isinstance(data, np.ndarray):
        raise GraphxformError(f"{path}: holds one array (a .npy file), not a .npz of arrays "
                              "keyed by placeholder name (write it with np.savez)")
    with data:
        try:
            return {key: data[key] for key in data.files}
        except (ValueError, OSError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
            raise GraphxformError(f"{path}: damaged or unreadable array ({e})") from None


def _shape_text(shape) -> str:
    return "[" + ", ".join("?" if d < 0 else str(d) for d in shape) + "]"


def _check_shape(path: str, inp, array) -> None:
    """Rank and static non-batch dimensions as the placeholder declares; never empty."""
    if array.size == 0:
        raise GraphxformError(f"{path}: the array for input '{inp.name}' is empty "
                              f"(shape {list(array.shape)})")
    if inp.shape is None:
        return
    wanted = _shape_text(inp.shape) + (" (rows along axis 0)" if inp.batched else "")
    if array.ndim != len(inp.shape):
        raise GraphxformError(f"{path}: the array for input '{inp.name}' has rank {array.ndim} "
                              f"(shape {list(array.shape)}); the placeholder is {wanted}")
    for axis, (want, got) in enumerate(zip(inp.shape, array.shape)):
        if want >= 0 and got != want and not (axis == 0 and inp.batched):
            raise GraphxformError(f"{path}: the array for input '{inp.name}' has shape "
                                  f"{list(array.shape)}; the placeholder is {wanted}")


def _as_input_dtype(path: str, inp, array):
    """``array`` as the placeholder's dtype, or a one-line error when that would change values
    (floats for an integer placeholder, integers a float cannot hold exactly)."""
    from tensorflow.python.framework import dtypes
    dtype = dtypes.as_dtype(inp.dtype)
    if dtype == dtypes.string or dtype.is_complex or array.dtype == dtype.as_numpy_dtype:
        return array
    target = np.dtype(dtype.as_numpy_dtype)
    kind = array.dtype.kind
    exact = None
    if dtype.is_floating and kind == "f":
        return array.astype(target)
    if kind in "iub" and (dtype.is_integer or dtype.is_floating or dtype.is_bool):
        exact = _converts_exactly(array, target, dtype)
    if not exact:
        why = "" if exact is None else " without changing values"
        raise GraphxformError(f"{path}: the array for input '{inp.name}' is {array.dtype}, which "
                              f"cannot feed a {dtype.name} placeholder{why}")
    return array.astype(target)


def _converts_exactly(array, target, dtype) -> bool:
    if dtype.is_bool:
        return array.dtype.kind == "b" or bool(np.isin(array, (0, 1)).all())
    values = array.astype(np.int64) if array.dtype.kind == "b" else array
    if dtype.is_integer:
        info = np.iinfo(target)
        return bool(values.min() >= info.min and values.max() <= info.max)
    import ml_dtypes  # finfo that also knows bfloat16
    largest_exact = 2 ** (ml_dtypes.finfo(target).nmant + 1)  # every integer up to it is exact
    return bool(np.abs(values.astype(np.float64)).max() <= largest_exact)


def _batch_size(inputs, pool: dict, given: int | None, sparse: dict) -> int:
    """--batch-size, else the graph's fixed batch, else the smallest batched array (at most
    DEFAULT_BATCH); a fixed batch the flag contradicts is an error naming the input."""
    if given is not None and given < 1:
        raise GraphxformError(f"--batch-size must be at least 1, not {given}")
    fixed = [i for i in inputs if i.fixed_batch]
    if fixed:
        if given is not None and given != fixed[0].fixed_batch:
            raise GraphxformError(f"--batch-size {given} differs from the fixed batch of input "
                                  f"'{fixed[0].name}' ({fixed[0].fixed_batch} rows)")
        return fixed[0].fixed_batch
    if given is not None:
        return given
    rows = [len(pool[i.name]) for i in inputs if i.batched and i.name in pool]
    rows += [sparse_batches.rows(p) for p in sparse.values()]
    return min(rows + [DEFAULT_BATCH])


def needed_inputs(ir: GraphIR, inputs, fetches=()) -> list:
    """``inputs`` with those that ``fetches`` read marked as read (so they must be fed)."""
    if not fetches:
        return list(inputs)
    read = set()
    for name in fetches:
        node = name.split(":")[0].lstrip("^")
        if node in ir:
            read |= ir.ancestors(node)
    return [dataclasses.replace(i, read_by_step=True) if i.name in read else i for i in inputs]


def _require_names(ir: GraphIR, steps) -> None:
    for step in steps:
        if step.op not in ir:
            raise GraphxformError(f"{ir.source or 'the graph'} has no '{step.name}', a step the "
                                  "original graph runs")


def replicas_of(ir: GraphIR) -> int:
    """How many ways a transformed graph splits its batch (1 for a single-device graph)."""
    splits = [ir.node(n)["attr"]["num_split"].i for n in ir.nodes()
              if n.startswith("split_inputs/") and ir.op(n) in ("Split", "SparseSplit")]
    return max(splits, default=1)


@dataclasses.dataclass
class StepResult:
    """One ``Runner.step``: each step's loss by the step's name, in run order (None where no
    loss was found), and the fetched values. A step of tower code (graphxform/towers.py) has
    no loss tensor of its own: its loss is the mean of its towers' losses (equal parts, equal
    weights: what their averaged gradients train), each of which is in ``towers``."""
    losses: dict
    fetches: dict
    towers: dict = dataclasses.field(default_factory=dict)

    @property
    def loss(self) -> float | None:
        """The first step's loss (for callers of one-step graphs)."""
        return next(iter(self.losses.values()), None)


class Runner:
    """A session over one MetaGraph that runs what the user runs: every step of the graph, in
    order, once per ``step()`` (a GAN's d_train then g_train), a tensor step as a tensor. The
    devices it places on are created locally."""

    def __init__(self, ir: GraphIR, train_op: str | None = None, fetches=(),
                 threads: int = 0, target: str = "", config=None, steps=None,
                 timeout_s: float | None = None, apart=None):
        """``target``/``config``: a TF server's session target and its ConfigProto (a cluster
        graph); by default a local session with the CPU devices the graph names. ``steps``:
        another graph's ``training.Step`` list to run here by name (verify runs the original's
        steps and losses on the transformed graph). ``timeout_s`` bounds each session.run (by
        default ``config``'s operation timeout, else LOCAL_TIMEOUT_S): TF stops a run still
        blocked then (an input queue nothing fills any more). ``apart``: the fetches to read
        in a session.run of their own after the steps (by default those that run a write no
        step runs in no order with the last step: ``fetch_races.fetched_beside``; verify gives
        the original's to both graphs)."""
        import tensorflow as tf
        tf1 = tf.compat.v1
        self.tf1 = tf1
        if steps is not None:
            _require_names(ir, steps)
            train_op = [s.name for s in steps]
        self.analysis = training.analyze(ir, train_op=train_op)
        self.analysis.require_train_op("run")
        input_pipeline.require_filled(ir, self.analysis)
        self.steps = list(steps) if steps is not None else self.analysis.steps
        self.train_op = self.steps[0].op
        self.loss = self.steps[0].loss
        self.replicas = replicas_of(ir)
        from graphxform.towers import replica_splits
        self.tower_splits = replica_splits(ir) if self.replicas > 1 else []
        self.fetches = list(fetches)
        if apart is None:
            from graphxform.fetch_races import fetched_beside
            last = next((s for s in self.analysis.steps if s.name == self.steps[-1].name),
                        self.analysis.steps[-1])  # this graph's, with its closure
            apart = fetched_beside(ir, self.analysis, self.fetches, last)
        self.apart = {f: apart[f] for f in self.fetches if f in apart}  # {fetch: why}
        self.inputs = needed_inputs(ir, self.analysis.inputs, self.fetches)
        self.iterator_inits = input_pipeline.iterator_initializers(ir, self.analysis.pipeline)
        meta = metagraph.to_metagraph(ir)
        devices = {ir.node(n)["device"] for n in ir.nodes()}
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.saver = import_meta_graph(meta, ir.source)
            if self.saver is None:  # no saver_def: save the global variables by op name
                self.saver = tf1.train.Saver(allow_empty=True)
            self.variables = tf1.global_variables()
            # what a TF1 training loop (tf.train.Scaffold) runs after initializing or restoring
            # the global variables: metrics keep their totals in local variables (tf_keras's
            # in variables of no collection, which Keras starts itself), feature columns their
            # vocabularies in tables, and no checkpoint holds either
            uncollected = [self.graph.get_operation_by_name(v.initializer)
                           for v in self.analysis.variables.values()
                           if v.local and v.initializer] if self.variables else []
            self.local_init_op = tf.group(tf1.local_variables_initializer(),
                                          tf1.tables_initializer(), *uncollected)
            if self.variables:
                self.init_op = tf1.global_variables_initializer()
            else:  # no variable collections (a bare GraphDef): run the initializers found
                self.init_op = tf.group(*[self.graph.get_operation_by_name(v.initializer)
                                          for v in self.analysis.variables.values()
                                          if v.initializer])
            for name in self.fetches + [t for s in self.steps
                                        for t in ([s.loss] if s.loss else s.towers)]:
                try:
                    self.graph.as_graph_element(name)
                except (KeyError, ValueError):
                    raise GraphxformError(f"no tensor named '{name}' to fetch") from None
        if config is None:
            config = tf1.ConfigProto(device_count={"CPU": cluster.cpu_devices_needed(devices)},
                                     allow_soft_placement=True,
                                     inter_op_parallelism_threads=threads,
                                     intra_op_parallelism_threads=threads)
        if timeout_s is None:
            timeout_s = config.operation_timeout_in_ms / 1000 or LOCAL_TIMEOUT_S
        self.timeout_s = timeout_s
        self.run_options = tf1.RunOptions(timeout_in_ms=max(1, int(timeout_s * 1000)))
        self.session = tf1.Session(target, graph=self.graph, config=config)
        self.input_threads = InputThreads(self.graph, self.session)
        self._in_flight = None  # the thread of a session.run a signal left running

    def close(self):
        """Stop the input threads and close the session, which cancels a run still in
        flight (one a signal interrupted) and lets its thread end."""
        self.input_threads.stop()
        self.session.close()
        if self._in_flight is not None:
            self._in_flight.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def initialize(self, feeds: Feeds | None = None):
        """Initialize the variables, then start the input pipeline (``start_input``)."""
        self._run(self.init_op, None)  # the first run places the graph: its errors are TF's
        self._run(self.local_init_op, None)
        self.start_input(feeds)

    def start_input(self, feeds: Feeds | None = None):
        """What a TF1 loop runs before its first step: the initializers of the iterators the
        steps read (fed from ``feeds``' .npz where they read placeholders), then the queue
        runners' threads."""
        if self.iterator_inits:
            feed = (feeds or Feeds([])).initializer_feed(self.iterator_inits)
            self._run([i.op for i in self.iterator_inits], feed)
        self.input_threads.start()

    def restore(self, prefix: str, feeds: Feeds | None = None):
        """Restore a checkpoint prefix, or the latest checkpoint of a directory, after
        initializing, as a TF1 loop does (a Saver of some variables restores only those)."""
        import os

        import tensorflow as tf
        self._run(self.init_op, None)
        if os.path.isdir(prefix):
            latest = tf.train.latest_checkpoint(prefix)
            if latest is None:
                raise GraphxformError(f"{prefix}: no checkpoint in this directory")
            prefix = latest
        try:
            with self.graph.as_default():  # tf1 Saver takes its eager path outside a graph
                self.saver.restore(self.session, prefix)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot restore checkpoint {prefix}: {tf_error_line(e)}") from None
        self._run(self.local_init_op, None)
        self.start_input(feeds)

    def save(self, prefix: str) -> str:
        """Save to ``prefix``, making its directory first (a sharded Saver would not)."""
        import os

        import tensorflow as tf
        try:
            os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        except OSError as e:
            raise GraphxformError(f"cannot save checkpoint {prefix}: {e.strerror}") from None
        try:
            with self.graph.as_default():
                return self.saver.save(self.session, prefix, write_meta_graph=False)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot save checkpoint {prefix}: {tf_error_line(e)}") from None

    def step(self, feed: dict) -> StepResult:
        """Run every step once, in order, on the same feed. The fetches are read in the last
        step's ``session.run``, as a user's loop fetching them beside its train op would, but
        ``apart`` in one of their own after it (each replica would order them its own way)."""
        self._check_batch(feed)
        losses, fetched, towers = {}, {}, {}
        beside = [f for f in self.fetches if f not in self.apart]
        for index, step in enumerate(self.steps):
            extra = beside if index == len(self.steps) - 1 else []
            own = [step.loss] if step.loss else list(step.towers)
            values = self._run([step.name] + own + extra, feed)[1:]
            found = [float(np.mean(v)) for v in values[:len(own)]]
            losses[step.name] = float(np.mean(found)) if found else None
            if not step.loss:
                towers.update(zip(own, found))
            fetched.update(zip(extra, values[len(own):]))
        if self.apart:
            fetched.update(zip(self.apart, self._run(list(self.apart), feed)))
        return StepResult(losses, {f: fetched[f] for f in self.fetches}, towers)

    def _run(self, names, feed) -> list:
        import tensorflow as tf
        try:
            return self._interruptible(names, feed)
        except tf.errors.DeadlineExceededError as e:
            what = names[0] if isinstance(names, list) else getattr(names, "name", names)
            raise GraphxformError(f"running '{what}' did not finish in {self.timeout_s:g} s "
                                  "(--timeout), so TensorFlow stopped it: something it waits "
                                  "on (an input queue's dequeue, say) never came "
                                  f"({tf_error_line(e)})") from None
        except tf.errors.OpError as e:
            raise GraphxformError(_explain(e)) from None
        except (ValueError, TypeError) as e:  # a feed TF's client refuses before running
            raise GraphxformError(f"cannot feed the graph: {tf_error_line(e)}") from None

    def _interruptible(self, names, feed):
        """``session.run`` in a thread of its own while this one waits: a signal's handler
        runs only once the main thread is back in Python, which a run blocked inside TF
        never is; a wait on a thread is interrupted (a Terminated raised here, and close()
        cancels the run)."""
        box = {}

        def run():
            try:
                box["value"] = self.session.run(names, feed, options=self.run_options)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = e
        thread = threading.Thread(target=run, name="graphxform-session-run", daemon=True)
        self._in_flight = thread
        thread.start()
        thread.join()
        self._in_flight = None
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _check_batch(self, feed):
        if self.replicas <= 1:
            return
        for inp in self.analysis.inputs:
            value = feed.get(f"{inp.name}:0")
            if inp.batched and value is not None and len(value) % self.replicas:
                raise GraphxformError(f"batch of {len(value)} rows for input '{inp.name}' does "
                                      f"not divide evenly across {self.replicas} replicas")
            if (inp.sparse and inp.name.endswith("/shape") and value is not None
                    and len(value) and value[0] % self.replicas):
                raise GraphxformError(f"batch of {value[0]} rows for sparse input "
                                      f"'{inp.sparse}' does not divide evenly across "
                                      f"{self.replicas} replicas")
        for split, name, towers in self.tower_splits:
            value = feed.get(f"{name}:0")
            if value is not None and len(value) % (self.replicas * towers):
                raise GraphxformError(
                    f"batch of {len(value)} rows for input '{name}' does not divide into "
                    f"{self.replicas} replicas x {towers} towers: each replica's slice of "
                    f"{len(value) // self.replicas} rows is split into {towers} parts "
                    f"(tf.split '{split}'); feed a multiple of {self.replicas * towers} rows")

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


def _explain(error) -> str:
    """One line for a TF runtime error, naming the node."""
    from graphxform.towers import uneven_towers
    uneven = uneven_batch(str(error)) or uneven_towers(str(error))
    if uneven:
        return uneven
    return f"TensorFlow failed at {tf_error_line(error)}"


def import_meta_graph(meta, source: str | None):
    """``tf.compat.v1.train.import_meta_graph`` into the default graph, devices kept (its
    Saver, or None); a graph TF cannot import is a one-line error naming ``source``."""
    import tensorflow as tf
    try:
        return tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
    except (ValueError, KeyError, tf.errors.OpError) as e:
        raise GraphxformError(f"TensorFlow cannot import {source or 'the graph'}: "
                              f"{tf_error_line(e)}") from None
