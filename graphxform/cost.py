"""Moved to graphxform/inspector/cost.py (the inspector's modules live together); this name
still imports it: ``graphxform.cost`` is the same module object."""

import sys

from graphxform.inspector import cost as _moved

sys.modules[__name__] = _moved
