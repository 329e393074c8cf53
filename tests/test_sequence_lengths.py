"""A loss shaped by the batch's longest sequence: ``tf.sequence_mask(lengths)`` without a
``maxlen`` is as wide as the longest length in the batch, and the tokens are cut to that width.
One device pads to the whole batch's longest; a replica, to its slice's. ``reduce_mean(ce *
mask)`` then divides by another number of tokens, and the transformed graph trained
differently (apply exited 0, verify failed: 7e-02). Every synchronous strategy now takes the
whole batch's longest in every replica (passes/global_extremes.py: a collective, or under ps
one node that reads every replica's).
A longest length that only bounds a loop (dynamic_rnn's) changes no value and is left alone."""

import numpy as np
import pytest

TIME, VOCAB = 12, 7


def _export_sgd(graph, loss, path) -> str:
    """Train ``loss`` by SGD as the step 'train', list it as the loss, export to ``path``."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    tf1.add_to_collection("train_op", train)
    tf1.add_to_collection("losses", loss)
    tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def _lengths(rng):
    """64 lengths, short but for one full sequence in the second slice (of two) of every
    batch of 16: the slices' longest differ."""
    lengths = rng.randint(1, 4, 64)
    lengths[8::16] = TIME
    return lengths.astype(np.int32)


def padded_graph(path, form="mean_over_padding"):
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tokens = tf1.placeholder(tf.int32, [None, TIME], name="tokens")
        targets = tf1.placeholder(tf.int32, [None, TIME], name="targets")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        longest = tf.reduce_max(lengths)
        embedded = tf.nn.embedding_lookup(tf1.get_variable("emb", [VOCAB, 6]),
                                          tokens[:, :longest])
        logits = tf.einsum("btd,dv->btv", embedded, tf1.get_variable("out", [6, VOCAB]))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets[:, :longest],
                                                            logits=logits)
        if form == "mean_over_padding":
            mask = tf.sequence_mask(lengths, dtype=tf.float32)
            loss = tf.reduce_mean(ce * mask, name="loss")
        elif form == "per_token_of_the_longest":  # the same count, written out
            loss = tf.identity(tf.reduce_sum(ce) / tf.cast(tf.size(ce), tf.float32),
                               name="loss")
        elif form == "mean_per_sequence":  # each over its own length, then the batch's mean
            mask = tf.sequence_mask(lengths, longest, dtype=tf.float32)
            loss = tf.reduce_mean(tf.reduce_sum(ce * mask, axis=1) /
                                  tf.cast(lengths, tf.float32), name="loss")
        else:  # "sequence_loss_per_row": seq2seq's sequence_loss(average_across_batch=False)
            mask = tf.sequence_mask(lengths, longest, dtype=tf.float32)
            loss = tf.reduce_mean(tf.reduce_sum(ce * mask, axis=1) /
                                  (tf.reduce_sum(mask, axis=1) + 1e-12), name="loss")
        return _export_sgd(graph, loss, path)


def _feeds(tmp_path):
    """Lengths whose longest differs between the slices of every batch of 16."""
    rng = np.random.RandomState(0)
    lengths = _lengths(rng)
    np.savez(tmp_path / "f.npz", tokens=rng.randint(0, VOCAB, (64, TIME)).astype(np.int32),
             targets=rng.randint(0, VOCAB, (64, TIME)).astype(np.int32),
             lengths=lengths)
    return tmp_path / "f.npz"


@pytest.mark.parametrize("form", ["mean_over_padding", "per_token_of_the_longest",
                                  "mean_per_sequence", "sequence_loss_per_row"])
@pytest.mark.parametrize("strategy", ["allreduce", "replicated"])
def test_a_loss_padded_to_the_longest_sequence_trains_like_one_device(run_cli, tmp_path,
                                                                      form, strategy):
    code, out, err = run_cli("verify", "--strategy", strategy, "--replicas", 2,
                             padded_graph(tmp_path / "m.meta", form), "--feeds",
                             _feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def test_every_replica_pads_to_the_whole_batchs_longest(tmp_path):
    from graphxform import metagraph, strategies
    ir = metagraph.load(padded_graph(tmp_path / "m.meta"))
    pipeline = strategies.transform(ir, "allreduce", devices=["/cpu:0", "/cpu:1"])
    done = {t.name: t.summary for t in pipeline.timings}["global-extremes"]
    assert done == {"the whole batch's": ["Max", "SequenceMask/Max"],  # the mask takes its own
                    "collectives_per_replica": 2}
    for i in range(2):
        reduced = f"global_extremes/0/replica_{i}/reduced"
        assert ir.op(reduced) == "CollectiveReduceV2"
        assert ir.attrs(reduced)["merge_op"].s == b"Max"
        readers = {dst for dst, _ in ir.consumers(f"replica_{i}/Max")}
        assert reduced in readers and not [r for r in readers if r.startswith("replica_")]


@pytest.mark.parametrize("form, strategy, workers", [
    ("mean_over_padding", "ps", 2), ("per_token_of_the_longest", "partitioned-ps", 3)])
def test_the_ps_strategies_take_the_whole_batchs_longest_too(run_cli, tmp_path, form, strategy,
                                                              workers):
    """ps refused it ('is shaped by 'Max' (Max), the batch's largest value of its
    examples'): one chain of Maximum on the first worker now reads every replica's Max."""
    cluster = tmp_path / "cluster.json"
    addresses = ", ".join(f'"127.0.0.1:{2224 + i}"' for i in range(workers))
    cluster.write_text(f'{{"ps": ["127.0.0.1:2222"], "worker": [{addresses}]}}')
    code, out, err = run_cli("verify", "--strategy", strategy, "--cluster", cluster,
                             padded_graph(tmp_path / "m.meta", form), "--feeds",
                             _feeds(tmp_path), "--batch-size", 24, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def test_a_longest_length_that_only_bounds_a_loop_is_left_alone():
    """The corpus' dynamic_rnn tagger: its min and max sequence lengths tell the loop when to
    copy state through, which changes no value; no collective is spent on them."""
    from conftest import FIXTURES
    from graphxform import metagraph, strategies
    ir = metagraph.load(str(FIXTURES / "recipes" / "dynamic_rnn_tagger.meta"))
    assert any(ir.op(n) == "Max" for n in ir.g)
    pipeline = strategies.transform(ir, "allreduce", devices=["/cpu:0", "/cpu:1"])
    assert not {t.name: t for t in pipeline.timings}["global-extremes"].modified
    assert not [n for n in ir.g if n.startswith("global_extremes/")]


def tagger_graph(path, form):
    """A sequence tagger's loss as guillaumegenthial/sequence_tagging writes it: per-token
    cross entropy, padding dropped by tf.boolean_mask(losses, tf.sequence_mask(lengths)),
    then the mean over what is left (``mean_of_selected``; ``recurrent_`` runs a recurrence
    over time first, a while loop the mixing analysis does not see through, where `apply`
    exited 0 and verify failed: 2e-02); the mask applied to the logits
    and labels first (``selected_first``); the selection's sum over its size
    (``sum_over_size``, the same mean); the selection's sum over the mask's sum
    (``sum_over_mask``); and a mean over weights a mask of the weights picks, beside a mean
    over the tokens (``weights_selected``). The selection's sum over its rows (``sum_over_rows``,
    ``tf.shape(selected)[0]``), and tf.compat.v1.losses on the selected labels and logits,
    which divides the sum by its count of the losses (``losses_selected``, the default
    SUM_BY_NONZERO_WEIGHTS; ``losses_mean_selected``, MEAN): that count, read from the
    selection's shape, was taken for a count of examples; `apply` exited 0, verify failed
    (6e-02)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        words = tf1.placeholder(tf.int32, [None, None], name="word_ids")
        labels = tf1.placeholder(tf.int32, [None, None], name="labels")
        lengths = tf1.placeholder(tf.int32, [None], name="sequence_lengths")
        embedded = tf.nn.embedding_lookup(tf1.get_variable("emb", [VOCAB, 6]), words)
        out = tf1.get_variable("out", [6, 5])
        if form.startswith("recurrent"):  # a recurrence over time (tf.scan: a while loop)
            cell = tf1.get_variable("cell", [6, 6])
            states = tf.scan(lambda h, x: tf.tanh(x + tf.matmul(h, cell)),
                             tf.transpose(embedded, [1, 0, 2]),
                             initializer=tf.zeros_like(embedded[:, 0]))
            embedded = tf.transpose(states, [1, 0, 2])
            form = form[len("recurrent_"):]
        logits = tf.einsum("btd,dc->btc", tf.tanh(embedded), out)
        mask = tf.sequence_mask(lengths)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits
        if form == "mean_of_selected":
            loss = tf.reduce_mean(tf.boolean_mask(xent(labels=labels, logits=logits), mask))
        elif form == "selected_first":
            loss = tf.reduce_mean(xent(labels=tf.boolean_mask(labels, mask),
                                       logits=tf.boolean_mask(logits, mask)))
        elif form == "sum_over_size":
            selected = tf.boolean_mask(xent(labels=labels, logits=logits), mask)
            loss = tf.reduce_sum(selected) / tf.cast(tf.size(selected), tf.float32)
        elif form == "sum_over_rows":
            selected = tf.boolean_mask(xent(labels=labels, logits=logits), mask)
            loss = tf.reduce_sum(selected) / tf.cast(tf.shape(selected)[0], tf.float32)
        elif form in ("losses_selected", "losses_mean_selected"):
            reduction = (tf1.losses.Reduction.MEAN if form == "losses_mean_selected" else
                         tf1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS)
            loss = tf1.losses.sparse_softmax_cross_entropy(
                tf.boolean_mask(labels, mask), tf.boolean_mask(logits, mask),
                reduction=reduction)
        elif form == "sum_over_mask":
            loss = (tf.reduce_sum(tf.boolean_mask(xent(labels=labels, logits=logits), mask))
                    / tf.reduce_sum(tf.cast(mask, tf.float32)))
        else:  # weights_selected
            loss = (tf.reduce_mean(xent(labels=labels, logits=logits))
                    + 0.01 * tf.reduce_mean(tf.boolean_mask(out, tf.abs(out) > 0.1)))
        loss = tf.identity(loss, name="loss")
        return _export_sgd(graph, loss, path)


def _tagger_feeds(tmp_path):
    """Sentences padded to the longest of all, each slice of a batch selecting a different
    number of tokens."""
    rng = np.random.RandomState(1)
    lengths = _lengths(rng)
    np.savez(tmp_path / "t.npz", word_ids=rng.randint(0, VOCAB, (64, TIME)).astype(np.int32),
             labels=rng.randint(0, 5, (64, TIME)).astype(np.int32),
             sequence_lengths=lengths)
    return tmp_path / "t.npz"


@pytest.mark.parametrize("form, strategy", [
    *((form, "allreduce") for form in ("mean_of_selected", "recurrent_mean_of_selected",
                                       "selected_first", "recurrent_sum_over_size",
                                       "sum_over_size", "sum_over_rows")),
    ("mean_of_selected", "ps"), ("sum_over_rows", "ps")])  # one form of each kind under ps
def test_a_mean_over_the_tokens_a_mask_selects_trains_like_one_device(run_cli, tmp_path, form,
                                                                      strategy):
    """Each replica divides by the whole batch's count of the tokens its [batch, time] mask
    selects (global-denominators); these were refused."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:28141"], "worker": ["127.0.0.1:28142", '
                       '"127.0.0.1:28143"]}')
    where = ("--cluster", cluster) if strategy == "ps" else ("--replicas", 2)
    code, out, err = run_cli("verify", "--strategy", strategy, *where,
                             tagger_graph(tmp_path / "m.meta", form),
                             "--feeds", _tagger_feeds(tmp_path), "--batch-size", 16,
                             "--steps", 4, "--fetch", "loss:0")
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("form", ["sum_over_mask", "recurrent_sum_over_mask",
                                  "weights_selected", "losses_selected",
                                  "losses_mean_selected"])
def test_a_selection_divided_by_the_masks_sum_trains_like_one_device(run_cli, tmp_path, form):
    code, out, err = run_cli("verify", "--replicas", 2, tagger_graph(tmp_path / "m.meta", form),
                             "--feeds", _tagger_feeds(tmp_path), "--batch-size", 16,
                             "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


@pytest.mark.parametrize("strategy", ["replicated", "ps"])
def test_losses_over_a_selection_divide_by_the_whole_batchs_count(run_cli, tmp_path, strategy):
    """tf.compat.v1.losses' count of the selected losses is the whole batch's in the other
    synchronous strategies too (global-denominators)."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224", '
                       '"127.0.0.1:2225"]}')
    where = ("--cluster", cluster) if strategy == "ps" else ("--replicas", 2)
    code, out, err = run_cli("verify", "--strategy", strategy, *where,
                             tagger_graph(tmp_path / "m.meta", "losses_selected"),
                             "--feeds", _tagger_feeds(tmp_path), "--batch-size", 16,
                             "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out


def time_summed_graph(path, width):
    """contrib's sequence_loss averaged over the batch alone, then summed over time: each
    timestep's masked sum over the batch over its own count of tokens (``width`` "fixed": the
    mask as wide as the tokens; "longest": both cut to the batch's longest length)."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tokens = tf1.placeholder(tf.int32, [None, TIME], name="tokens")
        targets = tf1.placeholder(tf.int32, [None, TIME], name="targets")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        embedded = tf.nn.embedding_lookup(tf1.get_variable("emb", [VOCAB, 6]), tokens)
        logits = tf.reshape(tf.matmul(tf.reshape(embedded, [-1, 6]),
                                      tf1.get_variable("out", [6, VOCAB])), [-1, TIME, VOCAB])
        width = TIME if width == "fixed" else tf.reduce_max(lengths)
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=targets[:, :width], logits=logits[:, :width])
        weights = tf.sequence_mask(lengths, width, dtype=tf.float32)
        loss = tf.reduce_sum(tf.reduce_sum(crossent * weights, axis=0) /
                             (tf.reduce_sum(weights, axis=0) + 1e-12), name="loss")
        return _export_sgd(graph, loss, path)


@pytest.mark.parametrize("width", ["fixed", "longest"])
@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_a_sum_over_time_of_each_timesteps_mean_over_the_batch_trains_like_one_device(
        run_cli, tmp_path, width, strategy):
    """Each timestep divides by the whole batch's count of its tokens (global-denominators;
    the slices' counts differ past the third timestep), so each replica's quotients average
    to one device's, and so does their sum over time. Refused before: by check (losses), as
    a Sum read as a sum over the slice ("fixed"), and ("longest") as rightly: the per-timestep
    counts, as long as the longest length, were taken for one per example and left the
    slice's (with the check off, verify failed by 7e-01)."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"ps": ["127.0.0.1:28421"], "worker": ["127.0.0.1:28422", '
                       '"127.0.0.1:28423"]}')
    where = ("--cluster", cluster) if strategy == "ps" else ("--replicas", 2)
    code, out, err = run_cli("verify", "--strategy", strategy, *where,
                             time_summed_graph(tmp_path / "m.meta", width), "--feeds",
                             _feeds(tmp_path), "--batch-size", 16, "--steps", 4)
    assert code == 0, err
    assert "PASS" in out, out
