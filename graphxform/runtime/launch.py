"""`graphxform launch`: a cluster graph's whole cluster (ps, allreduce, hybrid) as local processes
on 127.0.0.1 (`serve` for each ps task, `run --cluster` for each worker/chief), per-step loss as the
mean over workers, and a teardown that leaves no process and no bound port behind on every exit
path. A task that dies or freezes is found by its peers within --timeout (each names it in one
line and exits); the launcher then stops the rest. Its own "no step finished" watchdog is only
the last resort.

Children run in their own process groups; the launcher kills each group (SIGTERM, then SIGKILL)
when it finishes, fails, is interrupted or gets SIGTERM/SIGHUP, and returns only once every child
is gone. Every child exits by itself when the launcher dies, even by SIGKILL (the kernel's
parent-death signal, and a thread watching the parent pid). The launcher's temp dir is named for
its pid, so the next launch sweeps one a killed launcher left (see graphxform/cleanup.py)."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from graphxform import cleanup
from graphxform.cluster import Cluster
from graphxform.plan import ClusterPlan
from graphxform.runtime import servers
from graphxform.runtime.servers import describe
from graphxform.errors import GraphxformError

PARENT_ENV = "GRAPHXFORM_PARENT_PID"
STEP_LINE = re.compile(r"^step (\d+)\s+loss (\S+)")
CHILD_ERROR = "graphxform: error: "  # how a child's `graphxform run/serve` reports its failure
GRACE_S = 3.0
KILLED_WAIT_S = 30.0  # after SIGKILL a process is gone at once unless stuck in the kernel
START_SLACK_S = 60.0  # on top of --timeout, for children to import TF and connect


class Child:
    def __init__(self, job: str, task: int, address: str, argv: list, env: dict):
        self.job, self.task, self.address = job, task, address
        self.name = f"{job} {task} ({address})"
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                     start_new_session=True)
        self.last_error = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal_group(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: pgid == pid
        except (ProcessLookupError, PermissionError):
            pass


def _reader(child: Child, stream, kind: str, events: queue.Queue) -> None:
    try:
        for line in stream:
            events.put((kind, child, line.rstrip("\n")))
    except (OSError, ValueError):
        pass
    finally:
        events.put(("eof", child, kind))


def _is_frozen(pid: int) -> bool:
    """The process is stopped (SIGSTOP/SIGTSTP), read from /proc (Linux; elsewhere: no)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class Launch:
    """Start, watch and tear down a local cluster for ``model``'s plan."""

    def __init__(self, model: str, plan: ClusterPlan, cluster: Cluster | None = None,
                 steps: int = 10, feeds: str | None = None, batch_size: int | None = None,
                 timeout_s: float = servers.DEFAULT_TIMEOUT_S, save: str | None = None,
                 restore: str | None = None, debug: bool = False, echo=print, warn=None):
        self.model, self.plan, self.steps = model, plan, steps
        self.feeds, self.batch_size, self.timeout_s = feeds, batch_size, timeout_s
        self.save, self.restore, self.debug = save, restore, debug
        self.echo = echo
        self.warn = warn or (lambda text: print(text, file=sys.stderr))
        if cluster is None:
            cluster = servers.local_cluster(plan.job_sizes())
        else:
            _require_local(cluster)
            plan.check_cluster(cluster)
        self.cluster = cluster
        self.children: list[Child] = []
        self.losses: dict[int, dict] = {}  # step -> {task key: loss}
        self.mean_losses: list[float] = []
        self.tmp = None

    # ---------------------------------------------------------------- processes
    def _argv(self, job: str, task: int, cluster_file: str) -> list:
        base = [sys.executable, "-m", "graphxform.cli"]
        where = ["--cluster", cluster_file, "--job", job, "--task", str(task)]
        if f"{job}:{task}" not in self.plan.steps:
            return base + ["serve"] + where + ["--timeout", f"{self.timeout_s:g}"]
        argv = base + ["run", self.model] + where + ["--steps", str(self.steps),
                                                      "--timeout", f"{self.timeout_s:g}"]
        if self.feeds:
            argv += ["--feeds", self.feeds]
        if self.batch_size:
            argv += ["--batch-size", str(self.batch_size)]
        if self.plan.is_chief(job, task):
            argv += ["--save", self.save] if self.save else []
            argv += ["--restore", self.restore] if self.restore else []
        return argv + (["--debug"] if self.debug else [])

    def _start(self) -> None:
        cleanup.sweep_launch_dirs()
        self.tmp = tempfile.mkdtemp(prefix=cleanup.LAUNCH_PREFIX + cleanup.owner_tag())
        cluster_file = servers.write_cluster(os.path.join(self.tmp, "cluster.json"),
                                                 self.cluster)
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        env.update({"PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())})
        if not self.debug:
            env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        # ps first, so workers find their servers sooner
        order = sorted(((j, t) for j, ts in self.cluster.jobs.items() for t in range(len(ts))),
                       key=lambda jt: (jt[0] != "ps", jt))
        for job, task in order:
            child = Child(job, task, self.cluster.tasks(job)[task],
                          self._argv(job, task, cluster_file), env)
            self.children.append(child)
            self.echo(f"started {child.name} pid {child.pid}")

    def _teardown(self) -> None:
        """SIGTERM, a grace period, then SIGKILL to every child's group; returns once every
        child and everything in its group has exited (a signal meanwhile waits its turn)."""
        alive = [c for c in self.children if c.proc.poll() is None]
        for c in alive:
            c.signal_group(signal.SIGTERM)
            c.signal_group(signal.SIGCONT)  # a stopped child handles SIGTERM only once continued
        deadline = time.monotonic() + GRACE_S
        for c in alive:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in self.children:
            c.signal_group(signal.SIGKILL)  # the group, too: anything a child started
        for c in self.children:
            try:
                c.proc.wait(timeout=KILLED_WAIT_S)
            except subprocess.TimeoutExpired:
                self.warn(f"{c.name} (pid {c.pid}) did not exit after SIGKILL")
            _wait_group_gone(c.pid, deadline=time.monotonic() + GRACE_S)
            for stream in (c.proc.stdout, c.proc.stderr):
                try:
                    stream.close()
                except OSError:
                    pass
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ---------------------------------------------------------------- watching
    def run(self) -> list[float]:
        """Train; returns the mean loss per step. Raises GraphxformError naming the first task
        that stopped (or the lack of progress); always tears the cluster down."""
        with cleanup.signals_unwind():
            try:
                self._start()
                self._watch()
                return self.mean_losses
            finally:
                with cleanup.signals_deferred():
                    self._teardown()

    def _watch(self) -> None:
        events: queue.Queue = queue.Queue()
        runners = [c for c in self.children if f"{c.job}:{c.task}" in self.plan.steps]
        threads = []  # the runners' readers (the ps tasks' only end at the teardown)
        for c in self.children:
            for stream, kind in ((c.proc.stdout, "out"), (c.proc.stderr, "err")):
                t = threading.Thread(target=_reader, args=(c, stream, kind, events), daemon=True)
                t.start()
                if c in runners:
                    threads.append(t)
        loss_keys = [k for k in self.plan.losses if k in self.plan.steps]
        last_progress = time.monotonic()
        patience = self.timeout_s + START_SLACK_S
        while True:
            try:
                kind, child, payload = events.get(timeout=0.2)
            except queue.Empty:
                kind = None
            if kind == "out":
                if self._on_line(child, payload, loss_keys):
                    last_progress = time.monotonic()
            elif kind == "err":
                self._on_error_line(child, payload)
            for c in self.children:
                code = c.proc.poll()
                if code is None:
                    continue
                if code != 0 or c not in runners:
                    self._drain(events, c)
                    detail = f": {c.last_error}" if c.last_error else ""
                    frozen = [o for o in self.children if o is not c and _is_frozen(o.pid)]
                    if frozen and code < 0:  # a peer's crash while waiting on a frozen task
                        raise GraphxformError(
                            f"{frozen[0].name} stopped answering (frozen, e.g. SIGSTOP); "
                            f"{c.name} then stopped: {_exit_text(code)}")
                    raise GraphxformError(f"{c.name} stopped: {_exit_text(code)}{detail}")
            if all(c.proc.poll() == 0 for c in runners):
                self._drain_all(events, loss_keys, threads)
                break
            if time.monotonic() - last_progress > patience:
                raise GraphxformError(f"no step finished for {patience:g} s; stopping the "
                                      "cluster (see --timeout)")
        if len(self.mean_losses) < self.steps and loss_keys:
            raise GraphxformError(f"the workers exited after {len(self.mean_losses)} of "
                                  f"{self.steps} steps")

    def _drain(self, events: queue.Queue, child: Child, wait_s: float = 1.0) -> None:
        """Read what ``child`` said before it stopped (its last error line)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                kind, c, payload = events.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "err" and c is child:
                self._on_error_line(c, payload)
            elif kind == "eof" and c is child and payload == "err":
                return

    def _drain_all(self, events, loss_keys, threads) -> None:
        for t in threads:
            t.join(timeout=GRACE_S)
        while True:
            try:
                kind, child, payload = events.get_nowait()
            except queue.Empty:
                return
            if kind == "out":
                self._on_line(child, payload, loss_keys)
            elif kind == "err":
                self._on_error_line(child, payload)

    def _on_error_line(self, child: Child, line: str) -> None:
        """A child's stderr line, passed on; its own one-line error is not: it ends up in ours
        (`worker 1 (...) stopped: exit code 1: <its error>`), so the user reads it once."""
        text = line.strip()
        if not text:
            return
        if text.startswith(CHILD_ERROR):
            child.last_error = text[len(CHILD_ERROR):]
            return
        child.last_error = text
        self.warn(f"[{child.job} {child.task}] {line}")

    def _on_line(self, child: Child, line: str, loss_keys) -> bool:
        """A child's stdout line; returns True when a step finished on some task."""
        match = STEP_LINE.match(line)
        if match:
            step, loss = int(match.group(1)), float(match.group(2))
            got = self.losses.setdefault(step, {})
            got[f"{child.job}:{child.task}"] = loss
            while len(self.mean_losses) + 1 in self.losses and all(
                    k in self.losses[len(self.mean_losses) + 1] for k in loss_keys):
                k = len(self.mean_losses) + 1
                mean = sum(self.losses[k][key] for key in loss_keys) / max(len(loss_keys), 1)
                self.mean_losses.append(mean)
                self.echo(f"step {k}  loss {mean:.8g}")
            return True
        if line.startswith("saved "):
            self.echo(line)
        return bool(line.strip())


def _require_local(cluster: Cluster) -> None:
    for job, tasks in cluster.jobs.items():
        for task, address in enumerate(tasks):
            host = address.rsplit(":", 1)[0]
            if host not in ("127.0.0.1", "localhost"):
                raise GraphxformError(f"{cluster.source}: launch starts every task on this "
                                      f"machine, but {describe(cluster, job, task)} is not on "
                                      "127.0.0.1 (run `graphxform serve`/`run --cluster` on "
                                      "each host instead)")


def _wait_group_gone(pgid: int, deadline: float) -> None:
    """Until no process is left in group ``pgid`` (they were sent SIGKILL), or the deadline."""
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def exit_with_parent() -> None:
    """In a launched child: exit as soon as the launcher that started it is gone (the kernel
    kills us on Linux; elsewhere a thread notices within half a second)."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    cleanup.die_with_parent(signal.SIGKILL, parent=int(expected))

    def watch():
        while True:
            if str(os.getppid()) != expected:
                os._exit(1)
            time.sleep(0.5)
    threading.Thread(target=watch, name="graphxform-parent-watch", daemon=True).start()


def finish_child() -> None:
    """In a launched child that succeeded: exit at once (TensorFlow's teardown of a gRPC server
    takes seconds and there is nothing left to clean up)."""
    if os.environ.get(PARENT_ENV):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
