"""The acceptance core: the small traceable primitives every kernel is made of.

Each primitive is written once. Those that read across the vocabulary take an
optional ``axis_name``: None on one device; inside ``shard_map`` the mesh axis
the vocabulary is split over, where shards combine their partial results with
collectives of row-shaped arrays only (the bytes moved never grow with V). The
single-device kernels (:mod:`specjax.kernels.rejection`,
:mod:`specjax.kernels.frontend`), the generation loop's steps
(:mod:`specjax.kernels.steps`) and the mesh entry points
(:mod:`specjax.kernels.sharded`) are compositions of them, so a one-device mesh
runs exactly the single-device code (vocabulary of terms: see
:mod:`specjax.kernels.rejection`).

* sums over the vocabulary: :func:`to_blocks`, :func:`block_sums`, :func:`row_sums`;
* the accept test: :func:`num_accepted_from_ratios` (``u < p/q`` on the bits);
* per-platform exact gathers: :func:`take`, :func:`take_rows`;
* reductions over a (possibly split) vocabulary: :func:`vocab_max`,
  :func:`vocab_sum`, :func:`vocab_argmax`, :func:`vocab_gather`, :func:`psum_owned`;
* the residual and the draw: :func:`residual_weights`, :func:`inverse_cdf`,
  :func:`point_mass`, :func:`assemble_tokens`;
* the top-k / top-p cutoff: :func:`cutoff`.

The one optional fast path per backend (the C++ CPU kernels of
:mod:`specjax.kernels.cpu_kernels`) computes the same arithmetic and is tested
against these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import tpu_pallas

__all__ = [
    "AxisName",
    "assemble_tokens",
    "below_one",
    "block_sums",
    "compute_dtype",
    "cutoff",
    "first_argmax",
    "inverse_cdf",
    "is_positive",
    "num_accepted_from_ratios",
    "point_mass",
    "positive_ratio",
    "psum_owned",
    "residual_weights",
    "row_sums",
    "take",
    "take_rows",
    "to_blocks",
    "vocab_argmax",
    "vocab_gather",
    "vocab_max",
    "vocab_sum",
]

#: The mesh axis (or axes) the vocabulary is split over inside ``shard_map``; None on one device.
AxisName = str | tuple[str, ...] | None

# Block width of the blocked inverse-CDF draw. A multiple of the SIMD width; the
# vocabulary is zero-padded up to a multiple of it.
_CDF_BLOCK = 128
_NEG_INF = -jnp.inf


# --------------------------------------------------------------------------- #
# Sums over the vocabulary
# --------------------------------------------------------------------------- #


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


def below_one(u: jax.Array) -> jax.Array:
    """Clamp uniforms to the largest value below 1 of their dtype.

    A float64 uniform just below 1 can round to 1.0 when JAX stores it as
    float32; the contract's ``u < 1`` must survive that narrowing.
    """
    return jnp.minimum(u, jnp.nextafter(jnp.asarray(1, u.dtype), jnp.asarray(0, u.dtype)))


# --------------------------------------------------------------------------- #
# The accept test
# --------------------------------------------------------------------------- #


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


def num_accepted_from_ratios(
    target_at_draft: jax.Array,
    draft_at_draft: jax.Array,
    accept_uniforms: jax.Array,
    draft_lengths: jax.Array | None = None,
) -> jax.Array:
    """Length of the accepted prefix, per row.

    Args:
      target_at_draft: f32[B, G], ``p_i(x_i)``.
      draft_at_draft: f32[B, G], ``q_i(x_i)``.
      accept_uniforms: f32[B, G], ``u_i``.
      draft_lengths: optional i32[B], ``k_b``: only the first ``k_b`` tests
        of row b run (a ragged draft); the others count as failures.

    Returns:
      i32[B]: ``n``, the number of tests passed before the first failure.

    Test ``i`` passes iff ``u_i < p_i(x_i) / q_i(x_i)``. With ``q_i(x_i) = 0``
    that reads ``p_i(x_i) > 0`` (the ratio is +inf, or NaN when both are 0), so
    a token the target gives probability zero never passes, whatever ``u_i``.
    A NaN ``p_i(x_i)`` or ``q_i(x_i)`` (a non-finite distribution, possible
    with ``validate=False``) fails the test: the row then emits a token drawn
    by :func:`residual_weights`' rule, never a draft token vouched for by NaN.
    The inputs are replicated on a mesh (gathered with :func:`vocab_gather` or
    :func:`psum_owned`), so every shard takes the same decisions.
    """
    p, q, u = target_at_draft, draft_at_draft, accept_uniforms
    p_pos, q_pos = is_positive(p), is_positive(q)
    passes = jnp.where(q_pos, (u < positive_ratio(p, q)) | ((u == 0) & p_pos), p_pos)
    passes &= ~(jnp.isnan(p) | jnp.isnan(q))
    if draft_lengths is not None:
        positions = jnp.arange(p.shape[1], dtype=jnp.int32)
        passes = passes & (positions[None, :] < draft_lengths[:, None])
    return jnp.sum(jnp.cumprod(passes.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


# --------------------------------------------------------------------------- #
# Reductions over a (possibly split) vocabulary
# --------------------------------------------------------------------------- #


def vocab_max(x: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """f[..., L] -> f[...]: the row maxima over the whole vocabulary."""
    m = jnp.max(x, axis=-1)
    return lax.pmax(m, axis_name) if axis_name else m


def vocab_sum(x: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """f[..., L] -> f[...]: the row sums (:func:`row_sums` per shard, then a ``psum``)."""
    s = row_sums(x)
    return lax.psum(s, axis_name) if axis_name else s


def vocab_argmax(
    x: jax.Array, row_max: jax.Array, axis_name: AxisName = None, offset: jax.Array | int = 0
) -> jax.Array:
    """i32[...]: the first global index where ``x`` (f[..., L]) equals ``row_max`` (its global max).

    The first index on ties, like ``torch.argmax``; a NaN row gives ``L - 1 + offset``
    on one device (clipped, never out of range).
    """
    size = x.shape[-1]
    ids = lax.iota(jnp.int32, size)
    first = jnp.min(jnp.where(x == row_max[..., None], ids, size), axis=-1)
    if not axis_name:
        return jnp.minimum(first, size - 1) + offset
    big = jnp.iinfo(jnp.int32).max
    return lax.pmin(jnp.where(first < size, first + offset, big), axis_name)


def first_argmax(x: jax.Array) -> jax.Array:
    """i32[...]: ``vocab_argmax(x, vocab_max(x))`` of ``x`` (f[..., V]) on one device: the first index of each
    row's max, ``V - 1`` for a row with a NaN.

    That rule reads ``x`` twice (the max, then its first index). On a TPU the max and ``jnp.argmax`` (a
    first-index reduction of its own) are two reductions of one read, and a NaN row is told by its max;
    elsewhere the two passes (XLA:CPU vectorises a plain max, not a reduction over pairs).
    tests/test_platform_paths.py holds the TPU form to the rule bit for bit (ties, ±0, ±inf, NaN rows).
    """

    def one_read(x: jax.Array) -> jax.Array:
        first = jnp.argmax(x, axis=-1).astype(jnp.int32)
        return jnp.where(jnp.isnan(jnp.max(x, axis=-1)), jnp.int32(x.shape[-1] - 1), first)

    return lax.platform_dependent(x, tpu=one_read, default=lambda x: vocab_argmax(x, vocab_max(x)))


def take(x: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """``x`` at ``index`` along ``axis``, bit for bit (``take_along_axis`` without the kept axis).

    ``index``: i32 of ``x``'s shape without ``axis``, or broadcasting to it
    (i32[B, 1] picks one row per batch row of f[B, P, V]); in range.

    ``jnp.take_along_axis`` on XLA:CPU. Elsewhere (TPU) a gather of scattered
    elements or rows costs about a full read of ``x`` and more (its HBM tiles
    hold 8 rows of 128 entries; docs/tpu.md), so the value is picked by a
    compare against an iota and a sum over ``axis`` that fuses with the read,
    summed as integer bit patterns: one nonzero term, so NaN, -0 and
    subnormals (which float arithmetic flushes on a TPU) come out as they are.
    """

    def gather(x: jax.Array, index: jax.Array) -> jax.Array:
        return jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(index, axis), axis=axis), axis)

    return lax.platform_dependent(x, index, cpu=gather, default=lambda x, i: take_masked(x, i, axis))


def take_rows(x: jax.Array, index: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """f[B, P, L], i32[B] in [0, P) -> f[B, L]: row ``index[b]`` of ``x[b]``, bit for bit
    (:func:`take` along axis 1; ``axis_name`` is accepted for the mesh callers and changes nothing).

    A Pallas DMA of each row alone was measured on a TPU v5e and not kept (docs/tpu.md, section 4).
    """
    del axis_name
    return take(x, index[:, None], 1)


def take_masked(x: jax.Array, index: jax.Array, axis: int) -> jax.Array:
    """:func:`take` off CPU: a compare against an iota and an integer sum of the bits over ``axis``."""
    bits = _int_view(x)
    hit = lax.broadcasted_iota(jnp.int32, x.shape, axis % x.ndim) == jnp.expand_dims(index, axis)
    return lax.bitcast_convert_type(jnp.sum(jnp.where(hit, bits, 0), axis=axis, dtype=bits.dtype), x.dtype)


def vocab_gather(x: jax.Array, index: jax.Array, axis_name: AxisName = None, offset: jax.Array | int = 0) -> jax.Array:
    """``x[..., index]`` per row, for a (possibly sharded) last axis; NaN where ``index`` is outside it.

    A NaN logit has probability 0 in :func:`specjax.kernels.frontend.probs_from_stats`,
    so a draft token outside the vocabulary (possible with ``validate=False``)
    is never accepted, on every path.
    """
    local = index - offset
    size = x.shape[-1]
    inside = (local >= 0) & (local < size)
    val = take(x, jnp.clip(local, 0, size - 1), -1)
    if not axis_name:
        return jnp.where(inside, val, jnp.nan)
    found = lax.psum(inside.astype(jnp.int32), axis_name) > 0
    return jnp.where(found, lax.psum(jnp.where(inside, val, 0), axis_name), jnp.nan)


def psum_owned(values: tuple[jax.Array, ...], axis_name: AxisName = None) -> tuple[jax.Array, ...]:
    """psum of values that one shard owns and the others hold as +0, bit for bit (identity on one device).

    Summed as integer bit patterns, so a subnormal probability survives (XLA:CPU
    flushes subnormals to zero in float arithmetic, and the acceptance test
    counts them as positive).
    """
    if not axis_name:
        return values
    bits = lax.psum(tuple(_int_view(v) for v in values), axis_name)
    return tuple(lax.bitcast_convert_type(b, v.dtype) for b, v in zip(bits, values, strict=True))


# --------------------------------------------------------------------------- #
# The residual and the draw
# --------------------------------------------------------------------------- #


def point_mass(token: jax.Array, ids: jax.Array, dtype: Any) -> jax.Array:
    """f[..., V]: the point mass at ``token`` (i32[...]) over ``ids`` (i32[V]).

    The draft distribution of a deterministic proposal (an n-gram match, a
    greedy head): ``q(v) = [v == token]``. Then test ``i`` reads ``u_i < p_i(x_i)``
    and the residual ``max(p_n - q_n, 0)`` is ``p_n`` with ``x_n`` removed. Built
    one row per batch row inside the draw, never as a (B, G, V) array.
    """
    return (ids == token[..., None]).astype(dtype)


def residual_weights(target_row: jax.Array, draft_row: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """f32[B, L]: ``max(p_n - q_n, 0)``, or ``p_n`` for rows where that does not sum to a positive number.

    The residual is empty (sums to zero over all shards) when ``q_n >= p_n``
    everywhere; its sum is NaN when ``q_n`` or ``p_n`` holds a NaN (a
    non-finite distribution, possible with ``validate=False``). Either way the
    row draws from ``p_n``: with the test at ``n`` failed, that is the target's
    own law at that position, so a broken draft distribution costs speed,
    never exactness.

    Args:
      target_row: f32[B, L], (this shard's slice of) ``p_n``.
      draft_row: f32[B, L], (this shard's slice of) ``q_n`` (zeros when ``n = G``).
      axis_name: the vocabulary mesh axis, or None.
    """
    residual = jnp.maximum(target_row - draft_row, 0)  # NaN stays NaN (jnp.maximum propagates it)
    # Non-negative terms: the global sum is 0 iff every term is, whatever the order.
    empty = ~(vocab_sum(residual, axis_name) > 0)
    return jnp.where(empty[:, None], target_row, residual)


def inverse_cdf(
    weights: jax.Array,
    sample_uniforms: jax.Array,
    axis_name: AxisName = None,
    offset: jax.Array | int = 0,
) -> jax.Array:
    """Draw one index per row by a blocked inverse CDF of non-negative, unnormalised weights.

    Args:
      weights: f32[B, L], non-negative: (this shard's slice of) the weights,
        global ids ``offset .. offset + L - 1``.
      sample_uniforms: f32[B], ``s`` in [0, 1), the same on every shard.
      axis_name: the vocabulary mesh axis, or None (one device: one shard).
      offset: the global id of this shard's first entry (``axis_index · L``).

    Returns:
      i32[B], the same on every shard: the smallest global ``v`` with
      ``(w(0)+…+w(v)) / Σw > s``, where the cumulative sums are the shard
      totals' cumulative sum plus the shard's 128-wide block sums' cumulative
      sum plus the running sum inside the block that holds the draw (blocked
      sums are also more accurate than one long float32 running sum). When
      rounding leaves no such ``v`` (``s·Σw`` at or above every cumulative
      value), the largest ``v`` with ``w(v) > 0``; when the owning block's own
      running sum rounds below the threshold, its largest positive entry. The
      result always has ``w(v) > 0`` (-1 only if every weight is 0).

    Collectives (mesh only): one all-gather of (B,) shard totals and one
    ``pmax`` of (2, B) int32.
    """
    blocks = to_blocks(weights)  # [B, nb, k], local
    nb, k = blocks.shape[1:]
    sums = block_sums(blocks)  # [B, nb]
    block_cdf = jnp.cumsum(sums, axis=1)  # [B, nb], local
    me: jax.Array | int = 0
    if axis_name:
        totals = lax.all_gather(block_cdf[:, -1], axis_name, axis=1, tiled=False)  # [B, S]
        me = lax.axis_index(axis_name)
    else:
        totals = block_cdf[:, -1:]
    shard_cdf = jnp.cumsum(totals, axis=1)  # identical on every shard
    threshold = sample_uniforms.astype(weights.dtype) * shard_cdf[:, -1]
    # The shard holding the draw (S: none, by rounding).
    owner = jnp.sum(shard_cdf <= threshold[:, None], axis=1, dtype=jnp.int32)
    start = jnp.where(me > 0, lax.dynamic_index_in_dim(shard_cdf, jnp.maximum(me - 1, 0), 1, False), 0)

    # The block holding the draw: the first whose cumulative sum exceeds s·Σw.
    cum = start[:, None] + block_cdf
    blk = jnp.sum(cum <= threshold[:, None], axis=1, dtype=jnp.int32)
    found_block = blk < nb
    blk_c = jnp.minimum(blk, nb - 1)
    prev = jnp.where(blk_c > 0, jnp.take_along_axis(cum, jnp.maximum(blk_c - 1, 0)[:, None], axis=1)[:, 0], start)
    rows = take(blocks, blk_c[:, None], 1)  # [B, k]
    j = jnp.sum(prev[:, None] + jnp.cumsum(rows, axis=1) <= threshold[:, None], axis=1, dtype=jnp.int32)
    lane = jnp.arange(k, dtype=jnp.int32)
    # Rounding fallbacks: the last positive entry of the chosen block, or of the shard.
    last_in_block = jnp.max(jnp.where(rows > 0, lane[None, :], -1), axis=1)
    last_block = jnp.max(jnp.where(sums > 0, jnp.arange(nb, dtype=jnp.int32)[None, :], -1), axis=1)
    last_rows = take(blocks, jnp.maximum(last_block, 0)[:, None], 1)
    last_lane = jnp.max(jnp.where(last_rows > 0, lane[None, :], -1), axis=1)
    last_here = jnp.where(last_block >= 0, last_block * k + last_lane, -1)  # local id or -1

    local = jnp.where(found_block, blk_c * k + jnp.where(j < k, j, last_in_block), last_here)
    candidate = jnp.where((owner == me) & (local >= 0), local + offset, -1)
    last_global = jnp.where(last_here >= 0, last_here + offset, -1)
    best = jnp.stack([candidate, last_global])  # [2, B]
    if axis_name:
        best = lax.pmax(best, axis_name)
    return jnp.where((owner < totals.shape[1]) & (best[0] >= 0), best[0], best[1]).astype(jnp.int32)


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


# --------------------------------------------------------------------------- #
# The top-k / top-p cutoff
# --------------------------------------------------------------------------- #

# float32 <-> uint32 keys that sort like the floats: -inf < … < -0 < +0 < … < +inf.
_KEY_NEG_INF = np.uint32(0x007FFFFF)
_KEY_POS_INF = np.uint32(0xFF800000)
_SIGN = np.uint32(0x80000000)

# On one device the cutoff looks at the largest few logits first: lax.top_k over
# this many candidates is far cheaper than a pass per bisection step. Rows whose
# cutoff may lie below the candidates (top_k > 256, or a nucleus with more than
# the candidates' mass) take the bisection.
_CUTOFF_CANDIDATES = 256
# A row takes the candidates' top-p cutoff only if the mass outside them is
# below 1 - top_p by this margin, so that rounding cannot move the cutoff out.
_REST_MARGIN = 1e-5
# The TPU route's candidates: this many largest per lane (1024 for 128 lanes).
_LANE_DEPTH = 8


def _float_key(x: jax.Array) -> jax.Array:
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >= _SIGN, ~bits, bits | _SIGN)


def _key_float(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >= _SIGN, key & ~_SIGN, ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _smallest_float(
    pred: Callable[[jax.Array], jax.Array], shape: tuple[int, ...], unroll: bool
) -> tuple[jax.Array, jax.Array]:
    """Smallest float32 ``t`` in [-inf, +inf] with ``pred(t)`` (monotone: False…True).

    Bisection over the ordered bit patterns: 32 steps, each one ``pred`` call.
    Returns ``(t, pred(+inf))``; ``t`` is +inf when ``pred`` is False throughout.

    ``unroll``: True on a mesh, where ``pred`` holds a ``psum``: XLA:CPU's in-process
    collectives give a collective in a loop the same rendezvous key in every
    iteration, so a device that runs ahead into the next iteration joins the
    previous one's rendezvous ("Check failed: id < num_threads", or SIGSEGV).
    It happened on busy CPUs with a simulated multi-device mesh (docs/distributed.md).
    On one device the loop stays rolled: the same arithmetic, as fast, and a
    program with the cutoff compiles about 30% faster (the unrolled steps were
    ~700 fusions).
    """
    lo = jnp.full(shape, _KEY_NEG_INF, jnp.uint32)
    hi = jnp.full(shape, _KEY_POS_INF, jnp.uint32)
    top = pred(jnp.full(shape, jnp.inf, jnp.float32))

    def step(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(_key_float(mid))
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, hi = lax.fori_loop(0, 32, step, (lo, hi), unroll=unroll)
    return _key_float(hi), top


def _bisection_cutoff(
    scaled: jax.Array, k: jax.Array | None, one_minus_top_p: jax.Array | None, axis_name: AxisName
) -> jax.Array:
    """The cutoff of :func:`cutoff` for every row, by bisection (no sort, no gather).

    * top-k: the k-th largest value is the smallest float ``t`` with fewer than
      ``k`` values above it (counts summed over shards); bit-exact.
    * top-p: with ``prob`` the softmax over the top-k survivors, the smallest
      value ``t`` whose mass ``Σ prob(v ≤ t)`` exceeds ``1 - top_p`` (the mass
      summed over shards), or the row maximum when no value does.
    """
    rows = scaled.shape[:-1]
    cut = jnp.full(rows, _NEG_INF, jnp.float32)
    if k is not None:

        def fewer_than_k_above(t: jax.Array) -> jax.Array:
            above = jnp.sum(scaled > t[..., None], axis=-1, dtype=jnp.int32)
            return (lax.psum(above, axis_name) if axis_name else above) < k

        kth, _ = _smallest_float(fewer_than_k_above, rows, unroll=bool(axis_name))
        cut = jnp.where(k > 0, kth, cut)
    if one_minus_top_p is not None:
        m = vocab_max(scaled, axis_name)
        e = jnp.where(scaled >= cut[..., None], jnp.exp(scaled - m[..., None]), 0)
        prob = e / vocab_sum(e, axis_name)[..., None]

        def mass_above(t: jax.Array) -> jax.Array:
            mass = jnp.sum(jnp.where(scaled <= t[..., None], prob, 0), axis=-1)
            return (lax.psum(mass, axis_name) if axis_name else mass) > one_minus_top_p

        cut_p, any_kept = _smallest_float(mass_above, rows, unroll=bool(axis_name))
        cut_p = jnp.where(any_kept, cut_p, m)
        cut = jnp.where(one_minus_top_p > 0, jnp.maximum(cut, cut_p), cut)
    return cut


def cutoff(
    scaled: jax.Array,
    top_k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    axis_name: AxisName = None,
    *,
    source: tuple[jax.Array, Callable[[jax.Array], jax.Array]] | None = None,
) -> jax.Array:
    """Smallest scaled logit kept by top-k then top-p, per row (-inf when nothing is dropped).

    transformers' semantics (``TopKLogitsWarper``, ``TopPLogitsWarper`` with
    ``min_tokens_to_keep=1``): top-k keeps the logits ``>=`` the k-th largest;
    top-p sorts ascending, takes the cumulative softmax and drops entries whose
    cumulative probability is ``<= 1 - top_p``, keeping at least the largest.

    The exact algorithm is a bisection over float32 bit patterns
    (:func:`_bisection_cutoff`: 32 passes over the row per filter, with
    ``psum``'d counts and masses on a mesh; no sort, which XLA:CPU runs ~25×
    slower). On one device the 256 largest logits decide most rows first
    (:func:`_cutoff_from_candidates`): top-k with ``k <= 256`` whose kept set
    (ties at the k-th value included) lies inside them, and top-p when the mass
    outside the candidates is below ``1 - top_p`` by a margin; only the others
    take the bisection. Each row's cutoff is computed by the same arithmetic
    whichever way the batch goes, so a row's result never depends on the other
    rows. The candidates' top-p sum and the bisection's mass round differently
    in the last bits; a cutoff can differ only where a cumulative probability is
    within rounding of ``1 - top_p``.

    Where the candidates come from is the one per-platform choice: ``lax.top_k``
    of the row on CPU (and GPU); on a TPU, where ``lax.top_k`` is a sort of the
    whole row, :func:`cutoff_by_lanes` (a Pallas pass gives a short list known to
    hold them, or says it cannot, and the row's batch then takes ``lax.top_k``).
    Both hand the same candidates to the same rule: the same cutoff, bit for bit.

    Args:
      scaled: f32[..., L], (this shard's slice of) the temperature-scaled logits;
        padded entries are -inf and never count as kept mass.
      top_k: optional i32[...]; 0 keeps all.
      one_minus_top_p: optional f32[...], ``1 - top_p``; 0 keeps all.
      axis_name: the vocabulary mesh axis, or None.
      source: optional ``(logits, to_scaled)`` with ``scaled == to_scaled(logits)``
        (f[..., L] and an elementwise, non-decreasing map that broadcasts over
        any last-axis length, e.g. ``(v - max) * (1 / T)``): the TPU route then
        reads ``logits`` itself, not a materialised ``scaled``.

    Returns:
      f32[...] (replicated over ``axis_name``).
    """
    vocab = scaled.shape[-1]
    if axis_name:
        k = None if top_k is None else jnp.maximum(top_k, 0)
        return _bisection_cutoff(scaled, k, one_minus_top_p, axis_name)
    k = None if top_k is None else jnp.clip(top_k, 0, vocab)
    logits = scaled if source is None else source[0]
    kc = min(_CUTOFF_CANDIDATES, vocab)
    lanes_fit = tpu_pallas.lane_candidates_fit(logits.shape, logits.dtype.itemsize, _LANE_DEPTH)
    if kc == vocab or vocab < _LANE_DEPTH * tpu_pallas.LANES or not lanes_fit or scaled.size == 0:
        return _cutoff_from_candidates(lambda: scaled, vocab, _largest(scaled, kc), k, one_minus_top_p)
    return lax.platform_dependent(
        tpu=lambda: cutoff_by_lanes(scaled, k, one_minus_top_p, source),
        default=lambda: _cutoff_from_candidates(lambda: scaled, vocab, _largest(scaled, kc), k, one_minus_top_p),
    )


def _largest(scaled: jax.Array, count: int) -> jax.Array:
    """f32[..., count], ascending: the ``count`` largest of each row (``lax.top_k``)."""
    rows, vocab = scaled.shape[:-1], scaled.shape[-1]
    # lax.top_k on a rank-2 operand: XLA:CPU has a fast TopK only for (rows, V) and
    # lowers other ranks to a full sort.
    return lax.top_k(scaled.reshape(-1, vocab), count)[0].reshape((*rows, count))[..., ::-1]


def _cutoff_from_candidates(
    read: Callable[[], jax.Array],
    vocab: int,
    cand: jax.Array,
    k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    top: jax.Array | None = None,
) -> jax.Array:
    """:func:`cutoff` on one device from ``cand`` (f32[..., kc], the ``kc`` largest of each row, ascending).

    ``read()`` gives the scaled logits f32[..., V] (``vocab`` = V); it is called
    where they are needed, so that inside a conditional branch they are
    computed there from the logits rather than copied into it. Rows the
    candidates cannot decide take :func:`_bisection_cutoff` (only when some row
    needs it: one ``lax.cond`` for the batch). ``k`` is clipped to [0, V].
    ``top``: the rows' max (f32[...]) where the caller has it for free (the
    TPU's candidates: ``cand[..., -1]``, the same value); else a reduction of
    ``read()``. The mass outside the candidates (a pass over the row) is
    computed only when some row has top-p without top-k, the only rows that
    read it.
    """
    rows = cand.shape[:-1]
    kc = cand.shape[-1]
    cut = jnp.full(rows, _NEG_INF, jnp.float32)
    eligible = jnp.ones(rows, bool)
    k_active = jnp.zeros(rows, bool)
    if k is not None:
        kth = jnp.take_along_axis(cand, (kc - jnp.clip(k, 1, kc))[..., None], axis=-1)[..., 0]
        cut = jnp.where(k > 0, kth, cut)
        # The kept set is every value >= the k-th: it lies inside the candidates
        # unless the smallest candidate is kept too (ties at the k-th value past them).
        eligible = (k <= kc) & ((kc == vocab) | (cand[..., 0] < kth) | (k == 0))
        k_active = k > 0
    if one_minus_top_p is not None:
        # The row max, as its own reduction: reading it off the candidates
        # (cand[..., -1]) makes XLA:CPU lower lax.top_k to a sort of the whole
        # row (~13 ms per row of 49152, against ~0.3 ms).
        if top is None:
            top = jnp.max(read(), axis=-1)
        e = jnp.exp(jnp.where(cand >= cut[..., None], cand, _NEG_INF) - top[..., None])
        cand_mass = jnp.sum(e, axis=-1)
        if kc < vocab:

            def outside() -> jax.Array:
                return jnp.maximum(row_sums(jnp.exp(read() - top[..., None])) - cand_mass, 0)

            none = jnp.zeros(rows, jnp.float32)
            rest = jnp.where(k_active, 0, lax.cond(jnp.all(k_active), lambda: none, outside))
        else:
            rest = jnp.zeros(rows, jnp.float32)
        z = cand_mass + rest
        cum = (rest[..., None] + jnp.cumsum(e, axis=-1)) / z[..., None]
        dropped = jnp.sum(cum <= one_minus_top_p[..., None], axis=-1)
        cut_p = jnp.take_along_axis(cand, jnp.minimum(dropped, kc - 1)[..., None], axis=-1)[..., 0]
        cut = jnp.where(one_minus_top_p > 0, jnp.maximum(cut, cut_p), cut)
        eligible &= (one_minus_top_p <= 0) | k_active | (rest / z <= one_minus_top_p - _REST_MARGIN)
    if kc == vocab:
        return cut

    def bisection() -> jax.Array:
        return jnp.where(eligible, cut, _bisection_cutoff(read(), k, one_minus_top_p, None))

    return lax.cond(jnp.all(eligible), lambda: cut, bisection)


def lane_candidates_decide(
    scaled: jax.Array,
    k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    source: tuple[jax.Array, Callable[[jax.Array], jax.Array]] | None = None,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The TPU's candidates for :func:`_cutoff_from_candidates`, and per row whether they are the right ones.

    Returns ``(cand, decided)``: f32[..., kc] ascending, the ``kc`` largest of
    the :func:`specjax.kernels.tpu_pallas.lane_candidates` of the row (its
    ``_LANE_DEPTH`` largest per lane, mapped by ``to_scaled``), and bool[...].
    With ``τ`` the largest ``_LANE_DEPTH``-th largest per lane, every value of
    the row above ``τ`` is among those candidates, with its multiplicity, so
    ``cand`` agrees with the row's true ``kc`` largest in every entry above ``τ``
    (and everywhere when ``τ = -inf``). The rule reads, per row, only the
    entries ``>=`` the k-th largest when top-k is active, else all of them for
    top-p, else none: ``decided`` says that those are above ``τ``. A NaN in the
    row makes ``τ`` NaN, so such a row is never decided. ``k`` is clipped to [0, V].
    """
    logits, to_scaled = (scaled, lambda v: v) if source is None else source
    rows = scaled.shape[:-1]
    kc = min(_CUTOFF_CANDIDATES, scaled.shape[-1])
    lanes = to_scaled(tpu_pallas.lane_candidates(logits, _LANE_DEPTH, interpret=interpret))
    width = lanes.shape[-1]
    tau = jnp.max(lanes[..., width - tpu_pallas.LANES :], axis=-1)
    cand = _largest(lanes, kc)
    # Per row, the rank (0: the largest) of the smallest candidate the rule reads,
    # and whether it reads any.
    rank = jnp.full(rows, kc - 1, jnp.int32)
    used = jnp.zeros(rows, bool)
    if k is not None:
        rank = jnp.where(k > 0, jnp.clip(k, 1, kc) - 1, rank)
        used |= k > 0
        # k > kc: the row takes the bisection, which reads the row itself
        used &= k <= kc
    if one_minus_top_p is not None:
        used |= (one_minus_top_p > 0) & (True if k is None else k <= kc)
    lowest = jnp.take_along_axis(cand, (kc - 1 - rank)[..., None], axis=-1)[..., 0]
    decided = ~used | (lowest > tau) | (tau == _NEG_INF)
    return cand, decided


def cutoff_by_lanes(
    scaled: jax.Array,
    k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    source: tuple[jax.Array, Callable[[jax.Array], jax.Array]] | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """:func:`cutoff` on one TPU (``k`` clipped to [0, V]): the candidates of
    :func:`lane_candidates_decide` when they decide every row, else ``lax.top_k``'s.

    Either way :func:`_cutoff_from_candidates` applies the rule to the row's true
    ``kc`` largest (in the entries it reads), so the result is bit for bit the
    CPU path's. ``interpret``: run the Pallas pass in its interpreter (tests).
    """
    vocab = scaled.shape[-1]
    kc = min(_CUTOFF_CANDIDATES, vocab)
    cand, decided = lane_candidates_decide(scaled, k, one_minus_top_p, source, interpret=interpret)

    def read() -> jax.Array:  # from the logits inside each branch: no copy of size V into them
        return scaled if source is None else source[1](source[0])

    # Decided: the row max is the largest candidate (no row that reads it holds a NaN: such a row is never
    # decided). The fallback reduces the row itself, as the CPU path does (a NaN's place in lax.top_k's order is
    # not max's NaN).
    return lax.cond(
        jnp.all(decided),
        lambda: _cutoff_from_candidates(read, vocab, cand, k, one_minus_top_p, cand[..., -1]),
        lambda: _cutoff_from_candidates(read, vocab, _largest(read(), kc), k, one_minus_top_p),
    )
