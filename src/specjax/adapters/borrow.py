"""Enforcing the aliasing rule: torch must not write a buffer JAX is still reading.

A zero-copy :func:`specjax.adapters.to_jax` lends torch's memory to JAX. JAX
dispatches asynchronously, so the computation that reads the buffer may still be
running (on the CPU thread pool or on a CUDA stream) when the Python call that
launched it has returned. :func:`borrowed` scopes the loan: inside the block the
buffers are JAX's to read; on exit it blocks until the JAX results registered
with :meth:`Borrow.reads` are ready, after which torch may overwrite, reuse or
free the tensors (e.g. a static KV cache or a preallocated logits buffer)::

    with borrowed(draft_logits, target_logits) as b:
        q_logits, p_logits = b.arrays
        out = b.reads(verify_from_logits(q_logits, p_logits, ...))
    tokens = to_torch(out.tokens)  # i32[B, G+1], on the logits' device
    # draft_logits / target_logits may be written again from here on

Register every JAX result computed from the borrowed arrays (any pytree of
arrays); results of computations that do not read them need not be. If the
block raises, the registered results are still waited for (their own errors
are then ignored) before the exception propagates.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import jax
import torch

from specjax.adapters.dlpack import to_jax

__all__ = ["Borrow", "borrowed"]

T = TypeVar("T")


class Borrow:
    """The loan made by :func:`borrowed`.

    Attributes:
      arrays: one ``jax.Array`` per borrowed tensor, in order (zero-copy where
        possible, see :func:`specjax.adapters.to_jax`).
    """

    def __init__(self, arrays: tuple[jax.Array, ...]) -> None:
        self.arrays = arrays
        self._results: list[Any] = []
        self.released = False

    def reads(self, results: T) -> T:
        """Register JAX results that read the borrowed buffers; returns ``results`` unchanged."""
        if self.released:
            raise RuntimeError("Borrow.reads: the loan was already released; register results inside the block")
        self._results.append(results)
        return results

    def release(self) -> None:
        """Block until every registered result is ready. Idempotent."""
        if not self.released:
            jax.block_until_ready(tuple(self._results))
            self._results.clear()
            self.released = True


@contextmanager
def borrowed(*tensors: torch.Tensor, copy: bool | None = None) -> Iterator[Borrow]:
    """Lend torch tensors to JAX for the duration of a ``with`` block.

    Args:
      *tensors: torch tensors, converted with ``to_jax(t, copy=copy)``.
      copy: passed to :func:`specjax.adapters.to_jax`.

    Yields:
      A :class:`Borrow`; ``b.arrays`` are the JAX arrays, ``b.reads(result)``
      registers results to wait for on exit.
    """
    loan = Borrow(tuple(to_jax(t, copy=copy) for t in tensors))
    try:
        yield loan
    except BaseException:
        try:
            loan.release()
        except Exception:  # the block's exception is the one to report
            loan.released = True
        raise
    else:
        loan.release()
