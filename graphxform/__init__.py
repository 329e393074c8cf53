"""graphxform: turn a single-device TF training graph into a distributed one, and show what
that did. ``load`` a model, run a strategy's ``Pipeline`` on it, ``save`` the result."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from graphxform.errors import GraphxformError  # noqa: E402
from graphxform.ir import GraphIR  # noqa: E402
from graphxform.metagraph import load, save  # noqa: E402
from graphxform.pipeline import Pass, PassContext, PassResult, Pipeline  # noqa: E402

__all__ = ["GraphIR", "GraphxformError", "Pass", "PassContext", "PassResult", "Pipeline",
           "load", "save"]
__version__ = "0.1.0"
