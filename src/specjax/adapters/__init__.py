"""torch ↔ JAX adapters: zero-copy DLPack crossings, device and memory policy.

Data flows HF logits (torch) → :func:`to_jax` → kernels → int32 tokens →
:func:`to_torch` → the generation loop. Adapters never decide acceptance.

Public API (imported lazily; ``import specjax.adapters`` loads neither torch nor JAX):

* :func:`to_jax` ``(tensor, *, copy=None, check_range=True) -> jax.Array``
* :func:`jit_input` ``(tensor) -> jax.Array | numpy.ndarray``: what the kernels'
  public functions and the generation loop pass to jitted calls (on a CPU-only
  JAX, a NumPy view of an aligned float16/float32 CPU tensor, which XLA:CPU
  uses in place; else :func:`to_jax`).
* :func:`to_torch` ``(array, *, copy=None) -> torch.Tensor``
* :func:`host_array` ``(x) -> numpy.ndarray | None``: ids in host memory
  (NumPy, a CPU torch tensor, a CPU JAX array) as NumPy without a copy; None
  on a device.
* :func:`borrowed` ``(*tensors, copy=None)`` — context manager enforcing the
  aliasing rule; yields a :class:`Borrow` (``.arrays``, ``.reads(results)``).
* :func:`copy_stats` ``() -> CopyStats``, :func:`count_copies` ``()`` (context
  manager yielding a live :class:`CopyCounter`), :func:`reset_copy_stats` ``()``.
* :func:`configure_jax_memory` ``(*, preallocate=False, memory_fraction=None,
  allocator=None) -> dict[str, str]``.

Copy policy
-----------
``copy=None`` (default) crosses without a copy whenever JAX can use the buffer
as it is: a C-contiguous, 64-byte-aligned tensor of a dtype JAX stores natively
(the table is in :mod:`specjax.adapters.dlpack`). Otherwise the adapter makes
exactly one explicit copy *on the tensor's own device* into a fresh, aligned,
contiguous buffer and imports that: strided views (``logits[:, -k:]`` with
B > 1, which JAX refuses, and transposes, which JAX would take with a
non-default layout), misaligned starts (``logits[0, -1]`` when V·4 is not a
multiple of 64, which JAX would copy silently), int64 ids (narrowed to int32
after a range check) and float64 without ``jax_enable_x64`` (narrowed to
float32). Every copy is counted (:func:`copy_stats`, :func:`count_copies`) and
the first copy of each kind in a process is logged as a warning on the logger
``"specjax.adapters"``. ``copy=False`` never copies and raises ``ValueError``
saying why instead; ``copy=True`` always copies. A torch tensor is never copied
through NumPy or the host; on a CPU-only JAX, :func:`jit_input` passes CPU
tensors to jitted calls as NumPy *views* (the same memory, no copy), because
XLA:CPU reads such arguments in place at a fraction of a DLPack import's cost.

Aliasing rule
-------------
After a zero-copy :func:`to_jax`, the JAX array and the torch tensor share
memory. **torch must not write that buffer (in-place ops, ``out=``, a reused
static cache or logits buffer) until every JAX computation reading it has
finished**; JAX dispatches asynchronously, so returning from the Python call is
not enough. The generation loop enforces this with :func:`borrowed`::

    with borrowed(draft_logits, target_logits) as b:
        out = b.reads(verify_from_logits(*b.arrays, ...))
    tokens = to_torch(out.tokens)

which blocks (``jax.block_until_ready``) on the registered results on exit.
For the same reason never donate (``donate_argnums``) an array made by
:func:`to_jax` without a copy: XLA could write its outputs into torch's buffer.
In the other direction, a tensor from :func:`to_torch` aliases an immutable
JAX buffer: treat it as read-only, or ``.clone()`` it before writing.

CUDA streams
------------
A tensor on ``cuda:k`` becomes an array on JAX's GPU with CUDA index ``k`` (an
error if JAX has no GPU backend). Ordering follows the DLPack protocol:
``jax.dlpack.from_dlpack`` passes its stream for external ready events to
``tensor.__dlpack__(stream=...)``, and torch makes that stream wait on an event
recorded on torch's *current* stream of device ``k``, so work torch queued
before the call (the forward pass that wrote the logits, or the adapter's own
copy) is ordered before JAX reads. If the JAX device offers no such stream,
:func:`to_jax` synchronizes torch's current stream explicitly before the import.
Back to torch, ``torch.from_dlpack`` passes torch's current stream to the JAX
array's ``__dlpack__``, which makes it wait for the computation that produced
the array. Work torch queues on *other* streams is not covered: synchronize
those yourself.

GPU memory
----------
Call :func:`configure_jax_memory` before JAX starts, so JAX allocates on demand
instead of preallocating 75% of the GPU next to torch. See docs/gpu.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "to_jax": "specjax.adapters.dlpack",
    "jit_input": "specjax.adapters.dlpack",
    "to_torch": "specjax.adapters.dlpack",
    "TORCH_TO_JAX": "specjax.adapters.dlpack",
    "JAX_TO_TORCH": "specjax.adapters.dlpack",
    "borrowed": "specjax.adapters.borrow",
    "Borrow": "specjax.adapters.borrow",
    "copy_stats": "specjax.adapters.copies",
    "count_copies": "specjax.adapters.copies",
    "reset_copy_stats": "specjax.adapters.copies",
    "CopyStats": "specjax.adapters.copies",
    "CopyCounter": "specjax.adapters.copies",
    "COPY_REASONS": "specjax.adapters.copies",
    "host_array": "specjax.adapters.host",
    "configure_jax_memory": "specjax.adapters.memory",
    "jax_backends_initialized": "specjax.adapters.memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specjax.adapters' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
