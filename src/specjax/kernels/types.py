"""The kernels' parameter and result types as JAX pytrees: one pytree in, one named result out.

* :class:`SamplingParams`: the per-row sampling parameters (temperature,
  top-k, ``1 - top_p``) as data fields, and whether top-k / top-p are used at
  all as static fields. Passed to a jitted function, its data fields are traced
  (new values never recompile) and its static fields are part of the pytree's
  structure (switching top-k or top-p on or off recompiles, as it must: it
  decides whether rows get sorted).
* :class:`~specjax.kernels.results.AcceptanceResult`: ``num_accepted`` and
  ``tokens`` of an acceptance step. Defined without JAX in
  :mod:`specjax.kernels.results` (the NumPy/torch reference samplers return it
  too) and registered here.

Both are frozen dataclasses registered with
:func:`jax.tree_util.register_dataclass`, so they pass through ``jit``,
``shard_map`` and ``jax.tree.map`` like the tuples and dicts they replace.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax

from specjax.kernels.results import RESULT_FIELDS, AcceptanceResult

__all__ = ["AcceptanceResult", "SamplingParams"]

#: A jax.Array inside jit; the boundary builds them from host NumPy arrays (no
#: eager JAX operation per call).
Array = Any


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "one_minus_top_p"],
    meta_fields=["use_top_k", "use_top_p", "impl", "all_greedy"],
)
@dataclasses.dataclass(frozen=True, eq=False)
class SamplingParams:
    """Per-row sampling parameters of B rows, processed as transformers' warpers do.

    Attributes:
      temperature: f32[B]; 0 means greedy (one-hot at the first argmax).
      top_k: i32[B]; 0 keeps all. Read only when ``use_top_k``.
      one_minus_top_p: f32[B], ``1 - top_p`` (computed in float64 at the
        boundary, as transformers does); 0 keeps all. Read only when ``use_top_p``.
      use_top_k, use_top_p: static: whether any row uses top-k / top-p. The
        boundary fills an unused field with a (B,) placeholder, so the argument
        signature stays the same; kernel-level callers may leave it None.
      impl: static: ``"xla"`` (the JAX code, the default) or ``"cpu"`` (the C++
        CPU kernels where the function is lowered for a CPU;
        :mod:`specjax.kernels.cpu_kernels`). The boundary resolves its
        ``impl="auto"`` to one of them before tracing.
      all_greedy: static: a promise that every row's temperature is <= 0
        (greedy). Off the CPU the steps then trace the argmax rule alone, with
        no branch for sampled rows, so nothing else reads the logits. With it
        False (the default; the public entry points leave it so, since a
        static field recompiles) an all-greedy batch takes the same rule at
        run time. The device loop sets it for an all-greedy call
        (:func:`specjax.generate.jax_loop.known_greedy`).

    Recompiles (as an argument of a jitted function): when B or a dtype changes,
    or when ``use_top_k`` / ``use_top_p`` / ``impl`` / ``all_greedy`` change;
    never for other new values.
    """

    temperature: Array
    top_k: Array = None
    one_minus_top_p: Array = None
    use_top_k: bool = False
    use_top_p: bool = False
    impl: str = "xla"
    all_greedy: bool = False

    @property
    def active_top_k(self) -> Array | None:
        """``top_k`` when used, else None: the form the processing primitives take."""
        return self.top_k if self.use_top_k else None

    @property
    def active_one_minus_top_p(self) -> Array | None:
        """``one_minus_top_p`` when used, else None: the form the processing primitives take."""
        return self.one_minus_top_p if self.use_top_p else None


jax.tree_util.register_dataclass(AcceptanceResult, data_fields=list(RESULT_FIELDS), meta_fields=[])
