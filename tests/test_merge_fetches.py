"""merge-fetches: every original name of the input exists in the output, and fetching it gives
what the single-device graph gives for the whole batch (graphxform/replica_values.py's rules)."""

import glob
import os

import numpy as np
import pytest
from conftest import fixture_path

from graphxform import cluster, metagraph, replica_values, strategies, training
from graphxform.errors import GraphxformError
from graphxform.metagraph import from_metagraph
from graphxform.passes.merge_fetches import MergeFetches
from graphxform.pipeline import PassContext

DEVICES = ["/device:CPU:0", "/device:CPU:1"]
PS_SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
           "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
FIXTURES = sorted(os.path.basename(p)[:-5] for p in glob.glob(fixture_path("*")))


def fetch_graph():
    """A small training graph with one fetch of each kind, built as TF1 code builds them."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [4, 3])
        b = v1.get_variable("b", [3], initializer=v1.zeros_initializer())
        counter = v1.get_variable("counter", [], initializer=v1.zeros_initializer())
        step = v1.train.get_or_create_global_step()
        tf.reduce_mean(x)  # takes the name Mean, so the loss below is Mean_1
        logits = tf.add(tf.matmul(x, w), b, name="logits")
        tf.nn.softmax(logits, name="probs")  # per example: batch
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent)  # unnamed: Mean_1
        with tf.name_scope("loss"):
            tf.reduce_mean(tf.square(logits))  # loss/Mean
        tf.reduce_sum(xent, name="xent_sum")  # a sum
        tf.reduce_sum(tf.square(w), name="w_norm")  # from variables only: identical
        tf.reduce_max(logits, name="batch_max")  # the largest of the replicas' largest
        tf.split(logits, [1, 2], axis=1, name="halves")  # two outputs, each batch
        tf.pad(x, [[0, 0], [1, 2]], name="padded")  # the sides of each example: batch
        tf.pad(x, [[1, 0], [0, 0]], name="padded_rows")  # a row more per slice: run again
        tf.multiply(x, tf.raw_ops.RandomUniform(shape=[4], dtype=tf.float32),
                    name="dropped")  # an unseeded draw per replica: unknown
        bump = counter.assign_add(1.0, read_value=False, name="bump")  # an op without outputs
        with tf.control_dependencies([bump]):
            tf.identity(counter.read_value(), name="counter_after")  # runs the bump
        v1.add_to_collection(v1.GraphKeys.LOSSES, loss)
        updates = v1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
        with tf.control_dependencies([updates]):  # tf_slim's create_train_op
            train_tensor = tf.identity(loss, name="train_op/control_dependency")
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_tensor)
        return from_metagraph(v1.train.export_meta_graph())


def transformed(ir, strategy="allreduce", **options):
    if strategy == "allreduce":
        return strategies.transform(ir, "allreduce", devices=DEVICES, **options)
    return strategies.transform(ir, strategy, cluster=cluster.Cluster(PS_SPEC), **options)


def summary_of(pipeline) -> dict:
    return next(t.summary for t in pipeline.timings if t.name == "merge-fetches")


def session_run(ir, fetches, feeds, restore=None, save=None, then=None):
    """Import ``ir`` as a user would and run ``fetches`` once (then ``then``, returning the
    global variables' values by name), from ``restore`` or freshly initialised."""
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default() as g:
        saver = v1.train.import_meta_graph(metagraph.to_metagraph(ir)) or v1.train.Saver()
        with v1.Session(graph=g, config=v1.ConfigProto(device_count={"CPU": 2})) as sess:
            sess.run(v1.global_variables_initializer())
            if restore:
                saver.restore(sess, restore)
            if save:
                saver.save(sess, save, write_meta_graph=False)
            values = sess.run(fetches, feeds)
            if then:
                sess.run(then, feeds)
            variables = {v.op.name: sess.run(v) for v in v1.global_variables()}
    return values, variables


@pytest.fixture(scope="module")
def single_and_transformed(tmp_path_factory):
    """The fetch graph, its allreduce form (2 replicas) with the merge summary, a checkpoint of
    the single device's start and the feeds of one global batch."""
    rng = np.random.default_rng(0)
    feeds = {"x:0": rng.normal(size=(8, 4)).astype(np.float32),
             "y:0": rng.integers(0, 3, size=8).astype(np.int64)}
    single, out = fetch_graph(), fetch_graph()
    pipeline = transformed(out)
    start = str(tmp_path_factory.mktemp("start") / "start")
    session_run(single, [], feeds, save=start)
    return single, out, summary_of(pipeline), start, feeds


@pytest.mark.parametrize("name, kind", [
    ("Mean_1:0", "mean"), ("loss/Mean:0", "mean"), ("Mean:0", "mean"), ("probs:0", "batch"),
    ("logits:0", "batch"), ("padded:0", "batch"), ("xent_sum:0", "sum"),
    ("w_norm:0", "identical")])
def test_fetch_gives_the_single_device_value(single_and_transformed, name, kind):
    single, out, summary, start, feeds = single_and_transformed
    node = name.split(":")[0]
    assert out.node(node)["created_by"] == "merge-fetches" and node not in summary["unmerged"]
    assert out.op(node) == {"mean": "Mean", "batch": "ConcatV2", "sum": "AddN",
                            "identical": "Identity"}[kind]
    expected, _ = session_run(single, name, feeds, restore=start)
    got, _ = session_run(out, name, feeds, restore=start)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_node_with_several_outputs_merges_each(single_and_transformed):
    single, out, summary, start, feeds = single_and_transformed
    assert out.op("halves") == "IdentityN" and "halves" not in summary["unmerged"]
    for name in ("halves:0", "halves:1"):
        expected, _ = session_run(single, name, feeds, restore=start)
        got, _ = session_run(out, name, feeds, restore=start)
        assert got.shape == expected.shape  # the whole batch's rows, not replica 0's
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_unknown_is_listed_and_served_from_replica_0(single_and_transformed):
    _, out, summary, start, feeds = single_and_transformed
    assert "dropped" in summary["unmerged"] and "batch_max" not in summary["unmerged"]
    assert out.op("dropped") == "Identity" and out.inputs("dropped") == [
        ("replica_0/dropped", 0)]
    got, _ = session_run(out, "dropped:0", feeds, restore=start)
    assert got.shape[0] == len(feeds["x:0"]) // 2  # replica 0's slice


def test_an_op_on_a_fed_placeholder_is_run_again_on_the_whole_batch(single_and_transformed):
    """``tf.pad`` of the placeholder's rows: replica 0's copy reads its slice (split-inputs'
    Split), so it was served from replica 0 (its slice and its padding); now run again on the
    placeholder itself."""
    single, out, summary, start, feeds = single_and_transformed
    assert "padded_rows" not in summary["unmerged"] and out.op("padded_rows") == "Pad"
    expected, _ = session_run(single, "padded_rows:0", feeds, restore=start)
    got, _ = session_run(out, "padded_rows:0", feeds, restore=start)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("recipe, fetches", [
    ("keras_compile_metrics", ["metrics/accuracy/Identity:0"]),
    ("metrics_mlp", ["accuracy/update_op:0", "mean_loss/update_op:0"])])
def test_a_metric_fetched_beside_the_step_is_the_single_device_value(recipe, fetches):
    """A metric keeps a running total and count per replica. tf_keras's compiled step fetches
    its value (total / count), whose updates run with the fetch, outside the train op: it was
    classed identical and served from replica 0, unlisted (7e-01 off on this recipe). Its
    copies add up (a mean's average) to the single-device variable, and the value is computed
    again from those sums; so are tf.compat.v1.metrics' update_ops run in the train op."""
    from recipe_loop import RECIPES_DIR, recipe_meta
    from graphxform import equivalence
    original = metagraph.load(recipe_meta(recipe))
    transformed = metagraph.load(recipe_meta(recipe))
    pipeline = strategies.transform(transformed, "allreduce", devices=DEVICES)
    summary = next(t.summary for t in pipeline.timings if t.name == "merge-fetches")
    assert not any(f.split(":")[0] in summary["unmerged"] for f in fetches)
    report = equivalence.compare(original, transformed, str(RECIPES_DIR / f"{recipe}.npz"),
                                 steps=3, fetches=fetches)
    assert report.ok and not report.reasons, equivalence.format_report(report)
    assert {d.name for d in report.fetches} >= set(fetches)


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_a_keras_metric_on_shared_variables_reads_them_after_every_replica(strategy):
    """ps keeps a tf_keras metric's total and count once, on a ps task; every replica adds its
    slice to them. The metric's value read them after its own replica's adds only and was
    served from replica 0 as identical: fetched beside the step it gave the total after some
    replicas' adds (verify failed by 2e-01 to 5e-01, unexplained; apply exited 0). Now it is
    read again after every replica's adds: the single-device figure."""
    from recipe_loop import RECIPES_DIR, recipe_meta
    from graphxform import equivalence
    from graphxform.runtime import servers
    fetch = "metrics/accuracy/Identity:0"
    original = metagraph.load(recipe_meta("keras_compile_metrics"))
    out = metagraph.load(recipe_meta("keras_compile_metrics"))
    strategies.transform(out, strategy, cluster=servers.local_cluster({"ps": 1, "worker": 2}))
    adds = {n for n in out.ancestors("metrics/accuracy/Identity")
            if out.op(n) == "AssignAddVariableOp"}
    assert {f"replica_{i}/metrics/accuracy/AssignAddVariableOp" for i in (0, 1)} <= adds
    report = equivalence.compare(original, out, str(RECIPES_DIR / "keras_compile_metrics.npz"),
                                 steps=3, fetches=[fetch])
    assert report.ok and not report.reasons, equivalence.format_report(report)
    assert fetch in {d.name for d in report.fetches}


def keras_two_outputs_graph(path) -> str:
    """tf_keras' multi-output guide in a TF1 graph: two heads, a loss each, loss_weights, an
    accuracy per head; the training function also returns each head's loss, a Mean metric
    (its count goes up by one per call, the same on every replica)."""
    import numpy as np
    import tensorflow as tf
    import tf_keras
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf_keras.Input(shape=(8,), name="x")
        h = tf_keras.layers.Dense(16, activation="relu")(x)
        model = tf_keras.Model(x, [tf_keras.layers.Dense(3, name="a")(h),
                                   tf_keras.layers.Dense(2, name="b", activation="softmax")(h)])
        model.compile(optimizer=tf_keras.optimizers.legacy.RMSprop(0.01),
                      loss=[tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            "sparse_categorical_crossentropy"],
                      loss_weights=[0.3, 1.0], metrics={"a": ["accuracy"], "b": ["accuracy"]})
        model._make_train_function()
        tf.compat.v1.add_to_collection("train_op", model.train_function.updates_op)
        fetches = [t.name for t in model.train_function.outputs]
        tf.compat.v1.train.export_meta_graph(str(path), graph=graph)
    xs = np.random.RandomState(0).randn(64, 8).astype(np.float32)
    np.savez(str(path) + ".npz", x=xs,
             a_target=((xs[:, 0] > 0) + (xs[:, 1] > 0)).astype(np.float32)[:, None],
             b_target=(xs[:, 2] > 0).astype(np.float32)[:, None])
    return str(path), fetches


def test_a_keras_heads_loss_metric_on_shared_variables_counts_every_replica(tmp_path):
    """Each head's loss (a Mean metric) read its shared count after its own replica's add of 1
    only, unordered with the other's: fetched beside the step under ps it was twice the
    single-device figure or right by chance (verify failed by 1.0, unexplained)."""
    from graphxform import equivalence
    from graphxform.runtime import servers
    model, fetches = keras_two_outputs_graph(tmp_path / "m.meta")
    out = metagraph.load(model)
    strategies.transform(out, "ps", cluster=servers.local_cluster({"ps": 1, "worker": 2}))
    heads = [f for f in fetches if f.startswith("loss/Identity")]
    assert len(heads) == 2 and "metrics/a_accuracy/Identity:0" in fetches
    for head in heads:
        adds = {n for n in out.ancestors(head.split(":")[0]) if out.op(n) == "AssignAddVariableOp"}
        assert len(adds) == 4, (head, adds)  # total and count, on both replicas
    report = equivalence.compare(metagraph.load(model), out, model + ".npz", steps=3,
                                 fetches=fetches)
    assert report.ok and not report.reasons, equivalence.format_report(report)


def keras_fitted_metric_graph(path) -> str:
    """tf_keras' compile() with weighted_metrics, as exported after fit() with sample weights
    (train_on_batch here) in a TF1 graph: reset_metrics() left an assign of each metric's
    total and count from a placeholder (backend.batch_set_value), so their copies are not
    shown to be running sums, and the metric's value is served from replica 0."""
    import numpy as np
    import tensorflow as tf
    import tf_keras
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        x = tf_keras.Input(shape=(8,), name="x")
        model = tf_keras.Model(x, tf_keras.layers.Dense(3, name="out")(x))
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.1),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["accuracy"])
        rng = np.random.RandomState(0)
        xs, weights = rng.randn(64, 8).astype(np.float32), rng.uniform(0, 2, 64)
        labels = ((xs[:, 0] > 0) + (xs[:, 1] > 0)).astype(np.float32)[:, None]
        model.train_on_batch(xs[:4], labels[:4], sample_weight=weights[:4])
        tf.compat.v1.add_to_collection("train_op", model.train_function.updates_op)
        tf.compat.v1.train.export_meta_graph(str(path), graph=graph)
    np.savez(str(path) + ".npz", x=xs, out_target=labels,
             out_sample_weights=weights.astype(np.float32))
    return str(path)


def test_verify_names_a_fetch_served_from_replica_0(run_cli, tmp_path):
    """Fetching such a metric failed verify by 8e-01 with no reason given (apply's note listed
    it among the names it could not merge): verify now says why."""
    model = keras_fitted_metric_graph(tmp_path / "m.meta")
    metric = next(n for n in metagraph.load(model).nodes()
                  if n.startswith("metrics_2/") and n.endswith("accuracy/Identity"))
    code, out, err = run_cli("verify", model, "--replicas", 2, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3, "--fetch", metric + ":0")
    assert code == 1 and "FAIL" in out, out + err
    assert f"the fetches {metric}:0 are served from replica 0's copy" in out, out


def test_the_batch_extreme_is_the_extreme_of_the_replicas(single_and_transformed):
    single, out, _, start, feeds = single_and_transformed
    assert out.op("batch_max") == "Max"
    expected, _ = session_run(single, "batch_max:0", feeds, restore=start)
    got, _ = session_run(out, ["batch_max:0", "replica_0/batch_max:0"], feeds, restore=start)
    assert got[0] == pytest.approx(expected, rel=1e-6) and got[0] >= got[1]


def test_op_without_outputs_runs_every_replica(single_and_transformed):
    _, out, _, start, feeds = single_and_transformed
    assert out.op("bump") == "NoOp"
    _, variables = session_run(out, [], feeds, restore=start, then="bump")
    assert variables["replica_0/counter"] == variables["replica_1/counter"] == 1.0


def test_tensor_after_a_write_runs_every_replica(single_and_transformed):
    _, out, _, start, feeds = single_and_transformed
    assert set(out.control_inputs("counter_after")) == {"replica_1/counter_after"}
    value, variables = session_run(out, "counter_after:0", feeds, restore=start)
    assert value == 1.0
    assert variables["replica_0/counter"] == variables["replica_1/counter"] == 1.0


def test_tensor_train_op_steps_every_replica(single_and_transformed):
    single, out, _, start, feeds = single_and_transformed
    name = "train_op/control_dependency:0"
    expected, after_single = session_run(single, name, feeds, restore=start)
    got, after = session_run(out, name, feeds, restore=start)
    assert got == pytest.approx(expected, rel=1e-6)
    assert after["global_step"] == after_single["global_step"] == 1
    for i in range(2):  # every replica moved, by the whole batch's step
        np.testing.assert_allclose(after[f"replica_{i}/w"], after_single["w"], rtol=1e-5)
    assert not np.allclose(after["replica_1/w"], session_run(out, [], feeds, restore=start)[1][
        "replica_1/w"])


def test_user_overrides_take_precedence():
    ir = fetch_graph()
    summary = summary_of(transformed(ir, fetch_mean=["batch_max:0"], fetch_concat=["Mean:0"]))
    assert ir.op("batch_max") == "Mean" and "batch_max" not in summary["unmerged"]
    assert ir.op("Mean") == "ConcatV2"


def test_override_naming_no_node_is_refused():
    with pytest.raises(GraphxformError, match="cannot merge fetch 'nope:0': no such node"):
        transformed(fetch_graph(), fetch_mean=["nope:0"])


def test_nothing_to_merge_without_replicas():
    ir = fetch_graph()
    ctx = PassContext(training=training.analyze(ir), devices=DEVICES)
    assert MergeFetches().run(ir, ctx).modified is False


def test_collections_name_the_originals_again():
    ir = fetch_graph()
    transformed(ir)
    train_ops = list(ir.meta.collection_def["train_op"].node_list.value)
    assert train_ops == ["GradientDescent", "train_op/control_dependency:0"]  # minimize's own
    assert list(ir.meta.collection_def["losses"].node_list.value) == ["Mean_1:0"]


def test_classes_of_replica_copies():
    ir = fetch_graph()
    transformed(ir)
    step = {"replica_0/" + n for n in training.analyze(fetch_graph()).train_closure}
    values = replica_values.classify(ir, "replica_0/", step=step)
    assert values.of("replica_0/probs") == replica_values.BATCH
    assert values.of("replica_0/xent_sum") == replica_values.SUM
    assert values.of("replica_0/w_norm") == replica_values.IDENTICAL
    assert values.of("replica_0/batch_max") == replica_values.MAX
    assert "replica_0/counter_after" in values.effects
    assert "replica_0/probs" not in values.effects


def dropout_graph():
    """An MLP with seeded dropout (drawn per example) beside a tf.tensordot projection with a
    layer norm (a transformer's way), a mean loss and a train op."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(5)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w1, w2 = v1.get_variable("w1", [4, 6]), v1.get_variable("w2", [6, 3])
        hidden = tf.nn.relu(tf.matmul(x, w1), name="hidden")
        dropped = tf.nn.dropout(hidden, rate=0.5, name="dropout")
        projected = tf.tensordot(tf.reshape(x, [-1, 2, 2]), v1.get_variable("w3", [2, 5]),
                                 axes=1, name="projected")
        mean, variance = tf.nn.moments(projected, axes=[-1], keepdims=True)
        normed = tf.identity((projected - mean) * tf.math.rsqrt(variance + 1e-6), name="normed")
        pooled = tf.reduce_mean(normed, axis=[1, 2], keepdims=True, name="pooled")
        logits = tf.add(tf.matmul(dropped, w2), tf.reshape(pooled, [-1, 1]), name="logits")
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        step = v1.train.get_or_create_global_step()
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP,
                             v1.train.GradientDescentOptimizer(0.1).minimize(loss, step))
        return from_metagraph(v1.train.export_meta_graph())


def test_every_merged_value_is_the_single_device_value():
    """With random draws made consistent, every name served by a merge (not listed as
    unmerged) gives exactly what the single device gives; the rest are listed."""
    single, out = dropout_graph(), dropout_graph()
    summary = summary_of(transformed(out, consistent_random=True))
    served = [n + ":0" for n in single.nodes() if out.node(n)["created_by"] == "merge-fetches"
              and n not in summary["unmerged"] and out.op(n) not in ("NoOp", "IdentityN")
              and not out.control_inputs(n) and single.op(n) != "VarHandleOp"]
    # the replicas' rows of the global draw: dropout's mask, which used to be replica 0's half
    assert {"dropout/random_uniform/RandomUniform:0", "dropout/SelectV2:0"} <= set(served)
    assert {"projected:0", "normed:0", "pooled:0"} <= set(served)
    assert len(served) > 40
    rng = np.random.default_rng(1)
    feeds = {"x:0": rng.normal(size=(8, 4)).astype(np.float32),
             "y:0": rng.integers(0, 3, size=8).astype(np.int64)}
    import tempfile
    start = os.path.join(tempfile.mkdtemp(), "start")
    expected, _ = session_run(single, served, feeds, save=start)
    got, _ = session_run(out, served, feeds, restore=start)
    for name, a, b in zip(served, expected, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_draw_per_example_is_fetched_for_the_whole_batch():
    """Epsilon-greedy actions (DQN): a coin and a random action drawn per example beside the
    greedy one. Each replica draws rows for its slice; fetching the action gives one per
    example of the batch, not replica 0's half."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        q = tf.matmul(x, v1.get_variable("w", [4, 3]), name="q")
        greedy = tf.argmax(q, axis=1)
        explore = tf.random.uniform(tf.shape(greedy), 0, 3, dtype=tf.int64)
        tf.where(tf.random.uniform(tf.shape(greedy)) < 0.5, explore, greedy, name="action")
        loss = tf.reduce_mean(tf.square(q))
        v1.add_to_collection(v1.GraphKeys.TRAIN_OP,
                             v1.train.GradientDescentOptimizer(0.1).minimize(loss))
        out = from_metagraph(v1.train.export_meta_graph())
    summary = summary_of(transformed(out))
    assert "action" not in summary["unmerged"]
    feeds = {"x:0": np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)}
    (action,), _ = session_run(out, ["action:0"], feeds)
    assert action.shape == (8,)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
@pytest.mark.parametrize("name", FIXTURES)
def test_every_original_name_survives(name, strategy):
    original = metagraph.load(fixture_path(name))
    saver_scope = training.analyze(original).saver_scope
    ir = metagraph.load(fixture_path(name))
    transformed(ir, strategy)
    missing = [n for n in original.nodes()
               if n not in ir and not (saver_scope and n.startswith(saver_scope))]
    assert missing == []


INT_TENSORS = {
    "int32 values": (np.int32, [[1, -2], [3, 4]], "typed"),
    "int64 values": (np.int64, [2 ** 40, -1, 0], "typed"),
    "int32 bytes": (np.int32, [[5, 6, 7], [8, 9, 10]], "bytes"),
    "int64 bytes": (np.int64, [7, -8], "bytes"),
    "one value repeated": (np.int32, [3, 3, 3, 3], "last"),
    "zeros": (np.int64, [0, 0, 0], "none"),
    "scalar": (np.int32, 7, "typed"),
    "empty": (np.int32, np.zeros([0, 2], np.int32), "typed"),
}


@pytest.mark.parametrize("case", sorted(INT_TENSORS))
def test_int_constants_read_as_make_ndarray_reads_them(case):
    """replica_values reads int32 and int64 Consts straight from the proto: the same values as
    tensor_util.MakeNdarray, whichever field holds them."""
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2
    from tensorflow.python.framework import tensor_util
    dtype, value, field = INT_TENSORS[case]
    array = np.asarray(value, dtype)
    tensor = tensor_pb2.TensorProto(dtype=3 if dtype == np.int32 else 9)
    tensor.tensor_shape.CopyFrom(tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in array.shape]))
    values = tensor.int_val if dtype == np.int32 else tensor.int64_val
    if field == "bytes":
        tensor.tensor_content = array.tobytes()
    elif field == "typed":
        values.extend(array.reshape(-1).tolist())
    elif field == "last":
        values.append(int(array.reshape(-1)[0]))
    expected = [int(v) for v in tensor_util.MakeNdarray(tensor).reshape(-1)]
    assert expected == array.reshape(-1).tolist()
    assert replica_values._int_values(tensor) == expected


def test_a_statistic_of_a_fed_tensor_is_computed_again_from_the_whole_batch(run_cli, tmp_path):
    """PPO's explained variance, ``1 - var(returns - values) / var(returns)``, fetched beside
    the step with the returns fed: ``returns - mean(returns)`` reads the placeholder, and
    replica 0's copy reads its slice of it (split-inputs' Split), so it was served from replica
    0 alone (half the batch's figure, listed in apply's note); now it is run again on the
    placeholder itself, whole."""
    from conftest import export_classifier
    import tensorflow as tf
    from test_custom_training_code import dense
    tf1 = tf.compat.v1

    def build(x, y):
        value = dense(x, 8, "vf")
        tf.identity(1.0 - tf.math.reduce_variance(x - value) / tf.math.reduce_variance(x),
                    name="explained_variance")
        tf.identity(tf.math.reduce_std(x), name="x_std")
        return tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.square(x - value)))
    model = export_classifier(tmp_path / "m.meta", build)
    code, out, err = run_cli("verify", model, "--replicas", 2, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 2, "--fetch", "explained_variance:0",
                             "--fetch", "x_std:0")
    assert code == 0 and "PASS" in out and "replica 0's copy" not in out, out + err
