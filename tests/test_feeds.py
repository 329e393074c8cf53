"""Placeholders as users feed them (issue 12): which inputs are the batch, which need not be
fed, fixed batch dimensions split across replicas; and every bad feeds file a one-line error
naming the file and the input (issue 13)."""

import numpy as np
import pytest
import tensorflow as tf

from graphxform import cluster, equivalence, metagraph, strategies, training
from graphxform.errors import GraphxformError
from graphxform.nodes import const_value
from graphxform.runtime import Feeds

tf1 = tf.compat.v1
BATCH = 8


def export(graph, path=None):
    with graph.as_default():  # so the variable collections are written too
        meta = tf1.train.export_meta_graph(graph_def=graph.as_graph_def(add_shapes=True),
                                           graph=graph)
    ir = metagraph.from_metagraph(meta)
    if path:
        metagraph.save(ir, str(path))
    return ir


def word2vec_like(path=None, batch=BATCH):
    """The TF word2vec tutorial's shape: fixed [batch] and [batch, 1] placeholders, nce_loss
    (a seeded candidate sampler), plus a PlaceholderWithDefault and a placeholder no step reads
    (the tutorial's validation words)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        inputs = tf1.placeholder(tf.int32, [batch], name="train_inputs")
        labels = tf1.placeholder(tf.int64, [batch, 1], name="train_labels")
        scale = tf1.placeholder_with_default(1.0, [], name="loss_scale")
        tf1.placeholder(tf.int32, [3], name="valid_dataset")
        embeddings = tf1.get_variable("embeddings", [20, 4],
                                      initializer=tf1.random_uniform_initializer(-1, 1))
        weights = tf1.get_variable("nce_weights", [20, 4])
        biases = tf1.get_variable("nce_biases", [20], initializer=tf1.zeros_initializer())
        embed = tf.nn.embedding_lookup(embeddings, inputs)
        with tf.name_scope("loss"):
            loss = scale * tf.reduce_mean(tf.nn.nce_loss(weights, biases, labels, embed,
                                                         num_sampled=4, num_classes=20))
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(1.0).minimize(loss))
    return export(g, path)


def word2vec_feeds(path, rows=32, **changes):
    rng = np.random.default_rng(0)
    arrays = {"train_inputs": rng.integers(0, 20, rows).astype(np.int32),
              "train_labels": rng.integers(0, 20, (rows, 1))}
    arrays.update(changes)
    np.savez(str(path), **arrays)
    return str(path)


def fixed_batch_mlp(batch=BATCH):
    """A deterministic graph with a fixed batch that TF folds into constants: a reshape to
    [batch, -1], zeros_like of a batch, a mean over the batch, softmax cross entropy."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(2)
        x = tf1.placeholder(tf.float32, [batch, 2, 3], name="x")
        y = tf1.placeholder(tf.int32, [batch], name="y")
        flat = tf.reshape(x, [batch, -1])
        hidden = tf.tanh(tf.matmul(flat, tf1.get_variable("w0", [6, 5])))
        logits = tf.matmul(hidden + tf.zeros_like(hidden), tf1.get_variable("w1", [5, 3]))
        logits += tf1.get_variable("b1", [3], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                            logits=logits))
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(0.05).minimize(loss))
    return export(g)


def inputs_of(ir):
    return {i.name: i for i in training.analyze(ir).inputs}


def transformed(ir, replicas):
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(replicas)])
    return ir


def test_fixed_leading_dim_shared_by_every_read_placeholder_is_the_batch():
    found = inputs_of(word2vec_like())
    assert found["train_inputs"].batched and found["train_labels"].batched
    assert found["train_inputs"].fixed_batch == BATCH
    assert not found["train_inputs"].optional
    assert found["loss_scale"].optional and found["loss_scale"].has_default
    assert found["valid_dataset"].optional and not found["valid_dataset"].read_by_step
    assert not found["valid_dataset"].batched


@pytest.mark.parametrize("shapes", [([None, 4], [4]), ([8, 4], [4])])
def test_a_fixed_dim_the_steps_do_not_all_share_is_not_a_batch(shapes):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, shapes[0], name="x")
        scale = tf1.placeholder(tf.float32, shapes[1], name="scale")
        w = tf1.get_variable("w", [4, 1])
        loss = tf.reduce_mean(tf.matmul(x * scale, w))
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.1).minimize(loss))
    found = inputs_of(export(g))
    assert found["x"].batched == (shapes[0][0] is None)
    assert not found["scale"].batched


def test_optional_inputs_are_fed_only_when_the_file_has_them(tmp_path):
    inputs = training.analyze(word2vec_like()).inputs
    feed = Feeds(inputs, word2vec_feeds(tmp_path / "f.npz")).batch(0)
    assert set(feed) == {"train_inputs:0", "train_labels:0"}
    path = word2vec_feeds(tmp_path / "g.npz", loss_scale=np.float32(2.0))
    assert Feeds(inputs, path).batch(0)["loss_scale:0"] == 2.0
    assert set(Feeds(inputs).batch(0)) == {"train_inputs:0", "train_labels:0"}  # synthetic


def test_a_fixed_batch_is_the_batch_size(tmp_path):
    inputs = training.analyze(word2vec_like()).inputs
    path = word2vec_feeds(tmp_path / "f.npz")
    assert Feeds(inputs, path).batch_size == BATCH
    assert Feeds(inputs, path, batch_size=BATCH).batch(1)["train_inputs:0"].shape == (BATCH,)
    with pytest.raises(GraphxformError, match="--batch-size 4 differs from the fixed batch of "
                       "input 'train_inputs' \\(8 rows\\)"):
        Feeds(inputs, path, batch_size=4)


@pytest.mark.parametrize("size", [0, -3])
def test_batch_size_must_be_positive(size):
    inputs = training.analyze(word2vec_like()).inputs
    with pytest.raises(GraphxformError, match=f"--batch-size must be at least 1, not {size}"):
        Feeds(inputs, batch_size=size)


def test_integers_feed_a_float_placeholder_only_when_exact(tmp_path):
    g = tf.Graph()
    with g.as_default():
        tf1.placeholder(tf.float32, [None, 2], name="x")
    inputs = training.analyze(export(g)).inputs
    np.savez(str(tmp_path / "ok.npz"), x=np.arange(8).reshape(4, 2))
    assert Feeds(inputs, str(tmp_path / "ok.npz")).batch(0)["x:0"].dtype == np.float32
    np.savez(str(tmp_path / "big.npz"), x=np.full((4, 2), 2 ** 24 + 1))
    with pytest.raises(GraphxformError, match="big.npz: the array for input 'x' is int64, which "
                       "cannot feed a float32 placeholder without changing values"):
        Feeds(inputs, str(tmp_path / "big.npz"))


def bad_feeds(tmp_path, case):
    """A feeds file broken in one way, and what its error must say."""
    path = tmp_path / "bad.npz"
    rng = np.random.default_rng(0)
    if case == "rank":
        word2vec_feeds(path, train_labels=rng.integers(0, 20, 32))
        return path, "input 'train_labels' has rank 1"
    if case == "dim":
        word2vec_feeds(path, train_labels=rng.integers(0, 20, (32, 2)))
        return path, "input 'train_labels' has shape [32, 2]; the placeholder is [8, 1]"
    if case == "dtype":
        word2vec_feeds(path, train_inputs=rng.standard_normal(32))
        return path, "input 'train_inputs' is float64, which cannot feed a int32 placeholder"
    if case == "empty array":
        word2vec_feeds(path, train_inputs=np.zeros(0, np.int32))
        return path, "the array for input 'train_inputs' is empty"
    if case == "missing input":
        np.savez(str(path), train_inputs=np.zeros(32, np.int32))
        return path, "no array for input 'train_labels'"
    if case == "npy renamed":
        np.save(str(tmp_path / "one.npy"), np.zeros(3))
        (tmp_path / "one.npy").rename(path)
        return path, "holds one array (a .npy file), not a .npz"
    if case == "not a zip":
        path.write_text("train_inputs,train_labels\n1,2\n")
        return path, "not a .npz file"
    if case == "empty file":
        path.write_bytes(b"")
        return path, "not a .npz file"
    if case == "broken zip":
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 40)
        return path, "not a .npz file"
    assert case == "no file"
    return path, "no such file"


BAD_CASES = ["rank", "dim", "dtype", "empty array", "missing input", "npy renamed", "not a zip",
             "empty file", "broken zip", "no file"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_feeds_file_is_one_line_naming_file_and_input(case, tmp_path, run_cli):
    model = tmp_path / "w2v.meta"
    word2vec_like(model)
    path, says = bad_feeds(tmp_path, case)
    code, out, err = run_cli("run", model, "--steps", "1", "--feeds", path)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("graphxform: error: "), err
    assert str(path) in err and says in err, err
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("size", ["0", "-2"])
def test_run_refuses_a_batch_size_below_one(size, tmp_path, run_cli):
    model = tmp_path / "w2v.meta"
    word2vec_like(model)
    code, _, err = run_cli("run", model, "--steps", "1", "--batch-size", size)
    assert code == 1 and err.strip() == f"graphxform: error: --batch-size must be at least 1, " \
                                         f"not {size}"


def test_word2vec_like_graph_runs_as_users_run_it(tmp_path, run_cli):
    model = tmp_path / "w2v.meta"
    word2vec_like(model)
    feeds = word2vec_feeds(tmp_path / "f.npz")
    code, out, err = run_cli("run", model, "--steps", "2", "--feeds", feeds)
    assert code == 0, err
    assert [line.split()[2] for line in out.splitlines()] == ["loss", "loss"]
    code, _, err = run_cli("apply", model, "--replicas", "2")
    assert code == 0, err
    code, out, err = run_cli("run", tmp_path / "w2v.allreduce.meta", "--steps", "2", "--feeds",
                             feeds)
    assert code == 0 and out.count("step ") == 2, err


@pytest.mark.parametrize("replicas", [2, 4])
def test_split_inputs_splits_a_fixed_batch_and_trains_like_one_device(replicas, tmp_path):
    ir = transformed(word2vec_like(), replicas)
    assert ir.inputs("replica_1/embedding_lookup")[1] == ("split_inputs/train_inputs/split", 1)
    size = "replica_1/gradients/embedding_lookup_grad/Size"
    assert ir.op(size) == "Size"  # TF had folded 8 into a Const; it is live again, same name
    report = equivalence.compare(word2vec_like(), ir, word2vec_feeds(tmp_path / "f.npz"),
                                 steps=3)
    assert report.ok and report.reasons == [], equivalence.format_report(report)


@pytest.mark.parametrize("replicas", [2, 4])
def test_constants_folded_from_a_fixed_batch_say_the_slice(replicas, tmp_path):
    rng = np.random.default_rng(1)
    np.savez(str(tmp_path / "f.npz"), x=rng.standard_normal((32, 2, 3)).astype(np.float32),
             y=rng.integers(0, 3, 32).astype(np.int32))
    report = equivalence.compare(fixed_batch_mlp(), transformed(fixed_batch_mlp(), replicas),
                                 str(tmp_path / "f.npz"), steps=3)
    assert report.ok and report.reasons == [], equivalence.format_report(report)


def test_a_fixed_batch_that_does_not_divide_is_refused_naming_it(tmp_path, run_cli):
    with pytest.raises(GraphxformError, match="input 'train_inputs' has a fixed batch of 8, "
                       "which does not divide evenly across 3 replicas"):
        transformed(word2vec_like(), 3)
    model = tmp_path / "w2v.meta"
    word2vec_like(model)
    code, _, err = run_cli("apply", model, "--replicas", "3")
    assert code == 1 and err.count("\n") == 1 and "fixed batch of 8" in err


def wgan_gp_fixed_batch(batch=BATCH):
    """WGAN-GP as its authors' TF1 code writes it: fixed [BATCH_SIZE, dim] placeholders and
    one interpolation weight per example, tf.random_uniform([BATCH_SIZE, 1]), between real
    and generated examples; the critic's gradient penalty at the interpolates."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        real = tf1.placeholder(tf.float32, [batch, 4], name="real")
        noise = tf1.placeholder(tf.float32, [batch, 3], name="noise")
        fake = tf.matmul(noise, tf1.get_variable("g", [3, 4]))

        def critic(points):
            with tf1.variable_scope("critic", reuse=tf1.AUTO_REUSE):
                hidden = tf.tanh(tf.matmul(points, tf1.get_variable("w0", [4, 5])))
                return tf.matmul(hidden, tf1.get_variable("w1", [5, 1]))

        alpha = tf1.random_uniform(shape=[batch, 1], minval=0.0, maxval=1.0)
        interpolates = real + alpha * (fake - real)
        slopes = tf.sqrt(tf.reduce_sum(tf.square(tf.gradients(critic(interpolates),
                                                              [interpolates])[0]), axis=1))
        cost = tf.reduce_mean(critic(fake)) - tf.reduce_mean(critic(real)) + \
            10.0 * tf.reduce_mean(tf.square(slopes - 1.0))
        critic_vars = [v for v in tf1.trainable_variables() if v.name.startswith("critic")]
        tf1.add_to_collection("train_op", tf1.train.AdamOptimizer(1e-3).minimize(
            cost, var_list=critic_vars))
    return export(g)


@pytest.mark.parametrize("replicas", [2, 4])
def test_a_draw_per_example_of_a_fixed_batch_is_the_slice_s_rows(replicas, tmp_path):
    """TF rejected the output (a draw of [8, 1] against a slice of 4 rows); now each replica
    draws its slice's rows, and with --consistent-random the single-device draw's."""
    rng = np.random.default_rng(2)
    feeds = str(tmp_path / "f.npz")
    np.savez(feeds, real=rng.standard_normal((32, 4)).astype(np.float32),
             noise=rng.standard_normal((32, 3)).astype(np.float32))
    ir = wgan_gp_fixed_batch()
    strategies.transform(ir, "allreduce", devices=[f"/device:CPU:{i}" for i in range(replicas)],
                         consistent_random=True)
    report = equivalence.compare(wgan_gp_fixed_batch(), ir, feeds, steps=3)
    assert report.ok, equivalence.format_report(report)
    plain = transformed(wgan_gp_fixed_batch(), replicas)
    assert not equivalence.compare(wgan_gp_fixed_batch(), plain, feeds, steps=3).ok


def two_fixed_batches_mlp():
    """A labelled and an unlabelled batch of fixed size fed side by side, concatenated into one
    batch of the model: tf.compat.v1's loss counts the concat's 2 * BATCH rows, a constant."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        xs = [tf1.placeholder(tf.float32, [BATCH, 3], name=f"x{k}") for k in (1, 2)]
        ys = [tf1.placeholder(tf.int64, [BATCH], name=f"y{k}") for k in (1, 2)]
        logits = tf.matmul(tf.concat(xs, 0), tf1.get_variable("w", [3, 2]))
        loss = tf1.losses.sparse_softmax_cross_entropy(tf.concat(ys, 0), logits)
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        tf1.add_to_collection("train_op", train)
    return export(g)


def test_a_concat_of_fixed_batches_is_rebatched_too(tmp_path):
    # each replica's concat holds BATCH rows, but its count stayed the folded 2 * BATCH: the
    # step trained at half one device's gradient (verify FAIL by 0.5, apply exit 0)
    rng = np.random.default_rng(2)
    np.savez(str(tmp_path / "f.npz"), **{
        name: rng.standard_normal((32, 3)).astype(np.float32) for name in ("x1", "x2")},
        **{name: rng.integers(0, 2, 32) for name in ("y1", "y2")})
    report = equivalence.compare(two_fixed_batches_mlp(), transformed(two_fixed_batches_mlp(), 2),
                                 str(tmp_path / "f.npz"), steps=3)
    assert report.ok and report.reasons == [], equivalence.format_report(report)


def fixed_batch_crop(rows=BATCH):
    """``tf.image.random_crop`` of a fixed batch of images, its size naming the whole batch:
    one seeded draw of offsets (0 along the batch axis) crops every example alike. With fewer
    ``rows``, it crops a run of examples at a random offset."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        images = tf1.placeholder(tf.float32, [BATCH, 4, 4, 2], name="images")
        labels = tf1.placeholder(tf.int64, [BATCH], name="labels")
        crop = tf.image.random_crop(images, [rows, 3, 3, 2], seed=5)
        logits = tf.matmul(tf.reduce_mean(crop, [1, 2]), tf1.get_variable("w", [2, 3]))
        if rows < BATCH:
            logits = tf.tile(logits, [BATCH // rows, 1])
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.5).minimize(loss))
    return export(g)


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_crop_whose_size_is_the_fixed_batch_crops_each_slice(strategy, tmp_path):
    # the crop's size kept 8 rows where each replica holds 4: apply exited 1 with TensorFlow's
    # own "Dimensions must be equal"; every replica draws the same offsets, as one device does.
    # ps shares the size and the shape it is checked against (shared ops read them): each
    # replica reads its own copies of them and of the offsets' bound computed from them
    rng = np.random.default_rng(3)
    feeds = str(tmp_path / "f.npz")
    np.savez(feeds, images=rng.standard_normal((32, 4, 4, 2)).astype(np.float32),
             labels=rng.integers(0, 3, 32))
    if strategy == "ps":
        ir = fixed_batch_crop()
        strategies.transform(ir, "ps", cluster=cluster.Cluster(
            {"ps": ["127.0.0.1:28801"], "worker": ["127.0.0.1:28802", "127.0.0.1:28803"]}))
    else:
        ir = transformed(fixed_batch_crop(), 2)
    assert const_value(ir, "replica_1/random_crop/size").tolist() == [BATCH // 2, 3, 3, 2]
    report = equivalence.compare(fixed_batch_crop(), ir, feeds, steps=3)
    assert report.ok and report.reasons == [], equivalence.format_report(report)


def test_a_crop_of_fewer_rows_than_the_fixed_batch_is_refused_naming_it():
    # apply exited 0: each replica cropped its whole slice, one device a random run of rows
    with pytest.raises(GraphxformError, match="'random_crop' \\(Slice\\) picks examples of the "
                       "batch by their position"):
        transformed(fixed_batch_crop(rows=BATCH // 2), 2)


def fixed_batch_flip():
    """``tf.image.random_flip_left_right`` of a fixed batch: a coin per image, drawn with the
    shape TF folded from the batch's."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        images = tf1.placeholder(tf.float32, [BATCH, 4, 4, 2], name="images")
        labels = tf1.placeholder(tf.int64, [BATCH], name="labels")
        flipped = tf.image.random_flip_left_right(images, seed=6)
        logits = tf.matmul(tf.reshape(flipped, [BATCH, -1]), tf1.get_variable("w", [32, 3]))
        loss = tf1.losses.sparse_softmax_cross_entropy(labels, logits)
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.5).minimize(loss))
    return export(g)


@pytest.mark.parametrize("build", ["flip", "wgan"])
def test_ps_gives_each_replica_its_rows_of_a_shared_draw_per_example(build, tmp_path):
    # ps shares a draw that reads no batch, so every replica read all BATCH rows of it beside
    # its BATCH / 2 examples: TF rejected the graph ("Cannot reshape", "Dimensions must be
    # equal"); now replica i reads the rows of its slice, one device's draw
    rng = np.random.default_rng(4)
    feeds = str(tmp_path / "f.npz")
    if build == "flip":
        make = fixed_batch_flip
        np.savez(feeds, images=rng.standard_normal((32, 4, 4, 2)).astype(np.float32),
                 labels=rng.integers(0, 3, 32))
    else:
        make = wgan_gp_fixed_batch
        np.savez(feeds, real=rng.standard_normal((32, 4)).astype(np.float32),
                 noise=rng.standard_normal((32, 3)).astype(np.float32))
    ir = make()
    strategies.transform(ir, "ps", cluster=cluster.Cluster(
        {"ps": ["127.0.0.1:28804"], "worker": ["127.0.0.1:28805", "127.0.0.1:28806"]}))
    report = equivalence.compare(make(), ir, feeds, steps=3)
    assert report.ok, equivalence.format_report(report)
