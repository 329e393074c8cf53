"""Logits made by tf.einsum: an equation that keeps the batch's letter first in the output
('bi,ij->bj', 'btd,dv->btv') computes each example's rows from its own (replica_values'
Einsum rule), so a weighted or masked mean over them is divided by the batch's total
(global-denominators) and trains like one device; without the rule such a loss was refused as
one whose numerator "cannot be shown to be a sum or a mean". An equation summing over the
batch ('bi,bj->ij') is a sum over it: a mean of it is refused (it was trained silently wrong:
verify FAILed by 9.9e-01)."""

import pytest
from conftest import export_classifier


def _weighted_mean(equation):
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        if equation == "bi,ij->bj":
            logits = tf.einsum(equation, x, tf1.get_variable("w", [8, 2]))
            weights = tf.cast(x[:, 1] > 0, tf.float32)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                          logits=logits)
        else:  # a sequence: 4 steps of 2 features, masked per step
            steps = tf.reshape(x, [-1, 4, 2])
            logits = tf.einsum(equation, steps, tf1.get_variable("w", [2, 3]))
            weights = tf.cast(steps[:, :, 0] > 0, tf.float32)
            per_example = tf.reduce_logsumexp(logits, -1) - logits[:, :, 0]
        loss = tf.reduce_sum(per_example * weights / tf.reduce_sum(weights))
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return build


@pytest.mark.parametrize("equation", ["bi,ij->bj", "btd,dv->btv"])
def test_a_weighted_mean_over_einsum_logits_trains_like_one_device(run_cli, tmp_path,
                                                                   equation):
    model = export_classifier(tmp_path / "m.meta", _weighted_mean(equation))
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0 and "PASS" in out, out + err


def test_an_einsum_summing_over_the_batch_is_not_taken_for_a_mean(run_cli, tmp_path):
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        h = tf.einsum("bi,ij->bj", x, tf1.get_variable("w", [8, 2]))
        loss = tf.reduce_mean(tf.einsum("bi,bj->ij", h, h))
        return tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
    model = export_classifier(tmp_path / "m.meta", build)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and "a sum over the batch" in err, err
    assert len(err.strip().splitlines()) == 1
