"""Training throughput of the graph `apply --strategy allreduce` emits, against the original
single-device graph and tf.distribute.MirroredStrategy, on the same model and CPU devices.

Two models (``--model``), each at one global batch for every contender, plain SGD at lr 0.01:

- ``cnn`` (default), the tf_cnn_benchmarks case: 32x32x3 images, three 3x3 ReLU convolutions
  (C, 2C, 4C filters, the last two with stride 2; C = 32 by default), global average pooling and a
  10-way softmax; 0.1M parameters against about 60 MFLOP per example, so compute dominates.
- ``bncnn``: the ``cnn`` with a training-mode batch norm (fused, moving averages updated each
  step) after each convolution instead of its bias. The emitted graph is measured twice: plain
  (each replica normalises its own slice) and ``--sync-batch-norm`` ("emitted_sync": global
  statistics, 3 collectives per batch norm per step), against MirroredStrategy with tf_keras
  ``SyncBatchNormalization``, the peer's way to the same exactness.
- ``mlp``: 784-H-H-10 (ReLU, softmax cross-entropy; H = 1024 by default), 1.9M parameters against
  11 MFLOP per example: the all-reduce and the per-replica weight updates weigh far more here.

The contenders:

- original: the single-device TF1 training graph (exported MetaGraph), run in a tf.compat.v1
  Session, one ``session.run(train_op, feed_dict)`` per step, the whole batch on one device.
- emitted: that MetaGraph after ``strategies.transform(..., devices=/device:CPU:0..N-1)`` and
  ``metagraph.save``, driven exactly like the original (``import_meta_graph``, the train op from
  the "train_op" collection, feeds by the original names "x:0"/"y:0"); each replica gets
  batch/N rows and the gradients are all-reduced by collectives.
- mirrored: the same layers as a tf_keras model under ``tf.distribute.MirroredStrategy`` over N
  logical CPU devices, a custom training loop (``strategy.run`` inside one ``tf.function`` per
  step, SGD at the same rate, loss averaged over the global batch), input from a distributed
  ``tf.data`` pipeline.

Every contender runs in its own fresh Python subprocess (TF1 sessions and TF2 eager state do not
share a process well; the logical-device split has to happen before TF initialises) with the
same ``--inter-op``/``--intra-op`` thread counts and a session or context that has N CPU devices.
Each does ``--warmup`` untimed steps, then ``--repeats`` timed windows of ``--steps`` steps; the
figure is the best window (steps/s), the median is printed too. Budgets: emitted/original >=
0.9 and emitted/mirrored > 1.0.

Usage: python tools/bench_runtime.py [--model cnn|mlp] [--devices 4] [--batch 256] [--steps 30]
Always exits 0 (a failing contender or missed budget is reported, not raised).

``--strategies`` adds more emitted graphs on the same devices (replicated:SPEC, independent,
model-average); ``--all`` runs every strategy in one go: those (replicated pscpu, xring and
pscpu:32k:xring) beside original, allreduce and mirrored, then every cluster strategy below,
each table with its ratio against the baseline (original here, mwms on the cluster).

``--cluster``: 2 worker processes x 2 replicas on this machine (127.0.0.1), the same model and
global batch, in one run:

- allreduce: ``apply --strategy allreduce --cluster`` (2 workers, ``--replicas-per-worker 2``),
  each worker process running its task's part (graphxform.runtime.task.TaskRunner, as
  ``graphxform run --cluster`` does); ``allreduce_hierarchical`` the same with
  ``--hierarchical``;
- ps: ``apply --strategy ps`` on 1 ps task and 2 workers x 2 replicas, the ps task a server of
  its own process; partitioned_ps the same with every variable in 2 shards;
- hybrid: ``apply --strategy hybrid`` on that cluster, the classifier (the last dense layer's
  kernel and bias) on the ps by placement file (these models have no embedding, whose sparse
  gradients would go there by themselves), the rest all-reduced across the 4 replicas;
- model_average: ``apply --strategy model-average`` on that cluster (centres on the ps task,
  ``--interval 1``: a round every step);
- mwms: the tf_keras model under ``tf.distribute.MultiWorkerMirroredStrategy`` in 2 worker
  processes (TF_CONFIG), the custom loop of ``mirrored``. On CPUs it mirrors one replica per
  worker (it spreads a worker's replicas over GPUs only), so it runs 2 x 1 replicas.

Every process gets ``--inter-op``/``--intra-op`` threads (its server's pools for ours); the
figure is the chief's steps/s (every worker runs the same steps in lockstep). The contenders take
turns for ``--rounds`` rounds (the order reversed every other round), and each keeps its best
window over all of them, so a slow minute of a shared machine does not land on one contender.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FEATURES, CLASSES = 784, 10
IMAGE = (32, 32, 3)
ORIGINAL_BUDGET = 0.9   # emitted / original, at least
MIRRORED_BUDGET = 1.0   # emitted / mirrored, more than
RESULT_TAG = "BENCH_RUNTIME_RESULT "


# ------------------------------------------------------------------ subprocess side

def _input_shape(model: str) -> tuple:
    return (FEATURES,) if model == "mlp" else IMAGE


def _data(model: str, batch: int, seed: int = 0):
    import numpy as np
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, *_input_shape(model))).astype(np.float32)
    y = rng.integers(0, CLASSES, batch).astype(np.int64)
    return x, y


def _time_windows(step, warmup: int, steps: int, repeats: int, sync=lambda: None):
    for _ in range(warmup):
        step()
    sync()
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        rates.append(steps / (time.perf_counter() - t0))
    return rates


def build_graph(path: str, opts: dict) -> None:
    """The single-device TF1 training graph, exported with devices cleared."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, *_input_shape(opts["model"])], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        if opts["model"] == "mlp":
            h = _mlp_layers(v1, tf, x, opts["hidden"])
        else:
            h = _cnn_layers(v1, tf, x, opts["width"], batch_norm=opts["model"] == "bncnn")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h)
        loss = tf.identity(tf.reduce_mean(xent), name="loss")
        v1.add_to_collection(v1.GraphKeys.LOSSES, loss)
        global_step = v1.train.get_or_create_global_step()
        optimizer = v1.train.GradientDescentOptimizer(opts["lr"])
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss, global_step=global_step)
        if train_op not in v1.get_collection(v1.GraphKeys.TRAIN_OP):
            v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)
        v1.train.export_meta_graph(filename=path, graph=g, clear_devices=True)


def _variable(v1, name, shape, initializer):
    return v1.get_variable(name, shape, use_resource=True, initializer=initializer)


def _mlp_layers(v1, tf, x, hidden):
    h, n_in = x, FEATURES
    for i, n_out in enumerate([hidden, hidden, CLASSES]):
        with v1.variable_scope(f"dense{i}"):
            kernel = _variable(v1, "kernel", [n_in, n_out], v1.glorot_uniform_initializer())
            bias = _variable(v1, "bias", [n_out], v1.zeros_initializer())
            h = tf.matmul(h, kernel) + bias
            if i < 2:
                h = tf.nn.relu(h)
        n_in = n_out
    return h


def _cnn_layers(v1, tf, x, width, batch_norm=False):
    """What tf_keras Conv2D(padding="same") x3, GlobalAveragePooling2D, Dense compute; with
    ``batch_norm``, a fused training-mode batch norm replaces each conv's bias (moving
    averages updated through the UPDATE_OPS collection, as tf_slim and tf_keras do)."""
    h, n_in = x, IMAGE[2]
    for i, (n_out, stride) in enumerate(_conv_plan(width)):
        with v1.variable_scope(f"conv{i}"):
            kernel = _variable(v1, "kernel", [3, 3, n_in, n_out], v1.glorot_uniform_initializer())
            h = tf.nn.conv2d(h, kernel, [1, stride, stride, 1], "SAME")
            if batch_norm:
                h = _batch_norm(v1, tf, h, n_out)
            else:
                h = h + _variable(v1, "bias", [n_out], v1.zeros_initializer())
            h = tf.nn.relu(h)
        n_in = n_out
    h = tf.reduce_mean(h, axis=[1, 2])
    with v1.variable_scope("dense"):
        kernel = _variable(v1, "kernel", [n_in, CLASSES], v1.glorot_uniform_initializer())
        bias = _variable(v1, "bias", [CLASSES], v1.zeros_initializer())
        return tf.matmul(h, kernel) + bias


def _batch_norm(v1, tf, h, channels):
    gamma = _variable(v1, "gamma", [channels], v1.ones_initializer())
    beta = _variable(v1, "beta", [channels], v1.zeros_initializer())
    moving = [v1.get_variable(name, [channels], use_resource=True, trainable=False,
                              initializer=init)
              for name, init in (("moving_mean", v1.zeros_initializer()),
                                 ("moving_variance", v1.ones_initializer()))]
    y, mean, variance = v1.nn.fused_batch_norm(h, gamma, beta, epsilon=1e-3, is_training=True)
    for var, value in zip(moving, (mean, variance)):
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, var.assign_sub((var - value) * 0.01))
    return y


def _conv_plan(width: int) -> list[tuple[int, int]]:
    return [(width, 1), (2 * width, 2), (4 * width, 2)]


def run_session(path: str, opts: dict) -> dict:
    """Drive a MetaGraph the way a user's TF1 script would: original names only."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    x, y = _data(opts["model"], opts["batch"])
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(path)
        init = tf1.global_variables_initializer()
        train_op = tf1.get_collection("train_op")[0]
    config = tf1.ConfigProto(device_count={"CPU": opts["devices"]},
                             inter_op_parallelism_threads=opts["inter_op"],
                             intra_op_parallelism_threads=opts["intra_op"])
    with tf1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        feed = {"x:0": x, "y:0": y}
        first = float(sess.run("loss:0", feed))
        rates = _time_windows(lambda: sess.run(train_op, feed), opts["warmup"], opts["steps"],
                              opts["repeats"])
        last = float(sess.run("loss:0", feed))
        devices = sorted({op.device for op in graph.get_operations() if op.device})
    return {"rates": rates, "loss_first": first, "loss_last": last,
            "devices_used": len(devices)}


def run_mirrored(opts: dict) -> dict:
    import tensorflow as tf
    n = opts["devices"]
    tf.config.threading.set_inter_op_parallelism_threads(opts["inter_op"])
    tf.config.threading.set_intra_op_parallelism_threads(opts["intra_op"])
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    import tf_keras
    logical = [d.name for d in tf.config.list_logical_devices("CPU")]
    strategy = tf.distribute.MirroredStrategy(devices=logical[:n])
    # the same fixed global batch every step, like the feed_dict of the session contenders
    result = _keras_steps(tf, tf_keras, strategy, opts,
                          lambda dataset: dataset.prefetch(tf.data.AUTOTUNE))
    cross = type(strategy.extended._cross_device_ops).__name__ \
        if getattr(strategy.extended, "_cross_device_ops", None) else "?"
    return {**result, "cross_device_ops": cross}


def _keras_layers(tf_keras, opts: dict) -> list:
    layers = tf_keras.layers
    if opts["model"] == "bncnn":
        blocks = []
        for n, stride in _conv_plan(opts["width"]):
            blocks += [layers.Conv2D(n, 3, strides=stride, padding="same", use_bias=False),
                       layers.experimental.SyncBatchNormalization(epsilon=1e-3, momentum=0.99),
                       layers.ReLU()]
        return [tf_keras.Input(IMAGE), *blocks, layers.GlobalAveragePooling2D(),
                layers.Dense(CLASSES)]
    if opts["model"] == "cnn":
        convs = [layers.Conv2D(n, 3, strides=stride, padding="same", activation="relu")
                 for n, stride in _conv_plan(opts["width"])]
        return [tf_keras.Input(IMAGE), *convs, layers.GlobalAveragePooling2D(),
                layers.Dense(CLASSES)]
    hidden = [layers.Dense(opts["hidden"], activation="relu") for _ in range(2)]
    return [tf_keras.Input((FEATURES,)), *hidden, layers.Dense(CLASSES)]


# ------------------------------------------------------------------ --cluster, subprocess side

def run_cluster_task(opts: dict) -> dict:
    """One task of a graphxform cluster graph: its part of each step, as `run --cluster`."""
    from graphxform import metagraph
    from graphxform.cluster import Cluster
    from graphxform.runtime.task import TaskRunner
    runner = TaskRunner(metagraph.load(opts["path"]), Cluster(opts["cluster"]), opts["job"],
                        opts["task"], timeout_s=opts["task_timeout"],
                        threads=(opts["inter_op"], opts["intra_op"]))
    runner.prepare()
    x, y = _data(opts["model"], opts["batch"])
    feed = {"x:0": x, "y:0": y}
    first = runner.step(feed)[0]
    rates = _time_windows(lambda: runner.step(feed), opts["warmup"], opts["steps"],
                          opts["repeats"])
    last = runner.step(feed)[0]
    runner.finish()
    return {"rates": rates, "loss_first": first, "loss_last": last,
            "devices_used": opts["replicas_per_worker"] * len(opts["cluster"]["worker"])}


def run_ps_server(opts: dict) -> None:
    """A ps task's server, until the parent kills this process."""
    from graphxform.cluster import Cluster
    from graphxform.runtime import servers
    servers.start_server(Cluster(opts["cluster"]), "ps", opts["task"],
                         threads=(opts["inter_op"], opts["intra_op"]))
    print(RESULT_TAG + json.dumps({"serving": True}), flush=True)
    time.sleep(opts["task_timeout"] * 10)


def run_mwms(opts: dict) -> dict:
    """The tf_keras model under MultiWorkerMirroredStrategy, this process being one worker."""
    os.environ["TF_CONFIG"] = json.dumps({"cluster": opts["cluster"], "task": {
        "type": "worker", "index": opts["task"]}})
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(opts["inter_op"])
    tf.config.threading.set_intra_op_parallelism_threads(opts["intra_op"])
    import tf_keras
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    options = tf.data.Options()  # every worker reads the same fixed global batch, as ours do
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return _keras_steps(tf, tf_keras, strategy, opts,
                        lambda dataset: dataset.with_options(options))


def _keras_steps(tf, tf_keras, strategy, opts: dict, finish_dataset) -> dict:
    """The tf_keras model trained under ``strategy`` with a custom loop on the fixed global
    batch (``finish_dataset`` adds the strategy's own dataset settings); steps/s per window."""
    batch = opts["batch"]
    x, y = _data(opts["model"], batch)
    with strategy.scope():
        model = tf_keras.Sequential(_keras_layers(tf_keras, opts))
        optimizer = tf_keras.optimizers.SGD(opts["lr"])
    dataset = finish_dataset(tf.data.Dataset.from_tensors((x, y)).repeat().unbatch().batch(
        batch, drop_remainder=True))
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb, logits=logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(it):
        xb, yb = next(it)
        per_replica = strategy.run(step_fn, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    state = {}

    def step():
        state["loss"] = train_step(iterator)

    first = float(train_step(iterator))
    rates = _time_windows(step, opts["warmup"], opts["steps"], opts["repeats"],
                          sync=lambda: state["loss"].numpy())
    return {"rates": rates, "loss_first": first, "loss_last": float(state["loss"]),
            "devices_used": strategy.num_replicas_in_sync}


def worker(kind: str, opts: dict) -> None:
    if kind == "ps_server":
        run_ps_server(opts)
        return
    if kind == "build":
        build_graph(opts["path"], opts)
        result = {"path": opts["path"]}
    elif kind == "original" or kind.startswith("emitted"):
        result = run_session(opts["path"], opts)
    elif kind == "mirrored":
        result = run_mirrored(opts)
    elif kind == "cluster_task":
        result = run_cluster_task(opts)
    elif kind == "mwms":
        result = run_mwms(opts)
    else:
        raise ValueError(kind)
    print(RESULT_TAG + json.dumps(result), flush=True)
    if kind in ("cluster_task", "mwms"):  # a gRPC server's teardown takes seconds; skip it
        sys.stdout.flush()
        os._exit(0)


# ------------------------------------------------------------------ parent side

def spawn(kind: str, opts: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", kind, json.dumps(opts)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{tail}")


# ------------------------------------------------------------------ --cluster, parent side
# contender: (strategy, whether the cluster has a ps task, options); mwms is TF's own
CLUSTER_GRAPHS = {
    "allreduce": ("allreduce", False, {}),
    "allreduce_hierarchical": ("allreduce", False, {"hierarchical": True}),
    "ps": ("ps", True, {}),
    "partitioned_ps": ("partitioned-ps", True, {"partitions": 2}),
    "hybrid": ("hybrid", True, {}),
    "model_average": ("model-average", True, {}),  # --interval 1: a round every step
}
CLUSTER_CONTENDERS = (*CLUSTER_GRAPHS, "mwms")
LOCAL_EXTRAS = "replicated:pscpu,replicated:xring,replicated:pscpu:32k:xring,independent," \
               "model-average"  # what --all adds to the default local contenders


def spawn_cluster(kind: str, opts: dict, jobs: dict, timeout: float) -> dict:
    """One process per task of ``jobs`` ({"ps": 1, "worker": 2}) on free 127.0.0.1 ports; the
    chief's (worker 0's) result. Every process is killed, with its group, at the end; each
    writes to a file of its own, so a failure shows the tail of the task that failed first."""
    import signal
    import tempfile
    from graphxform.runtime import servers
    spec = servers.local_cluster(jobs).as_dict()
    procs, logs = {}, {}
    try:
        for job, count in sorted(jobs.items()):  # ps first
            for task in range(count):
                task_kind = "ps_server" if job == "ps" else kind
                cmd = [sys.executable, os.path.abspath(__file__), "--_worker", task_kind,
                       json.dumps(dict(opts, cluster=spec, job=job, task=task))]
                logs[(job, task)] = tempfile.TemporaryFile("w+")
                procs[(job, task)] = subprocess.Popen(
                    cmd, stdout=logs[(job, task)], stderr=subprocess.STDOUT, text=True,
                    start_new_session=True)
        procs[("worker", 0)].wait(timeout=timeout)
        for key, proc in procs.items():
            if key[0] == "worker":
                proc.wait(timeout=60)
    finally:
        for proc in procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
    outputs = {}
    for key, log in logs.items():
        log.seek(0)
        outputs[key] = log.read()
        log.close()
    for line in reversed(outputs[("worker", 0)].splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    failed = [k for k, p in procs.items() if k[0] == "worker" and p.returncode not in (0, -9)]
    others = [k for k in failed if k != ("worker", 0)]  # the chief's error only names them
    job, task = (others or [("worker", 0)])[0]
    tail = "\n".join(outputs[(job, task)].strip().splitlines()[-15:])
    raise RuntimeError(f"{kind}: {job} {task} failed:\n{tail}")


def classifier(opts: dict) -> list[str]:
    """The last dense layer's variables: what hybrid puts on the ps here."""
    layer = "dense2" if opts["model"] == "mlp" else "dense"
    return [f"{layer}/kernel", f"{layer}/bias"]


def cluster_main(args, opts: dict, original: str, only=None) -> dict:
    """Build the cluster graphs from ``original``, run every contender (``only``, else
    --only), print the figures."""
    from graphxform import metagraph, strategies
    from graphxform.cluster import Cluster
    from graphxform.passes.worker_steps import replica_devices
    workers = Cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    with_ps = Cluster({"ps": ["127.0.0.1:3"], "worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    stem = original[: -len(".meta")]
    only = only or [k.strip() for k in (args.only or ",".join(CLUSTER_CONTENDERS)).split(",")
                    if k.strip()]
    paths = {}
    for kind in [k for k in only if k in CLUSTER_GRAPHS]:
        strategy, has_ps, options = CLUSTER_GRAPHS[kind]
        cluster = with_ps if has_ps else workers
        if strategy == "hybrid":
            options = {"placement": dict.fromkeys(classifier(opts), "ps")}
        ir = metagraph.load(original)
        devices = cluster.worker_devices(2) if has_ps else replica_devices(cluster, 2)
        strategies.transform(ir, strategy, devices=devices, cluster=cluster, **options)
        paths[kind] = f"{stem}.{kind}-2x2.meta"
        metagraph.save(ir, paths[kind])
    print("cluster: 2 worker processes x 2 replicas on 127.0.0.1 (ps, partitioned_ps, hybrid, "
          "model_average: and 1 ps task; mwms: 1 replica per worker on CPUs); steps/s of the "
          f"chief; {args.rounds} round(s)")
    results = {}
    for round_index in range(args.rounds):
        for kind in (only if round_index % 2 == 0 else only[::-1]):
            has_ps = CLUSTER_GRAPHS.get(kind, ("", False))[1]
            jobs = {"ps": 1, "worker": 2} if has_ps else {"worker": 2}
            task_opts = dict(opts, path=paths.get(kind), replicas_per_worker=2,
                             task_timeout=120.0)
            try:
                res = spawn_cluster("mwms" if kind == "mwms" else "cluster_task", task_opts,
                                    jobs, args.timeout)
            except Exception as e:  # noqa: BLE001 - reported; the tool always exits 0
                print(f"{kind}: FAILED: {e}")
                continue
            print(f"round {round_index + 1} {kind:22s} windows "
                  f"{', '.join(f'{r:.2f}' for r in res['rates'])} steps/s  "
                  f"{res['devices_used']} replicas  loss {res['loss_first']:.3f} -> "
                  f"{res['loss_last']:.3f}")
            kept = results.setdefault(kind, dict(res, rates=[]))
            kept["rates"] += res["rates"]
    print()
    for res in results.values():
        res["best"] = max(res["rates"])
        res["median"] = statistics.median(res["rates"])
    print_table(results, "mwms")
    print()
    ratios = {}
    for ours in ("allreduce", "allreduce_hierarchical"):
        for other in ("ps", "mwms"):
            if ours in results and other in results:
                best = results[ours]["best"] / results[other]["best"]
                median = results[ours]["median"] / results[other]["median"]
                ratios[f"{ours}/{other}"] = {"best": best, "median": median}
                print(f"{ours} / {other} = {best:.2f}x best, {median:.2f}x median")
    return {"results": results, "ratios": ratios}


def print_table(results: dict, baseline: str) -> None:
    """Every contender's best and median steps/s side by side, with both against
    ``baseline``'s."""
    base = results.get(baseline)
    width = max(map(len, [*results, "contender"]))
    print(f"{'contender':{width}s} {'best':>8s} {'median':>8s}   / {baseline} (best, median)")
    for kind, res in results.items():
        ratio = (f"{res['best'] / base['best']:.2f}x, {res['median'] / base['median']:.2f}x"
                 if base else "-")
        print(f"{kind:{width}s} {res['best']:8.2f} {res['median']:8.2f}   {ratio}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("cnn", "bncnn", "mlp"), default="cnn")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices = replicas")
    parser.add_argument("--batch", type=int, default=256, help="global batch, all contenders")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    parser.add_argument("--width", type=int, default=32, help="CNN filters in the first conv")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="all-reduce bucket size for the emitted graph (default: apply's)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows (best is kept)")
    parser.add_argument("--inter-op", type=int, default=2,
                        help="inter_op_parallelism_threads for every contender")
    parser.add_argument("--intra-op", type=int, default=2,
                        help="intra_op_parallelism_threads for every contender")
    parser.add_argument("--out-dir", default=os.path.expanduser("~/.cache/graphxform-bench"),
                        help="where the original and emitted .meta files go")
    parser.add_argument("--only", default=None,
                        help="comma-separated subset of contenders to run (default: original, "
                        "emitted, mirrored; and emitted_sync for bncnn)")
    parser.add_argument("--strategies", default="",
                        help="more emitted graphs to run beside allreduce's, comma-separated: "
                        "replicated:SPEC (e.g. replicated:pscpu, replicated:xring) or "
                        "independent (the no-exchange ceiling)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--cluster: rounds of every contender in turn (best window kept)")
    parser.add_argument("--cluster", action="store_true",
                        help="2 worker processes x 2 replicas on 127.0.0.1: allreduce (flat, "
                        "hierarchical), ps, partitioned-ps, hybrid and model-average against "
                        "MultiWorkerMirroredStrategy (--only picks from "
                        f"{','.join(CLUSTER_CONTENDERS)})")
    parser.add_argument("--all", action="store_true",
                        help="every strategy in one run: the local contenders with --strategies "
                        f"{LOCAL_EXTRAS}, then every --cluster contender")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.all:
        args.strategies = ",".join(x for x in (args.strategies, LOCAL_EXTRAS) if x)

    if args.batch % args.devices:
        print(f"--batch {args.batch} does not divide across {args.devices} devices")
        return 0
    start = time.perf_counter()
    opts = {k: getattr(args, k) for k in ("model", "devices", "batch", "hidden", "width", "lr",
                                          "warmup", "steps", "repeats", "inter_op", "intra_op")}
    os.makedirs(args.out_dir, exist_ok=True)
    size = args.hidden if args.model == "mlp" else args.width
    stem = os.path.join(args.out_dir, f"runtime-{args.model}{size}")
    original, emitted = stem + ".meta", stem + f".allreduce{args.devices}.meta"
    emitted_sync = stem + f".allreduce{args.devices}-syncbn.meta"
    bn = args.model == "bncnn"
    only = args.only or ("original,emitted,emitted_sync,mirrored" if bn
                         else "original,emitted,mirrored")
    what = (f"MLP {FEATURES}-{args.hidden}-{args.hidden}-{CLASSES}" if args.model == "mlp" else
            f"CNN 32x32x3, convs {'-'.join(str(n) for n, _ in _conv_plan(args.width))}"
            + (" with batch norm" if bn else ""))
    print(f"bench_runtime: {what}, SGD lr "
          f"{args.lr}, global batch {args.batch}, {args.devices} CPU devices, threads inter_op "
          f"{args.inter_op} intra_op {args.intra_op}, {os.cpu_count()} CPU cores; "
          f"{args.warmup} warm-up steps, best of {args.repeats} windows of {args.steps} steps")
    try:
        spawn("build", dict(opts, path=original), args.timeout)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        if args.cluster:
            figures = cluster_main(args, opts, original)
            print(f"total benchmark time {time.perf_counter() - start:.0f} s")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"options": opts, **figures}, f, indent=1)
            return 0
        from graphxform import metagraph, strategies
        t0 = time.perf_counter()
        ir = metagraph.load(original)
        options = {} if args.bucket_bytes is None else {"bucket_bytes": args.bucket_bytes}
        devices = [f"/device:CPU:{i}" for i in range(args.devices)]
        strategies.transform(ir, "allreduce", devices=devices, **options)
        metagraph.save(ir, emitted)
        more_graphs = {}
        for label in [x.strip() for x in args.strategies.split(",") if x.strip()]:
            strategy, _, spec = label.partition(":")
            graph = metagraph.load(original)
            strategies.transform(graph, strategy, devices=devices,
                                 **({"all_reduce_spec": spec} if spec else {}))
            more_graphs["emitted_" + label.replace(":", "_")] = path = (
                stem + f".{label.replace(':', '_')}{args.devices}.meta")
            metagraph.save(graph, path)
        if bn:
            synced = metagraph.load(original)
            strategies.transform(synced, "allreduce", devices=devices, sync_batch_norm=True,
                                 **options)
            metagraph.save(synced, emitted_sync)
        print(f"original {original} ({len(metagraph.load(original))} nodes); emitted {emitted} "
              f"({len(ir)} nodes, transformed in {time.perf_counter() - t0:.2f} s)")
    except Exception as e:  # noqa: BLE001 - reported; the tool always exits 0
        print(f"cannot prepare the graphs: {type(e).__name__}: {e}")
        return 0

    results = {}
    for kind in [k.strip() for k in only.split(",") if k.strip()] + list(more_graphs):
        path = {"original": original, "emitted": emitted, "emitted_sync": emitted_sync,
                **more_graphs}.get(kind)
        try:
            res = spawn(kind, dict(opts, path=path), args.timeout)
        except Exception as e:  # noqa: BLE001
            print(f"{kind}: FAILED: {e}")
            continue
        res["best"] = max(res["rates"])
        res["median"] = statistics.median(res["rates"])
        results[kind] = res
        extra = f", cross-device ops {res['cross_device_ops']}" if "cross_device_ops" in res else ""
        print(f"{kind:12s} {res['best']:8.2f} steps/s best ({res['median']:.2f} median; windows "
              f"{', '.join(f'{r:.2f}' for r in res['rates'])})  "
              f"{res['best'] * args.batch:8.0f} examples/s  loss {res['loss_first']:.3f} -> "
              f"{res['loss_last']:.3f}{extra}")

    print()
    print_table(results, "original")
    print()
    verdicts = {}
    if "emitted_sync" in results:
        for other in ("emitted", "mirrored"):
            if other in results:
                ratio = results["emitted_sync"]["best"] / results[other]["best"]
                verdicts[f"emitted_sync/{other}"] = {"ratio": ratio}
                print(f"emitted_sync / {other:8s} = {ratio:.2f}x"
                      + ("  (the cost of --sync-batch-norm)" if other == "emitted" else
                         "  (against SyncBatchNormalization under MirroredStrategy)"))
    if "emitted" in results and not bn:
        for other, budget, strict in (("original", ORIGINAL_BUDGET, False),
                                      ("mirrored", MIRRORED_BUDGET, True)):
            if other not in results:
                continue
            ratio = results["emitted"]["best"] / results[other]["best"]
            ok = ratio > budget if strict else ratio >= budget
            verdicts[other] = {"ratio": ratio, "ok": ok}
            print(f"emitted / {other:8s} = {ratio:.2f}x  (budget {'>' if strict else '>='} "
                  f"{budget}x: {'within budget' if ok else 'OVER budget'})")
    cluster = {}
    if args.all:
        print()
        cluster = cluster_main(args, opts, original, only=list(CLUSTER_CONTENDERS))
    elapsed = time.perf_counter() - start
    print(f"total benchmark time {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"options": opts, "results": results, "ratios": verdicts,
                       "cluster": cluster, "elapsed_s": elapsed}, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_worker"]:
        worker(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    try:
        main()
    except Exception:  # noqa: BLE001 - the tool always exits 0 (usage errors keep their code)
        traceback.print_exc()
    sys.exit(0)
