"""A loss that divides a sum over the batch by another sum over it (tf.compat.v1.losses given
`weights`, whose default reduction divides by the number of nonzero weights, or
Reduction.MEAN; a masked mean `reduce_sum(l * mask) / reduce_sum(mask)`): each replica would
divide by its own slice's total, and the average of those ratios is not the single-device loss
or gradient. `apply` exited 0 on them and `verify` failed. Every synchronous strategy now
divides by the replicas' mean total (passes/global_denominators.py: a collective under
allreduce, one node that reads every replica under ps) and trains like one device; a
denominator computed from the model is refused naming it."""

import numpy as np
import pytest


def _classifier():
    """Inside a graph: the inputs x, labels y and weights w (the batch's), and a linear
    model's logits."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    x = tf1.placeholder(tf.float32, [None, 8], name="x")
    y = tf1.placeholder(tf.int64, [None], name="y")
    weights = tf1.placeholder(tf.float32, [None], name="w")
    return x, y, weights, tf.matmul(x, tf1.get_variable("w0", [8, 2]))


def _export_sgd(graph, loss, path) -> str:
    """Train ``loss`` by SGD with a global step, list it as the loss, export to ``path``."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    step = tf1.train.get_or_create_global_step()
    train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
    tf1.add_to_collection("train_op", train)
    tf1.add_to_collection("losses", loss)
    tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def weighted_graph(path, form):
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, logits = _classifier()
        if form == "tf1_losses":
            loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=weights)
        elif form == "model_weighted":  # weights from the model's own predictions
            probability = tf.stop_gradient(tf.nn.softmax(logits)[:, 1])
            loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=probability)
        elif form == "masked_mean":
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.identity(tf.reduce_sum(per * weights) / tf.reduce_sum(weights) + 0.0,
                               name="loss")
        elif form in ("mean_over_mask_sum", "scan_over_mask_sum"):
            # a mean over the batch divided by a sum: all-reducing the sum, not its mean
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            if form == "scan_over_mask_sum":  # through a loop whose output the rules can't tell
                per = tf.map_fn(lambda e: 2.0 * e, per)
            loss = tf.identity(-tf.reduce_mean(per * weights) / tf.reduce_sum(weights),
                               name="loss")
            loss = -loss
        elif form == "per_example_divisor":  # each example's own weight: no total at all
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_mean(per / (1.0 + weights), name="loss")
        elif form == "dot_over_mask_sum":  # the sum of a loop's output, not by a reduce_sum
            per = tf.map_fn(lambda e: 2.0 * e, tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits))
            loss = tf.identity(tf.tensordot(per, weights, 1) / tf.reduce_sum(weights),
                               name="loss")
        else:  # Reduction.MEAN divides by the weights' sum; SUM_OVER_BATCH_SIZE by the count
            reduction = {"weighted_mean": tf1.losses.Reduction.MEAN,
                         "sum_over_batch_size": tf1.losses.Reduction.SUM_OVER_BATCH_SIZE}[form]
            loss = tf1.losses.sparse_softmax_cross_entropy(y, logits, weights=weights,
                                                           reduction=reduction)
        return _export_sgd(graph, loss, path)




def _feeds(tmp_path):
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 8).astype(np.float32)
    mask = (rng.rand(64) < np.linspace(0.1, 0.9, 64)).astype(np.float32)  # uneven per slice
    np.savez(tmp_path / "f.npz", x=xs, y=(xs[:, 0] > 0).astype(np.int64), w=mask)
    return tmp_path / "f.npz"


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("form", ["tf1_losses", "weighted_mean", "masked_mean",
                                  "sum_over_batch_size", "mean_over_mask_sum",
                                  "scan_over_mask_sum", "per_example_divisor"])
def test_weighted_losses_train_like_one_device(run_cli, tmp_path, form, replicas):
    model = weighted_graph(tmp_path / "m.meta", form)
    code, out, err = run_cli("verify", "--replicas", replicas, model, "--feeds",
                             _feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def test_replicated_specs_make_the_denominator_global_too(run_cli, tmp_path):
    code, out, err = run_cli("verify", "--strategy", "replicated", "--all-reduce-spec", "pscpu",
                             "--replicas", 2, weighted_graph(tmp_path / "m.meta", "tf1_losses"),
                             "--feeds", _feeds(tmp_path), "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


def _cluster(tmp_path, workers=2):
    cluster = tmp_path / "cluster.json"
    addresses = ", ".join(f'"127.0.0.1:{2224 + i}"' for i in range(workers))
    cluster.write_text(f'{{"ps": ["127.0.0.1:2222"], "worker": [{addresses}]}}')
    return cluster


@pytest.mark.parametrize("form, strategy, workers", [
    ("tf1_losses", "ps", 2), ("masked_mean", "partitioned-ps", 2),
    ("mean_over_mask_sum", "ps", 4)])
def test_weighted_losses_train_like_one_device_under_ps(run_cli, tmp_path, form, strategy,
                                                        workers):
    """ps refused these (each worker would divide by its slice's total); one AddN on the
    first worker now reads every replica's total and every replica divides by it."""
    model = weighted_graph(tmp_path / "m.meta", form)
    code, out, err = run_cli("verify", "--strategy", strategy, "--cluster",
                             _cluster(tmp_path, workers), model, "--feeds", _feeds(tmp_path),
                             "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_denominator_not_made_global_is_refused(run_cli, tmp_path, strategy):
    where = ["--cluster", _cluster(tmp_path)] if strategy == "ps" else ["--replicas", 2]
    code, _, err = run_cli("apply", "--strategy", strategy, *where,
                           weighted_graph(tmp_path / "m.meta", "model_weighted"),
                           "-o", tmp_path / "o.meta")
    assert code == 1
    assert ("which divides by 'sparse_softmax_cross_entropy_loss/num_present', a sum over the "
            "batch") in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


def test_a_numerator_neither_sum_nor_mean_is_refused(run_cli, tmp_path):
    """A total of the batch divides what no rule shows a sum or a mean (a dot product with
    a loop's outputs): the replicas' mean of the total is right for the one and their sum for
    the other, and guessing wrong trains silently wrong (a mean over a sum failed verify by
    1e0 when every numerator was taken for a sum)."""
    code, _, err = run_cli("apply", "--replicas", 2,
                           weighted_graph(tmp_path / "m.meta", "dot_over_mask_sum"),
                           "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "divides 'Tensordot:0' by 'Sum:0', a total of the batch" in err
    assert "cannot be shown to be a sum or a mean over the batch" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


def self_normalised_tasks(x, y):
    """Two task losses each divided by its own value under stop_gradient (a common way to
    balance multi-task losses): each replica would divide by its own slice's loss, so the
    averaged gradients are not one device's."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    from test_custom_training_code import dense
    h = tf.nn.relu(dense(x, 8, "shared"))
    first = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=dense(h, 2, "first")))
    second = tf.reduce_mean(tf.square(dense(h, 1, "second")[:, 0] - x[:, 1]))
    total = first / tf.stop_gradient(first) + second / tf.stop_gradient(second)
    return tf1.train.GradientDescentOptimizer(0.1).minimize(
        total, global_step=tf1.train.get_or_create_global_step())


def test_a_denominator_computed_from_the_model_is_refused(run_cli, tmp_path):
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", self_normalised_tasks)
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "which divides by 'StopGradient" in err and "computed from the model's variables" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


def _guarded_feeds(tmp_path):
    """Every batch of 16 gives replica 0 (of 2) a slice with no weight and no example of
    class 1: where the replicas' totals differ most."""
    rng = np.random.RandomState(0)
    xs = rng.randn(64, 8).astype(np.float32)
    first_half = (np.arange(64) % 16) < 8
    np.savez(tmp_path / "g.npz", x=xs, y=np.where(first_half, 0, xs[:, 0] > 0).astype(np.int64),
             w=np.where(first_half, 0.0, rng.rand(64)).astype(np.float32))
    return tmp_path / "g.npz"


def guarded_graph(path, form):
    """A masked mean guarded against an empty mask (seq2seq losses' max(sum(mask), 1)), and
    a mean of per-class means (tf.math.unsorted_segment_mean, a class-balanced loss): each
    divides by a function of the batch's totals, which is not a total itself."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, logits = _classifier()
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if form == "guarded_masked_mean":
            loss = tf.reduce_sum(per * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
        elif form == "guarded_mean_over_mask_sum":
            loss = tf.reduce_mean(per * weights) / tf.maximum(tf.reduce_sum(weights), 1.0)
        elif form in ("guarded_loop_total", "guarded_dot_total"):  # totals no rule classes
            looped = tf.map_fn(lambda e: 1.0 * e, weights)
            total = tf.reduce_sum(looped) if form == "guarded_loop_total" else \
                tf.tensordot(looped, looped, 1)
            loss = tf.reduce_sum(per * weights) / tf.maximum(total, 1.0)
        else:
            loss = tf.reduce_mean(tf.math.unsorted_segment_mean(per, y, 2)) + \
                0.0 * tf.reduce_sum(weights)
        return _export_sgd(graph, loss, path)


@pytest.mark.parametrize("form", ["guarded_masked_mean", "guarded_mean_over_mask_sum",
                                  "guarded_loop_total", "per_class_mean"])
def test_a_denominator_that_is_a_function_of_totals_is_recomputed(run_cli, tmp_path, form):
    """The replicas' mean of max(sum(w_i), 1) is not max(sum(w), 1) when a slice has no
    weight: the totals are reduced and the function applied to them instead."""
    model = guarded_graph(tmp_path / "m.meta", form)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds",
                             _guarded_feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def test_a_function_of_totals_is_recomputed_under_ps(run_cli, tmp_path):
    model = guarded_graph(tmp_path / "m.meta", "guarded_masked_mean")
    code, out, err = run_cli("verify", "--strategy", "ps", "--cluster", _cluster(tmp_path),
                             model, "--feeds", _guarded_feeds(tmp_path), "--batch-size", 16,
                             "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def positives_normalised_graph(path, mixed=False):
    """An SSD / RetinaNet loss: a box term over the positive examples and a classification
    term over all, each divided by one node, max(number of positives, 1); ``mixed`` makes the
    classification term a mean, which the replicas' total cannot divide as it divides a sum."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, logits = _classifier()
        positives = tf.cast(y, tf.float32)
        norm = tf.maximum(tf.reduce_sum(positives), 1.0)
        box = tf.reduce_sum(tf.square(logits[:, 0] - weights) * positives)
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        classes = tf.reduce_mean(per) if mixed else tf.reduce_sum(per)
        return _export_sgd(graph, tf.add(box / norm, classes / norm, name="total_loss"), path)


def test_terms_divided_by_one_normaliser_train_like_one_device(run_cli, tmp_path):
    """global-denominators took the shared normaliser once per division and refused the
    second: 'the loss ... divides nothing by 'Maximum:0''."""
    model = positives_normalised_graph(tmp_path / "m.meta")
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds",
                             _guarded_feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0 and "PASS" in out, out + err
    code, _, err = run_cli("apply", "--replicas", 2,
                           positives_normalised_graph(tmp_path / "mixed.meta", mixed=True),
                           "-o", tmp_path / "o.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "divides 'Mean:0' (a mean) and 'Sum_1:0' (a sum) by 'Maximum:0'" in err


def keras_masked_sequence_graph(path):
    """tf_keras as its guide writes a masked sequence model: Embedding(mask_zero=True), an RNN
    and a Dense per step, compile() with a sparse cross-entropy. Keras weights each token by
    mask * size(mask) / sum(mask) inside the per-example weights, then takes the mean: each
    replica would divide by its own slice's count of tokens."""
    import tensorflow as tf
    import tf_keras
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        tokens = tf_keras.Input(shape=(6,), dtype="int32", name="tokens")
        h = tf_keras.layers.Embedding(12, 6, mask_zero=True)(tokens)
        h = tf_keras.layers.SimpleRNN(6, return_sequences=True)(h)
        model = tf_keras.Model(tokens, tf_keras.layers.Dense(4)(h))
        model.compile(optimizer=tf_keras.optimizers.legacy.SGD(0.5),
                      loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model._make_train_function()
        tf1.add_to_collection("train_op", tf.group(model.train_function.updates_op,
                                                   name="train"))
        tf1.add_to_collection("losses", model.total_loss)
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def _keras_feeds(tmp_path):
    """Sequences of 1 to 6 tokens, then padding (0): slices of every batch of 16 hold
    different counts of tokens."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 12, (64, 6))
    lengths = rng.randint(1, 7, 64)
    lengths[:8] = 1
    tokens[np.arange(6)[None, :] >= lengths[:, None]] = 0
    np.savez(tmp_path / "k.npz", tokens=tokens.astype(np.int32),
             dense_target=rng.randint(0, 4, (64, 6, 1)).astype(np.float32))
    return tmp_path / "k.npz"


def test_a_keras_masked_sequence_loss_trains_like_one_device(run_cli, tmp_path):
    code, out, err = run_cli("verify", "--replicas", 2,
                             keras_masked_sequence_graph(tmp_path / "m.meta"), "--feeds",
                             _keras_feeds(tmp_path), "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


def test_a_keras_masked_sequence_loss_trains_like_one_device_under_ps(run_cli, tmp_path):
    """ps refused it ('divides by loss/dense_loss/Sum, a sum over the batch')."""
    code, out, err = run_cli("verify", "--strategy", "ps", "--cluster", _cluster(tmp_path),
                             keras_masked_sequence_graph(tmp_path / "m.meta"), "--feeds",
                             _keras_feeds(tmp_path), "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


def test_apply_counts_the_denominators_collectives(run_cli, tmp_path):
    """The summary's collectives per replica per step include the denominators' own."""
    code, out, err = run_cli("apply", "--replicas", 2,
                             weighted_graph(tmp_path / "m.meta", "masked_mean"),
                             "-o", tmp_path / "o.meta")
    assert code == 0, err
    assert ("collectives per replica per step: 2 (1 dense buckets, 0 sparse gathers x3, "
            "1 global-denominators)") in out


def test_a_guard_over_what_is_not_shown_a_total_is_refused(run_cli, tmp_path):
    """max(w . w, 1) over a loop's outputs: the replicas' mean of the guard is not the whole
    batch's guard, and its parts are not shown to be totals to recompute it from (it was
    all-reduced as it was; a guard whose sum no rule classed failed verify by 3e-02)."""
    code, _, err = run_cli("apply", "--replicas", 2,
                           guarded_graph(tmp_path / "m.meta", "guarded_dot_total"),
                           "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "divides by 'Maximum' (Maximum), a function of the batch's totals" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


def gcn_masked_graph(path, form="gcn"):
    """tkipf/gcn's masked_softmax_cross_entropy with the mask fed per example: the mask over
    its mean weights each example's loss, and the loss is their mean. Each replica would divide
    by its own slice's mean mask (refused as mixing the batch's examples); global-denominators
    divides by the whole batch's, so each example's weight is one device's. ``guarded``: the
    mean kept off zero; ``input_norm``: the data itself over its mean, fed to the model (no
    weight of a loss: still refused)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, logits = _classifier()
        if form == "input_norm":
            logits = tf.matmul(x / tf.reduce_mean(tf.abs(x)), tf1.get_variable("w1", [8, 2]))
        loss = tf.nn.softmax_cross_entropy_with_logits(logits=logits, labels=tf.one_hot(y, 2))
        mask = tf.cast(weights, dtype=tf.float32)
        if form == "guarded":
            mask /= tf.maximum(tf.reduce_mean(mask), 1e-3)
        elif form != "input_norm":
            mask /= tf.reduce_mean(mask)
        loss *= mask
        return _export_sgd(graph, tf.reduce_mean(loss), path)


@pytest.mark.parametrize("form, strategy", [("gcn", "allreduce"), ("gcn", "ps"),
                                            ("guarded", "allreduce")])
def test_a_mask_over_its_mean_trains_like_one_device(run_cli, tmp_path, form, strategy):
    where = ["--cluster", _cluster(tmp_path)] if strategy == "ps" else ["--replicas", 2]
    code, out, err = run_cli("verify", "--strategy", strategy, *where,
                             gcn_masked_graph(tmp_path / "m.meta", form), "--feeds",
                             _feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def test_data_over_its_mean_outside_a_weight_is_still_refused(run_cli, tmp_path):
    code, _, err = run_cli("apply", "--replicas", 2,
                           gcn_masked_graph(tmp_path / "m.meta", "input_norm"),
                           "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "'truediv' (RealDiv) combines each example with a sum or mean over the batch" in err


def sized_by_values(form):
    """A step dividing by a count read from the shape of a tensor whose length the batch's
    values decide: the classes present in the batch (tf.unique of the labels, averaging over
    them; ``_guarded``: at least one), or the rows tf.where finds in a mask (a sum, or
    ``_guarded`` the size of those rows at least one, or a mean over that count).
    value_sources skips shapes (a count of examples is equal on equal slices), so neither
    divisor was seen to read the batch: apply exited 0 and verify failed by 6e-01 (a slice
    holding one class) and 2e-01."""
    def build(x, y):
        import tensorflow as tf
        tf1 = tf.compat.v1
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(x, tf1.get_variable("w0", [8, 2])))
        classes = tf.cast(tf.size(tf.unique(y)[0]), tf.float32)
        mask = x[:, 1] > -0.3
        rows = tf.cast(tf.shape(tf.where(mask))[0], tf.float32)
        masked = tf.reduce_sum(per * tf.cast(mask, tf.float32))
        loss = {"classes_present": lambda: tf.reduce_mean(per) / classes,
                "classes_present_guarded": lambda: tf.reduce_sum(per) / tf.maximum(classes, 1.),
                "rows_where_finds": lambda: masked / rows,
                "rows_where_finds_guarded": lambda: masked / tf.maximum(
                    tf.cast(tf.size(tf.where(mask)), tf.float32), 1.),
                "mean_over_rows_where_finds": lambda: tf.reduce_mean(per) / rows,
                "boxes_kept": lambda: tf.reduce_sum(per) / tf.cast(tf.size(
                    tf.image.non_max_suppression(tf.concat([x[:, :2], x[:, :2] + 1.], 1),
                                                 x[:, 2], 10, 0.3)), tf.float32)}[form]()
        return tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


DISTINCT = "the distinct values the batch holds ('Unique', tf.unique)"


@pytest.mark.parametrize("form, divisor, counted", [
    ("classes_present", "Cast", DISTINCT), ("classes_present_guarded", "Maximum", DISTINCT),
    ("boxes_kept", "Cast_3", "the boxes non-max suppression keeps")])
def test_a_divisor_counting_the_batch_s_distinct_values_is_refused(run_cli, tmp_path, form,
                                                                   divisor, counted):
    """The slices' counts of distinct labels (or of the boxes non-max suppression keeps) do
    not add up to the batch's: no all-reduce stands in for it. The refusal said "a function of
    the batch's totals", which it is not."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", sized_by_values(form))
    code, _, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "o.meta")
    assert code == 1, err
    op = divisor.split("_")[0]
    assert f"divides by '{divisor}' ({op}), which reads a count of {counted}" in err
    assert "the slices' counts do not add up to the whole batch's" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


def ratio_graph(path, form):
    """Keras' ratio of a mask's size to its sum (size(w) / sum(w)), where the model uses it:
    ``weight`` weights each example's loss by w * ratio (global-denominators makes the ratio
    the whole batch's), ``weight_and_hidden`` scales a hidden layer by that same ratio too;
    ``input`` and ``hidden`` feed it to the model alone, off the loss's way from its terms,
    where each replica would compute it over its own slice."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, _ = _classifier()
        ratio = tf.cast(tf.size(weights), tf.float32) / tf.reduce_sum(weights)
        h = tf.nn.relu(tf.matmul(x * ratio if form == "input" else x,
                                 tf1.get_variable("w1", [8, 8])))
        if form in ("hidden", "weight_and_hidden"):
            h *= ratio
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, tf1.get_variable("w2", [8, 2])))
        weighted = form in ("weight", "weight_and_hidden")
        loss = tf.reduce_mean(per * weights * ratio if weighted else per, name="loss")
        return _export_sgd(graph, loss, path)


@pytest.mark.parametrize("form", ["input", "hidden"])
def test_a_ratio_of_the_mask_fed_to_the_model_is_refused(run_cli, tmp_path, form):
    """batch_mixing read the ratio as the whole batch's through any Mul: apply exited 0 and
    verify FAILed by 5.4."""
    code, _, err = run_cli("apply", "--replicas", 2, ratio_graph(tmp_path / "m.meta", form),
                           "-o", tmp_path / "o.meta")
    assert code == 1, err
    assert "'mul' (Mul) combines each example with 'truediv', a count of the batch over a " \
           "total of its values off the loss's way from its terms" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o.meta").exists()


@pytest.mark.parametrize("form", ["weight", "weight_and_hidden"])
def test_a_ratio_of_the_mask_that_weights_the_loss_trains_like_one_device(run_cli, tmp_path,
                                                                         form):
    code, out, err = run_cli("verify", "--replicas", 2, ratio_graph(tmp_path / "m.meta", form),
                             "--feeds", _feeds(tmp_path), "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


def masked_sum_graph(path, total):
    """tkipf/gcn's and many seq2seq masked losses written as a sum: each example's loss times
    its mask over the batch's total of the mask (``reduce_sum`` or ``reduce_mean``), summed."""
    import tensorflow as tf
    graph = tf.Graph()
    with graph.as_default():
        x, y, weights, logits = _classifier()
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_sum(per * weights / total(weights), name="loss")
        return _export_sgd(graph, loss, path)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
@pytest.mark.parametrize("total", ["reduce_sum", "reduce_mean"])
def test_a_sum_over_the_masks_total_trains_like_one_device(run_cli, tmp_path, total, strategy):
    """Once global-denominators divides by the whole batch's total, the replicas' copies of the
    loss add up to one device's: summed-losses ran before it and could not see so (refused
    'not one seed of ones' under allreduce, by check (losses) under ps)."""
    import tensorflow as tf
    where = ["--cluster", _cluster(tmp_path)] if strategy == "ps" else ["--replicas", 2]
    code, out, err = run_cli("verify", "--strategy", strategy, *where,
                             masked_sum_graph(tmp_path / "m.meta", getattr(tf, total)),
                             "--feeds", _feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("form, strategy", [("rows_where_finds", "allreduce"),
                                            ("rows_where_finds", "ps"),
                                            ("rows_where_finds_guarded", "allreduce"),
                                            ("mean_over_rows_where_finds", "ps")])
def test_a_divisor_counting_the_rows_tf_where_finds_trains_like_one_device(
        run_cli, tmp_path, form, strategy):
    """tf.shape(tf.where(mask))[0] counts the mask's true entries, a sum over the examples
    as tf.reduce_sum(mask) is: global-denominators stands the replicas' total in for it (it
    was refused as a function of the batch's totals; verify PASS with slices whose masks
    keep different counts)."""
    from conftest import export_classifier
    model = export_classifier(tmp_path / "m.meta", sized_by_values(form))
    where = ["--cluster", _cluster(tmp_path)] if strategy == "ps" else ["--replicas", 2]
    code, out, err = run_cli("verify", "--strategy", strategy, *where, model, "--feeds",
                             model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("form", ["guarded", "unguarded", "boolean_mask"])
def test_a_random_mask_over_the_examples_divides_by_the_whole_batchs_count(run_cli, tmp_path,
                                                                            form):
    """openai/random-network-distillation trains its predictor on a random half of the batch,
    ``reduce_sum(mask * loss) / maximum(reduce_sum(mask), 1)`` with the mask drawn per
    example: a total of the batch as a fed mask is, though only the draw's shape reads the
    batch. Guarded by the maximum, global-denominators did not find it and apply exited 0
    with each replica dividing by its own slice's count (verify, under --consistent-random,
    failed naming no reason); unguarded, it was refused; ``tf.reduce_mean(tf.boolean_mask(l,
    keep))`` of such a mask went unseen too (a mean over each slice's own count, verify
    failed). All train like one device now."""
    from conftest import export_classifier
    import tensorflow as tf
    from test_custom_training_code import dense
    tf1 = tf.compat.v1

    def build(x, y):
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                             logits=dense(x, 2, "pred"))
        keep = tf.random.uniform(tf.shape(per)) < 0.5
        mask = tf.cast(keep, tf.float32)
        total = tf.reduce_sum(mask)
        loss = (tf.reduce_mean(tf.boolean_mask(per, keep)) if form == "boolean_mask" else
                tf.reduce_sum(mask * per) / (tf.maximum(total, 1.0) if form == "guarded"
                                             else total))
        return tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
    model = export_classifier(tmp_path / "m.meta", build)
    code, out, err = run_cli("verify", "--replicas", 2, model, "--feeds", model + ".npz",
                             "--batch-size", 16, "--steps", 3, "--consistent-random")
    assert code == 0 and "PASS" in out, out + err
