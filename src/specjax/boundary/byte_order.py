"""NumPy arrays in this machine's byte order (imports NumPy only: the reference samplers use it too)."""

from __future__ import annotations

import numpy as np

__all__ = ["native_byte_order"]


def native_byte_order(x: np.ndarray) -> np.ndarray:
    """``x`` with its dtype in this machine's byte order (a converted copy for, e.g., big-endian ``'>f4'``).

    JAX and XLA read host buffers in native order only: a big-endian float32
    array reached the kernels as garbage numbers (a one-hot "softmax", wrong
    counts) instead of an error. Arrays already in native order (nearly all)
    are returned as they are.
    """
    if x.dtype.isnative:
        return x
    return x.astype(x.dtype.newbyteorder("="))
