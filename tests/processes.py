"""What the multi-process tests share: running tasks' sessions in threads, recognising the
tasks `launch` started, and proving each one gone (its process group, and its port free) once
the command has returned."""

import os
import re
import socket
import threading

# the line launch prints per task it starts
STARTED = re.compile(r"started (\w+) (\d+) \(127\.0\.0\.1:(\d+)\) pid (\d+)")


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)  # launched children lead their own process groups
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))  # what TF's server binds
            return True
        except OSError:
            return False


def assert_launched_tasks_gone(out: str) -> None:
    """Every task launch's output says it started has exited and freed its port."""
    for _, _, port, pid in STARTED.findall(out):
        assert gone(int(pid)), f"pid {pid} left behind"
        assert port_free(int(port)), f"port {port} still bound"


def in_threads(work, runners):
    """``work(runner)`` for every task at once (a round blocks on the others); every thread is
    joined with a deadline and the first error raised here."""
    out, errors = {}, []

    def call(r):
        try:
            out[r.name] = work(r)
        except Exception as e:  # raised below, in the test's thread
            errors.append(e)
    threads = [threading.Thread(target=call, args=(r,), daemon=True) for r in runners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a task hung"
    if errors:
        raise errors[0]
    return [out[r.name] for r in runners]
