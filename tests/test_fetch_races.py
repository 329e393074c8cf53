"""Reads of a variable that race with the step's update of it in the original graph
(graphxform/fetch_races.py), and verify naming them instead of blaming the transformation."""

import pytest
import tensorflow as tf
from conftest import export_classifier
from recipe_loop import load_manifest, recipe_meta
from test_custom_training_code import dense

from graphxform import equivalence, fetch_races, metagraph, strategies, training

tf1 = tf.compat.v1


def uncertainty_weighted(weight_decay=False):
    """Kendall et al.'s multi-task weighting as its papers' code writes it: exp(-s) * L + s per
    task, s a trainable log-variance; the `+ s` term's gradient is 1 and needs no read of s."""
    def build(x, y):
        h = dense(x, 6, "hidden", tf.nn.tanh)
        logits, value = dense(h, 2, "logits"), dense(h, 1, "value")[:, 0]
        task1 = tf1.losses.sparse_softmax_cross_entropy(y, logits)
        task2 = tf.reduce_mean(tf.square(value - tf.cast(y, tf.float32)))
        s1 = tf1.get_variable("log_var_cls", [], initializer=tf1.zeros_initializer())
        s2 = tf1.get_variable("log_var_reg", [], initializer=tf1.zeros_initializer())
        if weight_decay:  # a read whose gradient (w itself) the update needs: ordered
            loss = task1 + task2 + 1e-3 * tf.add_n([tf.nn.l2_loss(v) for v in (s1, s2)])
        else:
            loss = tf.exp(-s1) * task1 + s1 + tf.exp(-s2) * task2 + s2
        return tf1.train.AdamOptimizer(0.05).minimize(tf.identity(loss, name="loss"))
    return build


def races_of(tmp_path, build):
    ir = metagraph.load(export_classifier(tmp_path / "m.meta", build))
    return fetch_races.races(ir, training.analyze(ir))


def test_a_variable_term_of_the_loss_races_with_its_update(tmp_path):
    found = races_of(tmp_path, uncertainty_weighted())
    assert {(r.fetch, r.variable) for r in found} == {("loss:0", "log_var_cls"),
                                                      ("loss:0", "log_var_reg")}
    assert all(r.update.endswith("ResourceApplyAdam") for r in found)
    assert races_of(tmp_path, uncertainty_weighted(weight_decay=True)) == []


def dqn(soft_update_in_step):
    """A DQN step: the Q-network's Huber loss against targets from a target network; the soft
    update of the target either grouped into the train op, as many tutorials write it, or run
    on its own after it."""
    def build(x, y):
        with tf1.variable_scope("q"):
            q = dense(dense(x, 6, "h", tf.nn.relu), 2, "out")
        with tf1.variable_scope("target"):
            target_q = dense(dense(x, 6, "h", tf.nn.relu), 2, "out")
        target = tf.cast(y, tf.float32) + 0.9 * tf.reduce_max(target_q, axis=1)
        chosen = tf.reduce_sum(q * tf.one_hot(y, 2), axis=1)
        loss = tf1.losses.huber_loss(tf.stop_gradient(target), chosen)
        q_vars, target_vars = (tf1.trainable_variables(s) for s in ("q/", "target/"))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=q_vars)
        update = tf.group(*[t.assign(0.99 * t + 0.01 * o) for o, t in zip(q_vars, target_vars)],
                          name="soft_update")
        if not soft_update_in_step:
            return train
        with tf.control_dependencies([train]):
            return tf.group(update, name="train_and_update")
    return build


def test_a_target_network_updated_beside_the_step_races_with_the_loss(tmp_path):
    found = races_of(tmp_path, dqn(soft_update_in_step=True))
    assert {r.variable for r in found} == {"target/h/kernel", "target/h/bias",
                                           "target/out/kernel", "target/out/bias"}
    assert all(r.update.startswith("Assign") for r in found)
    assert races_of(tmp_path, dqn(soft_update_in_step=False)) == []


# the corpus's one race: the critic's cost, mean(D(fake)) - mean(D(real)) + penalty, has a
# gradient with respect to the output layer's bias that needs no read of it
CORPUS_RACES = {"wgan_gp": {("critic_cost:0", "critic/out/bias")}}


@pytest.mark.parametrize("name", sorted(load_manifest()))
def test_corpus_graphs_race_only_where_their_code_does(name):
    # legacy while loops (a cycle through NextIteration), tf_keras' RNN (its first step's
    # output read only by a ZerosLike) and gradients seeded by Fill(Shape(loss)) are ordered
    ir = metagraph.load(recipe_meta(name))
    found = {(r.fetch, r.variable) for r in fetch_races.races(ir, training.analyze(ir))}
    assert found == CORPUS_RACES.get(name, set())


def test_verify_names_the_race_rather_than_the_transformation(tmp_path):
    model = export_classifier(tmp_path / "m.meta", uncertainty_weighted())
    original = metagraph.load(model)
    transformed = metagraph.load(model)
    strategies.transform(transformed, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    report = equivalence.compare(original, transformed, model + ".npz", steps=2, batch_size=16)
    assert max(d.scaled for d in report.variables) < 1e-5  # training itself matches
    text = " ".join(report.reasons)
    assert "reads 'log_var_cls' through" in text and "in either order" in text
