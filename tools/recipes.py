"""Build the corpus of public training recipes used as test fixtures (issue 12).

Each recipe is a small TF1-style training graph built with public model code
(tf_slim, tf_keras layers in graph mode, tf.compat.v1) called the way that
code's own docs and tutorials call it, so that graphxform is measured on the
graphs people actually hand it, not only on graphs written to suit it.

For every recipe this writes ``<name>.meta`` (binary MetaGraphDef, devices
cleared, a saver_def only where the recipe makes a Saver) and ``<name>.npz``
(64 deterministic rows per placeholder the user's loop feeds, keyed by node
name), plus ``manifest.json`` describing what a user runs and fetches.

``--check`` writes nothing: it rebuilds every recipe in memory, compares it
byte for byte with the files on disk, checks the manifest's claims against
the graph, and runs the user's loop (tests/recipe_loop.py) for 3 steps.

Usage: python tools/recipes.py [--out tests/fixtures/recipes] [--check] [--only NAME]
"""

import os
import sys

# tf.compat.v1.layers (which the TF1 recipes call) are Keras 2 layers: TF 2.21
# routes them to tf_keras only when this is set before tf.keras is first touched;
# otherwise they raise "not available with Keras 3".
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.core.protobuf import control_flow_pb2  # noqa: E402


def _import_tf_slim():
    """Import tf_slim on TF 2.21.

    TF's ``tensorflow.python.layers.normalization`` (used by slim.batch_norm)
    lazily imports ``tf_keras.legacy_tf_layers.normalization``, a path tf_keras
    2.21 only ships as ``tf_keras.src.legacy_tf_layers``; alias it.
    """
    import tf_keras.src.legacy_tf_layers as legacy_layers
    import tf_keras.src.legacy_tf_layers.normalization  # noqa: F401
    sys.modules.setdefault("tf_keras.legacy_tf_layers", legacy_layers)
    sys.modules.setdefault("tf_keras.legacy_tf_layers.normalization",
                           legacy_layers.normalization)
    import tf_slim
    return tf_slim


slim = _import_tf_slim()
import tf_keras  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import recipe_loop  # noqa: E402

v1 = tf.compat.v1
POOL = recipe_loop.POOL_ROWS
BATCH = 16
CHECK_STEPS = 3
DEFAULT_OUT = os.path.join("tests", "fixtures", "recipes")
# Random ops whose draw depends on the batch (a mask per example) keep a recipe from matching
# one device step for step. A seeded candidate sampler (nce_loss) is not among them: it draws
# the same candidates for the whole batch, so every replica draws what one device draws.
RANDOM_OPS = {
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
}
STATE_WRITE_WORDS = ("Assign", "Apply", "Scatter")  # op types that write a variable
BATCH_NORM_OPS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}


# ------------------------------------------------------------- registry

@dataclasses.dataclass
class Recipe:
    """A recipe's builder and what is known about it before building."""
    build: object
    note: str
    has: list
    inexact_because: list
    legacy_control_flow: bool


@dataclasses.dataclass
class Built:
    """What a builder hands back: the user's step(s), fetches and feed pool."""
    feeds: dict
    train_ops: list           # tf.Operation or tf.Tensor, in the user's loop order
    losses: list              # one tf.Tensor per train op
    extra_fetches: list = dataclasses.field(default_factory=list)
    saver: object = None      # a tf.compat.v1.train.Saver the recipe itself made


RECIPES = {}


def recipe(note, has, inexact_because=(), legacy_control_flow=False):
    """Register a builder; legacy_control_flow builds it with control flow v1."""
    def register(build):
        RECIPES[build.__name__] = Recipe(build, note, sorted(has), list(inexact_because),
                                         legacy_control_flow)
        return build
    return register


@contextlib.contextmanager
def _control_flow(legacy):
    """Build with legacy (TF1) control flow when the recipe's users had it."""
    was_v2 = v1.control_flow_v2_enabled()
    if legacy:
        v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2 and legacy:
            v1.enable_control_flow_v2()


# ------------------------------------------------------------- feed data

def _teacher_classes(rng, x, n_classes):
    """Labels from a fixed random linear rule of the inputs (learnable)."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    return np.argmax(flat @ rng.standard_normal([flat.shape[1], n_classes]), axis=1)


def _images(rng, shape):
    return rng.standard_normal([POOL] + list(shape)).astype(np.float32)


# -------------------------------------------------------------- recipes

@recipe(note="tf_slim README 'Training Models' / train_image_classifier: slim.conv2d in an "
             "arg_scope with normalizer_fn=slim.batch_norm and an l2 weights_regularizer, "
             "tf.compat.v1.losses.softmax_cross_entropy on slim.one_hot_encoding labels, "
             "total_loss from tf.compat.v1.losses.get_total_loss(), RMSProp as "
             "train_image_classifier's default, slim.learning.create_train_op("
             "summarize_gradients=False); the user runs (as slim.learning.train does) the "
             "tensor create_train_op returns",
        has=["tf_slim", "bn", "regularization", "check_numerics", "total_loss",
             "train_op_tensor"],
        inexact_because=["batch norm"], legacy_control_flow=True)
def slim_bn_cnn(rng):
    images = v1.placeholder(tf.float32, [None, 8, 8, 3], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    with slim.arg_scope([slim.conv2d, slim.fully_connected],
                        weights_regularizer=slim.l2_regularizer(4e-5)):
        with slim.arg_scope([slim.conv2d], normalizer_fn=slim.batch_norm,
                            normalizer_params={"is_training": True, "decay": 0.9,
                                               "epsilon": 1e-3}):
            net = slim.conv2d(images, 4, [3, 3], scope="conv1")
            net = slim.max_pool2d(net, [2, 2], scope="pool1")
            net = slim.conv2d(net, 8, [3, 3], scope="conv2")
        net = slim.flatten(net, scope="flatten")
        logits = slim.fully_connected(net, 4, activation_fn=None, scope="logits")
    v1.losses.softmax_cross_entropy(slim.one_hot_encoding(labels, 4), logits)
    total_loss = v1.losses.get_total_loss()
    optimizer = v1.train.RMSPropOptimizer(0.01, decay=0.9, momentum=0.9, epsilon=1.0)
    train_tensor = slim.learning.create_train_op(total_loss, optimizer,
                                                 summarize_gradients=False)
    xs = _images(rng, [8, 8, 3])
    return Built({"images": xs, "labels": _teacher_classes(rng, xs, 4)},
                 [train_tensor], [total_loss])


@recipe(note="tf_slim README: slim.stack of slim.fully_connected with slim.dropout("
             "is_training=<PlaceholderWithDefault True>), slim.losses.softmax_cross_entropy "
             "+ slim.losses.get_total_loss, slim.learning.create_train_op with Adam",
        has=["tf_slim", "dropout", "placeholder_with_default", "check_numerics",
             "total_loss", "train_op_tensor"],
        inexact_because=["dropout"], legacy_control_flow=True)
def slim_dropout_mlp(rng):
    inputs = v1.placeholder(tf.float32, [None, 10], name="inputs")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    is_training = v1.placeholder_with_default(True, [], name="is_training")
    net = slim.stack(inputs, slim.fully_connected, [16, 16], scope="fc")
    net = slim.dropout(net, 0.5, is_training=is_training, scope="dropout")
    logits = slim.fully_connected(net, 3, activation_fn=None, scope="logits")
    slim.losses.softmax_cross_entropy(logits, slim.one_hot_encoding(labels, 3))
    total_loss = slim.losses.get_total_loss()
    train_tensor = slim.learning.create_train_op(total_loss, v1.train.AdamOptimizer(0.01),
                                                 summarize_gradients=False)
    xs = _images(rng, [10])
    return Built({"inputs": xs, "labels": _teacher_classes(rng, xs, 3)},
                 [train_tensor], [total_loss])


WORD2VEC_BATCH = 16


@recipe(note="TF word2vec_basic tutorial: fixed-shape int32 placeholders [batch_size] and "
             "[batch_size, 1] under name_scope('inputs'), tf.Variable embeddings, "
             "embedding_lookup, tf.nn.nce_loss (log-uniform sampler, seeded by the graph "
             "seed) averaged under name_scope('loss'), GradientDescentOptimizer(1.0) under "
             "name_scope('optimizer'), a loss summary fetched with the step, the "
             "cosine-similarity eval path and a Saver; tiny vocab/embedding; tf.Variable "
             "makes resource variables in TF 2.21 (reference ones in TF1)",
        has=["fixed_batch", "sparse", "random_sampler", "summaries", "saver",
             "unnamed_placeholders", "no_global_step"])
def word2vec_basic(rng):
    vocabulary_size, embedding_size, num_sampled = 32, 8, 4
    with tf.name_scope("inputs"):
        train_inputs = v1.placeholder(tf.int32, shape=[WORD2VEC_BATCH])
        train_labels = v1.placeholder(tf.int32, shape=[WORD2VEC_BATCH, 1])
        valid_dataset = tf.constant([1, 5, 9], dtype=tf.int32)
    with tf.name_scope("embeddings"):
        embeddings = v1.Variable(v1.random_uniform([vocabulary_size, embedding_size],
                                                   -1.0, 1.0))
        embed = tf.nn.embedding_lookup(embeddings, train_inputs)
    with tf.name_scope("weights"):
        nce_weights = v1.Variable(v1.truncated_normal(
            [vocabulary_size, embedding_size], stddev=1.0 / np.sqrt(embedding_size)))
    with tf.name_scope("biases"):
        nce_biases = v1.Variable(tf.zeros([vocabulary_size]))
    with tf.name_scope("loss"):
        loss = tf.reduce_mean(v1.nn.nce_loss(
            weights=nce_weights, biases=nce_biases, labels=train_labels, inputs=embed,
            num_sampled=num_sampled, num_classes=vocabulary_size))
    v1.summary.scalar("loss", loss)
    with tf.name_scope("optimizer"):
        optimizer = v1.train.GradientDescentOptimizer(1.0).minimize(loss)
    norm = tf.sqrt(tf.reduce_sum(tf.square(embeddings), 1, keepdims=True))
    normalized_embeddings = embeddings / norm
    valid_embeddings = tf.nn.embedding_lookup(normalized_embeddings, valid_dataset)
    tf.matmul(valid_embeddings, normalized_embeddings, transpose_b=True)
    merged = v1.summary.merge_all()
    saver = v1.train.Saver()
    # Skip-gram pairs of a text where each word is followed by the next id.
    centers = rng.integers(0, vocabulary_size, size=POOL)
    contexts = (centers + rng.choice([-1, 1], size=POOL)) % vocabulary_size
    return Built({train_inputs.op.name: centers.astype(np.int32),
                  train_labels.op.name: contexts.reshape(POOL, 1).astype(np.int32)},
                 [optimizer], [loss], extra_fetches=[merged], saver=saver)


@recipe(note="tf.compat.v1.train.Optimizer docs 'Processing gradients before applying "
             "them' as the PTB language-model tutorial clips: compute_gradients, "
             "tf.clip_by_global_norm, apply_gradients(global_step) with an "
             "exponential_decay learning rate on global_step; tf.compat.v1.layers.dense "
             "MLP; loss an unnamed tf.reduce_mean",
        has=["clip", "lr_schedule", "unnamed_mean_loss", "tf_layers"])
def clip_schedule_mlp(rng):
    x = v1.placeholder(tf.float32, [None, 10], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    hidden = v1.layers.dense(x, 16, activation=tf.nn.relu, name="hidden")
    logits = v1.layers.dense(hidden, 4, name="logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))
    global_step = v1.train.get_or_create_global_step()
    learning_rate = v1.train.exponential_decay(0.5, global_step, decay_steps=2,
                                               decay_rate=0.8, staircase=True)
    optimizer = v1.train.GradientDescentOptimizer(learning_rate)
    grads, variables = zip(*optimizer.compute_gradients(loss))
    clipped, _ = tf.clip_by_global_norm(grads, clip_norm=0.5)
    train_op = optimizer.apply_gradients(zip(clipped, variables), global_step=global_step)
    xs = 2.0 * _images(rng, [10])
    return Built({"x": xs, "y": _teacher_classes(rng, xs, 4)}, [train_op], [loss])


@recipe(note="DCGAN-style GAN as in the TF1 GAN tutorials: generator and discriminator "
             "MLPs under variable scopes (discriminator reused), sigmoid cross-entropy "
             "losses d_loss and g_loss, one AdamOptimizer(beta1=0.5).minimize per network "
             "over its own var_list (d_train, then g_train which counts global_step), "
             "noise z fed by a placeholder; z_sample feeds an eval-only sampler",
        has=["two_train_ops", "unread_placeholder", "var_list"])
def gan_mlp(rng):
    x = v1.placeholder(tf.float32, [None, 2], name="x")
    z = v1.placeholder(tf.float32, [None, 4], name="z")
    z_sample = v1.placeholder(tf.float32, [None, 4], name="z_sample")

    def generator(noise, reuse=False):
        with v1.variable_scope("generator", reuse=reuse):
            h = v1.layers.dense(noise, 8, activation=tf.nn.relu, name="h0")
            return v1.layers.dense(h, 2, name="out")

    def discriminator(points, reuse=False):
        with v1.variable_scope("discriminator", reuse=reuse):
            h = v1.layers.dense(points, 8, activation=tf.nn.relu, name="h0")
            return v1.layers.dense(h, 1, name="logit")

    fake = generator(z)
    d_real = discriminator(x)
    d_fake = discriminator(fake, reuse=True)
    tf.identity(generator(z_sample, reuse=True), name="samples")

    def xent(logits, target):
        return tf.nn.sigmoid_cross_entropy_with_logits(logits=logits,
                                                       labels=target(logits))

    d_loss_real = tf.reduce_mean(xent(d_real, tf.ones_like))
    d_loss_fake = tf.reduce_mean(xent(d_fake, tf.zeros_like))
    d_loss = tf.add(d_loss_real, d_loss_fake, name="d_loss")
    g_loss = tf.reduce_mean(xent(d_fake, tf.ones_like), name="g_loss")
    trainable = v1.trainable_variables()
    d_vars = [v for v in trainable if v.name.startswith("discriminator/")]
    g_vars = [v for v in trainable if v.name.startswith("generator/")]
    global_step = v1.train.get_or_create_global_step()
    d_train = v1.train.AdamOptimizer(0.01, beta1=0.5).minimize(
        d_loss, var_list=d_vars, name="d_train")
    g_train = v1.train.AdamOptimizer(0.01, beta1=0.5).minimize(
        g_loss, var_list=g_vars, global_step=global_step, name="g_train")
    angles = rng.uniform(0, 2 * np.pi, size=POOL)
    real = np.stack([np.cos(angles), np.sin(angles)], axis=1) * 2.0 + 1.0
    noise = rng.standard_normal([POOL, 4])
    return Built({"x": real.astype(np.float32), "z": noise.astype(np.float32)},
                 [d_train, g_train], [d_loss, g_loss])


@recipe(note="WGAN-GP as its authors' TF1 code (improved_wgan_training) writes it: critic cost "
             "with a gradient penalty at interpolates between real and generated points "
             "(tf.gradients of the critic w.r.t. its input, then the norm per example), "
             "Adam(1e-4, beta1=0.5, beta2=0.9) on the critic, then on the generator; the "
             "interpolation weight is a placeholder_with_default whose default draws "
             "[tf.shape(real)[0], 1] uniforms (left unfed, so every step draws from the batch's "
             "shape)",
        has=["two_train_ops", "var_list", "gradient_penalty", "placeholder_with_default"])
def wgan_gp(rng):
    real = v1.placeholder(tf.float32, [None, 2], name="real")
    z = v1.placeholder(tf.float32, [None, 4], name="z")

    def generator(noise):
        with v1.variable_scope("generator", reuse=v1.AUTO_REUSE):
            h = v1.layers.dense(noise, 16, activation=tf.nn.relu, name="h0")
            return v1.layers.dense(h, 2, name="out")

    def critic(points):
        with v1.variable_scope("critic", reuse=v1.AUTO_REUSE):
            h = v1.layers.dense(points, 16, activation=tf.nn.relu, name="h0")
            return v1.layers.dense(h, 1, name="out")

    fake = generator(z)
    alpha = v1.placeholder_with_default(
        v1.random_uniform([tf.shape(real)[0], 1], 0.0, 1.0, seed=7), [None, 1], name="alpha")
    interpolates = real + alpha * (fake - real)
    gradients = tf.gradients(critic(interpolates), [interpolates])[0]
    slopes = tf.sqrt(tf.reduce_sum(tf.square(gradients), axis=[1]))
    penalty = tf.reduce_mean((slopes - 1.0) ** 2)
    critic_cost = tf.add(tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real)),
                         10.0 * penalty, name="critic_cost")
    generator_cost = tf.negative(tf.reduce_mean(critic(fake)), name="generator_cost")
    trainable = v1.trainable_variables()
    critic_vars = [v for v in trainable if v.name.startswith("critic/")]
    generator_vars = [v for v in trainable if v.name.startswith("generator/")]
    global_step = v1.train.get_or_create_global_step()
    critic_train = v1.train.AdamOptimizer(1e-4, beta1=0.5, beta2=0.9).minimize(
        critic_cost, var_list=critic_vars, name="critic_train")
    generator_train = v1.train.AdamOptimizer(1e-4, beta1=0.5, beta2=0.9).minimize(
        generator_cost, var_list=generator_vars, global_step=global_step,
        name="generator_train")
    angles = rng.uniform(0, 2 * np.pi, size=POOL)
    points = np.stack([np.cos(angles), np.sin(angles)], axis=1) * 2.0
    noise = rng.standard_normal([POOL, 4])
    return Built({"real": points.astype(np.float32), "z": noise.astype(np.float32)},
                 [critic_train, generator_train], [critic_cost, generator_cost])


@recipe(note="'Keras as a simplified interface to TensorFlow' (keras.io blog) with tf_keras "
             "2.21 layers called on tf.compat.v1 placeholders in graph mode: Embedding -> "
             "SimpleRNN(return_sequences=True) -> GlobalAveragePooling1D -> Dense, loss "
             "tf.reduce_mean of "
             "tf_keras.losses.sparse_categorical_crossentropy, v1 RMSPropOptimizer.minimize; "
             "legacy control flow (the RNN's while loop) as TF1 Keras had; tf_keras 2.21 "
             "with return_sequences=False rewrites TensorArray index 0 every step, which "
             "TF1 TensorArrays reject, hence the sequence output and the average",
        has=["tf_keras", "rnn", "sparse", "unnamed_mean_loss"],
        legacy_control_flow=True)
def keras_rnn(rng):
    tokens = v1.placeholder(tf.int32, [None, 6], name="tokens")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    h = tf_keras.layers.Embedding(20, 8, name="embedding")(tokens)
    h = tf_keras.layers.SimpleRNN(8, return_sequences=True, name="rnn")(h)
    h = tf_keras.layers.GlobalAveragePooling1D(name="average_over_time")(h)
    logits = tf_keras.layers.Dense(2, name="logits")(h)
    loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True))
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.RMSPropOptimizer(0.01).minimize(loss, global_step=global_step)
    ids = rng.integers(0, 20, size=[POOL, 6])
    token_score = rng.standard_normal(20)
    ys = (token_score[ids].sum(axis=1) > 0).astype(np.int64)
    return Built({"tokens": ids.astype(np.int32), "labels": ys}, [train_op], [loss])


@recipe(note="TF1 sequence tagging (the RNN guide's recipe): tf.nn.dynamic_rnn over an "
             "LSTMCell with sequence_length (it runs to the batch's longest sequence), a "
             "dense layer per step, tf.compat.v1.losses.sparse_softmax_cross_entropy with "
             "weights=tf.sequence_mask, AdamOptimizer.minimize(global_step)",
        has=["rnn", "sequence_length", "masked_loss", "tf_layers"],
        legacy_control_flow=True)
def dynamic_rnn_tagger(rng):
    tokens = v1.placeholder(tf.int32, [None, 6], name="tokens")
    lengths = v1.placeholder(tf.int32, [None], name="lengths")
    tags = v1.placeholder(tf.int64, [None, 6], name="tags")
    embedding = v1.get_variable("embedding", [20, 8])
    cell = v1.nn.rnn_cell.LSTMCell(16)
    outputs, _ = v1.nn.dynamic_rnn(cell, tf.nn.embedding_lookup(embedding, tokens),
                                   sequence_length=lengths, dtype=tf.float32)
    logits = v1.layers.dense(outputs, 3, name="tagger")
    mask = tf.sequence_mask(lengths, 6, dtype=tf.float32)
    loss = v1.losses.sparse_softmax_cross_entropy(tags, logits, weights=mask)
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)
    ids = rng.integers(0, 20, size=[POOL, 6])
    token_tag = rng.integers(0, 3, size=20)
    return Built({"tokens": ids.astype(np.int32),
                  "lengths": rng.integers(2, 7, size=POOL).astype(np.int32),
                  "tags": token_tag[ids].astype(np.int64)}, [train_op], [loss])


def _sparse_pool(name, rows_of_values, width, dtype):
    """A SparseTensor pool as the feeds of sparse_placeholder ``name``: one row per example,
    its entries at columns 0.. of a dense shape [POOL, width] (recipe_loop cuts it by rows)."""
    indices = [[row, col] for row, values in enumerate(rows_of_values)
               for col in range(len(values))]
    return {f"{name}/indices": np.asarray(indices, dtype=np.int64),
            f"{name}/values": np.concatenate(rows_of_values).astype(dtype),
            f"{name}/shape": np.asarray([len(rows_of_values), width], dtype=np.int64)}


@recipe(note="TF1 speech/OCR recipe (the ctc_loss docs, as the DeepSpeech-era and CRNN code "
             "calls it): label sequences fed through tf.compat.v1.sparse_placeholder as a "
             "SparseTensorValue, a dense layer per frame, tf.compat.v1.nn.ctc_loss(labels, "
             "logits, seq_len, time_major=False), tf.reduce_mean, MomentumOptimizer",
        has=["sparse_placeholder", "ctc", "tf_layers"])
def ctc_speech(rng):
    frames = v1.placeholder(tf.float32, [None, 12, 6], name="frames")
    seq_len = v1.placeholder(tf.int32, [None], name="seq_len")
    labels = v1.sparse_placeholder(tf.int32, name="labels")
    logits = v1.layers.dense(frames, 5, name="frame_logits")  # 4 symbols and the blank
    loss = tf.reduce_mean(v1.nn.ctc_loss(labels, logits, seq_len, time_major=False))
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, global_step=global_step)
    sequences = [rng.integers(0, 4, size=rng.integers(1, 4)) for _ in range(POOL)]
    feeds = {"frames": _images(rng, [12, 6]),
             "seq_len": rng.integers(9, 13, size=POOL).astype(np.int32)}
    feeds.update(_sparse_pool("labels", sequences, 3, np.int32))
    return Built(feeds, [train_op], [loss])


@recipe(note="CTR recipe with sparse ids: a tf.compat.v1.sparse_placeholder of feature ids "
             "per example (1 to 4 each), tf.nn.embedding_lookup_sparse(combiner='mean') as "
             "the embedding-column docs describe it, concatenated with dense features, a "
             "dense tower, tf.compat.v1.losses.sigmoid_cross_entropy, AdagradOptimizer",
        has=["sparse_placeholder", "embedding_lookup_sparse", "tf_layers"])
def sparse_ids_ctr(rng):
    ids = v1.sparse_placeholder(tf.int64, name="ids")
    dense = v1.placeholder(tf.float32, [None, 3], name="dense")
    clicked = v1.placeholder(tf.float32, [None, 1], name="clicked")
    embeddings = v1.get_variable("id_embeddings", [30, 4])
    pooled = tf.nn.embedding_lookup_sparse(embeddings, ids, None, combiner="mean")
    net = v1.layers.dense(tf.concat([pooled, dense], axis=1), 8, activation=tf.nn.relu,
                          name="tower")
    logits = v1.layers.dense(net, 1, name="logit")
    loss = v1.losses.sigmoid_cross_entropy(clicked, logits)
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.AdagradOptimizer(0.1).minimize(loss, global_step=global_step)
    rows = [rng.choice(30, size=rng.integers(1, 5), replace=False) for _ in range(POOL)]
    id_score = rng.standard_normal(30)
    features = rng.standard_normal([POOL, 3]).astype(np.float32)
    score = np.array([id_score[r].mean() for r in rows]) + features[:, 0]
    feeds = {"dense": features, "clicked": (score > 0).astype(np.float32).reshape(POOL, 1)}
    feeds.update(_sparse_pool("ids", rows, 4, np.int64))
    return Built(feeds, [train_op], [loss])


@recipe(note="BERT's optimization.create_optimizer: tf.gradients + clip_by_global_norm(1.0), "
             "polynomial_decay with linear warmup, AdamWeightDecayOptimizer (its own "
             "apply_gradients: m and v from get_variable, decoupled weight decay, each "
             "variable written by a plain assign, no Apply op), global_step advanced by a "
             "separate assign grouped with the step (listed in the train_op collection, as no "
             "minimize does it here)",
        has=["custom_optimizer", "clip_by_global_norm", "lr_schedule", "tf_layers"])
def bert_adamw(rng):
    features = v1.placeholder(tf.float32, [None, 12], name="features")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    hidden = v1.layers.dense(features, 16, activation=tf.nn.relu, name="dense")
    logits = v1.layers.dense(hidden, 3, name="output")
    loss = v1.losses.sparse_softmax_cross_entropy(labels, logits)
    global_step = v1.train.get_or_create_global_step()
    decayed = v1.train.polynomial_decay(tf.constant(1e-2), global_step, 100,
                                        end_learning_rate=0.0, power=1.0)
    step = tf.cast(tf.cast(global_step, tf.int32), tf.float32)
    warming = tf.cast(step < 10.0, tf.float32)
    learning_rate = (1.0 - warming) * decayed + warming * 1e-2 * step / 10.0
    params = v1.trainable_variables()
    grads, _ = tf.clip_by_global_norm(tf.gradients(loss, params), clip_norm=1.0)
    writes = []
    for grad, param in zip(grads, params):
        name = param.op.name
        m = v1.get_variable(name + "/adam_m", param.shape, tf.float32, trainable=False,
                            initializer=v1.zeros_initializer())
        v = v1.get_variable(name + "/adam_v", param.shape, tf.float32, trainable=False,
                            initializer=v1.zeros_initializer())
        next_m = 0.9 * m + 0.1 * grad
        next_v = 0.999 * v + 0.001 * tf.square(grad)
        update = next_m / (tf.sqrt(next_v) + 1e-6)
        if "bias" not in name:
            update += 0.01 * param  # decoupled weight decay
        writes += [param.assign(param - learning_rate * update), m.assign(next_m),
                   v.assign(next_v)]
    train_op = tf.group(tf.group(*writes), global_step.assign(global_step + 1),
                        name="train_op")
    v1.add_to_collection(v1.GraphKeys.TRAIN_OP, train_op)  # Estimator's spec names it so
    x = rng.standard_normal([POOL, 12]).astype(np.float32)
    return Built({"features": x, "labels": _teacher_classes(rng, x, 3)}, [train_op], [loss])


@recipe(note="TF1 layers guide: tf.compat.v1.layers.dense with kernel_regularizer, "
             "tf.compat.v1.losses.sparse_softmax_cross_entropy, "
             "tf.compat.v1.losses.get_total_loss() (data + regularization losses), "
             "MomentumOptimizer(use_nesterov=True).minimize(global_step); "
             "tf.contrib.layers.l2_regularizer is gone, tf_keras.regularizers.l2 is used",
        has=["regularization", "total_loss", "tf_layers"])
def losses_regularized(rng):
    features = v1.placeholder(tf.float32, [None, 12], name="features")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    regularizer = tf_keras.regularizers.l2(1e-3)
    hidden = v1.layers.dense(features, 16, activation=tf.nn.relu,
                             kernel_regularizer=regularizer, name="dense1")
    logits = v1.layers.dense(hidden, 3, kernel_regularizer=regularizer, name="dense2")
    v1.losses.sparse_softmax_cross_entropy(labels=labels, logits=logits)
    total_loss = v1.losses.get_total_loss()
    global_step = v1.train.get_or_create_global_step()
    train_op = v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True).minimize(
        total_loss, global_step=global_step)
    xs = _images(rng, [12])
    return Built({"features": xs, "labels": _teacher_classes(rng, xs, 3)},
                 [train_op], [total_loss])


@recipe(note="TF1 mnist_with_summaries tutorial: nn_layer with tf.Variable weights and "
             "variable_summaries (mean, stddev, max, min, histogram), activation histograms, "
             "accuracy and cross-entropy scalars, merge_all fetched with the step, "
             "AdamOptimizer.minimize without global step; plus tf.debugging.check_numerics "
             "on the logits and tf.compat.v1.add_check_numerics_ops() as a control "
             "dependency of the step; accuracy is built first, so the loss is the unnamed "
             "Mean_1",
        has=["summaries", "check_numerics", "unnamed_mean_loss", "no_global_step"])
def summaries_check_numerics(rng):
    x = v1.placeholder(tf.float32, [None, 10], name="x-input")
    y_ = v1.placeholder(tf.int64, [None], name="y-input")

    def variable_summaries(var):
        with tf.name_scope("summaries"):
            mean = tf.reduce_mean(var)
            v1.summary.scalar("mean", mean)
            with tf.name_scope("stddev"):
                stddev = tf.sqrt(tf.reduce_mean(tf.square(var - mean)))
            v1.summary.scalar("stddev", stddev)
            v1.summary.scalar("max", tf.reduce_max(var))
            v1.summary.scalar("min", tf.reduce_min(var))
            v1.summary.histogram("histogram", var)

    def nn_layer(input_tensor, input_dim, output_dim, layer_name, act=tf.nn.relu):
        with tf.name_scope(layer_name):
            with tf.name_scope("weights"):
                weights = v1.Variable(v1.truncated_normal([input_dim, output_dim],
                                                          stddev=0.1))
                variable_summaries(weights)
            with tf.name_scope("biases"):
                biases = v1.Variable(tf.constant(0.1, shape=[output_dim]))
                variable_summaries(biases)
            with tf.name_scope("Wx_plus_b"):
                preactivate = tf.matmul(input_tensor, weights) + biases
                v1.summary.histogram("pre_activations", preactivate)
            activations = act(preactivate, name="activation")
            v1.summary.histogram("activations", activations)
            return activations

    hidden1 = nn_layer(x, 10, 16, "layer1")
    y = nn_layer(hidden1, 16, 3, "layer2", act=tf.identity)
    y = tf.debugging.check_numerics(y, "logits")
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(y, 1), y_), tf.float32))
    v1.summary.scalar("accuracy", accuracy)
    cross_entropy = tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y_, logits=y))
    v1.summary.scalar("cross_entropy", cross_entropy)
    check_op = v1.add_check_numerics_ops()
    with tf.control_dependencies([check_op]):
        train_step = v1.train.AdamOptimizer(0.01).minimize(cross_entropy)
    merged = v1.summary.merge_all()
    xs = _images(rng, [10])
    return Built({"x-input": xs, "y-input": _teacher_classes(rng, xs, 3)},
                 [train_step], [cross_entropy], extra_fetches=[merged, accuracy])


@recipe(note="TF1 mixed-precision loss scaling: "
             "tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(Momentum, "
             "'dynamic') scales the loss, unscales the gradients, applies them only when "
             "all are finite (tf.cond; global_step moves only then) and updates the loss "
             "scale; the model stays float32; legacy control flow as TF1 had",
        has=["loss_scaling", "tf_layers"],
        legacy_control_flow=True)
def loss_scaling(rng):
    x = v1.placeholder(tf.float32, [None, 10], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    hidden = v1.layers.dense(x, 16, activation=tf.nn.relu, name="dense1")
    logits = v1.layers.dense(hidden, 3, name="dense2")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits), name="loss")
    global_step = v1.train.get_or_create_global_step()
    optimizer = v1.mixed_precision.MixedPrecisionLossScaleOptimizer(
        v1.train.MomentumOptimizer(0.05, 0.9), loss_scale="dynamic")
    train_op = optimizer.minimize(loss, global_step=global_step)
    xs = _images(rng, [10])
    return Built({"x": xs, "y": _teacher_classes(rng, xs, 3)}, [train_op], [loss])


@recipe(note="canned DNNLinearCombinedClassifier (tf.estimator, gone from TF 2.21) rebuilt "
             "with its public pieces: tf.compat.v1.feature_column.linear_model over a "
             "numeric and a multi-id categorical_column_with_identity (FTRL), input_layer "
             "with an embedding_column into a dense layer (Adagrad), logits summed, "
             "sigmoid loss averaged over the batch as the V2 heads do, both minimize ops "
             "grouped and then global_step incremented, as the canned model_fn does",
        has=["feature_columns", "sparse", "two_optimizers", "var_list"])
def wide_deep(rng):
    age = v1.placeholder(tf.float32, [None, 1], name="age")
    tags = v1.placeholder(tf.int64, [None, 3], name="tags")
    clicked = v1.placeholder(tf.float32, [None, 1], name="clicked")
    features = {"age": age, "tags": tags}
    fc = v1.feature_column
    age_column = fc.numeric_column("age")
    tags_column = fc.categorical_column_with_identity("tags", num_buckets=24)
    with v1.variable_scope("linear"):
        linear_logits = fc.linear_model(features, [age_column, tags_column])
    with v1.variable_scope("dnn"):
        net = fc.input_layer(features, [age_column,
                                        fc.embedding_column(tags_column, dimension=4)])
        net = v1.layers.dense(net, 8, activation=tf.nn.relu, name="hiddenlayer_0")
        dnn_logits = v1.layers.dense(net, 1, name="logits")
    logits = dnn_logits + linear_logits
    loss = v1.losses.sigmoid_cross_entropy(clicked, logits)
    global_step = v1.train.get_or_create_global_step()
    train_ops = [
        v1.train.AdagradOptimizer(0.05).minimize(
            loss, var_list=v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "dnn")),
        v1.train.FtrlOptimizer(0.1).minimize(
            loss, var_list=v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "linear")),
    ]
    with tf.control_dependencies([tf.group(*train_ops)]):
        train_op = global_step.assign_add(1, name="train_op").op
    ages = rng.uniform(-1, 1, size=[POOL, 1])
    ids = rng.integers(0, 24, size=[POOL, 3])
    ids[rng.uniform(size=[POOL, 3]) < 0.3] = -1   # -1: no id (rows of 0..3 ids)
    id_score = rng.standard_normal(24)
    score = np.where(ids >= 0, id_score[ids], 0.0).sum(axis=1) + ages[:, 0]
    return Built({"age": ages.astype(np.float32), "tags": ids.astype(np.int64),
                  "clicked": (score > 0).astype(np.float32).reshape(POOL, 1)},
                 [train_op], [loss])


@recipe(note="tf.compat.v1.train.ExponentialMovingAverage docs / inception_train: the "
             "optimizer step, then with tf.control_dependencies([opt_op]) "
             "train_op = tf.group(ema.apply(trainable variables)) with "
             "num_updates=global_step; legacy control flow as TF1 had (the shadow "
             "variables' initial values use a tf.cond)",
        has=["ema", "tf_layers"], legacy_control_flow=True)
def ema_weights(rng):
    x = v1.placeholder(tf.float32, [None, 10], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    hidden = v1.layers.dense(x, 16, activation=tf.nn.relu, name="dense1")
    logits = v1.layers.dense(hidden, 3, name="dense2")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits), name="loss")
    global_step = v1.train.get_or_create_global_step()
    opt_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=global_step)
    ema = v1.train.ExponentialMovingAverage(0.99, num_updates=global_step)
    with tf.control_dependencies([opt_op]):
        train_op = tf.group(ema.apply(v1.trainable_variables()), name="train_op")
    xs = _images(rng, [10])
    return Built({"x": xs, "y": _teacher_classes(rng, xs, 3)}, [train_op], [loss])


@recipe(note="tf.compat.v1.metrics docs: accuracy and mean return (value, update_op); the "
             "training loop runs the update ops grouped with the optimizer step "
             "(tf.group(train, acc_update, loss_update)) after "
             "local_variables_initializer(), which starts the metrics' totals and counts",
        has=["metrics", "tf_layers", "tf_losses"])
def metrics_mlp(rng):
    x = v1.placeholder(tf.float32, [None, 10], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    hidden = v1.layers.dense(x, 16, activation=tf.nn.relu, name="dense1")
    logits = v1.layers.dense(hidden, 3, name="dense2")
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    _, accuracy_update = v1.metrics.accuracy(y, tf.argmax(logits, 1), name="accuracy")
    _, loss_update = v1.metrics.mean(loss, name="mean_loss")
    global_step = v1.train.get_or_create_global_step()
    train = v1.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)
    train_op = tf.group(train, accuracy_update, loss_update, name="train_op")
    xs = _images(rng, [10])
    return Built({"x": xs, "y": _teacher_classes(rng, xs, 3)}, [train_op], [loss])


@recipe(note="TF1 'Deep MNIST for Experts' style: unnamed placeholders, "
             "tf.Variable(tf.truncated_normal(...)) as TF1 made them (reference variables, "
             "VariableV2, via variable_scope(use_resource=False)), conv2d + max_pool + "
             "softmax_cross_entropy_with_logits on one-hot float labels, tf.reduce_mean, "
             "MomentumOptimizer.minimize(global_step)",
        has=["unnamed_placeholders", "unnamed_mean_loss"])
def ref_vars_momentum(rng):
    with v1.variable_scope(v1.get_variable_scope(), use_resource=False):
        x = v1.placeholder(tf.float32, shape=[None, 36])
        y_ = v1.placeholder(tf.float32, shape=[None, 3])
        w_conv1 = v1.Variable(v1.truncated_normal([3, 3, 1, 4], stddev=0.1))
        b_conv1 = v1.Variable(tf.constant(0.1, shape=[4]))
        x_image = tf.reshape(x, [-1, 6, 6, 1])
        h_conv1 = tf.nn.relu(tf.nn.conv2d(x_image, w_conv1, strides=[1, 1, 1, 1],
                                          padding="SAME") + b_conv1)
        h_pool1 = tf.nn.max_pool2d(h_conv1, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1],
                                   padding="SAME")
        w_fc1 = v1.Variable(v1.truncated_normal([3 * 3 * 4, 3], stddev=0.1))
        b_fc1 = v1.Variable(tf.constant(0.1, shape=[3]))
        y_conv = tf.matmul(tf.reshape(h_pool1, [-1, 3 * 3 * 4]), w_fc1) + b_fc1
        cross_entropy = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
            labels=y_, logits=y_conv))
        global_step = v1.train.get_or_create_global_step()
        train_step = v1.train.MomentumOptimizer(0.05, 0.9).minimize(
            cross_entropy, global_step=global_step)
    xs = _images(rng, [36])
    onehot = np.eye(3, dtype=np.float32)[_teacher_classes(rng, xs, 3)]
    return Built({x.op.name: xs, y_.op.name: onehot}, [train_step], [cross_entropy])


@recipe(note="tf_keras in graph mode as in 'Keras as a simplified interface to "
             "TensorFlow': a tf_keras Sequential Conv2D-BatchNormalization-ReLU-"
             "MaxPooling2D-Flatten-Dropout-Dense called on a placeholder with training=True, "
             "tf.reduce_mean of sparse_categorical_crossentropy, v1 AdamOptimizer.minimize "
             "under control_dependencies(model.updates); the same model on an eval-only "
             "placeholder with training=False",
        has=["tf_keras", "bn", "dropout", "unread_placeholder", "unnamed_mean_loss"],
        inexact_because=["batch norm", "dropout"])
def keras_cnn_bn_dropout(rng):
    images = v1.placeholder(tf.float32, [None, 8, 8, 1], name="images")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    eval_images = v1.placeholder(tf.float32, [None, 8, 8, 1], name="eval_images")
    layers = tf_keras.layers
    model = tf_keras.Sequential([
        layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv1"),
        layers.BatchNormalization(name="bn1"),
        layers.ReLU(name="relu1"),
        layers.MaxPooling2D(2, name="pool1"),
        layers.Flatten(name="flatten"),
        layers.Dropout(0.25, name="dropout"),
        layers.Dense(3, name="logits"),
    ], name="cnn")
    logits = model(images, training=True)
    loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True))
    tf.argmax(model(eval_images, training=False), axis=1, name="eval_predictions")
    global_step = v1.train.get_or_create_global_step()
    with tf.control_dependencies(model.updates):
        train_op = v1.train.AdamOptimizer(0.01).minimize(loss, global_step=global_step)
    xs = _images(rng, [8, 8, 1])
    return Built({"images": xs, "labels": _teacher_classes(rng, xs, 3)},
                 [train_op], [loss])


@recipe(note="the tf_keras guide's compile() path in graph mode: a functional Model compiled "
             "with a legacy Adam, loss='sparse_categorical_crossentropy' and "
             "metrics=['accuracy']; the step is the training function fit() builds (its "
             "updates op, which its user puts in the train_op collection), the loss the model's "
             "total_loss. Keras keeps the metric's total and count in no collection, so TF's "
             "default Saver leaves them out; fetching the metric (which updates them) is not "
             "part of the step",
        has=["tf_keras", "keras_compile", "keras_metrics"])
def keras_compile_metrics(rng):
    x = tf_keras.Input(shape=(10,), name="x")
    hidden = tf_keras.layers.Dense(16, activation="relu", name="hidden")(x)
    model = tf_keras.Model(x, tf_keras.layers.Dense(3, activation="softmax", name="probs")(hidden))
    model.compile(optimizer=tf_keras.optimizers.legacy.Adam(0.01),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model._make_train_function()  # what fit() and train_on_batch() build first
    # Keras's legacy optimizers leave TF's train_op collection empty: its user names the step
    v1.add_to_collection(v1.GraphKeys.TRAIN_OP, model.train_function.updates_op)
    xs = _images(rng, [10])
    labels = _teacher_classes(rng, xs, 3).astype(np.float32)[:, None]
    return Built({"x": xs, "probs_target": labels}, [model.train_function.updates_op],
                 [model.total_loss])


# ---------------------------------------------------------- build/check

def _deterministic_meta(meta):
    """Serialize a MetaGraphDef so regenerating gives the same bytes.

    Legacy control-flow contexts are stored pre-serialized and hold maps filled
    in object-id order; re-serialize each with sorted keys.  Control inputs
    gathered from Python sets (create_train_op's update ops) come out in
    object-id order; sort them by name (their order has no meaning). A custom
    gradient's ``_gradient_op_type`` carries a process-wide uid
    (``CustomGradient-7201``): number them in the graph's order instead.
    """
    custom = {}
    for node in meta.graph_def.node:
        kind = node.attr.get("_gradient_op_type")
        if kind is not None and kind.s.startswith(b"CustomGradient-"):
            kind.s = custom.setdefault(kind.s, b"CustomGradient-%d" % len(custom))
        control = [name for name in node.input if name.startswith("^")]
        if control:
            data = [name for name in node.input if not name.startswith("^")]
            del node.input[:]
            node.input.extend(data + sorted(control))
    for key, message in (("while_context", control_flow_pb2.WhileContextDef),
                         ("cond_context", control_flow_pb2.CondContextDef)):
        if key in meta.collection_def:
            values = meta.collection_def[key].bytes_list.value
            for i, raw in enumerate(values):
                values[i] = message.FromString(raw).SerializeToString(deterministic=True)
    return meta.SerializeToString(deterministic=True)


def _npz_bytes(feeds):
    buffer = io.BytesIO()
    np.savez(buffer, **{name: feeds[name] for name in sorted(feeds)})
    return buffer.getvalue()


def build(name):
    """Build one recipe in a fresh graph: (meta bytes, npz bytes, manifest entry)."""
    spec = RECIPES[name]
    graph = tf.Graph()
    with graph.as_default(), _control_flow(spec.legacy_control_flow):
        # Keras initializers left unseeded draw their seeds from Python's random
        # module, not from the graph seed: seed both, as the Keras docs advise.
        tf_keras.utils.set_random_seed(0)
        v1.set_random_seed(0)
        built = spec.build(np.random.default_rng(sum(name.encode())))
        global_step = v1.train.get_global_step()
        meta = v1.train.export_meta_graph(
            graph=graph, clear_devices=True,
            saver_def=built.saver.as_saver_def() if built.saver else None)
    if meta.graph_def.library.function:
        # Function names carry process-wide uids: they would change with build order.
        raise RuntimeError(f"{name}: graph has library functions; build it with "
                           "legacy control flow or without tf.function")
    entry = {
        "note": spec.note,
        "train_ops": [t.name for t in built.train_ops],  # op name, or tensor name
        "losses": [t.name for t in built.losses],
        "extra_fetches": [t.name for t in built.extra_fetches],
        "batch_size": WORD2VEC_BATCH if "fixed_batch" in spec.has else BATCH,
        "exact": not spec.inexact_because,
        "inexact_because": spec.inexact_because,
        "global_step": global_step.op.name if global_step is not None else None,
        "has": sorted(set(spec.has) | _graph_tags(meta.graph_def)),
    }
    entry.update(_describe_inputs(meta.graph_def, built, entry["train_ops"]))
    entry["nodes"] = len(meta.graph_def.node)
    return _deterministic_meta(meta), _npz_bytes(built.feeds), entry


def _graph_tags(graph_def):
    """Tags read off the graph itself rather than declared."""
    ops = {node.op for node in graph_def.node}
    tags = set()
    if "VariableV2" in ops:
        tags.add("ref_vars")
    if ops & {"Switch", "Merge", "Enter"}:
        tags.add("legacy_control_flow")
    if ops & {"Enter", "While", "StatelessWhile"}:
        tags.add("while_loop")
    return tags


def _describe_inputs(graph_def, built, train_ops):
    """Placeholders of the graph, which the loop feeds, which may stay unfed."""
    nodes = {n.name: n for n in graph_def.node}
    step = _step_closure(nodes, train_ops)
    placeholders, optional = {}, []
    for node in graph_def.node:
        if node.op not in ("Placeholder", "PlaceholderWithDefault"):
            continue
        shape = node.attr["shape"].shape
        placeholders[node.name] = {
            "op": node.op,
            "dtype": tf.dtypes.as_dtype(node.attr["dtype"].type).name,
            "shape": None if shape.unknown_rank else [d.size if d.size >= 0 else None
                                                      for d in shape.dim],
        }
        if node.op == "PlaceholderWithDefault" or node.name not in step:
            optional.append(node.name)
    return {"placeholders": placeholders, "feeds": sorted(built.feeds),
            "feeds_optional": optional}


def _step_closure(nodes, fetches, data_only=False, through_defaults=True):
    """Names of the nodes running ``fetches`` executes (data and control inputs).

    data_only: follow data inputs only, i.e. the nodes whose values the
    fetches depend on (add_check_numerics_ops makes every step run the
    initializers' random ops, but nothing depends on their values).
    through_defaults=False: stop at a PlaceholderWithDefault.
    """
    stack = [name.split(":")[0] for name in fetches]
    seen = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if not through_defaults and nodes[name].op == "PlaceholderWithDefault":
            continue
        for inp in nodes[name].input:
            if not (data_only and inp.startswith("^")):
                stack.append(inp.lstrip("^").split(":")[0])
    return seen


def _manifest_problems(entry, graph_def, feeds):
    """Check what the manifest claims against the graph itself."""
    nodes = {n.name: n for n in graph_def.node}
    step = _step_closure(nodes, entry["train_ops"])
    step_ops = {nodes[n].op for n in step}
    problems = []
    writes = [n for n in step if any(word in nodes[n].op for word in STATE_WRITE_WORDS)]
    # a PlaceholderWithDefault is an input like any other: what computes its default is drawn
    # for the whole batch, once, in the transformed graph too (replicate's global_default)
    results = _step_closure(nodes, writes + entry["losses"], data_only=True,
                            through_defaults=False)
    random_in_step = sorted({nodes[n].op for n in results} & RANDOM_OPS)
    has_bn = bool(step_ops & BATCH_NORM_OPS) or "bn" in entry["has"]
    if entry["exact"] and (random_in_step or has_bn):
        problems.append(f"marked exact but the step has {random_in_step or 'batch norm'}")
    if not entry["exact"] and not (random_in_step or has_bn):
        problems.append("marked inexact but the step has no random op or batch norm")
    required = set(entry["placeholders"]) - set(entry["feeds_optional"])
    for head in recipe_loop.sparse_names(feeds):  # a SparseTensorValue feeds all three
        parts = {f"{head}/{part}" for part in recipe_loop.SPARSE_PARTS}
        if parts & required:
            required |= parts
    if required != set(entry["feeds"]):
        problems.append(f"feeds {entry['feeds']} but the step reads {sorted(required)}")
    for feed in entry["feeds"]:
        if recipe_loop.pool_rows(feeds, feed) != POOL:
            problems.append(f"{feed}: {recipe_loop.pool_rows(feeds, feed)} rows, not {POOL}")
        fixed = entry["placeholders"][feed]["shape"]
        if fixed and fixed[0] is not None and fixed[0] != entry["batch_size"]:
            problems.append(f"{feed}: fixed batch {fixed[0]} != batch_size")
    if entry["batch_size"] % 4:
        problems.append("batch_size not divisible by 4")
    return problems


def _write(path, data):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _manifest_bytes(entries):
    return (json.dumps(entries, indent=2, sort_keys=True) + "\n").encode()


def _read(path):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def check(name, out_dir, meta_bytes, npz_bytes, entry, manifest):
    """Compare with the files on disk, check the manifest, run the user's loop."""
    base = os.path.join(out_dir, name)
    problems = []
    if _read(base + ".meta") != meta_bytes:
        problems.append(".meta differs from a fresh build")
    if _read(base + ".npz") != npz_bytes:
        problems.append(".npz differs from a fresh build")
    if manifest.get(name) != entry:
        problems.append("manifest entry differs from a fresh build")
    feeds = dict(np.load(io.BytesIO(npz_bytes)))
    meta = v1.MetaGraphDef.FromString(meta_bytes)
    problems += _manifest_problems(entry, meta.graph_def, feeds)
    started = time.perf_counter()
    result = recipe_loop.run_user_loop(meta, entry, feeds, steps=CHECK_STEPS)
    losses = np.asarray(result.losses)
    if not np.all(np.isfinite(losses)):
        problems.append(f"non-finite losses {losses.tolist()}")
    if entry["global_step"] and result.global_steps != list(range(1, CHECK_STEPS + 1)):
        problems.append(f"global_step after each step: {result.global_steps}")
    first, last = losses[0].round(4).tolist(), losses[-1].round(4).tolist()
    print(f"{name:26s} {entry['nodes']:5d} nodes {len(meta_bytes):7d} B  loss {first} -> "
          f"{last}  {time.perf_counter() - started:4.1f}s  "
          f"{'OK' if not problems else 'FAIL: ' + '; '.join(problems)}")
    return not problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true",
                        help="write nothing: compare with a fresh build and train each")
    parser.add_argument("--only", action="append", choices=sorted(RECIPES),
                        help="just this recipe (repeatable)")
    args = parser.parse_args(argv)
    names = args.only or list(RECIPES)
    manifest_path = os.path.join(args.out, "manifest.json")
    manifest = json.loads(_read(manifest_path) or b"{}")
    built = {name: build(name) for name in names}
    if args.check:
        ok = [check(name, args.out, *built[name], manifest) for name in names]
        return 0 if all(ok) else 1
    os.makedirs(args.out, exist_ok=True)
    for name, (meta_bytes, npz_bytes, entry) in built.items():
        _write(os.path.join(args.out, name + ".meta"), meta_bytes)
        _write(os.path.join(args.out, name + ".npz"), npz_bytes)
        manifest[name] = entry
        print(f"wrote {os.path.join(args.out, name)}.{{meta,npz}}  {entry['nodes']} nodes, "
              f"{len(meta_bytes)} bytes")
    if not args.only:
        manifest = {name: manifest[name] for name in RECIPES}
    _write(manifest_path, _manifest_bytes(manifest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
