"""Gradients from tf.GradientTape in graph mode (`tape.gradient(loss, variables)` then a v1
optimizer's `apply_gradients`): TF names them under `gradient_tape/` after no forward op, so
they must be found by that scope. The loss they differentiate (which must be a mean for
averaging to be right) is the op whose gradient, named after its name scope, reads the tape's
seed, ones_like(target), where that scope is the op's own name (tf.nn.compute_average_loss's
div_no_nan); failing that, the one the graph lists in its 'losses' collection, which
TF-Agents' losses (tf.compat.v1.losses with Reduction.NONE) fill with the per-example vector
instead. A loss summed over the batch (tf.nn.compute_average_loss with a global batch size, as
TF's custom training loop guide writes it) has each replica's tape seed scaled to N
(passes/summed_losses.py)."""

import pytest
from conftest import export_classifier


def tape_graph(path, loss_kind):
    """``loss_kind``: 'tf1_losses' (tf.compat.v1.losses, which lists its loss), 'sum_listed'
    (reduce_sum, listed by hand), 'mean_unlisted' (reduce_mean, not listed)
    or 'average_loss' (TF-Agents: per-example tf.compat.v1.losses with Reduction.NONE, which
    lists the vector, then tf.nn.compute_average_loss with a global batch size: a sum over a
    constant; the action's Q value taken by tf.gather(batch_dims=1)) or 'tf_agents_mean' (the
    same without a global batch size: a mean)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        w = tf1.get_variable("w", [8, 2])
        b = tf1.get_variable("b", [2], initializer=tf1.zeros_initializer())
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, w) + b
            if loss_kind == "tf1_losses":
                loss = tf1.losses.sparse_softmax_cross_entropy(y, logits)
            elif loss_kind in ("average_loss", "tf_agents_mean"):  # TF-Agents' DQN loss
                q_taken = tf.gather(logits, y, batch_dims=1)
                per_example = tf1.losses.huber_loss(tf.ones_like(q_taken), q_taken,
                                                    reduction=tf1.losses.Reduction.NONE)
                size = 16 if loss_kind == "average_loss" else None
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=size)
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


@pytest.mark.parametrize("kind", ["tf1_losses", "tf_agents_mean"])
def test_tape_gradients_are_reduced_and_train_like_one_device(run_cli, tmp_path, kind):
    model = tape_graph(tmp_path / "m.meta", kind)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16)
    assert code == 0, err
    assert "PASS" in out and "loss: none found" not in out


@pytest.mark.parametrize("kind", ["sum_listed", "average_loss"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_tape_loss_summed_over_the_batch_trains_like_one_device(run_cli, tmp_path, kind,
                                                                  strategy):
    model = tape_graph(tmp_path / "m.meta", kind)
    where = ["--replicas", 2]
    if strategy == "ps":
        cluster = tmp_path / "cluster.json"
        cluster.write_text('{"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}')
        where = ["--cluster", cluster]
    code, out, err = run_cli("verify", "--strategy", strategy, *where, model,
                             "--feeds", model + ".npz", "--batch-size", 16)
    assert code == 0, out + err
    assert "PASS" in out, out


def test_a_tape_loss_that_cannot_be_found_is_refused(run_cli, tmp_path):
    model = tape_graph(tmp_path / "m.meta", "mean_unlisted")
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1
    assert ("applies gradients a tf.GradientTape made (of 'b'), of a loss that cannot be found"
            in err and len(err.strip().splitlines()) == 1)
    assert not (tmp_path / "out.meta").exists()
