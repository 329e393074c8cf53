"""Clusters on TensorFlow's own gRPC runtime: free local ports, cluster files, the servers of a
cluster started in this process, and the ConfigProto a task's server and session use (the plan
each task runs is graphxform/plan.py's data).

TensorFlow's gRPC server always listens on 0.0.0.0:PORT (hard-coded in grpc_server_lib.cc);
every address graphxform writes or connects to is 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time

from graphxform.cluster import Cluster
from graphxform.errors import GraphxformError

LOCALHOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0
LOCAL_TIMEOUT_S = 600.0  # one session.run of a local Runner (a step of a large model on CPUs)


# ---------------------------------------------------------------- addresses and files
def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (the kernel picks them; all held until all are picked)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOCALHOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def local_cluster(sizes: dict) -> Cluster:
    """A cluster of the given job sizes ({"ps": 2, "worker": 2}) on free 127.0.0.1 ports."""
    if sizes.get("ps", 1) < 1:
        raise GraphxformError("a cluster needs at least one ps task")
    ports = iter(free_ports(sum(sizes.values())))
    return Cluster({job: [f"{LOCALHOST}:{next(ports)}" for _ in range(n)]
                    for job, n in sizes.items()}, source="local cluster")


def write_cluster(path: str, cluster: Cluster | dict) -> str:
    """Write a ClusterSpec JSON file (atomically); returns the path."""
    import os
    jobs = cluster.as_dict() if isinstance(cluster, Cluster) else cluster
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(jobs, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    return path


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def grpc_target(address: str) -> str:
    """The session target for a task: always 127.0.0.1 for a local host name."""
    host, port = address.rsplit(":", 1)
    if host in ("localhost", "0.0.0.0", "[::]", "::"):
        host = LOCALHOST
    return f"grpc://{host}:{port}"


def describe(cluster: Cluster, job: str, task: int) -> str:
    """'worker 1 (127.0.0.1:2223)': how errors name a task."""
    tasks = cluster.tasks(job)
    where = f" ({tasks[task]})" if 0 <= task < len(tasks) else ""
    return f"{job} {task}{where}"


def reachable(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    if host == "localhost":
        host = LOCALHOST
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def wait_for_tasks(cluster: Cluster, tasks, timeout: float) -> None:
    """Wait until every (job, task) accepts connections; a one-line error naming the first that
    does not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    pending = list(tasks)
    while pending:
        pending = [(j, t) for j, t in pending if not reachable(cluster.tasks(j)[t], 0.5)]
        if not pending:
            return
        if time.monotonic() > deadline:
            job, task = pending[0]
            raise GraphxformError(f"{describe(cluster, job, task)} is not reachable after "
                                  f"{timeout:g} s (is its `graphxform serve` running?)")
        time.sleep(0.1)


def unreachable_tasks(cluster: Cluster, tasks=None) -> list[tuple[str, int]]:
    tasks = tasks if tasks is not None else [(j, t) for j, ts in cluster.jobs.items()
                                             for t in range(len(ts))]
    return [(j, t) for j, t in tasks if not reachable(cluster.tasks(j)[t], 0.5)]


# ---------------------------------------------------------------- TF configuration
def server_config(cpus: int = 1, collective_leader: str | None = None, threads=(0, 0)):
    """ConfigProto for a task's server: the local CPU devices its replicas are placed on, the
    collective group leader when the graph's step runs collectives across tasks (the server's
    collective executor resolves groups and step ids through it), and its (inter-op,
    intra-op) thread pools (0: TF's choice), which run every op placed on the task."""
    import tensorflow as tf
    config = tf.compat.v1.ConfigProto(device_count={"CPU": max(1, cpus)},
                                      inter_op_parallelism_threads=threads[0],
                                      intra_op_parallelism_threads=threads[1])
    if collective_leader:
        config.experimental.collective_group_leader = collective_leader
    return config


def session_config(device_filters=(), timeout_s: float = DEFAULT_TIMEOUT_S, threads: int = 0,
                   collective_leader: str | None = None):
    """ConfigProto for a task's session.

    - device_filters (the plan's, graphxform.plan.ClusterPlan.filters_of): what the session
      may see; a ps worker sees the ps jobs and itself, an allreduce worker only itself, so a
      dead peer worker cannot stall its session; the chief sees every task, since it
      initialises every variable. A distributed session places the whole graph (it ignores
      place_pruned_graph) and soft placement does not move ops off a hidden task, so a task
      imports the graph through ``visible_to`` first.
    - operation_timeout_in_ms: every blocking op (a queue dequeue, an accumulator's take_grad,
      a RecvTensor from a dead task) fails after ``timeout_s`` instead of waiting forever.
    - isolate_session_state stays False: every task's session must share the variables,
      accumulators and token queue on the ps tasks, and the chief initialises the workers'
      variables for them."""
    import tensorflow as tf
    fail_fast()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads,
                                      intra_op_parallelism_threads=threads)
    config.device_filters.extend(device_filters)
    config.operation_timeout_in_ms = max(1, int(timeout_s * 1000))
    config.isolate_session_state = False
    if collective_leader:
        config.experimental.collective_group_leader = collective_leader
    return config


def fail_fast() -> None:
    """Make TF's gRPC calls fail at once on a task that is gone (UNAVAILABLE) instead of
    waiting for it to come back, which no op timeout bounds. TF reads GRPC_FAIL_FAST once, at
    its first RPC, so this runs before any server or session exists (a value the user set
    wins). Starting tasks in any order still works: sessions wait for their peers' ports
    first (wait_for_tasks)."""
    os.environ.setdefault("GRPC_FAIL_FAST", "true")


def start_server(cluster: Cluster, job: str, task: int, cpus: int = 1,
                 collective_leader: str | None = None, threads=(0, 0)):
    """Start this task's tf.distribute.Server (it listens on 0.0.0.0:PORT)."""
    import tensorflow as tf
    fail_fast()
    cluster.require(job, task)
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(cluster.as_dict()), job_name=job,
                                    task_index=task, protocol="grpc",
                                    config=server_config(cpus, collective_leader, threads),
                                    start=True)
    except (tf.errors.OpError, ValueError, RuntimeError) as e:
        text = (getattr(e, "message", None) or str(e)).strip().splitlines()
        raise GraphxformError(f"cannot start the server of {describe(cluster, job, task)}: "
                              f"{text[0] if text else type(e).__name__}") from None


_TASK_IN_DEVICE = re.compile(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+)")


def sees(device_filters, job: str, task: int) -> bool:
    """Whether a session with these filters sees task ``job:task`` (no filter: every task)."""
    if not device_filters:
        return True
    for spec in device_filters:
        match = re.fullmatch(r"/job:([^/]+)(?:/replica:\d+)?(?:/task:(\d+))?", spec)
        if match and match.group(1) == job and (match.group(2) is None
                                                 or int(match.group(2)) == task):
            return True
    return False


def visible_to(graph_def, device_filters) -> set:
    """Clear the device of every node placed on a task ``device_filters`` hide, in place: the
    task never runs those ops, and a distributed session must place every node of the graph
    on a device it can see. Returns the names of the nodes cleared."""
    cleared = set()
    for node in graph_def.node:
        match = _TASK_IN_DEVICE.search(node.device)
        if match and not sees(device_filters, match.group(1), int(match.group(2))):
            node.device = ""
            cleared.add(node.name)
    return cleared


# ---------------------------------------------------------------- news of a run, for ps tasks
NEWS_QUEUE = "graphxform_run_news"


def news_queue(tf, device: str):
    """The queue on a ps task where the tasks that run steps leave news of the run for its
    `graphxform serve`: "started worker:0" once it is connected, "finished worker:0" when it
    ends its run normally (it may go away now), "lost worker:1 by worker:0" when it stops
    because a peer stopped (so a ps task that sees both gone names the cause, not the task that
    gave up). Built the same way by both sides, as TF requires of a shared resource."""
    with tf.device(device):
        return tf.queue.FIFOQueue(capacity=1024, dtypes=[tf.string], shapes=[[]],
                                  shared_name=NEWS_QUEUE, name=NEWS_QUEUE)


IN_PROCESS_QUEUES = 4  # gRPC completion queues of each in-process server (see __enter__)


class InProcessCluster(contextlib.AbstractContextManager):
    """A server for every task of ``cluster`` in this process (for verify and tests).

    TensorFlow cannot stop a gRPC server (GrpcServer::Stop is unimplemented), so the servers and
    their ports live until the process exits; give each InProcessCluster fresh ports
    (``local_cluster``)."""

    def __init__(self, cluster: Cluster | dict, cpus: dict | None = None,
                 collective_leader: str | None = None):
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster(cluster)
        self.cpus = dict(cpus or {})
        self.collective_leader = collective_leader
        self.servers = {}

    def __enter__(self):
        # Each server's gRPC client starts one thread per completion queue, 64 by default: a
        # process holding many servers (a test session) ran out of threads at ~30,000.
        os.environ.setdefault("TF_GRPC_WORKER_CACHE_QUEUES", str(IN_PROCESS_QUEUES))
        for job, tasks in self.cluster.jobs.items():
            for task in range(len(tasks)):
                self.servers[(job, task)] = start_server(self.cluster, job, task,
                                                         self.cpus.get(job, 1),
                                                         self.collective_leader)
        return self

    def __exit__(self, *exc):
        return False

    def target(self, job: str, task: int) -> str:
        return grpc_target(self.cluster.require(job, task))


# Idle in-process clusters, by (job sizes, CPUs per job): see reused_cluster.
_IDLE: dict = {}


@contextlib.contextmanager
def reused_cluster(sizes: dict, cpus: dict | None = None):
    """An InProcessCluster of ``sizes`` ({"ps": 1, "worker": 2}), reusing one an earlier call
    left idle in this process. TensorFlow cannot stop a server, so a process that verifies
    graph after graph (a test session) would otherwise hold every server it ever started, some
    35 MB each. On the way out every resource container of the cluster is reset (variables,
    queues, accumulators: what a session leaves on its servers), so the next graph starts on
    clean servers. Only for graphs without collectives: a server's collective executor keeps
    its groups and instances' shapes after a reset, so those get fresh servers
    (InProcessCluster over ``local_cluster``)."""
    import tensorflow as tf
    key = (tuple(sorted(sizes.items())), tuple(sorted((cpus or {}).items())))
    running = _IDLE.pop(key, None)
    if running is None:
        running = InProcessCluster(local_cluster(sizes), cpus=cpus).__enter__()
    job = next(iter(running.cluster.jobs))
    yield running
    try:
        tf.compat.v1.Session.reset(running.target(job, 0))
    except (tf.errors.OpError, RuntimeError):
        return  # a server that cannot be reset is not reused
    _IDLE[key] = running

