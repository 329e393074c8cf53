"""Leave nothing behind, whatever way a command ends.

- Temp files and directories we make are named for the process that made them
  (``.graphxform-<pid>-<host>-XXXX.tmp`` beside an output,
  ``graphxform-launch-<pid>-<host>-XXXX`` in the temp dir), so a later run can tell one whose
  process is gone (killed with -9, or the machine lost power) from one still being written,
  and sweep only the former. TF's checkpoint temp files name no owner: they are swept from a
  checkpoint directory once nobody has written them for a minute.
- SIGTERM, SIGHUP and SIGINT unwind the command like Ctrl-C (``Terminated``), so the
  ``finally``/``except`` blocks that remove what is in flight run; the CLI exits 128 + signal.
  A handler runs when the main thread is back in Python: a long TF call finishes first.
- Children die with us even on SIGKILL (``PR_SET_PDEATHSIG`` on Linux).
- Files we create get the mode ``open(path, "w")`` would give them (mkstemp's is 0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import sys
import threading
import time

TEMP_PREFIX = ".graphxform-"
TEMP_SUFFIX = ".tmp"
LAUNCH_PREFIX = "graphxform-launch-"
STALE_AFTER_S = 60.0  # untouched this long: not being written (by another pid namespace)
SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGINT")
                if hasattr(signal, name))

# <prefix><pid>-<host>-<mkstemp's random part, which has no '-'><suffix>
_OWNED = re.compile(r"^(?P<pid>\d+)-(?P<host>.+)-[A-Za-z0-9_]+$")
# What TF's checkpoint writers leave when killed: `<prefix>.index.tempstate<digits>`, the data
# files' likewise, and the `checkpoint` state file's `checkpoint.tmp<uuid>`.
_CHECKPOINT_TEMP = re.compile(r"(\.tempstate\d+|^checkpoint\.tmp[0-9a-f]{32})$")


class Terminated(KeyboardInterrupt):
    """The command got SIGTERM, SIGHUP or SIGINT; unwinds like Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ---------------------------------------------------------------- names we can sweep
def owner_tag() -> str:
    """``<pid>-<host>-``: what our temp names start with after their prefix."""
    return f"{os.getpid()}-{socket.gethostname()}-"


def _owner_gone(name: str, prefix: str, suffix: str = "") -> bool:
    """Whether ``name`` is one of our temp names whose process is no longer running here."""
    if not name.startswith(prefix) or not name.endswith(suffix):
        return False
    match = _OWNED.match(name[len(prefix): len(name) - len(suffix)])
    if not match or match.group("host") != socket.gethostname():
        return False
    return not pid_alive(int(match.group("pid")))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _untouched_since(path: str, when: float) -> bool:
    try:
        return os.lstat(path).st_mtime <= when
    except OSError:
        return False


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass  # gone already, or not ours to remove after all


def _sweep(directory: str, is_stale_name, min_age_s: float = STALE_AFTER_S) -> list[str]:
    cutoff = time.time() - min_age_s
    swept = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return swept
    for entry in entries:
        if is_stale_name(entry.name) and _untouched_since(entry.path, cutoff):
            _remove(entry.path)
            swept.append(entry.path)
    return swept


def sweep_output_temps(directory: str) -> list[str]:
    """Remove ``.graphxform-*.tmp`` files in ``directory`` left by runs of ours that died."""
    return _sweep(directory, lambda name: _owner_gone(name, TEMP_PREFIX, TEMP_SUFFIX))


def sweep_launch_dirs(directory: str | None = None) -> list[str]:
    """Remove ``graphxform-launch-*`` directories whose launcher is gone (its children read
    the cluster file there at start-up and die with it)."""
    import tempfile
    return _sweep(directory or tempfile.gettempdir(),
                  lambda name: _owner_gone(name, LAUNCH_PREFIX), min_age_s=0.0)


def sweep_checkpoint_temps(prefix_or_dir: str) -> list[str]:
    """Remove TF's temporary checkpoint files (``*.tempstate<N>``, ``checkpoint.tmp<uuid>``)
    that nobody has written for a while from the directory of a checkpoint prefix (or from the
    directory itself): a saver killed mid-save leaves them, and TF never reads them."""
    directory = (prefix_or_dir if os.path.isdir(prefix_or_dir)
                 else os.path.dirname(os.path.abspath(prefix_or_dir)))
    return _sweep(directory, lambda name: bool(_CHECKPOINT_TEMP.search(name)))


# ---------------------------------------------------------------- file modes
def current_umask() -> int:
    """The process umask, read without changing it where Linux says it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def mode_for_new_file(path: str) -> int:
    """The mode ``open(path, "w")`` would leave ``path`` with: an existing file keeps its own,
    a new one gets 0666 less the umask."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    return 0o666 & ~current_umask()


# ---------------------------------------------------------------- signals
@contextlib.contextmanager
def signals_unwind():
    """While inside, SIGTERM/SIGHUP/SIGINT raise ``Terminated`` in the main thread (elsewhere
    this does nothing: only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        _received.append(signum)
        raise Terminated(signum)
    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    del _received[:]
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


_received = []  # the signals signals_unwind's handler got, in order


def terminated_by() -> Terminated | None:
    """The ``Terminated`` a signal raised, where it was turned into another exception on its
    way out: a signal that lands while TensorFlow builds the exception of a failed run (a
    collective's timeout) reaches the caller as pybind11's RuntimeError, not as itself."""
    return Terminated(_received[0]) if _received else None


class signals_deferred:
    """While inside, SIGTERM/SIGHUP/SIGINT are only noted, so a teardown is not cut short;
    on a clean exit a noted signal is raised as ``Terminated`` then."""

    def __enter__(self):
        self.got = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, lambda s, f: self.got.append(s))
                             for sig in SIGNALS}
        return self

    def __exit__(self, exc_type, exc, tb):
        for sig, old in self.previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if self.got and exc_type is None:
            raise Terminated(self.got[0])
        return False


# ---------------------------------------------------------------- children
_PR_SET_PDEATHSIG = 1


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """In a child: have the kernel send ``sig`` when the parent exits (Linux). ``parent`` is
    the pid it must still have, else the parent already died and we exit now. Returns whether
    the kernel will do it."""
    prctl = _prctl()
    armed = bool(prctl) and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if parent is not None and os.getppid() != parent:
        os._exit(1)
    return armed


def child_preexec():
    """A ``preexec_fn`` for children that are not ours (Graphviz's ``dot``): die with us.
    Built before forking, so the child only calls into libc."""
    prctl = _prctl()
    parent = os.getpid()
    if prctl is None:
        return None

    def preexec():
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)
    return preexec
