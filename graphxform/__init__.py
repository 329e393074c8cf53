"""graphxform: turn a single-device TF training graph into a distributed one, and show what
that did. ``load`` a model, run a strategy's ``Pipeline`` on it, ``save`` the result."""

from graphxform.errors import GraphxformError
from graphxform.ir import GraphIR
from graphxform.metagraph import load, save
from graphxform.pipeline import Pass, PassContext, PassResult, Pipeline

__all__ = ["GraphIR", "GraphxformError", "Pass", "PassContext", "PassResult", "Pipeline",
           "load", "save"]
__version__ = "0.1.0"
