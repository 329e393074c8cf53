"""Importing TensorFlow for the command line: its core first, the whole Python API on demand.

`import tensorflow` runs tensorflow/__init__.py, which loads the whole public API (distribute,
data, autograph, saved_model, ...): about 2.5 s of CPU on a quiet 2-core machine. A command that
only reads and writes protobufs, asks the op registry and imports graphs through the C API
(`apply`, `inspect`, `viz`, `check`, ...) needs about 0.4 s of it: the generated protobuf
modules, the pywrap extension and a few `tensorflow.python.framework` modules, none of which
need the package's __init__ to have run.

`core()` puts a stand-in for the `tensorflow` package in `sys.modules` (same `__path__`, so its
submodules import as usual) and loads those modules. The stand-in turns into the real package
the first time anything needs the API: an attribute read (`tf.Session`, `tf.compat`) or an
import of a name the package's own directories do not hold (`import tensorflow.compat.v1`).
Then it imports `tensorflow` for real; the submodules already loaded are reused, so every
object stays the same. Library users never meet the stand-in: only the CLI's `main` calls
`core()`, and only when TensorFlow is not imported yet.

Both imports keep TF's native start-up chatter (written straight to fd 2) off the terminal
unless ``quiet`` is false (`--debug`)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

# what `apply` and the inspector use: loaded eagerly so later imports cost nothing
CORE_MODULES = (
    "tensorflow.core.framework.graph_pb2",
    "tensorflow.core.protobuf.meta_graph_pb2",
    "tensorflow.python.client.pywrap_tf_session",
    "tensorflow.python.framework.op_def_registry",
    "tensorflow.python.framework.ops",
)

_quiet = True


def core(quiet: bool = True) -> None:
    """Load TensorFlow's core modules without its Python API (see the module docstring);
    nothing to do when `tensorflow` is already imported."""
    global _quiet
    if "tensorflow" in sys.modules:
        return
    _quiet = quiet
    spec = importlib.util.find_spec("tensorflow")
    if spec is None:
        from graphxform.errors import GraphxformError
        raise GraphxformError("TensorFlow is not installed in this Python "
                              f"({sys.executable}): pip install tensorflow")
    stand_in = _StandIn("tensorflow")
    stand_in.__spec__, stand_in.__file__ = spec, spec.origin
    stand_in.__path__ = list(spec.submodule_search_locations)
    sys.modules["tensorflow"] = stand_in
    sys.meta_path.insert(0, _UPGRADE_FINDER)
    with silenced(quiet):
        for name in CORE_MODULES:
            importlib.import_module(name)


def full():
    """The real `tensorflow` package, imported now if it is not yet."""
    module = sys.modules.get("tensorflow")
    if module is not None and not isinstance(module, _StandIn):
        return module
    if _UPGRADE_FINDER in sys.meta_path:
        sys.meta_path.remove(_UPGRADE_FINDER)
    sys.modules.pop("tensorflow", None)
    with silenced(_quiet):
        return importlib.import_module("tensorflow")


@contextlib.contextmanager
def silenced(quiet: bool = True):
    """Keep what native code writes to fd 2 (TF's start-up chatter) off the terminal, so an
    error stays one line."""
    if not quiet:
        yield
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _StandIn(types.ModuleType):
    """`tensorflow` before its __init__ has run: any API attribute imports it for real."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(full(), name)


class _UpgradeFinder(importlib.abc.MetaPathFinder):
    """Imports the real package when a `tensorflow.X` import names something its directories
    do not hold (the API modules live under tensorflow/_api; __init__ aliases them)."""

    def find_spec(self, name, path=None, target=None):
        stand_in = sys.modules.get("tensorflow")
        if (not isinstance(stand_in, _StandIn) or not name.startswith("tensorflow.")
                or name.count(".") > 1
                or importlib.machinery.PathFinder.find_spec(name, stand_in.__path__)):
            return None  # a real submodule (or below one): the usual import finds it
        return importlib.util.spec_from_loader(name, _AfterUpgrade())


class _AfterUpgrade(importlib.abc.Loader):
    """Loads `tensorflow.X` by importing the real package, whose __init__ makes X."""

    def create_module(self, spec):
        full()
        module = importlib.import_module(spec.name)
        self.spec = module.__spec__  # the import machinery is about to overwrite it
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec


_UPGRADE_FINDER = _UpgradeFinder()
