"""The speculative-decoding acceptance kernel (rejection sampling over draft tokens).

Vocabulary used throughout specjax
----------------------------------
B
    batch rows (independent requests).
G
    draft length: the number of tokens the draft model proposed per row.
V
    vocabulary size.
draft tokens ``x_0 .. x_{G-1}``
    the tokens proposed by the draft model, ``x_i`` sampled from ``q_i``.
draft distribution ``q_i``
    the distribution the draft model sampled ``x_i`` from.
target distribution ``p_i``
    the target model's distribution at the same position; ``p_G`` is the target
    distribution after the last draft token.
accepted tokens
    the prefix ``x_0 .. x_{n-1}`` of draft tokens that passed their tests.
correction token
    the token drawn from the residual ``max(p_n - q_n, 0)`` when test ``n < G``
    failed.
bonus token
    the token drawn from ``p_G`` when all ``G`` tests passed.
emitted token ``y``
    the correction or bonus token.

The algorithm is Leviathan, Kalman & Matias 2023, "Fast Inference from
Transformers via Speculative Decoding" (arXiv:2211.17192), and Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling"
(arXiv:2302.01318): emitted sequences follow the target distribution exactly.

Implementation notes
--------------------
The kernel never materialises a (B, G, V) intermediate. It gathers ``p_i(x_i)``
and ``q_i(x_i)`` first (B·G scalars), finds ``n`` per row, then reads only row
``n`` of ``p`` and ``q`` for each batch row (two rows of V per batch row), and
draws ``y`` by a blocked inverse CDF: per-block sums, a cumulative sum over the
blocks, then a cumulative sum inside the one block that holds the draw. The
blocked sum is also more accurate than one long float32 running sum.

The step is :func:`rejection_body`, a composition of the primitives of
:mod:`specjax.kernels.core`; the same function runs on one device
(:func:`_rejection_sample_jit`) and, with ``axis_name``, on each vocabulary
shard of a mesh (:mod:`specjax.kernels.sharded`). This module takes and returns
JAX arrays; :func:`specjax.rejection_sample`, which converts and validates user
inputs first, lives in :mod:`specjax.boundary.api`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels import cpu_kernels
from specjax.kernels.core import (
    AxisName,
    assemble_tokens,
    below_one,
    compute_dtype,
    inverse_cdf,
    num_accepted_from_ratios,
    point_mass,
    psum_owned,
    residual_weights,
    take,
    take_rows,
)
from specjax.kernels.types import AcceptanceResult

__all__ = ["rejection_body"]


def _gather_draft_probs(
    target_probs: jax.Array, draft_probs: jax.Array | None, draft_tokens: jax.Array, offset: jax.Array | int = 0
) -> tuple[jax.Array, jax.Array]:
    """``(p_i(x_i), q_i(x_i))``: f[B, G] each, in the inputs' dtypes; B·G scalars, never (B, G, V).

    The probabilities hold the global ids ``offset .. offset + L - 1`` (a
    vocabulary shard, or the whole vocabulary at offset 0); an id outside them
    reads 0 on both sides: on a mesh another shard owns it
    (:func:`~specjax.kernels.core.psum_owned` combines them), on one device
    it is outside [0, V) (possible with ``validate=False``) and never accepted.
    ``draft_probs=None`` means point masses: ``q_i(x_i) = 1`` where owned.

    On XLA:CPU one row at a time (``lax.map`` over row indices, the inputs loop
    invariants): a gather over the whole (B, G, V) arrays at once was several
    times slower, more so as G grows. Elsewhere :func:`~specjax.kernels.core.take`
    (a masked pass, no gather: on a TPU any gather from these arrays costs a
    full read or more). The values are copied either way, bit for bit.
    """
    size = target_probs.shape[-1]
    g = draft_tokens.shape[1]

    def by_row() -> tuple[jax.Array, jax.Array]:
        def one(i: jax.Array) -> tuple[jax.Array, jax.Array]:
            local = lax.dynamic_index_in_dim(draft_tokens, i, 0, keepdims=False) - offset  # i32[G]
            inside = (local >= 0) & (local < size)
            xc = jnp.clip(local, 0, size - 1)[:, None]
            p_row = lax.dynamic_index_in_dim(target_probs, i, 0, keepdims=False)[: local.shape[0]]
            p_x = jnp.where(inside, jnp.take_along_axis(p_row, xc, axis=1)[:, 0], 0)
            if draft_probs is None:
                return p_x, inside.astype(p_x.dtype)
            q_row = lax.dynamic_index_in_dim(draft_probs, i, 0, keepdims=False)
            return p_x, jnp.where(inside, jnp.take_along_axis(q_row, xc, axis=1)[:, 0], 0)

        return lax.map(one, jnp.arange(draft_tokens.shape[0], dtype=jnp.int32))

    def masked() -> tuple[jax.Array, jax.Array]:
        local = draft_tokens - offset
        inside = (local >= 0) & (local < size)
        xc = jnp.clip(local, 0, size - 1)
        p_x = jnp.where(inside, take(target_probs[:, :g], xc, 2), 0)
        if draft_probs is None:
            return p_x, inside.astype(p_x.dtype)
        return p_x, jnp.where(inside, take(draft_probs, xc, 2), 0)

    return lax.platform_dependent(cpu=by_row, default=masked)


def rejection_body(
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
    *,
    axis_name: AxisName = None,
    impl: str = "xla",
) -> AcceptanceResult:
    """The acceptance step on probabilities (traceable; the contract of :func:`specjax.rejection_sample`).

    Args:
      draft_tokens: i32[B, G].
      draft_probs: f[B, G, L], or None for point masses at the draft tokens.
      target_probs: f[B, G+1, L].
      accept_uniforms: f[B, G]; sample_uniforms: f[B] (the same on every shard).
      axis_name: None on one device (L = V); inside ``shard_map``, the mesh
        axis the vocabulary is split over (L = V / S, this shard's slice).
      impl: ``"xla"`` or ``"cpu"`` (static): on one CPU device, ``"cpu"`` draws
        float32 rows with the C++ :func:`specjax.kernels.cpu_kernels.draw_probs`.

    Returns:
      :class:`AcceptanceResult`: i32[B] ``num_accepted`` and i32[B, G+1]
      ``tokens``, replicated over ``axis_name``.

    Per batch row only row ``n`` of ``p`` and ``q`` is read for the draw (two
    rows of L), after ``p_i(x_i)`` and ``q_i(x_i)`` (B·G scalars) gave ``n``.
    """
    g = draft_tokens.shape[1]
    size = target_probs.shape[-1]
    q_dtype = target_probs.dtype if draft_probs is None else draft_probs.dtype
    ct = compute_dtype(jnp.result_type(q_dtype, target_probs.dtype))
    offset = lax.axis_index(axis_name) * size if axis_name else 0
    x = draft_tokens.astype(jnp.int32)
    # Gathered in the input dtype; on a mesh one psum of (B, G) pairs, bit for bit.
    p_x, q_x = psum_owned(_gather_draft_probs(target_probs, draft_probs, x, offset), axis_name)
    n = num_accepted_from_ratios(p_x.astype(ct), q_x.astype(ct), below_one(accept_uniforms.astype(ct)))
    s = sample_uniforms.astype(ct)

    def jax_draw() -> jax.Array:
        def row(probs: jax.Array, index: jax.Array) -> jax.Array:  # f[B, L]: row index[b] of probs[b]
            return take_rows(probs, index, axis_name).astype(ct)

        p_n = row(target_probs, n)
        if g == 0:
            q_n = jnp.zeros_like(p_n)
        else:
            pos = jnp.minimum(n, g - 1)
            if draft_probs is None:
                x_n = jnp.take_along_axis(x, pos[:, None], axis=1)[:, 0]
                q_n = point_mass(x_n, lax.iota(jnp.int32, size) + offset, ct)
            else:
                q_n = row(draft_probs, pos)
            q_n = jnp.where((n < g)[:, None], q_n, 0)
        return inverse_cdf(residual_weights(p_n, q_n, axis_name), s, axis_name, offset)

    def cpu_draw() -> jax.Array:
        # The same draw in one C++ pass per row (specjax.kernels.cpu_kernels.draw_probs).
        assert draft_probs is not None  # point masses take the JAX draw
        rows = cpu_kernels.draw_rows_index(n, g)
        return cpu_kernels.draw_probs(target_probs.reshape(-1, size), draft_probs.reshape(-1, size), rows, s)

    # One device, float32 inputs only: others would need a converted copy of the whole inputs.
    if (
        not axis_name
        and draft_probs is not None
        and target_probs.dtype == draft_probs.dtype == ct == jnp.float32
        and cpu_kernels.require(impl)
    ):
        y = lax.platform_dependent(cpu=cpu_draw, default=jax_draw)
    else:
        y = jax_draw()
    return AcceptanceResult(n, assemble_tokens(x, n, y, None if axis_name else size))


# Recompiles only when the shapes or dtypes of the five inputs change, when
# draft_probs switches between an array and None (point masses), or impl changes.
@partial(jax.jit, static_argnames=("impl",))
def _rejection_sample_jit(
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
    impl: str = "xla",
) -> AcceptanceResult:
    return rejection_body(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, impl=impl)
