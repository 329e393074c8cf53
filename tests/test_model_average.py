"""Strategy model-average (TF's ModelAverageOptimizer): rounds average the replicas' copies
into centre variables, --interval 1 with SGD is synchronous data parallelism, checkpoints hold
the centres under the original names, and the contract proves the strategy's own invariant;
on one process's devices and on a cluster (centres on the ps tasks, one client per task).

Cluster tests bind 127.0.0.1 ports picked free, bound every wait, and `launch` kills every
process it starts (checked: no pid or port left)."""

import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from conftest import fixture_path, mlp_single_device
from processes import assert_launched_tasks_gone, in_threads

from graphxform import cluster, contract, equivalence, metagraph, strategies, training
from graphxform.errors import GraphxformError
from graphxform.passes.model_average import LOCAL_STEP, centre_name
from graphxform.plan import ClusterPlan
from graphxform.runtime import Feeds, Runner, servers
from graphxform.runtime.task import TaskRunner

v1 = tf.compat.v1
DEVICES = ["/device:CPU:0", "/device:CPU:1"]
TRAINED = ["dense0/bias", "dense0/kernel", "dense1/bias", "dense1/kernel"]


def averaged(interval, model="mlp_sgd", replicas=2):
    ir = metagraph.load(fixture_path(model))
    strategies.transform(ir, "model-average", devices=DEVICES[:replicas] if replicas <= 2 else
                         [f"/device:CPU:{i}" for i in range(replicas)], interval=interval)
    return ir


def session_of(ir):
    """A session on the emitted graph (as a user's import_meta_graph gives), initialised."""
    graph = tf.Graph()
    with graph.as_default():
        v1.train.import_meta_graph(metagraph.to_metagraph(ir))
    config = v1.ConfigProto(device_count={"CPU": 4}, allow_soft_placement=True)
    session = v1.Session(graph=graph, config=config)
    with graph.as_default():
        session.run(v1.global_variables_initializer())
    return session


def feeds(k, batch=16):
    data = np.load(fixture_path("mlp_sgd", ".npz"))
    return {f"{name}:0": data[name][k * batch:(k + 1) * batch] for name in data.files}


def copies(session, var, replicas=2):
    """Every replica's copy of ``var`` now (reads made after the last step)."""
    graph = session.graph
    with graph.as_default():
        return [session.run(v1.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name(f"replica_{i}/{var}:0"), dtype=tf.float32))
                for i in range(replicas)]


def centre(session, var):
    graph = session.graph
    with graph.as_default():
        return session.run(v1.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name(centre_name(var) + ":0"), dtype=tf.float32))


def test_a_round_averages_every_copy_into_the_centre_and_back():
    interval = 3
    session = session_of(averaged(interval))
    start = {var: centre(session, var) for var in TRAINED}
    for var in TRAINED:  # before the first step every local copy equals the centre
        for copy in copies(session, var):
            np.testing.assert_array_equal(copy, start[var])
    for k in range(interval - 1):
        session.run("GradientDescent", feeds(k))
    for var in TRAINED:
        np.testing.assert_array_equal(centre(session, var), start[var])  # no round yet
    assert not np.array_equal(*copies(session, "dense1/kernel"))  # the copies train apart
    pre = [f"model_average/step_0/{var}/read_{i}:0" for var in TRAINED for i in range(2)]
    values = session.run(pre + ["GradientDescent"], feeds(interval - 1))[:-1]
    for j, var in enumerate(TRAINED):
        mean = (values[2 * j] + values[2 * j + 1]) / 2
        np.testing.assert_allclose(centre(session, var), mean, rtol=1e-6, atol=1e-7)
        for copy in copies(session, var):
            np.testing.assert_array_equal(copy, centre(session, var))
    with session.graph.as_default():
        local = session.run(v1.raw_ops.ReadVariableOp(
            resource=session.graph.get_tensor_by_name(LOCAL_STEP + ":0"), dtype=tf.int64))
        rounds = session.run(v1.raw_ops.ReadVariableOp(
            resource=session.graph.get_tensor_by_name("global_step:0"), dtype=tf.int64))
    assert (local, rounds) == (interval, 1)  # global_step counts averaging rounds
    session.close()


def test_interval_1_with_sgd_matches_one_device():
    original = metagraph.load(fixture_path("mlp_sgd"))
    report = equivalence.compare(original, averaged(1), fixture_path("mlp_sgd", ".npz"),
                                 steps=3, batch_size=16, rtol=1e-5)
    assert report.ok, equivalence.format_report(report)


def test_checkpoints_hold_the_centres_under_the_original_names(tmp_path):
    ir = averaged(2)
    session = session_of(ir)
    for k in range(2):
        session.run("GradientDescent", feeds(k))
    expected = {var: centre(session, var) for var in TRAINED}
    prefix = str(tmp_path / "averaged")
    saver_def = ir.meta.saver_def
    session.run(saver_def.save_tensor_name, {saver_def.filename_tensor_name: prefix})
    session.close()
    graph = tf.Graph()  # the single-device graph restores it
    with graph.as_default():
        saver = v1.train.import_meta_graph(fixture_path("mlp_sgd"))
        with v1.Session(graph=graph) as single:
            saver.restore(single, prefix)
            for var in TRAINED:
                got = single.run(graph.get_tensor_by_name(var + "/Read/ReadVariableOp:0"))
                np.testing.assert_array_equal(got, expected[var])
            single_prefix = saver.save(single, str(tmp_path / "single"))
    session = session_of(averaged(2))  # and the reverse sets the centre and every copy
    session.run(saver_def.restore_op_name, {saver_def.filename_tensor_name: single_prefix})
    for var in TRAINED:
        for value in copies(session, var) + [centre(session, var)]:
            np.testing.assert_array_equal(value, expected[var])
    session.close()


def test_contract_refuses_a_centre_that_misses_a_replica():
    ir = averaged(2)
    mean = "model_average/step_0/dense0/bias/sum"
    ir.set_input(mean, 1, "model_average/step_0/dense0/bias/read_0")  # replica 0 twice
    tg = training.analyze(metagraph.load(fixture_path("mlp_sgd")))
    with pytest.raises(contract.ContractError, match=r"dense0/bias.*without replicas \[1\]"):
        contract.check_model_average(ir, tg, 2)


def test_interval_below_one_is_refused():
    with pytest.raises(GraphxformError, match="--interval must be at least 1"):
        averaged(0)


def test_cli_apply_and_verify(run_cli, tmp_path):
    out = str(tmp_path / "mlp.model-average.meta")
    code, text, _ = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "model-average",
                            "--replicas", 2, "--interval", 2, "-o", out)
    assert code == 0, text
    code, text, _ = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "model-average",
                            "--replicas", 2, "--feeds", fixture_path("mlp_sgd", ".npz"),
                            "--steps", 3, "--interval", 1)
    assert code == 0, text
    code, text, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "allreduce",
                              "--replicas", 2, "--interval", 2, "-o", out)
    assert code != 0 and "--interval is an option of --strategy model-average" in text + err


def test_cost_names_the_strategy_and_its_minimum(run_cli):
    code, text, err = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "model-average",
                              "--replicas", 2)
    assert code == 0, text + err
    assert text.startswith("model-average: bytes per averaging round (1 local step)")


# ---------------------------------------------------------------- on a cluster
SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
BATCH = 16


def on_cluster(interval, spec=SPEC, replicas_per_worker=1, model="mlp_sgd"):
    ir = metagraph.load(fixture_path(model))
    found = cluster.Cluster(spec)
    strategies.transform(ir, "model-average", cluster=found, interval=interval,
                         devices=found.worker_devices(replicas_per_worker))
    return ir


def value(runner, name):
    return runner.session.run(runner.graph.get_tensor_by_name(name))


def test_cluster_graph_keeps_centres_on_the_ps_and_each_task_its_step():
    ir = on_cluster(2, replicas_per_worker=2)
    plan = ClusterPlan.from_ir(ir)
    assert plan.strategy == "model-average" and plan.chief == "worker:0"
    assert plan.collective_leader is None
    assert plan.device_filters == {"worker:0": [], "worker:1": ["/job:ps", "/job:worker/task:1"]}
    for var in TRAINED:  # the centre and its accumulator on a ps task, side by side
        device = ir.node(centre_name(var))["device"]
        assert device.startswith("/job:ps/task:")
        assert ir.op(var + "/accumulator") == "ConditionalAccumulator"
        assert ir.node(var + "/accumulator")["device"] == device
        assert ir.attrs(var + "/accumulator")["reduction_type"].s == b"MEAN"
    assert {ir.node(centre_name(v))["device"] for v in TRAINED} == {
        "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"}  # balanced by bytes
    for w in range(2):  # each worker's own local_step and its own step, rounds behind a Switch
        assert ir.node(f"model_average/worker_{w}/local_step")["device"].startswith(
            f"/job:worker/task:{w}/")
        assert ir.op(f"model_average/worker_{w}/switch") == "Switch"
        assert f"model_average/worker_{w}/merge" in ir.control_inputs(plan.steps[f"worker:{w}"])
    assert ir.op("model_average/worker_1/token") == "QueueDequeueV2"
    assert ir.op("model_average/release") == "QueueEnqueueManyV2"
    assert "model_average/worker_0/token" not in ir  # the chief releases, the others wait
    # one client: the original train op runs every task's step
    assert set(plan.steps.values()) <= set(ir.control_inputs("GradientDescent"))


def test_a_round_on_the_cluster_averages_every_workers_copies(tmp_path):
    """2 workers x 2 replicas, each task in its own thread: after interval - 1 steps the copies
    have trained apart and the centres not moved; the next step's round makes every copy and
    the centre the mean of the copies just before it; global_step counts rounds."""
    interval = 3
    ir = on_cluster(interval, replicas_per_worker=2)
    found = servers.local_cluster({"ps": 2, "worker": 2})
    batches = Feeds(training.analyze(ir).inputs, fixture_path("mlp_sgd", ".npz"), BATCH)
    with servers.InProcessCluster(found, cpus={"worker": 2}) as running:
        runners = [TaskRunner(ir, found, "worker", w, timeout_s=30,
                              target=running.target("worker", w)) for w in range(2)]
        chief = runners[0]
        in_threads(lambda r: r.prepare(), runners)
        copy = lambda k, var: value(chief, f"replica_{k}/{var}/Read/ReadVariableOp:0")
        centre_now = lambda var: value(chief, centre_name(var) + "/Read/ReadVariableOp:0")
        start = {var: centre_now(var) for var in TRAINED}
        for var in TRAINED:  # before the first step every local copy equals the centre
            for k in range(4):
                np.testing.assert_array_equal(copy(k, var), start[var])
        in_threads(lambda r: [r.step(batches.batch(s)) for s in range(interval - 1)], runners)
        for var in TRAINED:
            np.testing.assert_array_equal(centre_now(var), start[var])
        assert not np.array_equal(copy(0, "dense1/kernel"), copy(2, "dense1/kernel"))
        # the round's step, fetching each worker's copies as its round reads them
        reads = {var: [f"{var}/local_mean/worker_{k // 2}/read_{k}:0" for k in range(4)]
                 for var in TRAINED}
        own = lambda r: [n for var in TRAINED for n in reads[var] if f"worker_{r.task}/" in n]
        got = in_threads(lambda r: dict(zip(own(r), r.session.run(
            [r.step_op] + own(r), batches.batch(interval - 1))[1:])), runners)
        before = {**got[0], **got[1]}
        for var in TRAINED:
            mean = np.mean([before[n] for n in reads[var]], axis=0)
            np.testing.assert_allclose(centre_now(var), mean, rtol=1e-6, atol=1e-7)
            for k in range(4):
                np.testing.assert_array_equal(copy(k, var), centre_now(var))
        for w in range(2):
            assert value(chief, f"model_average/worker_{w}/local_step/Read/ReadVariableOp:0") \
                == interval
        assert [value(chief, f"replica_{k}/global_step/Read/ReadVariableOp:0")
                for k in range(4)] == [1] * 4  # global_step counts rounds
        for r in runners:
            r.close()


def test_interval_1_on_the_cluster_with_one_client_matches_one_device(run_cli, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SPEC))
    code, out, err = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "model-average",
                             "--cluster", path, "--replicas-per-worker", 2, "--interval", 1,
                             "--feeds", fixture_path("mlp_sgd", ".npz"), "--steps", 3,
                             "--batch-size", BATCH)
    assert code == 0 and "PASS" in out, out + err


def test_launched_tasks_with_interval_1_match_one_device(run_cli, tmp_path):
    """One process per task (`launch`: 2 ps, 2 workers), --interval 1 and SGD: each step's
    mean loss over the workers and the chief's checkpoint, restored into the single-device
    graph under the original names, are those of synchronous data parallelism."""
    steps = 3
    start, losses, values = mlp_single_device(steps, tmp_path, BATCH)
    meta = str(tmp_path / "mlp.model-average.meta")
    metagraph.save(on_cluster(1), meta)
    save = tmp_path / "ckpt" / "model"
    code, out, err = run_cli("launch", meta, "--steps", steps, "--feeds",
                             fixture_path("mlp_sgd", ".npz"), "--batch-size", BATCH,
                             "--restore", start, "--save", save, "--timeout", 60)
    assert code == 0, out + err
    got = [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    assert f"saved {save}-{steps}" in out  # global_step counted 3 rounds
    with Runner(metagraph.load(fixture_path("mlp_sgd"))) as run:
        run.restore(f"{save}-{steps}")
        for name, restored in run.variable_values().items():
            assert restored.shape == values[name].shape
            np.testing.assert_allclose(restored, values[name], rtol=1e-5, atol=1e-6)
    assert_launched_tasks_gone(out)


def test_contract_refuses_a_cluster_centre_that_misses_a_worker():
    ir = on_cluster(2)
    ir.set_input("dense0/bias/accumulator/apply_worker_1", 2,
                 "dense0/bias/local_mean/worker_0/read_0")  # worker 0's copy twice
    tg = training.analyze(metagraph.load(fixture_path("mlp_sgd")))
    with pytest.raises(contract.ContractError, match=r"dense0/bias.*without replicas \[1\]"):
        contract.check_model_average(ir, tg, 2)


def test_cluster_check_and_cost(run_cli, tmp_path):
    """`check` proves the tokens and accumulators of the per-task steps; `cost` counts a round:
    each worker sends its copy to the ps and reads the centre back, the textbook minimum."""
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SPEC))
    out_meta = tmp_path / "out.meta"
    code, text, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "model-average",
                              "--cluster", path, "--interval", 4, "-o", out_meta)
    assert code == 0, text + err
    code, text, err = run_cli("check", out_meta, "--json")
    checks = json.loads(text)["checks"]
    assert code == 0 and checks["accumulators"]["status"] == "ok", text
    assert "2 task step(s) checked" in checks["accumulators"]["summary"]
    code, text, err = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "model-average",
                              "--cluster", path, "--interval", 4, "--batch-size", BATCH, "--json")
    doc = json.loads(text)
    assert code == 0 and doc["per"] == "averaging round (4 local steps)", err
    tasks = {t["name"]: t for t in doc["tasks"]}
    for ps in ("ps:0", "ps:1"):  # W copies in, W centres out, nothing else
        assert tasks[ps]["ratio"] == 1.0 and tasks[ps]["sent"] == tasks[ps]["minimum_sent"]
    assert sum(tasks[ps]["minimum_received"] for ps in ("ps:0", "ps:1")) == 2 * 780
    for var in doc["variables"]:
        if var["name"] != "other":
            assert var["ratio"] == 1.0, var


@pytest.mark.parametrize("args, message", [
    (("--interval", 0), "invalid value for '--interval'"),
    (("--cluster", "NOPS"), "the cluster has no 'ps' job"),
    (("--cluster", "CLUSTER", "--replicas", 2), "use --replicas-per-worker"),
    (("--cluster", "CLUSTER", "--staleness", 2), "--staleness is an option of --strategy ps"),
    (("--replicas", 2, "--sync-batch-norm"), "--sync-batch-norm is an option of"),
])
def test_bad_requests_are_one_line(run_cli, tmp_path, args, message):
    files = {"NOPS": {"worker": SPEC["worker"]}, "CLUSTER": SPEC}
    for name, spec in files.items():
        (tmp_path / name).write_text(json.dumps(spec))
    args = [tmp_path / a if a in files else a for a in args]
    code, text, err = run_cli("apply", fixture_path("mlp_sgd"), "--strategy", "model-average",
                              *args, "-o", tmp_path / "out.meta")
    assert code != 0 and message in err and err.count("\n") == 1, err
    assert "Traceback" not in err


def test_several_train_ops_on_a_cluster_are_refused_in_one_line():
    gan = metagraph.load(os.path.join(os.path.dirname(__file__), "fixtures", "recipes",
                                      "gan_mlp.meta"))
    with pytest.raises(GraphxformError, match="has 2 .*use it without --cluster"):
        strategies.transform(gan, "model-average", cluster=cluster.Cluster(SPEC))
