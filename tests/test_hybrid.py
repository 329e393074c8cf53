"""hybrid (Parallax): dense-gradient variables all-reduced per replica, sparse-gradient ones on
the ps tasks behind sparse accumulators. The corpus's exact recipes and the embedding fixture,
transformed for 2 ps + 2 workers (and 1 worker x 2 replicas), match the single-device graph
for 3 steps within 1e-5 with one client; wide & deep launched one process per task (1 ps, 2
workers x 2 replicas on 127.0.0.1) matches it too; the borderline options decide as
documented. With --partitions, the ps side's large variables are split into shards spread over
the ps tasks, each behind its own accumulator: still exact with one client and per task, and
checkpoints stay whole under the original names."""

import json
import os
import re

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import pytest  # noqa: E402
from conftest import fixture_path  # noqa: E402
from recipe_loop import load_manifest, recipe_meta  # noqa: E402

from processes import assert_launched_tasks_gone, in_threads  # noqa: E402
from test_multiworker import assert_close  # noqa: E402

from graphxform import cluster, equivalence, metagraph, strategies, training  # noqa: E402
from graphxform.errors import GraphxformError  # noqa: E402
from graphxform.passes.hybrid import decide  # noqa: E402
from graphxform.plan import ClusterPlan  # noqa: E402
from graphxform.runtime import servers  # noqa: E402
from graphxform.runtime.local import Feeds, Runner  # noqa: E402
from graphxform.runtime.task import TaskRunner  # noqa: E402

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
ONE_WORKER = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224"]}
MANIFEST = load_manifest()
EXACT = sorted(name for name, entry in MANIFEST.items() if entry["exact"])
EMBEDDING = os.path.join(os.path.dirname(__file__), "fixtures", "embedding_adam.meta")


def transform(meta, spec=SPEC, devices=None, train_op=None, **options):
    ir = metagraph.load(meta)
    pipeline = strategies.transform(ir, "hybrid", cluster=cluster.Cluster(spec),
                                    devices=devices, train_op=train_op, **options)
    return ir, pipeline


def assert_matches(meta, entry=None, **kwargs):
    entry = entry or {}
    ir, _ = transform(meta, train_op=entry.get("train_ops"), **kwargs)
    report = equivalence.compare(metagraph.load(meta), ir, meta.replace(".meta", ".npz"),
                                 steps=3, batch_size=entry.get("batch_size", 8), rtol=1e-5,
                                 train_op=entry.get("train_ops"))
    assert report.ok, equivalence.format_report(report)
    return ir


def decisions(pipeline):
    return next(t for t in pipeline.timings if t.name == "choose-placement").summary


@pytest.mark.parametrize("name", EXACT)
def test_exact_recipe_matches_single_device(name):
    assert_matches(recipe_meta(name), MANIFEST[name])


def test_embedding_on_ps_dense_all_reduced_one_worker_two_replicas():
    devices = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:1"]
    ir = assert_matches(EMBEDDING, spec=ONE_WORKER, devices=devices)
    assert "embedding/weights" in ir and "replica_0/embedding/weights" not in ir
    assert ir.node("embedding/weights")["device"].startswith("/job:ps/")
    assert "replica_1/dense0/kernel" in ir  # the original name stays as a fetchable view


def test_decisions_are_reported_and_overridable():
    _, pipeline = transform(EMBEDDING)
    said = decisions(pipeline)
    assert said["embedding/weights"] == "ps (sparse gradient)"
    assert said["dense0/kernel"] == "allreduce (dense gradient)"
    ir, pipeline = transform(EMBEDDING, sparse_as_dense_below=1 << 30)
    assert decisions(pipeline)["embedding/weights"].startswith("allreduce (sparse gradient")
    assert "replica_1/embedding/weights" in ir
    _, pipeline = transform(EMBEDDING, placement={"dense0/kernel": "ps"})
    assert decisions(pipeline)["dense0/kernel"] == "ps (placement file)"


def test_bad_placement_file_entries_are_refused():
    tg = training.analyze(metagraph.load(EMBEDDING))
    with pytest.raises(GraphxformError, match="no trainable variable"):
        decide(tg.trainable, overrides={"nope": "ps"})
    with pytest.raises(GraphxformError, match="expected one of"):
        decide(tg.trainable, overrides={"dense0/kernel": "gpu"})


def test_each_task_runs_its_own_replicas_and_a_barrier_orders_the_update():
    ir, _ = transform(EMBEDDING, devices=cluster.Cluster(SPEC).worker_devices(2))
    plan = ClusterPlan.from_ir(ir)
    assert plan.collective_leader == "/job:worker/replica:0/task:0"
    assert plan.device_filters == {"worker:0": [], "worker:1": ["/job:ps", "/job:worker/task:1"]}
    for task, mine in (("worker:0", {"replica_0", "replica_1"}),
                       ("worker:1", {"replica_2", "replica_3"})):
        ran = {n.split("/")[0] for n in ir.ancestors(plan.steps[task]) if n.startswith("replica_")}
        assert ran == mine
        # the step ends in a collective over the tasks, once the rest of it is done
        scope = f"hybrid_sync/{task.replace(':', '_')}/"
        assert ir.control_inputs(plan.steps[task]) == [scope + "end"]
        assert ir.op(scope + "end") == "CollectiveReduceV2"
        assert scope + "done" in ir.control_inputs(scope + "end")
    # Adam's beta powers move once all replicas' dense updates ran: through the barrier
    assert "hybrid_sync/all_done" in ir.control_inputs("Adam/update")
    assert not [c for c in ir.control_inputs("Adam/update") if c.startswith("replica_")]
    assert {"hybrid_sync/worker_0/done", "hybrid_sync/worker_1/done"} <= set(
        ir.control_inputs("Adam"))  # one client still runs every replica


def test_per_task_runs_are_refused_in_one_line_when_nothing_is_on_the_ps():
    ir, _ = transform(EMBEDDING, placement={"embedding/weights": "allreduce"})
    with pytest.raises(GraphxformError, match="runs with one client only.*every variable is "
                                              "all-reduced"):
        ClusterPlan.from_ir(ir).require_per_task()


@pytest.mark.slow
def test_launched_per_task_trains_like_one_device(run_cli, tmp_path):
    """wide & deep (FTRL and Adagrad on embeddings, dense layers) for 1 ps + 2 workers x 2
    replicas, one process per task: each step's mean loss over workers and the chief's
    checkpoint match the single-device graph."""
    meta, entry, steps = recipe_meta("wide_deep"), MANIFEST["wide_deep"], 3
    feeds = meta.replace(".meta", ".npz")
    original = metagraph.load(meta)
    source = Feeds(training.analyze(original).inputs, feeds, entry["batch_size"])
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        losses = [run.step(source.batch(k)).loss for k in range(steps)]
        values = run.variable_values()
    spec = servers.local_cluster({"ps": 1, "worker": 2})
    ir, _ = transform(meta, spec=spec.as_dict(), devices=spec.worker_devices(2))
    out_meta = str(tmp_path / "wide_deep.hybrid.meta")
    metagraph.save(ir, out_meta)
    save = tmp_path / "ckpt" / "model"
    code, out, err = run_cli("launch", out_meta, "--steps", steps, "--feeds", feeds,
                             "--batch-size", entry["batch_size"], "--restore", start,
                             "--save", save, "--timeout", 60)
    assert code == 0, out + err
    assert_close([float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)], losses)
    with Runner(metagraph.load(meta)) as run:
        run.restore(f"{save}-{steps}")
        for name, value in run.variable_values().items():
            assert_close(value, values[name])
    assert_launched_tasks_gone(out)


def test_cli_apply_prints_each_decision_and_verify_passes(run_cli, tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223"]}')
    placement = tmp_path / "placement.json"
    placement.write_text('{"dense0/bias": "ps"}')
    code, out, err = run_cli("apply", fixture_path("embedding_adam"), "--strategy", "hybrid",
                             "--cluster", spec, "--placement-file", placement,
                             "-o", tmp_path / "out.meta")
    assert code == 0, err
    assert "embedding/weights: ps (sparse gradient)" in out
    assert "dense0/kernel: allreduce (dense gradient)" in out
    assert "dense0/bias: ps" in out
    code, out, err = run_cli("verify", fixture_path("embedding_adam"), "--strategy", "hybrid",
                             "--cluster", spec, "--feeds", fixture_path("embedding_adam", ".npz"),
                             "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_cli_hybrid_options_refused_elsewhere(run_cli, tmp_path):
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", 2,
                           "--sparse-as-dense-below", 100, "-o", tmp_path / "out.meta")
    assert code != 0


WIDE_DEEP_PS_SIDE = ("dnn/input_layer/tags_embedding/embedding_weights",
                     "linear/linear_model/tags/weights")


def partition_summary(pipeline):
    return next(t for t in pipeline.timings if t.name == "partition-variables").summary


def test_partitioned_ps_side_matches_single_device_with_shards_on_each_ps_task():
    name = "wide_deep"
    ir = assert_matches(recipe_meta(name), MANIFEST[name], partitions=2, partition_min_bytes=0)
    for var in WIDE_DEEP_PS_SIDE:
        assert var not in ir or ir.op(var) not in ("VarHandleOp", "VariableV2")
        shards = [f"{var}/part_{k}" for k in range(2)]
        assert f"{var}/part_2" not in ir
        assert {ir.node(s)["device"] for s in shards} == {"/job:ps/task:0/device:CPU:0",
                                                         "/job:ps/task:1/device:CPU:0"}
        for shard in shards:  # each shard behind its own sparse accumulator, on its task
            assert ir.op(shard + "/accumulator") == "SparseConditionalAccumulator"
            assert ir.node(shard + "/accumulator")["device"] == ir.node(shard)["device"]
    # the dense side is untouched: replicated, never split
    assert "replica_1/dnn/hiddenlayer_0/kernel" in ir
    assert not [n for n in ir.nodes() if "/part_" in n and n.startswith("dnn/hiddenlayer")]


def test_more_partitions_than_ps_tasks_and_replicas_per_worker():
    ir = assert_matches(EMBEDDING, devices=cluster.Cluster(SPEC).worker_devices(2),
                        partitions=3, partition_min_bytes=100)
    shapes = [tuple(d.size for d in ir.node(f"embedding/weights/part_{k}")["attr"]["shape"]
                    .shape.dim) for k in range(3)]
    assert shapes == [(17, 8), (17, 8), (16, 8)]
    assert "replica_3/dense0/kernel" in ir and "dense0/kernel/part_0" not in ir


def test_partitioning_decisions_default_and_nothing_to_do():
    _, pipeline = transform(EMBEDDING, partitions=2, partition_min_bytes=0)
    assert partition_summary(pipeline)["partitioned_into"] == {"embedding/weights": 2}
    ir, pipeline = transform(EMBEDDING)  # the default keeps a 1600-byte embedding whole
    said = partition_summary(pipeline)
    assert not said["partitioned_into"]
    assert said["kept_whole"] == {"embedding/weights": "1600 B < --partition-min-bytes 262144"}
    assert ir.op("embedding/weights") == "VarHandleOp"
    ir, pipeline = transform(EMBEDDING, partitions=1, partition_min_bytes=0)
    assert not [t for t in pipeline.timings if t.name == "partition-variables"][0].modified
    assert "embedding/weights/part_0" not in ir
    with pytest.raises(GraphxformError, match="--partitions must be at least 1, not 0"):
        transform(EMBEDDING, partitions=0)


def test_per_task_runs_and_checkpoints_both_ways_with_shards(tmp_path):
    """wide & deep partitioned over 2 ps tasks, 2 workers x 2 replicas each running its own step
    in its own session: the single-device checkpoint restores into it, 3 steps match one
    device, and its checkpoint restores into the single-device graph with the same values."""
    meta, entry, steps = recipe_meta("wide_deep"), MANIFEST["wide_deep"], 3
    original = metagraph.load(meta)
    batches = Feeds(training.analyze(original).inputs, meta.replace(".meta", ".npz"),
                    entry["batch_size"])
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        initial = run.variable_values()
        losses = [run.step(batches.batch(k)).loss for k in range(steps)]
        values = run.variable_values()
    found = servers.local_cluster({"ps": 2, "worker": 2})
    ir, _ = transform(meta, spec=found.as_dict(), devices=found.worker_devices(2),
                      partitions=2, partition_min_bytes=0)
    leader = ClusterPlan.from_ir(ir).collective_leader
    with servers.InProcessCluster(found, cpus={"worker": 2},
                                  collective_leader=leader) as running:
        runners = [TaskRunner(ir, found, "worker", w, timeout_s=30,
                              target=running.target("worker", w)) for w in range(2)]
        try:
            chief = runners[0]
            in_threads(lambda r: r.prepare(restore=start if r.chief else None), runners)
            restored = chief.session.run({v.op.name: v for v in chief.variables})
            for var in WIDE_DEEP_PS_SIDE:  # the single-device values, sliced into the shards
                assert_close(list(restored[f"{var}/part_0"].ravel()) +
                             list(restored[f"{var}/part_1"].ravel()),
                             list(initial[var].ravel()))
            got = in_threads(lambda r: [r.step(batches.batch(k))[0] for k in range(steps)],
                             runners)
            assert_close([sum(pair) / 2 for pair in zip(*got)], losses)
            saved = chief.save(str(tmp_path / "hybrid" / "model"))
        finally:
            for r in runners:
                r.close()
    with Runner(metagraph.load(meta)) as run:
        run.restore(saved)
        for name, value in run.variable_values().items():
            assert_close(value, values[name])


def test_cli_partitions_apply_prints_shards_then_verify_check_and_cost(run_cli, tmp_path):
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(SPEC))
    model, out_meta = fixture_path("embedding_adam"), tmp_path / "out.meta"
    code, out, err = run_cli("apply", model, "--strategy", "hybrid", "--cluster", spec,
                             "--partitions", 2, "--partition-min-bytes", 0, "-o", out_meta)
    assert code == 0, err
    assert "embedding/weights: ps (sparse gradient), partitioned into 2" in out
    assert "dense0/kernel: allreduce (dense gradient)\n" in out
    code, out, err = run_cli("verify", model, "--strategy", "hybrid", "--cluster", spec,
                             "--partitions", 2, "--partition-min-bytes", 0,
                             "--feeds", fixture_path("embedding_adam", ".npz"), "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
    code, out, err = run_cli("check", out_meta)
    assert code == 0 and "0 error(s)" in out, out + err
    code, out, err = run_cli("cost", model, "--strategy", "hybrid", "--cluster", spec,
                             "--partitions", 2, "--partition-min-bytes", 0, "--json")
    assert code == 0, err
    tasks = {row["name"]: row for row in json.loads(out)["tasks"]}
    for ps in ("ps:0", "ps:1"):  # each holds a shard: gets its part of the rows, as it should
        assert tasks[ps]["minimum_received"] > 0 and tasks[ps]["ratio"] < 1.5, tasks[ps]
    code, out, err = run_cli("apply", model, "--strategy", "hybrid", "--cluster", spec,
                             "-o", tmp_path / "whole.meta")
    assert code == 0, err
    assert ("embedding/weights: ps (sparse gradient), whole (1600 B < --partition-min-bytes "
            "262144)") in out


def text_cnn_update(path):
    """dennybritz/cnn-text-classification-tf's update, reduced: an embedding (ps side), an
    output layer with an L2 penalty in the loss (all-reduced), Adam with a global_step.
    tf.gradients gates the penalty's constant gradient with a tuple that stays single."""
    import numpy as np
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.int32, [None, 4], name="x")
        y = tf1.placeholder(tf.float32, [None], name="y")
        emb = tf1.get_variable("W", [30, 3], initializer=tf1.glorot_uniform_initializer(seed=1))
        out = tf1.get_variable("Wo", [3, 1], initializer=tf1.glorot_uniform_initializer(seed=3))
        h = tf.reduce_sum(tf.nn.embedding_lookup(emb, x), 1)
        loss = tf.reduce_mean(tf.square(tf.squeeze(tf.matmul(h, out), 1) - y))
        loss = tf.identity(loss + 0.1 * tf.nn.l2_loss(out), name="loss")
        tf1.train.AdamOptimizer(1e-2).minimize(loss,
                                               global_step=tf1.train.get_or_create_global_step())
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    np.savez(str(path).replace(".meta", ".npz"), x=rng.randint(0, 30, (64, 4)).astype(np.int32),
             y=rng.randn(64).astype(np.float32))
    return str(path)


def test_a_penalty_gated_by_a_single_gradient_tuple_does_not_deadlock(tmp_path):
    """The barrier routed that tuple's wait on every replica's gradient through the queue
    every replica's update fills: each replica's gradient waited on every update, and verify
    hung until the collectives timed out."""
    assert_matches(text_cnn_update(tmp_path / "m.meta"))


def keras_batch_norm(path) -> str:
    """tf_keras as its guide writes a batch-normalised classifier, compiled in a TF1 graph: the
    layer runs under ``tf.cond`` on the learning-phase placeholder (control flow v2), whose
    training branch updates the moving statistics. Keras' own training function feeds that
    placeholder True; the .npz does too."""
    import numpy as np
    import tensorflow as tf
    import tf_keras
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf_keras.Input(shape=(8,), name="x")
        h = tf_keras.layers.BatchNormalization()(tf_keras.layers.Dense(16)(x))
        model = tf_keras.Model(x, tf_keras.layers.Dense(3, name="out")(tf.nn.relu(h)))
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model._make_train_function()
        tf.compat.v1.add_to_collection("train_op", model.train_function.updates_op)
        tf.compat.v1.train.export_meta_graph(str(path), graph=graph)
    xs = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    np.savez(str(path) + ".npz", x=xs, out_target=(xs[:, :1] > 0).astype(np.float32),
             keras_learning_phase=np.array(True))
    return str(path)


@pytest.mark.parametrize("strategy", ["hybrid", "allreduce"])
def test_a_keras_batch_norm_in_a_cond_runs_on_every_worker(run_cli, tmp_path, strategy):
    """The cond's branch colocates its moving-average update with 'AssignMovingAvg/<var>', a
    name only the branch knows: TF took it for one group across both workers' calls and
    refused the graph ("Cannot colocate nodes ... incompatible tasks") after apply exited 0.
    With --sync-batch-norm (allreduce) it trains like one device; under hybrid, verify runs and
    names batch norm."""
    model = keras_batch_norm(tmp_path / "m.meta")
    ports = servers.free_ports(3)
    jobs = {"worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
    options = ["--sync-batch-norm"]
    if strategy == "hybrid":
        jobs["ps"], options = [f"127.0.0.1:{ports[0]}"], []
    code, out, err = run_cli("verify", model, "--strategy", strategy, *options, "--cluster",
                             servers.write_cluster(str(tmp_path / "c.json"), jobs), "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert "Cannot colocate" not in err and ("PASS" in out) == (strategy == "allreduce"), out + err
    assert strategy == "allreduce" or "batch norm in training mode" in out, out
