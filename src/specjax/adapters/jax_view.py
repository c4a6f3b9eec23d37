"""torchax tensors at the boundary: a torch tensor that already *is* a ``jax.Array``.

torchax (docs/torchax.md) runs PyTorch code on JAX's devices (a TPU, or JAX's
CPU backend) with a ``torch.Tensor`` subclass, ``torchax.tensor.Tensor``, that
holds a ``jax.Array``. Such a tensor is not on ``cpu`` or ``cuda``: DLPack and
NumPy views do not apply, and ``np.asarray`` would copy it to the host and back
without anyone counting it. Its array is taken as it is instead: the same
buffer, on the same device, zero copies.

Recognised by the class's module (``torchax...``), so that this module imports
neither torch nor torchax.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["is_torchax", "torchax_array"]


def is_torchax(x: Any) -> bool:
    """Whether ``x`` is a torchax tensor (a ``torch.Tensor`` that holds a ``jax.Array``)."""
    return type(x).__module__.split(".")[0] == "torchax"


def torchax_array(x: Any) -> jax.Array | None:
    """The ``jax.Array`` a torchax tensor holds (the same buffer, no copy); None for anything else."""
    if not is_torchax(x):
        return None
    from torchax.interop import jax_view  # torchax is imported: it made x

    array = jax_view(x)
    if not isinstance(array, jax.Array):
        held = type(array).__name__
        raise TypeError(f"tensor: expected a torchax tensor holding a jax.Array, got one holding {held}")
    return array
