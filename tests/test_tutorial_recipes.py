"""Classic TF1 tutorial code (TF's own models), built as the tutorials build it.

The PTB word LM (ptb_word_lm.py) bakes its batch size into the graph and averages its
sequence loss over the batch with ``tf.reduce_sum(crossent, axis=[0]) / tf.reduce_sum(
weights, axis=[0])`` (tf.contrib.seq2seq.sequence_loss). TF folds the static shape of that
Sum's input into its gradient's Tile multiples (``gradients/Sum_grad/Tile/multiples``, the
global batch), which split-inputs left whole: TF then rejected the replicas' gradient
("Cannot reshape a tensor with 20 elements to shape [10]"), a refusal of a graph that
transforms exactly. And ``tf.reduce_sum(tf.reduce_mean(losses, axis=0))`` (a mean over the
batch summed over timesteps or outputs, fixed batch or not) was refused by `check`'s losses
rule, which takes the outer Sum for a sum over the batch. That refusal stays: the inner Mean's
axis 0 is the batch's only when nothing moved it (time-major losses are Transposed to
[time, batch], where the same form is a mean over time summed over the batch), and the rule
reads no axes; the PTB forms that are means are tested with `reduce="sum"`."""

import numpy as np
import pytest

BATCH, STEPS, VOCAB = 4, 3, 6


def export_ptb_like(path, reduce="sum"):
    """A fixed batch of token ids, an embedding, per-token cross entropy reshaped to
    [batch, steps], summed (or averaged) over axis 0 and divided by the weights' sum."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        ids = tf1.placeholder(tf.int32, [BATCH, STEPS], name="input_data")
        targets = tf1.placeholder(tf.int32, [BATCH, STEPS], name="targets")
        embedding = tf1.get_variable("embedding", [VOCAB, 8])
        softmax_w = tf1.get_variable("softmax_w", [8, VOCAB])
        h = tf.reshape(tf.nn.embedding_lookup(embedding, ids), [-1, 8])
        logits = tf.matmul(tf.tanh(h), softmax_w)
        weights = tf.ones([BATCH, STEPS])
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(targets, [-1]), logits=logits) * tf.reshape(weights, [-1])
        crossent = tf.reshape(crossent, [BATCH, STEPS])
        if reduce == "sum":
            loss = tf.reduce_sum(crossent, axis=[0]) / (tf.reduce_sum(weights, axis=[0]) + 1e-12)
        else:
            loss = tf.reduce_mean(crossent, axis=[0])
        cost = tf.reduce_sum(loss, name="cost")
        tvars = tf1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(tf.gradients(cost, tvars), 5.0)
        train = tf1.train.GradientDescentOptimizer(1.0).apply_gradients(
            zip(grads, tvars), global_step=tf1.train.get_or_create_global_step())
        tf1.add_to_collection("train_op", train)
        tf1.train.export_meta_graph(str(path), graph=graph)
    tokens = np.random.RandomState(0).randint(0, VOCAB, size=(32, STEPS + 1)).astype(np.int32)
    np.savez(str(path) + ".npz", input_data=tokens[:, :-1], targets=tokens[:, 1:])
    return str(path)


@pytest.mark.parametrize("reduce", ["sum"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_a_sequence_loss_over_a_fixed_batch_trains_like_one_device(run_cli, tmp_path, reduce,
                                                                     replicas):
    model = export_ptb_like(tmp_path / "m.meta", reduce)
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", replicas,
                             "--feeds", model + ".npz", "--batch-size", BATCH, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


@pytest.mark.parametrize("time_major", [False, True])
def test_a_sum_of_means_is_refused_not_trained_at_1_over_n(run_cli, tmp_path, time_major):
    """``reduce_sum(reduce_mean(per, axis=0))``: batch-major a mean (refused although exact),
    time-major a sum over the batch, which averaging the replicas' gradients would train at
    1/N of its gradient: apply must not accept it as a mean."""
    import tensorflow as tf
    from conftest import export_classifier
    tf1 = tf.compat.v1

    def build(x, y):
        w = tf1.get_variable("w", [8, 3])
        per = tf.square(tf.matmul(x, w) - tf.one_hot(y, 3))
        if time_major:
            per = tf.transpose(per)  # [outputs, batch]
        cost = tf.reduce_sum(tf.reduce_mean(per, axis=0), name="cost")
        return tf1.train.GradientDescentOptimizer(0.1).minimize(cost, name="train")
    model = export_classifier(tmp_path / "m.meta", build)
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code != 0 and "is a sum over its slice" in err, out + err


def export_mnist_convolutional(path):
    """tensorflow/models/image/mnist/convolutional.py: fixed-size placeholders, a Reshape to
    the batch's static shape, L2 regularisers added to the loss, MomentumOptimizer on
    ``exponential_decay(0.01, batch * BATCH_SIZE, train_size, 0.95)`` with ``batch`` the step
    counter, and ``train_prediction`` fetched with every step (its error rate is printed).
    train_size and BATCH_SIZE are multiples of the slice's size: merge-fetches took them for
    constants folded from the batch, so the learning rate, every updated variable and every
    fetch reading them were unknown, and train_prediction gave replica 0's rows alone."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    batch_size, train_size = 8, 32
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        data = tf1.placeholder(tf.float32, (batch_size, 4, 4, 1), name="train_data")
        labels = tf1.placeholder(tf.int64, (batch_size,), name="train_labels")
        conv_w = tf.Variable(tf1.truncated_normal([3, 3, 1, 4], stddev=0.1, seed=1))
        fc_w = tf.Variable(tf1.truncated_normal([2 * 2 * 4, 10], stddev=0.1, seed=1))
        fc_b = tf.Variable(tf.constant(0.1, shape=[10]))
        conv = tf.nn.relu(tf.nn.conv2d(data, conv_w, strides=[1, 1, 1, 1], padding="SAME"))
        pool = tf.nn.max_pool(conv, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")
        shape = pool.get_shape().as_list()
        reshape = tf.reshape(pool, [shape[0], shape[1] * shape[2] * shape[3]])
        logits = tf.matmul(reshape, fc_w) + fc_b
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits)) + 5e-4 * (tf.nn.l2_loss(fc_w) + tf.nn.l2_loss(fc_b))
        batch = tf.Variable(0, dtype=tf.float32)
        learning_rate = tf1.train.exponential_decay(0.01, batch * batch_size, train_size, 0.95,
                                                    staircase=True)
        train = tf1.train.MomentumOptimizer(learning_rate, 0.9).minimize(loss, global_step=batch)
        tf.nn.softmax(logits, name="train_prediction")
        tf1.add_to_collection("train_op", train)
        tf1.train.export_meta_graph(str(path), graph=graph)
    images = np.random.RandomState(0).rand(32, 4, 4, 1).astype(np.float32)
    np.savez(str(path) + ".npz", train_data=images,
             train_labels=(images[:, 0, 0, 0] * 10).astype(np.int64))
    return str(path)


def test_a_fixed_batch_s_predictions_are_the_whole_batch_s(run_cli, tmp_path):
    model = export_mnist_convolutional(tmp_path / "m.meta")
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 8, "--steps", 3,
                             "--fetch", "train_prediction:0")
    assert code == 0 and "PASS" in out and "replica 0's" not in out, out + err


def export_time_major_lengths(path):
    """The NMT tutorial's layout (time-major, [time, batch]): each example's masked squared
    error summed over time (axis 0) and divided by its own length (the mask summed over axis
    0), averaged over the batch. Both Sums reduce axis 0, which here is time, not the batch:
    global-denominators took the lengths for a total of the batch per timestep and divided
    every example by the whole batch's (verify 0.37, apply exiting 0)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 3, 4], name="x")
        y = tf1.placeholder(tf.float32, [None, 3], name="y")
        mask = tf1.placeholder(tf.float32, [None, 3], name="mask")
        w = tf1.get_variable("w", [4, 1])
        pred = tf.reshape(tf.matmul(tf.reshape(x, [-1, 4]), w), [-1, 3])
        per_step = tf.transpose(tf.square(pred - y) * mask)  # [time, batch]
        lengths = tf.reduce_sum(tf.transpose(mask), axis=0) + 1.0
        loss = tf.reduce_mean(tf.reduce_sum(per_step, axis=0) / lengths, name="loss")
        train = tf1.train.GradientDescentOptimizer(0.05).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        tf1.add_to_collection("train_op", train)
        tf1.train.export_meta_graph(str(path), graph=graph)
    rng = np.random.RandomState(0)
    np.savez(str(path) + ".npz", x=rng.randn(64, 3, 4).astype(np.float32),
             y=rng.randn(64, 3).astype(np.float32),
             mask=(rng.rand(64, 3) > 0.3).astype(np.float32))
    return str(path)


def test_a_time_major_length_is_each_example_s_not_the_batch_s(run_cli, tmp_path):
    model = export_time_major_lengths(tmp_path / "m.meta")
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 8, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
