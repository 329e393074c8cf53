"""Losses behind a while loop (graphxform/loop_mixing.py).

An RNN is a while loop over time steps: tf.compat.v1.nn.dynamic_rnn builds it with legacy
control flow (Enter/Merge/Switch/NextIteration/Exit and TensorArrays) or, with control flow v2,
as a While op whose body reads TensorLists. batch_mixing used to stop at the loop, leaving
everything after it unknown, so a loss that mixed the examples after an RNN went unseen: an
in-batch softmax over the final states, or the batch's largest loss, transformed with exit 0
and trained otherwise than one device (verify FAILed by 0.48 and 1.47). The flow now goes
through the loop, so those are refused, and the RNN's mean loss still trains exactly."""

import numpy as np
import pytest

BATCH, STEPS, FEATURES, HIDDEN = 8, 5, 4, 6


def export_rnn(path, loss_kind: str, control_flow_v2: bool):
    """dynamic_rnn over [batch, time, features] as its docs call it, then a loss of kind
    ``loss_kind`` on its final state (or on a body that mixes: "body")."""
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if control_flow_v2:
            tf1.enable_control_flow_v2()
        else:
            tf1.disable_control_flow_v2()
        try:
            tf1.set_random_seed(1)
            x = tf1.placeholder(tf.float32, [None, STEPS, FEATURES], name="x")
            y = tf1.placeholder(tf.int32, [None], name="y")
            w = tf1.get_variable("w", [HIDDEN, 3])
            if loss_kind == "body":  # each step adds the batch's mean state: mixes
                u = tf1.get_variable("u", [FEATURES, HIDDEN])

                def body(t, h):
                    h = tf.tanh(tf.matmul(x[:, t, :], u) + h)
                    return t + 1, h - tf.reduce_mean(h, axis=0)

                h0 = tf.zeros(tf.stack([tf.shape(x)[0], HIDDEN]))
                _, state = tf1.while_loop(lambda t, h: t < STEPS, body, [tf.constant(0), h0])
            else:
                cell = tf1.nn.rnn_cell.BasicRNNCell(HIDDEN)
                _, state = tf1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(state, w))
            if loss_kind == "inbatch":  # each final state against every other's
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=tf.range(tf.shape(x)[0]),
                    logits=tf.matmul(state, state, transpose_b=True)))
            elif loss_kind == "max":
                loss = tf.reduce_max(per_example)
            else:
                loss = tf.reduce_mean(per_example)
            train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
            tf1.add_to_collection("train_op", train)
            tf1.train.export_meta_graph(str(path), graph=graph)
        finally:
            tf1.enable_control_flow_v2()
    rows = np.random.RandomState(0)
    np.savez(str(path) + ".npz", x=rows.randn(64, STEPS, FEATURES).astype(np.float32),
             y=rows.randint(0, 3, 64).astype(np.int32))
    return str(path)


@pytest.mark.parametrize("control_flow_v2", [False, True], ids=["legacy", "v2"])
@pytest.mark.parametrize("loss_kind,where", [("inbatch", "MatMul"), ("max", "Max")])
def test_mixing_after_an_rnn_is_refused(run_cli, tmp_path, loss_kind, where, control_flow_v2):
    model = export_rnn(tmp_path / "m.meta", loss_kind, control_flow_v2)
    code, out, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2, model,
                             "-o", tmp_path / "out.meta")
    assert code != 0, out + err
    assert "mixes the examples of its batch" in err and f"({where})" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out.meta").exists()


def test_mixing_inside_a_loop_body_is_refused(run_cli, tmp_path):
    model = export_rnn(tmp_path / "m.meta", "body", control_flow_v2=False)
    code, out, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2, model,
                             "-o", tmp_path / "out.meta")
    assert code != 0 and "mixes the examples of its batch" in err, out + err
    assert "'while/sub' (Sub)" in err, err


@pytest.mark.parametrize("control_flow_v2", [False, True], ids=["legacy", "v2"])
def test_an_rnn_mean_loss_still_trains_like_one_device(run_cli, tmp_path, control_flow_v2):
    model = export_rnn(tmp_path / "m.meta", "mean", control_flow_v2)
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", BATCH, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_the_flow_goes_through_the_loop_to_the_loss(tmp_path):
    """The loss's state is worked out (a mean over the batch), not unknown, in both forms."""
    from graphxform import batch_mixing, metagraph, training
    for v2 in (False, True):
        ir = metagraph.load(export_rnn(tmp_path / f"m{v2}.meta", "mean", v2))
        tg = training.analyze(ir)
        loss = tg.steps[0].loss.split(":")[0]
        flow = batch_mixing._settled(
            lambda: batch_mixing._Flow(ir, set(tg.batch_sources)), loss)
        assert flow.states[loss] == batch_mixing.AGGREGATE, (v2, flow.states[loss])


def test_join():
    from graphxform.batch_states import AGGREGATE, UNKNOWN, Mixed
    from graphxform.loop_mixing import join
    mixed = Mixed("n", "Op", "mixes")
    assert join(None, 0) == 0 and join(1, None) == 1 and join(0, 0) == 0
    assert join(None, AGGREGATE) == AGGREGATE
    assert join(0, 1) == UNKNOWN and join(0, AGGREGATE) == UNKNOWN
    assert join(None, mixed) is mixed and join(0, mixed) is mixed
