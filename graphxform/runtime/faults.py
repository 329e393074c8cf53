"""Bounds on every blocking call of a cluster task, and how a task tells a dead peer from a
frozen one.

A dead task refuses connections, but a frozen one (SIGSTOP, a hung host) still completes TCP
handshakes in its kernel: a connect test calls it alive, and an RPC to it waits for ever unless
it has a deadline. So a peer is asked over gRPC, with a deadline, for its status
(``WorkerService/GetStatus``, which every TF server answers): an answer means alive,
UNAVAILABLE means gone, no answer in time means frozen.

TensorFlow bounds most waits itself (``operation_timeout_in_ms``, collectives'
``timeout_seconds``), but not every one (a RecvTensor from a frozen ps task, a session's close,
interpreter teardown), and its handling of a collective that times out can crash the process.
So a task process runs each ``session.run`` under a ``Watchdog``: if the call has not returned
by its timeout, the watchdog names the peer that stopped answering in one line and ends the
process, since a call blocked inside TF cannot be interrupted from Python; TF's own timeouts
come ``GRACE_S`` later, as a backstop."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading
import time

OK, FROZEN, GONE = "answering", "not answering", "gone"
PROBE_S = 1.0
GRACE_S = 3.0  # after the watchdog's deadline, TF's own timeouts (a backstop)
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def probe(address: str, timeout: float = PROBE_S) -> str:
    """OK, FROZEN or GONE for the TF server at ``address`` (host:port)."""
    import grpc
    host, port = address.rsplit(":", 1)
    if host in ("localhost", "0.0.0.0"):
        host = "127.0.0.1"
    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        call = channel.unary_unary(_GET_STATUS, request_serializer=None,
                                   response_deserializer=None)
        call(b"", timeout=timeout)  # an empty GetStatusRequest
        return OK
    except grpc.RpcError as e:
        return FROZEN if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else GONE
    finally:
        channel.close()


def probe_all(addresses: dict, timeout: float = PROBE_S) -> dict:
    """{key: state} for {key: address}, asked in parallel (one deadline for all)."""
    if not addresses:
        return {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        futures = {key: pool.submit(probe, address, timeout)
                   for key, address in addresses.items()}
        return {key: future.result() for key, future in futures.items()}


def lost_peers(cluster, tasks, timeout: float = PROBE_S) -> list[tuple[str, int, str]]:
    """(job, task, state) of each of ``tasks`` that does not answer: frozen ones first (a
    frozen task is the cause; the tasks that gave up on it and exited are the consequence)."""
    states = probe_all({(j, t): cluster.tasks(j)[t] for j, t in tasks}, timeout)
    lost = [(j, t, s) for (j, t), s in states.items() if s != OK]
    return sorted(lost, key=lambda item: (item[2] != FROZEN, item[0], item[1]))


def hard_exit(code: int) -> None:
    """Leave now: flush our output and skip TF's teardown, which may wait on a frozen peer."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class Watchdog:
    """``with watchdog.guard(seconds, describe):`` runs the body; if it has not finished after
    ``seconds``, ``give_up(describe())`` is called from the watchdog's thread (it prints one line
    and ends the process). One thread serves every guarded call of a task."""

    def __init__(self, give_up):
        self.give_up = give_up
        self._lock = threading.Lock()
        self._deadline = None
        self._describe = None
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="graphxform-watchdog",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def guard(self, seconds: float, describe):
        with self._lock:
            self._deadline = time.monotonic() + seconds
            self._describe = describe
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._deadline = None

    def _watch(self):
        while True:
            with self._lock:
                deadline, describe = self._deadline, self._describe
            if deadline is None:
                self._wake.wait()
                self._wake.clear()
                continue
            left = deadline - time.monotonic()
            if left > 0:
                self._wake.wait(min(left, 0.5))
                self._wake.clear()
                continue
            with self._lock:
                expired = self._deadline is not None and self._deadline <= time.monotonic()
            if expired:
                self.give_up(describe())
                return
