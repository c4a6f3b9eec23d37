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

This module takes and returns JAX arrays (:func:`_rejection_sample_jit` and its
primitives); :func:`specjax.rejection_sample`, which converts and validates
user inputs first, lives in :mod:`specjax.boundary.api`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from specjax import _compat
from specjax.kernels import cpu_kernels
from specjax.kernels.types import AcceptanceResult

__all__ = [
    "assemble_tokens",
    "block_sums",
    "compute_dtype",
    "draw_rows",
    "inverse_cdf",
    "num_accepted_from_ratios",
    "point_mass",
    "residual_weights",
    "row_sums",
    "to_blocks",
]

# Block width of the blocked inverse-CDF draw. A multiple of the SIMD width; the
# vocabulary is zero-padded up to a multiple of it.
_CDF_BLOCK = 128


def block_sums(blocks: jax.Array) -> jax.Array:
    """f[..., nb, k] -> f[..., nb]: the sum of each length-``k`` block.

    On CPU a matrix-vector product with ones: XLA:CPU runs a reduction over a
    short minor axis, fused with its elementwise producer, much slower than the
    GEMV over the materialised operand (see docs/benchmarks.md, kernel
    section). ``HIGHEST`` keeps full precision. Elsewhere ``jnp.sum``. Every
    sum over the vocabulary in the kernels goes through here or
    :func:`row_sums`, so every path computes its block and row sums the same
    way (a one-device mesh gives exactly the plain kernel's tokens).
    """

    def by_dot(b: jax.Array) -> jax.Array:
        return jnp.dot(b, jnp.ones((b.shape[-1],), b.dtype), precision=lax.Precision.HIGHEST)

    return lax.platform_dependent(blocks, cpu=by_dot, default=lambda b: jnp.sum(b, axis=-1))


def to_blocks(x: jax.Array) -> jax.Array:
    """f[..., V] -> f[..., nb, k]: the last axis zero-padded and cut into blocks.

    ``k = min(128, V)`` and ``nb = ceil(V / k)``; block ``b`` holds entries
    ``b·k .. b·k + k - 1`` (padding zeros after ``V - 1``).
    """
    vocab = x.shape[-1]
    k = min(_CDF_BLOCK, vocab)
    nb = -(-vocab // k)
    if nb * k != vocab:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * k - vocab)])
    return x.reshape(*x.shape[:-1], nb, k)


def row_sums(x: jax.Array) -> jax.Array:
    """f[..., V] -> f[...]: the sum over the last axis, as :func:`block_sums` of :func:`to_blocks`."""
    return jnp.sum(block_sums(to_blocks(x)), axis=-1)


def compute_dtype(dtype: Any) -> jnp.dtype:
    """The float dtype probabilities are compared in: at least float32."""
    return jnp.promote_types(dtype, jnp.float32)


def num_accepted_from_ratios(
    target_at_draft: jax.Array,
    draft_at_draft: jax.Array,
    accept_uniforms: jax.Array,
    num_draft_tokens: jax.Array | None = None,
) -> jax.Array:
    """Length of the accepted prefix, per row.

    Args:
      target_at_draft: f32[B, G], ``p_i(x_i)``.
      draft_at_draft: f32[B, G], ``q_i(x_i)``.
      accept_uniforms: f32[B, G], ``u_i``.
      num_draft_tokens: optional i32[B], ``k_b``: only the first ``k_b`` tests
        of row b run (a ragged draft); the others count as failures.

    Returns:
      i32[B]: ``n``, the number of tests passed before the first failure.

    Test ``i`` passes iff ``u_i < p_i(x_i) / q_i(x_i)``. With ``q_i(x_i) = 0``
    that reads ``p_i(x_i) > 0`` (the ratio is +inf, or NaN when both are 0), so
    a token the target gives probability zero never passes, whatever ``u_i``.
    """
    p, q, u = target_at_draft, draft_at_draft, accept_uniforms
    p_pos, q_pos = is_positive(p), is_positive(q)
    passes = jnp.where(q_pos, (u < positive_ratio(p, q)) | ((u == 0) & p_pos), p_pos)
    if num_draft_tokens is not None:
        positions = jnp.arange(p.shape[1], dtype=jnp.int32)
        passes = passes & (positions[None, :] < num_draft_tokens[:, None])
    return jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def _int_view(x: jax.Array) -> jax.Array:
    """The bits of a float array as a signed integer of the same width."""
    return lax.bitcast_convert_type(x, {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize])


def is_positive(x: jax.Array) -> jax.Array:
    """``x > 0`` decided on the bits, so subnormals count as positive.

    XLA:CPU flushes subnormal floats to zero (FTZ/DAZ) in arithmetic and in
    comparisons; a probability of 1e-40 is still a positive probability.
    """
    return _int_view(x) > 0


def positive_ratio(p: jax.Array, q: jax.Array) -> jax.Array:
    """``p / q`` for ``q > 0`` (bits), exact also when both are subnormal.

    Subnormal values are their bit patterns times one constant, so for two
    subnormals the ratio of the integer views is the ratio of the values.
    """
    tiny = _int_view(jnp.asarray(jnp.finfo(p.dtype).tiny, p.dtype))
    pi, qi = _int_view(p), _int_view(q)
    both_subnormal = (pi < tiny) & (qi < tiny) & (qi > 0)
    int_ratio = pi.astype(p.dtype) / jnp.where(both_subnormal, qi, 1).astype(p.dtype)
    safe_q = jnp.where(qi > 0, q, 1)
    return jnp.where(both_subnormal, int_ratio, p / safe_q)


def below_one(u: jax.Array) -> jax.Array:
    """Clamp uniforms to the largest value below 1 of their dtype.

    A float64 uniform just below 1 can round to 1.0 when JAX stores it as
    float32; the contract's ``u < 1`` must survive that narrowing.
    """
    return jnp.minimum(u, jnp.nextafter(jnp.asarray(1, u.dtype), jnp.asarray(0, u.dtype)))


def inverse_cdf(weights: jax.Array, sample_uniforms: jax.Array) -> jax.Array:
    """Draw one index per row by inverse CDF of non-negative, unnormalised weights.

    Args:
      weights: f32[B, V], non-negative; each row must have a positive sum.
      sample_uniforms: f32[B], ``s`` in [0, 1).

    Returns:
      i32[B]: the smallest ``v`` with ``(w(0)+…+w(v)) / Σ w > s``. When float
      rounding leaves no such ``v``, the largest ``v`` with ``w(v) > 0``. The
      result always has ``w(v) > 0``.
    """
    blocks = to_blocks(weights)  # [B, nb, k]
    nb, k = blocks.shape[1:]
    sums = block_sums(blocks)  # [B, nb]
    block_cdf = jnp.cumsum(sums, axis=1)  # [B, nb]
    total = block_cdf[:, -1]
    threshold = sample_uniforms.astype(weights.dtype) * total  # [B]

    # Block holding the draw: the first block whose cumulative sum exceeds s·Σw.
    blk = jnp.sum(block_cdf <= threshold[:, None], axis=1, dtype=jnp.int32)
    found_block = blk < nb
    blk_c = jnp.minimum(blk, nb - 1)
    prev = jnp.where(
        blk_c > 0,
        jnp.take_along_axis(block_cdf, jnp.maximum(blk_c - 1, 0)[:, None], axis=1)[:, 0],
        0,
    )
    rows = jnp.take_along_axis(blocks, blk_c[:, None, None], axis=1)[:, 0]  # [B, k]
    inner_cdf = prev[:, None] + jnp.cumsum(rows, axis=1)
    j = jnp.sum(inner_cdf <= threshold[:, None], axis=1, dtype=jnp.int32)
    lane = jnp.arange(k, dtype=jnp.int32)
    # Rounding fallbacks: the last positive entry of the chosen block, or of the row.
    last_in_block = jnp.max(jnp.where(rows > 0, lane[None, :], -1), axis=1)
    block_ids = jnp.arange(nb, dtype=jnp.int32)
    last_block = jnp.max(jnp.where(sums > 0, block_ids[None, :], -1), axis=1)
    last_block_c = jnp.maximum(last_block, 0)
    last_rows = jnp.take_along_axis(blocks, last_block_c[:, None, None], axis=1)[:, 0]
    last_in_last_block = jnp.max(jnp.where(last_rows > 0, lane[None, :], -1), axis=1)

    in_block = jnp.where(j < k, j, last_in_block)
    y = jnp.where(found_block, blk_c * k + in_block, last_block_c * k + last_in_last_block)
    return y.astype(jnp.int32)


def assemble_tokens(
    draft_tokens: jax.Array, num_accepted: jax.Array, emitted: jax.Array, vocab: int | None = None
) -> jax.Array:
    """i32[B, G+1]: the accepted draft tokens, then ``emitted``, then -1.

    With ``vocab``, ``emitted`` is clipped to [0, V): the draws never leave it on
    valid inputs, but unvalidated degenerate ones (a distribution with no
    positive weight, NaN) must still give an id, never -1 (the padding marker).
    """
    b, g = draft_tokens.shape
    if vocab is not None:
        emitted = jnp.clip(emitted, 0, vocab - 1)
    positions = jnp.arange(g + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([draft_tokens.astype(jnp.int32), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    n = num_accepted[:, None]
    return jnp.where(positions < n, padded, jnp.where(positions == n, emitted[:, None], -1))


def residual_weights(target_row: jax.Array, draft_row: jax.Array) -> jax.Array:
    """f32[B, V]: ``max(p_n - q_n, 0)``, or ``p_n`` for rows where that sums to zero."""
    residual = jnp.maximum(target_row - draft_row, 0)
    empty = row_sums(residual)[:, None] <= 0
    return jnp.where(empty, target_row, residual)


def draw_rows(
    rows: Any,
    row_fn: Any,
    sample_uniforms: jax.Array,
) -> jax.Array:
    """Draw ``y`` per batch row from ``residual_weights(*row_fn(row))``.

    Args:
      rows: a pytree of arrays with a leading batch axis B (the per-row inputs).
      row_fn: maps one row's slice of ``rows`` to ``(p_row f32[V], q_row f32[V])``.
      sample_uniforms: f32[B].

    Returns:
      i32[B], as :func:`inverse_cdf` of :func:`residual_weights` (same blocks,
      same sums, so the same tokens). On CPU the rows are drawn one at a time
      (``lax.map``): each row is read once into its block sums, then only the
      one 128-wide block holding the draw is re-read, so the temporaries are a
      few rows, not (B, V) buffers. Elsewhere the batch is drawn vectorised.
    """

    def vectorised(rows, s):
        p_n, q_n = jax.vmap(row_fn)(rows)
        return inverse_cdf(residual_weights(p_n, q_n), s)

    def per_row(rows, s):
        # Map over row indices with ``rows`` closed over (loop invariants), not over
        # ``rows`` themselves: a scan over (B, G+1, V) inputs would copy each row's
        # whole (G+1, V) slice per iteration, where the draw reads two V-rows.
        def one(i):
            def read() -> tuple[jax.Array, jax.Array]:
                row = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), rows)
                return row_fn(row)

            return _draw_one(read, s[i])

        return lax.map(one, jnp.arange(s.shape[0], dtype=jnp.int32))

    return lax.platform_dependent(rows, sample_uniforms, cpu=per_row, default=vectorised)


def _find_block(sums: jax.Array, s: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The first block whose cumulative sum exceeds ``s * total``, in two levels.

    Args:
      sums: f32[nb], non-negative; s: scalar in [0, 1).

    Returns:
      ``(blk, prev, threshold)``: i32 index (``nb`` when rounding leaves no
      such block), the cumulative sum before it, and ``s * total``. The cumulative sum
      runs over groups of 32 blocks, then inside the chosen group: two short
      scans instead of one over all ``nb`` blocks (a scan costs far more per
      element than a sum on XLA:CPU).
    """
    nb = sums.shape[0]
    w = 32
    ng = -(-nb // w)
    padded = jnp.pad(sums, (0, ng * w - nb)).reshape(ng, w)
    group_cdf = jnp.cumsum(jnp.sum(padded, axis=1))
    total = group_cdf[-1]
    threshold = s * total
    count = jnp.sum(group_cdf <= threshold, dtype=jnp.int32)
    found = count < ng
    grp = jnp.minimum(count, ng - 1)
    before = jnp.where(grp > 0, group_cdf[jnp.maximum(grp - 1, 0)], 0)
    blocks = lax.dynamic_index_in_dim(padded, grp, 0, keepdims=False)
    inner = before + jnp.cumsum(blocks)
    j = jnp.sum(inner <= threshold, dtype=jnp.int32)
    # Rounding: the group's own running sum may stay <= the threshold although its
    # total exceeded it; then take the group's last block with positive weight.
    lane = jnp.arange(w, dtype=jnp.int32)
    j = jnp.where(j < w, j, jnp.max(jnp.where(blocks > 0, lane, 0)))
    prev = jnp.where(j > 0, inner[jnp.maximum(j - 1, 0)], before)
    blk = jnp.where(found, grp * w + j, nb)
    return blk.astype(jnp.int32), prev, threshold


def _draw_one(read: Callable[[], tuple[jax.Array, jax.Array]], s: jax.Array) -> jax.Array:
    """One row of :func:`draw_rows`: ``read()`` gives the f32[V] target and draft rows; s scalar -> i32.

    One pass reads both rows into the residual ``max(p - q, 0)`` (a one-row,
    cache-sized temporary) and :func:`block_sums` turns it into 128-wide block
    sums; only the block holding the draw is recomputed from ``p`` and ``q``
    (``p`` itself, in the rare case where the residual is all zero). The rows
    are read through ``read`` so that the rare branch reads ``p`` from the
    inputs itself: a row passed into ``lax.cond`` would be copied on every call.
    """

    def blocks() -> tuple[jax.Array, jax.Array]:
        p_row, q_row = read()
        return to_blocks(p_row), to_blocks(q_row)

    p_blocks, q_blocks = blocks()
    nb, k = p_blocks.shape
    dtype = p_blocks.dtype
    res_sums = block_sums(jnp.maximum(p_blocks - q_blocks, 0))
    empty = jnp.sum(res_sums) <= 0
    sums = lax.cond(empty, lambda: block_sums(blocks()[0]), lambda: res_sums)
    blk, prev, threshold = _find_block(sums, s.astype(dtype))
    found = blk < nb
    ids = jnp.arange(nb, dtype=jnp.int32)
    last_block = jnp.maximum(jnp.max(jnp.where(sums > 0, ids, -1)), 0)
    b = jnp.where(found, blk, last_block)
    prev = jnp.where(found, prev, 0)
    p_b = lax.dynamic_index_in_dim(p_blocks, b, 0, keepdims=False)
    q_b = lax.dynamic_index_in_dim(q_blocks, b, 0, keepdims=False)
    row = jnp.where(empty, p_b, jnp.maximum(p_b - q_b, 0))
    j = jnp.sum(prev + jnp.cumsum(row) <= threshold, dtype=jnp.int32)
    lane = jnp.arange(k, dtype=jnp.int32)
    last_in = jnp.max(jnp.where(row > 0, lane, -1))
    return (b * k + jnp.where(found & (j < k), j, last_in)).astype(jnp.int32)


def point_mass(token: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """f[..., V]: the point mass at ``token`` (i32[...]) over ``ids`` (i32[V]).

    The draft distribution of a deterministic proposal (an n-gram match, a
    greedy head): ``q(v) = [v == token]``. Then test ``i`` reads ``u_i < p_i(x_i)``
    and the residual ``max(p_n - q_n, 0)`` is ``p_n`` with ``x_n`` removed. Built
    one row at a time inside the draw, never as a (B, G, V) array.
    """
    return (ids == token[..., None]).astype(dtype)


def _gather_draft_probs(
    target_probs: jax.Array, draft_probs: jax.Array | None, draft_tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(p_i(x_i), q_i(x_i))``: f[B, G] each, in the inputs' dtypes; B·G scalars, never (B, G, V).

    ``draft_probs=None`` means point masses: ``q_i(x_i) = 1``. An id outside
    [0, V) (possible with ``validate=False``) has probability 0 on both sides,
    so it is never accepted.

    One row at a time (``lax.map`` over row indices, the inputs loop
    invariants): on XLA:CPU a gather over the whole (B, G, V) arrays at once
    was several times slower, more so as G grows.
    """
    vocab = target_probs.shape[-1]

    def one(i: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = lax.dynamic_index_in_dim(draft_tokens, i, 0, keepdims=False)  # i32[G]
        inside = (x >= 0) & (x < vocab)
        xc = jnp.clip(x, 0, vocab - 1)[:, None]
        p_row = lax.dynamic_index_in_dim(target_probs, i, 0, keepdims=False)[: x.shape[0]]
        p_x = jnp.where(inside, jnp.take_along_axis(p_row, xc, axis=1)[:, 0], 0)
        if draft_probs is None:
            return p_x, jnp.ones_like(p_x)
        q_row = lax.dynamic_index_in_dim(draft_probs, i, 0, keepdims=False)
        return p_x, jnp.where(inside, jnp.take_along_axis(q_row, xc, axis=1)[:, 0], 0)

    return lax.map(one, jnp.arange(draft_tokens.shape[0], dtype=jnp.int32))


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
    g = draft_tokens.shape[1]
    q_dtype = target_probs.dtype if draft_probs is None else draft_probs.dtype
    ct = compute_dtype(jnp.result_type(q_dtype, target_probs.dtype))
    draft_tokens = draft_tokens.astype(jnp.int32)
    p_x, q_x = _gather_draft_probs(target_probs, draft_probs, draft_tokens)
    p_x, q_x = p_x.astype(ct), q_x.astype(ct)
    n = num_accepted_from_ratios(p_x, q_x, below_one(accept_uniforms.astype(ct)))
    vocab = target_probs.shape[-1]

    def row_fn(row):
        p_b, q_b, x_b, n_b = row  # f[G+1, V], f[G, V] or None, i32[G], i32[]
        p_row = lax.dynamic_index_in_dim(p_b, n_b, 0, keepdims=False).astype(ct)
        if g == 0:
            return p_row, jnp.zeros_like(p_row)
        pos = jnp.minimum(n_b, g - 1)
        if q_b is None:
            q_row = point_mass(lax.dynamic_index_in_dim(x_b, pos, 0, keepdims=False), lax.iota(jnp.int32, vocab), ct)
        else:
            q_row = lax.dynamic_index_in_dim(q_b, pos, 0, keepdims=False).astype(ct)
        return p_row, jnp.where(n_b < g, q_row, 0)

    def jax_draw() -> jax.Array:
        return draw_rows((target_probs, draft_probs, draft_tokens, n), row_fn, sample_uniforms.astype(ct))

    def cpu_draw() -> jax.Array:
        # The same draw in one C++ pass per row (specjax.kernels.cpu_kernels.draw_probs).
        assert draft_probs is not None  # point masses take the JAX draw
        rows = cpu_kernels.draw_rows_index(n, g)
        return cpu_kernels.draw_probs(
            target_probs.reshape(-1, vocab), draft_probs.reshape(-1, vocab), rows, sample_uniforms.astype(ct)
        )

    # float32 inputs only: others would need a converted copy of the whole inputs.
    if (
        draft_probs is not None
        and target_probs.dtype == draft_probs.dtype == ct == jnp.float32
        and cpu_kernels.require(impl)
    ):
        y = lax.platform_dependent(cpu=cpu_draw, default=jax_draw)
    else:
        y = jax_draw()
    return AcceptanceResult(n, assemble_tokens(draft_tokens, n, y, target_probs.shape[-1]))


# The public rejection_sample (inputs of any kind) lives at the boundary now; this path (and the installed
# `specjax.samplers` entry point metadata) still resolves to it. See specjax._compat.
_MOVED = {"rejection_sample": "specjax.boundary.api"}


def __getattr__(name: str) -> Any:
    return _compat.moved(__name__, name, _MOVED)
