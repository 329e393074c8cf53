"""Recommender and NLP losses as their public code writes them. BPR (the widely copied TF1
bpr.py and its ports) minimises ``-tf.reduce_mean(tf.log(tf.sigmoid(x_uij)))`` plus an L2
penalty on the whole embedding tables: a mean over the batch behind a Neg, beside weight decay.
`check`'s losses rule read the Neg as unknown and the penalty's L2Loss as a sum over the
slice, and refused the transformed graph ("each replica's loss is a sum over its slice")
although the passes had transformed it exactly."""

import numpy as np
import pytest

USERS, ITEMS = 20, 30


def export_bpr(tmp_path) -> str:
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        u, i, j = (tf1.placeholder(tf.int32, [None], name=n) for n in "uij")
        users = tf1.get_variable("user_emb", [USERS, 8])
        items = tf1.get_variable("item_emb", [ITEMS, 8])
        x = tf.reduce_sum(tf.nn.embedding_lookup(users, u) * (
            tf.nn.embedding_lookup(items, i) - tf.nn.embedding_lookup(items, j)), 1)
        loss = -tf.reduce_mean(tf.math.log_sigmoid(x)) + 1e-4 * (
            tf.nn.l2_loss(users) + tf.nn.l2_loss(items))
        tf1.add_to_collection("train_op", tf1.train.AdagradOptimizer(0.1).minimize(loss))
        tf1.add_to_collection("losses", loss)
        path = str(tmp_path / "bpr.meta")
        tf1.train.export_meta_graph(path, graph=graph)
    rng = np.random.RandomState(0)
    np.savez(path + ".npz", u=rng.randint(0, USERS, 64).astype(np.int32),
             i=rng.randint(0, ITEMS, 64).astype(np.int32),
             j=rng.randint(0, ITEMS, 64).astype(np.int32))
    return path


@pytest.mark.parametrize("strategy", ["allreduce", "replicated"])
def test_a_negated_mean_beside_weight_decay_trains_like_one_device(run_cli, tmp_path, strategy):
    model = export_bpr(tmp_path)
    code, out, err = run_cli("verify", model, "--strategy", strategy, "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 8, "--steps", 2)
    assert code == 0 and "PASS" in out, out + err


def test_check_reads_a_negated_mean_as_a_mean(tmp_path):
    from graphxform import metagraph, strategies
    from graphxform.inspector import losses
    ir = metagraph.load(export_bpr(tmp_path))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    loss = losses.loss_tensors(ir)[0].split(":")[0]
    assert losses.kind(ir, "replica_0/" + loss) == losses.MEAN
    assert losses.check(ir).status == "ok", losses.check(ir).findings
