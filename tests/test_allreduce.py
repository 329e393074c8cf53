"""Strategy allreduce end to end: equivalence with the single-device graph, the drop-in
contract, bucketing, and bad input."""

import os

import numpy as np
import pytest
from conftest import fixture_path, graph_without_train_op

from graphxform import equivalence, metagraph, strategies, training
from graphxform.errors import GraphxformError

MATCHABLE = ["mlp_sgd", "cnn_momentum", "embedding_adam", "legacy_ref", "rnn_while",
             "rnn_while_legacy", "mlp_saver"]


def transformed(name, replicas, **options):
    ir = metagraph.load(fixture_path(name))
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(replicas)],
                         **options)
    return ir


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", MATCHABLE)
def test_trains_like_the_single_device_graph(name, replicas):
    report = equivalence.compare(metagraph.load(fixture_path(name)), transformed(name, replicas),
                                 fixture_path(name, ".npz"), steps=5, batch_size=16)
    assert report.reasons == []
    assert report.ok, equivalence.format_report(report)
    assert {d.name for d in report.variables} >= {"global_step"}
    assert all(d.replica_spread == 0.0 for d in report.variables)
    first_loss = report.losses[0]
    assert first_loss[0] == pytest.approx(first_loss[1], rel=1e-6)


def test_sparse_as_dense_trains_the_same():
    report = equivalence.compare(metagraph.load(fixture_path("embedding_adam")),
                                 transformed("embedding_adam", 2, sparse_as_dense=True),
                                 fixture_path("embedding_adam", ".npz"), steps=5, batch_size=16)
    assert report.ok, equivalence.format_report(report)


def embedding_with(path, optimizer: str) -> str:
    """An embedding bag and a dense layer trained by a TF1 optimizer with a sparse update."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [None, 3], name="ids")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        emb = tf1.get_variable("emb", [20, 4], initializer=tf1.glorot_uniform_initializer(seed=1))
        w = tf1.get_variable("w", [4, 1], initializer=tf1.glorot_uniform_initializer(seed=2))
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), 1)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w) - y))
        make = {"momentum": lambda: tf1.train.MomentumOptimizer(0.1, 0.9),
                "rmsprop": lambda: tf1.train.RMSPropOptimizer(0.01),
                "adagrad": lambda: tf1.train.AdagradOptimizer(0.1)}[optimizer]
        tf1.add_to_collection("train_op", make().minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    np.savez(str(path) + ".npz", ids=rng.randint(0, 20, (32, 3)).astype(np.int32),
             y=rng.randn(32, 1).astype(np.float32))
    return str(path)


@pytest.mark.parametrize("optimizer", ["momentum", "rmsprop"])
def test_sparse_as_dense_refuses_an_update_of_the_given_rows_only(run_cli, tmp_path, optimizer):
    """Momentum's sparse update leaves the rows the batch did not look up alone; given their
    zero gradients it keeps moving them (apply exited 0, verify failed by 1e-01)."""
    model = embedding_with(tmp_path / "m.meta", optimizer)
    code, _, err = run_cli("apply", "--replicas", 2, "--sparse-as-dense", model,
                           "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "--sparse-as-dense: variable 'emb'" in err
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)  # gathered: exact
    assert code == 0 and "PASS" in out, out + err


def test_sparse_as_dense_keeps_adagrad(run_cli, tmp_path):
    model = embedding_with(tmp_path / "m.meta", "adagrad")
    code, out, err = run_cli("verify", "--replicas", 2, "--sparse-as-dense", model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_sparse_gradient_is_gathered_not_densified():
    ir = transformed("embedding_adam", 2)
    ops = [ir.op(n) for n in ir.nodes() if n.startswith("allreduce/sparse_0/replica_0/")]
    assert ops.count("CollectiveGatherV2") == 3  # row counts, values, indices
    assert "UnsortedSegmentSum" not in ops


def unique_ids_graph():
    """An embedding looked up through the distinct ids of the batch (as feature columns'
    embedding_lookup_sparse does): its gradient has one row per distinct id, so two slices of
    a batch give gradients of different lengths."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(1)
        ids = v1.placeholder(tf.int64, [None, 3], name="ids")
        y = v1.placeholder(tf.float32, [None], name="y")
        table = v1.get_variable("table", [20, 4])
        distinct, position = tf.unique(tf.reshape(ids, [-1]))
        rows = tf.gather(tf.gather(table, distinct), position)
        pred = tf.reduce_sum(tf.reshape(rows, [-1, 12]), axis=1)
        loss = tf.reduce_mean(tf.square(pred - y), name="loss")
        step = v1.train.get_or_create_global_step()
        v1.train.AdagradOptimizer(0.5).minimize(loss, global_step=step)
        meta = v1.train.export_meta_graph(graph=g)
    return metagraph.from_metagraph(meta)


def test_sparse_gradients_of_different_lengths_are_gathered_exactly(tmp_path):
    ids = np.array([[1, 1, 1], [1, 2, 1], [3, 4, 5], [1, 1, 1], [0, 0, 0], [9, 9, 9],
                    [10, 11, 12], [13, 14, 15],  # step 2: other lengths than step 1
                    [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 2, 4], [6, 8, 10],
                    [12, 14, 16], [18, 19, 17]], dtype=np.int64)
    assert len(np.unique(ids[:4])) != len(np.unique(ids[4:8]))  # slices differ in distinct ids
    feeds = tmp_path / "feeds.npz"
    np.savez(feeds, ids=ids, y=np.linspace(-1, 1, len(ids)).astype(np.float32))
    for replicas in (2, 4):
        ir = unique_ids_graph()
        strategies.transform(ir, "allreduce",
                             devices=[f"/device:CPU:{i}" for i in range(replicas)])
        report = equivalence.compare(unique_ids_graph(), ir, str(feeds), steps=3, batch_size=8)
        assert report.ok, equivalence.format_report(report)


def test_batch_norm_says_why_it_cannot_match():
    report = equivalence.compare(metagraph.load(fixture_path("cnn_bn_momentum")),
                                 transformed("cnn_bn_momentum", 2),
                                 fixture_path("cnn_bn_momentum", ".npz"), steps=2, batch_size=16)
    assert any("batch norm" in r and "bn0/moving_mean" in r for r in report.reasons)


def collectives_per_replica(ir):
    return sum(1 for n in ir.nodes() if n.startswith("allreduce/") and "/replica_0/" in n
               and ir.op(n).startswith("Collective"))


@pytest.mark.parametrize("name", ["mlp_sgd", "cnn_momentum"])
def test_bucketing_fuses_gradients(name):
    ir = metagraph.load(fixture_path(name))
    pipeline = strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    summary = {k: v for t in pipeline.timings for k, v in t.summary.items()}
    assert summary["buckets"] == 1
    assert collectives_per_replica(ir) <= summary["buckets"]
    small = metagraph.load(fixture_path(name))
    pipeline = strategies.transform(small, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"],
                                    bucket_bytes=64)
    buckets = {k: v for t in pipeline.timings for k, v in t.summary.items()}["buckets"]
    assert buckets > 1 and collectives_per_replica(small) == buckets


def run_steps(path, feeds, steps, restore=None, save=None):
    """Drive the emitted file the way a user's TF1 script would, by original names only."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        saver = tf1.train.import_meta_graph(path)
        init = tf1.global_variables_initializer()
        step_var = tf1.train.get_global_step()
        cpus = 4
        with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": cpus})) as sess:
            if restore:
                saver.restore(sess, restore)
            else:
                sess.run(init)
            start = sess.run(step_var)
            losses = []
            for k in range(steps):
                rows = slice(16 * k, 16 * (k + 1))
                loss, _ = sess.run(["loss:0", "GradientDescent"],
                                   {"x:0": feeds["x"][rows], "y:0": feeds["y"][rows]})
                losses.append(loss)
                assert sess.run(step_var) == start + k + 1
            values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
            if save:
                saver.save(sess, save)
    return losses, values


def test_drop_in_contract(tmp_path):
    feeds = np.load(fixture_path("mlp_sgd", ".npz"))
    out = str(tmp_path / "mlp.allreduce.meta")
    metagraph.save(transformed("mlp_sgd", 2), out)
    # a checkpoint of the single-device graph restores into the transformed one ...
    original_losses, _ = run_steps(fixture_path("mlp_sgd"), feeds, 2,
                                   save=str(tmp_path / "orig"))
    losses, values = run_steps(out, feeds, 2, restore=str(tmp_path / "orig"),
                               save=str(tmp_path / "dist"))
    for i in range(2):
        np.testing.assert_array_equal(values[f"replica_{i}/dense0/kernel"],
                                      values["replica_0/dense0/kernel"])
    # ... and the reverse, keyed by the original names and full shapes
    import tensorflow as tf
    reader = tf.train.load_checkpoint(str(tmp_path / "dist"))
    shapes = reader.get_variable_to_shape_map()
    assert shapes["dense0/kernel"] == [8, 16] and "replica_0/dense0/kernel" not in shapes
    back_losses, back_values = run_steps(fixture_path("mlp_sgd"), feeds, 1,
                                         restore=str(tmp_path / "dist"))
    assert back_values["global_step"] == 5
    assert len(losses) == 2 and np.isfinite(losses).all() and np.isfinite(back_losses).all()
    assert original_losses[0] > 0


def saver_graph(make_saver, partitioner=None, export_saver_def=True):
    """A dense softmax model trained with Adam whose Saver ``make_saver()`` builds, as a user
    hands graphxform a graph exported with its own Saver's saver_def (None: no Saver);
    ``partitioner``: the kernel is a partitioned variable, as large embeddings are;
    ``export_saver_def=False``: exported by ``tf.compat.v1.train.export_meta_graph`` alone,
    which leaves the Saver's nodes in the graph but names none of them."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        w = tf1.get_variable("dense/kernel", [8, 3], partitioner=partitioner)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, tf.convert_to_tensor(w)))
        step = tf1.train.get_or_create_global_step()
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(0.01).minimize(loss, step))
        saver = make_saver() if make_saver else None
        saver_def = saver.as_saver_def() if saver and export_saver_def else None
        meta = tf1.train.export_meta_graph(graph=g, saver_def=saver_def)
    return metagraph.from_metagraph(meta)


SAVERS = {  # the Saver a user made: checkpoint keys it writes
    "dict": (lambda: __import__("tensorflow").compat.v1.train.Saver(
        {"model/weights": _var("dense/kernel"), "step": _var("global_step")}),
        {"model/weights", "step"}),
    "subset": (lambda: __import__("tensorflow").compat.v1.train.Saver([_var("dense/kernel")]),
               {"dense/kernel"}),
    "sharded": (lambda: __import__("tensorflow").compat.v1.train.Saver(sharded=True),
                {"dense/kernel", "dense/kernel/Adam", "dense/kernel/Adam_1", "global_step",
                 "beta1_power", "beta2_power"}),
}


def _var(name):
    import tensorflow as tf
    return next(v for v in tf.compat.v1.global_variables() if v.op.name == name)


def _partitioned():
    return __import__("tensorflow").compat.v1.fixed_size_partitioner(2)


PARTITIONED_SAVERS = {  # a partitioned kernel: its parts are slices of one checkpoint key
    "partitioned": (lambda: __import__("tensorflow").compat.v1.train.Saver(),
                    {"dense/kernel", "dense/kernel/Adam", "dense/kernel/Adam_1", "global_step",
                     "beta1_power", "beta2_power"}),
    "partitioned-no-saver": (None, {"dense/kernel", "dense/kernel/Adam", "dense/kernel/Adam_1",
                                    "global_step", "beta1_power", "beta2_power"}),
}


@pytest.mark.parametrize("kind", sorted(SAVERS) + sorted(PARTITIONED_SAVERS))
def test_checkpoints_of_the_inputs_own_saver_move_both_ways(kind, tmp_path):
    """A Saver given a dict of keys or a subset of the variables, or any Saver (or none) of a
    graph with a partitioned variable: the transformed graph's saver writes the same keys
    (a part as its slice of the whole variable's), so the user's checkpoints restore into it
    and its own restore into the single-device graph."""
    import tensorflow as tf

    from graphxform.runtime import Feeds, Runner
    make, keys = {**SAVERS, **PARTITIONED_SAVERS}[kind]
    partitioner = _partitioned() if kind in PARTITIONED_SAVERS else None
    original = saver_graph(make, partitioner)
    ir = saver_graph(make, partitioner)
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    np.savez(tmp_path / "rows.npz", x=np.random.RandomState(0).randn(32, 8).astype(np.float32),
             y=np.random.RandomState(1).randint(0, 3, 32))
    feeds = Feeds(training.analyze(original).inputs, str(tmp_path / "rows.npz"), 16)
    with Runner(original) as run:
        run.initialize()
        run.step(feeds.batch(0))
        first = run.save(str(tmp_path / "original"))
    assert set(tf.train.load_checkpoint(first).get_variable_to_shape_map()) == keys
    with Runner(original) as run:
        run.restore(first)
        expected = run.step(feeds.batch(1)).loss
    with Runner(ir) as run:
        run.restore(first)
        assert run.step(feeds.batch(1)).loss == pytest.approx(expected, rel=1e-5)
        second = run.save(str(tmp_path / "transformed"))
    assert set(tf.train.load_checkpoint(second).get_variable_to_shape_map()) == keys
    if partitioner is not None:
        assert tf.train.load_checkpoint(second).get_variable_to_shape_map()[
            "dense/kernel"] == [8, 3]
    with Runner(original) as run:
        run.restore(second)
        run.step(feeds.batch(0))


def test_the_users_saver_keeps_how_many_checkpoints_it_keeps():
    """``Saver(max_to_keep=3, keep_checkpoint_every_n_hours=2)``: a user's loop saving through
    the transformed graph's saver deletes and keeps the checkpoints the original would."""
    import tensorflow as tf
    ir = saver_graph(lambda: tf.compat.v1.train.Saver(max_to_keep=3,
                                                      keep_checkpoint_every_n_hours=2))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    assert ir.meta.saver_def.max_to_keep == 3
    assert ir.meta.saver_def.keep_checkpoint_every_n_hours == 2


def test_a_saver_the_metagraph_does_not_name_is_left_alone(tmp_path):
    """A Saver exported without its saver_def keeps its ``save/`` scope in the graph; the
    rebuilt saver takes the next free scope, and checkpoints keep the original keys."""
    import tensorflow as tf

    from graphxform.runtime import Feeds, Runner
    original = saver_graph(None)
    ir = saver_graph(lambda: tf.compat.v1.train.Saver(sharded=True), export_saver_def=False)
    assert ir.has_scope("save/") and not ir.meta.HasField("saver_def")
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    np.savez(tmp_path / "rows.npz", x=np.random.RandomState(0).randn(32, 8).astype(np.float32),
             y=np.random.RandomState(1).randint(0, 3, 32))
    feeds = Feeds(training.analyze(original).inputs, str(tmp_path / "rows.npz"), 16)
    with Runner(original) as run:
        run.initialize()
        first = run.save(str(tmp_path / "original"))
        expected = run.step(feeds.batch(0)).loss
    with Runner(ir) as run:
        run.restore(first)
        assert run.step(feeds.batch(0)).loss == pytest.approx(expected, rel=1e-5)
        second = run.save(str(tmp_path / "transformed"))
    assert set(tf.train.load_checkpoint(second).get_variable_to_shape_map()) == set(
        tf.train.load_checkpoint(first).get_variable_to_shape_map())


def monitored_training(meta: str, checkpoint_dir, steps: int) -> None:
    """The standard TF1 loop: MonitoredTrainingSession over a checkpoint directory (it
    restores the latest checkpoint there and saves one at the end), on mlp_sgd's rows."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    rows = np.load(fixture_path("mlp_sgd", ".npz"))
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(meta)
        (train,) = tf1.get_collection("train_op")
        feeds = {"x:0": rows["x"][:8], "y:0": rows["y"][:8]}
        with tf1.train.MonitoredTrainingSession(
                checkpoint_dir=str(checkpoint_dir), save_summaries_steps=None,
                config=tf1.ConfigProto(device_count={"CPU": 2})) as session:
            for _ in range(steps):
                session.run(train, feeds)


def test_monitored_training_session_checkpoints_move_both_ways(tmp_path):
    """MonitoredTrainingSession (and Supervisor) save with the first Saver of the graph's
    `savers` collection, else a default one of every global variable, which would key each
    replica's copy by its own name: a single-device run, resumed by the transformed graph from
    its checkpoint directory, writes what the single-device graph would have."""
    import shutil

    import tensorflow as tf
    out = str(tmp_path / "mlp.allreduce.meta")
    metagraph.save(transformed("mlp_sgd", 2), out)
    monitored_training(fixture_path("mlp_sgd"), tmp_path / "one", 3)
    shutil.copytree(tmp_path / "one", tmp_path / "two")
    monitored_training(fixture_path("mlp_sgd"), tmp_path / "one", 3)
    monitored_training(out, tmp_path / "two", 3)
    want = tf.train.load_checkpoint(str(tmp_path / "one"))
    got = tf.train.load_checkpoint(str(tmp_path / "two"))
    assert set(got.get_variable_to_shape_map()) == set(want.get_variable_to_shape_map())
    for key in want.get_variable_to_shape_map():
        np.testing.assert_allclose(got.get_tensor(key), want.get_tensor(key), rtol=1e-5,
                                   atol=1e-6)
    assert got.get_tensor("global_step") == 6


def test_a_saver_of_a_value_that_is_no_variable_is_refused():
    import tensorflow as tf
    ir = saver_graph(lambda: tf.compat.v1.train.Saver([_var("dense/kernel")]))
    ir.set_input("save/SaveV2", 3, "x:0")  # as if it saved a tensor, not a variable's value
    with pytest.raises(GraphxformError, match="checkpoint key 'dense/kernel' from a value that "
                                              "is not a variable"):
        strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])


def test_initialization_makes_replicas_identical(tmp_path):
    out = str(tmp_path / "m.meta")
    metagraph.save(transformed("cnn_momentum", 3), out)
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(out)
        with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 3})) as sess:
            sess.run(tf1.global_variables_initializer())
            values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
    for i in (1, 2):
        np.testing.assert_array_equal(values[f"replica_{i}/conv0/kernel"],
                                      values["replica_0/conv0/kernel"])
    assert np.abs(values["replica_0/conv0/kernel"]).sum() > 0


def warm_started(directory) -> str:
    """BERT's run_classifier recipe: the body's variables start from a pretrained checkpoint
    (init_from_checkpoint replaces their initializers), the head from its initializer."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf.Graph().as_default():
        tf1.get_variable("bert/kernel", [8, 16], initializer=tf1.random_normal_initializer(
            seed=5))
        tf1.get_variable("bert/bias", [16], initializer=tf1.constant_initializer(0.3))
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            tf1.train.Saver().save(session, str(directory / "pretrained"))
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        hidden = tf.nn.relu(tf.matmul(x, tf1.get_variable("bert/kernel", [8, 16]))
                            + tf1.get_variable("bert/bias", [16]))
        logits = tf.matmul(hidden, tf1.get_variable("cls/kernel", [16, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        tf1.train.init_from_checkpoint(str(directory / "pretrained"),
                                       {"bert/": "bert/"})
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(0.01).minimize(loss))
        tf1.train.export_meta_graph(str(directory / "model.meta"), graph=graph)
    return str(directory / "model.meta")


def test_a_warm_start_from_a_checkpoint_starts_every_replica_from_it(tmp_path):
    """init_from_checkpoint's initializer reads the restored value through an Identity; the
    other replicas read it directly (sync-init): the same value, so the contract accepts it,
    and every replica starts from the pretrained checkpoint."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    ir = metagraph.load(warm_started(tmp_path))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    out = str(tmp_path / "model.allreduce.meta")
    metagraph.save(ir, out)
    with tf.Graph().as_default():
        tf1.train.import_meta_graph(out)
        with tf1.Session(config=tf1.ConfigProto(device_count={"CPU": 2})) as sess:
            sess.run(tf1.global_variables_initializer())
            values = {v.op.name: sess.run(v) for v in tf1.global_variables()}
    pretrained = tf.train.load_checkpoint(str(tmp_path / "pretrained"))
    for name in ("bert/kernel", "bert/bias"):
        for i in (0, 1):
            np.testing.assert_array_equal(values[f"replica_{i}/{name}"],
                                          pretrained.get_tensor(name))
    np.testing.assert_array_equal(values["replica_1/cls/kernel"],
                                  values["replica_0/cls/kernel"])


def test_refuses_graph_without_train_op():
    ir = graph_without_train_op()
    with pytest.raises(GraphxformError, match="no train op"):
        strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])


def test_refuses_already_transformed_graph():
    ir = transformed("mlp_sgd", 2)
    with pytest.raises(GraphxformError, match="already transformed"):
        strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])


@pytest.mark.parametrize("args, message", [
    (["--replicas", "0"], "at least 1"),
    (["--replicas", "-2"], "at least 1"),
    (["--devices", "/device:CPU:0,/gizmo:zz"], "not a TF device name"),
    (["--replicas", "3", "--devices", "/device:CPU:0,/device:CPU:1"], "does not match"),
])
def test_apply_bad_options(args, message, tmp_path, run_cli):
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "-o", out, *args)
    assert code != 0 and message in err and err.count("\n") == 1, err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_apply_already_transformed_and_no_train_op(tmp_path, run_cli):
    first = tmp_path / "a.meta"
    assert run_cli("apply", fixture_path("mlp_sgd"), "--replicas", "2", "-o", first)[0] == 0
    code, _, err = run_cli("apply", first, "--replicas", "2", "-o", tmp_path / "b.meta")
    assert code != 0 and "already transformed" in err and err.count("\n") == 1
    code, _, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", "2", "--train-op",
                           "nope", "-o", tmp_path / "c.meta")
    assert code != 0 and "nope" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.meta"]
    code, _, err = run_cli("verify", fixture_path("mlp_sgd"), "--replicas", "2", "--train-op",
                           "GradientDescent,GradientDescent")
    assert code == 1 and "'GradientDescent' is given twice" in err and err.count("\n") == 1


def test_apply_summary_and_default_output(tmp_path, run_cli):
    model = tmp_path / "model.meta"
    model.write_bytes(open(fixture_path("cnn_momentum"), "rb").read())
    code, out, err = run_cli("apply", model, "--replicas", "2")
    assert code == 0, err
    assert (tmp_path / "model.allreduce.meta").exists()
    assert "2 replicas" in out and "collectives per replica per step: 1" in out
    assert "replicate" in out and "ms" in out
    lines = {line.split()[0]: line for line in out.splitlines() if " ms" in line}
    assert "nothing to do" not in lines["sync-init"]  # it plans for replicate, changes nothing


def test_run_batch_that_does_not_divide(tmp_path, run_cli):
    out = tmp_path / "m.meta"
    run_cli("apply", fixture_path("mlp_sgd"), "--replicas", "2", "-o", out)
    code, _, err = run_cli("run", out, "--steps", "1", "--batch-size", "7")
    assert code != 0 and "does not divide evenly across 2 replicas" in err
    assert err.strip().splitlines()[-1].startswith("graphxform: error:")


def test_a_failure_downstream_of_a_split_is_not_called_uneven():
    """TF's error names the failing node; a split that merely feeds it, mentioned elsewhere in
    the text, is not the failure (a fixed-size stack beside a slice was reported as a batch
    that does not divide)."""
    from graphxform.passes.split_inputs import uneven_batch
    text = ("Graph execution error:\n\nDetected at node 'replica_1/stack' defined at ...\n"
            "Node: 'replica_1/stack'\nShapes of all inputs must match: values[0].shape = [8] "
            "!= values[1].shape = [16]\n\t [[{{node replica_1/stack}}]]\n"
            "input 0: split_inputs/actions/split:1")
    assert uneven_batch(text) is None
    assert uneven_batch(text.replace("replica_1/stack", "split_inputs/actions/split")) == (
        "the batch for input 'actions' does not divide evenly across replicas")


def test_run_prints_loss_and_saves(tmp_path, run_cli):
    out = tmp_path / "m.meta"
    run_cli("apply", fixture_path("embedding_adam"), "--replicas", "2", "-o", out)
    code, text, err = run_cli("run", out, "--steps", "3", "--feeds",
                              fixture_path("embedding_adam", ".npz"), "--batch-size", "8",
                              "--save", tmp_path / "ckpt", "--fetch", "global_step:0")
    assert code == 0, err
    lines = [line for line in text.splitlines() if line.startswith("step")]
    assert len(lines) == 3 and "loss" in lines[0]
    assert os.path.exists(str(tmp_path / "ckpt.index"))
    code, text, err = run_cli("run", fixture_path("embedding_adam"), "--steps", "1",
                              "--restore", tmp_path / "ckpt")
    assert code == 0, err


def test_verify_cli_pass_and_explained_fail(run_cli):
    code, out, _ = run_cli("verify", fixture_path("mlp_sgd"), "--replicas", "2", "--feeds",
                           fixture_path("mlp_sgd", ".npz"), "--steps", "3", "--batch-size", "16")
    assert code == 0 and "PASS" in out
    code, out, _ = run_cli("verify", fixture_path("cnn_bn_momentum"), "--replicas", "2",
                           "--steps", "2", "--batch-size", "16")
    assert code != 0 and "FAIL" in out and "batch norm" in out


def test_run_and_verify_start_the_metrics_local_variables(run_cli, tmp_path):
    """tf.compat.v1.metrics' totals are local variables: `run` and `verify` start them as a
    TF1 loop does (local_variables_initializer, also after restoring, since no checkpoint
    holds them), and the transformed graph's saver keeps them out as TF's default Saver does,
    so a single-device checkpoint restores into it. Their totals are running sums (means),
    served added up (averaged), so verify names no metric as replica 0's."""
    from recipe_loop import RECIPES_DIR, recipe_meta
    meta, feeds = recipe_meta("metrics_mlp"), RECIPES_DIR / "metrics_mlp.npz"
    code, _, err = run_cli("run", meta, "--feeds", feeds, "--steps", "2",
                           "--save", tmp_path / "ckpt")
    assert code == 0, err
    out_meta = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", "2", meta,
                           "-o", out_meta)
    assert code == 0, err
    code, _, err = run_cli("run", out_meta, "--feeds", feeds, "--steps", "1",
                           "--restore", tmp_path / "ckpt")
    assert code == 0, err
    code, out, err = run_cli("verify", meta, "--replicas", "2", "--feeds", feeds,
                             "--steps", "3")
    assert code == 0 and "PASS" in out, out + err
    assert "metrics' totals" not in out  # running totals: their update_ops are exact
    assert "batch norm" not in out


def test_train_op_without_global_step(tmp_path):
    """minimize() without global_step: the train op is a NoOp sink, merged once."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(0)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.get_variable("w", [4, 1], use_resource=True)
        loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w))), name="loss")
        tf1.add_to_collection("losses", loss)
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
        path = str(tmp_path / "m.meta")
        tf1.train.export_meta_graph(filename=path)
    np.savez(str(tmp_path / "f.npz"), x=np.random.default_rng(0).standard_normal((16, 4)))
    ir = metagraph.load(path)
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    assert ir.op("GradientDescent") == "NoOp"
    report = equivalence.compare(metagraph.load(path), ir, str(tmp_path / "f.npz"), steps=3,
                                 batch_size=8)
    assert report.ok, equivalence.format_report(report)


def test_run_bare_graphdef_initializes_without_collections(tmp_path, run_cli):
    pb = str(tmp_path / "mlp.pb")
    metagraph.save(metagraph.load(fixture_path("mlp_sgd")), pb)
    code, out, err = run_cli("run", pb, "--train-op", "GradientDescent", "--steps", "2",
                             "--batch-size", "4")
    assert code == 0, err
    assert len([line for line in out.splitlines() if line.startswith("step")]) == 2


def chained_actor_critic(path, train_op: str) -> str:
    """Spinning Up's actor-critic step (DDPG/TD3/SAC in TF1): the critic's minimize, the
    actor's under a control dependency on it (its loss reads the critic after the update),
    then the target critic's soft update after both; the train op is the actor's step or a
    tf.group of all three."""
    import tensorflow as tf
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def dense(h, units, name):
        w = tf1.get_variable(name, [h.shape[1], units])
        return tf.matmul(h, w)

    def critic(x, action, scope):
        with tf1.variable_scope(scope, reuse=tf1.AUTO_REUSE):
            h = tf.nn.relu(dense(tf.concat([x, action], 1), 16, "w0"))
            return tf.squeeze(dense(h, 1, "w1"), 1)

    def build(x, y):
        reward = tf.cast(y, tf.float32)
        taken = tf.one_hot(y, 2)
        with tf1.variable_scope("pi"):
            action = tf.tanh(dense(tf.nn.relu(dense(x, 16, "w0")), 2, "w1"))
        backup = tf.stop_gradient(reward + 0.9 * critic(x, taken, "target_q"))
        q_loss = tf.reduce_mean(tf.square(critic(x, taken, "q") - backup))
        q_vars = tf1.trainable_variables("q/")
        train_q = tf1.train.AdamOptimizer(1e-2).minimize(q_loss, var_list=q_vars)
        with tf.control_dependencies([train_q]):
            pi_loss = -tf.reduce_mean(critic(x, action, "q"))
            train_pi = tf1.train.AdamOptimizer(1e-2).minimize(
                pi_loss, var_list=tf1.trainable_variables("pi/"))
        with tf.control_dependencies([train_pi]):
            target = tf.group([tf1.assign(t, 0.995 * t + 0.005 * v) for v, t in
                               zip(q_vars, tf1.global_variables("target_q/"))])
        return train_pi if train_op == "actor" else tf.group(train_q, train_pi, target)
    return export_classifier(path, build)


@pytest.mark.parametrize("train_op", ["actor", "group"])
def test_chained_optimizers_reduce_each_stage_before_its_update(run_cli, tmp_path, train_op):
    """The actor's gradients are computed after the critic's update ran: fused into one bucket
    with the critic's they made a cycle (apply failed with an internal error from
    rewire-consumers); each stage is reduced on its own now."""
    model = chained_actor_critic(tmp_path / "ac.meta", train_op)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_a_gradient_computed_after_another_variables_write_names_that_write(run_cli, tmp_path):
    """PopArt's ART step rescales the value head's trainable kernel (an assign from the batch's
    statistics) before the loss whose gradients train the torso is computed: no gradient can be
    reduced before that write. The refusal named the torso's kernel and 'its own update',
    which it is not: it names the write the gradients wait on, and its variable."""
    from conftest import export_classifier
    import tensorflow as tf
    from test_custom_training_code import dense
    tf1 = tf.compat.v1

    def build(x, y):
        h = dense(x, 8, "torso", tf.nn.relu)
        w = tf1.get_variable("head/kernel", [8, 1])
        returns = tf.cast(y, tf.float32)
        rescale = tf1.assign(w, w * (1.0 + 0.01 * tf.reduce_mean(returns)), name="art")
        with tf.control_dependencies([rescale]):
            value = tf.matmul(h, w.read_value())[:, 0]
        return tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.square(value - returns)))
    model = export_classifier(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'art', an update of variable 'head/kernel', runs" in err, err
