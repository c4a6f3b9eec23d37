"""Bookkeeping for the copies the adapters make: counters, snapshots and warn-once logging.

Every copy :func:`specjax.adapters.to_jax` or :func:`specjax.adapters.to_torch`
makes is recorded here under exactly one reason (see :data:`COPY_REASONS`). A
copy the caller did not ask for (``copy=None``) is also logged once per process
and reason, as a warning on the logger ``"specjax.adapters"``.

Two ways to read the counts:

* :func:`copy_stats` — a process-wide snapshot (all threads) since start-up or
  the last :func:`reset_copy_stats`.
* :func:`count_copies` — a context manager counting the copies made by the
  current thread inside the block, e.g. one call of the generation loop::

      with specjax.adapters.count_copies() as c:
          out = speculative_generate(...)
      print(c.copies, c.bytes, c.by_reason)

Counting is guarded by one lock, so concurrent threads never lose an update.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "COPY_REASONS",
    "CopyCounter",
    "CopyStats",
    "copy_stats",
    "count_copies",
    "reset_copy_stats",
]

logger = logging.getLogger("specjax.adapters")

#: Why a copy was made. Each copy is counted under exactly one reason; when
#: several apply (an int64 view that is also strided) the first listed wins,
#: because a dtype conversion always writes a fresh contiguous, aligned buffer.
COPY_REASONS: Mapping[str, str] = MappingProxyType(
    {
        "requested": "the caller passed copy=True",
        "int64_to_int32": "int64 token ids are narrowed to int32 (JAX's default integer width)",
        "float64_to_float32": (
            "float64 is narrowed to float32 because jax_enable_x64 is off (enable it to keep float64 zero-copy)"
        ),
        "non_contiguous": (
            "the tensor is a strided view (not C-contiguous); JAX accepts only "
            "compact row-major buffers (or refuses with UNIMPLEMENTED)"
        ),
        "misaligned": (
            "the tensor's data pointer is not 64-byte aligned; JAX would copy "
            "it silently, so specjax copies it explicitly instead"
        ),
        "dlpack_copy": "the DLPack import produced a new buffer although none was expected",
    }
)


@dataclass(frozen=True)
class CopyStats:
    """A snapshot of copy counts.

    Attributes:
      copies: number of copies.
      bytes: bytes written by those copies (size of the destination buffers).
      by_reason: copies per reason; every key of :data:`COPY_REASONS` is present.
    """

    copies: int
    bytes: int
    by_reason: Mapping[str, int]


class CopyCounter:
    """Live counts for one :func:`count_copies` block (readable during and after it)."""

    def __init__(self) -> None:
        self.copies = 0
        self.bytes = 0
        self.by_reason: dict[str, int] = dict.fromkeys(COPY_REASONS, 0)

    def _add(self, reason: str, nbytes: int) -> None:
        self.copies += 1
        self.bytes += nbytes
        self.by_reason[reason] += 1

    def snapshot(self) -> CopyStats:
        return CopyStats(self.copies, self.bytes, MappingProxyType(dict(self.by_reason)))

    def __repr__(self) -> str:
        reasons = {k: v for k, v in self.by_reason.items() if v}
        return f"CopyCounter(copies={self.copies}, bytes={self.bytes}, by_reason={reasons})"


@dataclass
class _State:
    lock: threading.Lock = field(default_factory=threading.Lock)
    total: CopyCounter = field(default_factory=CopyCounter)
    warned: set[str] = field(default_factory=set)


_state = _State()
_local = threading.local()


def _active_counters() -> list[CopyCounter]:
    stack = getattr(_local, "counters", None)
    if stack is None:
        stack = _local.counters = []
    return stack


def record_copy(reason: str, nbytes: int, *, detail: str = "", requested: bool = False) -> None:
    """Count one copy; warn once per process and reason unless the caller asked for it.

    Args:
      reason: a key of :data:`COPY_REASONS`.
      nbytes: size of the buffer the copy wrote.
      detail: appended to the warning (shape, dtype, device of the tensor).
      requested: the caller passed ``copy=True``; counted, never warned about.
    """
    assert reason in COPY_REASONS, reason
    with _state.lock:
        _state.total._add(reason, nbytes)
        for counter in _active_counters():
            counter._add(reason, nbytes)
        first = not requested and reason not in _state.warned
        if first:
            _state.warned.add(reason)
    if first:
        logger.warning(
            "specjax.adapters made a copy (%s): %s%s. Further copies for this reason are "
            "counted (specjax.adapters.copy_stats()) but not logged again.",
            reason,
            COPY_REASONS[reason],
            f"; {detail}" if detail else "",
        )


def copy_stats() -> CopyStats:
    """Process-wide copy counts (all threads) since start-up or :func:`reset_copy_stats`."""
    with _state.lock:
        return _state.total.snapshot()


def reset_copy_stats() -> None:
    """Zero the process-wide counts and forget which reasons were already logged."""
    with _state.lock:
        _state.total = CopyCounter()
        _state.warned.clear()


@contextmanager
def count_copies() -> Iterator[CopyCounter]:
    """Count the copies the current thread makes inside the block.

    Yields a :class:`CopyCounter` with ``copies``, ``bytes`` and ``by_reason``.
    Blocks nest; copies made by other threads are not counted here (they are
    in :func:`copy_stats`).
    """
    counter = CopyCounter()
    stack = _active_counters()
    stack.append(counter)
    try:
        yield counter
    finally:
        stack.remove(counter)
