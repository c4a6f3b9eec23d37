"""XLA compile options shared by specjax's jitted entry points, and the jit that applies them.

On XLA:CPU, let LLVM vectorise fused loops with 512-bit vectors where the CPU
has them (AVX-512); XLA's default prefers 256 bits. The front end's passes over
the vocabulary (the exp of the normalisers) run faster with it here
(benchmarks/bench_overheads.py, last table); the probability kernel's time is
not in such loops and it keeps XLA's default. A preference only: LLVM never
uses wider vectors than the CPU has, and other backends ignore ``xla_cpu_*``
options. Floating-point results may differ in the last bit from XLA's default
(e.g. a normaliser), so every jitted function that turns logits into
probabilities uses these same options: the draft's draw and the acceptance
step must compute q identically, bit for bit. (On a single CPU device both
take q from the C++ kernels instead, specjax.kernels.cpu_kernels, with one
expression for a token's probability.)

JAX accepts ``compiler_options`` only on a top-level ``jax.jit``: a jit that
carries them raises when it is called inside another ``jax.jit`` (or under
``jax.grad``). :func:`vector_jit` applies them where they are legal and leaves
them out inside a user's program, so every jitted entry point can be fused into
the caller's own jitted step (the whole program then compiles with the
caller's options; call the draft's draw and the acceptance step the same way,
both nested or both at the top level, for the bit-for-bit rule above).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["VECTOR_OPTIONS", "vector_jit"]

VECTOR_OPTIONS: dict[str, int] = {"xla_cpu_prefer_vector_width": 512}

# The one ValueError JAX raises for compiler_options on a nested jit (jax._src.pjit).
_NESTED_MESSAGE = "can only be passed to top-level"


class _TopLevelOptions:
    """A jitted function with :data:`VECTOR_OPTIONS` at the top level and without them when nested.

    Attributes other than the call (``lower``, ``trace``, ``_cache_size``,
    ``__wrapped__``...) are the top-level jit's.
    """

    def __init__(self, fun: Callable[..., Any], jit_kwargs: dict[str, Any]) -> None:
        self._top = jax.jit(fun, compiler_options=VECTOR_OPTIONS, **jit_kwargs)
        self._nested = jax.jit(fun, **jit_kwargs)
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # No check on the fast path (a top-level call is the hot one at B = 1): JAX
        # raises before it stages anything into the caller's program, so the
        # nested jit can take over from there.
        try:
            return self._top(*args, **kwargs)
        except ValueError as err:
            if _NESTED_MESSAGE not in str(err):
                raise
        return self._nested(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._top, name)


def vector_jit(fun: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """``jax.jit(fun, **jit_kwargs)`` with :data:`VECTOR_OPTIONS` wherever JAX allows them.

    A decorator (``@vector_jit`` or ``@vector_jit(static_argnames=...)``). Called
    at the top level it runs the jit with the options; called inside another
    ``jax.jit`` (or ``grad``), the same function without them, traced into the
    caller's program.
    """
    if fun is None:
        return functools.partial(vector_jit, **jit_kwargs)
    return _TopLevelOptions(fun, jit_kwargs)
