"""The result of an acceptance step as a small named type, free of JAX.

:class:`AcceptanceResult` holds ``num_accepted`` and ``tokens`` (vocabulary:
see :mod:`specjax.kernels.rejection`): JAX arrays from the kernels, NumPy
arrays or torch tensors from the reference samplers
(:mod:`specjax.plugin.reference_samplers`), which never import JAX; hence this
module does not either. :mod:`specjax.kernels.types`, which every kernel
imports, registers the class as a JAX pytree (data fields ``num_accepted``,
``tokens``), so it passes through ``jit``, ``shard_map`` and ``jax.tree.map``.
Read it by attribute (``out.tokens``); ``vars(out)`` gives a dict of the fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RESULT_FIELDS", "AcceptanceResult"]

#: A jax.Array from the kernels; NumPy arrays or torch tensors from the reference samplers.
Array = Any

#: The data fields of :class:`AcceptanceResult`, in order.
RESULT_FIELDS = ("num_accepted", "tokens")


@dataclasses.dataclass(frozen=True, eq=False)
class AcceptanceResult:
    """The outcome of one acceptance step over B rows with G draft tokens each.

    Attributes:
      num_accepted: i32[B], ``n``: the draft tokens accepted before the first
        failed test (``k_b`` when none fails).
      tokens: i32[B, G+1]: row b holds the ``n`` accepted draft tokens, then the
        correction or bonus token ``y``, then -1.
    """

    num_accepted: Array
    tokens: Array
