"""Losses that mix the examples of the batch, as public recipes write them: in-batch negatives
(SimCLR, CLIP), a batch-hard triplet loss (FaceNet), hard-example mining, mixup, a sort, a
softmax over the batch, centring by the batch's mean. Split across replicas, each computes
something else on its slice; `apply` used to exit 0 and `verify` then failed. Each is refused
in one line naming the op; the look-alikes that work inside each example are not."""

import contextlib

import pytest
from conftest import export_classifier as _export

from test_custom_training_code import dense


def _step(loss):
    import tensorflow as tf
    tf1 = tf.compat.v1
    return tf1.train.GradientDescentOptimizer(0.1).minimize(
        loss, global_step=tf1.train.get_or_create_global_step())


def _assert_verify_passes(run_cli, model: str) -> None:
    """allreduce over 2 replicas trains ``model`` as one device does."""
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out


def _xent(y, logits):
    import tensorflow as tf
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                         logits=logits))


def infonce(x, y):
    import tensorflow as tf
    a = tf.nn.l2_normalize(dense(x, 8, "a"), axis=1)
    b = tf.nn.l2_normalize(dense(x * 0.5, 8, "b"), axis=1)
    logits = tf.matmul(a, b, transpose_b=True) / 0.1
    return _step(_xent(tf.range(tf.shape(a)[0]), logits))


def clip_einsum(x, y):
    import tensorflow as tf
    a = tf.nn.l2_normalize(dense(x, 8, "image"), axis=1)
    b = tf.nn.l2_normalize(dense(x * 0.5, 8, "text"), axis=1)
    logits = tf.einsum("ik,jk->ij", a, b) * 10.0
    labels = tf.range(tf.shape(a)[0])
    return _step(_xent(labels, logits) + _xent(labels, tf.transpose(logits)))


def simclr_tensordot(x, y):
    """SimCLR's similarity matrix written with tf.tensordot (reshapes around a MatMul) and
    its targets as a one-hot of the positions."""
    import tensorflow as tf
    a = tf.nn.l2_normalize(dense(x, 8, "a"), axis=1)
    b = tf.nn.l2_normalize(dense(x * 0.5, 8, "b"), axis=1)
    logits = tf.tensordot(a, b, axes=[[1], [1]]) / 0.1
    size = tf.shape(a)[0]
    return _step(tf.compat.v1.losses.softmax_cross_entropy(tf.one_hot(tf.range(size), size),
                                                           logits))


def prototypes(x, y):
    """Prototypical networks: each class's mean embedding over the batch, read back per
    example by its label."""
    import tensorflow as tf
    emb = dense(x, 8, "emb")
    centroids = tf.math.unsorted_segment_mean(emb, tf.cast(y, tf.int32), 2)
    return _step(tf.reduce_mean(tf.reduce_sum(tf.square(emb - tf.gather(centroids, y)), 1)))


def partitioned_mean(x, y):
    """The mean loss of the examples of one group, split off by tf.dynamic_partition: each
    replica's mean is over its own slice's group, of another size."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    _, kept = tf.dynamic_partition(per, tf.cast(x[:, 1] > 0.3, tf.int32), 2)
    return _step(tf.reduce_mean(kept))


def rmse(x, y):
    """A root-mean-square error: the square root of the batch's mean."""
    import tensorflow as tf
    error = dense(x, 1, "out")[:, 0] - tf.cast(y, tf.float32)
    return _step(tf.sqrt(tf.reduce_mean(tf.square(error))))


def batch_class_weights(x, y):
    """Class weights from the batch's own label counts (tf.math.bincount), read back per
    example by its label."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    counts = tf.math.bincount(tf.cast(y, tf.int32), minlength=2, dtype=tf.float32)
    return _step(tf.reduce_mean(per * tf.gather(1.0 / tf.maximum(counts, 1.0), y)))


def segment_max(x, y):
    import tensorflow as tf
    hardest = tf.math.unsorted_segment_max(dense(x, 4, "emb"), tf.cast(y, tf.int32), 2)
    return _step(tf.reduce_mean(tf.square(hardest)))


def first_example_anchor(x, y):
    import tensorflow as tf
    emb = dense(x, 4, "emb")
    return _step(tf.reduce_mean(tf.square(emb - tf.gather_nd(emb, [[0]]))))


def whitened(x, y):
    """Features whitened by the inverse of the batch's covariance."""
    import tensorflow as tf
    h = dense(x, 4, "h")
    covariance = tf.matmul(h, h, transpose_a=True) / tf.cast(tf.shape(h)[0], tf.float32)
    return _step(_xent(y, dense(tf.matmul(h, tf.linalg.inv(covariance + tf.eye(4))), 2,
                                "out")))


def centred_in_a_tf_function(x, y):
    """Centring by the batch's mean inside a tf.function the graph calls."""
    import tensorflow as tf

    @tf.function
    def centred(t):
        return t - tf.reduce_mean(t, axis=0)
    return _step(_xent(y, dense(centred(dense(x, 8, "h")), 2, "out")))


def map_fn_beside_batch_mean(x, y):
    """tf.map_fn over the examples (control flow v2) reading the batch's mean."""
    import tensorflow as tf
    h = dense(x, 8, "h")
    mean = tf.reduce_mean(h, axis=0)
    return _step(_xent(y, dense(tf.map_fn(lambda row: row - mean, h), 2, "out")))


def cond_on_batch_mean(x, y):
    """A control-flow-v2 cond whose predicate is the batch's mean."""
    import tensorflow as tf
    h = dense(x, 8, "h")
    h = tf.cond(tf.reduce_mean(h) > 0.0, lambda: h * 2.0, lambda: h)
    return _step(_xent(y, dense(h, 2, "out")))


def rolled_negatives(x, y):
    import tensorflow as tf
    emb = dense(x, 8, "emb")
    negative = tf.roll(emb, shift=1, axis=0)
    return _step(tf.reduce_mean(tf.nn.relu(1.0 - tf.reduce_sum(tf.square(emb - negative), 1))))


def triplet_batch_hard(x, y):
    import tensorflow as tf
    emb = dense(x, 8, "emb")
    distance = tf.reduce_sum(tf.square(emb[:, None, :] - emb[None, :, :]), -1)
    same = tf.cast(tf.equal(y[:, None], y[None, :]), tf.float32)
    hardest = tf.reduce_max(distance * same, 1) - tf.reduce_min(distance + 1e6 * same, 1)
    return _step(tf.reduce_mean(tf.nn.relu(hardest + 1.0)))


def hard_example_mining(x, y):
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    hardest, _ = tf.nn.top_k(per, k=tf.shape(per)[0] // 2)
    return _step(tf.reduce_mean(hardest))


def mixup(x, y):
    import tensorflow as tf
    partner = tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=3)
    mixed = 0.7 * x + 0.3 * tf.gather(x, partner)
    labels = 0.7 * tf.one_hot(y, 2) + 0.3 * tf.gather(tf.one_hot(y, 2), partner)
    return _step(tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(
        labels=labels, logits=dense(mixed, 2, "out"))))


def mixup_reversed(x, y):
    import tensorflow as tf
    mixed = 0.7 * x + 0.3 * tf.reverse(x, [0])
    return _step(_xent(y, dense(mixed, 2, "out")))


def sorted_predictions(x, y):
    import tensorflow as tf
    p = tf.sort(dense(x, 1, "out")[:, 0])
    return _step(tf.reduce_mean(tf.square(p - tf.sort(tf.cast(y, tf.float32)))))


def softmax_over_batch(x, y):
    import tensorflow as tf
    h = dense(x, 8, "h")
    weight = tf.nn.softmax(dense(h, 1, "score")[:, 0], axis=0)
    pooled = tf.reduce_sum(h * weight[:, None], axis=0, keepdims=True)
    return _step(_xent(y, dense(h + pooled, 2, "out")))


def centred_by_batch_mean(x, y):
    import tensorflow as tf
    h = dense(x, 16, "h")
    h = h - tf.reduce_mean(h, axis=0, keepdims=True)
    return _step(_xent(y, dense(tf.nn.relu(h), 2, "out")))


def _fgsm(x, y, perturb):
    """Adversarial training (Goodfellow et al.'s FGSM, as cleverhans writes it): the loss on
    x + perturb(dL/dx), L the batch's mean loss, beside the clean loss."""
    import tensorflow as tf

    def net(inputs):
        with tf.compat.v1.variable_scope("net", reuse=tf.compat.v1.AUTO_REUSE):
            return dense(tf.nn.relu(dense(inputs, 16, "h")), 2, "out")

    clean = _xent(y, net(x))
    adversarial = tf.stop_gradient(x + perturb(tf.gradients(clean, x)[0]))
    return _step(clean + _xent(y, net(adversarial)))


def fgsm_raw_gradient(x, y):
    return _fgsm(x, y, lambda g: 5.0 * g)


@contextlib.contextmanager
def _legacy_control_flow():
    """Loops as TF1 built them (Enter/Merge/NextIteration in the graph, not functions)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()


def scan_over_examples(x, y):
    """A recurrence run over the batch axis: what dynamic_rnn(time_major=True) does to
    batch-major data, or a running sum over the examples (tf.scan)."""
    import tensorflow as tf
    with _legacy_control_flow():  # the gradients too
        running = tf.scan(lambda total, row: 0.5 * total + tf.tanh(row), dense(x, 8, "in"))
        return _step(_xent(y, dense(running, 2, "out")))


def scan_over_examples_v2(x, y):
    """The same with control flow v2, TF2's default: a While op whose body reads the batch
    from a TensorList, one example per iteration."""
    import tensorflow as tf
    running = tf.scan(lambda total, row: 0.5 * total + tf.tanh(row), dense(x, 8, "in"))
    return _step(_xent(y, dense(running, 2, "out")))


def squared_batch_mean(x, y):
    """A loss that is a non-linear function of the batch's mean: the average of the replicas'
    squares is not the square of the batch's mean."""
    import tensorflow as tf
    return _step(tf.square(_xent(y, dense(x, 2, "out"))))


def log_mean_exp(x, y):
    """A tilted (risk-averse) loss, log E[exp(loss)] over the batch."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    return _step(tf.math.log(tf.reduce_mean(tf.exp(per))))


def sharpe_ratio(x, y):
    """A portfolio's Sharpe ratio over the batch's returns, through tf.nn.moments: not batch
    norm, though it takes the same statistics."""
    import tensorflow as tf
    returns = dense(x, 1, "weights")[:, 0] * (tf.cast(y, tf.float32) - 0.5)
    mean, variance = tf.nn.moments(returns, axes=[0])
    return _step(-mean / tf.sqrt(variance + 1e-6))


def advantage_normalised(x, y):
    """Policy gradient with advantages standardised by the batch's moments: tf.nn.moments
    and tf.nn.batch_normalization, over returns, not over an activation."""
    import tensorflow as tf
    returns = tf.cast(y, tf.float32) * 2.0 + x[:, 0]
    mean, variance = tf.nn.moments(returns, axes=[0])
    advantages = tf.nn.batch_normalization(returns, mean, variance, None, None, 1e-8)
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    return _step(tf.reduce_mean(per * advantages))


def standardised_losses(x, y):
    """Each example's loss z-scored by the batch's moments of the losses."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    mean, variance = tf.nn.moments(per, axes=[0])
    return _step(tf.reduce_mean(tf.square((per - mean) / tf.sqrt(variance + 1e-3))))


def loss_plus_batch_variance(x, y):
    """A mean loss plus the variance of the per-example losses (variance-penalised risk)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    _, variance = tf.nn.moments(per, axes=[0])
    return _step(tf.reduce_mean(per) + 0.5 * variance)


def ratio_under_sqrt(x, y):
    """Keras's rescaling of a masked loss, size / sum(mask), put through a square root: no
    longer a weight global-denominators can make the whole batch's."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    positives = tf.reduce_sum(tf.cast(tf.equal(y, 1), tf.float32))
    ratio = tf.cast(tf.size(y), tf.float32) / positives
    return _step(tf.reduce_mean(per * tf.sqrt(ratio)))


def dqn_range_of_the_batch_size(x, y):
    """DQN as many public repos write it: Q(s, a) picked by tf.gather_nd over
    tf.stack([tf.range(BATCH_SIZE), actions]) with a Python batch size, while the
    placeholders take any batch: on 2 replicas every slice of 8 meets all 16 rows (apply
    exited 0; the graph failed in TensorFlow at its first step)."""
    import tensorflow as tf
    q = dense(x, 3, "q")
    picked = tf.gather_nd(q, tf.stack([tf.range(16, dtype=tf.int64), y], 1))
    return _step(tf.reduce_mean(tf.square(picked - tf.cast(y, tf.float32))))


def position_weights_of_the_batch_size(x, y):
    """A weight per position of a batch of 16, a constant multiplying each example's loss."""
    import numpy as np
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    return _step(tf.reduce_mean(per * tf.constant(np.linspace(0.5, 1.5, 16), tf.float32)))


def column_of_the_batch_size(x, y):
    """A constant column of 16 rows concatenated beside the features."""
    import tensorflow as tf
    features = tf.concat([x, tf.ones([16, 1])], axis=1)
    return _step(_xent(y, dense(features, 2, "out")))


def simclr_split_views(x, y):
    """SimCLR as its TF code pairs views: both views in one batch, tf.split in halves along
    the batch, each half's in-batch positives the other half's rows."""
    import tensorflow as tf
    z = tf.nn.l2_normalize(dense(tf.concat([x, x * 0.5], 0), 8, "z"), axis=1)
    a, b = tf.split(z, 2, 0)
    logits = tf.matmul(a, b, transpose_b=True) / 0.1
    return _step(_xent(tf.range(tf.shape(a)[0]), logits))


def halves_paired(x, y):
    """The first half of the batch against the second (a siamese pair laid out in halves)."""
    import tensorflow as tf
    a, b = tf.split(dense(x, 4, "emb"), 2, 0)
    return _step(tf.reduce_mean(tf.square(a - b)))


def pairwise_by_tiling(x, y):
    """Prototypical networks' Euclidean distances as their code tiles them: each embedding
    repeated as many times as the batch has examples."""
    import tensorflow as tf
    e = dense(x, 4, "emb")
    n = tf.shape(e)[0]
    rows = tf.tile(tf.expand_dims(e, 1), [1, n, 1])
    cols = tf.tile(tf.expand_dims(e, 0), [n, 1, 1])
    return _step(_xent(y, -tf.reduce_sum(tf.square(rows - cols), axis=2)[:, :2]))


def minibatch_stddev(x, y):
    """ProGAN's minibatch standard deviation: the batch reshaped into groups of 4."""
    import tensorflow as tf
    h = dense(x, 4, "h")
    groups = tf.reshape(h, [4, -1, 4])
    std = tf.sqrt(tf.reduce_mean(tf.square(groups - tf.reduce_mean(groups, 0)), 0) + 1e-8)
    feature = tf.tile(tf.reduce_mean(std, keepdims=True), [tf.shape(h)[0], 1])
    return _step(_xent(y, dense(tf.concat([h, feature], 1), 2, "out")))


def source_half(x, y):
    """DANN's label loss on the source half of the batch: tf.slice up to half its size."""
    import tensorflow as tf
    logits = dense(x, 2, "out")
    half = tf.shape(x)[0] // 2
    return _step(_xent(tf.slice(y, [0], [half]), tf.slice(logits, [0, 0], [half, -1])))


def double_backprop(x, y):
    """Drucker and LeCun's double backpropagation: the loss plus the squared norm of its
    gradient with respect to the inputs, summed."""
    import tensorflow as tf
    loss = _xent(y, dense(tf.nn.tanh(dense(x, 8, "h")), 2, "out"))
    (grad,) = tf.gradients(loss, [x])
    return _step(loss + 0.1 * tf.reduce_sum(tf.square(grad)))


def r1_penalty(x, y):
    """R1's gradient penalty as GAN code writes it: the gradient of the critic's mean output
    (one score per example, [batch, 1]) with respect to the reals, squared and averaged."""
    import tensorflow as tf
    score = dense(tf.nn.relu(dense(x, 8, "critic")), 1, "score")
    (grad,) = tf.gradients(tf.reduce_mean(score), [x])
    return _step(tf.reduce_mean(tf.nn.softplus(-score))
                 + 10.0 * tf.reduce_mean(tf.reduce_sum(tf.square(grad), 1)))


def maml_inner_step(x, y):
    """MAML's inner step on the batch: fast weights from the mean support loss's gradient,
    the outer loss on the same batch through them."""
    import tensorflow as tf
    w = tf.compat.v1.get_variable("w", [8, 2])
    (grad,) = tf.gradients(_xent(y, tf.matmul(x, w)), [w])
    return _step(_xent(y, tf.matmul(x, w - 0.5 * grad)))


def scaled_by_selection_count(x, y):
    """The mean loss times how many examples a mask of the batch keeps, read from the
    selection's shape (tf.shape(tf.boolean_mask(...))[0]): that count is a sum over the
    batch, not its size, and the product a non-linear function of two; it was taken for the
    batch's size (apply exited 0, verify failed by 5e-01)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    kept = tf.cast(tf.shape(tf.boolean_mask(per, x[:, 1] > -0.3))[0], tf.float32)
    return _step(tf.reduce_mean(per) * kept)


def scaled_by_classes_present(x, y):
    """The mean loss times how many classes the batch holds (tf.size(tf.unique(labels)[0])):
    each replica counts its own slice's, and the union's count is not the sum of the
    slices'; tf.unique had no rule, so the count passed as free of the batch (apply exited 0,
    verify failed by 4e-01 with slices holding different classes)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    return _step(tf.reduce_mean(per) * tf.cast(tf.size(tf.unique(y)[0]), tf.float32))


def weighted_by_classes_present(x, y):
    """Each example's loss weighted by the number of classes present, counted by summing
    ones over the batch's distinct labels (missed as the count above was)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    present = tf.reduce_sum(tf.ones_like(tf.cast(tf.unique(y)[0], tf.float32)))
    return _step(tf.reduce_mean(per * present))


def scaled_by_rows_where_finds(x, y):
    """The mean loss times how many rows tf.where finds in a mask of the batch: a sum over
    the batch, times a mean (apply exited 0, verify failed by 8e-01)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    found = tf.cast(tf.shape(tf.where(x[:, 1] > -0.3))[0], tf.float32)
    return _step(tf.reduce_mean(per) * found)


def scaled_by_a_partition_s_size(x, y):
    """The mean loss times the size of one part tf.dynamic_partition makes of the labels
    (apply exited 0, verify failed by 8e-01)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    part = tf.dynamic_partition(y, tf.cast(y, tf.int32), 2)[1]
    return _step(tf.reduce_mean(per) * tf.cast(tf.size(part), tf.float32))


def scaled_by_boxes_kept(x, y):
    """The mean loss times how many of the batch's boxes non-max suppression keeps (apply
    exited 0, verify failed by 4e-01)."""
    import tensorflow as tf
    per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=dense(x, 2, "out"))
    boxes = tf.stack([x[:, 0], x[:, 1], x[:, 0] + 1.0, x[:, 1] + 1.0], 1)
    kept = tf.image.non_max_suppression(boxes, x[:, 2], 10, 0.3)
    return _step(tf.reduce_mean(per) * tf.cast(tf.size(kept), tf.float32))


FIXED_ROWS = [(dqn_range_of_the_batch_size, "Pack", "tf.range(16)"),
              (position_weights_of_the_batch_size, "Mul", "whose 16 rows the graph fixes"),
              (column_of_the_batch_size, "ConcatV2", "whose 16 rows the graph fixes")]


MIXING = [(infonce, "MatMul", "pairs every example with every other"),
          (ratio_under_sqrt, "Mul", "made at 'Sqrt' (Sqrt)"),
          (squared_batch_mean, "Square", "non-linear function to a sum or mean"),
          (log_mean_exp, "Log", "non-linear function to a sum or mean"),
          (sharpe_ratio, "SquaredDifference", "combines each example with a sum or mean"),
          (loss_plus_batch_variance, "SquaredDifference", "combines each example with a sum or mean"),
          (advantage_normalised, "SquaredDifference", "combines each example with a sum or mean"),
          (standardised_losses, "Sub", "combines each example with a sum or mean"),
          (simclr_tensordot, "MatMul", "pairs every example with every other"),
          (prototypes, "GatherV2", "sum or mean over the batch picked by its own index"),
          (partitioned_mean, "DynamicPartition", "splits the examples of the batch"),
          (rmse, "Sqrt", "non-linear function to a sum or mean"),
          (batch_class_weights, "GatherV2", "non-linear function of a sum or mean"),
          (segment_max, "UnsortedSegmentMax", "per segment"),
          (first_example_anchor, "GatherNd", "at fixed positions"),
          (whitened, "MatrixInverse", "non-linear function of a sum or mean"),
          (centred_in_a_tf_function, "PartitionedCall", "runs 'sub' (Sub)"),
          (map_fn_beside_batch_mean, "StatelessWhile", "beside a sum or mean over the batch"),
          (cond_on_batch_mean, "StatelessIf", "picks the branch its examples take"),
          (fgsm_raw_gradient, "AddV2", "scale with the batch's size"),
          (clip_einsum, "Einsum", "different subscripts"),
          (rolled_negatives, "Roll", "rolls the examples"),
          (triplet_batch_hard, "Sub", "different axes"),
          (hard_example_mining, "TopKV2", "ranks the examples"),
          (mixup, "RandomShuffle", "shuffles the examples"),
          (mixup_reversed, "ReverseV2", "reverses the order"),
          (sorted_predictions, "TopKV2", "ranks the examples"),
          (softmax_over_batch, "Softmax", "normalises over the batch axis"),
          (centred_by_batch_mean, "Sub", "sum or mean over the batch"),
          (scan_over_examples, "TensorArrayScatterV3", "carries"),
          (scan_over_examples_v2, "StatelessWhile", "carries"),
          (simclr_split_views, "Split", "splits the batch into parts by position"),
          (halves_paired, "Split", "splits the batch into parts by position"),
          (pairwise_by_tiling, "Tile", "as many times as the batch has"),
          (minibatch_stddev, "Reshape", "groups the examples of the batch by position"),
          (source_half, "Slice", "picks examples of the batch by their position"),
          (double_backprop, "AddV2", "scales with the inverse of the batch's size"),
          (r1_penalty, "AddV2", "scales with the inverse of the batch's size"),
          (maml_inner_step, "MatMul", "multiplies examples by a sum or mean"),
          (scaled_by_selection_count, "Mul", "non-linear function to a sum or mean"),
          (scaled_by_classes_present, "Unique", "counts the distinct values the batch holds"),
          (weighted_by_classes_present, "Mul", "made at 'Unique' (Unique)"),
          (scaled_by_rows_where_finds, "Mul", "non-linear function to a sum or mean"),
          (scaled_by_a_partition_s_size, "Mul", "non-linear function to a sum or mean"),
          (scaled_by_boxes_kept, "NonMaxSuppressionV3", "counts the boxes non-max suppression"),
          *FIXED_ROWS]


@pytest.mark.parametrize("build,op,reason", MIXING, ids=[b.__name__ for b, _, _ in MIXING])
def test_a_loss_that_mixes_the_batch_is_refused(run_cli, tmp_path, build, op, reason):
    model = _export(tmp_path / "m.meta", build)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", out)
    assert code == 1, err
    assert len(err.strip().splitlines()) == 1
    assert f"({op})" in err and reason in err and "mixes the examples" in err
    assert not out.exists()


def test_strategies_that_train_replicas_apart_are_not_refused(run_cli, tmp_path):
    """independent and model-average are documented as not drop-in: each replica trains on
    its own slice, so a mixing loss is what they do anyway."""
    model = _export(tmp_path / "m.meta", infonce)
    for strategy in ("independent", "model-average"):
        code, _, err = run_cli("apply", "--strategy", strategy, "--replicas", 2, model,
                               "-o", tmp_path / f"{strategy}.meta")
        assert code == 0, err


def per_example_lookalikes(x, y):
    """Each of the ops above, used inside each example: attention over a sequence, a sort
    and a top_k over features, a softmax over classes, layer norm, a column, a reversal of
    features, a reshape round trip, a gather of embedding rows by labels, a tensordot over
    features (tf_keras Dense on a sequence), a split and a tile of features, slices up to
    the batch's own size."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    seq = tf.reshape(dense(x, 16, "seq"), [-1, 4, 4])  # [batch, time, features]
    scores = tf.nn.softmax(tf.matmul(seq, seq, transpose_b=True) / 2.0)
    attended = tf.reshape(tf.matmul(scores, seq), [-1, 16])
    mean, variance = tf.nn.moments(attended, axes=[1], keepdims=True)
    normed = (attended - mean) * tf.math.rsqrt(variance + 1e-3)
    top, _ = tf.nn.top_k(normed, k=4)
    ordered = tf.sort(normed, axis=1)
    table = tf1.get_variable("table", [2, 4])
    mixed_features = tf.einsum("bij,bjk->bik", scores, seq)[:, 0, :]  # per example
    features = tf.concat([top, ordered[:, :4], tf.reverse(normed, [1])[:, 2:6],
                          tf.gather(table, y), normed[:, 0:1], mixed_features,
                          tf.roll(normed, shift=1, axis=1)[:, :2],
                          tf.reshape(tf.tensordot(seq, table, axes=[[2], [1]]), [-1, 8]),
                          tf.split(normed, 2, axis=1)[1][:, :2],
                          tf.tile(normed[:, :1], [1, 3]),
                          tf.reshape(normed[:tf.shape(x)[0], :2], [-1, 2]),
                          tf.reshape(tf.slice(normed, [0, 0], [tf.shape(y)[0], 2]), [-1, 2])],
                         axis=1)
    return _step(_xent(y, dense(features, 2, "out")))


def _loops_within_each_example(x, y):
    import tensorflow as tf
    per_example = tf.map_fn(lambda row: tf.nn.relu(row) * 2.0, dense(x, 8, "in"))
    sequence = tf.transpose(tf.reshape(dense(x, 12, "seq"), [-1, 4, 3]), [1, 0, 2])
    states = tf.scan(lambda state, step: tf.tanh(state + step), sequence)
    features = tf.concat([per_example, states[-1]], axis=1)
    return _step(_xent(y, dense(features, 2, "out")))


def loops_within_each_example(x, y):
    """tf.map_fn over the examples (each one's result written alone), and a recurrence over
    time of batch-major sequences transposed to time-major, as dynamic_rnn runs it."""
    with _legacy_control_flow():
        return _loops_within_each_example(x, y)


def loops_within_each_example_v2(x, y):
    """The same with control flow v2."""
    return _loops_within_each_example(x, y)


@pytest.mark.parametrize("build", [loops_within_each_example, loops_within_each_example_v2])
def test_loops_within_each_example_are_not_mixing(run_cli, tmp_path, build):
    from graphxform import batch_mixing, metagraph, training
    model = _export(tmp_path / "m.meta", build)
    ir = metagraph.load(model)
    tg = training.analyze(ir)
    assert batch_mixing.mixing_in(ir, tg.steps[0].loss, tg.batch_sources) is None
    _assert_verify_passes(run_cli, model)


def test_per_example_lookalikes_are_not_mixing(tmp_path):
    from graphxform import batch_mixing, metagraph, training
    ir = metagraph.load(_export(tmp_path / "m.meta", per_example_lookalikes))
    tg = training.analyze(ir)
    (step,) = tg.steps
    assert batch_mixing.mixing_in(ir, step.loss, tg.batch_sources) is None


def test_per_example_lookalikes_train_like_one_device(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", per_example_lookalikes)
    _assert_verify_passes(run_cli, model)


@pytest.mark.parametrize("build", [b for b, _, _ in MIXING], ids=[b.__name__ for b, _, _ in
                                                                 MIXING])
def test_the_mixing_ops_are_found_where_they_are(tmp_path, build):
    """The analysis names the first op where examples meet, not one after it."""
    from graphxform import batch_mixing, metagraph, training
    ir = metagraph.load(_export(tmp_path / "m.meta", build))
    tg = training.analyze(ir)
    (step,) = tg.steps
    found = batch_mixing.mixing_in(ir, step.loss, tg.batch_sources)
    assert found is not None
    for src, port in ir.inputs(found.node):
        inner = batch_mixing.mixing_in(ir, f"{src}:{port}", tg.batch_sources)
        # an input may be a non-linear function of the batch's statistics, which a loss may
        # not be either; the message then names where it was made
        assert inner is None or f"'{inner.node}' ({inner.op})" in found.reason, inner


def batch_random_crop(x, y):
    """tf.image.random_crop of the whole batch, its size's batch entry tf.shape(x)[0]: one
    seeded draw of offsets, 0 along the batch axis, so each example keeps its own row."""
    import tensorflow as tf
    crop = tf.image.random_crop(x, tf.stack([tf.shape(x)[0], 6]), seed=5)
    return _step(_xent(y, dense(crop, 2, "out")))


def crop_dropping_an_example(x, y):
    """The look-alike that does pick examples by position: a random offset along the batch
    axis, a size one example short of the batch."""
    import tensorflow as tf
    crop = tf.image.random_crop(x, tf.stack([tf.shape(x)[0] - 1, 6]), seed=5)
    return _step(_xent(y[1:], dense(crop, 2, "out")))


def test_a_slice_sized_to_the_whole_batch_keeps_each_example(run_cli, tmp_path):
    # random_crop's computed offset along the batch axis read as picking examples by
    # position: apply refused a crop TF can only start at the first example
    from graphxform import batch_mixing, metagraph, training
    model = _export(tmp_path / "m.meta", batch_random_crop)
    ir = metagraph.load(model)
    tg = training.analyze(ir)
    assert batch_mixing.mixing_in(ir, tg.steps[0].loss, tg.batch_sources) is None
    _assert_verify_passes(run_cli, model)
    ir = metagraph.load(_export(tmp_path / "short.meta", crop_dropping_an_example))
    tg = training.analyze(ir)
    found = batch_mixing.mixing_in(ir, tg.steps[0].loss, tg.batch_sources)
    assert found is not None and found.op == "Slice" and "by their position" in found.reason


def statistics_used_linearly(x, y):
    """What the rules for statistics of the batch must not refuse: a focal loss divided by
    the batch's count of positives clamped at one (RetinaNet; global-denominators' case),
    Q-values picked per example by tf.gather_nd, an embedding looked up through the batch's
    distinct ids, and a regularizer that adds a mean to the loss."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    labels = tf.cast(y, tf.float32)
    logit = dense(x, 1, "score")[:, 0]
    p = tf.sigmoid(logit)
    focal = tf.square(1.0 - (labels * p + (1.0 - labels) * (1.0 - p))) * \
        tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit)
    positives = tf.maximum(tf.reduce_sum(labels), 1.0)
    q = dense(x, 3, "q")
    picked = tf.gather_nd(q, tf.stack([tf.range(tf.shape(q, out_type=tf.int64)[0]), y], 1))
    distinct, position = tf.unique(y)
    table = tf1.get_variable("table", [2, 1])
    looked_up = tf.gather(tf.gather(table, distinct), position)[:, 0]
    return _step(tf.reduce_sum(focal) / positives + 0.1 * tf.reduce_mean(
        tf.square(picked - labels)) + 0.01 * tf.reduce_mean(tf.square(looked_up)))


def test_statistics_used_linearly_train_like_one_device(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", statistics_used_linearly)
    _assert_verify_passes(run_cli, model)


def per_example_functions(x, y):
    """A tf.function applied to the batch and a control-flow-v2 cond on a placeholder, each
    working inside each example: followed into their bodies, not refused."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    @tf.function
    def normed(t):
        return t * tf.math.rsqrt(tf.reduce_mean(tf.square(t), axis=1, keepdims=True) + 1e-3)
    wide = tf1.placeholder_with_default(True, [], name="wide")
    h = normed(dense(x, 8, "h"))
    h = tf.cond(wide, lambda: tf.nn.relu(h), lambda: h * 0.5)
    return _step(_xent(y, dense(h, 2, "out")))


def test_per_example_functions_train_like_one_device(run_cli, tmp_path):
    from graphxform import batch_mixing, metagraph, training
    model = _export(tmp_path / "m.meta", per_example_functions)
    ir = metagraph.load(model)
    tg = training.analyze(ir)
    assert batch_mixing.mixing_in(ir, tg.steps[0].loss, tg.batch_sources) is None
    _assert_verify_passes(run_cli, model)


def fgsm_sign(x, y):
    import tensorflow as tf
    return _fgsm(x, y, lambda g: 0.1 * tf.sign(g))


def fgsm_l2_normalized(x, y):
    import tensorflow as tf
    return _fgsm(x, y, lambda g: 0.5 * tf.nn.l2_normalize(g, axis=1))


@pytest.mark.parametrize("build", [fgsm_sign, fgsm_l2_normalized])
def test_a_perturbation_that_does_not_scale_with_the_batch_trains_like_one_device(
        run_cli, tmp_path, build):
    """The gradient of a mean loss is each example's over the batch's size, so a slice's is
    N times larger; its sign and its direction are the same, and those are not refused."""
    model = _export(tmp_path / "m.meta", build)
    _assert_verify_passes(run_cli, model)


def center_loss(x, y):
    """Center loss (Wen et al. 2016) as its TF1 implementations write it: class centres in a
    non-trainable variable that the step moves towards the batch's features (scatter_sub),
    and that the loss reads."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    features = tf.nn.relu(dense(x, 4, "features"))
    centers = tf1.get_variable("centers", [2, 4], initializer=tf1.zeros_initializer(),
                               trainable=False)
    batch_centers = tf.gather(centers, y)
    pull = tf.reduce_mean(tf.reduce_sum(tf.square(features - batch_centers), 1))
    update = tf1.scatter_sub(centers, y, 0.5 * (batch_centers - features))
    with tf.control_dependencies([update]):
        return _step(_xent(y, dense(features, 2, "out")) + 0.1 * pull)


def test_a_loss_reading_state_the_step_moves_by_the_batch_is_refused(run_cli, tmp_path):
    """Each replica would keep its own centres, moved by its own slice: apply used to exit 0
    and verify then failed from the second step on."""
    model = _export(tmp_path / "m.meta", center_loss)
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", out)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "reads variable 'centers'" in err and "from the batch" in err
    assert not out.exists()
    code, _, err = run_cli("apply", "--strategy", "model-average", "--replicas", 2, model,
                           "-o", out)
    assert code == 0, err


def _loop_over_examples(x, y, term, bound=None):
    """A control-flow-v2 while loop over the examples, read from TensorArrays of the batch,
    whose loop variable ``total`` adds ``term(i, logits_i, y_i, carried)`` each iteration;
    ``carried`` is a second loop variable, halved each iteration. The loss is total / size."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    w = tf1.get_variable("w", [8, 2])
    size = tf.shape(x)[0]
    xs = tf.TensorArray(tf.float32, size=0, dynamic_size=True).unstack(x)
    ys = tf.TensorArray(tf.int64, size=0, dynamic_size=True).unstack(y)

    def body(i, total, carried):
        logits = tf.matmul(xs.read(i)[None], w)
        return i + 1, total + term(i, logits, ys.read(i)[None], carried), carried * 0.5

    _, total, _ = tf1.while_loop(lambda i, *_: i < (size if bound is None else bound(size)),
                                 body, [tf.constant(0), tf.constant(0.0), tf.constant(1.0)])
    return _step(total / tf.cast(size, tf.float32))


def per_example_sum_loop(x, y):
    """The loop adds each example's loss: the mean of per-example losses, as one device."""
    return _loop_over_examples(x, y, lambda i, logits, label, _: _xent(label, logits))


def test_a_loop_summing_each_examples_loss_trains_like_one_device(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", per_example_sum_loop)
    _assert_verify_passes(run_cli, model)


def discounted_loop(x, y):
    return _loop_over_examples(x, y, lambda i, logits, label, carried:
                               carried * _xent(label, logits))


def positional_loop(x, y):
    import tensorflow as tf
    return _loop_over_examples(x, y, lambda i, logits, label, _:
                               tf.cast(i, tf.float32) * _xent(label, logits))


def first_examples_loop(x, y):
    import tensorflow as tf
    return _loop_over_examples(x, y, lambda i, logits, label, _: _xent(label, logits),
                               bound=lambda size: tf.minimum(size, 4))


@pytest.mark.parametrize("build", [discounted_loop, positional_loop, first_examples_loop])
def test_a_loop_summing_terms_that_depend_on_position_is_refused(run_cli, tmp_path, build):
    """Weights by the example's position (a discount carried from one to the next, the
    counter itself) or a loop over the first examples only: a slice restarts at 0."""
    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1, err
    assert "(While)" in err and "carries" in err


def _towers(towers: int, variant: str = ""):
    """TF1's multi-GPU CIFAR-10 tutorial on one device: tf.split of the batch, one tower per
    part (variables shared by variable_scope reuse), compute_gradients per tower, the
    tutorial's average_gradients (reduce_mean of the expanded, concatenated gradients) and one
    apply_gradients."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def tower_loss(x, y, scale):
        w1 = tf1.get_variable("w1", [8, 16])
        h = tf.nn.relu(tf.matmul(x, w1))
        if variant == "max":
            h = h - tf.reduce_max(h, axis=0, keepdims=True)
        logits = tf.matmul(h, tf1.get_variable("w2", [16, 2]))
        reduce = tf.reduce_sum if variant == "sum" else tf.reduce_mean
        return scale * reduce(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))

    def build(x, y):
        opt = tf1.train.GradientDescentOptimizer(0.1)
        tower_grads = []
        with tf1.variable_scope(tf1.get_variable_scope()):
            for i, (xs, ys) in enumerate(zip(tf.split(x, towers), tf.split(y, towers))):
                with tf1.name_scope(f"tower_{i}"):
                    scale = 2.0 if variant == "unequal" and i == 0 else 1.0
                    tower_grads.append(opt.compute_gradients(tower_loss(xs, ys, scale)))
                    tf1.get_variable_scope().reuse_variables()
        averaged = []
        for grad_and_vars in zip(*tower_grads):
            grads = [tf.expand_dims(g, 0) for g, _ in grad_and_vars]
            averaged.append((tf.reduce_mean(tf.concat(grads, 0), 0), grad_and_vars[0][1]))
        return opt.apply_gradients(averaged)
    return build


@pytest.mark.parametrize("towers", [1, 2, 4])
def test_towers_of_per_example_losses_train_the_same(run_cli, tmp_path, towers):
    """Each replica's slice split into towers: the mean of the towers' means is the slice's
    mean (equal parts), so the towers' averaged gradient is reduced across replicas (the split
    was refused as mixing, even tf.split(x, 1))."""
    model = _export(tmp_path / "towers.meta", _towers(towers))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


@pytest.mark.parametrize("variant, message", [
    ("max", "'tower_0/Max' (Max) takes the Max over the batch"),
    ("unequal", "towers that compute differently"),
    ("sum", "'tower_0/mul' (Mul) is a sum over the tower's part, not a mean")])
def test_towers_that_mix_their_part_or_differ_are_refused(run_cli, tmp_path, variant, message):
    """A replica's tower t holds other examples than the original's tower t: a tower that
    mixes its part (a max over it) or towers that weigh their parts otherwise would train
    otherwise; a tower's sum over its part, averaged over towers and then over replicas,
    would train with 1/N of its gradient (verify failed by 5.2e-01)."""
    model = _export(tmp_path / "towers.meta", _towers(2, variant))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert message in err, err


@pytest.mark.parametrize("replicas, towers, batch", [(2, 2, 16), (3, 2, 12), (2, 4, 16)])
def test_a_towers_values_are_served_as_one_device_computes_them(run_cli, tmp_path, replicas,
                                                               towers, batch):
    """One device's tower t holds rows [tB/T, (t+1)B/T), replica r's tower t part t of r's
    slice: a tower's loss and logits (and the split's parts) are served from the pieces of
    the batch that part is made of, so each compares (they were replica 0's); the step's
    loss is the mean of its towers' (it was "none found"). A fetch named without a port is
    compared as its output 0 (it was run as an op: None against None)."""
    model = _export(tmp_path / "towers.meta", _towers(towers))
    last = towers - 1
    code, out, err = run_cli("verify", "--replicas", replicas, model, "--feeds",
                             model + ".npz", "--batch-size", batch, "--steps", 2, "--fetch",
                             f"tower_{last}/MatMul_1", "--fetch", "split:1")
    assert code == 0 and "PASS" in out, out + err
    for name in ("tower_0/mul:0", f"tower_{last}/mul:0", f"tower_{last}/MatMul_1:0",
                 "split:1"):
        assert f"fetch {name} " in out, out
    assert "loss: none found" not in out and "loss (transformed)" in out, out
    assert "replica 0's value" not in out, out


def test_a_feed_that_does_not_divide_into_replicas_and_towers_is_one_line(run_cli, tmp_path):
    """6 rows divide by 2 replicas, but a replica's 3 do not split into 2 towers: TF's
    'Number of ways to split should evenly divide' becomes one line naming the split."""
    model = _export(tmp_path / "towers.meta", _towers(2))
    code, _, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                           "--batch-size", 6, "--steps", 1)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "2 replicas x 2 towers" in err and "tf.split 'split'" in err, err


@pytest.mark.parametrize("batch, message", [
    (12, "each of 2 replicas gets 6 rows, which tf.split 'split' cannot divide into its 4"),
    (16, "divides into 4 towers of 4 rows: TensorFlow folded that size")])
def test_towers_on_a_fixed_batch_are_refused(run_cli, tmp_path, batch, message):
    """A fixed batch folds the tower's part size into constants (the mean's gradient divides
    by it), which would hold it in each replica's smaller part: verify failed by 5.0e-01
    while apply exited 0; a slice that does not divide into the towers failed at import."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [batch, 8], name="x")
        y = tf1.placeholder(tf.int64, [batch], name="y")
        tf1.add_to_collection("train_op", _towers(4)(x, y))
        tf1.train.export_meta_graph(str(tmp_path / "fixed.meta"), graph=graph)
    code, _, err = run_cli("apply", "--replicas", 2, tmp_path / "fixed.meta", "-o",
                           tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert message in err, err


def test_a_cross_entropy_of_logits_summed_over_the_batch_is_refused(run_cli, tmp_path):
    """One example a step whose rows are axis 0 of the input (an image's rows, an iterator's
    unbatched element): its logits sum over them, then a cross entropy against one label. It
    was accepted and trained 40x off (the cross entropy of a sum was unknown, not mixing)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        logits = tf.reduce_sum(tf.matmul(x, tf1.get_variable("w", [8, 2])), 0, keepdims=True)
        return _step(tf1.losses.sparse_softmax_cross_entropy(tf.ones([1], tf.int64), logits))
    model = _export(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'sparse_softmax_cross_entropy_loss/xentropy/xentropy' " \
           "(SparseSoftmaxCrossEntropyWithLogits) applies a non-linear function" in err


def dopamine_chosen_q(shifted):
    """Dopamine's C51/Rainbow picks each example's chosen action with tf.gather_nd of
    ``tf.concat([tf.range(batch)[:, None], actions[:, None]], 1)``: the range made a column by
    ``[:, None]`` (a StridedSlice adding an axis) still numbers each example (refused before as
    picking by computed index). ``shifted``: the column is ``(tf.range(batch) + 1) % batch``,
    the next example's row, which stays refused."""
    import tensorflow as tf

    def build(x, y):
        q = tf.reshape(dense(x, 6, "q"), [-1, 3, 2])
        rows = tf.range(tf.shape(q)[0])
        rows = (rows + 1) % tf.shape(q)[0] if shifted else rows
        chosen = tf.gather_nd(q, tf.concat([rows[:, None], tf.cast(y, tf.int32)[:, None]], 1))
        return _step(_xent(y, chosen))
    return build


def test_a_gather_nd_of_each_examples_chosen_action_trains_like_one_device(run_cli, tmp_path):
    _assert_verify_passes(run_cli, _export(tmp_path / "m.meta", dopamine_chosen_q(False)))


def test_a_gather_nd_of_the_next_examples_row_is_refused(run_cli, tmp_path):
    model = _export(tmp_path / "m.meta", dopamine_chosen_q(True))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'GatherNd'" in err and "by computed index" in err, err
