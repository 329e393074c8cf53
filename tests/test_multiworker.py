"""allreduce across worker processes, and faults on every strategy that runs on a cluster.

- apply: each task's part of the step and its TF configuration are data in the graph;
- verify --cluster (one client) and launch (2 worker processes x 2 replicas on 127.0.0.1) keep
  the drop-in contract against the single-device graph, flat and --hierarchical, and the
  chief's checkpoint restores into the single-device graph;
- a worker killed or frozen, or a ps task frozen, stops every other process within --timeout
  + 10 s with one line naming it, standalone (`serve` + `run --cluster`) and under `launch`,
  leaving no process and no bound port.

Every server binds 127.0.0.1 ports picked free, every wait has a deadline, and every process
a test starts is killed with its process group in a `finally` (a stopped one is continued
first)."""

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

from conftest import fixture_path
from processes import STARTED, assert_launched_tasks_gone, gone, port_free
from graphxform import cluster, metagraph, strategies, training
from graphxform.errors import GraphxformError
from graphxform.passes.worker_steps import replica_devices
from graphxform.plan import ClusterPlan
from graphxform.runtime import servers
from graphxform.runtime.local import Feeds, Runner

RECIPES = os.path.join(os.path.dirname(__file__), "fixtures", "recipes")
WORKERS = {"worker": ["127.0.0.1:2301", "127.0.0.1:2302"]}
BATCH, STEPS = 16, 3
FAULT_TIMEOUT = 6  # --timeout of the fault tests
MODELS = {"mlp": fixture_path("mlp_sgd", ""), "embedding": fixture_path("embedding_adam", ""),
          "cnn": os.path.join(RECIPES, "ref_vars_momentum")}  # a corpus CNN, no batch norm


def allreduce_graph(model: str, spec=WORKERS, hierarchical=False, replicas=2):
    ir = metagraph.load(MODELS[model] + ".meta")
    devices = replica_devices(cluster.Cluster(spec), replicas)
    strategies.transform(ir, "allreduce", devices=devices, cluster=cluster.Cluster(spec),
                         hierarchical=hierarchical)
    return ir


# ---------------------------------------------------------------- the plan (no process)
def test_apply_writes_each_tasks_part_and_configuration():
    ir = allreduce_graph("mlp")
    plan = ClusterPlan.from_ir(ir)
    assert plan.strategy == "allreduce" and plan.chief == "worker:0"
    assert plan.collective_leader == "/job:worker/replica:0/task:0"
    assert plan.device_filters == {"worker:0": [], "worker:1": ["/job:worker/task:1"]}
    assert set(plan.steps) == set(plan.losses) == {"worker:0", "worker:1"}
    step = plan.steps["worker:1"]
    assert sorted(ir.control_inputs(step)) == ["replica_2/GradientDescent",
                                               "replica_3/GradientDescent"]
    assert ir.node(step)["device"] == "/job:worker/task:1/device:CPU:0"
    # global_step is mirrored per replica (no task reads a counter another one moves), and
    # the collection names one copy
    assert {f"replica_{i}/global_step" for i in range(4)} <= set(ir.nodes())
    assert len(ir.meta.collection_def["global_step"].bytes_list.value) == 1
    reduces = ir.nodes_of({"CollectiveReduceV2"})
    assert len(reduces) == 4 and all(ir.attrs(n)["timeout_seconds"].f == 120 for n in reduces)
    # hierarchical: one member per worker, summed inside the worker first
    ir = allreduce_graph("mlp", hierarchical=True)
    reduces = sorted(ir.nodes_of({"CollectiveReduceV2"}))
    assert reduces == ["allreduce/bucket_0/replica_0/reduce", "allreduce/bucket_0/replica_2/reduce"]
    assert ir.op("allreduce/bucket_0/replica_2/local_sum") == "AddN"
    assert ir.input("allreduce/bucket_0/replica_3/broadcast", 0)[0] == \
        "allreduce/bucket_0/replica_2/reduce"


def test_a_chief_job_holds_replicas_and_leads_and_bad_requests_are_refused(run_cli, tmp_path):
    spec = {"chief": ["127.0.0.1:2300"], **WORKERS}
    plan = ClusterPlan.from_ir(allreduce_graph("mlp", spec, replicas=1))
    assert plan.chief == "chief:0" and plan.collective_leader == "/job:chief/replica:0/task:0"
    assert set(plan.steps) == {"chief:0", "worker:0", "worker:1"}
    with pytest.raises(GraphxformError, match="runs on workers only"):
        replica_devices(cluster.Cluster({**WORKERS, "ps": ["127.0.0.1:2303"]}))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(WORKERS))
    model = fixture_path("mlp_sgd")
    for args, message in [
            (("--strategy", "allreduce", "--replicas", "2", "--hierarchical"),
             "--hierarchical is an option of --strategy allreduce with --cluster"),
            (("--strategy", "allreduce", "--cluster", path, "--replicas", "2"),
             "use --replicas-per-worker"),
            (("--strategy", "ps", "--cluster", path, "--hierarchical"),
             "--hierarchical is an option of --strategy allreduce with --cluster")]:
        code, _, err = run_cli("apply", model, *args, "-o", tmp_path / "out.meta")
        assert code == 1 and message in err and err.count("\n") == 1, err
    # several train ops: one client only, refused per task before anything starts
    gan = metagraph.load(os.path.join(RECIPES, "gan_mlp.meta"))
    strategies.transform(gan, "allreduce", cluster=cluster.Cluster(WORKERS))
    metagraph.save(gan, str(tmp_path / "gan.meta"))
    code, _, err = run_cli("launch", tmp_path / "gan.meta")
    assert code == 1 and "has 2 train ops" in err


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_verify_with_one_client_on_the_cluster(run_cli, tmp_path, hierarchical):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(WORKERS))
    code, out, err = run_cli("verify", fixture_path("mlp_sgd"), "--strategy", "allreduce",
                             "--cluster", path, "--replicas-per-worker", 2, "--steps", 3,
                             "--feeds", fixture_path("mlp_sgd", ".npz"), "--batch-size", BATCH,
                             *(["--hierarchical"] if hierarchical else []))
    assert code == 0 and "PASS" in out, out + err


def test_cost_shows_each_workers_link_for_both_variants(run_cli, tmp_path):
    """A flat ring of W x R replicas puts 2(N-1)/N of the gradients on each worker's link; the
    hierarchical one the textbook minimum, 2(W-1)/W."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(WORKERS))
    code, out, err = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "allreduce",
                             "--cluster", path, "--replicas-per-worker", 2, "--batch-size", BATCH,
                             "--json")
    assert code == 0, err
    doc = json.loads(out)
    gradients = 780  # mlp_sgd's trainable bytes (apply: "dense bytes all-reduced")
    assert doc["link_minimum_each_way"] == pytest.approx(2 * (2 - 1) / 2 * gradients)
    links = {link["variant"]: link["tasks"] for link in doc["links"]}
    for task in links["flat"]:
        assert task["sent"] == task["received"] == pytest.approx(2 * 3 / 4 * gradients)
        assert task["ratio"] == 1.5
    assert [t["ratio"] for t in links["hierarchical"]] == [1.0, 1.0]
    code, out, _ = run_cli("cost", fixture_path("mlp_sgd"), "--strategy", "allreduce",
                           "--cluster", path, "--replicas-per-worker", 2, "--hierarchical")
    assert code == 0 and "network link of each worker task per step (hierarchical and flat)" in out


# ---------------------------------------------------------------- processes
def cli(*args):
    return [sys.executable, "-m", "graphxform.cli", *map(str, args)]


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout} s")
        time.sleep(0.1)


class Process:
    """A child in its own process group: its output lines (with times) on a queue, the time it
    exited; killed with its group by ``kill`` (continued first, in case it was stopped)."""

    def __init__(self, argv):
        # a crash inside TF prints the Python stacks (what the failure message shows)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="3",
                   PYTHONFAULTHANDLER="1")
        env.pop("TF_CONFIG", None)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.lines = queue.Queue()
        self.out, self.err = [], []
        self.exited_at = None
        for stream, kind in ((self.proc.stdout, "out"), (self.proc.stderr, "err")):
            threading.Thread(target=self._read, args=(stream, kind), daemon=True).start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _read(self, stream, kind):
        for line in stream:
            line = line.rstrip("\n")
            (self.out if kind == "out" else self.err).append(line)
            self.lines.put((kind, line))

    def _wait(self):
        self.proc.wait()
        self.exited_at = time.monotonic()

    def wait_for_line(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s; "
                             f"out {self.out[-5:]}, err {self.err[-5:]}")

    def errors(self) -> list[str]:
        return [line for line in self.err if line.startswith("graphxform: error:")]

    def kill(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


@contextlib.contextmanager
def processes():
    """A list to start Processes into; all killed (groups, stopped ones continued) at exit."""
    started = []
    try:
        yield started
    finally:
        for p in started:
            p.kill()


def single_device_run(model: str, tmp_path):
    """The original graph's start checkpoint, its losses over STEPS steps and its variables."""
    original = metagraph.load(MODELS[model] + ".meta")
    feeds = Feeds(training.analyze(original).inputs, MODELS[model] + ".npz", BATCH)
    with Runner(original) as run:
        run.initialize()
        start = run.save(str(tmp_path / "start"))
        losses = [run.step(feeds.batch(k)).loss for k in range(STEPS)]
        return start, losses, run.variable_values()


def assert_close(got, want, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.max(np.abs(got - want)) <= rtol * max(np.max(np.abs(want)), 1e-3), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("model, hierarchical", [
    ("mlp", False), ("mlp", True), ("embedding", False), ("embedding", True), ("cnn", False),
    ("cnn", True)])
def test_launched_workers_keep_the_contract(run_cli, tmp_path, model, hierarchical):
    """2 worker processes x 2 replicas: each step's mean loss over workers is the single-device
    loss, and the chief's checkpoint restores into the single-device graph with its values."""
    start, losses, values = single_device_run(model, tmp_path)
    meta = str(tmp_path / "model.allreduce.meta")
    metagraph.save(allreduce_graph(model, hierarchical=hierarchical), meta)
    save = tmp_path / "ckpt" / "model"
    code, out, err = run_cli("launch", meta, "--steps", STEPS, "--feeds", MODELS[model] + ".npz",
                             "--batch-size", BATCH, "--restore", start, "--save", save,
                             "--timeout", 60)
    assert code == 0, out + err
    assert_close([float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)], losses)
    assert f"saved {save}-{STEPS}" in out
    with Runner(metagraph.load(MODELS[model] + ".meta")) as run:
        run.restore(f"{save}-{STEPS}")
        for name, value in run.variable_values().items():
            assert_close(value, values[name])
    assert_launched_tasks_gone(out)


# ---------------------------------------------------------------- faults
FAULT_CLUSTERS = {"ps": {"ps": 1, "worker": 2}, "allreduce": {"worker": 2}}
FAULTS = [("ps", "worker", "SIGKILL"), ("ps", "worker", "SIGSTOP"), ("ps", "ps", "SIGSTOP"),
          ("allreduce", "worker", "SIGKILL"), ("allreduce", "worker", "SIGSTOP")]


@pytest.fixture(scope="module")
def fault_graphs(tmp_path_factory):
    """mlp_sgd for 2 workers x 2 replicas: with one ps task, and with allreduce."""
    tmp = tmp_path_factory.mktemp("faults")
    paths = {}
    for strategy, sizes in FAULT_CLUSTERS.items():
        spec = servers.local_cluster(sizes)
        ir = metagraph.load(fixture_path("mlp_sgd"))
        strategies.transform(ir, strategy, cluster=spec,
                             devices=(replica_devices(spec, 2) if strategy == "allreduce"
                                      else spec.worker_devices(2)))
        paths[strategy] = str(tmp / f"mlp.{strategy}.meta")
        metagraph.save(ir, paths[strategy])
    return paths


def task_argv(meta, cluster_file, job, task):
    where = ["--cluster", cluster_file, "--job", job, "--task", task,
             "--timeout", FAULT_TIMEOUT]
    if job == "ps":
        return cli("serve", *where)
    return cli("run", meta, *where, "--steps", 1_000_000, "--feeds",
               fixture_path("mlp_sgd", ".npz"), "--batch-size", BATCH)


def assert_one_line_naming(process: Process, victim: str) -> None:
    errors = process.errors()
    assert len(errors) == 1 and victim in errors[0], (victim, process.err[-5:])


@pytest.mark.slow
@pytest.mark.parametrize("strategy, victim_job, signame", FAULTS)
def test_standalone_tasks_stop_when_a_peer_dies_or_freezes(fault_graphs, tmp_path, strategy,
                                                          victim_job, signame):
    """`serve` + `run --cluster`, one process per task: every other process exits within
    --timeout + 10 s with one line naming the task, leaving no bound port."""
    found = servers.local_cluster(FAULT_CLUSTERS[strategy])
    cluster_file = servers.write_cluster(str(tmp_path / "cluster.json"), found)
    order = sorted(((j, t) for j, ts in found.jobs.items() for t in range(len(ts))),
                   key=lambda jt: (jt[0] != "ps", jt))
    victim = (victim_job, 1 if victim_job == "worker" else 0)
    with processes() as started:
        tasks = {}
        for job, task in order:
            tasks[(job, task)] = Process(task_argv(fault_graphs[strategy], cluster_file, job,
                                                   task))
            started.append(tasks[(job, task)])
        tasks[("worker", 0)].wait_for_line(r"^step 3  loss", 120)
        os.kill(tasks[victim].pid, getattr(signal, signame))
        faulted = time.monotonic()
        others = [p for key, p in tasks.items() if key != victim]
        limit = FAULT_TIMEOUT + 10
        wait_until(lambda: all(p.exited_at for p in others), limit + 5, "others still running")
        name = servers.describe(found, *victim)
        for p in others:
            assert p.exited_at - faulted <= limit and p.proc.returncode == 1, (
                p.proc.returncode, p.err[-12:])
            assert_one_line_naming(p, name)
    for p in tasks.values():
        wait_until(lambda: gone(p.pid), 10, f"pid {p.pid} left behind")
    for address in [a for ts in found.jobs.values() for a in ts]:
        wait_until(lambda: port_free(servers.port_of(address)), 10, f"{address} still bound")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, victim_job, signame", FAULTS)
def test_launch_stops_when_a_task_dies_or_freezes(fault_graphs, strategy, victim_job, signame):
    """Under launch (run here, in the test's main thread, as the CLI runs it) the tasks find the
    fault themselves; the launcher's own watchdog would wait --timeout + 60 s. It fails within
    --timeout + 10 s with one line naming the task, and no child or port is left."""
    from graphxform.runtime.launch import Launch
    from graphxform.runtime.task import plan_of
    meta = fault_graphs[strategy]
    lines = queue.Queue()
    launch = Launch(meta, plan_of(metagraph.load(meta)), steps=1_000_000,
                    feeds=fixture_path("mlp_sgd", ".npz"), batch_size=BATCH,
                    timeout_s=FAULT_TIMEOUT, echo=lines.put, warn=lambda text: None)
    victim = (victim_job, 1 if victim_job == "worker" else 0)
    children, fault = {}, {}

    def saboteur():
        """Strike once step 3 is done; on any trouble stop the launch (it unwinds on SIGTERM)."""
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    line = lines.get(timeout=0.2)
                    match = STARTED.match(line)
                    if match:
                        children[(match.group(1), int(match.group(2)))] = (
                            int(match.group(3)), int(match.group(4)))
                    elif line.startswith("step 3 "):
                        fault["pid"] = children[victim][1]
                        os.kill(fault["pid"], getattr(signal, signame))
                        fault["at"] = time.monotonic()
                        return
        except Exception as e:  # noqa: BLE001 - reported by the test below
            fault["error"] = e
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=saboteur, daemon=True)
    thread.start()
    try:
        with pytest.raises(GraphxformError) as failed:
            launch.run()
        stopped = time.monotonic()
    finally:
        thread.join(timeout=130)
        with contextlib.suppress(ProcessLookupError, KeyError):
            os.kill(fault["pid"], signal.SIGCONT)
            os.kill(fault["pid"], signal.SIGKILL)
    assert "at" in fault, fault
    assert stopped - fault["at"] <= FAULT_TIMEOUT + 10
    port = children[victim][0]
    message = str(failed.value)
    assert "\n" not in message and f"{victim[0]} {victim[1]} (127.0.0.1:{port})" in message, message
    for port, pid in children.values():
        wait_until(lambda: gone(pid), 10, f"pid {pid} left behind")
        wait_until(lambda: port_free(port), 10, f"port {port} still bound")
