"""The result of an acceptance step as a small named type, free of JAX.

:class:`AcceptanceResult` holds ``num_accepted`` and ``tokens`` (vocabulary:
see :mod:`specjax.kernels.rejection`): JAX arrays from the kernels, NumPy
arrays or torch tensors from the reference samplers
(:mod:`specjax.plugin.reference_samplers`), which never import JAX; hence this
module does not either. :mod:`specjax.kernels.types`, which every kernel
imports, registers the class as a JAX pytree (data fields ``num_accepted``,
``tokens``), so it passes through ``jit``, ``shard_map`` and ``jax.tree.map``.

It still answers the old dict-style access (``out["tokens"]``, ``"tokens" in
out``, ``out.keys()``, ...) for one release, with a ``DeprecationWarning``
naming the attribute to use.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["RESULT_FIELDS", "AcceptanceResult"]

#: A jax.Array from the kernels; NumPy arrays or torch tensors from the reference samplers.
Array = Any

#: The data fields of :class:`AcceptanceResult`, in order.
RESULT_FIELDS = ("num_accepted", "tokens")


def _deprecated(what: str, instead: str) -> None:
    # stacklevel=3: the caller of the dict-style method, not this helper or the method.
    warnings.warn(
        f"AcceptanceResult: {what} is deprecated and will be removed in the next release; use {instead}",
        DeprecationWarning,
        stacklevel=3,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class AcceptanceResult:
    """The outcome of one acceptance step over B rows with G draft tokens each.

    Attributes:
      num_accepted: i32[B], ``n``: the draft tokens accepted before the first
        failed test (``k_b`` when none fails).
      tokens: i32[B, G+1]: row b holds the ``n`` accepted draft tokens, then the
        correction or bonus token ``y``, then -1.

    Dict-style access (``out["tokens"]``, ``"tokens" in out``, ``keys()``,
    ``values()``, ``items()``, ``get()``, iteration, ``len``) still works for one
    release and warns (``DeprecationWarning``); use the attributes, or ``vars(out)``
    for a dict.
    """

    num_accepted: Array
    tokens: Array

    def __getitem__(self, key: str) -> Array:
        if key not in RESULT_FIELDS:
            raise KeyError(key)
        _deprecated(f"out[{key!r}]", f"the attribute out.{key}")
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        _deprecated(f"out.get({key!r})", f"the attribute out.{key}" if key in RESULT_FIELDS else "the attributes")
        return getattr(self, key) if key in RESULT_FIELDS else default

    def __contains__(self, key: object) -> bool:
        _deprecated(f"{key!r} in out", "the attributes out.num_accepted and out.tokens")
        return key in RESULT_FIELDS

    def keys(self) -> tuple[str, ...]:
        _deprecated("out.keys()", "the attributes out.num_accepted and out.tokens, or vars(out)")
        return RESULT_FIELDS

    def values(self) -> tuple[Array, ...]:
        _deprecated("out.values()", "the attributes out.num_accepted and out.tokens, or vars(out)")
        return tuple(getattr(self, k) for k in RESULT_FIELDS)

    def items(self) -> tuple[tuple[str, Array], ...]:
        _deprecated("out.items()", "vars(out).items()")
        return tuple((k, getattr(self, k)) for k in RESULT_FIELDS)

    def __iter__(self) -> Iterator[str]:
        _deprecated("iterating over out", "the attributes out.num_accepted and out.tokens, or vars(out)")
        return iter(RESULT_FIELDS)

    def __bool__(self) -> bool:  # a result is truthy, as the two-key dict was, without a warning
        return True

    def __len__(self) -> int:
        _deprecated("len(out)", "the attributes out.num_accepted and out.tokens")
        return len(RESULT_FIELDS)
