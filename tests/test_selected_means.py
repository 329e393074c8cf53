"""A mean over the elements a mask of the batch selects (tf.boolean_mask: padding, an ignore
label) trains like one device: each replica divides by the whole batch's count of selected
elements (passes/global_denominators.py). They were refused."""

import numpy as np
import pytest

from conftest import export_classifier


def _masked(path, form):
    import tensorflow as tf
    tf1 = tf.compat.v1

    def build(x, y):
        logits = tf.matmul(x, tf1.get_variable("w0", [8, 2]))
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        selected = tf.boolean_mask(per, x[:, 1] > 0)
        if form == "mean":
            loss = tf.reduce_mean(selected)
        elif form == "sum_over_size":
            loss = tf.reduce_sum(selected) / tf.cast(tf.size(selected), tf.float32)
        elif form == "guarded_rows":
            loss = tf.reduce_sum(selected) / tf.maximum(
                tf.cast(tf.shape(selected)[0], tf.float32), 1.0)
        elif form == "mean_over_rows":  # a Mean over axis 0 of [count, 2] selected losses
            loss = 2.0 * tf.reduce_mean(tf.boolean_mask(tf.stack([per, 2 * per], 1),
                                                        x[:, 1] > 0), axis=0)[1]
        else:  # sum_of_mean_over_rows
            loss = tf.reduce_sum(tf.reduce_mean(tf.boolean_mask(tf.stack([per, 2 * per], 1),
                                                                x[:, 1] > 0), axis=0))
        return tf1.train.GradientDescentOptimizer(0.5).minimize(tf.identity(loss, "loss"))

    meta = export_classifier(path, build)
    data = dict(np.load(meta + ".npz"))  # replica 0's slice of each 16 keeps 8, replica 1's 4
    data["x"][:, 1] = np.where(np.arange(64) % 16 < 12, 1.0, -1.0)
    np.savez(meta + ".npz", **data)
    return meta


@pytest.mark.parametrize("form", ["mean", "sum_over_size", "guarded_rows"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_mean_over_a_masked_selection_trains_like_one_device(run_cli, tmp_path, form,
                                                                strategy):
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:28131"], "worker": ["127.0.0.1:28132", '
                       '"127.0.0.1:28133"]}')
    where = ("--cluster", cluster) if strategy == "ps" else ("--replicas", 2)
    meta = _masked(tmp_path / "m.meta", form)
    code, out, err = run_cli("verify", "--strategy", strategy, *where, meta, "--feeds",
                             meta + ".npz", "--batch-size", 16, "--steps", 3,
                             "--fetch", "loss:0")
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("form", ["mean_over_rows", "sum_of_mean_over_rows"])
def test_a_mean_over_the_rows_of_a_selection_alone_is_refused(run_cli, tmp_path, form):
    """Sliced, `apply` exited 0 and verify failed (1e-01)."""
    meta = _masked(tmp_path / "m.meta", form)
    code, _, err = run_cli("apply", "--replicas", 2, meta, "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "averages ('Mean') over the elements that 'boolean_mask_1/GatherV2'" in err
    assert "the exact forms are tf.reduce_mean over every axis of the selection" in err
    assert len(err.strip().splitlines()) == 1


def test_the_walks_for_several_means_share_what_found_nothing_and_still_find_a_selection():
    """selections.RowSelections keeps the nodes a walk that found no selection went through;
    a later walk that passes them on its way to a masked selection still finds it, and one
    that found a selection keeps nothing (it saw only part of what it reaches)."""
    import tensorflow as tf
    from graphxform import metagraph, selections
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        shared = tf.nn.relu(tf.matmul(x, tf1.get_variable("w", [4, 4])), name="shared")
        plain = tf.identity(shared * 2.0, name="plain")
        picked = tf.boolean_mask(shared, x[:, 0] > 0)
        tf.add(picked, tf.reduce_sum(plain), name="masked")
        ir = metagraph.from_metagraph(tf1.train.export_meta_graph(graph=g))
    gather = selections.selected_rows(ir, "masked", {"x"})
    assert gather is not None and ir.op(gather) == "GatherV2"
    walks = selections.RowSelections(ir, {"x"})
    assert walks.of("plain") is None and "shared" in walks.found_nothing
    assert walks.of("masked") == gather  # past 'shared', which found nothing
    assert gather not in walks.found_nothing and "masked" not in walks.found_nothing
    assert walks.of("plain") is None and walks.of("masked") == gather
