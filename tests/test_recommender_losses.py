"""Recommender and NLP losses as their public code writes them. BPR (the widely copied TF1
bpr.py and its ports) minimises ``-tf.reduce_mean(tf.log(tf.sigmoid(x_uij)))`` plus an L2
penalty on the whole embedding tables: a mean over the batch behind a Neg, beside weight decay.
`check`'s losses rule read the Neg as unknown and the penalty's L2Loss as a sum over the
slice, and refused the transformed graph ("each replica's loss is a sum over its slice")
although the passes had transformed it exactly."""

import numpy as np
import pytest
from conftest import dense

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


def export_word2vec(tmp_path, sampler: str) -> str:
    """word2vec's sampled softmax, its candidates drawn by ``sampler`` (learned: the kernel
    counts every batch's true classes and draws the next step's candidates from them)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    vocabulary = 50
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        inputs = tf1.placeholder(tf.int32, [None], name="train_inputs")
        labels = tf1.placeholder(tf.int64, [None, 1], name="train_labels")
        embeddings = tf1.Variable(tf1.random_uniform([vocabulary, 8], -1.0, 1.0), name="emb")
        weights = tf1.Variable(tf1.truncated_normal([vocabulary, 8], stddev=0.3), name="sm_w")
        biases = tf1.Variable(tf.zeros([vocabulary]), name="sm_b")
        if sampler == "learned":
            draw = tf.random.learned_unigram_candidate_sampler
        else:
            def draw(**args):
                return tf.random.fixed_unigram_candidate_sampler(
                    unigrams=list(range(1, vocabulary + 1)), **args)
        sampled = draw(true_classes=labels, num_true=1, num_sampled=5, unique=True,
                       range_max=vocabulary)
        loss = tf.reduce_mean(tf.nn.sampled_softmax_loss(
            weights=weights, biases=biases, labels=labels,
            inputs=tf.nn.embedding_lookup(embeddings, inputs), num_sampled=5,
            num_classes=vocabulary, sampled_values=sampled))
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(1.0).minimize(loss))
        path = str(tmp_path / "word2vec.meta")
        tf1.train.export_meta_graph(path, graph=graph)
    rng = np.random.RandomState(0)
    classes = np.concatenate([rng.randint(0, 5, 32), rng.randint(40, 50, 32)])
    np.savez(path + ".npz", train_inputs=rng.randint(0, vocabulary, 64).astype(np.int32),
             train_labels=classes.reshape(64, 1).astype(np.int64))
    return path


def test_a_sampler_learning_from_the_batch_is_refused(run_cli, tmp_path):
    """Each replica's copy would count its own slice's classes (verify FAILed by 1.0)."""
    model = export_word2vec(tmp_path, "learned")
    code, out, err = run_cli("apply", model, "--strategy", "allreduce", "--replicas", 2,
                             "-o", tmp_path / "out.meta")
    assert code != 0 and "'LearnedUnigramCandidateSampler' (LearnedUnigramCandidateSampler) " \
        "learns its sampling distribution from the true classes" in err, out + err


def test_a_seeded_fixed_sampler_trains_like_one_device(run_cli, tmp_path):
    model = export_word2vec(tmp_path, "fixed")
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def export_models_word2vec(tmp_path) -> str:
    """tensorflow/models' tutorials/embedding/word2vec.py, forward() and nce_loss(): the
    candidates from a seeded fixed_unigram_candidate_sampler, the true and sampled logits'
    cross entropies summed over the batch and divided by the Python batch size. The sampler had
    no rule in replica_values: the sampled logits were unknown, so summed-losses left the sum's
    seed at 1 (each replica's gradient half one device's) and `check` refused the graph."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    vocabulary, dim, samples, batch = 50, 8, 6, 16
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        examples = tf1.placeholder(tf.int32, [None], name="examples")
        labels = tf1.placeholder(tf.int64, [None], name="labels")
        emb = tf1.Variable(tf1.random_uniform([vocabulary, dim], -0.5 / dim, 0.5 / dim),
                           name="emb")
        sm_w_t = tf1.Variable(tf1.truncated_normal([vocabulary, dim], stddev=0.3),
                              name="sm_w_t")
        sm_b = tf1.Variable(tf.zeros([vocabulary]), name="sm_b")
        global_step = tf1.Variable(0, name="global_step")
        sampled_ids, _, _ = tf1.nn.fixed_unigram_candidate_sampler(
            true_classes=tf.reshape(labels, [-1, 1]), num_true=1, num_sampled=samples,
            unique=True, range_max=vocabulary, distortion=0.75,
            unigrams=list(range(vocabulary, 0, -1)))
        example_emb = tf.nn.embedding_lookup(emb, examples)
        true_logits = tf.reduce_sum(example_emb * tf.nn.embedding_lookup(sm_w_t, labels), 1) \
            + tf.nn.embedding_lookup(sm_b, labels)
        sampled_logits = tf.matmul(example_emb, tf.nn.embedding_lookup(sm_w_t, sampled_ids),
                                   transpose_b=True) \
            + tf.reshape(tf.nn.embedding_lookup(sm_b, sampled_ids), [samples])
        true_xent = tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.ones_like(true_logits), logits=true_logits)
        sampled_xent = tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.zeros_like(sampled_logits), logits=sampled_logits)
        loss = (tf.reduce_sum(true_xent) + tf.reduce_sum(sampled_xent)) / batch
        optimizer = tf1.train.GradientDescentOptimizer(0.2)
        tf1.add_to_collection("train_op", optimizer.minimize(
            loss, global_step=global_step, gate_gradients=optimizer.GATE_NONE))
        path = str(tmp_path / "word2vec_models.meta")
        tf1.train.export_meta_graph(path, graph=graph)
    rng = np.random.RandomState(0)
    np.savez(path + ".npz", examples=rng.randint(0, vocabulary, 64).astype(np.int32),
             labels=rng.randint(0, vocabulary, 64).astype(np.int64))
    return path


def test_a_seeded_sampler_draws_what_one_device_draws(run_cli, tmp_path):
    model = export_models_word2vec(tmp_path)
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def test_a_seeded_sampler_is_identical_in_every_replica(tmp_path):
    from graphxform import metagraph, replica_values, strategies
    ir = metagraph.load(export_models_word2vec(tmp_path))
    strategies.transform(ir, "allreduce", devices=["/device:CPU:0", "/device:CPU:1"])
    prefix = "replica_0/"
    values = replica_values.classify(ir, prefix,
                                     copies=replica_values.replica_copies(ir, prefix))
    sampler = prefix + "FixedUnigramCandidateSampler"
    assert [values.of(sampler, port) for port in range(3)] == [
        replica_values.IDENTICAL, replica_values.BATCH, replica_values.IDENTICAL]
    assert values.of(prefix + "truediv", 0) == replica_values.SUM


def export_din(tmp_path, dice: bool) -> str:
    """Deep Interest Network (zhougr1993/DeepInterestNetwork): the candidate item's embedding
    tiled over the user's history (``tf.tile(q, [1, tf.shape(h)[1], 1])``, the history padded
    to the fed width), attention pooling under a sequence mask, then Dice, whose mean and
    standard deviation are the current batch's (its train mode, by hand), or PReLU. The tile's
    multiples were not constant, so batch_mixing lost the batch there and never saw Dice's
    statistics: apply exited 0 and verify FAILed by 0.48."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    items, width, dim = 30, 6, 8
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        item = tf1.placeholder(tf.int32, [None], name="i")
        label = tf1.placeholder(tf.float32, [None], name="y")
        history = tf1.placeholder(tf.int32, [None, None], name="hist_i")
        lengths = tf1.placeholder(tf.int32, [None], name="sl")
        table = tf1.get_variable("item_emb_w", [items, dim])
        query = tf.nn.embedding_lookup(table, item)
        keys = tf.nn.embedding_lookup(table, history)
        queries = tf.tile(query[:, None, :], [1, tf.shape(keys)[1], 1])
        scores = tf.reduce_sum(queries * keys, -1)
        mask = tf.sequence_mask(lengths, tf.shape(keys)[1])
        scores = tf.where(mask, scores, tf.ones_like(scores) * (-2 ** 32 + 1))
        pooled = tf.reduce_sum(tf.nn.softmax(scores)[:, :, None] * keys, 1)
        x = dense(tf.concat([pooled, query], -1), 16, "f1")
        alphas = tf1.get_variable("alpha", [16], initializer=tf1.constant_initializer(0.0))
        if dice:
            mean = tf.reduce_mean(x, axis=[0])
            std = tf.sqrt(tf.reduce_mean(tf.square(x - mean) + 1e-9, axis=[0]))
            p = tf.sigmoid((x - mean) / (std + 1e-9))
            x = alphas * (1.0 - p) * x + p * x
        else:
            x = tf.maximum(0.0, x) + alphas * tf.minimum(0.0, x)
        logits = tf.squeeze(dense(x, 1, "f3"), -1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(logits=logits,
                                                                      labels=label))
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(1.0).minimize(loss))
        path = str(tmp_path / "din.meta")
        tf1.train.export_meta_graph(path, graph=graph)
    rng = np.random.RandomState(0)
    np.savez(path + ".npz", i=rng.randint(0, items, 64).astype(np.int32),
             y=rng.randint(0, 2, 64).astype(np.float32),
             hist_i=rng.randint(0, items, (64, width)).astype(np.int32),
             sl=rng.randint(1, width + 1, 64).astype(np.int32))
    return path


def test_statistics_of_the_batch_after_a_tiled_history_are_refused(run_cli, tmp_path):
    model = export_din(tmp_path, dice=True)
    code, out, err = run_cli("apply", model, "--strategy", "allreduce", "--replicas", 2,
                             "-o", tmp_path / "out.meta")
    assert code != 0 and "mixes the examples of its batch: 'sub_1' (Sub) combines each " \
        "example with a sum or mean over the batch" in err, out + err


def test_a_history_tiled_per_example_trains_like_one_device(run_cli, tmp_path):
    model = export_din(tmp_path, dice=False)
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err


def export_two_tower(tmp_path, scaling: str) -> str:
    """A two-tower retrieval model trained with in-batch negatives (logits u @ i^T, labels
    tf.range(batch)), its user vectors divided by a fed temperature or dropped out with a fed
    keep_prob: both placeholders built without a shape, as TF1 code writes them
    (``tf.compat.v1.placeholder(tf.float32, name="keep_prob")``). batch_mixing lost the
    batch's axis at the broadcast with an operand of unknown rank, so the in-batch product
    after it was never seen: apply exited 0, verify FAILed by 0.34; ``scaling`` "none": the
    same towers trained per example (a dot product per pair), which splits exactly."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        user = tf1.placeholder(tf.int32, [None], name="user")
        item = tf1.placeholder(tf.int32, [None], name="item")
        scalar = tf1.placeholder(tf.float32, name="temperature")
        users = tf.nn.embedding_lookup(tf1.get_variable("user_emb", [USERS, 8]), user)
        items = tf.nn.embedding_lookup(tf1.get_variable("item_emb", [ITEMS, 8]), item)
        if scaling == "temperature":
            users = users / scalar
        elif scaling == "dropout":
            users = tf1.nn.dropout(users, scalar)
        if scaling == "none":
            logits = tf.reduce_sum(users * items / scalar, 1)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
                labels=tf.ones_like(logits), logits=logits))
        else:
            logits = tf.matmul(users, items, transpose_b=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.range(tf.shape(logits)[0]), logits=logits))
        tf1.add_to_collection("train_op", tf1.train.AdagradOptimizer(0.1).minimize(loss))
        path = str(tmp_path / "two_tower.meta")
        tf1.train.export_meta_graph(path, graph=graph)
    rng = np.random.RandomState(0)
    np.savez(path + ".npz", user=rng.randint(0, USERS, 64).astype(np.int32),
             item=rng.randint(0, ITEMS, 64).astype(np.int32), temperature=np.float32(0.5))
    return path


@pytest.mark.parametrize("scaling", ["temperature", "dropout"])
def test_in_batch_negatives_behind_a_shapeless_placeholder_are_refused(run_cli, tmp_path,
                                                                        scaling):
    model = export_two_tower(tmp_path, scaling)
    code, out, err = run_cli("apply", model, "--strategy", "allreduce", "--replicas", 2,
                             "-o", tmp_path / "out.meta")
    assert code != 0 and "mixes the examples of its batch: 'MatMul'" in err \
        and "pairs every example with every other" in err, out + err


def test_per_example_scores_behind_a_shapeless_placeholder_train_like_one_device(run_cli,
                                                                                 tmp_path):
    model = export_two_tower(tmp_path, "none")
    code, out, err = run_cli("verify", model, "--strategy", "allreduce", "--replicas", 2,
                             "--feeds", model + ".npz", "--batch-size", 16, "--steps", 3)
    assert code == 0 and "PASS" in out, out + err
