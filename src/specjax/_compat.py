"""Old import paths of public names that moved up a layer, kept working for one release.

A lower module (say :mod:`specjax.kernels.rejection`) must not import a higher
one (:mod:`specjax.boundary.api`, where :func:`specjax.rejection_sample` now
lives). Users and installed entry-point metadata may still name the old path,
so such a module declares ``_MOVED = {name: new module}`` and a PEP 562
``__getattr__`` that calls :func:`moved`: the name resolves on first access,
from outside the package. Nothing inside specjax uses these paths
(tests/test_layering.py checks it), so they add no arrow between layers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["moved"]


def moved(module: str, name: str, table: Mapping[str, str]) -> Any:
    """``name`` of ``module`` looked up in its new home ``table[name]``; AttributeError if not moved."""
    target = table.get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(target), name)
    setattr(sys.modules[module], name, value)  # later lookups skip __getattr__
    return value
