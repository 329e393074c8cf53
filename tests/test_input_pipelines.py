"""Input pipelines inside the graph (graphxform/input_pipeline.py), built as the TF1 guides
build them: a tf.data one-shot iterator (`make_one_shot_iterator(...).get_next()`), a batch
fixed by `drop_remainder`, and a queue filled by queue runners (`slice_input_producer` +
`tf.compat.v1.train.batch`). Each step must read one batch, as on one device, and each replica
train on its slice: `verify` (the command as typed, its checks on) trains both graphs from one
checkpoint and compares."""

import re

import numpy as np
import pytest

from graphxform import equivalence, metagraph, training
from graphxform.input_pipeline import find


def _examples(rows=256, seed=0):
    rng = np.random.RandomState(seed)
    xs = rng.randn(rows, 8).astype(np.float32)
    return xs, (xs[:, 0] + xs[:, 1] > 0).astype(np.int64)


def _model_and_step(tf1, x, y, hidden=16):
    """Two dense layers of tf1.get_variable, tf.compat.v1.losses' mean cross entropy, SGD."""
    import tensorflow as tf
    h = x
    for k, width in enumerate((hidden, 2)):
        w = tf1.get_variable(f"w{k}", [h.shape[-1], width])
        b = tf1.get_variable(f"b{k}", [width], initializer=tf1.zeros_initializer())
        h = tf.matmul(h, w) + b
        h = tf.nn.relu(h) if k == 0 else h
    loss = tf1.losses.sparse_softmax_cross_entropy(y, h)
    step = tf1.train.get_or_create_global_step()
    train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
    tf1.add_to_collection("train_op", train)


def _export(build, path, graph_seed=1) -> str:
    import tensorflow as tf
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        if graph_seed is not None:
            tf1.set_random_seed(graph_seed)
        build(tf, tf1)
        tf1.train.export_meta_graph(str(path), graph=graph)
    return str(path)


def tf_data_graph(path, batch=16, drop_remainder=False, rows=256, repeat=True, seed=3):
    def build(tf, tf1):
        dataset = tf.data.Dataset.from_tensor_slices(_examples(rows)).shuffle(64, seed=seed)
        dataset = dataset.repeat() if repeat else dataset
        dataset = dataset.batch(batch, drop_remainder=drop_remainder)
        x, y = tf1.data.make_one_shot_iterator(dataset).get_next()
        _model_and_step(tf1, x, y)
    return _export(build, path, graph_seed=None if seed is None else 1)


def queue_graph(path, num_epochs=None):
    def build(tf, tf1):
        x, y = tf1.train.slice_input_producer(list(_examples()), shuffle=False,
                                              num_epochs=num_epochs)
        xs, ys = tf1.train.batch([x, y], batch_size=16)
        _model_and_step(tf1, xs, ys)
    return _export(build, path)


def fixed_placeholder_graph(path):
    """The MNIST-tutorial style: placeholders of a fixed batch, as wide as the hidden layer."""
    def build(tf, tf1):
        x = tf1.placeholder(tf.float32, [16, 8], name="x")
        y = tf1.placeholder(tf.int64, [16], name="y")
        _model_and_step(tf1, x, y, hidden=16)
    return _export(build, path)


def _passes(run_cli, *args):
    code, out, err = run_cli("verify", *args)
    assert code == 0, err
    assert "PASS" in out, out
    return out


def test_the_pipeline_is_found_with_its_batched_outputs(tmp_path):
    ir = metagraph.load(tf_data_graph(tmp_path / "m.meta"))
    pipeline = find(ir, training.analyze(ir).train_closure)
    assert [(r.node, r.batched, r.fixed_batch) for r in pipeline.reads] == [
        ("IteratorGetNext", [0, 1], None)]
    assert {"OneShotIterator", "IteratorGetNext"} <= pipeline.nodes
    assert not any(ir.op(n) in ("VarHandleOp", "MatMul") for n in pipeline.nodes)
    fixed = metagraph.load(tf_data_graph(tmp_path / "f.meta", drop_remainder=True))
    assert find(fixed, training.analyze(fixed).train_closure).reads[0].fixed_batch == 16


@pytest.mark.parametrize("replicas", [2, 4])
def test_tf_data_pipeline_stays_single_and_each_replica_trains_on_its_slice(
        run_cli, tmp_path, replicas):
    model = tf_data_graph(tmp_path / "m.meta")
    out = tmp_path / "out.meta"
    code, _, err = run_cli("apply", "--replicas", replicas, model, "-o", out)
    assert code == 0, err
    ir = metagraph.load(str(out))
    assert ir.op("IteratorGetNext") == "IteratorGetNext"  # one, under its own name
    assert not any(ir.op(n).startswith(("Iterator", "OneShot")) or "Dataset" in ir.op(n)
                   for n in ir.nodes() if n.startswith("replica_"))
    for port in (0, 1):
        split = f"split_inputs/IteratorGetNext/output_{port}/split"
        assert ir.input(split, 1) == ("IteratorGetNext", port)
        assert ir.attrs(split)["num_split"].i == replicas
    _passes(run_cli, "--replicas", replicas, model)


def test_a_batch_fixed_by_drop_remainder_is_rebatched_and_still_a_mean(run_cli, tmp_path):
    # tf.compat.v1.losses divides by a count TF folded into a [16] shape constant: the loss
    # must still be seen as a mean (refused as a sum before), and train like one device
    _passes(run_cli, "--replicas", 4, tf_data_graph(tmp_path / "m.meta", drop_remainder=True))


def test_fixed_batch_placeholders_as_wide_as_a_layer(run_cli, tmp_path):
    # the bias initialised to zeros([16]) is not the batch of 16 (it was shrunk to 8 before)
    model = fixed_placeholder_graph(tmp_path / "m.meta")
    xs, ys = _examples(64)
    np.savez(tmp_path / "feeds.npz", x=xs, y=ys)
    _passes(run_cli, "--replicas", 2, model, "--feeds", tmp_path / "feeds.npz",
            "--batch-size", 16)


def test_queue_runner_pipeline_runs_and_stays_single(run_cli, tmp_path):
    model = queue_graph(tmp_path / "m.meta")
    code, out, err = run_cli("run", model, "--steps", 2)  # queue runners started, no hang
    assert code == 0, err
    assert "step 2" in out
    out_path = tmp_path / "out.meta"
    assert run_cli("apply", "--replicas", 2, model, "-o", out_path)[0] == 0
    ir = metagraph.load(str(out_path))
    assert not any(ir.op(n).startswith(("Queue", "FIFOQueue")) for n in ir.nodes()
                   if n.startswith("replica_"))
    _passes(run_cli, "--replicas", 2, model, "--steps", 3)


def test_an_epoch_counter_in_the_pipeline_is_refused_in_one_line(run_cli, tmp_path):
    code, _, err = run_cli("apply", "--replicas", 2,
                           queue_graph(tmp_path / "m.meta", num_epochs=2),
                           "-o", tmp_path / "out.meta")
    assert code == 1
    assert "variable 'input_producer/input_producer/limit_epochs/epochs' (num_epochs" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.meta").exists()


def test_a_last_batch_that_does_not_divide_is_a_one_line_error(run_cli, tmp_path):
    # 18 rows in batches of 8: the third batch has 2 rows, which 4 replicas cannot share
    model = tf_data_graph(tmp_path / "m.meta", batch=8, rows=18, repeat=False)
    out = tmp_path / "out.meta"
    assert run_cli("apply", "--replicas", 4, model, "-o", out)[0] == 0
    code, _, err = run_cli("run", out, "--steps", 3)
    assert code == 1
    # both outputs' splits fail; TF reports whichever ran first
    assert re.search(r"the batch that 'IteratorGetNext' read \(output [01]\) does not divide "
                     "evenly", err)
    assert len(err.strip().splitlines()) == 1


def two_batches_graph(path, second_batch=16):
    """Two batches a step, each fixed by drop_remainder (a labelled and an unlabelled batch,
    as semi-supervised recipes read them), concatenated into one batch of the model: the
    tf.compat.v1 loss counts 16 + second_batch rows, a constant TF folded."""
    def build(tf, tf1):
        def batches(size, seed):
            dataset = tf.data.Dataset.from_tensor_slices(_examples(seed=seed))
            return dataset.shuffle(64, seed=3).repeat().batch(size, drop_remainder=True)
        x1, y1 = tf1.data.make_one_shot_iterator(batches(16, 0)).get_next()
        x2, y2 = tf1.data.make_one_shot_iterator(batches(second_batch, 1)).get_next()
        _model_and_step(tf1, tf.concat([x1, x2], 0), tf.concat([y1, y2], 0))
    return _export(build, path)


@pytest.mark.parametrize("second_batch", [16, 8])
def test_two_fixed_batches_concatenated_train_like_one_device(run_cli, tmp_path, second_batch):
    # each replica holds 8 + second_batch / 2 rows, but the loss's count, folded from the
    # concat's static shape (32 or 24), was not rebatched: the loss and its gradients were
    # half one device's (verify FAIL by 0.46, apply exit 0)
    model = two_batches_graph(tmp_path / "m.meta", second_batch)
    _passes(run_cli, "--replicas", 2, "--steps", 3, model)


def test_ps_keeps_the_pipeline_single_too(run_cli, tmp_path):
    cluster = tmp_path / "cluster.json"  # verify starts its own servers on free ports
    cluster.write_text('{"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2224", '
                       '"127.0.0.1:2225"]}')
    _passes(run_cli, "--strategy", "ps", "--cluster", cluster, "--steps", 3,
            tf_data_graph(tmp_path / "m.meta"))


def test_verify_names_an_unseeded_shuffle(run_cli, tmp_path):
    model = tf_data_graph(tmp_path / "m.meta", seed=None)
    ir = metagraph.load(model)
    reasons = " ".join(equivalence.mismatch_reasons(ir, training.analyze(ir)))
    assert "the input pipeline shuffles without a seed (ShuffleDataset)" in reasons
    seeded = metagraph.load(tf_data_graph(tmp_path / "s.meta"))
    assert "shuffles" not in " ".join(equivalence.mismatch_reasons(seeded,
                                                                  training.analyze(seeded)))


@pytest.mark.parametrize("build", [tf_data_graph, queue_graph])
def test_launched_workers_each_read_the_batch_and_train_on_their_slice(run_cli, tmp_path,
                                                                        build):
    """Under launch every worker's session runs its own step: an unplaced pipeline lands on the
    worker, which reads the batch for itself (its queue runners started by the task runtime) and
    trains on its slice, so a seeded pipeline keeps the workers on the same batches and the
    mean loss over workers is the single-device loss."""
    from processes import assert_launched_tasks_gone
    from graphxform.runtime.local import Runner
    model = build(tmp_path / "m.meta")
    with Runner(metagraph.load(model)) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        losses = [run.step({}).loss for _ in range(3)]
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"worker": ["127.0.0.1:2311", "127.0.0.1:2312"]}')
    out_path = tmp_path / "out.meta"
    assert run_cli("apply", "--cluster", cluster, model, "-o", out_path)[0] == 0
    code, out, err = run_cli("launch", out_path, "--steps", 3, "--restore", start,
                             "--timeout", 60)
    assert code == 0, out + err
    got = [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    assert_launched_tasks_gone(out)


def census_graph(path, rows=256):
    """The TF1 wide-and-deep (census) recipe: a CSV read by string_input_producer +
    TextLineReader + decode_csv, batched by shuffle_batch (queue runners all along)."""
    xs, ys = _examples(rows)
    csv = str(path) + ".csv"
    with open(csv, "w") as f:
        f.writelines(",".join(f"{v:.5f}" for v in x) + f",{y}\n" for x, y in zip(xs, ys))

    def build(tf, tf1):
        files = tf1.train.string_input_producer([csv], shuffle=False)
        _, line = tf1.TextLineReader().read(files)
        columns = tf1.decode_csv(line, record_defaults=[[0.0]] * 8 + [[0]])
        x, y = tf.stack(columns[:8]), tf.cast(columns[8], tf.int64)
        xs, ys = tf1.train.shuffle_batch([x, y], batch_size=16, capacity=128,
                                         min_after_dequeue=32, seed=3)
        _model_and_step(tf1, xs, ys)
    return _export(build, path)


def _cluster_file(tmp_path):
    cluster = tmp_path / "cluster.json"  # verify starts its own servers on free ports
    cluster.write_text('{"ps": ["127.0.0.1:23010"], "worker": ["127.0.0.1:23011", '
                       '"127.0.0.1:23012"]}')
    return cluster


def test_ps_trains_a_queue_runner_pipeline_like_one_device(run_cli, tmp_path):
    # train.batch's queue is input, not a token queue of the workers' barrier: it was refused
    # ("takes 16 token(s) from 'batch/fifo_queue' per step, but the tasks' steps put 0")
    _passes(run_cli, "--strategy", "ps", "--cluster", _cluster_file(tmp_path), "--steps", 3,
            queue_graph(tmp_path / "m.meta"))


@pytest.mark.parametrize("strategy", [["--strategy", "ps", "--cluster"],
                                      ["--strategy", "allreduce", "--replicas"]])
def test_shuffle_batch_is_accepted_and_verify_names_its_racing_threads(run_cli, tmp_path,
                                                                       strategy):
    model = census_graph(tmp_path / "m.meta")
    how = strategy + [_cluster_file(tmp_path) if "ps" in strategy else 2]
    code, _, err = run_cli("apply", *how, model, "-o", tmp_path / "out.meta")
    assert code == 0, err
    ir = metagraph.load(model)
    reasons = " ".join(equivalence.mismatch_reasons(ir, training.analyze(ir)))
    assert "race to fill its queues (shuffle_batch/random_shuffle_queue: a RandomShuffle" \
        in reasons
    batched = metagraph.load(queue_graph(tmp_path / "b.meta"))  # one thread, FIFO: repeats
    assert "race" not in " ".join(equivalence.mismatch_reasons(batched,
                                                               training.analyze(batched)))


def fed_queue_graph(path, queue_runner=False):
    """The TF1 recipe whose own loop fills the queue: `sess.run(enqueue, feed_dict=...)`, then
    the train op, which dequeues a batch (optionally with a QueueRunner of that enqueue)."""
    def build(tf, tf1):
        x = tf1.placeholder(tf.float32, [None, 8], name="x")
        y = tf1.placeholder(tf.int64, [None], name="y")
        queue = tf1.FIFOQueue(256, [tf.float32, tf.int64], shapes=[[8], []], name="input_queue")
        enqueue = queue.enqueue_many([x, y], name="enqueue")
        if queue_runner:
            tf1.train.add_queue_runner(tf1.train.QueueRunner(queue, [enqueue]))
        _model_and_step(tf1, *queue.dequeue_many(16, name="batch"))
    return _export(build, path)


def blocking_graph(path):
    """A step that waits for ever: it puts one example into the queue it takes 4 from."""
    def build(tf, tf1):
        queue = tf1.FIFOQueue(64, [tf.float32, tf.int64], shapes=[[8], []], name="q")
        with tf.control_dependencies([queue.enqueue([tf.ones([8]), tf.constant(1, tf.int64)])]):
            x, y = queue.dequeue_many(4)
        _model_and_step(tf1, x, y)
    return _export(build, path)


@pytest.mark.parametrize("queue_runner", [False, True])
def test_a_queue_the_training_loop_fills_is_refused_by_run_and_verify(run_cli, tmp_path,
                                                                      queue_runner):
    # run and verify hung for ever on it, deaf to SIGTERM; apply keeps it (the user's loop
    # still fills the queue through the placeholders, which keep their names)
    model = fed_queue_graph(tmp_path / "m.meta", queue_runner)
    xs, ys = _examples(64)
    np.savez(tmp_path / "feeds.npz", x=xs, y=ys)
    why = ("its queue runner runs 'enqueue', which needs placeholder 'x' fed" if queue_runner
           else "is filled only by 'enqueue', which a training loop runs with a feed dict")
    for command in (["run", "--steps", 2], ["verify", "--replicas", 2]):
        code, _, err = run_cli(*command, model, "--feeds", tmp_path / "feeds.npz")
        assert code == 1
        assert "cannot run the graph: queue 'input_queue' (read by 'batch')" in err
        assert why in err
        assert len(err.strip().splitlines()) == 1
    assert run_cli("apply", "--replicas", 2, model, "-o", tmp_path / "out.meta")[0] == 0


def test_a_step_that_blocks_stops_at_the_timeout_in_one_line(run_cli, tmp_path):
    code, _, err = run_cli("run", blocking_graph(tmp_path / "m.meta"), "--timeout", 1)
    assert code == 1
    assert "did not finish in 1 s (--timeout), so TensorFlow stopped it" in err
    assert len(err.strip().splitlines()) == 1


def _cpu_time(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/stat"), reason="Linux /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_blocked_run_dies_promptly_on_a_signal_leaving_nothing(tmp_path, sig):
    """A run blocked inside TF heard no signal before (Python runs a handler only back in the
    main thread); now it stops at once, says so in one line, and writes no checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time
    model = blocking_graph(tmp_path / "m.meta")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-m", "graphxform", "run", model, "--save",
                             tmp_path / "ck" / "model"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        before, deadline = -1, time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)  # blocked: its CPU time stands still (importing TF moves it)
            now = _cpu_time(proc.pid)
            if now == before:
                break
            before = now
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + getattr(signal, sig)
    lines = [line for line in err.splitlines() if line.startswith("graphxform")]
    assert lines == ["graphxform: interrupted" if sig == "SIGINT"
                     else "graphxform: stopped by SIGTERM"], err
    assert not (tmp_path / "ck").exists()
