"""Clusters on TensorFlow's own gRPC runtime: free local ports, cluster files, the servers of a
cluster started in this process, and the ConfigProto a task's server and session use (the plan
each task runs is graphxform/plan.py's data).

TensorFlow's gRPC server always listens on 0.0.0.0:PORT (hard-coded in grpc_server_lib.cc);
every address graphxform writes or connects to is 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

from graphxform.cluster import Cluster
from graphxform.errors import GraphxformError

LOCALHOST = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0


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
def server_config(cpus: int = 1):
    """ConfigProto for a task's server: the local CPU devices its replicas are placed on."""
    import tensorflow as tf
    return tf.compat.v1.ConfigProto(device_count={"CPU": max(1, cpus)})


def session_config(job: str, task: int, chief: bool, timeout_s: float = DEFAULT_TIMEOUT_S,
                   threads: int = 0):
    """ConfigProto for a task's session.

    - device_filters: a worker sees the ps jobs and itself (so a dead peer worker cannot stall
      it); the chief sees every task, since it initialises every variable.
    - operation_timeout_in_ms: every blocking op (a queue dequeue, an accumulator's take_grad,
      a RecvTensor from a dead task) fails after ``timeout_s`` instead of waiting forever.
    A distributed session places the whole graph (it ignores place_pruned_graph) and soft
    placement does not move ops off a hidden task, so a worker imports the graph through
    ``visible_to`` first.
    - isolate_session_state stays False: every worker's session must share the variables,
      accumulators and token queue on the ps tasks."""
    import tensorflow as tf
    fail_fast()
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=threads,
                                      intra_op_parallelism_threads=threads)
    if not chief:
        config.device_filters.extend(["/job:ps", f"/job:{job}/task:{task}"])
    config.operation_timeout_in_ms = max(1, int(timeout_s * 1000))
    config.isolate_session_state = False
    return config


def fail_fast() -> None:
    """Make TF's gRPC calls fail at once on a task that is gone (UNAVAILABLE) instead of
    waiting for it to come back, which no op timeout bounds. TF reads GRPC_FAIL_FAST once, at
    its first RPC, so this runs before any server or session exists (a value the user set
    wins). Starting tasks in any order still works: sessions wait for their peers' ports
    first (wait_for_tasks)."""
    import os
    os.environ.setdefault("GRPC_FAIL_FAST", "true")


def start_server(cluster: Cluster, job: str, task: int, cpus: int = 1):
    """Start this task's tf.distribute.Server (it listens on 0.0.0.0:PORT)."""
    import tensorflow as tf
    fail_fast()
    cluster.require(job, task)
    try:
        return tf.distribute.Server(tf.train.ClusterSpec(cluster.as_dict()), job_name=job,
                                    task_index=task, protocol="grpc",
                                    config=server_config(cpus), start=True)
    except (tf.errors.OpError, ValueError, RuntimeError) as e:
        text = (getattr(e, "message", None) or str(e)).strip().splitlines()
        raise GraphxformError(f"cannot start the server of {describe(cluster, job, task)}: "
                              f"{text[0] if text else type(e).__name__}") from None


_TASK_IN_DEVICE = re.compile(r"/job:([^/]+)(?:/replica:\d+)?/task:(\d+)")


def visible_to(graph_def, job: str, task: int) -> int:
    """Clear the device of every node placed on a task a worker's device filters hide (another
    worker), in place: the worker never runs those ops, and a distributed session must place
    every node of the graph on a device it can see. Returns how many were cleared."""
    cleared = 0
    for node in graph_def.node:
        match = _TASK_IN_DEVICE.search(node.device)
        if match and match.group(1) != "ps" and (match.group(1), int(match.group(2))) != (
                job, task):
            node.device = ""
            cleared += 1
    return cleared


class InProcessCluster(contextlib.AbstractContextManager):
    """A server for every task of ``cluster`` in this process (for verify and tests).

    TensorFlow cannot stop a gRPC server (GrpcServer::Stop is unimplemented), so the servers and
    their ports live until the process exits; give each InProcessCluster fresh ports
    (``local_cluster``)."""

    def __init__(self, cluster: Cluster | dict, cpus: dict | None = None):
        self.cluster = cluster if isinstance(cluster, Cluster) else Cluster(cluster)
        self.cpus = dict(cpus or {})
        self.servers = {}

    def __enter__(self):
        for job, tasks in self.cluster.jobs.items():
            for task in range(len(tasks)):
                self.servers[(job, task)] = start_server(self.cluster, job, task,
                                                         self.cpus.get(job, 1))
        return self

    def __exit__(self, *exc):
        return False

    def target(self, job: str, task: int) -> str:
        return grpc_target(self.cluster.require(job, task))
