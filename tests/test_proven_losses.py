"""Losses public code writes that batch_mixing used to leave unknown and now proves a mean of
per-example terms (graphxform/batch_mixing.py, graphxform/sampled_logits.py): tf.nn.nce_loss and
sampled_softmax_loss's one lookup of the true and sampled classes, tf_keras' batch norm in a
cond on the learning phase, fake quantisation, tf.random.Generator draws and categorical
draws, tf.gather with batch_dims. Each has a twin the flow must not prove: the same structure
used so that examples meet, or that no rule shows keeps them apart."""

import numpy as np
import pytest
from conftest import dense, export_classifier

REPLICAS = ["/device:CPU:0", "/device:CPU:1"]


def loss_state(path: str, loss: str):
    from graphxform import batch_mixing, metagraph, training
    ir = metagraph.load(path)
    tg = training.analyze(ir)
    return batch_mixing.loss_state(ir, loss, tg.batch_sources)


def export(tmp_path, build, batch=None, name="m") -> str:
    """conftest's classifier (x [batch, 8], y [batch]) minimising ``build(x, y)``, named
    ``loss``, by plain SGD."""
    def step(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        loss = tf.identity(build(x, y), name="loss")
        tf1.add_to_collection("losses", loss)
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return export_classifier(tmp_path / f"{name}.meta", step, batch)


def mean_cross_entropy(labels, logits):
    import tensorflow as tf
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                        logits=logits))


def nce(x, y, num_true=1, sampled=True, remove_accidental_hits=False):
    import tensorflow as tf
    tf1 = tf.compat.v1
    weights = tf1.get_variable("nce_w", [10, 4])
    biases = tf1.get_variable("nce_b", [10], initializer=tf1.zeros_initializer())
    labels = tf.reshape(y, [-1, 1])
    if num_true == 2:
        labels = tf.concat([labels, (labels + 1) % 10], 1)
    loss = (tf.nn.sampled_softmax_loss if sampled else tf.nn.nce_loss)(
        weights=weights, biases=biases, labels=labels, inputs=dense(x, 4, "embed"),
        num_sampled=3, num_classes=10, num_true=num_true,
        remove_accidental_hits=remove_accidental_hits)
    return tf.reduce_mean(loss)


@pytest.mark.parametrize("num_true", [1, 2])
@pytest.mark.parametrize("sampled", [False, True], ids=["nce", "sampled_softmax"])
def test_one_lookup_of_true_and_sampled_classes_is_proven(tmp_path, num_true, sampled):
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, lambda x, y: nce(x, y, num_true, sampled))
    assert loss_state(path, "loss:0") == AGGREGATE


def test_sampled_softmax_as_its_docs_call_it_is_proven(tmp_path):
    """With its default remove_accidental_hits=True: a mask of each example's own hits."""
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, lambda x, y: nce(x, y, 2, True, remove_accidental_hits=True))
    assert loss_state(path, "loss:0") == AGGREGATE


def hits_of_the_next_example(x, y):
    """The accidental-hits mask with each hit moved to the next example's row."""
    import tensorflow as tf
    labels = tf.reshape(y, [-1, 1])
    sampled = tf.constant([1, 2, 3], tf.int64)
    rows, ids, weights = tf.nn.compute_accidental_hits(labels, sampled, 1)
    rows = (rows + 1) % tf.shape(labels)[0]
    mask = tf.sparse.to_dense(tf.sparse.reorder(tf.SparseTensor(
        tf.cast(tf.stack([rows, tf.cast(ids, tf.int32)], 1), tf.int64), weights,
        tf.cast(tf.stack([tf.shape(labels)[0], 3]), tf.int64))))
    logits = dense(x, 3, "out") + tf.maximum(mask, -1e3)
    return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=tf.ones([1, 3]) / 3,
                                                                  logits=logits))


def test_hits_moved_to_another_example_are_not_proven(tmp_path):
    from graphxform.batch_states import AGGREGATE
    assert loss_state(export(tmp_path, hits_of_the_next_example), "loss:0") != AGGREGATE


def test_the_word2vec_tutorial_s_fixed_batch_is_proven():
    """TensorFlow folded tf.shape(labels) into constants there (split-inputs rewrites them)."""
    from conftest import fixture_path

    from graphxform.batch_states import AGGREGATE
    assert loss_state(fixture_path("recipes/word2vec_basic"), "loss/Mean:0") == AGGREGATE


def stacked_sliced_at(rows: str):
    """The lookup nce_loss makes, cut at the wrong row: one row too few (an example's weights
    then sit with the sampled ones), or at the sampled part's size."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        table = tf1.get_variable("table", [10, 8])
        sampled = tf.constant([1, 2, 3], tf.int64)
        looked = tf.nn.embedding_lookup(table, tf.concat([y, sampled], 0))
        count = tf.shape(y)[0] - 1 if rows == "one_too_few" else tf.shape(sampled)[0]
        mine = tf.slice(looked, tf.stack([0, 0]), tf.stack([count, -1]))
        return tf.reduce_mean(tf.reduce_sum(mine * x[:tf.shape(mine)[0]], 1))
    return build


@pytest.mark.parametrize("rows", ["one_too_few", "sampled_size"])
def test_a_lookup_cut_elsewhere_is_not_proven(tmp_path, rows):
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, stacked_sliced_at(rows))
    assert loss_state(path, "loss:0") != AGGREGATE


def test_nce_loss_trains_like_one_device(run_cli, tmp_path):
    path = export(tmp_path, lambda x, y: nce(x, y, 2, False))
    code, out, err = run_cli("verify", path, "--replicas", 2, "--feeds", path + ".npz",
                             "--batch-size", 8, "--steps", 2)
    assert code == 0 and "PASS" in out, out + err


def keras_batch_norm_in_a_cond(x, y):
    """tf_keras' BatchNormalization called in a TF1 graph without a training flag: its
    statistics come from a cond on the learning phase (the batch's, or the moving ones)."""
    import tensorflow as tf
    import tf_keras
    h = tf_keras.layers.BatchNormalization()(dense(x, 16, "hidden"))
    logits = dense(tf.nn.relu(h), 10, "out")
    return mean_cross_entropy(y, logits)


@pytest.mark.parametrize("legacy", [False, True], ids=["cond_v2", "legacy_cond"])
def test_batch_norm_in_a_cond_on_the_learning_phase_is_proven(tmp_path, legacy):
    import tensorflow as tf

    from graphxform.batch_states import AGGREGATE
    if legacy:
        tf.compat.v1.disable_control_flow_v2()
    try:
        path = export(tmp_path, keras_batch_norm_in_a_cond)
    finally:
        tf.compat.v1.enable_control_flow_v2()
    assert loss_state(path, "loss:0") == AGGREGATE


def a_cond_on_the_learning_phase_of(branch: str):
    """A cond on a fed flag whose true branch subtracts the batch's mean from each example
    (mixing), or whose branches both keep each example apart."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        flag = tf1.placeholder_with_default(True, [], name="flag")
        h = dense(x, 10, "out")
        centred = h - tf.reduce_mean(h, 0) if branch == "batch_mean" else h * 2.0
        logits = tf.cond(flag, lambda: centred, lambda: h)
        return mean_cross_entropy(y, logits)
    return build


def test_a_cond_whose_branch_mixes_is_refused(tmp_path):
    from graphxform import metagraph, strategies
    from graphxform.errors import GraphxformError
    path = export(tmp_path, a_cond_on_the_learning_phase_of("batch_mean"))
    with pytest.raises(GraphxformError, match="mixes the examples"):
        strategies.transform(metagraph.load(path), "allreduce", devices=REPLICAS)
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, a_cond_on_the_learning_phase_of("per_example"), name="apart")
    assert loss_state(path, "loss:0") == AGGREGATE


def fake_quant(bounds: str):
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        h = tf.nn.relu(dense(x, 16, "hidden"))
        if bounds == "variables":
            low = tf1.get_variable("q_min", [], initializer=tf1.constant_initializer(-6.0),
                                   trainable=False)
            high = tf1.get_variable("q_max", [], initializer=tf1.constant_initializer(6.0),
                                    trainable=False)
        else:  # the batch's own range
            low, high = tf.reduce_min(h), tf.reduce_max(h)
        h = tf.quantization.fake_quant_with_min_max_vars(h, low, high)
        logits = dense(h, 10, "out")
        return mean_cross_entropy(y, logits)
    return build


def test_fake_quantisation_between_variables_is_proven(tmp_path):
    from graphxform.batch_states import AGGREGATE
    assert loss_state(export(tmp_path, fake_quant("variables")), "loss:0") == AGGREGATE


def test_fake_quantisation_to_the_batch_s_range_is_not_proven(tmp_path):
    from graphxform.batch_states import AGGREGATE
    assert loss_state(export(tmp_path, fake_quant("batch")), "loss:0") != AGGREGATE


def generator_noise(x, y):
    import tensorflow as tf
    noise = tf.random.Generator.from_seed(3).normal(tf.shape(x))
    logits = dense(x + 0.01 * noise, 10, "out")
    return mean_cross_entropy(y, logits)


def categorical_actions(x, y):
    """REINFORCE as its tutorials write it: actions drawn from the policy's own logits."""
    import tensorflow as tf
    logits = dense(x, 10, "policy")
    actions = tf.stop_gradient(tf.random.categorical(logits, 1)[:, 0])
    return mean_cross_entropy(actions, logits)


@pytest.mark.parametrize("build", [generator_noise, categorical_actions])
def test_random_draws_per_example_are_proven(tmp_path, build):
    from graphxform.batch_states import AGGREGATE
    assert loss_state(export(tmp_path, build), "loss:0") == AGGREGATE


def last_output(source: str):
    """Each sequence's output at its own last position (gather with batch_dims=1), or at
    positions taken from another example (the batch's lengths reversed)."""
    def build(x, y):
        import tensorflow as tf
        outputs = tf.reshape(dense(x, 20, "rnn_like"), [-1, 4, 5])
        lengths = tf.cast(tf.abs(x[:, 0]) * 3, tf.int32) % 4 + 1
        if source == "another_example":
            lengths = tf.reverse(lengths, [0])
        last = tf.gather(outputs, lengths - 1, batch_dims=1, axis=1)
        logits = dense(last, 10, "out")
        return mean_cross_entropy(y, logits)
    return build


def test_a_gather_within_each_example_is_proven(tmp_path):
    from graphxform.batch_states import AGGREGATE
    assert loss_state(export(tmp_path, last_output("own")), "loss:0") == AGGREGATE


def test_a_gather_by_another_example_s_positions_is_refused(tmp_path):
    from graphxform import metagraph, strategies
    from graphxform.errors import GraphxformError
    path = export(tmp_path, last_output("another_example"))
    with pytest.raises(GraphxformError, match="ReverseV2"):
        strategies.transform(metagraph.load(path), "allreduce", devices=REPLICAS)


def unrolled_rnn(first_state: str):
    """The PTB tutorial's shape of model: a fixed batch, an RNN unrolled with plain ops from a
    first state of zeros (each example meets the same row), or from a constant whose rows
    differ (example i would meet row i, which no replica's slice has)."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        batch = x.shape[0]
        h = (tf.zeros([batch, 6]) if first_state == "zeros" else
             tf.constant(np.arange(batch * 6, dtype=np.float32).reshape(batch, 6) / 50))
        kernel = tf1.get_variable("cell", [4 + 6, 6])
        for t in range(2):
            h = tf.tanh(tf.matmul(tf.concat([x[:, 4 * t:4 * t + 4], h], 1), kernel))
        logits = dense(h, 10, "out")
        return mean_cross_entropy(y, logits)
    return build


def test_a_zero_first_state_of_a_fixed_batch_is_proven(run_cli, tmp_path):
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, unrolled_rnn("zeros"), batch=8)
    assert loss_state(path, "loss:0") == AGGREGATE
    code, out, err = run_cli("verify", path, "--replicas", 2, "--feeds", path + ".npz",
                             "--batch-size", 8, "--steps", 2)
    assert code == 0 and "PASS" in out, out + err


def test_a_first_state_whose_rows_differ_is_not_proven(tmp_path):
    from graphxform.batch_states import AGGREGATE
    path = export(tmp_path, unrolled_rnn("rows_differ"), batch=8)
    assert loss_state(path, "loss:0") != AGGREGATE
