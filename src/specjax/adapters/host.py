"""CPU torch tensors as NumPy views that XLA:CPU reads in place (the cheap CPU crossing).

Imports no torch at module level: :func:`host_view` is only ever called with a
torch tensor, so torch is already imported then.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from specjax.adapters.jax_view import torchax_array

__all__ = ["host_array", "host_view", "jax_on_cpu"]


@functools.cache
def jax_on_cpu() -> bool:
    """Whether JAX's default backend is the CPU (then NumPy arguments of a jitted call are aliased)."""
    return jax.default_backend() == "cpu"


_VIEW_ALIGNMENT = 64  # XLA:CPU aliases host buffers aligned to this; others it copies


def host_view(x: Any) -> np.ndarray | None:
    """A CPU torch tensor as a NumPy view of its memory, when the jitted kernels can alias it; else None.

    On a CPU-only JAX, a NumPy argument of a jitted function whose buffer is
    64-byte aligned is used in place (no copy), and it is far cheaper than a
    DLPack import first (``benchmarks/bench_overheads.py``, docs/benchmarks.md).
    So CPU tensors take this route when nothing would be lost: integer tensors
    (token ids or per-row parameters, a few numbers, which the callers check
    and narrow on the host), and contiguous, aligned float16/float32 tensors.
    Everything else, including any tensor when JAX has a GPU (the kernel must
    run where the tensor is), goes through :func:`specjax.adapters.to_jax`,
    which copies explicitly and counts the copy when one is needed.
    """
    import torch  # only called with torch tensors

    if not x.is_cpu or not jax_on_cpu() or x.layout != torch.strided:
        return None
    if x.is_floating_point():
        if x.dtype not in (torch.float16, torch.float32) or not x.is_contiguous():
            return None
        if x.numel() and x.data_ptr() % _VIEW_ALIGNMENT:
            return None
    elif x.is_complex() or x.dtype == torch.bool:
        return None
    try:
        return (x.detach() if x.requires_grad else x).numpy()
    except (RuntimeError, TypeError):  # e.g. a negative-bit view, or a dtype NumPy lacks
        return None


def host_array(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array when it lives in host memory (NumPy, a CPU torch tensor, a JAX array on
    the CPU, a torchax tensor holding one; no copy), else None (a device array: it stays where it is)."""
    if isinstance(x, np.ndarray):
        return x
    held = torchax_array(x)
    if held is not None:  # a torchax tensor: the jax.Array it holds
        x = held
    if hasattr(x, "is_cpu") and hasattr(x, "numpy"):  # a torch tensor (torch is imported: it made x)
        return (x.detach() if x.requires_grad else x).numpy() if x.is_cpu else None
    devices = getattr(x, "devices", None)
    if isinstance(x, jax.Array) and devices is not None and all(d.platform == "cpu" for d in devices()):
        return np.asarray(x)
    return None


def int32_range_error(lo: int, hi: int) -> str:
    """The one message for token ids that do not fit in int32 (NumPy, JAX and torch inputs alike)."""
    i32 = np.iinfo(np.int32)
    return f"token ids must fit in int32 [{i32.min}, {i32.max}], got values in [{lo}, {hi}]"
