"""A loss that divides a sum over the batch by another sum over it (tf.compat.v1.losses given
`weights`, whose default reduction divides by the number of nonzero weights; a masked mean
`reduce_sum(l * mask) / reduce_sum(mask)`): each replica would divide by its own slice's total,
and the average of those ratios is not the single-device loss or gradient. `apply` exited 0 on
both and `verify` failed; now they are refused, naming the denominator."""

import numpy as np
import pytest


def weighted_graph(path, form):
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        weights = tf1.placeholder(tf.float32, [None], name="w")
        w = tf1.get_variable("w0", [8, 2])
        logits = tf.matmul(x, w)
        if form == "tf1_losses":
            loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=weights)
        elif form == "masked_mean":
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.identity(tf.reduce_sum(per * weights) / tf.reduce_sum(weights) + 0.0,
                               name="loss")
        else:  # Reduction.MEAN divides by the weights' sum; SUM_OVER_BATCH_SIZE by the count
            reduction = {"weighted_mean": tf1.losses.Reduction.MEAN,
                         "sum_over_batch_size": tf1.losses.Reduction.SUM_OVER_BATCH_SIZE}[form]
            loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=weights,
                                                           reduction=reduction)
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
        tf1.add_to_collection("train_op", train)
        tf1.add_to_collection("losses", loss)
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


@pytest.mark.parametrize("form, denominator", [
    ("tf1_losses", "sparse_softmax_cross_entropy_loss/num_present"),
    ("weighted_mean", "sparse_softmax_cross_entropy_loss/Sum_1"),
    ("masked_mean", "Sum_1")])
def test_a_loss_divided_by_a_sum_over_the_batch_is_refused(run_cli, tmp_path, form,
                                                           denominator):
    code, _, err = run_cli("apply", "--replicas", 2, weighted_graph(tmp_path / "m.meta", form),
                           "-o", tmp_path / "out.meta")
    assert code == 1
    assert f"which divides by '{denominator}', a sum over the batch" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.meta").exists()


def test_weights_over_the_batch_size_still_train_like_one_device(run_cli, tmp_path):
    # SUM_OVER_BATCH_SIZE divides the weighted sum by the number of examples: a mean
    model = weighted_graph(tmp_path / "m.meta", "sum_over_batch_size")
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 8).astype(np.float32)
    np.savez(tmp_path / "f.npz", x=xs, y=(xs[:, 0] > 0).astype(np.int64),
             w=(rng.rand(64) < 0.6).astype(np.float32))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", tmp_path / "f.npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out
