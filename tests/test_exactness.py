"""--sync-batch-norm and --consistent-random: the corpus's batch-norm and dropout recipes train
like one device (losses, weights and moving statistics within 1e-4 after 3 steps), graphs
without either are left alone, and the options say when there is nothing to do."""

import pytest
import tensorflow as tf
from conftest import export_classifier, fixture_path
from recipe_loop import RECIPES_DIR, before_and_after, load_manifest, recipe_meta

from graphxform import equivalence, metagraph, strategies
from graphxform.errors import GraphxformError

MANIFEST = load_manifest()
INEXACT = sorted(name for name, entry in MANIFEST.items()
                 if {"batch norm", "dropout"} & set(entry["inexact_because"]))
BOTH = {"sync_batch_norm": True, "consistent_random": True}
TOLERANCE = 1e-4


def devices(replicas):
    return [f"/device:CPU:{i}" for i in range(replicas)]


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", INEXACT)
def test_batch_norm_and_dropout_recipes_match_one_device(name, replicas, tmp_path):
    entry = MANIFEST[name]
    before, after = before_and_after(name, lambda ir: strategies.transform(
        ir, "allreduce", devices=devices(replicas), **BOTH), replicas, tmp_path)
    for got, expected in zip(after.losses, before.losses):
        assert got == pytest.approx(expected, rel=TOLERANCE)
    floor = equivalence.scale_floor(before.variables, before.variables)
    moving = [v for v in before.variables if "moving" in v]
    assert moving or "batch norm" not in entry["inexact_because"]
    for diff in equivalence.compare_variables(before.variables, after.variables, {}, floor):
        assert diff.scaled <= TOLERANCE, f"{name}: {diff.name} differs by {diff.scaled:.2e}"
        assert diff.replica_spread <= TOLERANCE, f"{name}: replicas of {diff.name} differ"


def test_without_the_options_the_same_recipe_does_not_match(tmp_path):
    """The check above can fail: without the options, batch norm statistics differ."""
    before, after = before_and_after("slim_bn_cnn", lambda ir: strategies.transform(
        ir, "allreduce", devices=devices(2)), 2, tmp_path)
    floor = equivalence.scale_floor(before.variables, before.variables)
    worst = max(d.scaled for d in equivalence.compare_variables(
        before.variables, after.variables, {}, floor))
    assert worst > 1e-2


@pytest.mark.parametrize("name", ["mlp_sgd", "embedding_adam", "rnn_while_legacy"])
def test_graphs_without_batch_norm_or_random_ops_are_unchanged(name):
    plain = metagraph.load(fixture_path(name))
    strategies.transform(plain, "allreduce", devices=devices(2))
    with_options = metagraph.load(fixture_path(name))
    pipeline = strategies.transform(with_options, "allreduce", devices=devices(2), **BOTH)
    assert str(with_options) == str(plain)
    summaries = {t.name: t.summary for t in pipeline.timings}
    assert summaries["sync-batch-norm"]["batch_norms_synchronised"] == 0
    assert summaries["consistent-random"]["random_ops_rewritten"] == 0


def test_apply_says_nothing_to_synchronise(run_cli, tmp_path):
    code, out, err = run_cli("apply", fixture_path("mlp_sgd"), "--replicas", "2",
                             "--sync-batch-norm", "--consistent-random",
                             "-o", tmp_path / "out.meta")
    assert code == 0, err
    assert "sync-batch-norm: nothing to synchronise" in out
    assert "consistent-random: nothing to synchronise" in out


def test_apply_reports_what_it_synchronised(run_cli, tmp_path):
    code, out, err = run_cli("apply", recipe_meta("keras_cnn_bn_dropout"), "--replicas", "2",
                             "--sync-batch-norm", "--consistent-random",
                             "-o", tmp_path / "out.meta")
    assert code == 0, err
    assert "1 batch norm(s) synchronised, 3 collectives per replica per step" in out
    assert "consistent-random: 1 random op(s) draw the whole batch" in out


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_ps_strategies_refuse_the_options_in_one_line(strategy):
    from graphxform import cluster
    spec = cluster.Cluster({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    with pytest.raises(GraphxformError, match="--sync-batch-norm is an option of --strategy "
                                              "allreduce"):
        strategies.transform(metagraph.load(fixture_path("mlp_sgd")), strategy, cluster=spec,
                             sync_batch_norm=True)


@pytest.mark.parametrize("replicas", [2, 4])
def test_moments_batch_norm_matches_and_verify_passes(run_cli, replicas):
    """The tf.nn.moments form (cnn_bn_momentum's hand-written batch norm), through verify."""
    code, out, err = run_cli("verify", fixture_path("cnn_bn_momentum"), "--replicas", replicas,
                             "--sync-batch-norm", "--feeds", fixture_path("cnn_bn_momentum", ".npz"),
                             "--batch-size", 16, "--steps", 3, "--rtol", TOLERANCE)
    assert code == 0, out + err
    assert "PASS" in out and "cannot match" not in out and "bn0/moving_mean" in out


@pytest.mark.parametrize("model, feeds, activation", [
    (recipe_meta("slim_bn_cnn"), str(RECIPES_DIR / "slim_bn_cnn.npz"), "conv2/Relu:0"),
    (fixture_path("cnn_bn_momentum"), fixture_path("cnn_bn_momentum", ".npz"), "Relu:0")])
def test_an_activation_after_a_synchronised_batch_norm_is_the_whole_batch_s(
        run_cli, model, feeds, activation):
    """The statistics come from a collective, which replica_values took for merely equal on
    every replica: what the batch norm normalised was unknown and fetched as replica 0's rows
    (a fused batch norm's activations: inf, half the rows; tf.nn.moments': replica 0's)."""
    code, out, err = run_cli("verify", model, "--replicas", 2, "--sync-batch-norm", "--feeds",
                             feeds, "--batch-size", 16, "--steps", 3, "--rtol", TOLERANCE,
                             "--fetch", activation)
    assert code == 0 and "PASS" in out, out + err
    assert f"fetch {activation}" in out


def test_verify_names_the_option_when_it_is_off(run_cli):
    code, out, _ = run_cli("verify", fixture_path("cnn_bn_momentum"), "--replicas", 2,
                           "--feeds", fixture_path("cnn_bn_momentum", ".npz"), "--batch-size",
                           16, "--steps", 3)
    assert "--sync-batch-norm" in out


def test_unseeded_random_op_is_listed():
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", [4, 1], initializer=v1.zeros_initializer())
        noisy = tf.matmul(x * tf.random.uniform(tf.shape(x)), w)  # no seed anywhere
        loss = tf.reduce_mean(tf.square(noisy), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(
            loss, global_step=v1.train.get_or_create_global_step())
        meta = v1.train.export_meta_graph(graph=g)
    ir = metagraph.from_metagraph(meta)
    pipeline = strategies.transform(ir, "allreduce", devices=devices(2), consistent_random=True)
    summary = {t.name: t.summary for t in pipeline.timings}["consistent-random"]
    assert summary["unseeded_random_ops"] == ["random_uniform/RandomUniform"]


def renorm_classifier(path):
    """tf_keras BatchNormalization(renorm=True) in training mode, its updates run with the
    step, as the tf_keras docs run a layer's updates in a TF1 graph."""
    import numpy as np
    import tf_keras as keras
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        hidden = keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(seed=1))
        norm = keras.layers.BatchNormalization(renorm=True, renorm_momentum=0.9, momentum=0.9)
        out = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed=2))
        logits = out(tf.nn.relu(norm(hidden(x), training=True)))
        loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits,
                                                                            from_logits=True))
        with tf.control_dependencies(norm.updates):
            tf1.add_to_collection("train_op",
                                  tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    np.savez(str(path) + ".npz", x=(rng.randn(64, 6) * 2 + 1).astype(np.float32),
             y=rng.randint(0, 3, 64).astype(np.int32))
    return str(path)


def test_batch_renormalization_is_batch_norm(run_cli, tmp_path):
    """Its statistics (moving_stddev, renorm_mean, renorm_stddev) are batch norm's: per
    replica by default, named by verify (global-state refused them as other state), and
    exact with --sync-batch-norm."""
    model = renorm_classifier(tmp_path / "m.meta")
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 1 and "batch norm in training mode" in out + err and "renorm_" in out + err
    code, out, err = run_cli("verify", "--replicas", 2, "--sync-batch-norm", model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 2)
    assert code == 0 and "PASS" in out, out + err  # 2.4e-06: a bias before the norm, ~0


def gan_through_one_batch_norm(image: bool):
    """A GAN as DCGAN ports write it: the discriminator (tf_keras Dense or Conv2D, then
    BatchNormalization, training=True) scores real and generated rows; d_train and g_train
    each minimise their loss over their own model's variables. Both gradients run through the
    batch norm of the discriminator's call on generated rows: its statistics' gradient lives
    in two tf.gradients scopes, one per train op. ``image``: 4-D input, so the
    batch norm is fused (FusedBatchNormV3 and one FusedBatchNormGradV3 per train op)."""
    import tf_keras as keras
    layers = keras.layers
    tf1 = tf.compat.v1

    def build(x, y):
        init = keras.initializers.GlorotUniform
        generator = keras.Sequential([layers.Dense(4, activation="tanh",
                                                   kernel_initializer=init(seed=1))])
        if image:
            shape = layers.Reshape([2, 2, 1])
            body = [shape, layers.Conv2D(3, 2, padding="same", use_bias=False,
                                          kernel_initializer=init(seed=2))]
        else:
            body = [layers.Dense(6, use_bias=False, kernel_initializer=init(seed=2))]
        discriminator = keras.Sequential(body + [
            layers.BatchNormalization(momentum=0.9), layers.LeakyReLU(0.2), layers.Flatten(),
            layers.Dense(1, kernel_initializer=init(seed=3))])
        real, noise = x[:, :4], x[:, 4:]
        fake = generator(noise, training=True)
        real_logits = discriminator(real, training=True)
        fake_logits = discriminator(fake, training=True)
        xent = tf.nn.sigmoid_cross_entropy_with_logits
        d_loss = tf.reduce_mean(xent(labels=tf.ones_like(real_logits), logits=real_logits)
                                + xent(labels=tf.zeros_like(fake_logits), logits=fake_logits))
        g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake_logits), logits=fake_logits))
        # the real batch's statistics only: two unordered updates of one moving mean would race
        with tf.control_dependencies(discriminator.get_updates_for(real)):
            d_train = tf1.train.AdamOptimizer(1e-2, beta1=0.5).minimize(
                d_loss, var_list=discriminator.trainable_variables, name="d_train")
        tf1.add_to_collection("train_op", d_train)
        return tf1.train.AdamOptimizer(1e-2, beta1=0.5).minimize(
            g_loss, var_list=generator.trainable_variables, name="g_train")
    return build


@pytest.mark.parametrize("image", [False, True], ids=["moments", "fused"])
def test_a_batch_norm_two_train_ops_run_through_is_synchronised_in_both(run_cli, tmp_path,
                                                                        image):
    model = export_classifier(tmp_path / "gan.meta", gan_through_one_batch_norm(image))
    code, out, err = run_cli("verify", "--replicas", 2, "--sync-batch-norm", model,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def generator_classifier(path, draw):
    """A classifier whose inputs get noise from a tf.random.Generator (the TF 'Random number
    generation' guide's Generator.from_seed, its draws in graph mode: RngReadAndSkip advancing
    the generator's state variable by the draw's count, then a stateless op)."""
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def build(x, y):
        gen = tf.random.Generator.from_seed(1234)
        noisy = x + draw(gen, x)
        logits = tf.matmul(noisy, tf1.get_variable("w", [8, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits), name="loss")
        return tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return export_classifier(path, build)


def test_a_generator_draw_of_the_batch_matches_one_device(run_cli, tmp_path):
    """Each replica's generator skipped its slice's count, not the whole batch's: from the
    second step on every replica drew other numbers than one device (verify FAILed, 0.5)."""
    model = generator_classifier(tmp_path / "m.meta",
                                 lambda gen, x: 0.5 * gen.normal(tf.shape(x)))
    code, out, err = run_cli("verify", "--replicas", 2, "--consistent-random", model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
    assert "cannot match" not in out and "random_generator/StateVar" in out
    code, out, _ = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                           "--batch-size", 16, "--steps", 3)
    assert code == 1 and "--consistent-random (--strategy allreduce) gives" in out


def test_a_generator_draw_the_pass_cannot_count_is_refused(run_cli, tmp_path):
    """Generator.binomial draws from the state itself (StatefulRandomBinomial): refused."""
    model = generator_classifier(tmp_path / "m.meta", lambda gen, x: tf.cast(gen.binomial(
        tf.shape(x), counts=2.0, probs=0.5), tf.float32))
    code, out, err = run_cli("apply", "--replicas", 2, "--consistent-random", model,
                             "-o", tmp_path / "out.meta")
    assert code == 1 and "Traceback" not in err
    assert "'binomial' (StatefulRandomBinomial)" in err
    assert len(err.strip().splitlines()) == 1


def fixed_batch_flip_classifier(path):
    """tf.image.random_flip_left_right on images of a fixed batch of 16, as input code with a
    static batch_size writes it: TF folds tf.shape(image) into a Const, so the draw's shape is
    [Const[0]], a Pack split-inputs' rewritten Const leads."""
    import numpy as np
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        images = tf1.placeholder(tf.float32, [16, 4, 4, 1], name="images")
        labels = tf1.placeholder(tf.int64, [16], name="labels")
        flipped = tf.image.random_flip_left_right(images, seed=6)
        logits = tf.matmul(tf.reshape(flipped, [16, 16]), tf1.get_variable("w", [16, 2]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")
        tf1.add_to_collection("train_op", tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 4, 4, 1).astype(np.float32)
    np.savez(str(path) + ".npz", images=xs, labels=(xs[:, 0, 0, 0] > xs[:, 0, 3, 0]).astype(
        np.int64))
    return str(path)


def test_a_flip_of_a_fixed_batch_draws_one_device_s_mask(run_cli, tmp_path):
    """The draw was left alone (its shape is no Const nor read from the slice): each replica
    flipped its slice with the first half of the mask (verify FAILed, 0.4, blaming rounding:
    it did not see the draw as the batch's either)."""
    model = fixed_batch_flip_classifier(tmp_path / "m.meta")
    code, out, err = run_cli("verify", "--replicas", 2, "--consistent-random", model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out and "cannot match" not in out, out + err
    code, out, _ = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                           "--batch-size", 16, "--steps", 3)
    assert code == 1 and "random_flip_left_right/random_uniform/RandomUniform" in out
    assert "reverse order" not in out
