"""Gradients from tf.GradientTape in graph mode (`tape.gradient(loss, variables)` then a v1
optimizer's `apply_gradients`): TF names them under `gradient_tape/` after no forward op, so
they must be found by that scope, and the loss they differentiate (which must be a mean for
averaging to be right) is the one the graph lists in its 'losses' collection."""

import pytest
from conftest import export_classifier


def tape_graph(path, loss_kind):
    """``loss_kind``: 'tf1_losses' (tf.compat.v1.losses, which lists its loss), 'sum_listed'
    (reduce_sum, listed by hand) or 'mean_unlisted' (reduce_mean, not listed)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        w = tf1.get_variable("w", [8, 2])
        b = tf1.get_variable("b", [2], initializer=tf1.zeros_initializer())
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, w) + b
            if loss_kind == "tf1_losses":
                loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
            else:
                per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits)
                reduce = tf.reduce_sum if loss_kind == "sum_listed" else tf.reduce_mean
                loss = reduce(per_example)
        grads = tape.gradient(loss, [w, b])
        step = tf1.train.get_or_create_global_step()
        train = tf1.train.AdamOptimizer(0.01).apply_gradients(zip(grads, [w, b]),
                                                              global_step=step)
        if loss_kind == "sum_listed":
            tf1.add_to_collection("losses", loss)
        return train
    return export_classifier(path, build)


def test_tape_gradients_are_reduced_and_train_like_one_device(run_cli, tmp_path):
    model = tape_graph(tmp_path / "m.meta", "tf1_losses")
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out and "loss: none found" not in out


@pytest.mark.parametrize("kind, says", [
    ("sum_listed", "minimises 'Sum:0', a sum over the batch"),
    ("mean_unlisted", "applies gradients a tf.GradientTape made (of 'b'), of a loss that "
                      "cannot be found")])
def test_a_tape_loss_not_shown_to_be_a_mean_is_refused(run_cli, tmp_path, kind, says):
    model = tape_graph(tmp_path / "m.meta", kind)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.meta").exists()
