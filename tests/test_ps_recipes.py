"""ps and partitioned-ps keep the drop-in contract on real training graphs: each situation of
issue 12 as a small graph built here the way public model code builds it (tf.compat.v1, tf_slim),
and the corpus's exact recipes (tests/fixtures/recipes), each transformed for 2 ps tasks and 2
workers and compared with the single-device graph by `equivalence.compare`: 3 steps from one
checkpoint on the same data, every step's loss and every variable within 1e-5 (scaled)."""

import contextlib
import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_slim 1.1 needs Keras 2 (tf_keras)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from recipe_loop import load_manifest, recipe_meta  # noqa: E402

from graphxform import cluster, equivalence, metagraph, strategies  # noqa: E402
from graphxform.plan import ClusterPlan  # noqa: E402
from graphxform.errors import GraphxformError  # noqa: E402

v1 = tf.compat.v1
SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
STRATEGIES = ["ps", "partitioned-ps"]
RTOL = 1e-5
ROWS = 64  # rows of feed data per placeholder
MANIFEST = load_manifest()
EXACT = sorted(name for name, entry in MANIFEST.items() if entry["exact"])
SLOW_RECIPES = {"gan_mlp", "wide_deep", "keras_rnn", "summaries_check_numerics"}


# ------------------------------------------------------------------ helpers
@contextlib.contextmanager
def legacy_control_flow():
    """Build with TF1's control flow (Switch/Merge conds), as TF1 users had it."""
    v1.disable_control_flow_v2()
    try:
        yield
    finally:
        v1.enable_control_flow_v2()


def build(make, legacy=False):
    """The GraphIR of the graph ``make`` builds in a fresh tf.Graph (seeded)."""
    graph = tf.Graph()
    with graph.as_default(), (legacy_control_flow() if legacy else contextlib.nullcontext()):
        v1.set_random_seed(1)
        make()
        meta = v1.train.export_meta_graph(graph=graph)
    return metagraph.from_metagraph(meta)


def classes(rng, x, n=3):
    """Labels from a fixed linear rule of the inputs, so training has something to learn."""
    return np.argmax(x.reshape(len(x), -1) @ rng.standard_normal([x[0].size, n]), axis=1)


def mlp_data(tmp_path, width=6):
    rng = np.random.default_rng(0)
    x = rng.standard_normal([ROWS, width]).astype(np.float32)
    path = tmp_path / "feeds.npz"
    np.savez(path, x=x, y=classes(rng, x).astype(np.int64))
    return str(path)


def mlp_logits(x, hidden=8, classes=3):
    h = v1.layers.dense(x, hidden, activation=tf.nn.relu, name="hidden")
    return v1.layers.dense(h, classes, name="logits")


def mlp_loss():
    x = v1.placeholder(tf.float32, [None, 6], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    logits = mlp_logits(x)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits),
                          name="loss")


def transform(original, strategy, **options):
    ir = metagraph.from_metagraph(metagraph.to_metagraph(original))
    strategies.transform(ir, strategy, cluster=cluster.Cluster(SPEC), **options)
    return ir


def assert_matches(original, strategy, feeds, train_op=None, batch_size=8, **options):
    """Transform, train both 3 steps from one checkpoint, and require every loss and variable
    to match within RTOL; returns the transformed graph."""
    ir = transform(original, strategy, train_op=train_op, **options)
    report = equivalence.compare(original, ir, feeds, steps=3, batch_size=batch_size,
                                 rtol=RTOL, train_op=train_op)
    text = equivalence.format_report(report)
    assert report.ok, text
    assert report.losses and all(a is not None and b is not None for a, b in report.losses), text
    return ir


# ------------------------------------------------------------------ the situations
def slim_create_train_op():
    """tf_slim's recipe: the user runs the tensor create_train_op returns (an Identity of the
    total loss with the update as control input, after a CheckNumerics of it)."""
    import tf_slim as slim
    x = v1.placeholder(tf.float32, [None, 6], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    with slim.arg_scope([slim.fully_connected], weights_regularizer=slim.l2_regularizer(1e-3)):
        net = slim.fully_connected(x, 8, scope="fc1")
        logits = slim.fully_connected(net, 3, activation_fn=None, scope="logits")
    slim.losses.softmax_cross_entropy(logits, slim.one_hot_encoding(y, 3))
    total_loss = slim.losses.get_total_loss()
    slim.learning.create_train_op(total_loss, v1.train.MomentumOptimizer(0.1, 0.9),
                                  summarize_gradients=False)


def clip_by_global_norm():
    """compute_gradients, clip_by_global_norm, apply_gradients with a decaying learning rate."""
    loss = mlp_loss()
    global_step = v1.train.get_or_create_global_step()
    rate = v1.train.exponential_decay(0.5, global_step, decay_steps=1, decay_rate=0.7)
    optimizer = v1.train.GradientDescentOptimizer(rate)
    grads, variables = zip(*optimizer.compute_gradients(loss))
    clipped, _ = tf.clip_by_global_norm(grads, clip_norm=0.3)
    optimizer.apply_gradients(zip(clipped, variables), global_step=global_step)


def loss_scaling_skip():
    """A scaled loss, unscaled gradients, and an update only when all of them are finite."""
    loss = mlp_loss()
    global_step = v1.train.get_or_create_global_step()
    optimizer = v1.train.AdamOptimizer(0.05)
    variables = v1.trainable_variables()
    scale = tf.constant(1024.0)
    grads = [g / scale for g in tf.gradients(loss * scale, variables)]
    finite = tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))
    train = v1.cond(finite, lambda: tf.group(optimizer.apply_gradients(
        zip(grads, variables), global_step=global_step)), tf.no_op, name="apply_if_finite")
    v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train)


def gan():
    """Two train ops, each updating its own variables: d_train, then g_train."""
    x = v1.placeholder(tf.float32, [None, 2], name="x")
    z = v1.placeholder(tf.float32, [None, 3], name="z")

    def discriminator(points, reuse):
        with v1.variable_scope("d", reuse=reuse):
            return v1.layers.dense(v1.layers.dense(points, 6, tf.nn.relu, name="h"), 1,
                                   name="out")

    with v1.variable_scope("g"):
        fake = v1.layers.dense(v1.layers.dense(z, 6, tf.nn.relu, name="h"), 2, name="out")
    real_logit, fake_logit = discriminator(x, False), discriminator(fake, True)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = tf.add(tf.reduce_mean(xent(labels=tf.ones_like(real_logit), logits=real_logit)),
                    tf.reduce_mean(xent(labels=tf.zeros_like(fake_logit), logits=fake_logit)),
                    name="d_loss")
    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake_logit), logits=fake_logit),
                            name="g_loss")
    trainable = v1.trainable_variables()
    # epsilon: Adam divides a dead unit's ~1e-9 gradient by its own root mean square, so the
    # order the workers' gradients are summed in moved g/h/bias by 1e-4 (a flaky test)
    v1.train.AdamOptimizer(0.02, beta1=0.5, epsilon=1e-4).minimize(
        d_loss, var_list=[v for v in trainable if v.name.startswith("d/")], name="d_train")
    v1.train.AdamOptimizer(0.02, beta1=0.5, epsilon=1e-4).minimize(
        g_loss, var_list=[v for v in trainable if v.name.startswith("g/")], name="g_train")


def gan_data(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "gan.npz"
    np.savez(path, x=rng.standard_normal([ROWS, 2]).astype(np.float32) + 2.0,
             z=rng.standard_normal([ROWS, 3]).astype(np.float32))
    return str(path)


def resource_assign_add_step():
    """The step is a resource `global_step.assign_add(1)` after the update: it leaves a
    ReadVariableOp that nothing reads, waiting on the train op."""
    loss = mlp_loss()
    global_step = v1.train.get_or_create_global_step()
    update = v1.train.GradientDescentOptimizer(0.3).minimize(loss)
    with tf.control_dependencies([update]):
        global_step.assign_add(1, name="train_op")


def ema_after_step():
    """The inception recipe: the optimizer step, then an ExponentialMovingAverage of the
    weights that waits on it."""
    loss = mlp_loss()
    global_step = v1.train.get_or_create_global_step()
    update = v1.train.MomentumOptimizer(0.2, 0.9).minimize(loss, global_step=global_step)
    ema = v1.train.ExponentialMovingAverage(0.9, num_updates=global_step)
    with tf.control_dependencies([update]):
        tf.group(ema.apply(v1.trainable_variables()), name="train_op")


SITUATIONS = {  # name -> (builder, legacy control flow, train op(s) the user runs)
    "slim_create_train_op": (slim_create_train_op, False, None),
    "clip_by_global_norm": (clip_by_global_norm, False, None),
    "loss_scaling_skip": (loss_scaling_skip, True, None),
    "resource_assign_add_step": (resource_assign_add_step, False, "train_op"),
    "ema_after_step": (ema_after_step, False, "train_op"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("situation", sorted(SITUATIONS))
def test_situation_matches_single_device(situation, strategy, tmp_path):
    make, legacy, train_op = SITUATIONS[situation]
    assert_matches(build(make, legacy), strategy, mlp_data(tmp_path), train_op=train_op)


def test_slim_step_keeps_its_name_and_gives_the_loss(tmp_path):
    original = build(slim_create_train_op)
    ir = transform(original, "ps")
    step = "train_op/control_dependency"
    assert ir.op(step) == "Identity" and not step.startswith("replica_")
    assert ir.op(ir.inputs(step)[0][0]) == "Mean"  # the replicas' mean of the checked loss
    assert "ps_sync/" + step in ir.control_inputs(step)


def test_ema_shadows_update_once_per_step_after_the_update():
    ir = transform(build(ema_after_step), "ps")
    shadows = [n for n in ir.nodes() if n.endswith("ExponentialMovingAverage")
               and ir.op(n) == "VarHandleOp"]
    assert shadows
    for shadow in shadows:
        writes = [d for d, _ in ir.consumers(shadow) if ir.op(d) == "AssignSubVariableOp"]
        assert len(writes) == 1 and not writes[0].startswith("replica_")


def test_dangling_read_of_the_step_waits_on_the_rebuilt_step():
    ir = transform(build(resource_assign_add_step), "ps", train_op="train_op")
    readers = [n for n in ir.control_consumers("train_op") if ir.op(n) == "ReadVariableOp"]
    assert readers  # still there, still after the step
    assert ir.op("ps_sync/train_op") == "AssignAddVariableOp"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_train_ops_run_in_turn_match_single_device(strategy, tmp_path):
    ir = assert_matches(build(gan), strategy, gan_data(tmp_path),
                        train_op=["d_train", "g_train"])
    for step in ("d_train", "g_train"):
        assert step in ir and "ps_sync/" + step in ir
    plan = ClusterPlan.from_ir(ir)
    assert plan.train_ops == ["d_train", "g_train"] and plan.steps == {}


def test_several_train_ops_refused_per_task(run_cli, tmp_path):
    ir = transform(build(gan), "ps", train_op=["d_train", "g_train"])
    path = str(tmp_path / "gan.ps.meta")
    metagraph.save(ir, path)
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(SPEC))
    for args in (("launch", path, "--steps", 1),
                 ("run", path, "--cluster", cluster_file, "--job", "worker", "--task", 0)):
        code, _, err = run_cli(*args)
        assert code == 1 and err.count("\n") == 1, err
        assert "2 train ops (d_train, g_train)" in err and "one client" in err



def keras_dcgan():
    """The TF DCGAN tutorial's models in a TF1 port: tf_keras Dense, BatchNormalization and
    LeakyReLU in the generator and the discriminator, the discriminator called on real and on
    generated points, each minimize under its own model's ``updates``. The discriminator's two
    calls update one moving mean in no order (order-races orders them)."""
    import tf_keras as keras
    layers, init = keras.layers, keras.initializers.GlorotUniform
    x = v1.placeholder(tf.float32, [None, 2], name="x")
    z = v1.placeholder(tf.float32, [None, 3], name="z")
    generator = keras.Sequential([layers.Dense(6, use_bias=False, kernel_initializer=init(1)),
                                  layers.BatchNormalization(), layers.LeakyReLU(0.2),
                                  layers.Dense(2, kernel_initializer=init(2))])
    discriminator = keras.Sequential([layers.Dense(6, kernel_initializer=init(3)),
                                      layers.LeakyReLU(0.2), layers.BatchNormalization(),
                                      layers.Dense(1, kernel_initializer=init(4))])
    real_logit = discriminator(x, training=True)
    fake_logit = discriminator(generator(z, training=True), training=True)
    xent = tf.nn.sigmoid_cross_entropy_with_logits
    d_loss = tf.add(tf.reduce_mean(xent(labels=tf.ones_like(real_logit), logits=real_logit)),
                    tf.reduce_mean(xent(labels=tf.zeros_like(fake_logit), logits=fake_logit)),
                    name="d_loss")
    g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake_logit), logits=fake_logit),
                            name="g_loss")
    # epsilon as gan()'s: a bias whose unit the batch norm after it centres has a ~0 gradient
    for model, loss, name in ((discriminator, d_loss, "d_train"), (generator, g_loss, "g_train")):
        with tf.control_dependencies(model.updates):
            optimizer = v1.train.AdamOptimizer(0.02, beta1=0.5, epsilon=1e-4)
            v1.add_to_collection("train_op", optimizer.minimize(
                loss, var_list=model.trainable_variables, name=name))


def test_moving_statistics_two_calls_update_in_no_order_are_kept_from_replica_0(tmp_path):
    """ps updates batch norm's moving statistics from replica 0's slice and drops the other
    replicas' updates, so the order order-races gave them holds where they remain: the
    transform is accepted (it was refused, naming merge-fetches' stand-ins for the dropped
    updates) and trains like a run of the original in that order. Each batch's halves are the
    same rows, so each worker's batch statistics are the whole batch's."""
    from graphxform import training
    from graphxform.passes.order_races import OrderRaces
    from graphxform.pipeline import PassContext, Pipeline
    original = build(keras_dcgan)
    ir = transform(original, "ps")
    ordered = metagraph.from_metagraph(metagraph.to_metagraph(original))
    Pipeline([OrderRaces()]).run(ordered, PassContext(training=training.analyze(ordered),
                                                      devices=["/cpu:0", "/cpu:1"]))
    rng = np.random.default_rng(1)
    rows = {"x": rng.standard_normal([ROWS // 2, 2]) + 2.0,
            "z": rng.standard_normal([ROWS // 2, 3])}
    path = tmp_path / "halves.npz"  # batch k of 8: rows 4k..4k+3, twice
    np.savez(path, **{key: np.repeat(value.reshape(-1, 4, value.shape[1]), 2, axis=0)
                      .reshape(ROWS, -1).astype(np.float32) for key, value in rows.items()})
    # 1e-4: Adam scales the workers' sums' rounding on the ~0 gradients up to ~2e-5
    report = equivalence.compare(ordered, ir, str(path), steps=3, batch_size=8, rtol=1e-4)
    assert report.ok, equivalence.format_report(report)

def keras_renorm():
    """tf_keras BatchNormalization(renorm=True) in training mode, its updates run with the
    step: tf_keras assigns moving_variance from moving_stddev after that one's update, an
    assign that reads only variables (so it is shared, not a replica's)."""
    import tf_keras as keras
    x = v1.placeholder(tf.float32, [None, 6], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    norm = keras.layers.BatchNormalization(renorm=True, renorm_momentum=0.9, momentum=0.9)
    logits = keras.layers.Dense(3)(tf.nn.relu(norm(keras.layers.Dense(8)(x), training=True)))
    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                        from_logits=True))
    with tf.control_dependencies(norm.updates):
        v1.add_to_collection("train_op", v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_renormalization_statistics_are_kept_from_replica_0(strategy, tmp_path):
    """Renorm's statistics are batch norm's: ps keeps them from replica 0's slice, as it keeps
    moving_mean (refused before: the shared assign of moving_variance reads what only replica
    0's slice reaches). Each batch's halves are the same rows, so it trains like one device."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal([ROWS // 2, 6]) * 2 + 1
    path = tmp_path / "halves.npz"
    np.savez(path, x=np.repeat(x.reshape(-1, 4, 6), 2, axis=0).reshape(ROWS, 6)
             .astype(np.float32), y=np.repeat(classes(rng, x).reshape(-1, 4), 2, axis=0)
             .reshape(ROWS).astype(np.int64))
    original = build(keras_renorm)
    # 1e-4: the workers' sums' rounding on a bias's ~0 gradient, scaled by momentum (~1e-5)
    report = equivalence.compare(original, transform(original, strategy), str(path), steps=3,
                                 batch_size=8, rtol=1e-4)
    assert report.ok, equivalence.format_report(report)
    assert any("batch norm" in reason for reason in report.reasons), report.reasons


# ------------------------------------------------------------------ sparse gradients
def unique_ids_embedding():
    """An embedding whose gradient has one row per distinct id (the lookup goes through
    Unique, as feature columns' sparse lookups do)."""
    ids = v1.placeholder(tf.int64, [None, 3], name="ids")
    y = v1.placeholder(tf.int64, [None], name="y")
    table = v1.get_variable("embedding", [20, 4], use_resource=True,
                            initializer=v1.random_normal_initializer(seed=3))
    distinct, position = tf.unique(tf.reshape(ids, [-1]))
    rows = tf.gather(tf.gather(table, distinct), position)
    pooled = tf.reduce_mean(tf.reshape(rows, [-1, 3, 4]), axis=1)
    logits = v1.layers.dense(pooled, 3, name="logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits),
                          name="loss")
    v1.train.AdagradOptimizer(0.5).minimize(loss)


def uneven_ids(tmp_path, batch=8, slices=4):
    """Batches whose slices (one per replica) hold 1, 2, 5 and 6 distinct ids."""
    rng = np.random.default_rng(2)
    per_slice = batch // slices
    steps = []
    for _ in range(ROWS // batch):
        for distinct in (1, 2, 5, 6):
            pool = rng.choice(20, size=distinct, replace=False)
            block = np.concatenate([pool, rng.choice(pool, 3 * per_slice - distinct)])
            steps.append(rng.permutation(block).reshape(per_slice, 3))
    ids = np.concatenate(steps)[:ROWS]
    path = tmp_path / "ids.npz"
    np.savez(path, ids=ids.astype(np.int64), y=rng.integers(0, 3, ROWS).astype(np.int64))
    return str(path), ids


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_gradients_with_different_row_counts_aggregate_exactly(strategy, tmp_path):
    feeds, ids = uneven_ids(tmp_path)
    counts = {len(np.unique(ids[k:k + 2])) for k in range(0, 8, 2)}
    assert counts == {1, 2, 5, 6}  # every replica's slice of step 1 differs in length
    devices = [f"/job:worker/task:{w}/device:CPU:{r}" for w in range(2) for r in range(2)]
    ir = assert_matches(build(unique_ids_embedding), strategy, feeds, devices=devices)
    accumulators = [n for n in ir.nodes() if ir.op(n) == "SparseConditionalAccumulator"]
    assert accumulators and all(n.startswith("embedding") for n in accumulators)


# ------------------------------------------------------------------ partitions
def cnn_with_small_variables():
    """A 1x1 convolution (one row) and a 3-element bias beside a bigger kernel."""
    x = v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    net = v1.layers.conv2d(x, 3, 1, name="pointwise")  # kernel [1, 1, 2, 3], bias [3]
    net = v1.layers.conv2d(net, 4, 3, padding="same", activation=tf.nn.relu, name="conv")
    logits = v1.layers.dense(tf.reshape(net, [-1, 64]), 3, name="logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits),
                          name="loss")
    v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)


def test_partitioned_cnn_splits_small_variables_into_their_rows(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.standard_normal([ROWS, 4, 4, 2]).astype(np.float32)
    feeds = tmp_path / "cnn.npz"
    np.savez(feeds, x=x, y=classes(rng, x).astype(np.int64))
    ir = assert_matches(build(cnn_with_small_variables), "partitioned-ps", str(feeds),
                        partitions=4)
    assert "pointwise/kernel" in ir  # one row: whole
    assert [f"pointwise/bias/part_{k}" in ir for k in range(4)] == [True] * 3 + [False]
    assert all(f"conv/kernel/part_{k}" in ir for k in range(3))  # 3 rows of a 3x3 kernel
    assert all(f"logits/kernel/part_{k}" in ir for k in range(4))


def test_partitions_must_be_at_least_one():
    original = build(cnn_with_small_variables)
    with pytest.raises(GraphxformError, match="--partitions must be at least 1, not 0"):
        transform(original, "partitioned-ps", partitions=0)


# ------------------------------------------------------------------ the corpus
INEXACT = sorted(name for name, entry in MANIFEST.items() if not entry["exact"])


def corpus_params():
    return [pytest.param(name, strategy, marks=[pytest.mark.slow] if name in SLOW_RECIPES
                         else []) for name in EXACT for strategy in STRATEGIES]


@pytest.mark.parametrize("name, strategy", corpus_params())
def test_exact_recipe_matches_single_device(name, strategy):
    entry = MANIFEST[name]
    original = metagraph.load(recipe_meta(name))
    assert_matches(original, strategy, recipe_meta(name).replace(".meta", ".npz"),
                   train_op=entry["train_ops"], batch_size=entry["batch_size"])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", INEXACT)
def test_inexact_recipe_trains_and_the_reason_is_named(name, strategy):
    """Batch norm and dropout cannot match step for step; the graph still trains and verify
    says why."""
    entry = MANIFEST[name]
    original = metagraph.load(recipe_meta(name))
    ir = transform(original, strategy, train_op=entry["train_ops"])
    report = equivalence.compare(original, ir, recipe_meta(name).replace(".meta", ".npz"),
                                 steps=3, batch_size=entry["batch_size"],
                                 train_op=entry["train_ops"])
    assert all(np.isfinite(b) for _, b in report.losses), equivalence.format_report(report)
    reasons = " ".join(report.reasons)
    for why in entry["inexact_because"]:
        word = "random" if why in ("dropout", "sampled softmax") else why.split()[0]
        assert word in reasons, f"{name}: no reason names {why}: {reasons}"


# ------------------------------------------------------------------ colocation with an input
def map_fn_over_the_input():
    """TF1's map_fn (legacy control flow) over the fed batch: TF colocates the TensorArray the
    batch is scattered into with the placeholder (``_class: loc:@x``), and so does a
    ``colocate_with(x)`` block of preprocessing."""
    x = v1.placeholder(tf.float32, [None, 6], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    per_example = tf.map_fn(lambda row: tf.tanh(row) * 2.0, x)
    with v1.colocate_with(x):
        scaled = x * 0.5
    v1.train.GradientDescentOptimizer(0.1).minimize(
        tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=mlp_logits(tf.concat([per_example, scaled], 1)))),
        colocate_gradients_with_ops=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_copies_colocated_with_an_input_run_on_their_own_task(strategy, tmp_path):
    """A replica's copy kept its colocation with the fed placeholder on worker 0 while pinned
    to its own worker: apply exited 0 and TensorFlow refused to place the graph ("Cannot
    colocate nodes ... incompatible tasks"), reported as an internal error."""
    ir = assert_matches(build(map_fn_over_the_input, legacy=True), strategy,
                        mlp_data(tmp_path))
    assert not any(b"loc:@x" in ir.attrs(n).get("_class", v1.AttrValue()).list.s
                   for n in ir.nodes() if n.startswith("replica_"))


def _statistic_after_step(of):
    """A step whose train op is a moving average, updated after the optimizer's step
    (control_dependencies on it), of the loss (``of`` "loss": ExponentialMovingAverage.apply)
    or of the mean of the model's activations (``of`` "activations": a plain assign)."""
    def step(x, y):
        tf1 = tf.compat.v1
        logits = tf.matmul(x, tf1.get_variable("w0", [8, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        opt = tf1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        with tf.control_dependencies([opt]):
            if of == "loss":
                return tf1.train.ExponentialMovingAverage(0.9).apply([loss])
            moving = tf1.get_variable("moving", [], trainable=False,
                                      initializer=tf1.zeros_initializer())
            return tf1.assign(moving, 0.9 * moving + 0.1 * tf.reduce_mean(tf.nn.relu(logits)))
    return step


@pytest.mark.parametrize("of", ["loss", "activations"])
def test_a_moving_average_after_the_step_reads_every_replica(run_cli, tmp_path, of):
    """The update region runs once per step and read replica 0's loss (or its slice's
    activations): refused ('reads Mean:0, which each replica computes'). It now reads the
    replicas' copies combined (averaged, concatenated), one device's value; one process per
    task cannot compute that, so the plan says one client only."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", _statistic_after_step(of))
    spec = tmp_path / "cluster.json"
    spec.write_text('{"ps": ["127.0.0.1:27111"], "worker": ["127.0.0.1:27112", '
                    '"127.0.0.1:27113"]}')
    code, out, err = run_cli("verify", "--strategy", "ps", "--cluster", spec, model,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out
    code, _, err = run_cli("apply", "--strategy", "ps", "--cluster", spec, model,
                           "-o", tmp_path / "o.meta")
    assert code == 0, err
    found = metagraph.load(str(tmp_path / "o.meta"))
    from graphxform.plan import CLUSTER_COLLECTION
    text = found.meta.collection_def[CLUSTER_COLLECTION].bytes_list.value[0].decode()
    assert "of every replica combined" in ClusterPlan.from_json(text).one_client_only
