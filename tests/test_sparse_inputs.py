"""SparseTensor inputs fed through tf.compat.v1.sparse_placeholder (CTC labels, sparse feature
ids), and inputs whose batch is not on axis 0.

Split-inputs used to cut a sparse_placeholder's indices and values as if their rows were
examples: each replica got entries of other replicas' examples with the global dense shape
(CTCLoss failed at run time; apply exited 0). Now one SparseSplit cuts the SparseTensor by its
rows. The corpus recipes ctc_speech and sparse_ids_ctr train exactly as one device under every
strategy (the recipe tests); these tests pin the pieces."""

import numpy as np
import pytest
from conftest import export_classifier

from recipe_loop import batch as user_batch
from recipe_loop import load_feeds, recipe_meta
from test_custom_training_code import dense


def _analysis(name):
    from graphxform import metagraph, training
    ir = metagraph.load(recipe_meta(name))
    return ir, training.analyze(ir)


def test_the_three_placeholders_of_a_sparse_placeholder_are_one_sparse_input():
    _, tg = _analysis("ctc_speech")
    assert tg.sparse_inputs == {"labels": ("labels/indices", "labels/values", "labels/shape")}
    parts = {i.name: i for i in tg.inputs if i.sparse}
    assert not any(i.batched for i in parts.values())  # their rows are entries, not examples
    assert set(parts) <= set(tg.batch_sources)
    assert {"frames", "seq_len"} <= set(tg.batch_sources)


def test_look_alike_placeholders_are_not_a_sparse_input(tmp_path):
    """A float 'indices', or a triple missing its shape, is fed as what it says it is."""
    import tensorflow as tf

    from graphxform import metagraph, training
    tf1 = tf.compat.v1

    def build(x, y):
        with tf.name_scope("pair"):
            idx = tf1.placeholder(tf.float32, [None, 2], name="indices")
            vals = tf1.placeholder(tf.float32, [None], name="values")
        logits = dense(x, 2, "out") + tf.reduce_sum(idx) + tf.reduce_sum(vals)
        return tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                          logits=logits)))
    ir = metagraph.load(export_classifier(tmp_path / "m.meta", build))
    tg = training.analyze(ir)
    assert tg.sparse_inputs == {}
    assert {i.name: i.batched for i in tg.inputs}["pair/indices"]


def _transformed(name, replicas=2):
    from graphxform import metagraph, strategies
    ir = metagraph.load(recipe_meta(name))
    strategies.transform(ir, "allreduce",
                         devices=[f"/device:CPU:{i}" for i in range(replicas)])
    return ir


def test_split_inputs_cuts_a_sparse_input_by_rows_with_one_sparse_split():
    ir = _transformed("ctc_speech")
    split = "split_inputs/labels/split"
    assert ir.op(split) == "SparseSplit" and ir.attrs(split)["num_split"].i == 2
    assert [src for src, _ in ir.inputs(split)][1:] == ["labels/indices", "labels/values",
                                                       "labels/shape"]
    # outputs: 2 indices, 2 values, 2 shapes; replica 1 reads its own of each (CTCLoss
    # reads no shape)
    read = {port for node in ir.nodes() if node.startswith("replica_1/")
            for src, port in ir.inputs(node) if src == split}
    assert read == {1, 3}
    for part in ("indices", "values", "shape"):  # no replica reads the whole SparseTensor
        assert all(not dst.startswith("replica_") for dst, _ in ir.consumers(f"labels/{part}"))


LOSS = "sigmoid_cross_entropy_loss/value:0"  # sparse_ids_ctr's


def _run_transformed(ir, feed):
    import tensorflow as tf

    from graphxform import metagraph
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(metagraph.to_metagraph(ir))
        init = tf1.global_variables_initializer()
    config = tf1.ConfigProto(device_count={"CPU": 2})
    with tf1.Session(graph=graph, config=config) as sess:
        sess.run(init)
        return sess.run(LOSS, feed)


def test_a_sparse_batch_that_does_not_divide_is_refused_at_run_time():
    """SparseSplit itself would cut 15 rows into 8 and 7; the graph refuses them instead."""
    import tensorflow as tf
    ir = _transformed("sparse_ids_ctr")
    feeds = user_batch(load_feeds("sparse_ids_ctr"), 0, 16)
    assert np.isfinite(_run_transformed(ir, feeds))
    odd = user_batch({k: v for k, v in load_feeds("sparse_ids_ctr").items()
                      if k.startswith("ids/")}, 0, 15)
    # the dense inputs divide (16 rows); the sparse one's 15 rows do not
    odd.update({k: v for k, v in feeds.items() if not k.startswith("ids/")})
    with pytest.raises(tf.errors.InvalidArgumentError, match="sparse input ids does not "
                       "divide evenly across 2 replicas"):
        _run_transformed(ir, odd)
    from graphxform.passes.split_inputs import uneven_batch
    assert uneven_batch("... [[{{node split_inputs/ids/divides}}]] ...") == (
        "the batch for sparse input 'ids' does not divide evenly across replicas")


def test_feeds_cut_a_sparse_pool_as_a_users_loop_does():
    """graphxform's Feeds and the test-side user loop (written apart) agree, batch by batch."""
    from graphxform.runtime import Feeds
    _, tg = _analysis("ctc_speech")
    path = recipe_meta("ctc_speech").replace(".meta", ".npz")
    feeds = Feeds(tg.inputs, path, 16)
    pool = load_feeds("ctc_speech")
    for step in (0, 3, 5):  # 5 wraps around the 64 rows
        got, want = feeds.batch(step), user_batch(pool, step, 16)
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["labels/shape:0"].tolist() == [16, 3]


def test_feeds_make_a_synthetic_sparse_batch_without_a_file():
    from graphxform.runtime import Feeds
    _, tg = _analysis("sparse_ids_ctr")
    batch = Feeds(tg.inputs, None, 8).batch(0)
    indices, values, shape = (batch[f"ids/{p}:0"] for p in ("indices", "values", "shape"))
    assert shape.tolist() == [8, 3] and indices.shape[1] == 2 and len(values) == len(indices)
    assert (indices < shape).all() and set(indices[:, 0]) == set(range(8))
    assert values.dtype == np.int64


def test_a_pool_that_is_no_sparse_tensor_is_one_line_naming_the_file(tmp_path, run_cli):
    pool = dict(load_feeds("sparse_ids_ctr"))
    pool["ids/values"] = pool["ids/values"][:-1]  # one value short of the indices
    path = tmp_path / "bad.npz"
    np.savez(path, **pool)
    code, out, err = run_cli("run", recipe_meta("sparse_ids_ctr"), "--steps", "1",
                             "--feeds", path)
    assert code != 0
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "bad.npz" in err and "sparse input 'ids'" in err


def test_reversing_a_batch_reverses_the_sparse_rows_with_the_dense_ones():
    from graphxform.equivalence import _reversed_rows
    _, tg = _analysis("sparse_ids_ctr")
    feed = user_batch(load_feeds("sparse_ids_ctr"), 0, 4)
    back = _reversed_rows(feed, tg.inputs)
    np.testing.assert_array_equal(back["dense:0"], feed["dense:0"][::-1])
    rows = lambda f, r: f["ids/values:0"][f["ids/indices:0"][:, 0] == r].tolist()
    assert [rows(back, r) for r in range(4)] == [rows(feed, r) for r in (3, 2, 1, 0)]


def test_a_split_port_reads_alike_in_every_replica_for_the_inspector():
    """A collective's instance key computed from each replica's slice (the sparse gradient's
    padded gather) is one instance, not one per split port."""
    from graphxform.inspector import shapes
    ir = _transformed("sparse_ids_ctr")
    split = "split_inputs/ids/split"
    assert shapes.describe(ir, split, 2) == shapes.describe(ir, split, 3)
    assert shapes.describe(ir, split, 0) != shapes.describe(ir, split, 2)


def _time_major(path, time_steps):
    """Time-major data [time, batch, 4] (as dynamic_rnn(time_major=True) reads it), summed over
    time after a transpose to batch-major, labels [batch]."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [time_steps, None, 4], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        state = tf.reduce_sum(tf.transpose(x, [1, 0, 2]), axis=1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=dense(state, 2, "out")))
        tf1.add_to_collection("train_op",
                              tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def test_an_input_with_its_batch_on_another_axis_is_refused(tmp_path, run_cli):
    """[7, ?, 4]: fed whole to every replica beside the others' slices, it failed at run time
    after apply exited 0."""
    meta = _time_major(tmp_path / "tm.meta", 7)
    code, out, err = run_cli("apply", "--strategy", "allreduce", "--replicas", "2", meta)
    assert code == 1
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "input 'x' has shape [7, ?, 4]" in err and "axis 1, not axis 0" in err
    assert not (tmp_path / "tm.allreduce.meta").exists()


def _sparse_from_placeholders(path, shape="placeholder"):
    """The SparseTensor of ids built by hand, as CTR code without sparse_placeholder does:
    ``tf.SparseTensor(indices, values, dense_shape)`` of plain placeholders, then
    embedding_lookup_sparse (which reads the indices' column 0 as segment ids, never the
    shape). ``shape``: "placeholder", "batch" (computed from the labels' batch), "unread"
    (the lookup reads the indices as a dense [?, 2] input instead), or None (no SparseTensor:
    the int64 [?, 2] input is pairs of ids per example)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        idx = tf1.placeholder(tf.int64, [None, 2], name="feat_idx")
        val = tf1.placeholder(tf.int64, [None], name="feat_val")
        y = tf1.placeholder(tf.float32, [None], name="y")
        table = tf1.get_variable("table", [50, 4])
        if shape in ("placeholder", "batch"):
            dense_shape = (tf1.placeholder(tf.int64, [2], name="feat_shape")
                           if shape == "placeholder" else
                           tf.stack([tf.shape(y, out_type=tf.int64)[0], 50]))
            embedded = tf.nn.embedding_lookup_sparse(
                table, tf.SparseTensor(idx, val, dense_shape), None, combiner="mean")
        else:
            if shape == "unread":
                tf1.placeholder(tf.int64, [2], name="feat_shape")
            embedded = tf.nn.embedding_lookup(table, idx[:, 0] + val)
        pred = tf.reduce_sum(embedded, axis=1)
        loss = tf.reduce_mean(tf.square(pred - y))
        tf1.add_to_collection("train_op", tf1.train.AdagradOptimizer(0.1).minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


SPARSE_LOOKALIKES = {
    "placeholder": "input 'feat_idx' (int64 [?, 2]) is read as a SparseTensor's indices (by "
                   "'embedding_lookup_sparse', SparseSegmentMean)",
    "batch": "input 'feat_idx' (int64 [?, 2]) is read as a SparseTensor's indices (by "
             "'embedding_lookup_sparse', SparseSegmentMean)",
    "unread": "inputs 'feat_idx' (int64 [?, 2]), 'feat_val' ([?]) and 'feat_shape' (int64 [2]) "
              "look like a SparseTensor's",
}


@pytest.mark.parametrize("shape", sorted(SPARSE_LOOKALIKES))
def test_a_sparse_tensor_of_plain_placeholders_is_refused(tmp_path, run_cli, shape):
    """Its indices and values looked batched: split by entries (the dense shape fed whole, or
    computed from the slice), apply exited 0."""
    meta = _sparse_from_placeholders(tmp_path / "ctr.meta", shape)
    code, out, err = run_cli("apply", "--replicas", "2", meta)
    assert code == 1
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert SPARSE_LOOKALIKES[shape] in err and "sparse_placeholder" in err
    assert not (tmp_path / "ctr.allreduce.meta").exists()


def test_pairs_of_ids_per_example_are_not_a_sparse_tensor(tmp_path, run_cli):
    pairs = _sparse_from_placeholders(tmp_path / "pairs.meta", None)
    code, out, err = run_cli("apply", "--replicas", "2", pairs)
    assert code == 0, err


def _ctc_time_major(path):
    """tf.compat.v1.nn.ctc_loss as its docs default it, time_major=True: features fed
    [time, batch, 4] with both unknown, labels through sparse_placeholder."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        feats = tf1.placeholder(tf.float32, [None, None, 4], name="feats")
        lengths = tf1.placeholder(tf.int32, [None], name="seq_len")
        labels = tf1.sparse_placeholder(tf.int32, name="labels")
        logits = tf.einsum("tbf,fc->tbc", feats, tf1.get_variable("w", [4, 6]))
        loss = tf.reduce_mean(tf1.nn.ctc_loss(labels, logits, lengths))
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(0.05).minimize(loss))
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def test_time_major_ctc_logits_are_refused(tmp_path, run_cli):
    """Split along time beside labels split by examples, apply exited 0 and the run failed."""
    meta = _ctc_time_major(tmp_path / "ctc.meta")
    code, out, err = run_cli("apply", "--replicas", "2", meta)
    assert code == 1
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "'CTCLoss' (CTCLoss) reads time-major logits" in err and "time_major=False" in err
    assert not (tmp_path / "ctc.allreduce.meta").exists()


def _bag_of_embeddings(path, partly_known: bool) -> str:
    """A DAN / fastText bag of embeddings: unsorted_segment_mean of a sparse_placeholder's
    rows, as many segments as its dense shape has rows. ``partly_known``: the shape given as
    [None, None] (what tf.RaggedTensor.from_sparse needs), which makes the dense shape a
    PlaceholderWithDefault."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        tokens = tf1.sparse_placeholder(tf.int64, [None, None] if partly_known else None,
                                        name="tokens")
        y = tf1.placeholder(tf.int32, [None], name="y")
        emb = tf1.get_variable("emb", [40, 6], initializer=tf1.random_normal_initializer(seed=1))
        w = tf1.get_variable("w", [6, 3], initializer=tf1.random_normal_initializer(seed=2))
        bag = tf.math.unsorted_segment_mean(tf.nn.embedding_lookup(emb, tokens.values),
                                            tf.cast(tokens.indices[:, 0], tf.int32),
                                            tf.cast(tokens.dense_shape[0], tf.int32))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(bag, w)), name="loss")
        tf1.train.AdagradOptimizer(0.5).minimize(loss)
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    rows = [(i, j) for i in range(32) for j in range(rng.randint(1, 5))]
    np.savez(str(path) + ".npz", **{"tokens/indices": np.array(rows, np.int64),
                                    "tokens/values": rng.randint(0, 40, len(rows)),
                                    "tokens/shape": np.array([32, 5], np.int64),
                                    "y": rng.randint(0, 3, 32).astype(np.int32)})
    return str(path)


@pytest.mark.parametrize("partly_known", [False, True])
def test_a_bag_counted_by_the_dense_shape_trains_like_one_device(tmp_path, run_cli,
                                                                 partly_known):
    """The dense shape's rows are the batch's size (it was read as a batch tensor whose first
    example was picked: refused); a partly known shape is still a sparse_placeholder's (it was
    refused as plain placeholders that look like one)."""
    model = _bag_of_embeddings(tmp_path / "m.meta", partly_known)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def _safe_wide_model(path) -> str:
    """A wide (linear) model as TF's wide & deep tutorials build it: weighted ids of a
    sparse_placeholder through tf.compat.v1.nn.safe_embedding_lookup_sparse, whose
    SparseFillEmptyRows gives an example with no ids a row (some have none here)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        ids = tf1.sparse_placeholder(tf.int64, name="ids")
        weights = tf1.sparse_placeholder(tf.float32, name="wts")
        y = tf1.placeholder(tf.float32, [None], name="y")
        table = tf1.get_variable("wide", [50, 1],
                                 initializer=tf1.random_normal_initializer(seed=1))
        bias = tf1.get_variable("bias", [1], initializer=tf1.zeros_initializer())
        logits = tf1.nn.safe_embedding_lookup_sparse([table], ids, weights,
                                                     combiner="sqrtn")[:, 0] + bias
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
        tf1.train.AdagradOptimizer(0.3).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        tf1.train.export_meta_graph(str(path), graph=g)
    rng = np.random.RandomState(0)
    rows = np.array([(i, j) for i in range(64) for j in range(rng.randint(0, 4))], np.int64)
    shape = np.array([64, 4], np.int64)
    np.savez(str(path) + ".npz", **{
        "ids/indices": rows, "ids/values": rng.randint(0, 50, len(rows)), "ids/shape": shape,
        "wts/indices": rows, "wts/values": rng.rand(len(rows)).astype(np.float32),
        "wts/shape": shape, "y": (rng.rand(64) < 0.5).astype(np.float32)})
    return str(path)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_safe_embedding_lookup_sparse_trains_like_one_device(tmp_path, run_cli, strategy):
    """SparseFillEmptyRows' filled rows and its segment ops follow the sparse-bag rule: the
    wide model is accepted and exact (a pin: it already was)."""
    model = _safe_wide_model(tmp_path / "m.meta")
    spec = tmp_path / "cluster.json"
    spec.write_text('{"ps": ["127.0.0.1:27121"], "worker": ["127.0.0.1:27122", '
                    '"127.0.0.1:27123"]}')
    where = ["--cluster", spec] if strategy == "ps" else ["--replicas", 2]
    code, out, err = run_cli("verify", "--strategy", strategy, *where, model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
