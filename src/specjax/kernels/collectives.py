"""Traceable building blocks over a vocabulary split across a mesh axis (inside ``shard_map``).

Each takes ``axis_name`` (None: one device, where it is the single-device
primitive of :mod:`specjax.kernels.rejection`) and combines shards with
collectives of row-shaped arrays only, so the bytes moved never grow with V.
The logits front end (:mod:`specjax.kernels.frontend`) and the mesh entry points
(:mod:`specjax.kernels.sharded`) compose them; this module imports neither.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels.rejection import (
    _int_view,
    block_sums,
    inverse_cdf,
    residual_weights,
    row_sums,
    to_blocks,
)

__all__ = ["AxisName", "sharded_cutoff", "sharded_inverse_cdf", "sharded_residual_weights"]

# The mesh axis (or axes) the vocabulary is split over inside shard_map; None on one device.
AxisName = str | tuple[str, ...] | None


def sharded_residual_weights(target_row: jax.Array, draft_row: jax.Array, axis_name: AxisName) -> jax.Array:
    """f32[B, L]: ``max(p_n - q_n, 0)``, or ``p_n`` where that sums to zero over all shards.

    Args:
      target_row: f32[B, L], this shard's slice of ``p_n``.
      draft_row: f32[B, L], this shard's slice of ``q_n`` (zeros when ``n = G``).
      axis_name: the vocabulary mesh axis (None: one device, see
        :func:`~specjax.kernels.rejection.residual_weights`).
    """
    if not axis_name:
        return residual_weights(target_row, draft_row)
    residual = jnp.maximum(target_row - draft_row, 0)
    # Non-negative terms: the global sum is 0 iff every term is, whatever the order.
    empty = lax.psum(row_sums(residual), axis_name) <= 0
    return jnp.where(empty[:, None], target_row, residual)


def sharded_inverse_cdf(
    weights: jax.Array,
    sample_uniforms: jax.Array,
    axis_name: AxisName,
    offset: jax.Array | int,
) -> jax.Array:
    """Inverse-CDF draw over a vocabulary split across ``axis_name`` (replicated result).

    Args:
      weights: f32[B, L], non-negative: this shard's slice of the unnormalised
        weights, global ids ``offset .. offset + L - 1``.
      sample_uniforms: f32[B], ``s`` in [0, 1), the same on every shard.
      axis_name: the vocabulary mesh axis (None: :func:`inverse_cdf` on one device).
      offset: the global id of this shard's first entry (``axis_index · L``).

    Returns:
      i32[B], the same on every shard: the smallest global ``v`` with
      ``(w(0)+…+w(v)) / Σw > s``, where the cumulative sums are the shard
      totals' cumulative sum plus the shard's blocked cumulative sums. When
      rounding leaves no such ``v`` (``s·Σw`` at or above every cumulative
      value), the largest ``v`` with ``w(v) > 0`` over all shards; when the
      owning shard's own sums round below the threshold, its largest positive
      ``v``. The result always has ``w(v) > 0`` (-1 only if every weight is 0).

    Collectives: one all-gather of (B,) shard totals and one ``pmax`` of (2, B)
    int32.
    """
    if not axis_name:
        return inverse_cdf(weights, sample_uniforms)
    size = weights.shape[1]
    blocks = to_blocks(weights)  # [B, nb, k], local
    nb, k = blocks.shape[1:]
    block_cdf = jnp.cumsum(block_sums(blocks), axis=1)  # [B, nb], local
    totals = lax.all_gather(block_cdf[:, -1], axis_name, axis=1, tiled=False)  # [B, S]
    num_shards = totals.shape[1]
    shard_cdf = jnp.cumsum(totals, axis=1)  # identical on every shard
    threshold = sample_uniforms.astype(weights.dtype) * shard_cdf[:, -1]
    owner = jnp.sum(shard_cdf <= threshold[:, None], axis=1, dtype=jnp.int32)  # S: none

    me = lax.axis_index(axis_name)
    start = jnp.where(me > 0, lax.dynamic_index_in_dim(shard_cdf, jnp.maximum(me - 1, 0), 1, False), 0)
    cum = start[:, None] + block_cdf
    blk = jnp.sum(cum <= threshold[:, None], axis=1, dtype=jnp.int32)
    found_block = blk < nb
    blk_c = jnp.minimum(blk, nb - 1)
    prev = jnp.where(
        blk_c > 0,
        jnp.take_along_axis(cum, jnp.maximum(blk_c - 1, 0)[:, None], axis=1)[:, 0],
        start,
    )
    rows = jnp.take_along_axis(blocks, blk_c[:, None, None], axis=1)[:, 0]  # [B, k]
    j = jnp.sum(prev[:, None] + jnp.cumsum(rows, axis=1) <= threshold[:, None], axis=1, dtype=jnp.int32)
    lane = jnp.arange(k, dtype=jnp.int32)
    last_in_block = jnp.max(jnp.where(rows > 0, lane[None, :], -1), axis=1)
    ids = jnp.arange(size, dtype=jnp.int32)
    last_here = jnp.max(jnp.where(weights > 0, ids[None, :], -1), axis=1)  # local id or -1

    local = jnp.where(found_block, blk_c * k + jnp.where(j < k, j, last_in_block), last_here)
    mine = (owner == me) & (local >= 0)
    candidate = jnp.where(mine, local + offset, -1)
    last_global = jnp.where(last_here >= 0, last_here + offset, -1)
    best = lax.pmax(jnp.stack([candidate, last_global]), axis_name)  # [2, B]
    return jnp.where((owner < num_shards) & (best[0] >= 0), best[0], best[1]).astype(jnp.int32)


# float32 <-> uint32 keys that sort like the floats: -inf < … < -0 < +0 < … < +inf.
_KEY_NEG_INF = np.uint32(0x007FFFFF)
_KEY_POS_INF = np.uint32(0xFF800000)
_SIGN = np.uint32(0x80000000)


def _float_key(x: jax.Array) -> jax.Array:
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _key_float(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >= _SIGN, key & ~_SIGN, ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_float(pred: Any, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Smallest float32 ``t`` in [-inf, +inf] with ``pred(t)`` (monotone: False…True).

    Bisection over the ordered bit patterns: 32 steps, each one ``pred`` call.
    Returns ``(t, pred(+inf))``; ``t`` is +inf when ``pred`` is False throughout.

    The steps are unrolled: ``pred`` holds a ``psum``, and XLA:CPU's in-process
    collectives give a collective in a loop the same rendezvous key in every
    iteration, so a device that runs ahead into the next iteration joins the
    previous one's rendezvous ("Check failed: id < num_threads", or SIGSEGV).
    It happened on busy CPUs with a simulated multi-device mesh (docs/distributed.md).
    """
    lo = jnp.full(shape, _KEY_NEG_INF, jnp.uint32)
    hi = jnp.full(shape, _KEY_POS_INF, jnp.uint32)
    top = pred(jnp.full(shape, jnp.inf, jnp.float32))

    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(_key_float(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, hi = lax.fori_loop(0, 32, step, (lo, hi), unroll=True)
    return _key_float(hi), top


def sharded_cutoff(
    scaled: jax.Array,
    top_k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    axis_name: AxisName,
) -> jax.Array:
    """Smallest kept scaled logit under top-k then top-p, over a vocabulary-sharded axis.

    The sharded counterpart of the sort-based cutoff in
    :func:`specjax.kernels.frontend.row_stats` (no sort, no gather):

    * top-k: the k-th largest value is the smallest float ``t`` with fewer than
      ``k`` values above it (``psum``'d counts), found by bisection; bit-exact.
    * top-p: with ``prob`` the softmax over the top-k survivors, the cutoff is
      the smallest value ``t`` whose mass ``Σ prob(v ≤ t)`` exceeds ``1 - top_p``
      (the single-device "drop the prefix of the ascending cumulative sum that is
      ``<= 1 - top_p``"), or the row maximum when no value does. The mass is a
      ``psum`` of shard sums, so it can differ from the sorted cumulative sum in
      the last bits.

    Args:
      scaled: f32[..., L], this shard's temperature-scaled logits.
      top_k: optional i32[...]; 0 keeps all.
      one_minus_top_p: optional f32[...], ``1 - top_p``; 0 keeps all.
      axis_name: the vocabulary mesh axis.

    Returns:
      f32[...] (replicated over ``axis_name``): -inf when nothing is dropped.
      Padded -inf entries are never counted as kept mass.
    """
    rows = scaled.shape[:-1]
    cut = jnp.full(rows, -jnp.inf, jnp.float32)
    if top_k is not None:
        k = jnp.maximum(top_k, 0)

        def fewer_than_k_above(t):
            above = lax.psum(jnp.sum(scaled > t[..., None], axis=-1, dtype=jnp.int32), axis_name)
            return above < k

        kth, _ = _smallest_float(fewer_than_k_above, rows)
        cut = jnp.where(k > 0, kth, cut)
    if one_minus_top_p is not None:
        m = lax.pmax(jnp.max(scaled, axis=-1), axis_name)
        kept = scaled >= cut[..., None]
        e = jnp.where(kept, jnp.exp(scaled - m[..., None]), 0)
        prob = e / lax.psum(row_sums(e), axis_name)[..., None]

        def mass_above_theta(t):
            mass = lax.psum(jnp.sum(jnp.where(scaled <= t[..., None], prob, 0), axis=-1), axis_name)
            return mass > one_minus_top_p

        cut_p, any_kept = _smallest_float(mass_above_theta, rows)
        cut_p = jnp.where(any_kept, cut_p, m)
        cut = jnp.where(one_minus_top_p > 0, jnp.maximum(cut, cut_p), cut)
    return cut


def _psum_owned(values: tuple[jax.Array, ...], axis_name: AxisName) -> tuple[jax.Array, ...]:
    """psum of values that one shard owns and the others hold as +0, bit for bit.

    Summed as integer bit patterns, so a subnormal probability survives (XLA:CPU
    flushes subnormals to zero in float arithmetic, and the acceptance test
    counts them as positive).
    """
    bits = lax.psum(tuple(_int_view(v) for v in values), axis_name)
    return tuple(lax.bitcast_convert_type(b, v.dtype) for b, v in zip(bits, values, strict=True))
