"""Loading the optional C extension (``tracker/_speedups.c``), in one place.

The marker decoders (``tracker.protocol``) and the client's GC untracking
(``tracker.client.gc_untrack``) both use it when it is built and fall back to Python when it is
not, or when ``KMQ_PURE_PYTHON`` asks for the reference code (the tests run both ways).
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def load_c_extension() -> Any:
    """The ``tracker._speedups`` module, or None (not built, or ``KMQ_PURE_PYTHON`` is set)."""
    if os.environ.get("KMQ_PURE_PYTHON"):
        return None
    try:
        # By name, not ``from tracker import _speedups``: that reads as an import of the
        # package itself, which imports its users (a cycle to the import contracts).
        return importlib.import_module("tracker._speedups")
    except ImportError:
        return None
