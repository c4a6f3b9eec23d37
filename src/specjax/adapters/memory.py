"""GPU memory policy: let JAX share the GPU with torch.

By default JAX's CUDA client preallocates 75% of the GPU's memory the first time
a JAX backend starts, which leaves torch (model weights, KV cache) too little.
:func:`configure_jax_memory` sets XLA's environment variables so that JAX
allocates on demand instead. The variables are read once, when JAX initialises
its backends (the first JAX computation, ``jax.devices()``, ...), so the call
must come before that. The names are those read by ``jaxlib.xla_client``
(``generate_pjrt_gpu_plugin_options``) in jax 0.10.2:

* ``XLA_PYTHON_CLIENT_PREALLOCATE``: ``false`` to allocate on demand.
* ``XLA_CLIENT_MEM_FRACTION``: the fraction of GPU memory JAX may use (default
  0.75); ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is its deprecated name, and setting
  both makes JAX fail, so this module writes only the new one.
* ``XLA_PYTHON_CLIENT_ALLOCATOR``: ``default``/``bfc`` (a pooling allocator),
  ``platform`` (cudaMalloc/cudaFree per buffer: slow, but returns memory),
  ``cuda_async`` or ``vmm``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ALLOCATORS", "configure_jax_memory", "jax_backends_initialized"]

ALLOCATORS = ("default", "platform", "bfc", "cuda_async", "vmm")

_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
_FRACTION = "XLA_CLIENT_MEM_FRACTION"
_FRACTION_OLD = "XLA_PYTHON_CLIENT_MEM_FRACTION"
_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"


def jax_backends_initialized() -> bool:
    """Whether JAX has started its backends, checked without starting them.

    False when ``jax`` was never imported. Uses
    ``jax._src.xla_bridge.backends_are_initialized`` (jax 0.10.2 has no public
    equivalent that does not itself initialise the backends).
    """
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    check = getattr(xla_bridge, "backends_are_initialized", None)
    if check is not None:
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", {}))


def _env_preallocate() -> bool:
    value = os.environ.get(_PREALLOCATE, "")
    return value not in ("false", "False", "0") if value else True  # JAX's parsing


def _env_fraction() -> float | None:
    value = os.environ.get(_FRACTION) or os.environ.get(_FRACTION_OLD)
    return float(value) if value else None


def _env_allocator() -> str:
    return os.environ.get(_ALLOCATOR, "default").lower()


def configure_jax_memory(
    *,
    preallocate: bool = False,
    memory_fraction: float | None = None,
    allocator: str | None = None,
) -> dict[str, str]:
    """Set JAX's GPU memory environment before JAX starts, so it shares the GPU with torch.

    Args:
      preallocate: whether JAX grabs its memory pool up front. ``False``
        (default) allocates on demand, leaving the rest to torch.
      memory_fraction: the most GPU memory JAX may use, as a fraction in (0, 1];
        ``None`` leaves JAX's default (0.75) or the environment's value.
      allocator: one of :data:`ALLOCATORS`; ``None`` leaves it unchanged.

    Returns:
      The environment variables this call wants, name → value.

    Idempotent: calling again with the same settings is fine, even after JAX
    started. Call it first thing (before any JAX computation); on CPU-only
    machines it is harmless.

    Raises:
      TypeError, ValueError: an argument of the wrong type or out of range.
      RuntimeError: JAX's backends are already initialised and the environment
        does not already hold these settings (they could no longer take effect).
    """
    if not isinstance(preallocate, bool):
        raise TypeError(f"preallocate: expected a bool, got {type(preallocate).__name__}")
    if memory_fraction is not None:
        if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, int | float):
            raise TypeError(f"memory_fraction: expected a float in (0, 1], got {memory_fraction!r}")
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction: expected a value in (0, 1], got {memory_fraction}")
    if allocator is not None and allocator not in ALLOCATORS:
        raise ValueError(f"allocator: expected one of {', '.join(ALLOCATORS)}, got {allocator!r}")

    wanted = {_PREALLOCATE: "true" if preallocate else "false"}
    if memory_fraction is not None:
        wanted[_FRACTION] = repr(float(memory_fraction))
    if allocator is not None:
        wanted[_ALLOCATOR] = allocator

    mismatches = []
    if _env_preallocate() != preallocate:
        mismatches.append(f"{_PREALLOCATE}={os.environ.get(_PREALLOCATE)!r}")
    if memory_fraction is not None and _env_fraction() != float(memory_fraction):
        mismatches.append(f"{_FRACTION}={os.environ.get(_FRACTION) or os.environ.get(_FRACTION_OLD)!r}")
    if allocator is not None and _env_allocator() != allocator:
        mismatches.append(f"{_ALLOCATOR}={os.environ.get(_ALLOCATOR)!r}")
    if not mismatches:
        return wanted
    if jax_backends_initialized():
        raise RuntimeError(
            "configure_jax_memory: expected to run before JAX initialises its backends, but "
            f"they are already running with {', '.join(mismatches)} (wanted "
            f"{', '.join(f'{k}={v!r}' for k, v in wanted.items())}); call it at start-up, "
            "before the first JAX computation or jax.devices()"
        )
    os.environ.update(wanted)
    if memory_fraction is not None:
        os.environ.pop(_FRACTION_OLD, None)  # JAX refuses both names at once
    return wanted
