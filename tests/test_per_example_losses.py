"""Losses of one value per example, which tf.gradients (and so ``minimize``) sums over the
batch: older tutorials minimise an unreduced cross entropy, and DDPG's actor (pemami4911's, as
many TF1 DDPG repos write it) differentiates its actions seeded with the critic's action
gradients, fed per example, then divides by the batch size. Each replica's gradient is then
its slice's share of the sum: averaged, the step trained with 1/N of it (apply exited 0,
verify FAILed by 0.5). passes/summed_losses.py scales the seed by N; grad_ys that mixes the
batch is refused."""

import numpy as np
import pytest
from conftest import dense, export_classifier


def ddpg_actor(normalised=False):
    """The actor's step: tf.gradients(actions, params, -action_gradient) / batch size, Adam
    (``normalised``: the fed gradients over the batch's largest, which mixes the batch)."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        action_gradient = tf1.placeholder(tf.float32, [None, 2], name="action_gradient")
        actions = tf.tanh(dense(tf.nn.relu(dense(x, 16, "actor_h")), 2, "actor_out"))
        params = tf1.trainable_variables()
        seed = -action_gradient
        if normalised:
            seed = seed / tf.reduce_max(tf.abs(action_gradient))
        grads = [g / 16.0 for g in tf.gradients(actions, params, seed)]
        return tf1.train.AdamOptimizer(1e-2).apply_gradients(zip(grads, params), name="train")
    return build


def unreduced_cross_entropy(x, y):
    """GradientDescentOptimizer.minimize of the per-example cross entropy, no reduce_mean."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    logits = dense(tf.nn.relu(dense(x, 16, "h")), 2, "out")
    loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    return tf1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")


def export(tmp_path, build):
    model = export_classifier(tmp_path / "m.meta", build)
    feeds = dict(np.load(model + ".npz"))
    feeds["action_gradient"] = np.random.RandomState(1).randn(64, 2).astype(np.float32)
    np.savez(model + ".npz", **feeds)
    return model


def verify(run_cli, model, *where):
    return run_cli("verify", *where, model, "--feeds", model + ".npz", "--batch-size", 16,
                   "--steps", 3)


@pytest.mark.parametrize("strategy", ["allreduce", "replicated"])
@pytest.mark.parametrize("build", [ddpg_actor(), unreduced_cross_entropy],
                         ids=["ddpg_action_gradients", "unreduced_cross_entropy"])
def test_a_loss_per_example_trains_like_one_device(run_cli, tmp_path, strategy, build):
    model = export(tmp_path, build)
    code, out, err = verify(run_cli, model, "--strategy", strategy, "--replicas", 2)
    assert code == 0 and "PASS" in out, out + err


def test_ps_sums_the_workers_gradients_of_a_loss_per_example(run_cli, tmp_path):
    model = export(tmp_path, ddpg_actor())
    spec = tmp_path / "cluster.json"
    spec.write_text('{"ps": ["127.0.0.1:28291"], "worker": ["127.0.0.1:28292", '
                    '"127.0.0.1:28293"]}')
    code, out, err = verify(run_cli, model, "--strategy", "ps", "--cluster", spec)
    assert code == 0 and "PASS" in out, out + err


def test_the_fed_seed_is_scaled_in_every_replica(tmp_path):
    from graphxform import metagraph, strategies
    from graphxform.nodes import const_value
    ir = metagraph.load(export(tmp_path, ddpg_actor()))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    for i in range(2):
        scaled = ir.inputs(f"replica_{i}/gradients/grad_ys_0")[0][0]
        assert ir.op(scaled) == "Mul" and const_value(ir, ir.inputs(scaled)[1][0]) == 2


def test_a_seed_that_mixes_the_batch_is_refused(run_cli, tmp_path):
    model = export(tmp_path, ddpg_actor(normalised=True))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "'Tanh:0', one value per example" in err and "grad_ys" in err
