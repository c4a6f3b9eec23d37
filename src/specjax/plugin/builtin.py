"""The ``builtin_samplers`` plugin: this package's samplers, registered like any plugin's.

Declared in ``pyproject.toml`` as the ``specjax.plugins`` entry point
``builtin_samplers = "specjax.plugin.builtin:register_samplers"``. Importing
this module imports nothing else; :func:`register_samplers` registers lazy
``module:attr`` strings, so neither JAX nor torch is imported until a sampler
is used.
"""

from __future__ import annotations

__all__ = ["BUILTIN_SAMPLERS", "register_samplers"]

#: name -> "module:attr" of the samplers this package provides (the same
#: targets as its ``specjax.samplers`` entry points).
BUILTIN_SAMPLERS: dict[str, str] = {
    "jax": "specjax.kernels.rejection:rejection_sample",
    "numpy": "specjax.plugin.reference_samplers:numpy_rejection_sample",
    "torch": "specjax.plugin.reference_samplers:torch_rejection_sample",
}


def register_samplers() -> None:
    """Register ``jax`` (the fused kernel), ``numpy`` (float64 reference) and ``torch``.

    Idempotent: registering the same targets again changes nothing.
    """
    from specjax.plugin.registry import register_sampler

    for name, target in BUILTIN_SAMPLERS.items():
        register_sampler(name, target)
