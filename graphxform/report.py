"""Moved to graphxform/inspector/report.py (the inspector's modules live together); this name
still imports it: ``graphxform.report`` is the same module object."""

import sys

from graphxform.inspector import report as _moved

sys.modules[__name__] = _moved
