"""The ``builtin_samplers`` plugin: this package's samplers, registered like any plugin's.

Declared in ``pyproject.toml`` as the ``specjax.plugins`` entry point
``builtin_samplers = "specjax.plugin.builtin:register_samplers"``. Importing
this module imports only :mod:`specjax.registry` (where the table of built-in
samplers is declared); :func:`register_samplers` registers lazy
``module:attr`` strings, so neither JAX nor torch is imported until a sampler
is used.
"""

from __future__ import annotations

from specjax.registry import BUILTIN_SAMPLERS, register_sampler

__all__ = ["register_samplers"]


def register_samplers() -> None:
    """Register ``jax`` (the fused kernel), ``numpy`` (float64 reference) and ``torch``.

    Idempotent: registering the same targets again changes nothing.
    """
    for name, target in BUILTIN_SAMPLERS.items():
        register_sampler(name, target)
