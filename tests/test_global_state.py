"""State the step moves from the batch that no gradient updates (passes/global_state.py): a
count of the examples seen, a learning rate adapted from the loss, REINFORCE's running reward
baseline that the loss reads. Each replica kept its own copy, moved by its slice: `apply`
exited 0, `verify` failed and the checkpoint held replica 0's count. Where the value written
is a sum, count, mean or extreme of the batch, every replica now writes one device's value;
what cannot be combined so (a memory bank's scatter of the examples' rows) is refused, naming
the variable. `verify` (the command as typed, its checks on) trains both graphs from one
checkpoint and compares every variable, the state included."""

import json

import numpy as np
import pytest

SPEC = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}


def _export(path, build, feeds):
    """Build a graph with ``build(tf, tf1, x)`` (x: a [None, 3] float placeholder), export it
    and a pool of 64 examples; returns the .meta path."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        build(tf, tf1, x)
        tf1.train.export_meta_graph(str(path), graph=graph)
    rng = np.random.RandomState(0)
    pool = {"x": rng.randn(64, 3).astype(np.float32)}
    pool.update(feeds(rng))
    np.savez(str(path) + ".npz", **pool)
    return str(path)


def _regression(tf, tf1, x):
    w = tf1.get_variable("w", [3, 1], initializer=tf1.glorot_uniform_initializer(seed=1))
    return tf.square(tf.matmul(x, w) - 1.0)


def examples_seen(path):
    """A global, non-trainable counter of the examples trained on, grouped with the step."""
    def build(tf, tf1, x):
        loss = tf.reduce_mean(_regression(tf, tf1, x))
        seen = tf1.get_variable("examples_seen", [], tf.int64, trainable=False,
                                initializer=tf1.zeros_initializer())
        train = tf.group(tf1.train.GradientDescentOptimizer(0.1).minimize(loss),
                         tf1.assign_add(seen, tf.cast(tf.shape(x)[0], tf.int64)), name="train")
        tf1.add_to_collection("train_op", train)
    return _export(path, build, lambda rng: {})


def adaptive_rate(path, rule="linear"):
    """A learning rate variable the step adapts from the loss after applying it: linear in
    the loss (a mean), in its square (a function of the batch's mean: each replica reads the
    replicas' mean) or in the first example's loss (no statistic of the batch)."""
    def build(tf, tf1, x):
        rate = tf1.get_variable("rate", [], trainable=False,
                                initializer=tf1.constant_initializer(0.1))
        per_example = _regression(tf, tf1, x)
        loss = tf.reduce_mean(per_example, name="loss")
        train = tf1.train.GradientDescentOptimizer(rate).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        with tf.control_dependencies([train]):
            signal = {"linear": loss, "square": tf.square(loss),
                      "first": tf.reduce_sum(per_example[0])}[rule]
            adapt = tf1.assign(rate, rate * (1.0 - 0.01 * signal))
        tf1.add_to_collection("train_op", tf.group(adapt, name="train"))
    return _export(path, build, lambda rng: {})


def _policy(tf, tf1, x):
    """A REINFORCE policy's pieces: the fed rewards, a running baseline of them (not
    trained), and the log-probability of each fed action."""
    reward = tf1.placeholder(tf.float32, [None], name="reward")
    action = tf1.placeholder(tf.int32, [None], name="action")
    w = tf1.get_variable("policy", [3, 4], initializer=tf1.glorot_uniform_initializer(seed=2))
    baseline = tf1.get_variable("baseline", [], trainable=False,
                                initializer=tf1.zeros_initializer())
    log_prob = -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=action,
                                                               logits=tf.matmul(x, w))
    return reward, baseline, log_prob


def reinforce_baseline(path):
    """REINFORCE with a running baseline of the reward: the loss reads the baseline, and the
    step moves it toward the batch's mean reward (an exponential moving average)."""
    def build(tf, tf1, x):
        reward, baseline, log_prob = _policy(tf, tf1, x)
        loss = -tf.reduce_mean((reward - baseline) * log_prob)
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        with tf.control_dependencies([train]):
            moved = tf1.assign(baseline, 0.9 * baseline + 0.1 * tf.reduce_mean(reward))
        tf1.add_to_collection("train_op", tf.group(moved, name="train"))
    return _export(path, build, lambda rng: {
        "reward": rng.uniform(0, 2, 64).astype(np.float32),
        "action": rng.randint(0, 4, 64).astype(np.int32)})


def memory_bank(path):
    """A memory bank (instance discrimination's): the step writes each example's features at
    its index in the dataset."""
    def build(tf, tf1, x):
        index = tf1.placeholder(tf.int32, [None], name="index")
        w = tf1.get_variable("w", [3, 2], initializer=tf1.glorot_uniform_initializer(seed=1))
        features = tf.matmul(x, w)
        loss = tf.reduce_mean(tf.square(features - 1.0))
        bank = tf1.get_variable("memory_bank", [64, 2], trainable=False,
                                initializer=tf1.zeros_initializer())
        train = tf.group(tf1.train.GradientDescentOptimizer(0.1).minimize(loss),
                         tf1.scatter_update(bank, index, tf.stop_gradient(features)),
                         name="train")
        tf1.add_to_collection("train_op", train)
    return _export(path, build, lambda rng: {"index": np.arange(64, dtype=np.int32)})


def _verify(run_cli, model, *strategy):
    return run_cli("verify", *strategy, model, "--feeds", model + ".npz", "--batch-size", 16,
                   "--steps", 3)


@pytest.mark.parametrize("strategy", [("--replicas", 2), ("--strategy", "replicated",
                                                          "--replicas", 2)])
def test_a_count_of_the_examples_seen_is_the_global_batch_s(run_cli, tmp_path, strategy):
    model = examples_seen(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, *strategy)
    assert code == 0, err
    assert "PASS" in out and "examples_seen" in out
    assert "kept per replica" not in out + err


def test_a_count_on_the_hybrid_strategy(run_cli, tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(SPEC))
    model = examples_seen(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, "--strategy", "hybrid", "--cluster", cluster)
    assert code == 0, err
    assert "PASS" in out


def test_apply_says_what_it_combined(run_cli, tmp_path):
    model = examples_seen(tmp_path / "m.meta")
    code, out, err = run_cli("apply", "--replicas", 4, model, "-o", tmp_path / "out.meta")
    assert code == 0, err
    assert "1 global-state" in out


@pytest.mark.parametrize("rule", ["linear", "square"])
def test_a_rate_adapted_from_the_loss_trains_like_one_device(run_cli, tmp_path, rule):
    model = adaptive_rate(tmp_path / "m.meta", rule)
    code, out, err = _verify(run_cli, model, "--replicas", 2)
    assert code == 0, err
    assert "PASS" in out


def test_a_baseline_the_loss_reads_trains_like_one_device(run_cli, tmp_path):
    model = reinforce_baseline(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, "--replicas", 2)
    assert code == 0, err
    assert "PASS" in out and "baseline" in out


@pytest.mark.parametrize("build, variable", [(memory_bank, "memory_bank"),
                                             (lambda p: adaptive_rate(p, "first"), "rate")])
def test_state_that_cannot_be_combined_is_refused_in_one_line(run_cli, tmp_path, build,
                                                              variable):
    model = build(tmp_path / "m.meta")
    out_path = tmp_path / "out.meta"
    code, out, err = run_cli("apply", "--replicas", 2, model, "-o", out_path)
    assert code == 1 and not out_path.exists()
    assert len(err.strip().splitlines()) == 1, err
    assert f"variable '{variable}' (not trained; the step moves it from the batch)" in err
    assert "checkpoint would save replica 0's" in err


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_the_ps_strategies_combine_a_count_by_graph_edges(run_cli, tmp_path, strategy):
    """One node on the variable's ps task adds up every replica's count; replica 0's update
    alone stays (the count was replica 0's slice's before)."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(SPEC))
    model = examples_seen(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, "--strategy", strategy, "--cluster", cluster)
    assert code == 0 and "PASS" in out, out + err


def test_ps_refuses_a_memory_bank_in_one_line(run_cli, tmp_path):
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(SPEC))
    model = memory_bank(tmp_path / "m.meta")
    code, out, err = run_cli("apply", "--strategy", "ps", "--cluster", cluster, model,
                             "-o", tmp_path / "out.meta")
    assert code == 1
    assert "variable 'memory_bank'" in err and len(err.strip().splitlines()) == 1


def baseline_moved_first(path):
    """A NAS controller's REINFORCE (Zoph & Le): the baseline moves toward the batch's mean
    reward first, and the advantage reads it after, under tf.control_dependencies."""
    def build(tf, tf1, x):
        reward, baseline, log_prob = _policy(tf, tf1, x)
        moved = tf1.assign_sub(baseline, 0.05 * (baseline - tf.reduce_mean(reward)))
        with tf.control_dependencies([moved]):
            advantage = reward - tf.identity(baseline)
        loss = -tf.reduce_mean(log_prob * advantage)
        tf1.add_to_collection("train_op", tf1.train.GradientDescentOptimizer(0.5).minimize(loss))
    return _export(path, build, lambda rng: {
        "reward": (rng.randn(64) + 1).astype(np.float32),
        "action": rng.randint(0, 3, 64).astype(np.int32)})


@pytest.mark.parametrize("strategy", ["ps", "partitioned-ps"])
def test_a_read_after_the_one_update_waits_on_it(run_cli, tmp_path, strategy):
    """ps keeps replica 0's update alone; replica 1's read lost its wait on its own update and
    read the baseline from before it (verify failed by 3.2e-02 at step 1, apply exited 0)."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(SPEC))
    model = baseline_moved_first(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, "--strategy", strategy, "--cluster", cluster)
    assert code == 0 and "PASS" in out, out + err


def last_batch_max(path):
    """The largest reward of the last batch, kept for a summary: an assign of reduce_max."""
    def build(tf, tf1, x):
        loss = tf.reduce_mean(_regression(tf, tf1, x))
        reward = tf1.placeholder(tf.float32, [None], name="reward")
        largest = tf1.get_variable("largest_reward", [], trainable=False,
                                   initializer=tf1.zeros_initializer())
        train = tf.group(tf1.train.GradientDescentOptimizer(0.1).minimize(loss),
                         tf1.assign(largest, tf.reduce_max(reward)), name="train")
        tf1.add_to_collection("train_op", train)
    return _export(path, build, lambda rng: {"reward": rng.randn(64).astype(np.float32)})


def test_an_extreme_of_the_batch_is_the_whole_batch_s(run_cli, tmp_path):
    model = last_batch_max(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, "--replicas", 2)
    assert code == 0 and "PASS" in out, out + err


def running_activation_range(path):
    """Quantization-aware training's range: the largest activation seen so far,
    ``rmax.assign(tf.maximum(rmax, tf.reduce_max(h)))``, read by a fake-quant op after its
    update (refused: the Maximum of the state and the batch's max was no max class)."""
    def build(tf, tf1, x):
        h = tf.nn.relu(_regression(tf, tf1, x))
        rmax = tf1.get_variable("rmax", [], trainable=False, initializer=tf1.zeros_initializer())
        update = tf1.assign(rmax, tf.maximum(rmax, tf.reduce_max(h)))
        with tf.control_dependencies([update]):
            quantized = tf.quantization.fake_quant_with_min_max_vars(
                h, 0.0, tf.maximum(rmax, 1e-3))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(quantized))
        tf1.add_to_collection("train_op", train)
    return _export(path, build, lambda rng: {})


@pytest.mark.parametrize("strategy", [("--replicas", 2), ("--strategy", "ps", "--cluster")])
def test_a_running_maximum_is_the_whole_batch_s(run_cli, tmp_path, strategy):
    if "ps" in strategy:
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps(SPEC))
        strategy += (cluster,)
    model = running_activation_range(tmp_path / "m.meta")
    code, out, err = _verify(run_cli, model, *strategy)
    assert code == 0 and "PASS" in out and "rmax" in out, out + err


def in_a_cond(path, what):
    """An update inside tf.cond (control flow v2, TF2's default) after the optimizer's: a
    count of the examples from the batch, or Lookahead's sync of the weights into a slow copy,
    which reads nothing of the batch."""
    def build(tf, tf1, x):
        step = tf1.train.get_or_create_global_step()
        loss = tf.reduce_mean(_regression(tf, tf1, x))
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        (w,) = tf1.trainable_variables()
        state = tf1.get_variable("state", [3, 1] if what == "lookahead" else [], trainable=False,
                                 initializer=tf1.zeros_initializer())
        with tf.control_dependencies([train]):
            if what == "lookahead":
                def sync():
                    slow = state.assign(state + 0.5 * (w - state))
                    with tf.control_dependencies([slow]):
                        return tf.group(w.assign(slow))
            else:
                def sync():
                    return tf.group(state.assign_add(tf.cast(tf.shape(x)[0], tf.float32)))
            update = tf.cond(tf.equal(step % 2, 0), sync, tf.no_op)
        tf1.add_to_collection("train_op", tf.group(train, update, name="train"))
    return _export(path, build, lambda rng: {})


def test_state_moved_from_the_batch_inside_a_cond_is_refused(run_cli, tmp_path):
    """No pass reaches into a function body: apply exited 0 and each replica counted its own
    slice."""
    model = in_a_cond(tmp_path / "m.meta", "count")
    code, out, err = run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "updates 'state'" in err and "inside it from values each replica computes" in err


def test_an_update_in_a_cond_that_reads_no_slice_trains_like_one_device(run_cli, tmp_path):
    """Lookahead's sync reads the weights alone: equal on every replica (it was refused as
    applying a slice's gradient)."""
    model = in_a_cond(tmp_path / "m.meta", "lookahead")
    code, out, err = _verify(run_cli, model, "--replicas", 2)
    assert code == 0 and "PASS" in out, out + err


def moving_average_range(path, form):
    """Quantization-aware training's activation range as an exponential moving average of the
    batch's max and min (tf.contrib.quantize's create_training_graph; the hand-written form),
    read by a fake-quant op: ``assign_moving_average(rmax, reduce_max(h), decay)`` grouped
    with the train op, or ``rmax.assign_sub((rmax - reduce_max(h)) * (1 - decay))`` under
    its control dependencies. The written value is a function of the batch's max and the
    state, which no class names: it was refused."""
    def build(tf, tf1, x):
        from tensorflow.python.training import moving_averages  # as tf.contrib.quantize
        h = tf.nn.relu(_regression(tf, tf1, x))
        rmax = tf1.get_variable("rmax", [], trainable=False,
                                initializer=tf1.constant_initializer(6.0))
        rmin = tf1.get_variable("rmin", [], trainable=False, initializer=tf1.zeros_initializer())
        quantized = tf.quantization.fake_quant_with_min_max_vars(h, rmin, rmax)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(quantized))
        if form == "assign_moving_average":
            updates = [moving_averages.assign_moving_average(
                           var, reduce(h), 0.9, zero_debias=False)
                       for var, reduce in [(rmax, tf.reduce_max), (rmin, tf.reduce_min)]]
            train = tf.group(train, *updates, name="train")
        else:
            with tf.control_dependencies([train]):
                train = tf.group(rmax.assign_sub((rmax - tf.reduce_max(h)) * (1 - 0.9)),
                                 rmin.assign_sub((rmin - tf.reduce_min(h)) * (1 - 0.9)),
                                 name="train")
        tf1.add_to_collection("train_op", train)
    return _export(path, build, lambda rng: {})


@pytest.mark.parametrize("form, strategy", [
    ("assign_moving_average", "allreduce"), ("assign_sub", "allreduce"),
    ("assign_moving_average", "ps")])  # ps: an update under the train op's control
def test_a_moving_average_of_the_batch_s_range_trains_like_one_device(run_cli, tmp_path, form,
                                                                      strategy):  # runs once
    where = ("--replicas", 2)
    if strategy == "ps":
        cluster = tmp_path / "cluster.json"
        cluster.write_text(json.dumps(SPEC))
        where = ("--cluster", cluster)
    model = moving_average_range(tmp_path / "m.meta", form)
    code, out, err = _verify(run_cli, model, "--strategy", strategy, *where)
    assert code == 0 and "PASS" in out and "rmax" in out, out + err
