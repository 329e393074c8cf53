"""Graph neural networks and bags of sparse ids, as public TF1 code writes them.

A GCN over one whole graph (Kipf & Welling's: the adjacency times the node features, the nodes
being the batch) sums every node's neighbours: a replica's slice of the nodes cannot meet the
whole graph's adjacency. It used to pass apply (the product of a batch-free matrix with the
batch's axis, and SparseTensorDenseMatMul, had no rule) and fail at run time on a shape. A
mini-batch of small graphs (a padded adjacency per example) trains like one device.

tf.nn.embedding_lookup_sparse sums each example's entries per row of the SparseTensor
(``segment_ids = sp_ids.indices[:, 0]``): per example, not a sum over the batch. With weights
(its SegmentSum path) it was read as a sum over the batch: combiner="sqrtn" was refused, and
centring the bags by their batch mean was not seen at all (without weights the lookup's
SparseSegmentMean had no rule): apply exited 0 and trained another model."""

import numpy as np
import pytest

N_NODES, N_FEATURES, VOCAB = 16, 4, 20


def _dense(x, units, name):
    import tensorflow as tf
    tf1 = tf.compat.v1
    with tf1.variable_scope(name):
        w = tf1.get_variable("kernel", [x.shape[-1], units])
        return tf.tensordot(x, w, 1) if len(x.shape) > 2 else tf.matmul(x, w)


def _export(path, build, feeds):
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        loss = build()
        tf1.add_to_collection("train_op", tf1.train.AdagradOptimizer(0.1).minimize(
            loss, global_step=tf1.train.get_or_create_global_step()))
        tf1.train.export_meta_graph(str(path), graph=graph)
    np.savez(str(path) + ".npz", **feeds)
    return str(path)


def _adjacency():
    rng = np.random.RandomState(0)
    a = rng.rand(N_NODES, N_NODES) < 0.2
    a = a | a.T | np.eye(N_NODES, dtype=bool)
    degree = a.sum(1)
    return (a / np.sqrt(degree[:, None] * degree[None])).astype(np.float32)


def _full_graph_gcn(path, adjacency):
    """A two-layer GCN on one graph whose nodes are fed as the batch, Kipf's masked loss."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build():
        a = _adjacency()
        if adjacency == "sparse":
            where = np.argwhere(a)
            adj = tf.SparseTensor(where, a[a != 0], a.shape)
            product = tf.sparse.sparse_dense_matmul
        elif adjacency == "dense":
            adj, product = tf.constant(a), tf.matmul
        else:  # fed, as the reference implementation feeds its "support"
            adj, product = tf1.sparse_placeholder(tf.float32, name="support"), \
                tf.sparse.sparse_dense_matmul
        x = tf1.placeholder(tf.float32, [None, N_FEATURES], name="features")
        labels = tf1.placeholder(tf.int32, [None], name="labels")
        mask = tf1.placeholder(tf.float32, [None], name="labels_mask")
        hidden = tf.nn.relu(product(adj, _dense(x, 8, "gc1")))
        logits = product(adj, _dense(hidden, 3, "gc2"))
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        return tf.reduce_mean(losses * mask / tf.reduce_mean(mask))
    return _export(path, build, {})


@pytest.mark.parametrize("adjacency", ["sparse", "dense", "fed"])
def test_a_gcn_over_one_whole_graph_is_refused_naming_the_product(tmp_path, run_cli,
                                                                  adjacency):
    model = _full_graph_gcn(tmp_path / "gcn.meta", adjacency)
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2, model,
                           "-o", tmp_path / "out.meta")
    assert code == 1 and "Traceback" not in err
    op = "MatMul" if adjacency == "dense" else "SparseTensorDenseMatMul"
    assert f"({op}) sums over the examples of its batch" in err
    assert "message passing over one whole graph" in err
    assert len(err.strip().splitlines()) == 1


def test_a_mini_batch_of_small_graphs_trains_like_one_device(tmp_path, run_cli):
    """Each example its own graph: a padded adjacency per example and a batched matmul."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    n = 5

    def build():
        adj = tf1.placeholder(tf.float32, [None, n, n], name="adjacency")
        x = tf1.placeholder(tf.float32, [None, n, N_FEATURES], name="node_features")
        y = tf1.placeholder(tf.int64, [None], name="graph_label")
        hidden = tf.nn.relu(tf.matmul(adj, _dense(x, 8, "gc1")))
        logits = _dense(tf.reduce_mean(tf.matmul(adj, hidden), 1), 2, "readout")
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
    rng = np.random.RandomState(0)
    a = (rng.rand(64, n, n) < 0.4).astype(np.float32) + np.eye(n, dtype=np.float32)
    x = rng.randn(64, n, N_FEATURES).astype(np.float32)
    model = _export(tmp_path / "graphs.meta", build, {
        "adjacency": a / a.sum(2, keepdims=True), "node_features": x,
        "graph_label": (x[:, :, 0].sum(1) > 0).astype(np.int64)})
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def _sparse_pool(name, rows, dtype):
    indices = [[r, c] for r, values in enumerate(rows) for c in range(len(values))]
    return {f"{name}/indices": np.asarray(indices, np.int64),
            f"{name}/values": np.concatenate(rows).astype(dtype),
            f"{name}/shape": np.asarray([len(rows), 4], np.int64)}


def _bag_of_ids(path, combiner, weighted, centred):
    """CTR-style: ids (and weights) per example through sparse_placeholders,
    embedding_lookup_sparse, a sigmoid cross entropy."""
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build():
        ids = tf1.sparse_placeholder(tf.int64, name="ids")
        weights = tf1.sparse_placeholder(tf.float32, name="weights") if weighted else None
        clicked = tf1.placeholder(tf.float32, [None, 1], name="clicked")
        table = tf1.get_variable("embeddings", [VOCAB, 4])
        bags = tf.nn.embedding_lookup_sparse(table, ids, weights, combiner=combiner)
        if centred:
            bags -= tf.reduce_mean(bags, 0)
        logits = _dense(tf.nn.relu(_dense(bags, 8, "hidden")), 1, "logit")
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=clicked,
                                                                      logits=logits))
    rng = np.random.RandomState(0)
    rows = [rng.choice(VOCAB, rng.randint(1, 5), replace=False) for _ in range(64)]
    score = rng.randn(VOCAB)
    feeds = {"clicked": np.array([[score[r].mean() > 0] for r in rows], np.float32)}
    feeds.update(_sparse_pool("ids", rows, np.int64))
    if weighted:
        feeds.update(_sparse_pool("weights", [rng.rand(len(r)) + 0.5 for r in rows],
                                  np.float32))
    return _export(path, build, feeds)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_weighted_bags_of_ids_train_like_one_device(tmp_path, run_cli, combiner):
    model = _bag_of_ids(tmp_path / "bags.meta", combiner, weighted=True, centred=False)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


@pytest.mark.parametrize("weighted", [False, True])
def test_bags_centred_by_their_batch_mean_are_refused(tmp_path, run_cli, weighted):
    model = _bag_of_ids(tmp_path / "bags.meta", "mean", weighted=weighted, centred=True)
    code, _, err = run_cli("apply", "--strategy", "allreduce", "--replicas", 2, model,
                           "-o", tmp_path / "out.meta")
    assert code == 1 and "mixes the examples of its batch: 'sub' (Sub)" in err, err
