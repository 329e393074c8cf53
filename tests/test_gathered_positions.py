"""Rows of each example picked by index, as public sequence code writes it.

google-research/bert's masked-LM loss (``gather_indexes``) flattens the sequence output to
[batch * seq_length, width] and gathers ``positions + tf.range(batch) * seq_length``; the last
output of each padded sequence is ``tf.gather(flat, tf.range(batch) * max_length + length - 1)``
or ``tf.gather_nd(output, tf.stack([tf.range(batch), length - 1], 1))``. A replica's range
numbers its own examples, so each picks the same rows one device picks. The flat gather was
refused as mixing the batch ('GatherV2 picks or reorders the examples'), and a gather_nd whose
first index is not the example's own number (a partner's, the first example's) passed apply
and trained another model (verify: 6e-02): it is refused now, naming the GatherNd. So is
``tf.gather(output, length - 1, axis=1)``, which looks every example's length up in every
example ([batch, batch, width]; verify: 4e-02); ``batch_dims=1`` pairs each with its own."""

import numpy as np
import pytest

T, V, P = 10, 30, 3


def _export(path, build, feeds):
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        loss = build()
        step = tf1.train.get_or_create_global_step()
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=step))
        tf1.add_to_collection("losses", loss)
        tf1.train.export_meta_graph(str(path), graph=graph)
    np.savez(str(path) + ".npz", **feeds)
    return str(path)


def _padded(rng):
    """64 sequences, the two slices of every batch of 16 with different lengths."""
    lengths = rng.randint(4, 6, 64)
    lengths[8::16] = T
    ids = rng.randint(1, V, (64, T))
    ids[np.arange(T)[None] >= lengths[:, None]] = 0
    return ids.astype(np.int32), lengths.astype(np.int32)


def _sequence_output(tokens):
    import tensorflow as tf
    tf1 = tf.compat.v1
    table = tf1.get_variable("word_embeddings", [V, 8])
    hidden = tf.tanh(tf.tensordot(tf.nn.embedding_lookup(table, tokens),
                                  tf1.get_variable("encoder", [8, 8]), 1))
    return table, hidden


def masked_lm(path, static):
    """get_masked_lm_output as google-research/bert writes it, tied output embeddings, a
    label-weighted numerator / (sum(label_weights) + 1e-5), plus the next-sentence loss."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build():
        input_ids = tf1.placeholder(tf.int32, [None, T], name="input_ids")
        positions = tf1.placeholder(tf.int32, [None, P], name="masked_lm_positions")
        label_ids = tf1.placeholder(tf.int32, [None, P], name="masked_lm_ids")
        label_weights = tf1.placeholder(tf.float32, [None, P], name="masked_lm_weights")
        next_sentence = tf1.placeholder(tf.int32, [None], name="next_sentence_labels")
        table, sequence = _sequence_output(input_ids)
        shape = tf.shape(sequence)  # gather_indexes, get_shape_list's dims
        batch_size, seq_length = shape[0], T if static else shape[1]
        flat_offsets = tf.reshape(tf.range(0, batch_size, dtype=tf.int32) * seq_length, [-1, 1])
        flat_positions = tf.reshape(positions + flat_offsets, [-1])
        flat_sequence = tf.reshape(sequence, [batch_size * seq_length, 8])
        picked = tf.gather(flat_sequence, flat_positions)
        logits = tf.matmul(tf.tanh(picked), table, transpose_b=True)
        log_probs = tf.nn.log_softmax(logits, axis=-1)
        weights = tf.reshape(label_weights, [-1])
        per_example = -tf.reduce_sum(
            log_probs * tf.one_hot(tf.reshape(label_ids, [-1]), depth=V), axis=[-1])
        masked_lm_loss = tf.reduce_sum(weights * per_example) / (tf.reduce_sum(weights) + 1e-5)
        first = tf.squeeze(sequence[:, 0:1, :], axis=1)
        nsp = tf.nn.log_softmax(tf.matmul(first, tf1.get_variable("nsp", [8, 2])), axis=-1)
        nsp_loss = tf.reduce_mean(-tf.reduce_sum(tf.one_hot(next_sentence, 2) * nsp, axis=-1))
        return tf.identity(masked_lm_loss + nsp_loss, name="total_loss")

    rng = np.random.RandomState(0)
    ids, lengths = _padded(rng)
    picked = np.stack([rng.choice(n, P, replace=False) for n in lengths]).astype(np.int32)
    weights = (rng.rand(64, P) > 0.3).astype(np.float32)
    return _export(path, build, {
        "input_ids": ids, "masked_lm_positions": picked,
        "masked_lm_ids": np.take_along_axis(ids, picked, 1), "masked_lm_weights": weights,
        "next_sentence_labels": rng.randint(0, 2, 64).astype(np.int32)})


def last_output(path, form):
    """A classifier of each padded sequence's last real output, picked by ``form``."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build():
        tokens = tf1.placeholder(tf.int32, [None, T], name="tokens")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        labels = tf1.placeholder(tf.int64, [None], name="labels")
        _, output = _sequence_output(tokens)
        batch = tf.shape(output)[0]
        flat = tf.reshape(output, [-1, 8])
        if form == "gather":  # Hafner, 'Variable Sequence Lengths in TensorFlow'
            last = tf.gather(flat, tf.range(0, batch) * T + (lengths - 1))
        elif form == "gather_nd":
            last = tf.gather_nd(output, tf.stack([tf.range(batch), lengths - 1], axis=1))
        elif form == "gather_nd_of_partner":  # each example reads the next one's
            partner = tf.math.floormod(tf.range(batch) + 1, batch)
            last = tf.gather_nd(output, tf.stack([partner, lengths - 1], axis=1))
        elif form == "gather_nd_of_first":
            last = tf.gather_nd(output, tf.stack([tf.zeros_like(lengths), lengths - 1], 1))
        elif form == "gather_by_half_stride":  # strides of 5 through rows of 10: a neighbour's
            last = tf.gather(flat, tf.range(0, batch) * 5 + (lengths - 1))
        elif form == "gather_along_time_by_every_length":  # [B, B, 8]: each at all lengths
            last = tf.reduce_mean(tf.gather(output, lengths - 1, axis=1), axis=1)
        elif form == "gather_batch_dims":
            last = tf.gather(output, lengths - 1, batch_dims=1)
        else:  # "gather_offsets_counting_examples": the offset numbers examples too
            last = tf.gather(flat, tf.range(0, batch) * T + tf.minimum(tf.range(0, batch), 3))
        logits = tf.matmul(last, tf1.get_variable("w", [8, 2]))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")

    ids, lengths = _padded(np.random.RandomState(0))
    return _export(path, build, {"tokens": ids, "lengths": lengths,
                                 "labels": (ids[np.arange(64), lengths - 1] % 2)})


def _cluster(tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:27811"], '
                       '"worker": ["127.0.0.1:27812", "127.0.0.1:27813"]}')
    return ["--cluster", cluster]


def _verify(run_cli, tmp_path, meta, strategy):
    where = _cluster(tmp_path) if strategy == "ps" else ["--replicas", 2]
    code, out, err = run_cli("verify", "--strategy", strategy, *where, meta, "--feeds",
                             meta + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("static, strategy", [(True, "allreduce"), (False, "allreduce"),
                                              (True, "ps"), (False, "replicated")])
def test_bert_masked_lm_loss_trains_like_one_device(run_cli, tmp_path, static, strategy):
    _verify(run_cli, tmp_path, masked_lm(tmp_path / "m.meta", static), strategy)


@pytest.mark.parametrize("form", ["gather", "gather_nd", "gather_batch_dims"])
def test_the_last_output_of_each_sequence_trains_like_one_device(run_cli, tmp_path, form):
    _verify(run_cli, tmp_path, last_output(tmp_path / "m.meta", form), "allreduce")


@pytest.mark.parametrize("form, op", [("gather_nd_of_partner", "GatherNd"),
                                      ("gather_nd_of_first", "GatherNd"),
                                      ("gather_by_half_stride", "GatherV2"),
                                      ("gather_offsets_counting_examples", "GatherV2"),
                                      ("gather_along_time_by_every_length", "GatherV2")])
def test_picking_another_examples_rows_is_refused(run_cli, tmp_path, form, op):
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2,
                           last_output(tmp_path / "m.meta", form), "-o", tmp_path / "o.meta")
    assert code == 1
    assert f"'{op}' ({op})" in err and "mixes the examples of its batch" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
