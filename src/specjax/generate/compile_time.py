"""One-time JAX compilation inside a block of code, from JAX's own monitoring events.

A generation's first call with new shapes traces and compiles its jitted steps
(seconds on a CPU); reporting tokens/s over that time says more about the
compiler than about decoding. :func:`measure_compiles` sums the durations JAX
reports for tracing, lowering and compiling (or loading from the persistent
compilation cache) in the calling thread while the block runs, and counts
backend compilations, so callers can report compile time separately and
detect recompilations (``benchmarks/soak.py``). :func:`timed_block` times a
block of code with the compilation inside it apart (the loop's phases).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CompileClock", "Spent", "measure_compiles", "timed_block"]

_BACKEND = "/jax/core/compile/backend_compile_duration"
_EVENTS = frozenset(
    {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        _BACKEND,
    }
)

_lock = threading.Lock()
_registered = False
_local = threading.local()


@dataclass(eq=False)  # identity: nested clocks are told apart when removed
class CompileClock:
    """What :func:`measure_compiles` saw.

    Attributes:
      seconds: time spent tracing, lowering and compiling (or loading compiled code
        from the persistent cache) in this thread during the block.
      compiles: backend compilations (each new shape or static argument of a jitted function).
    """

    seconds: float = 0.0
    compiles: int = 0


def _listener(event: str, duration_secs: float, **_: str | int) -> None:
    if event not in _EVENTS:
        return
    for clock in getattr(_local, "clocks", ()):
        clock.seconds += duration_secs
        if event == _BACKEND:
            clock.compiles += 1


def _ensure_listener() -> None:
    global _registered
    with _lock:
        if not _registered:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(_listener)
            _registered = True


@contextlib.contextmanager
def measure_compiles() -> Iterator[CompileClock]:
    """Yield a :class:`CompileClock` that counts this thread's JAX compilation while the block runs."""
    _ensure_listener()
    clock = CompileClock()
    clocks = _local.__dict__.setdefault("clocks", [])
    clocks.append(clock)
    try:
        yield clock
    finally:
        clocks.remove(clock)


@dataclass
class Spent:
    """A block's wall-clock time and the part of it spent compiling (filled in by :func:`timed_block`).

    Attributes:
      seconds: the block's wall-clock time (``time.perf_counter``).
      compiling: the JAX compilation its clock saw meanwhile (part of ``seconds``).
    """

    seconds: float = 0.0
    compiling: float = 0.0

    @property
    def net(self) -> float:
        """The block's time without compilation (one-time work per shape and process)."""
        return self.seconds - self.compiling

    def minus(self, *parts: Spent) -> Spent:
        """This block's time outside ``parts`` (blocks that ran inside it)."""
        return Spent(self.seconds - sum(p.seconds for p in parts), self.compiling - sum(p.compiling for p in parts))


@contextlib.contextmanager
def timed_block(clock: CompileClock) -> Iterator[Spent]:
    """Yield a :class:`Spent` that holds, once the block ends, its time and the compilation ``clock`` saw in it.

    ``clock``: a :func:`measure_compiles` clock open around the block.
    """
    spent = Spent()
    compiled, start = clock.seconds, time.perf_counter()
    try:
        yield spent
    finally:
        spent.seconds = time.perf_counter() - start
        spent.compiling = clock.seconds - compiled
