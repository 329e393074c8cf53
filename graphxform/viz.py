"""Moved to graphxform/inspector/viz.py (the inspector's modules live together); this name
still imports it: ``graphxform.viz`` is the same module object."""

import sys

from graphxform.inspector import viz as _moved

sys.modules[__name__] = _moved
