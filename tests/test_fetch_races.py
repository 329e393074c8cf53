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
    targets = {r.variable: r for r in found if r.variable.startswith("target/")}
    assert set(targets) == {"target/h/kernel", "target/h/bias", "target/out/kernel",
                            "target/out/bias"}
    assert all(r.update.startswith("Assign") and r.fetch == "huber_loss/value:0"
               for r in targets.values())
    # the soft update, built before the control dependency, also reads the Q-network in no
    # order with its optimizer's update: the target moves towards the old or the new weights
    online = [r for r in found if r.variable.startswith("q/")]
    assert {r.variable for r in online} == {"q/h/kernel", "q/h/bias", "q/out/kernel",
                                            "q/out/bias"}
    assert all(r.kind == "write_reads" and r.fetch.startswith("AssignVariableOp")
               and r.update.endswith("ResourceApplyGradientDescent") for r in online)
    assert races_of(tmp_path, dqn(soft_update_in_step=False)) == []


# the corpus's races: the critic's cost, mean(D(fake)) - mean(D(real)) + penalty, has a
# gradient with respect to the output layer's bias that needs no read of it; BERT's AdamW
# computes its learning rate from a read of global_step that nothing orders against the
# `global_step.assign(global_step + 1)` grouped beside it (as BERT's optimization.py does)
CORPUS_RACES = {"wgan_gp": {("critic_cost:0", "critic/out/bias")},
                "bert_adamw": {("AssignVariableOp", "global_step")}}


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


def wgan_critic(clip_after_step):
    """WGAN's critic step as its TF1 code writes it (ref variables): RMSProp's minimize of the
    critic's loss and the weight clipping, ``p.assign(tf.clip_by_value(p, -c, c))``, grouped
    into one train op, or the clipping run after the step."""
    def build(x, y):
        def var(name, shape):
            return tf1.Variable(tf1.random_normal(shape, stddev=0.3, seed=len(name)),
                                name=name, use_resource=False)
        w1, b1, w2 = var("critic/w1", [8, 16]), var("critic/b1", [16]), var("critic/w2", [16, 1])
        fake = tf.reverse(x, [1]) * 0.5 + tf.cast(tf.expand_dims(y, 1), tf.float32)

        def critic(h):
            return tf.matmul(tf.nn.relu(tf.matmul(h, w1) + b1), w2)
        loss = tf.identity(tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(x)), "loss")
        step = tf1.train.RMSPropOptimizer(5e-2).minimize(loss, var_list=[w1, b1, w2])
        def clip():
            return [p.assign(tf.clip_by_value(p, -0.01, 0.01)) for p in (w1, b1, w2)]
        if not clip_after_step:
            return tf.group(step, *clip(), name="train")
        with tf.control_dependencies([step]):
            return tf.group(*clip(), name="train")
    return build


def test_weight_clipping_grouped_with_the_critic_step_races_with_it(tmp_path):
    """The clipping's assign and RMSProp's apply write each critic weight in either order (and
    the clipping reads 'p/read', which aliases the variable, whenever it runs): verify failed
    by 3e+01, 2e+01, 8e+02 run to run and named no race."""
    found = races_of(tmp_path, wgan_critic(clip_after_step=False))
    assert {r.variable for r in found} == {"critic/w1", "critic/b1", "critic/w2"}
    for race in found:
        assert race.kind == "write" and race.fetch == "train"
        assert {"ApplyRMSProp", "Assign"} == {training_op(tmp_path, race.read),
                                              training_op(tmp_path, race.update)}
    # clipped after the step, only the fetched loss races: its last MatMul reads 'critic/w2'
    # (through the snapshot) and no gradient needs its output, so it may run after the update
    after = races_of(tmp_path, wgan_critic(clip_after_step=True))
    assert [(r.fetch, r.variable, r.kind) for r in after] == [("loss:0", "critic/w2", "read")]


def training_op(tmp_path, name):
    return metagraph.load(str(tmp_path / "m.meta")).op(name)


def test_a_ref_snapshot_is_read_when_what_consumes_it_runs(tmp_path):
    """A moving average of a ref weight grouped with its optimizer step: 'w/read' runs before
    the step's apply (the forward pass needs it), but the average's Mul, which takes it, reads
    the variable's buffer whenever it runs, before or after the apply."""
    def build(x, y):
        w = tf1.Variable(tf1.random_normal([8, 2], seed=1), name="w", use_resource=False)
        avg = tf1.Variable(tf.zeros([8, 2]), name="avg", use_resource=False, trainable=False)
        loss = tf1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        return tf.group(step, avg.assign(0.9 * avg + 0.1 * w))
    (race,) = races_of(tmp_path, build)
    assert (race.variable, race.kind) == ("w", "write_reads")
    assert training_op(tmp_path, race.read) == "Mul"
    assert training_op(tmp_path, race.update) == "ApplyGradientDescent"


def test_verify_names_two_unordered_writes_of_a_variable(tmp_path):
    model = export_classifier(tmp_path / "m.meta", wgan_critic(clip_after_step=False))
    original = metagraph.load(model)
    transformed = metagraph.load(model)
    strategies.transform(transformed, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    report = equivalence.compare(original, transformed, model + ".npz", steps=2, batch_size=16)
    lines = [r for r in report.reasons if "writes 'critic/w1' with" in r]
    assert len(lines) == 1 and "which nothing orders" in lines[0], report.reasons
    assert "ApplyRMSProp" in lines[0] and "'Assign" in lines[0]
