"""The classic TF1 batch-norm helper (tf.nn.moments, an ExponentialMovingAverage of its mean and
variance, tf.nn.batch_normalization, under tf.cond(phase_train, ...) or not) under allreduce.
Its averages are named after its tensors (moments/Squeeze/ExponentialMovingAverage), not
moving_mean: without --sync-batch-norm they were taken for other state the replicas must keep
equal and refused, and with it the contract saw the synced moments as the replica's own (their
shapes came from the replica's tensors) and refused too. They are batch norm's moving
statistics, found by structure (graphxform/moving_statistics.py): per replica as tf_keras'
(verify names batch norm), one device's with --sync-batch-norm (verify PASS)."""

import numpy as np
import pytest

from conftest import export_classifier

TOLERANCE = 1e-4
FORMS = ["cond_v2", "cond_legacy", "no_cond"]


def _helper(form, penalty=False):
    """A step through the helper: ``form`` is how it picks the statistics; ``penalty``: what
    is trained also reads the moving mean (then it is no batch norm's moving statistic)."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        if form == "cond_legacy":
            tf1.disable_control_flow_v2()
        try:
            w = tf1.get_variable("w", [8, 6], initializer=tf1.glorot_uniform_initializer(seed=1))
            h = tf.nn.relu(tf.matmul(x, w))
            beta = tf.Variable(tf.zeros([6]), name="beta")
            gamma = tf.Variable(tf.ones([6]), name="gamma")
            mean, var = tf.nn.moments(h, [0], name="moments")
            ema = tf1.train.ExponentialMovingAverage(decay=0.5)
            updates = []
            if form == "no_cond":
                updates.append(ema.apply([mean, var]))
            else:
                phase_train = tf1.placeholder_with_default(True, [], name="phase_train")

                def with_update():
                    with tf.control_dependencies([ema.apply([mean, var])]):
                        return tf.identity(mean), tf.identity(var)
                mean, var = tf.cond(phase_train, with_update,
                                    lambda: (ema.average(mean), ema.average(var)))
            normed = tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
            v = tf1.get_variable("v", [6, 2], initializer=tf1.glorot_uniform_initializer(seed=2))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(normed, v)))
            if penalty:  # (form "no_cond"): its gradient reads the average
                loss += 0.01 * tf.reduce_sum(tf.square(ema.average(mean) - beta))
            with tf.control_dependencies(updates):
                return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(
                    loss, global_step=tf1.train.get_or_create_global_step())
        finally:
            if form == "cond_legacy":
                tf1.enable_control_flow_v2()
    return build


AVERAGES = ["moments/Squeeze/ExponentialMovingAverage",
            "moments/Squeeze_1/ExponentialMovingAverage"]


def _spread_out(model):
    """Give the two halves of the pool different scales, so each replica's slice has other
    moments than the global batch's."""
    pool = dict(np.load(model + ".npz"))
    pool["x"][::2] *= 3.0
    np.savez(model + ".npz", **pool)
    return model


@pytest.mark.parametrize("form", FORMS)
def test_the_helper_s_averages_are_batch_norm_s_by_structure(tmp_path, form):
    from graphxform import metagraph, training
    model = export_classifier(tmp_path / "m.meta", _helper(form))
    tg = training.analyze(metagraph.load(model))
    assert {name: tg.variables[name].moving_statistic for name in AVERAGES} == \
        dict.fromkeys(AVERAGES, "structure")


@pytest.mark.parametrize("form", FORMS)
def test_the_helper_trains_exactly_with_sync_batch_norm(run_cli, tmp_path, form):
    """The synced moments are the global batch's in every replica, so the averages are one
    device's: the contract proves it and verify compares them."""
    model = _spread_out(export_classifier(tmp_path / "m.meta", _helper(form)))
    code, out, err = run_cli("verify", "--replicas", 2, "--sync-batch-norm", model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3,
                             "--rtol", TOLERANCE)
    assert code == 0 and "PASS" in out, out + err
    assert all(name in out for name in AVERAGES)


@pytest.mark.parametrize("form", ["cond_v2", "no_cond"])
def test_the_helper_without_sync_batch_norm_is_tf_keras_batch_norm(run_cli, tmp_path, form):
    """Accepted (was refused naming the average); each replica keeps its own averages, and
    verify says batch norm is why it cannot match, naming the option."""
    model = _spread_out(export_classifier(tmp_path / "m.meta", _helper(form)))
    code, out, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 0, err
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 2)
    assert code == 1 and "batch norm in training mode" in out, out + err
    assert "--sync-batch-norm" in out and "Traceback" not in err


def test_an_average_the_loss_reads_is_no_moving_statistic(tmp_path):
    """The same average, also read by what is trained (a penalty pulling beta towards it), is
    state the step moves from the batch (global-state keeps it one device's), not batch
    norm's: each replica's own copy would train beta apart."""
    from graphxform import metagraph, training
    model = export_classifier(tmp_path / "m.meta", _helper("no_cond", penalty=True))
    tg = training.analyze(metagraph.load(model))
    assert tg.variables[AVERAGES[0]].moving_statistic is None
    assert tg.variables[AVERAGES[1]].moving_statistic == "structure"


def test_a_running_average_of_the_loss_is_no_moving_statistic(tmp_path):
    """An ExponentialMovingAverage of the loss that the loss reads (a running baseline) beside
    the helper's batch norm."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        w = tf1.get_variable("w", [8, 2], initializer=tf1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)
        mean, var = tf.nn.moments(h, [0], name="moments")
        ema = tf1.train.ExponentialMovingAverage(decay=0.5)
        normed = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
        ce = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                           logits=normed))
        update = ema.apply([ce, mean])
        loss = ce - 0.1 * ema.average(ce)
        with tf.control_dependencies([update]):
            return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    from graphxform import metagraph, training
    model = export_classifier(tmp_path / "m.meta", build)
    tg = training.analyze(metagraph.load(model))
    marks = {name: v.moving_statistic for name, v in tg.variables.items()
             if "ExponentialMovingAverage" in name}
    assert marks == {"Mean/ExponentialMovingAverage": None,
                     "moments/Squeeze/ExponentialMovingAverage": "structure"}, marks


def _keras_in_a_legacy_cond(x, y):
    """tf_keras BatchNormalization on a training flag that is a tensor, with control flow v1:
    its updates run inside legacy conds."""
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    import tf_keras
    tf1 = tf.compat.v1
    tf1.disable_control_flow_v2()
    try:
        hidden = tf_keras.layers.Dense(6)(x)
        norm = tf_keras.layers.BatchNormalization()
        hidden = norm(hidden, training=tf1.placeholder_with_default(True, [], name="training"))
        logits = tf_keras.layers.Dense(2)(tf.nn.relu(hidden))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        with tf.control_dependencies(norm.updates):
            return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    finally:
        tf1.enable_control_flow_v2()


@pytest.mark.parametrize("build", [_helper("cond_legacy"), _keras_in_a_legacy_cond],
                         ids=["helper", "tf_keras"])
def test_ps_keeps_legacy_conds_importable(run_cli, tmp_path, build):
    """ps updates the moving statistics from replica 0 alone and removes the other replicas'
    updates, which here sit inside legacy conds: their cond contexts still named the removed
    tensors, and the emitted graph failed in import_meta_graph (apply exited 0)."""
    import json
    import tensorflow as tf
    model = export_classifier(tmp_path / "m.meta", build)
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"ps": ["127.0.0.1:28601"],
                                "worker": ["127.0.0.1:28602", "127.0.0.1:28603"]}))
    code, out, err = run_cli("apply", "--strategy", "ps", "--cluster", spec, model,
                             "-o", tmp_path / "out.meta")
    assert code == 0, err
    with tf.Graph().as_default():
        tf.compat.v1.train.import_meta_graph(str(tmp_path / "out.meta"))
