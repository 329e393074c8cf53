"""One task's part of a cluster graph's training step (ps, allreduce, hybrid), on TensorFlow's gRPC
runtime: start (or reuse) the task's server configured as the graph's plan says, connect a
session to it, let the chief initialise (or restore) while the others wait, run the task's step
op, and let the chief save. Every blocking call is bounded (graphxform/runtime/faults.py): a
failure names the peer that died or froze, in one line."""

from __future__ import annotations

import contextlib
import os
import re
import time

import numpy as np

from graphxform import input_pipeline, metagraph, training
from graphxform.cluster import Cluster
from graphxform.plan import CLUSTER_COLLECTION, ClusterPlan
from graphxform.runtime import faults, servers
from graphxform.runtime.input_threads import InputThreads
from graphxform.passes.split_inputs import uneven_batch
from graphxform.runtime.local import import_meta_graph
from graphxform.runtime.servers import describe
from graphxform.errors import GraphxformError, tf_error_line
from graphxform.ir import GraphIR

POLL_S = 0.2
STARTUP_S = 60.0  # at least: how long a task waits for its peers' servers to come up at the start
_REMOTE_TASK = re.compile(r"(?:From|remote target) /job:([^/\s]+)/replica:\d+/task:(\d+)")


def plan_of(ir: GraphIR, per_task: bool = True) -> ClusterPlan:
    """The plan a cluster graph carries; a one-line error for a graph without one, or (with
    ``per_task``: `launch`, `run --cluster`) one only a single client can run."""
    plan = ClusterPlan.from_ir(ir)
    if plan is None:
        raise GraphxformError(f"{ir.source or 'the graph'} was not built for a cluster (no "
                              f"'{CLUSTER_COLLECTION}' collection; build it with "
                              "`graphxform apply --strategy ps|allreduce|hybrid --cluster F`)")
    if per_task:
        plan.require_per_task(ir.source or "the graph")
    return plan


def cpus_needed(ir: GraphIR, job: str, task: int) -> int:
    """How many CPU devices this task's server needs for the replicas placed on it."""
    pattern = re.compile(rf"/job:{re.escape(job)}(?:/replica:\d+)?/task:{task}/device:CPU:(\d+)")
    count = 1
    for name in ir.nodes():
        match = pattern.search(ir.node(name)["device"] or "")
        if match:
            count = max(count, int(match.group(1)) + 1)
    return count


class TaskRunner:
    """A session for task ``job:task`` of the cluster a graph was built for.

    ``target`` connects to a server already running (InProcessCluster); without one this task's
    server is started here. ``timeout_s`` bounds every blocking op and every wait: TF's own
    timeouts (operation_timeout_in_ms, each run's timeout, collectives' timeout_seconds), and
    with ``on_stuck`` a watchdog that calls ``on_stuck(line)`` (which ends the process) when a
    call is still blocked after ``timeout_s``. With the watchdog, TF's timeouts are set
    ``faults.GRACE_S`` later, as a backstop: TF's own handling of a collective that times out
    on a frozen peer sometimes crashes the process inside ``session.run`` (SIGSEGV or SIGABRT,
    about one run in twenty of the fault tests), before it could say which peer stopped; the
    watchdog names it and ends the process first. ``threads``:
    the (inter-op, intra-op) pools of the server started here."""

    def __init__(self, ir: GraphIR, cluster: Cluster, job: str, task: int,
                 timeout_s: float = servers.DEFAULT_TIMEOUT_S, target: str | None = None,
                 fetches=(), on_stuck=None, threads=(0, 0)):
        import tensorflow as tf
        tf1 = tf.compat.v1
        self.tf, self.tf1 = tf, tf1
        self.plan = plan_of(ir)
        self.plan.check_cluster(cluster)
        self.cluster, self.job, self.task = cluster, job, int(task)
        self.name = describe(cluster, job, self.task)
        cluster.require(job, self.task)
        self.step_op = self.plan.step_of(job, self.task)
        self.loss = self.plan.losses.get(f"{job}:{self.task}")
        self.chief = self.plan.is_chief(job, self.task)
        self.filters = self.plan.filters_of(job, self.task)
        self.timeout_s = timeout_s
        self.tf_timeout_s = timeout_s + faults.GRACE_S if on_stuck else timeout_s
        self.fetches = list(fetches)
        analysis = training.analyze(ir)
        input_pipeline.require_filled(ir, analysis)
        self.inputs = analysis.inputs
        reads = ir.ancestors(self.step_op) if self.step_op in ir else set()
        self.iterator_inits = [i for i in input_pipeline.iterator_initializers(
            ir, analysis.pipeline) if i.iterator in reads]  # those this task's step reads
        self.steps_run = 0
        self.watchdog = faults.Watchdog(self._stuck) if on_stuck else None
        self.on_stuck = on_stuck
        self.server = None
        if target is None:
            self.server = servers.start_server(cluster, job, self.task,
                                               cpus_needed(ir, job, self.task),
                                               self.plan.collective_leader, threads)
            target = servers.grpc_target(cluster.require(job, self.task))
        self.target = target
        meta = metagraph.to_metagraph(ir)
        hidden = servers.visible_to(meta.graph_def, self.filters)
        _time_collectives(meta.graph_def, self.tf_timeout_s)
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.saver = import_meta_graph(meta, ir.source)
            for name in [self.step_op] + ([self.loss] if self.loss else []) + self.fetches:
                try:
                    self.graph.as_graph_element(name)
                except (KeyError, ValueError):
                    raise GraphxformError(f"no op or tensor named '{name}' in the graph (named "
                                          f"by its cluster plan or --fetch)") from None
            self.global_step = tf1.train.get_global_step(self.graph)
            self.variables = tf1.global_variables() + tf1.local_variables()
            self.own_variables = [v for v in self.variables if v.op.name not in hidden]
            self.ready_op = None  # built on first use (TF warns about an unused one)
            if self.chief:
                self.init_op = tf1.global_variables_initializer()
                self.local_init_op = tf1.local_variables_initializer()
                if self.saver is None:
                    self.saver = tf1.train.Saver(allow_empty=True)
            self._news_ops = self._news_ops_for_ps()
        self.run_options = tf1.RunOptions(timeout_in_ms=max(1, int(self.tf_timeout_s * 1000)))
        self.session = tf1.Session(target, graph=self.graph, config=servers.session_config(
            self.filters, self.tf_timeout_s, collective_leader=self.plan.collective_leader))
        # this task's input queues: an unplaced pipeline lands on the task itself
        self.input_threads = InputThreads(self.graph, self.session)

    def _news_ops_for_ps(self) -> dict:
        """ps task -> the op that leaves news of this run in its queue (servers.news_queue);
        none in a cluster without ps tasks."""
        tf = self.tf
        ps_tasks = [t for t in range(len(self.cluster.tasks("ps")))
                    if servers.sees(self.filters, "ps", t)]
        if not ps_tasks:
            return {}
        with tf.name_scope("graphxform_runtime/"):
            self._news = self.tf1.placeholder(tf.string, [], name="news")
            return {t: servers.news_queue(tf, f"/job:ps/task:{t}").enqueue([self._news])
                    for t in ps_tasks}

    def _tell_ps(self, text: str, ps_tasks, timeout_s: float) -> None:
        for t in ps_tasks:
            self.session.run(self._news_ops[t], {self._news: text},
                             options=self.tf1.RunOptions(timeout_in_ms=int(timeout_s * 1000)))

    def blame(self, lost) -> None:
        """Tell the ps tasks that still answer which task stopped (lost_peers' first), so they
        name it rather than this task when it goes away. Best effort, bounded."""
        if not self._news_ops or not lost:
            return
        job, task, _ = lost[0]
        quiet = {t for j, t, _ in lost if j == "ps"}
        with contextlib.suppress(Exception):
            self._tell_ps(f"lost {job}:{task} by {self.job}:{self.task}",
                          [t for t in self._news_ops if t not in quiet], faults.PROBE_S)

    # ---------------------------------------------------------------- life cycle
    def close(self):
        with self._bounded("closing the session"):
            self.input_threads.stop()
            self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def peers(self) -> list[tuple[str, int]]:
        return [(j, t) for j, ts in self.cluster.jobs.items() for t in range(len(ts))
                if (j, t) != (self.job, self.task)]

    def wait_for_cluster(self):
        """Every task this one talks to accepts connections: the chief every task; another task
        what its session sees, the collective group leader and the chief (whose work it waits
        for next). Bounded by the timeout, but at least STARTUP_S: tasks on several hosts start
        in any order, and each takes seconds to import TensorFlow."""
        chief_job, chief_task = self.plan.chief.split(":")
        needed = [(j, t) for j, t in self.peers() + [(self.job, self.task)]
                  if self.chief or servers.sees(self.filters, j, t)
                  or self._leads_collectives(j, t) or (j, t) == (chief_job, int(chief_task))]
        servers.wait_for_tasks(self.cluster, needed, max(self.timeout_s, STARTUP_S))

    def _leads_collectives(self, job: str, task: int) -> bool:
        leader = self.plan.collective_leader or ""
        return bool(re.fullmatch(rf"/job:{re.escape(job)}(?:/replica:\d+)?/task:{task}", leader))

    def prepare(self, restore: str | None = None, feeds=None):
        """The chief initialises (or restores) every variable and runs chief_init; the others
        wait until it has. Each tells the ps tasks its run started (they watch it from now),
        then starts its input (``start_input``)."""
        self.wait_for_cluster()
        self._announce("started")
        if not self.chief:
            self._wait_until_ready()
            self.start_input(feeds)
            return
        if restore:
            self.restore(restore)
            missing = self._uninitialized()
            if missing:  # not in the checkpoint's saver (e.g. local step counters)
                with self.graph.as_default():
                    names = set(missing)
                    self._run(self.tf1.variables_initializer(
                        [v for v in self.variables if v.op.name in names]), "initialising")
        else:
            self._run([self.init_op, self.local_init_op], "initialising the variables")
        if self.plan.chief_init:
            self._run(self.plan.chief_init, "running chief_init")
        self.start_input(feeds)

    def start_input(self, feeds=None):
        """As a TF1 loop before its first step: run the initializers of the iterators this
        task's step reads (their placeholders fed from ``feeds``' .npz, a runtime.local.Feeds)
        in this task's session, then start the queue runners' threads."""
        if self.iterator_inits:
            from graphxform.runtime.local import Feeds
            feed = (feeds or Feeds([])).initializer_feed(self.iterator_inits)
            self._run([i.op for i in self.iterator_inits], "initializing the input iterators",
                      feed)
        self.input_threads.start()

    def _uninitialized(self) -> list[str]:
        """Which variables this task's session sees that are not initialised yet (another task's
        replicas' copies are the chief's business: this session cannot see them)."""
        if self.ready_op is None:
            with self.graph.as_default():
                self.ready_op = self.tf1.report_uninitialized_variables(
                    self.variables if self.chief else self.own_variables)
        names = self._run(self.ready_op, "checking which variables are initialised")
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    def _wait_until_ready(self):
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = self._uninitialized()
            if not missing:
                return
            if time.monotonic() > deadline:
                raise GraphxformError(
                    f"{self.name}: the chief ({self.plan.chief.replace(':', ' ')}) has not "
                    f"initialised the variables after {self.timeout_s:g} s (still missing: "
                    f"{', '.join(missing[:3])})")
            time.sleep(POLL_S)

    def finish(self):
        """Tell the ps tasks this task ended its run normally (it may go away now)."""
        self._announce("finished")

    def _announce(self, news: str):
        if not self._news_ops:
            return
        what = f"telling the ps tasks the run {'is over' if news == 'finished' else news}"
        with self._bounded(what):
            try:
                self._tell_ps(f"{news} {self.job}:{self.task}", self._news_ops,
                              self.tf_timeout_s)
                return
            except self.tf.errors.OpError as e:
                error = e
        raise GraphxformError(self._explain(error, what)) from None

    # ---------------------------------------------------------------- steps
    def step(self, feed: dict):
        """One step of this task's part; returns (mean loss of its replicas or None, fetches)."""
        names = ([self.loss] if self.loss else []) + self.fetches
        values = self._run([self.step_op] + names, f"step {self.steps_run + 1}", feed)[1:]
        self.steps_run += 1
        got = dict(zip(names, values))
        loss = float(np.mean(got[self.loss])) if self.loss else None
        return loss, {k: got[k] for k in self.fetches}

    def _bounded(self, what: str):
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.guard(self.timeout_s, lambda: what)

    def _run(self, fetches, what: str, feed=None):
        with self._bounded(what):
            try:
                return self.session.run(fetches, feed, options=self.run_options)
            except self.tf.errors.OpError as e:
                error = e
        # outside the watchdog's guard: naming the cause takes probes of its own (bounded)
        raise GraphxformError(self._explain(error, what)) from None

    def _stuck(self, what: str) -> None:
        """The watchdog's verdict on a call TF did not end in time: one line, then the end."""
        waited = self.timeout_s
        lost = faults.lost_peers(self.cluster, self.peers())
        self.blame(lost)
        if lost:
            line = f"{self.name}: {self._who(lost)} ({what}: no answer after {waited:g} s)"
        else:
            line = (f"{self.name}: {what} did not finish within {waited:g} s (a task is too "
                    "slow or stuck; see --timeout)")
        self.on_stuck(line)

    def _who(self, lost) -> str:
        job, task, state = lost[0]
        verb = "stopped answering" if state == faults.FROZEN else "is gone"
        return f"{describe(self.cluster, job, task)} {verb}"

    def _explain(self, error, what: str) -> str:
        """One line: which task died or froze, else what timed out, else TF's message."""
        tf = self.tf
        text = tf_error_line(error)
        if isinstance(error, (tf.errors.DeadlineExceededError, tf.errors.UnavailableError,
                              tf.errors.AbortedError, tf.errors.CancelledError,
                              tf.errors.InternalError, tf.errors.UnknownError,
                              tf.errors.FailedPreconditionError)):
            lost = faults.lost_peers(self.cluster, self.peers())
            if not lost:  # a task killed this instant may still hold its port briefly
                time.sleep(0.5)
                lost = faults.lost_peers(self.cluster, self.peers())
            if lost:
                self.blame(lost)
                return f"{self.name}: {self._who(lost)} ({what}: {type(error).__name__})"
            if isinstance(error, tf.errors.DeadlineExceededError):
                return (f"{self.name}: {what} timed out after {self.timeout_s:g} s waiting for "
                        "other tasks (one stopped or is too slow; see --timeout)")
            remote = _REMOTE_TASK.search(str(error))
            if remote:
                return (f"{self.name}: {what} failed on "
                        f"{describe(self.cluster, remote.group(1), int(remote.group(2)))}: "
                        f"{text}")
        uneven = uneven_batch(str(error))
        if uneven:
            return uneven
        return f"{self.name}: {what} failed: {text}"

    # ---------------------------------------------------------------- checkpoints
    def restore(self, path: str):
        """Restore from a checkpoint prefix, or the latest checkpoint of a directory."""
        tf = self.tf
        prefix = path
        if os.path.isdir(path):
            prefix = tf.train.latest_checkpoint(path)
            if prefix is None:
                raise GraphxformError(f"{path}: no checkpoint in this directory")
        try:
            with self.graph.as_default(), self._bounded("restoring the checkpoint"):
                self.saver.restore(self.session, prefix)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot restore checkpoint {prefix}: {tf_error_line(e)}") from None

    def save(self, prefix: str) -> str:
        """Write PREFIX-<global step> and only then point the directory's `checkpoint` state file
        at it (TF writes each checkpoint file under a temporary name and renames it; the state
        file is replaced atomically, last): a crash mid-save leaves the previous latest
        checkpoint in place. Returns the written prefix."""
        tf = self.tf
        step = (int(self._run(self.global_step, "reading global_step"))
                if self.global_step is not None else self.steps_run)
        directory = os.path.dirname(os.path.abspath(prefix))
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise GraphxformError(f"cannot save checkpoint {prefix}-{step}: cannot create "
                                  f"{directory}: {e.strerror}") from None
        try:
            with self.graph.as_default(), self._bounded("saving the checkpoint"):
                return self.saver.save(self.session, prefix, global_step=step,
                                       write_meta_graph=False)
        except (ValueError, tf.errors.OpError) as e:
            raise GraphxformError(f"cannot save checkpoint {prefix}-{step}: "
                                  f"{tf_error_line(e)}") from None


def _time_collectives(graph_def, seconds: float) -> None:
    """Every collective of the step fails after ``seconds`` (--timeout) when a member never
    comes, instead of the graph's default."""
    for node in graph_def.node:
        if node.op.startswith("Collective") and "timeout_seconds" in node.attr:
            node.attr["timeout_seconds"].f = float(seconds)


# ---------------------------------------------------------------- the CLI's halves
def resolve_task(cluster_file: str | None, job: str | None, task: int | None,
                 environ=None) -> tuple[Cluster, str, int]:
    """The cluster (--cluster, else TF_CONFIG) and this process's job and task (--job/--task,
    else TF_CONFIG's "task"); one-line errors for a task the cluster does not have."""
    import json
    from graphxform.cluster import load_cluster
    environ = os.environ if environ is None else environ
    cluster, tf_task = load_cluster(cluster_file, environ)
    if job is None:
        if not tf_task and environ.get("TF_CONFIG"):
            try:
                tf_task = json.loads(environ["TF_CONFIG"]).get("task") or {}
            except (ValueError, AttributeError):
                tf_task = {}
        if not tf_task or not tf_task.get("type"):
            raise GraphxformError("give --job and --task (or set TF_CONFIG's \"task\")")
        job = tf_task["type"]
        if task is None:
            try:
                task = int(tf_task.get("index", 0))
            except (TypeError, ValueError):
                raise GraphxformError(f"TF_CONFIG: task {tf_task!r} is not {{type, index}}") \
                    from None
    task = 0 if task is None else task
    cluster.require(job, task)
    return cluster, job, task


def run_task(ir: GraphIR, cluster: Cluster, job: str, task: int, steps: int,
             feeds: str | None = None, batch_size: int | None = None,
             restore: str | None = None, save: str | None = None, fetches=(),
             timeout_s: float = servers.DEFAULT_TIMEOUT_S, echo=print, fail=None) -> list:
    """`graphxform run OUT --cluster F --job J --task I`: this task's part of K steps, printing
    "step k  loss X" (its replicas' mean loss); the chief initialises or restores and saves.
    Returns the losses. ``fail(line)``, when given, ends the process on any failure once the
    task's server runs (a session blocked on a frozen peer cannot be closed cleanly)."""
    from graphxform.runtime.launch import exit_with_parent
    from graphxform.runtime.local import Feeds
    exit_with_parent()
    runner = TaskRunner(ir, cluster, job, task, timeout_s=timeout_s, fetches=fetches,
                        on_stuck=fail)
    losses = []
    try:
        source = Feeds(runner.inputs, feeds, batch_size)
        if restore and not runner.chief:
            raise GraphxformError(f"--restore is for the chief ({runner.plan.chief}); "
                                  f"{runner.name} gets the variables the chief restores")
        runner.prepare(restore if runner.chief else None, source)
        echo(f"{runner.name}: ready{' (chief)' if runner.chief else ''}")
        for k in range(steps):
            loss, fetched = runner.step(source.batch(k))
            losses.append(loss)
            parts = [f"step {k + 1}"]
            if loss is not None:
                parts.append(f"loss {loss:.8g}")
            parts += [f"{name} {_short(value)}" for name, value in fetched.items()]
            echo("  ".join(parts))
        if save and runner.chief:
            echo(f"saved {runner.save(save)}")
        runner.finish()
        runner.close()
    except GraphxformError as e:
        if fail is None:
            runner.close()
            raise
        fail(str(e))
    return losses


def _short(value) -> str:
    array = np.asarray(value)
    return f"{array.item():.6g}" if array.size == 1 else f"{array.dtype}{list(array.shape)}"
