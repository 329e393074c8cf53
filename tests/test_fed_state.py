"""A state the user's loop fetches and feeds back: the TF PTB tutorial's and char-rnn's RNN
language models fetch the zero state (``cell.zero_state(batch_size)``), feed each step's final
state into it, and fetch the final state again. The transformed graph must take the fed state
into every replica's slice and give back the whole batch's final state."""

import json

import numpy as np
import pytest

B, T, V = 8, 5, 20  # global batch, steps unrolled, vocabulary


def char_rnn(directory, hidden: int, zero_state: str) -> str:
    """An LSTM language model unrolled over T steps with plain ops, its zero state made as
    ``zero_state`` says: 'const' (tf.zeros folds a small batch into a Const), 'fill' (a large
    one is a Fill) or 'cell' (an RNN cell's: a Fill of the batch size concatenated with the
    units). Writes model.meta and a start checkpoint; returns the .meta path."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.int32, [B, T], name="x")
        y = tf1.placeholder(tf.int32, [B, T], name="y")
        inputs = tf.nn.embedding_lookup(tf1.get_variable("emb", [V, hidden]), x)
        shape = tf.concat([[B], [hidden]], 0) if zero_state == "cell" else [B, hidden]
        c, h = tf.zeros(shape, name="initial_c"), tf.zeros(shape, name="initial_h")
        kernel = tf1.get_variable("lstm/kernel", [2 * hidden, 4 * hidden])
        outputs = []
        for t in range(T):
            i, j, f, o = tf.split(tf.matmul(tf.concat([inputs[:, t], h], 1), kernel), 4, 1)
            c = c * tf.sigmoid(f + 1.0) + tf.sigmoid(i) * tf.tanh(j)
            h = tf.tanh(c) * tf.sigmoid(o)
            outputs.append(h)
        tf.identity(c, "final_c")
        tf.identity(h, "final_h")
        logits = tf.matmul(tf.reshape(tf.stack(outputs, 1), [-1, hidden]),
                           tf1.get_variable("out/kernel", [hidden, V]))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(y, [-1]), logits=logits), name="loss")
        train = tf1.train.GradientDescentOptimizer(1.0).minimize(
            loss, global_step=tf1.train.get_or_create_global_step(), name="train")
        tf1.add_to_collection("train_op", train)
        with tf1.Session() as session:
            session.run(tf1.global_variables_initializer())
            tf1.train.Saver().save(session, str(directory / "start"))
        tf1.train.export_meta_graph(str(directory / "model.meta"), graph=graph)
    rng = np.random.RandomState(0)
    np.savez(str(directory / "pool.npz"), x=rng.randint(0, V, (64, T)).astype(np.int32),
             y=rng.randint(0, V, (64, T)).astype(np.int32))
    assert (graph.get_tensor_by_name("initial_c:0").op.type
            == {"const": "Const", "fill": "Fill", "cell": "Fill"}[zero_state])
    return str(directory / "model.meta")


def ptb_loop(meta: str, start: str, steps: int = 4):
    """The PTB tutorial's run_epoch: fetch the initial state, then each step feed the state
    the last step fetched. Returns the losses and the last final state."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    rng = np.random.RandomState(1)
    graph = tf.Graph()
    with graph.as_default():
        saver = tf1.train.import_meta_graph(meta)
        config = tf1.ConfigProto(device_count={"CPU": 2})
        with tf1.Session(graph=graph, config=config) as session:
            saver.restore(session, start)
            c, h = session.run(["initial_c:0", "initial_h:0"])
            losses = []
            for _ in range(steps):
                feeds = {"x:0": rng.randint(0, V, (B, T)), "y:0": rng.randint(0, V, (B, T)),
                         "initial_c:0": c, "initial_h:0": h}
                loss, c, h, _ = session.run(["loss:0", "final_c:0", "final_h:0", "train"],
                                            feeds)
                losses.append(loss)
    return losses, c, h


@pytest.mark.parametrize("zero_state, hidden", [("const", 16), ("fill", 128), ("cell", 128)])
def test_a_state_fed_back_trains_like_one_device(run_cli, tmp_path, zero_state, hidden):
    model = char_rnn(tmp_path, hidden, zero_state)
    out = tmp_path / "model.allreduce.meta"
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", out)
    assert code == 0, err
    start = str(tmp_path / "start")
    want_losses, want_c, want_h = ptb_loop(model, start)
    got_losses, got_c, got_h = ptb_loop(str(out), start)
    assert got_c.shape == want_c.shape == (B, hidden)  # the whole batch's, not replica 0's
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-5)


def test_a_filled_batch_is_split_once_for_all_replicas(tmp_path):
    """The original name fills the global batch; each replica reads its slice of it."""
    from graphxform import metagraph, strategies
    ir = metagraph.load(char_rnn(tmp_path, 128, "cell"))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    assert ir.op("initial_c") == "Fill"
    for i in range(2):
        assert ir.op(f"replica_{i}/initial_c") == "Identity"
        assert ir.inputs(f"replica_{i}/initial_c") == [("split_inputs/initial_c/split", i)]


def test_a_fed_state_graph_verifies_under_ps(run_cli, tmp_path):
    model = char_rnn(tmp_path, 128, "fill")
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"ps": ["127.0.0.1:2322"],
                                "worker": ["127.0.0.1:2324", "127.0.0.1:2325"]}))
    code, out, err = run_cli("verify", model, "--strategy", "ps", "--cluster", spec,
                             "--feeds", tmp_path / "pool.npz", "--batch-size", B, "--steps", 3)
    assert code == 0, out + err
    assert "PASS" in out
