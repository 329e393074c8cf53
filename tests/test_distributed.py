"""The ps runtime on TensorFlow's gRPC servers: the cluster plan, one task's session (in-process
servers, one thread per task), `serve`, `run --cluster`, `launch`, faults, atomic checkpoints.

Every address is 127.0.0.1 (TF's server itself listens on 0.0.0.0), every wait is bounded and
every process a test starts is killed, with its process group, in a `finally`."""

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import fixture_path, mlp_single_device
from processes import STARTED, gone, in_threads, port_free
from graphxform import cluster, metagraph, strategies, training
from graphxform.plan import CLUSTER_COLLECTION, ClusterPlan
from graphxform.runtime import servers
from graphxform.errors import GraphxformError
from graphxform.runtime import Feeds, Runner
from graphxform.runtime.task import TaskRunner

SPEC = {"ps": ["127.0.0.1:2222", "127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"]}
STEPS, BATCH = 5, 16


def ps_graph(spec=SPEC):
    ir = metagraph.load(fixture_path("mlp_sgd"))
    strategies.transform(ir, "ps", cluster=cluster.Cluster(spec))
    return ir


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """mlp_sgd as a ps graph (2 ps, 2 workers), a start checkpoint of the original, and the
    original's losses and variables after STEPS steps from it."""
    tmp = tmp_path_factory.mktemp("distributed")
    ir = ps_graph()
    meta = str(tmp / "mlp.ps.meta")
    metagraph.save(ir, meta)
    start, losses, values = mlp_single_device(STEPS, tmp, BATCH)
    return {"dir": tmp, "ir": ir, "meta": meta, "start": start, "losses": losses,
            "values": values}


def assert_close(got, want, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rtol * max(np.max(np.abs(want)), 1e-12), (got, want)


def run_tasks(runners, feeds, steps, restore=None):
    """Each task's prepare and steps in its own thread (the chief blocks on the others'
    gradients); returns {task name: losses}."""
    def work(r):
        r.prepare(restore if r.chief else None)
        return [r.step(feeds.batch(k))[0] for k in range(steps)]
    return dict(zip((r.name for r in runners), in_threads(work, runners)))


@contextlib.contextmanager
def process(argv, env=None):
    """A child in its own process group, its output lines on a queue; killed (group) at exit."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines = queue.Queue()
    for stream, kind in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=lambda s=stream, k=kind: [lines.put((k, l.rstrip("\n")))
                                                          for l in s], daemon=True).start()
    try:
        yield proc, lines
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_for_line(lines, pattern, timeout, seen=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kind, line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if seen is not None:
            seen.append((kind, line))
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r} within {timeout} s: {seen}")


def cli(*args):
    return [sys.executable, "-m", "graphxform.cli", *map(str, args)]


# ---------------------------------------------------------------- plan, addresses, configs
def test_cluster_plan_round_trip_and_bad_plans(built):
    plan = ClusterPlan.from_ir(built["ir"])
    assert plan.cluster == SPEC and plan.chief == "worker:0" and not plan.is_async
    assert set(plan.steps) == set(plan.losses) == {"worker:0", "worker:1"}
    assert plan.step_of("worker", 1) == plan.steps["worker:1"]
    assert ClusterPlan.from_json(plan.to_json()) == plan
    meta = metagraph.to_metagraph(built["ir"])
    plan.write_to(meta)
    assert len(meta.collection_def[CLUSTER_COLLECTION].bytes_list.value) == 1
    assert ClusterPlan.from_ir(metagraph.load(fixture_path("mlp_sgd"))) is None
    with pytest.raises(GraphxformError, match="not valid JSON"):
        ClusterPlan.from_json("{nope")
    with pytest.raises(GraphxformError, match="has no 'steps'"):
        ClusterPlan.from_json(json.dumps({"cluster": SPEC}))
    with pytest.raises(GraphxformError, match="job 'ps' has no tasks"):
        ClusterPlan.from_json(json.dumps({"cluster": {**SPEC, "ps": []},
                                          "steps": {"worker:0": "s"}}))
    with pytest.raises(GraphxformError, match="chief 'chief:0' has no step op"):
        ClusterPlan.from_json(json.dumps({"cluster": SPEC, "steps": {"worker:0": "s"},
                                          "chief": "chief:0"}))
    with pytest.raises(GraphxformError, match="ps 0 has no part in the training step"):
        plan.step_of("ps", 0)
    with pytest.raises(GraphxformError, match="has 1 ps, 2 worker tasks but the graph was built "
                                              "for 2 ps, 2 worker"):
        plan.check_cluster(cluster.Cluster({**SPEC, "ps": SPEC["ps"][:1]}))


def test_local_cluster_files_and_session_configs(tmp_path):
    found = servers.local_cluster({"ps": 2, "worker": 2})
    addresses = found.tasks("ps") + found.tasks("worker")
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    assert len({servers.port_of(a) for a in addresses}) == 4
    path = servers.write_cluster(str(tmp_path / "c.json"), found)
    assert cluster.load_cluster(path)[0].as_dict() == found.as_dict()
    with pytest.raises(GraphxformError, match="at least one ps task"):
        servers.local_cluster({"ps": 0, "worker": 1})
    assert servers.grpc_target("localhost:5") == "grpc://127.0.0.1:5"
    plan = ClusterPlan(cluster=SPEC, steps={"worker:0": "a", "worker:1": "b"}, losses={})
    worker = servers.session_config(plan.filters_of("worker", 1), timeout_s=7)
    assert list(worker.device_filters) == ["/job:ps", "/job:worker/task:1"]
    assert worker.operation_timeout_in_ms == 7000 and not worker.isolate_session_state
    assert not servers.session_config(plan.filters_of("worker", 0)).device_filters
    assert not worker.experimental.collective_group_leader
    leader = "/job:worker/replica:0/task:0"
    assert servers.server_config(2, leader).experimental.collective_group_leader == leader
    assert "GRPC_FAIL_FAST" in os.environ  # set before any RPC (unless the user set it)


def test_a_worker_sees_only_the_ps_tasks_and_itself(built):
    meta = metagraph.to_metagraph(built["ir"])
    plan = ClusterPlan.from_ir(built["ir"])
    assert servers.visible_to(meta.graph_def, plan.filters_of("worker", 1))
    devices = {n.device for n in meta.graph_def.node if n.device}
    assert not any(d.startswith("/job:worker/task:0") for d in devices)
    assert any(d.startswith("/job:worker/task:1") for d in devices)
    assert any(d.startswith("/job:ps/task:1") for d in devices)


# ---------------------------------------------------------------- in-process servers
def test_tasks_on_in_process_servers_match_single_device_and_save_atomically(built, tmp_path):
    ir = built["ir"]
    found = servers.local_cluster({"ps": 2, "worker": 2})
    feeds = Feeds(training.analyze(ir).inputs, fixture_path("mlp_sgd", ".npz"), BATCH)
    with servers.InProcessCluster(found) as running:
        runners = [TaskRunner(ir, found, "worker", i, timeout_s=30,
                              target=running.target("worker", i)) for i in range(2)]
        losses = run_tasks(runners, feeds, STEPS, restore=built["start"])
        chief = runners[0]
        assert chief.chief and not runners[1].chief
        mean = np.mean([losses[r.name] for r in runners], axis=0)
        assert_close(mean, built["losses"])
        prefix = str(tmp_path / "ckpt" / "model")
        assert chief.save(prefix) == f"{prefix}-{STEPS}"
        # a save that dies after writing its data but before its index is in place (the index
        # path is taken by a directory) leaves the previous latest checkpoint in place
        with chief.graph.as_default():
            bump = chief.global_step.assign_add(1)
        chief.session.run(bump)
        os.makedirs(f"{prefix}-{STEPS + 1}.index")
        with pytest.raises(GraphxformError, match=f"cannot save checkpoint {prefix}-{STEPS + 1}"):
            chief.save(prefix)
        for r in runners:
            r.close()
    import tensorflow as tf
    assert tf.train.latest_checkpoint(str(tmp_path / "ckpt")) == f"{prefix}-{STEPS}"
    with Runner(metagraph.load(fixture_path("mlp_sgd"))) as run:
        run.restore(f"{prefix}-{STEPS}")
        for name, value in run.variable_values().items():
            assert_close(value, built["values"][name])


def test_a_lone_task_fails_within_its_timeout_naming_what_it_waited_for(built):
    ir = built["ir"]
    found = servers.local_cluster({"ps": 2, "worker": 2})
    feeds = Feeds(training.analyze(ir).inputs, fixture_path("mlp_sgd", ".npz"), BATCH)
    with servers.InProcessCluster(found) as running:
        worker = TaskRunner(ir, found, "worker", 1, timeout_s=1,
                            target=running.target("worker", 1))
        t0 = time.monotonic()
        with pytest.raises(GraphxformError, match=r"worker 1 \(127.0.0.1:\d+\): the chief "
                                                  r"\(worker 0\) has not initialised"):
            worker.prepare()
        chief = TaskRunner(ir, found, "worker", 0, timeout_s=1,
                           target=running.target("worker", 0))
        chief.prepare()
        worker.prepare()
        with pytest.raises(GraphxformError, match="step 1 timed out after 1 s"):
            worker.step(feeds.batch(0))  # nobody takes its gradient or hands it a token
        assert time.monotonic() - t0 < 20
        with pytest.raises(GraphxformError, match="does not divide evenly"):
            chief.step({k: v[:3] for k, v in feeds.batch(0).items()})
        worker.close()
        chief.close()


RECIPES = os.path.join(os.path.dirname(__file__), "fixtures", "recipes")


@pytest.mark.parametrize("recipe, train_op", [
    ("ema_weights", "train_op"),  # an ExponentialMovingAverage of the weights after the step
    ("clip_schedule_mlp", None),  # clip_by_global_norm between the gradients and the update
    ("losses_regularized", None),
])
def test_each_task_runs_its_part_of_a_recipe_like_a_single_device(tmp_path, recipe, train_op):
    """The per-task plan on graphs whose update region goes beyond the optimizer: each worker
    in its own thread, every wait bounded, the mean of the workers' losses and the variables
    after the steps as on one device."""
    path = os.path.join(RECIPES, recipe)
    original = metagraph.load(path + ".meta")
    feeds = Feeds(training.analyze(original, train_op=train_op).inputs, path + ".npz", BATCH)
    with Runner(original, train_op=train_op) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        losses = [run.step(feeds.batch(k)).loss for k in range(3)]
        values = run.variable_values()
    ir = metagraph.load(path + ".meta")
    strategies.transform(ir, "ps", cluster=cluster.Cluster(SPEC), train_op=train_op)
    found = servers.local_cluster({"ps": 2, "worker": 2})
    with servers.InProcessCluster(found) as running:
        runners = [TaskRunner(ir, found, "worker", i, timeout_s=30,
                              target=running.target("worker", i)) for i in range(2)]
        got = run_tasks(runners, feeds, 3, restore=start)
        saved = runners[0].save(str(tmp_path / "after"))
        for r in runners:
            r.close()
    assert_close(np.mean([got[r.name] for r in runners], axis=0), losses)
    with Runner(metagraph.load(path + ".meta"), train_op=train_op) as run:
        run.restore(saved)
        for name, value in run.variable_values().items():
            assert_close(value, values[name])


def test_a_tf_error_without_words_is_named_by_its_type():
    import tensorflow as tf
    from graphxform.errors import tf_error_line as tf_message
    assert tf_message(tf.errors.DeadlineExceededError(None, None, "")) == "DeadlineExceededError"


def test_a_cluster_with_a_chief_job(tmp_path):
    spec = {**SPEC, "chief": ["127.0.0.1:2226"]}
    ir = ps_graph(spec)
    found = servers.local_cluster({"ps": 2, "worker": 2, "chief": 1})
    feeds = Feeds(training.analyze(ir).inputs, fixture_path("mlp_sgd", ".npz"), BATCH)
    with servers.InProcessCluster(found) as running:
        runners = [TaskRunner(ir, found, job, task, timeout_s=30, target=running.target(job, task))
                   for job, task in (("chief", 0), ("worker", 0), ("worker", 1))]
        losses = run_tasks(runners, feeds, 2)
        assert runners[0].chief and losses[runners[0].name] == [None, None]
        assert all(np.isfinite(losses[r.name]).all() for r in runners[1:])
        for r in runners:
            r.close()


# ---------------------------------------------------------------- CLI errors (one line)
@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"ps": [], "worker": ["127.0.0.1:1"]}', "job 'ps' has no tasks"),
    ('{"worker": ["127.0.0.1:1"]}', "the cluster has no job 'ps'"),
])
def test_serve_bad_cluster_is_one_line(run_cli, tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(content)
    code, out, err = run_cli("serve", "--cluster", path, "--job", "ps", "--task", 0)
    assert code == 1 and message in err and err.count("\n") == 1, err


def test_tf_config_naming_a_missing_task_or_none(run_cli, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC,
                                                "task": {"type": "ps", "index": 3}}))
    code, _, err = run_cli("serve")
    assert code == 1 and "TF_CONFIG: job 'ps' has no task 3" in err and err.count("\n") == 1
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC}))
    code, _, err = run_cli("serve")
    assert code == 1 and "give --job and --task" in err


def test_run_and_launch_refuse_what_cannot_run(run_cli, built, tmp_path, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"ps": ["127.0.0.1:1"], "worker": SPEC["worker"]}))
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps({**SPEC, "ps": ["10.0.0.1:2222", "127.0.0.1:2223"]}))
    full = tmp_path / "full.json"
    full.write_text(json.dumps(SPEC))
    cases = [
        (("run", built["meta"]), "was built for a cluster: give --cluster"),
        (("run", built["meta"], "--cluster", small, "--job", "worker", "--task", 0),
         "the cluster has 1 ps, 2 worker tasks but the graph was built for 2 ps, 2 worker"),
        (("run", built["meta"], "--cluster", full, "--job", "worker", "--task", 2),
         "job 'worker' has no task 2"),
        (("run", built["meta"], "--cluster", full, "--job", "ps", "--task", 0),
         "ps 0 has no part in the training step"),
        (("run", fixture_path("mlp_sgd"), "--cluster", full, "--job", "worker"),
         "was not built for a cluster"),
        (("launch", built["meta"], "--cluster", remote), "ps 0 (10.0.0.1:2222) is not on "
                                                         "127.0.0.1"),
        (("launch", built["meta"], "--cluster", small), "built for 2 ps, 2 worker"),
        (("launch", fixture_path("mlp_sgd")), "was not built for a cluster"),
    ]
    for args, message in cases:
        code, _, err = run_cli(*args)
        assert code == 1 and message in err and err.count("\n") == 1, (args, err)
        assert "Traceback" not in err


# ---------------------------------------------------------------- processes
def test_serve_from_tf_config_blocks_until_sigterm(tmp_path):
    found = servers.local_cluster({"ps": 1, "worker": 1})
    port = servers.port_of(found.tasks("ps")[0])
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": found.as_dict(),
                                                 "task": {"type": "ps", "index": 0}}))
    with process(cli("serve"), env) as (proc, lines):
        line = wait_for_line(lines, r"serving", 60)
        assert line == f"serving ps 0 (127.0.0.1:{port}) at grpc://127.0.0.1:{port}"
        assert servers.reachable(f"127.0.0.1:{port}") and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    assert port_free(port)


@pytest.mark.slow
def test_serve_outlives_a_run_that_finished(tmp_path):
    """Workers that end their run normally say so first: the ps task keeps serving after they
    are gone, until SIGTERM."""
    found = servers.local_cluster({"ps": 1, "worker": 2})
    meta = str(tmp_path / "mlp.ps.meta")
    metagraph.save(ps_graph(found.as_dict()), meta)
    cluster_file = servers.write_cluster(str(tmp_path / "cluster.json"), found)
    where = lambda job, task: ["--cluster", cluster_file, "--job", job, "--task", task,
                               "--timeout", 10]
    with process(cli("serve", *where("ps", 0))) as (ps, ps_lines):
        wait_for_line(ps_lines, r"serving", 60)
        with process(cli("run", meta, *where("worker", 0), "--steps", 3)) as (w0, _), \
                process(cli("run", meta, *where("worker", 1), "--steps", 3)) as (w1, _):
            assert w0.wait(timeout=120) == 0 and w1.wait(timeout=60) == 0
        time.sleep(3)  # several rounds of the ps task's watch with both workers gone
        assert ps.poll() is None
        ps.send_signal(signal.SIGTERM)
        assert ps.wait(timeout=20) == 0
    for address in found.tasks("ps") + found.tasks("worker"):
        assert port_free(servers.port_of(address))


@pytest.mark.slow
def test_a_users_own_session_on_servers_started_for_an_allreduce_graph(built, tmp_path):
    """`serve --graph` takes the server's CPU devices and collective group leader from the
    graph; the user's own plain session on the chief then runs the original train op across
    both workers like one device, and the servers, never told a run started, just serve."""
    import tensorflow as tf
    from graphxform.passes.worker_steps import replica_devices
    found = servers.local_cluster({"worker": 2})
    ir = metagraph.load(fixture_path("mlp_sgd"))
    strategies.transform(ir, "allreduce", cluster=found, devices=replica_devices(found, 2))
    meta = str(tmp_path / "mlp.allreduce.meta")
    metagraph.save(ir, meta)
    cluster_file = servers.write_cluster(str(tmp_path / "cluster.json"), found)
    serve = lambda task: cli("serve", "--cluster", cluster_file, "--job", "worker", "--task",
                             task, "--graph", meta, "--timeout", 5)
    feeds = Feeds(training.analyze(ir).inputs, fixture_path("mlp_sgd", ".npz"), BATCH)
    with process(serve(0)) as (chief, chief_lines), process(serve(1)) as (worker, lines):
        wait_for_line(chief_lines, r"serving", 60)
        wait_for_line(lines, r"serving", 60)
        target = servers.grpc_target(found.tasks("worker")[0])
        with Runner(ir, target=target, config=tf.compat.v1.ConfigProto()) as run:
            run.restore(built["start"])
            losses = [run.step(feeds.batch(k)).loss for k in range(STEPS)]
        assert_close(losses, built["losses"])
        time.sleep(2)  # the servers' watch saw no run start: no error
        assert chief.poll() is None and worker.poll() is None
        for proc in (worker, chief):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0


def test_launch_trains_like_a_single_device_and_leaves_nothing(run_cli, built):
    save = built["dir"] / "launched" / "model"
    code, out, err = run_cli("launch", built["meta"], "--steps", STEPS, "--feeds",
                             fixture_path("mlp_sgd", ".npz"), "--batch-size", BATCH,
                             "--restore", built["start"], "--save", save, "--timeout", 30)
    assert code == 0, out + err
    started = STARTED.findall(out)
    assert sorted((job, task) for job, task, _, _ in started) == [
        ("ps", "0"), ("ps", "1"), ("worker", "0"), ("worker", "1")]
    losses = [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]
    assert len(losses) == STEPS
    assert_close(losses, built["losses"])
    assert f"saved {save}-{STEPS}" in out
    with Runner(metagraph.load(fixture_path("mlp_sgd"))) as run:
        run.restore(f"{save}-{STEPS}")
        for name, value in run.variable_values().items():
            assert_close(value, built["values"][name])
    for _, _, port, pid in started:
        assert gone(int(pid)), f"pid {pid} left behind"
        assert port_free(int(port)), f"port {port} still bound"


@pytest.mark.slow
def test_launch_stops_with_a_clear_error_when_a_worker_dies(built):
    seen = []
    with process(cli("launch", built["meta"], "--steps", 1_000_000, "--feeds",
                     fixture_path("mlp_sgd", ".npz"), "--batch-size", BATCH,
                     "--timeout", 30)) as (proc, lines):
        started = {}
        while len(started) < 4:
            match = STARTED.match(wait_for_line(lines, STARTED.pattern, 60, seen))
            started[(match.group(1), int(match.group(2)))] = (match.group(3), int(match.group(4)))
        wait_for_line(lines, r"^step 2  loss", 90, seen)
        port, pid = started[("worker", 1)]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - killed
        error = wait_for_line(lines, r"^graphxform: error:", 5, seen)
    assert code == 1 and elapsed < 60
    assert error == (f"graphxform: error: worker 1 (127.0.0.1:{port}) stopped: exit code -9 "
                     "(SIGKILL)")
    for port, pid in started.values():
        assert gone(pid), f"pid {pid} left behind"
        assert port_free(int(port)), f"port {port} still bound"
