"""Runner runs what the user runs: every train op of the graph in order, each once per step (a
GAN's d_train then g_train), a tensor step as a tensor; each step's loss by name; `run` prints
them all and `verify` compares them step by step."""

import numpy as np
import pytest
import tensorflow as tf

from graphxform import equivalence, metagraph, strategies, training
from graphxform.errors import GraphxformError
from graphxform.runtime import Feeds, Runner

tf1 = tf.compat.v1


def export(graph, path=None):
    with graph.as_default():
        ir = metagraph.from_metagraph(tf1.train.export_meta_graph(graph=graph))
    if path:
        metagraph.save(ir, str(path))
    return ir


def gan(path=None, probe=False):
    """Two optimizers, two train ops. With ``probe``, each train op also appends its digit to
    ``order`` (1 for d_train, 2 for g_train), so the value tells what ran and in which order."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        z = tf1.placeholder(tf.float32, [None, 3], name="z")
        with tf1.variable_scope("generator"):
            fake = tf.matmul(z, tf1.get_variable("w", [3, 2]))
        with tf1.variable_scope("discriminator"):
            d_w = tf1.get_variable("w", [2, 1])
        real_logit, fake_logit = tf.matmul(x, d_w), tf.matmul(fake, d_w)
        d_loss = tf.identity(tf.reduce_mean(tf.nn.softplus(-real_logit)) +
                             tf.reduce_mean(tf.nn.softplus(fake_logit)), name="d_loss")
        g_loss = tf.identity(tf.reduce_mean(tf.nn.softplus(-fake_logit)), name="g_loss")
        d_vars = tf1.get_collection("trainable_variables", "discriminator")
        g_vars = tf1.get_collection("trainable_variables", "generator")
        d_update = tf1.train.GradientDescentOptimizer(0.1).minimize(d_loss, var_list=d_vars)
        g_update = tf1.train.GradientDescentOptimizer(0.1).minimize(g_loss, var_list=g_vars)
        if probe:
            order = tf1.get_variable("order", [], initializer=tf1.zeros_initializer(),
                                     trainable=False)
            d_update = tf.group(d_update, order.assign(order * 10 + 1))
            g_update = tf.group(g_update, order.assign(order * 10 + 2))
        tf1.add_to_collection("train_op", tf.group(d_update, name="d_train"))
        tf1.add_to_collection("train_op", tf.group(g_update, name="g_train"))
    return export(g, path)


def gan_feeds(path, rows=16):
    rng = np.random.default_rng(0)
    np.savez(str(path), x=rng.standard_normal((rows, 2)).astype(np.float32),
             z=rng.standard_normal((rows, 3)).astype(np.float32))
    return str(path)


def tensor_step_graph():
    """tf_slim's shape of a train op: the tensor ``train_op:0``, the loss after the update."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        loss = tf.reduce_mean(tf.square(tf.matmul(x, tf1.get_variable("w", [2, 1]))),
                              name="loss")
        step = tf1.train.get_or_create_global_step()
        update = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        with tf.control_dependencies([update]):
            tf1.add_to_collection("train_op", tf.identity(loss, name="train_op"))
    return export(g)


def test_every_step_runs_once_per_call_in_order(tmp_path):
    ir = gan(probe=True)
    feeds = Feeds(training.analyze(ir).inputs, gan_feeds(tmp_path / "f.npz"), 8)
    with Runner(ir, fetches=["d_loss:0"]) as run:
        run.initialize()
        first = run.step(feeds.batch(0))
        assert run.variable_values()["order"] == 12  # d_train, then g_train
        run.step(feeds.batch(1))
        assert run.variable_values()["order"] == 1212
    assert list(first.losses) == ["d_train", "g_train"]
    assert first.loss == first.losses["d_train"]
    assert all(np.isfinite(v) for v in first.losses.values())
    assert set(first.fetches) == {"d_loss:0"}  # read with the last step


def test_a_tensor_step_runs_as_a_tensor():
    ir = tensor_step_graph()
    assert [s.name for s in training.analyze(ir).steps] == ["train_op:0"]
    feeds = Feeds(training.analyze(ir).inputs, batch_size=4)
    with Runner(ir) as run:
        run.initialize()
        result = run.step(feeds.batch(0))
        run.step(feeds.batch(1))
        assert run.variable_values()["global_step"] == 2
    assert list(result.losses) == ["train_op:0"] and result.loss > 0


def test_steps_of_another_graph_must_exist_here():
    steps = training.analyze(gan()).steps
    with pytest.raises(GraphxformError, match="has no 'd_train', a step the original graph runs"):
        Runner(tensor_step_graph(), steps=steps)


def test_run_prints_every_steps_loss(tmp_path, run_cli):
    gan(tmp_path / "gan.meta")
    code, out, err = run_cli("run", tmp_path / "gan.meta", "--steps", "2", "--feeds",
                             gan_feeds(tmp_path / "f.npz"), "--batch-size", "8")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1  d_train loss ") and "  g_train loss " in lines[0]


def test_verify_runs_the_same_steps_and_compares_each_loss(tmp_path):
    ir = gan()
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    report = equivalence.compare(gan(), ir, gan_feeds(tmp_path / "f.npz"), steps=3,
                                 batch_size=8)
    assert report.ok, equivalence.format_report(report)
    assert list(report.step_losses) == ["d_train", "g_train"]
    assert all(len(pairs) == 3 for pairs in report.step_losses.values())
    assert report.losses == report.step_losses["d_train"]
    assert [d.name for d in report.fetches] == ["d_loss:0", "g_loss:0"]
    text = equivalence.format_report(report)
    assert "step  train op  loss (original)  loss (transformed)" in text
    assert sum(line.split()[1:2] == ["g_train"] for line in text.splitlines()) == 3


def grouped_minimize(path, ema: bool):
    """``train = tf.group(optimizer.minimize(loss), ...)`` in the 'train_op' collection, as
    many scripts list it; minimize lists its own op there too."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], initializer=tf1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0), name="loss")
        opt = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        others = []
        if ema:
            with tf.control_dependencies([opt]):
                others.append(tf1.train.ExponentialMovingAverage(0.9).apply([w]))
        tf1.add_to_collection("train_op", tf.group(opt, *others, name="train"))
    return export(g, path)


@pytest.mark.parametrize("ema", [False, True])
def test_a_transformed_graph_runs_a_grouped_minimize_once(tmp_path, run_cli, ema):
    """The transformed graph's collection lists the optimizer's merged op beside the merged
    group: `run` ran both, applying the gradients twice per step."""
    grouped_minimize(tmp_path / "m.meta", ema)
    out_path = tmp_path / "out.meta"
    assert run_cli("apply", "--replicas", 2, tmp_path / "m.meta", "-o", out_path)[0] == 0
    assert training.find_steps(metagraph.load(str(out_path))) == ["train"]
    np.savez(tmp_path / "f.npz", x=np.random.RandomState(0).randn(32, 3).astype(np.float32))
    runs = [run_cli("run", model, "--steps", 3, "--feeds", tmp_path / "f.npz",
                    "--batch-size", 16) for model in (tmp_path / "m.meta", out_path)]
    assert all(code == 0 for code, _, _ in runs), runs
    assert [line.split()[:3] for line in runs[0][1].splitlines()] == \
        [line.split()[:3] for line in runs[1][1].splitlines()]
    original, transformed = ([float(line.split()[-1]) for line in out.splitlines()]
                             for _, out, _ in runs)
    assert np.allclose(original, transformed, rtol=1e-5)


def test_a_transformed_graph_s_step_loss_is_the_one_the_user_named(tmp_path):
    """tensorflow/nmt's ``train_loss = tf.identity(sum / size, name="loss")``: in the
    transformed graph the analysis took the step's loss as 'truediv:0', merge-fetches' node of
    the original name (replica 0's value where it is not merged), so `run` printed another
    figure than fetching 'loss:0' gives."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.get_variable("w", [3, 1], initializer=tf1.glorot_uniform_initializer(seed=1))
        per_example = tf.square(tf.matmul(x, w) - 1.0)
        loss = tf.identity(tf.reduce_sum(per_example) / tf.cast(tf.size(per_example),
                                                                 tf.float32), name="loss")
        tf1.add_to_collection("train_op",
                              tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
    ir = export(g)
    assert [s.loss for s in training.analyze(ir).steps] == ["loss:0"]
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    assert [s.loss for s in training.analyze(ir).steps] == ["loss:0"]


def wgan_clipping(path):
    """The original WGAN recipe: RMSProp on the critic and the generator, and the critic's
    weights clipped by ``clip_D = [p.assign(tf.clip_by_value(p, -0.01, 0.01)) ...]``, run as
    ``sess.run([D_solver, clip_D])``: both in the 'train_op' collection, then G_solver."""
    from conftest import export_classifier

    def dense(x, name, n_in, n_out):
        w = tf1.get_variable(name + "/w", [n_in, n_out])
        return tf.matmul(x, w) + tf1.get_variable(name + "/b", [n_out],
                                                  initializer=tf1.zeros_initializer())

    def build(x, y):
        with tf1.variable_scope("G"):
            fake = dense(tf.nn.relu(dense(x[:, :4], "h", 4, 8)), "out", 8, 8)

        def critic(v, reuse):
            with tf1.variable_scope("D", reuse=reuse):
                return dense(tf.nn.relu(dense(v, "h", 8, 8)), "out", 8, 1)
        d_real, d_fake = critic(x, False), critic(fake, True)
        d_loss = tf.identity(tf.reduce_mean(d_fake) - tf.reduce_mean(d_real), name="d_loss")
        g_loss = tf.identity(-tf.reduce_mean(d_fake), name="g_loss")
        theta_d, theta_g = tf1.trainable_variables("D"), tf1.trainable_variables("G")
        d_solver = tf1.train.RMSPropOptimizer(5e-3).minimize(d_loss, var_list=theta_d)
        g_solver = tf1.train.RMSPropOptimizer(5e-3).minimize(g_loss, var_list=theta_g)
        clip_d = [p.assign(tf.clip_by_value(p, -0.01, 0.01)) for p in theta_d]
        tf1.add_to_collection("train_op", d_solver)
        tf1.add_to_collection("train_op", tf.group(*clip_d, name="clip_D"))
        return g_solver
    return export_classifier(path, build)


def test_a_steps_loss_is_what_its_optimizer_differentiates_not_a_clipping(tmp_path, run_cli):
    """The critic's variables were first written by clip_D, so D_solver's step found no loss
    and clip_D's step, which applies no gradient, took the critic's: verify compared d_loss
    read beside the clipping (a false FAIL where the reads raced with it)."""
    model = wgan_clipping(tmp_path / "wgan.meta")
    steps = training.analyze(metagraph.load(model)).steps
    assert {s.name: s.loss for s in steps} == {"RMSProp": "d_loss:0", "clip_D": None,
                                               "RMSProp_1": "g_loss:0"}
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 2)
    assert code == 0 and "PASS" in out, out + err
    assert any(line.split()[1:2] == ["RMSProp"] and "-" not in line.split()[2:]
               for line in out.splitlines() if line.strip().startswith("1 ")), out
