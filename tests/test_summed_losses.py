"""Losses summed over the batch, as public recipes write them, train like one device under
every synchronous strategy (passes/summed_losses.py: each replica's gradient seed fills with
N, so the averaged gradients are the replicas' sum)."""

import pytest
from conftest import export_classifier as _export


def _dense(x, units, name, activation=None):
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf1.variable_scope(name):
        w = tf1.get_variable("w", [x.shape[-1], units],
                             initializer=tf1.glorot_uniform_initializer(seed=len(name)))
        b = tf1.get_variable("b", [units], initializer=tf1.zeros_initializer())
    h = tf.matmul(x, w) + b
    return activation(h) if activation else h


def reduction_sum(x, y):
    """tf.compat.v1.losses with reduction=SUM."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    logits = _dense(_dense(x, 16, "hidden", tf.nn.relu), 2, "logits")
    loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, reduction=tf1.losses.Reduction.SUM)
    return tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss)


def ptb_sum_over_batch_size(x, y):
    """The TF1 PTB language model's cost: the per-example losses summed, divided by the
    Python batch size the model was built for."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    batch_size = 16
    per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=_dense(_dense(x, 16, "hidden", tf.nn.tanh), 2, "logits"))
    cost = tf.reduce_sum(per_example) / batch_size
    optimizer = tf1.train.GradientDescentOptimizer(0.5)
    grads, _ = tf.clip_by_global_norm(tf.gradients(cost, tf1.trainable_variables()), 5.0)
    return optimizer.apply_gradients(zip(grads, tf1.trainable_variables()),
                                     global_step=tf1.train.get_or_create_global_step())


def vae_summed(x, y):
    """A TF1 variational autoencoder: reconstruction error and KL divergence summed over the
    batch, the reparameterisation's noise drawn per example."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    hidden = _dense(x, 16, "encoder", tf.nn.relu)
    mean, log_var = _dense(hidden, 2, "mean"), _dense(hidden, 2, "log_var")
    z = mean + tf.exp(0.5 * log_var) * tf1.random_normal(tf.shape(mean), seed=3)
    reconstruction = _dense(_dense(z, 16, "decoder", tf.nn.relu), 8, "reconstruction")
    loss = (tf.reduce_sum(tf.square(reconstruction - x))
            - 0.5 * tf.reduce_sum(1 + log_var - tf.square(mean) - tf.exp(log_var)))
    return tf1.train.AdamOptimizer(1e-3).minimize(loss)


RECIPES = {"reduction_sum": reduction_sum, "ptb": ptb_sum_over_batch_size,
           "vae": vae_summed}


def _where(strategy, tmp_path) -> list:
    if strategy not in ("ps", "hybrid", "partitioned-ps"):
        return ["--replicas", 2]
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}')
    return ["--cluster", cluster]


CASES = [(recipe, strategy) for recipe in ("reduction_sum", "ptb")
         for strategy in ("allreduce", "replicated", "ps", "hybrid")]
CASES += [("vae", "allreduce"), ("vae", "replicated")]  # with --consistent-random


@pytest.mark.parametrize("recipe, strategy", CASES)
def test_a_loss_summed_over_the_batch_trains_like_one_device(run_cli, tmp_path, recipe,
                                                             strategy):
    model = _export(tmp_path / "m.meta", RECIPES[recipe])
    random = ["--consistent-random"] if recipe == "vae" else []
    code, out, err = run_cli("verify", "--strategy", strategy, *_where(strategy, tmp_path),
                             *random, model, "--feeds", model + ".npz", "--batch-size", 16)
    assert code == 0, out + err
    assert "PASS" in out, out


@pytest.mark.parametrize("target, listed", [("mean", "sum"), ("sum", "mean")])
def test_a_tape_whose_target_is_not_the_listed_loss_is_refused(run_cli, tmp_path, target,
                                                                listed):
    """A tape's seed is rescaled only where it starts the listed loss's gradient, and a tape's
    gradients are combined only where its target is shown to be the listed loss: a tape of the
    batch's sum beside a listed mean was averaged as the mean's (apply exited 0, verify failed
    by 4.7e-01), and a tape of the mean beside a listed sum would have been scaled by N."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=_dense(x, 2, "logits"))
            losses = {"mean": tf.reduce_mean(per_example), "sum": tf.reduce_sum(per_example)}
        tf1.add_to_collection("losses", losses[listed])
        variables = tf1.trainable_variables()
        return tf1.train.GradientDescentOptimizer(0.01).apply_gradients(
            zip(tape.gradient(losses[target], variables), variables))
    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and "the tape's target cannot be shown to be the loss" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_summed_loss_plus_weight_decay_is_refused(run_cli, tmp_path):
    """sum(l) + c * l2(w): a replica's copy is its slice's sum plus the whole penalty, so
    neither the sum nor the mean of the replicas' gradients is one device's."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=_dense(x, 2, "logits")))
        decay = tf.add_n([tf.nn.l2_loss(v) for v in tf1.trainable_variables()])
        return tf1.train.GradientDescentOptimizer(0.01).minimize(loss + 0.1 * decay)
    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and "a sum over the batch, to terms that are not" in err, err
    assert "weight decay" in err and len(err.strip().splitlines()) == 1


def _mean_loss_seeded_by(given):
    """A mean cross-entropy whose tf.gradients call is given ``given(per_example, x)`` as
    grad_ys."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=_dense(x, 2, "logits"))
        loss = tf.reduce_mean(per_example)
        variables = tf1.trainable_variables()
        grads = tf.gradients(loss, variables, grad_ys=given(per_example, x))
        return tf1.train.GradientDescentOptimizer(0.1).apply_gradients(zip(grads, variables))
    return build


@pytest.mark.parametrize("given, name", [
    (lambda p, x: 1.0 / __import__("tensorflow").reduce_max(abs(p)), "truediv"),
    (lambda p, x: __import__("tensorflow").reduce_mean(x[:, 0]), "Mean_1")],
    ids=["batch_max", "batch_mean"])
def test_a_mean_loss_seeded_by_a_batch_statistic_is_refused(run_cli, tmp_path, given, name):
    """grad_ys read from the batch seeds each replica's gradients with its own slice's
    statistic: apply exited 0 and verify FAILed (by 2.0e-02 for the max)."""
    model = _export(tmp_path / "m.meta", _mean_loss_seeded_by(given))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and f"grad_ys '{name}'" in err and "statistic of the batch" in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_mean_loss_seeded_by_a_constant_trains_like_one_device(run_cli, tmp_path):
    import tensorflow as tf
    model = _export(tmp_path / "m.meta", _mean_loss_seeded_by(lambda p, x: tf.constant(2.0)))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0 and "PASS" in out, out + err


def test_a_penalty_on_the_rows_the_batch_looks_up_names_the_form_that_trains(run_cli,
                                                                           tmp_path):
    """A factorization machine's l2_loss of the embedding rows looked up for the batch is a
    sum over it, added to a mean: refused naming the L2Loss and saying what trains (that
    penalty divided by the batch size, which verifies)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(divided):
        def step(x, y):
            ids = tf.cast(tf.abs(x[:, 0]) * 3, tf.int64) % 10
            rows = tf.nn.embedding_lookup(tf1.get_variable("emb", [10, 4]), ids)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=_dense(tf.concat([x, rows], 1), 2, "logits")))
            penalty = tf.nn.l2_loss(rows)
            if divided:
                penalty = penalty / tf.cast(tf.shape(ids)[0], tf.float32)
            return tf1.train.GradientDescentOptimizer(0.1).minimize(loss + 0.01 * penalty)
        return step
    model = _export(tmp_path / "m.meta", build(False))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and "adds 'mul_1', a sum over the batch" in err
    assert "term (a multiple of 'L2Loss', L2Loss) a mean" in err, err
    assert "tf.shape(ids)[0]" in err and len(err.strip().splitlines()) == 1
    model = _export(tmp_path / "d.meta", build(True))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0 and "PASS" in out, out + err
