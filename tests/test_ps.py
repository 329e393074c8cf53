"""Strategy ps: equivalence on an in-process cluster, placement, the passes, bad input."""

import json

import numpy as np
import pytest
import tensorflow as tf

from conftest import fixture_path
from graphxform import cluster, metagraph, strategies, training
from graphxform.plan import ClusterPlan
from graphxform.runtime import servers
from graphxform.errors import GraphxformError
from graphxform.passes.place_variables import balance
from graphxform.pipeline import PassContext, Pipeline

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}


@pytest.fixture
def cluster_file(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SPEC))
    return str(path)


def transform_ps(name, spec=SPEC, strategy="ps", **options):
    ir = metagraph.load(fixture_path(name))
    strategies.transform(ir, strategy, cluster=cluster.Cluster(spec), **options)
    return ir


@pytest.mark.parametrize("name, strategy, options", [
    ("mlp_sgd", "ps", []),
    ("embedding_adam", "ps", []),
    ("legacy_ref", "ps", []),
    ("mlp_sgd", "ps", ["--replicas-per-worker", 2]),
    ("mlp_sgd", "partitioned-ps", []),
    ("embedding_adam", "partitioned-ps", ["--partitions", 3, "--partition-min-bytes", 100,
                                          "--replicas-per-worker", 2]),
    ("legacy_ref", "partitioned-ps", []),
])
def test_verify_matches_single_device(run_cli, cluster_file, name, strategy, options):
    code, out, err = run_cli("verify", fixture_path(name), "--strategy", strategy, "--cluster",
                             cluster_file, *options, "--feeds", fixture_path(name, ".npz"),
                             "--steps", 5)
    assert code == 0, out + err
    assert "PASS" in out


def test_ps_graph_shape():
    ir = transform_ps("embedding_adam")
    tg = training.analyze(metagraph.load(fixture_path("embedding_adam")))
    for var in tg.variables:  # one copy of every variable, slot and optimizer state, on a ps task
        assert var in ir and not any(f"replica_{i}/{var}" in ir for i in range(2))
        assert ir.node(var)["device"].startswith("/job:ps/task:")
    assert ir.op("embedding/weights/accumulator") == "SparseConditionalAccumulator"
    assert ir.op("dense0/kernel/accumulator") == "ConditionalAccumulator"
    for var in ("embedding/weights", "dense0/kernel"):  # the accumulator lives with its variable
        assert ir.node(var + "/accumulator")["device"] == ir.node(var)["device"]
    updates = [n for n in ir.nodes() if ir.op(n) == "ResourceApplyAdam"]
    assert len(updates) == 2  # one update per dense variable per step, not one per replica
    plan = ClusterPlan.from_ir(ir)
    assert plan.chief == "worker:0" and set(plan.steps) == {"worker:0", "worker:1"}
    assert plan.steps["worker:1"] in ir and ir.op("ps_sync/worker_1/token") == "QueueDequeueV2"
    assert set(plan.losses) == {"worker:0", "worker:1"}


def test_chief_job_gets_a_step_without_replicas():
    ir = transform_ps("mlp_sgd", {**SPEC, "chief": ["127.0.0.1:2226"]})
    plan = ClusterPlan.from_ir(ir)
    assert plan.chief == "chief:0" and set(plan.steps) == {"chief:0", "worker:0", "worker:1"}
    assert not any(ir.node(n)["device"].startswith("/job:chief") for n in ir.nodes())


def test_staleness_prefills_tokens_and_async_copies_the_update():
    ir = transform_ps("mlp_sgd", staleness=2)
    assert ClusterPlan.from_ir(ir).chief_init == "ps_sync/chief_init"
    assert ir.op("dense0/kernel/accumulator/set_global_step") == "AccumulatorSetGlobalStep"
    ir = transform_ps("mlp_sgd", asynchronous=True)
    assert not any(ir.op(n) == "ConditionalAccumulator" for n in ir.nodes())
    applies = [n for n in ir.nodes() if ir.op(n) == "ResourceApplyGradientDescent"]
    assert len(applies) == 2 * 4  # each worker updates each variable itself
    assert ClusterPlan.from_ir(ir).is_async


def test_async_verify_says_why_it_cannot_match(run_cli, cluster_file):
    code, out, _ = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "ps", "--cluster",
                           cluster_file, "--async", "--feeds", fixture_path("mlp_sgd", ".npz"),
                           "--steps", 2, "--rtol", 1.0)
    assert "PASS" in out  # --rtol 1.0: the reason still stands, as a caution
    assert "may not match in general: --async" in out
    # what async ps does, not independent's reason (it said the replicas never exchange
    # gradients: they do, each worker applying its own to the shared variables)
    assert "apply their gradients to the shared variables in no fixed order" in out
    assert "as that worker read them" in out
    assert "never exchange" not in out and "--strategy independent" not in out, out


def test_async_keeps_the_apply_op_the_collection_names(run_cli, tmp_path, cluster_file):
    """TF1's minimize puts its apply op ('RMSProp') in the train_op collection beside the group
    the user adds (WGAN's step and clipping): --async copied it per worker and dropped it,
    leaving the collection naming no node (apply refused its own graph). It is kept under its
    name, running every worker's copy."""
    from conftest import export_classifier
    from test_order_races import wgan_critic
    model = export_classifier(tmp_path / "m.meta", wgan_critic)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--strategy", "ps", "--async", "--cluster", cluster_file,
                           model, "-o", out)
    assert code == 0, err
    ir = metagraph.load(str(out))
    assert list(ir.meta.collection_def["train_op"].node_list.value) == ["RMSProp", "train"]
    assert ir.op("RMSProp") == "NoOp"
    assert set(ir.control_inputs("RMSProp")) == {"ps_async/worker_0/RMSProp",
                                                 "ps_async/worker_1/RMSProp"}


@pytest.mark.parametrize("name, strategy, options", [
    ("mlp_sgd", "ps", {}),
    ("embedding_adam", "partitioned-ps", {"partitions": 3, "partition_min_bytes": 100}),
])
def test_checkpoint_from_ps_graph_restores_into_the_original(tmp_path, name, strategy, options):
    from graphxform.runtime import Feeds, Runner
    ir = metagraph.load(fixture_path(name))
    strategies.transform(ir, strategy, cluster=cluster.Cluster(SPEC), **options)
    original = metagraph.load(fixture_path(name))
    feeds = Feeds(training.analyze(original).inputs, fixture_path(name, ".npz"))
    with servers.InProcessCluster(servers.local_cluster({"ps": 2, "worker": 2})) as c:
        with Runner(ir, target=c.target("worker", 0),
                    config=servers.session_config()) as run:
            run.initialize()
            run.step(feeds.batch(0))
            saved = run.variable_values()
            prefix = run.save(str(tmp_path / "ps"))
    with Runner(original) as run:
        run.restore(prefix)
        restored = run.variable_values()
    for var, value in restored.items():
        parts = [saved[f"{var}/part_{k}"] for k in range(3) if f"{var}/part_{k}" in saved]
        np.testing.assert_array_equal(value, np.concatenate(parts) if parts else saved[var])


def test_placement_balances_unequal_variables():
    sizes = {"huge": 1000, "a": 300, "b": 300, "c": 200, "d": 100, "e": 100, "f": 50}
    for tasks in (2, 3, 4):
        placement = balance(sizes, tasks)
        load = [sum(s for n, s in sizes.items() if placement[n] == t) for t in range(tasks)]
        assert max(load) <= max(sizes.values()) + sum(sizes.values()) / tasks


def test_place_variables_keeps_slots_with_their_variable():
    ir = transform_ps("embedding_adam")
    for slot in ("embedding/weights/Adam", "embedding/weights/Adam_1"):
        assert ir.node(slot)["device"] == ir.node("embedding/weights")["device"]


def test_share_variables_refuses_a_graph_without_train_op():
    from conftest import graph_without_train_op
    from graphxform.passes.share_variables import ShareVariables
    ir = graph_without_train_op()
    ctx = PassContext(training=training.analyze(ir), devices=["/job:worker/task:0/device:CPU:0"])
    with pytest.raises(GraphxformError, match="share-variables.*no train op"):
        Pipeline([ShareVariables()]).run(ir, ctx)


def test_insert_accumulators_needs_shared_variables():
    from graphxform.passes.insert_accumulators import InsertAccumulators
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ctx = PassContext(training=training.analyze(ir), devices=["/job:worker/task:0/device:CPU:0"])
    with pytest.raises(GraphxformError, match="needs share-variables"):
        Pipeline([InsertAccumulators()]).run(ir, ctx)


@pytest.mark.parametrize("spec, message", [
    ('{"ps": [], "worker": ["127.0.0.1:1"]}', "job 'ps' has no tasks"),
    ('{"worker": ["127.0.0.1:1"]}', "needs a 'ps' job"),
    ("{oops", "not valid JSON"),
])
def test_bad_cluster_is_a_one_line_error(run_cli, tmp_path, spec, message):
    path = tmp_path / "cluster.json"
    path.write_text(spec)
    out_path = tmp_path / "out.meta"
    code, out, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "ps", "--cluster",
                             path, "-o", out_path)
    assert code != 0 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not out_path.exists()


def test_tf_config_naming_a_missing_task(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC,
                                                "task": {"type": "worker", "index": 5}}))
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "ps", "-o",
                           tmp_path / "out.meta")
    assert code != 0 and "has no task 5" in err and "Traceback" not in err


def test_ps_refuses_replicas_option(run_cli, cluster_file, tmp_path):
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "ps", "--cluster",
                           cluster_file, "--replicas", 2, "-o", tmp_path / "out.meta")
    assert code != 0 and "--replicas-per-worker" in err


def test_partition_variables_shards_variables_slots_and_lookups():
    ir = transform_ps("embedding_adam", strategy="partitioned-ps", partitions=3,
                      partition_min_bytes=100)
    assert "embedding/weights" not in ir and "embedding/weights/Adam" not in ir
    shapes = [tuple(d.size for d in ir.node(f"embedding/weights/part_{k}")["attr"]["shape"]
                    .shape.dim) for k in range(3)]
    assert shapes == [(17, 8), (17, 8), (16, 8)]  # 50 rows, uneven
    assert all(f"embedding/weights/Adam_1/part_{k}" in ir for k in range(3))
    assert "dense0/kernel" in ir  # under --partition-min-bytes: whole
    lookups = [n for n in ir.nodes() if ir.op(n) == "ResourceGather"]
    assert lookups and all("/part_" in ir.inputs(n)[0][0] for n in lookups)
    assert any(ir.op(n) == "DynamicStitch" for n in ir.nodes())
    for k in range(3):  # each shard has its own accumulator, on the shard's ps task
        acc = f"embedding/weights/part_{k}/accumulator"
        assert ir.op(acc) == "SparseConditionalAccumulator"
        assert ir.node(acc)["device"] == ir.node(f"embedding/weights/part_{k}")["device"]


def test_partition_variables_nothing_to_do_more_partitions_than_rows_and_zero(run_cli,
                                                                             cluster_file,
                                                                             tmp_path):
    from graphxform.passes.partition_variables import PartitionVariables
    ir = metagraph.load(fixture_path("mlp_sgd"))
    ctx = PassContext(training=training.analyze(ir))
    assert not PartitionVariables(partitions=1).run(ir, ctx).modified
    assert not PartitionVariables(partitions=2, min_bytes=1 << 30).run(ir, ctx).modified
    with pytest.raises(GraphxformError, match="--partitions must be at least 1, not 0"):
        PartitionVariables(partitions=0).run(ir, ctx)
    out_path = tmp_path / "out.meta"  # more partitions than rows: one shard per row
    code, out, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "partitioned-ps",
                             "--cluster", cluster_file, "--partitions", 99, "-o", out_path)
    assert code == 0, err
    ir = metagraph.load(str(out_path))
    assert [f"dense1/bias/part_{k}" in ir for k in range(4)] == [True, True, True, False]
    assert f"dense0/kernel/part_{7}" in ir and f"dense0/kernel/part_{8}" not in ir
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "partitioned-ps",
                           "--cluster", cluster_file, "--partitions", 0, "-o", tmp_path / "z")
    assert code != 0 and "--partitions" in err and "Traceback" not in err


def test_placement_on_a_graph_with_very_unequal_variables():
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        sizes = {"huge": (4, 5000), "big": (4, 800), "mid": (4, 300), "small": (4, 20),
                 "tiny": (4, 1)}
        total = 0.0
        for name, shape in sizes.items():
            w = tf1.get_variable(name, shape, use_resource=True)
            total += tf.reduce_mean(tf.matmul(x, w))
        loss = tf.identity(total, name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        tf1.add_to_collection("train_op", train)
        ir = metagraph.from_metagraph(tf1.train.export_meta_graph(graph=g))
    ps_tasks = 3
    spec = {"ps": [f"127.0.0.1:{2300 + i}" for i in range(ps_tasks)], "worker": SPEC["worker"]}
    strategies.transform(ir, "ps", cluster=cluster.Cluster(spec))
    nbytes = {name: 4 * rows * cols for name, (rows, cols) in sizes.items()}
    load = {}
    for name, size in nbytes.items():
        load[ir.node(name)["device"]] = load.get(ir.node(name)["device"], 0) + size
    assert len(load) == ps_tasks
    assert max(load.values()) <= max(nbytes.values()) + sum(nbytes.values()) / ps_tasks


def test_worker_gpus(run_cli, cluster_file, tmp_path):
    out_path = tmp_path / "gpu.meta"
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "ps", "--cluster",
                           cluster_file, "--replicas-per-worker", 2, "--worker-device", "GPU",
                           "-o", out_path)
    assert code == 0, err
    ir = metagraph.load(str(out_path))
    assert ir.node("replica_3/dense0/MatMul")["device"] == "/job:worker/task:1/device:GPU:1"


def averaged_losses(x, y):
    """The CIFAR-10 tutorial's _add_loss_summaries: moving averages of the losses, updated
    before the gradients are computed."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    from test_custom_training_code import dense
    xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=dense(dense(x, 8, "hidden", tf.nn.relu), 2, "logits")),
        name="cross_entropy")
    total = tf.add(xent, 0.01 * tf.nn.l2_loss(tf1.trainable_variables()[0]), name="total_loss")
    averages = tf1.train.ExponentialMovingAverage(0.9, name="avg").apply([xent, total])
    with tf.control_dependencies([averages]):
        optimizer = tf1.train.GradientDescentOptimizer(0.1)
        return optimizer.apply_gradients(optimizer.compute_gradients(total))


def test_a_loss_a_moving_average_reads_is_fetched_from_every_replica(tmp_path):
    """The losses' averages are updated once per step (replica 0's update alone stays), from
    the replicas' mean of what each would move them by (global-state): the whole batch's loss,
    as on one device; fetching total_loss gives every replica's too (the other replicas'
    copies of the losses once went with their updates, and it gave replica 0's)."""
    from conftest import export_classifier
    ir = metagraph.load(export_classifier(tmp_path / "m.meta", averaged_losses))
    strategies.transform(ir, "ps", cluster=cluster.Cluster(SPEC))
    for name in ("total_loss", "cross_entropy"):
        assert f"replica_1/{name}" in ir.value_sources(name), name
    assert "replica_1/avg/AssignMovingAvg/AssignSubVariableOp" not in ir  # replica 0's only
    assert "replica_1/cross_entropy" in ir.value_sources(
        "replica_0/avg/AssignMovingAvg/AssignSubVariableOp")


def test_moving_averages_of_the_losses_train_like_one_device(run_cli, tmp_path, cluster_file):
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", averaged_losses)
    for strategy in (["--strategy", "ps", "--cluster", cluster_file], ["--replicas", 2]):
        code, out, err = run_cli("verify", *strategy, model, "--feeds", model + ".npz",
                                 "--batch-size", 16, "--steps", 3)
        assert code == 0 and "PASS" in out, out + err
        assert "avg" in out


def export_pinned(path, device) -> str:
    """A classifier with an embedding, built (placeholders, variables, optimizer, a Saver) under
    ``tf.device(device)`` and exported with its devices, as ``export_meta_graph`` keeps them by
    default (clear_devices=False)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), tf.device(device):
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        ids = tf.cast(tf.abs(x[:, :2]) * 10, tf.int64) % 50
        emb = tf1.get_variable("emb", [50, 4])
        h = tf.concat([x, tf.reshape(tf.nn.embedding_lookup(emb, ids), [-1, 8])], 1)
        w = tf1.get_variable("w", [16, 2])
        loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, w))
        step = tf1.train.get_or_create_global_step()
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(0.01).minimize(
            loss, global_step=step))
        tf1.train.Saver()
        tf1.train.export_meta_graph(str(path), graph=graph, clear_devices=False)
    xs = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    np.savez(str(path) + ".npz", x=xs, y=(xs[:, 0] > 0).astype(np.int64))
    return str(path)


@pytest.mark.parametrize("strategy, device", [
    ("ps", "/device:GPU:0"),  # partitioned-ps runs the same first pass
    ("hybrid", "/job:localhost/replica:0/task:0/device:CPU:0"),
    ("allreduce", "/job:localhost/replica:0/task:0/device:CPU:0"),
])
def test_the_inputs_device_pins_are_dropped_on_a_cluster(run_cli, tmp_path, strategy, device):
    # the pins name the single machine the input was built on: kept on the nodes the strategy
    # leaves shared (variable reads, the placeholders, the Saver's constants), the cluster's
    # session failed to place them (verify: "internal error: ... Cannot assign a device")
    model = export_pinned(tmp_path / "m.meta", device)
    spec = SPEC if strategy != "allreduce" else {"worker": SPEC["worker"]}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(spec))
    code, out, err = run_cli("verify", model, "--strategy", strategy, "--cluster", path,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0, out + err
    assert "PASS" in out
    ir = metagraph.load(model)
    strategies.transform(ir, strategy, cluster=cluster.Cluster(spec))
    assert not {ir.node(n)["device"] for n in ir.nodes()} & {device, "/device:CPU:0"}


def clipped_embedding(path, clip):
    """NMT's and BERT's update: tf.gradients of an embedding lookup and a dense layer, clipped
    (tf.clip_by_global_norm over both, or tf.clip_by_norm of each), apply_gradients."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None, 3], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf.compat.v1.get_variable("emb", [10, 4])
        w = tf.compat.v1.get_variable("w", [4, 1])
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
        grads = tf.gradients(loss, [emb, w])
        if clip == "global":
            grads, _ = tf.clip_by_global_norm(grads, 1.0)
        else:
            grads = [tf.clip_by_norm(g, 1.0) for g in grads]
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients(
            zip(grads, [emb, w]))
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.train.export_meta_graph(str(path), graph=g)
    return str(path)


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps", "hybrid"])
@pytest.mark.parametrize("clip", ["global", "each"])
def test_a_norm_of_sparse_rows_is_refused_in_one_line(run_cli, tmp_path, cluster_file,
                                                      strategy, clip):
    """The accumulators sum the rows of one id, where one device's IndexedSlices has a row per
    lookup: a norm of them differs (apply exited 0, verify failed by 1.9e-03; hybrid gave a
    pass failure)."""
    model = clipped_embedding(tmp_path / "m.meta", clip)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--strategy", strategy, "--cluster", cluster_file, model,
                           "-o", out)
    assert code == 1 and not out.exists()
    assert len(err.strip().splitlines()) == 1, err
    assert "pass " not in err and "--strategy allreduce" in err


def test_allreduce_keeps_the_rows_and_the_norm(run_cli, tmp_path):
    model = clipped_embedding(tmp_path / "m.meta", "global")
    rng = np.random.RandomState(0)
    np.savez(tmp_path / "f.npz", ids=rng.randint(0, 3, (32, 3)).astype(np.int32),
             y=rng.randn(32, 1).astype(np.float32))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", tmp_path / "f.npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def embedding_adam(path, use_resource):
    """word2vec's embedding trained by tf.compat.v1.train.AdamOptimizer: apply_gradients sums
    an id's rows (its dedup) before Adam's sparse update, whose square roots are of moments."""
    g = tf.Graph()
    with g.as_default():
        ids = tf.compat.v1.placeholder(tf.int32, [None, 3], name="ids")
        y = tf.compat.v1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf.compat.v1.get_variable("emb", [10, 4], use_resource=use_resource)
        w = tf.compat.v1.get_variable("w", [4, 1], use_resource=use_resource)
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
        tf.compat.v1.add_to_collection(
            "train_op", tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss))
        tf.compat.v1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    np.savez(str(path) + ".npz", ids=rng.randint(0, 3, (32, 3)).astype(np.int32),
             y=rng.randn(32, 1).astype(np.float32))
    return str(path)


@pytest.mark.parametrize("use_resource", [False, True], ids=["ref", "resource"])
def test_adams_moments_of_summed_rows_are_no_norm_of_the_rows(run_cli, tmp_path, cluster_file,
                                                               use_resource):
    """With reference variables Adam writes its moments by ScatterAdd, which the op registry
    does not call stateful: the walk went on to the moments' Sqrt and refused the canonical
    TF1 embedding + Adam under ps as 'a norm of them'."""
    model = embedding_adam(tmp_path / "m.meta", use_resource)
    code, out, err = run_cli("verify", "--strategy", "ps", "--cluster", cluster_file, model,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def rnn_by_tf_gradients(path):
    """tensorflow/nmt's update: an RNN in a tf.while_loop (control flow v2), tf.gradients of
    the loss, apply_gradients. tf.gradients colocates the gradient loop's function body with
    the forward loop."""
    g = tf.Graph()
    with g.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf.compat.v1.placeholder(tf.float32, [None, 5, 3], name="x")
        kernel = tf.compat.v1.get_variable("rnn/kernel", [7, 4])
        weights = tf.identity(kernel)  # read once, as an RNN cell's kernel: a StatelessWhile
        steps = tf.transpose(x, [1, 0, 2])

        def body(t, h):
            return t + 1, tf.tanh(tf.matmul(tf.concat([steps[t], h], 1), weights))
        _, h = tf.compat.v1.while_loop(lambda t, h: t < 5, body,
                                       [tf.constant(0), tf.zeros([tf.shape(x)[0], 4])])
        loss = tf.reduce_mean(tf.square(h), name="loss")
        grads = tf.gradients(loss, [kernel])
        train = tf.compat.v1.train.GradientDescentOptimizer(0.1).apply_gradients(
            zip(grads, [kernel]))
        tf.compat.v1.add_to_collection("train_op", train)
        tf.compat.v1.train.export_meta_graph(str(path), graph=g)
    np.savez(str(path) + ".npz", x=np.random.RandomState(0).randn(32, 5, 3).astype(np.float32))
    return str(path)


def test_a_gradient_loop_colocated_with_its_forward_loop_runs_on_every_worker(
        run_cli, tmp_path, cluster_file):
    """Each worker's gradient loop was pinned beside replica 0's forward loop: TF refused the
    graph ("Cannot colocate nodes ... incompatible tasks") after apply exited 0."""
    model = rnn_by_tf_gradients(tmp_path / "m.meta")
    code, out, err = run_cli("verify", model, "--strategy", "ps", "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def legacy_scan(path):
    """A TF1-era RNN by tf.scan under legacy control flow: the TensorArray it writes each
    step's state into is sized by the (constant) number of steps, so it reads no batch."""
    from conftest import export_classifier
    tf1 = tf.compat.v1
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()

    def build(x, y):
        steps = tf.transpose(tf.reshape(x, [-1, 4, 2]), [1, 0, 2])
        w = tf1.get_variable("rnn/w", [2, 2], initializer=tf1.glorot_uniform_initializer())
        states = tf.scan(lambda h, s: tf.tanh(tf.matmul(s, w) + h), steps,
                         initializer=tf.zeros_like(steps[0]))
        logits = tf.matmul(states[-1], tf1.get_variable("dense/kernel", [2, 2]))
        loss = tf.reduce_mean(tf1.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    try:
        return export_classifier(path, build)
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_a_scans_tensor_arrays_are_each_workers_own(run_cli, tmp_path, cluster_file, strategy):
    """tf.scan's output TensorArray stayed one for every worker (it reads no batch), and each
    worker's writes were colocated with it: TF refused the graph ("Cannot colocate nodes ...
    incompatible tasks") after apply exited 0."""
    model = legacy_scan(tmp_path / "m.meta")
    code, out, err = run_cli("verify", model, "--strategy", strategy, "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def popart_ref(path):
    """PopArt's preserving of outputs with TF1 ref variables: the output layer is rescaled by
    ``assign`` to the new statistics, and the forward pass and the update run under
    control_dependencies on that (here statistics that read no batch)."""
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def build(x, y):
        def var(name, shape, init=None):
            return tf1.get_variable(name, shape, initializer=init, use_resource=False)
        h = tf.nn.relu(tf.matmul(x, var("body/w", [8, 8])))
        w, b = var("head/w", [8, 1]), var("head/b", [1], tf1.zeros_initializer())
        mu = tf1.get_variable("popart/mu", [], initializer=tf1.zeros_initializer(),
                              trainable=False, use_resource=False)
        sigma, new_mu, new_sigma = tf.constant(1.0), 0.9 * mu + 0.5, tf.constant(2.0)
        rescale = [w.assign(w * sigma / new_sigma),
                   b.assign((sigma * b + mu - new_mu) / new_sigma)]
        with tf.control_dependencies(rescale):
            stats = [mu.assign(new_mu)]
        with tf.control_dependencies(stats):
            out = tf.squeeze(tf.matmul(h, w) + b, 1)
            loss = tf.reduce_mean(tf.square((tf.cast(y, tf.float32) - mu) / new_sigma - out))
            return tf1.train.GradientDescentOptimizer(0.05).minimize(loss)
    return export_classifier(path, build)


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_a_ref_variable_read_after_its_write_sees_the_write_on_every_worker(
        run_cli, tmp_path, cluster_file, strategy):
    """The workers' forward pass read 'head/w/read' on the ps task, sent whenever it ran:
    before the step's rescaling assign, where one device's snapshot aliases the variable and
    sees it (verify failed by 4e-01; apply exited 0)."""
    model = popart_ref(tmp_path / "m.meta")
    code, out, err = run_cli("verify", model, "--strategy", strategy, "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


@pytest.mark.parametrize("strategy, train_op", [("ps", "actor"), ("partitioned-ps", "group")])
def test_chained_optimizers_update_each_stage_once_after_its_gradients(
        run_cli, tmp_path, cluster_file, strategy, train_op):
    """Spinning Up's actor-critic step: the actor's loss is built under a control dependency on
    the critic's update. Its forward pass was taken for part of the once-per-step update, and
    apply refused it ("'q_1/concat' runs once per step ... reads 'pi/Tanh:0'"); each stage's
    forward and backward pass is per replica now, and its update runs once on its aggregated
    gradients. Such a step runs with one client only: a worker's own step would run the
    critic's update too."""
    from test_allreduce import chained_actor_critic
    model = chained_actor_critic(tmp_path / "ac.meta", train_op)
    code, out, err = run_cli("verify", model, "--strategy", strategy, "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
    out_path = str(tmp_path / "out.meta")
    code, _, err = run_cli("apply", model, "--strategy", strategy, "--cluster", cluster_file,
                           "-o", out_path)
    assert code == 0, err
    code, _, err = run_cli("run", out_path, "--cluster", cluster_file, "--job", "worker",
                           "--task", 0)
    assert code == 1 and "one client only" in err and "chains its optimizers" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_step_chained_only_through_its_loss_runs_the_first_optimizers_applies(
        run_cli, tmp_path, cluster_file):
    """The actor's loss is built under control_dependencies([critic_train]), its minimize
    outside: the critic's takes are upstream of the actor's applies only, not of the update,
    and a take does not depend on the applies it waits for. The step ran the actor's applies
    and not the critic's: apply exited 0 and every run hung on the critic's takes."""
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def build(x, y):
        def dense(h, units, name):
            return tf.matmul(h, tf1.get_variable(name, [h.shape[1], units]))
        value = tf.squeeze(dense(tf.nn.relu(dense(x, 16, "critic/w0")), 1, "critic/w1"), 1)
        critic_loss = tf.reduce_mean(tf.square(tf.cast(y, tf.float32) - value))
        critic = tf1.train.AdamOptimizer(1e-2).minimize(critic_loss, name="critic_train")
        with tf.control_dependencies([critic]):
            logits = dense(tf.nn.relu(dense(x, 16, "actor/w0")), 2, "actor/w1")
            actor_loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
            actor_loss, var_list=tf1.trainable_variables("actor/"), name="actor_train")

    model = export_classifier(tmp_path / "m.meta", build)
    out_path = str(tmp_path / "out.meta")
    code, _, err = run_cli("apply", model, "--strategy", "ps", "--cluster", cluster_file,
                           "-o", out_path)
    assert code == 0, err
    ir = metagraph.load(out_path)
    waits = set(ir.control_inputs("actor_train"))
    assert {"critic/w0/accumulator/apply_worker_0", "critic/w0/accumulator/apply_worker_1",
            "actor/w0/accumulator/apply_worker_1"} <= waits, sorted(waits)
    code, out, err = run_cli("verify", model, "--strategy", "ps", "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_a_polyak_update_after_the_step_reads_the_updated_ref_variables(
        run_cli, tmp_path, cluster_file):
    """Spinning Up's SAC with TF1 ref variables: the target network's polyak update runs under
    control_dependencies([train_value_op]) and reads 'v/w/read', which on one device aliases
    the variable and sees the update. The chief's copy of it was sent before the update
    (verify failed by 9e-02; apply exited 0)."""
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def build(x, y):
        def dense(h, units, name):
            return tf.matmul(h, tf1.get_variable(name, [h.shape[1], units], use_resource=False))
        with tf1.variable_scope("pi"):
            action = tf.tanh(dense(tf.nn.relu(dense(x, 16, "w0")), 2, "w1"))
        with tf1.variable_scope("q"):
            q_pi = dense(tf.nn.relu(dense(tf.concat([x, action], 1), 16, "w0")), 1, "w1")
        values = {}
        for scope in ("v", "target_v"):
            with tf1.variable_scope(scope):
                values[scope] = dense(tf.nn.relu(dense(x, 16, "w0")), 1, "w1")
        reward = tf.cast(y, tf.float32)[:, None]
        pi_loss = -tf.reduce_mean(q_pi)
        value_loss = tf.reduce_mean(tf.square(tf.stop_gradient(q_pi) - values["v"])) + \
            tf.reduce_mean(tf.square(reward + 0.9 * tf.stop_gradient(values["target_v"]) - q_pi))
        train_pi = tf1.train.AdamOptimizer(1e-2).minimize(
            pi_loss, var_list=tf1.trainable_variables("pi/"))
        with tf.control_dependencies([train_pi]):
            train_value = tf1.train.AdamOptimizer(1e-2).minimize(
                value_loss, var_list=tf1.trainable_variables("q/") + tf1.trainable_variables("v/"))
        with tf.control_dependencies([train_value]):
            target = tf.group([tf1.assign(t, 0.5 * t + 0.5 * v) for v, t in
                               zip(tf1.global_variables("v/"), tf1.global_variables("target_v/"))])
        return tf.group(pi_loss, value_loss, train_pi, train_value, target)

    model = export_classifier(tmp_path / "sac.meta", build)
    code, out, err = run_cli("verify", model, "--strategy", "ps", "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_verify_under_ps_says_which_strategy_has_the_options_it_names(run_cli, tmp_path,
                                                                      cluster_file):
    """tf_keras Dropout and BatchNormalization called with training=True under ps: verify's
    reasons recommended --sync-batch-norm and --consistent-random, which ps refuses."""
    import tf_keras
    from conftest import export_classifier

    def build(x, y):
        h = tf_keras.layers.BatchNormalization()(tf_keras.layers.Dense(8)(x), training=True)
        h = tf_keras.layers.Dropout(0.3)(h, training=True)
        loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(
            y, tf_keras.layers.Dense(2)(h), from_logits=True))
        return tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    model = export_classifier(tmp_path / "m.meta", build)
    code, out, err = run_cli("verify", model, "--strategy", "ps", "--cluster", cluster_file,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 2)
    assert code == 1 and "FAIL" in out, out + err
    assert "--sync-batch-norm (--strategy allreduce) uses the global batch's" in out, out
    assert "--consistent-random (--strategy allreduce) gives" in out, out
