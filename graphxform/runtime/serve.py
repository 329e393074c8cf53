"""`graphxform serve`: one task's server (a ps task) that stays up while the cluster trains and
stops, in one line naming the task, when a peer dies or freezes during a run.

A ps task runs no step of its own, so nothing of ours would ever time out in it: it watches its
peers instead (graphxform/runtime/faults.py's probe, every second, in parallel). A run is on
while some task that runs steps (`graphxform run --cluster`) has said it started and has not
said it finished: each leaves that news in the ps task's queue (servers.news_queue). During a
run, a peer that is gone, or has not answered for ``timeout`` seconds, stops this task, but
only once the tasks that run steps are gone too (or after ``LINGER_S`` more): they find the
fault themselves and name its cause, which they could not if this task went first and looked
like one. A task that stops because of a peer leaves "lost <peer>" in the news first, so the
line this task prints names the cause too, not the task that gave up on it. Outside a run (and
for servers a single client uses, whose peers never say they started) the server just serves,
until SIGTERM or Ctrl-C, as before."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time

from graphxform.cluster import Cluster
from graphxform.errors import GraphxformError
from graphxform.runtime import faults, servers
from graphxform.runtime.servers import describe

POLL_S = 1.0
LINGER_S = 5.0


@dataclasses.dataclass
class Peer:
    job: str
    task: int
    address: str
    runs_steps: bool  # a worker or chief (ps tasks never start or finish a run)
    seen: bool = False
    last_answer: float = 0.0
    started: bool = False
    finished: bool = False


class RunWatch:
    """What this task knows of its peers during a run (see the module docstring)."""

    def __init__(self, cluster: Cluster, job: str, task: int, timeout_s: float, target: str):
        import tensorflow as tf
        tf1 = tf.compat.v1
        self.cluster, self.timeout_s = cluster, timeout_s
        self.name = describe(cluster, job, task)
        self.peers = {(j, t): Peer(j, t, a, j != "ps")
                      for j, tasks in cluster.jobs.items() for t, a in enumerate(tasks)
                      if (j, t) != (job, task)}
        self.blamed = None  # (peer key, reporter) from the first "lost" news
        self.graph = tf.Graph()
        with self.graph.as_default():
            queue = servers.news_queue(tf, f"/job:{job}/task:{task}")
            self.size = queue.size()
            self.count = tf1.placeholder(tf.int32, [])
            self.take = queue.dequeue_many(self.count)
        self.options = tf1.RunOptions(timeout_in_ms=int(timeout_s * 1000))
        self.session = tf1.Session(target, graph=self.graph, config=servers.session_config(
            [f"/job:{job}/task:{task}"], timeout_s))

    def _read_news(self) -> None:
        count = int(self.session.run(self.size, options=self.options))
        if not count:
            return
        for raw in self.session.run(self.take, {self.count: count}, options=self.options):
            kind, _, rest = raw.decode().partition(" ")
            who, _, reporter = rest.partition(" by ")
            job, _, task = who.partition(":")
            key = (job, int(task)) if task.isdigit() else None
            if kind == "started" and key in self.peers:
                self.peers[key].started, self.peers[key].finished = True, False
            elif kind == "finished" and key in self.peers:
                self.peers[key].finished = True
            elif kind == "lost" and key is not None and self.blamed is None:
                self.blamed = (key, reporter.replace(":", " "))

    def in_run(self) -> bool:
        return any(p.started and not p.finished for p in self.peers.values() if p.runs_steps)

    def check(self):
        """One round: None while all is well, else (the peer lost, its state)."""
        self._read_news()
        states = faults.probe_all({key: p.address for key, p in self.peers.items()})
        now = time.monotonic()
        for key, state in states.items():
            if state == faults.OK:
                self.peers[key].seen, self.peers[key].last_answer = True, now
        if not self.in_run():
            return None
        for key, state in sorted(states.items(), key=lambda kv: kv[1] != faults.FROZEN):
            peer = self.peers[key]
            if not peer.seen or peer.finished or state == faults.OK or (
                    peer.runs_steps and not peer.started):
                continue
            if state == faults.GONE:
                self._read_news()  # it may have finished and left since the last read
                if peer.finished:
                    continue
                return key, state
            if now - peer.last_answer > self.timeout_s:
                return key, state
        return None

    def verdict(self, lost) -> str:
        """The line naming the cause: the peer a stopped task reported, else the one lost."""
        with contextlib.suppress(Exception):
            self._read_news()
        if self.blamed is not None:
            (job, task), reporter = self.blamed
            return (f"{self.name}: {describe(self.cluster, job, task)} stopped during the run "
                    f"(reported by {reporter})")
        (job, task), state = lost
        who = describe(self.cluster, job, task)
        if state == faults.GONE:
            return f"{self.name}: {who} is gone during the run"
        silent = time.monotonic() - self.peers[(job, task)].last_answer
        return f"{self.name}: {who} stopped answering (no answer for {silent:.0f} s during the run)"

    def linger(self, stop) -> None:
        """Keep serving until no task that runs steps answers any more, at most LINGER_S."""
        deadline = time.monotonic() + LINGER_S
        runners = {key: p.address for key, p in self.peers.items()
                   if p.runs_steps and p.started and not p.finished}
        while time.monotonic() < deadline and not stop.is_set():
            states = faults.probe_all(runners, timeout=0.5)
            if all(state != faults.OK for state in states.values()):
                return
            stop.wait(0.5)


def serve(cluster: Cluster, job: str, task: int, cpus: int = 1,
          timeout_s: float = servers.DEFAULT_TIMEOUT_S, echo=print, fail=None,
          collective_leader: str | None = None) -> None:
    """Start this task's server, watch the runs, and block until SIGTERM or SIGINT. A peer lost
    during a run calls ``fail(line)`` (which ends the process) or raises GraphxformError.
    ``collective_leader``: for a server whose ops a graph's collectives run (one client)."""
    from graphxform.runtime.launch import exit_with_parent
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = servers.start_server(cluster, job, task, cpus, collective_leader)
        exit_with_parent()
        echo(f"serving {describe(cluster, job, task)} at "
             f"{servers.grpc_target(cluster.require(job, task))}")
        watch = RunWatch(cluster, job, task, timeout_s, server.target)
        while not stop.wait(POLL_S):
            lost = watch.check()
            if lost:
                watch.linger(stop)
                line = watch.verdict(lost)
                if fail is None:
                    raise GraphxformError(line)
                fail(line)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
