"""Running graphs: local sessions (``local``), the servers and configs of a cluster
(``servers``), one task's part of a cluster graph's step (``task``), a ps task's server that
watches its peers (``serve``), a whole local cluster (``launch``) and the bounds on every
blocking call (``faults``).

``from graphxform.runtime import Feeds, Runner`` still works: the local runner's names are
looked up here on first use, so importing a sibling module does not load the others."""

from __future__ import annotations

import importlib

_LOCAL = {"Feeds", "Runner", "StepResult", "cpus_by_job", "needed_inputs", "replicas_of",
          "DEFAULT_BATCH"}


def __getattr__(name):
    if name in _LOCAL:
        return getattr(importlib.import_module("graphxform.runtime.local"), name)
    raise AttributeError(f"module 'graphxform.runtime' has no attribute '{name}'")
