"""The kernels under a JAX device mesh: batch and/or vocabulary split over devices.

Tensor-parallel targets split their LM head over the vocabulary, so logits
arrive sharded over V; serving batches are split over B. This module runs
:func:`specjax.rejection_sample` and :func:`specjax.verify_from_logits` there
with JAX's own SPMD machinery (``jax.shard_map`` and its collectives), never
gathering a vocabulary: every collective carries per-row scalars, so the bytes
moved per call do not grow with V (vocabulary: see :mod:`specjax.kernels.rejection`).

How a vocabulary-sharded step runs, per batch row (S vocabulary shards, shard
``k`` holding the ids ``[k·L, (k+1)·L)``):

1. ``p_i(x_i)`` and ``q_i(x_i)``: the shard that owns ``x_i`` reads it, the
   others contribute 0, one ``psum`` of (B, G) values, summed as integer bit
   patterns (exact, subnormals included).
2. ``n`` is computed from those replicated values, so every shard takes the
   same decisions; the uniforms come from one key (or are passed in), the same
   on every shard: no per-shard random streams (vLLM #17498 was shards
   disagreeing on draws).
3. Row ``n`` of ``p`` and ``q`` is read locally; the residual is local, and the
   zero-sum fallback to ``p_n`` tests the global sum (``psum`` of (B,)).
4. The inverse-CDF draw: per-shard totals (the local blocked sums, as in
   :func:`~specjax.kernels.rejection.inverse_cdf`) are all-gathered, (B, S);
   their cumulative sum names the shard holding the draw; that shard searches
   its blocks, the others answer -1, and one ``pmax`` of (2, B) int32 returns
   its global id together with the global rounding fallback (the largest id
   with positive weight).

Logits: :func:`specjax.kernels.frontend.verify_core` runs with ``axis_name``;
row maxima, normalisers and argmaxes are combined with ``pmax``/``psum``/``pmin``
of row-shaped arrays, and top-k / top-p cutoffs come from
:func:`sharded_cutoff`, a bisection over float32 bit patterns with ``psum``'d
counts and masses (32 steps each).

Equality with one device: integer results (``num_accepted``, ``tokens``) are
those of the single-device kernel except when two float32 sums that the two
layouts associate differently straddle a decision boundary (a sum of shard
partials instead of one long sum; the probability is of order 1e-7 per
decision). XLA itself does not promise more across shapes: on CPU it already
picks different summation orders for different batch sizes. Greedy rows,
top-k cutoffs and the gathered ``p_i(x_i)`` / ``q_i(x_i)`` are bit-exact.

Uneven vocabularies: when V is not a multiple of the vocabulary shard count the
kernels pad it (zero probabilities, -inf logits) up to the next multiple inside
the jitted call; padded ids have zero weight and are never drawn. Inputs that
arrive already split over V are split evenly (JAX requires it), so this padding
moves no data. Rows are padded likewise when B is not a multiple of the batch
shard count.

Public functions: :func:`rejection_sample_sharded` and
:func:`verify_from_logits_sharded` take the mesh and axis names explicitly;
:func:`specjax.rejection_sample` and :func:`specjax.verify_from_logits` call
the same code when their probabilities/logits are a ``NamedSharding`` that
splits B and/or V (:func:`mesh_layout`).
"""

from __future__ import annotations

import contextvars
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.kernels.compile_options import VECTOR_OPTIONS
from specjax.kernels.rejection import (
    _int_view,
    assemble_tokens,
    below_one,
    block_sums,
    compute_dtype,
    inverse_cdf,
    num_accepted_from_ratios,
    point_mass,
    residual_weights,
    row_sums,
    to_blocks,
)

__all__ = [
    "MeshLayout",
    "hlo_collectives",
    "mesh_layout",
    "rejection_sample_sharded",
    "sharded_cutoff",
    "sharded_inverse_cdf",
    "sharded_residual_weights",
    "verify_from_logits_sharded",
]

AxisName = str | tuple[str, ...] | None


# --------------------------------------------------------------------------- #
# Layout: which mesh axes split B and V
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class MeshLayout:
    """A mesh and the axis (or axes) splitting the batch and the vocabulary.

    ``batch_axis`` / ``vocab_axis`` are a mesh axis name, a tuple of names, or
    None (not split). Hashable: it is a static argument of the jitted kernels.
    """

    mesh: Mesh
    batch_axis: AxisName = None
    vocab_axis: AxisName = None

    def size(self, axis: AxisName) -> int:
        if axis is None:
            return 1
        names = (axis,) if isinstance(axis, str) else axis
        return math.prod(self.mesh.shape[a] for a in names)


def _axis(entry: Any) -> AxisName:
    """A PartitionSpec entry as an axis name, a tuple of names, or None."""
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    names = tuple(entry)
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def _check_axes(mesh: Mesh, batch_axis: AxisName, vocab_axis: AxisName) -> None:
    for what, axis in (("batch_axis", batch_axis), ("vocab_axis", vocab_axis)):
        names = () if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        for a in names:
            if a not in mesh.shape:
                raise ValueError(f"{what}: expected an axis of the mesh {dict(mesh.shape)}, got {a!r}")
    if batch_axis is not None and vocab_axis is not None:
        b = {batch_axis} if isinstance(batch_axis, str) else set(batch_axis)
        v = {vocab_axis} if isinstance(vocab_axis, str) else set(vocab_axis)
        if b & v:
            raise ValueError(f"batch_axis and vocab_axis: expected different mesh axes, got {sorted(b & v)}")


_LAYOUT_OVERRIDE: contextvars.ContextVar[MeshLayout | None] = contextvars.ContextVar(
    "specjax_mesh_layout", default=None
)


@contextmanager
def _use_layout(layout: MeshLayout) -> Iterator[None]:
    """Make the public kernels run on ``layout`` whatever their inputs' placement."""
    token = _LAYOUT_OVERRIDE.set(layout)
    try:
        yield
    finally:
        _LAYOUT_OVERRIDE.reset(token)


def mesh_layout(x: Any, name: str = "target") -> MeshLayout | None:
    """The mesh layout of a (B, ..., V) array, or None for single-device inputs.

    ``x`` counts as sharded when it is a :class:`jax.Array` whose sharding is a
    :class:`~jax.sharding.NamedSharding` whose spec splits its first axis (B)
    and/or its last axis (V). Inside :func:`rejection_sample_sharded` /
    :func:`verify_from_logits_sharded` the layout given there wins.

    Raises:
      ValueError: when the spec splits a middle axis (G or G+1).
    """
    override = _LAYOUT_OVERRIDE.get()
    if override is not None:
        return override
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or getattr(x, "ndim", 0) < 2:
        return None
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    for entry in spec[1:-1]:
        if _axis(entry) is not None:
            raise ValueError(
                f"{name}: expected a sharding over B and/or V only, got spec {sharding.spec} "
                "(the draft-position axis must not be split)"
            )
    batch_axis, vocab_axis = _axis(spec[0]), _axis(spec[-1])
    if batch_axis is None and vocab_axis is None:
        return None
    # A committed array's NamedSharding holds a concrete Mesh (AbstractMesh only inside tracing).
    return MeshLayout(cast(Mesh, sharding.mesh), batch_axis, vocab_axis)


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
    """Inside jit: lay ``x`` out as ``spec`` (reshard on explicit meshes)."""
    sharding = NamedSharding(mesh, spec)
    if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _place(x: jax.Array, layout: MeshLayout, spec: P) -> jax.Array:
    """Outside jit: put an input that is not on the layout's mesh onto it.

    Arrays already on the mesh are left alone (the jitted call lays them out);
    others are split as ``spec`` where the shape divides evenly, else replicated.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == layout.mesh:
        return x
    for dim, axis in zip(x.shape, spec, strict=False):
        if dim % layout.size(axis):
            spec = P()
            break
    target = NamedSharding(layout.mesh, spec)
    if target.is_fully_addressable:
        return jax.device_put(x, target)
    # Several processes: each holds the whole input (it is the same everywhere) and
    # contributes the slices its own devices hold.
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _place(jax.random.key_data(x), layout, spec)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    whole = np.asarray(x)
    return jax.make_array_from_callback(whole.shape, target, lambda index: whole[index])


def _pad_to(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --------------------------------------------------------------------------- #
# Building blocks (traceable, inside shard_map)
# --------------------------------------------------------------------------- #


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


# --------------------------------------------------------------------------- #
# The probability kernel on a mesh
# --------------------------------------------------------------------------- #


def _psum_owned(values: tuple[jax.Array, ...], axis_name: AxisName) -> tuple[jax.Array, ...]:
    """psum of values that one shard owns and the others hold as +0, bit for bit.

    Summed as integer bit patterns, so a subnormal probability survives (XLA:CPU
    flushes subnormals to zero in float arithmetic, and the acceptance test
    counts them as positive).
    """
    bits = lax.psum(tuple(_int_view(v) for v in values), axis_name)
    return tuple(lax.bitcast_convert_type(b, v.dtype) for b, v in zip(bits, values, strict=True))


def _rejection_body(
    draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, vocab_axis: AxisName, per_shard: bool
):
    """One shard's step: rows of its batch slice, columns of its vocabulary slice.

    ``draft_probs=None``: point masses at the draft tokens (``q_i(x_i) = 1``).
    """
    g = draft_tokens.shape[1]
    size = target_probs.shape[2]
    q_dtype = target_probs.dtype if draft_probs is None else draft_probs.dtype
    ct = compute_dtype(jnp.result_type(q_dtype, target_probs.dtype))
    offset = lax.axis_index(vocab_axis) * size if vocab_axis else 0
    x = draft_tokens.astype(jnp.int32)
    if g > 0:
        local = x - offset
        inside = (local >= 0) & (local < size)
        idx = jnp.clip(local, 0, size - 1)[:, :, None]
        # Gather in the input dtype, zero elsewhere, then one psum of (B, G) pairs.
        p_x = jnp.where(inside, jnp.take_along_axis(target_probs[:, :g], idx, axis=2)[:, :, 0], 0)
        if draft_probs is None:
            q_x = jnp.where(inside, jnp.ones_like(p_x), 0)
        else:
            q_x = jnp.where(inside, jnp.take_along_axis(draft_probs, idx, axis=2)[:, :, 0], 0)
        if vocab_axis:
            p_x, q_x = _psum_owned((p_x, q_x), vocab_axis)
        n = num_accepted_from_ratios(p_x.astype(ct), q_x.astype(ct), below_one(accept_uniforms.astype(ct)))
    else:
        n = jnp.zeros((x.shape[0],), jnp.int32)

    p_n = jnp.take_along_axis(target_probs, n[:, None, None], axis=1)[:, 0].astype(ct)
    if g > 0:
        pos = jnp.minimum(n, g - 1)
        if draft_probs is None:
            x_n = jnp.take_along_axis(x, pos[:, None], axis=1)[:, 0]
            q_n = point_mass(x_n, lax.iota(jnp.int32, size) + offset, ct)
        else:
            q_n = jnp.take_along_axis(draft_probs, pos[:, None, None], axis=1)[:, 0]
        q_n = jnp.where((n < g)[:, None], q_n.astype(ct), 0)
    else:
        q_n = jnp.zeros_like(p_n)
    weights = sharded_residual_weights(p_n, q_n, vocab_axis)
    y = sharded_inverse_cdf(weights, sample_uniforms.astype(ct), vocab_axis, offset)
    out = {"num_accepted": n, "tokens": assemble_tokens(x, n, y)}
    if per_shard:
        out = {key: v[None] for key, v in out.items()}
    return out


def _without_draft(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` for point-mass drafts: shard_map passes no draft array, the body gets None."""

    def run(draft_tokens, *rest, **kwargs):
        return body(draft_tokens, None, *rest, **kwargs)

    return run


def _out_specs(layout: MeshLayout, per_shard: bool) -> dict[str, P]:
    ba, va = layout.batch_axis, layout.vocab_axis
    if per_shard:
        return {"num_accepted": P(va, ba), "tokens": P(va, ba, None)}
    return {"num_accepted": P(ba), "tokens": P(ba, None)}


def _trim(out: dict[str, jax.Array], batch: int, mesh: Mesh, per_shard: bool) -> dict[str, jax.Array]:
    """Cut padded rows off (replicating the small results first, which explicit meshes need)."""
    rows = 1 if per_shard else 0
    if next(iter(out.values())).shape[rows] == batch:
        return out
    return {k: lax.slice_in_dim(_constrain(v, mesh, P()), 0, batch, axis=rows) for k, v in out.items()}


# Recompiles when the shapes or dtypes of the five inputs change, or the layout
# (mesh, axis names) changes. Never for new values.
@partial(jax.jit, static_argnames=("layout", "per_shard"))
def _rejection_sample_mesh_jit(
    draft_tokens,
    draft_probs,
    target_probs,
    accept_uniforms,
    sample_uniforms,
    *,
    layout: MeshLayout,
    per_shard: bool = False,
):
    mesh, ba, va = layout.mesh, layout.batch_axis, layout.vocab_axis
    b = draft_tokens.shape[0]
    vocab = target_probs.shape[2]
    b_pad = _round_up(b, layout.size(ba))
    v_pad = _round_up(vocab, layout.size(va))
    # Padded rows and ids have zero probabilities: ids are never drawn, rows are cut off.
    point_masses = draft_probs is None
    args = (
        _constrain(_pad_to(draft_tokens, 0, b_pad), mesh, P(ba, None)),
        *(
            ()
            if point_masses
            else (_constrain(_pad_to(_pad_to(draft_probs, 0, b_pad), 2, v_pad), mesh, P(ba, None, va)),)
        ),
        _constrain(_pad_to(_pad_to(target_probs, 0, b_pad), 2, v_pad), mesh, P(ba, None, va)),
        _constrain(_pad_to(accept_uniforms, 0, b_pad), mesh, P(ba, None)),
        _constrain(_pad_to(sample_uniforms, 0, b_pad), mesh, P(ba)),
    )
    body: Callable[..., Any] = partial(_rejection_body, vocab_axis=va, per_shard=per_shard)
    if point_masses:
        body = _without_draft(body)
    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(ba, None), *(() if point_masses else (P(ba, None, va),)), P(ba, None, va), P(ba, None), P(ba)),
        out_specs=_out_specs(layout, per_shard),
        # all_gather results count as varying, so replication can't be inferred;
        # it holds by construction and tests check it with per_shard=True.
        check_vma=False,
    )(*args)
    return _trim(out, b, mesh, per_shard)


def rejection_sample_on_mesh(
    draft_tokens: jax.Array,
    draft_probs: jax.Array | None,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
    layout: MeshLayout,
    *,
    per_shard: bool = False,
) -> dict[str, jax.Array]:
    """The probability kernel on ``layout`` for already validated inputs.

    ``per_shard=True`` (for tests) returns every vocabulary shard's own copy of
    the results, stacked on a leading axis of size S, instead of one.
    """
    ba, va = layout.batch_axis, layout.vocab_axis
    args = (
        _place(draft_tokens, layout, P(ba, None)),
        None if draft_probs is None else _place(draft_probs, layout, P(ba, None, va)),
        _place(target_probs, layout, P(ba, None, va)),
        _place(accept_uniforms, layout, P(ba, None)),
        _place(sample_uniforms, layout, P(ba)),
    )
    return _rejection_sample_mesh_jit(*args, layout=layout, per_shard=per_shard)


def rejection_sample_sharded(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    mesh: Mesh,
    batch_axis: AxisName = None,
    vocab_axis: AxisName = None,
    validate: bool = True,
) -> dict[str, jax.Array]:
    """:func:`specjax.rejection_sample` on ``mesh``, rows split over ``batch_axis``, ids over ``vocab_axis``.

    Args:
      draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms,
        validate: as :func:`specjax.rejection_sample` (i32[B, G], f[B, G, V],
        f[B, G+1, V], f[B, G], f[B]). Inputs may live anywhere: arrays already
        on ``mesh`` keep their placement, others are placed on it.
      mesh: a :class:`jax.sharding.Mesh`.
      batch_axis: the mesh axis (or tuple of axes) splitting B, or None.
      vocab_axis: the mesh axis (or tuple of axes) splitting V, or None.

    Returns:
      ``{"num_accepted": i32[B], "tokens": i32[B, G+1]}`` on ``mesh``, split over
      ``batch_axis`` and replicated over the other axes; the values of
      :func:`specjax.rejection_sample` (see the module docstring on equality).

    B and V need not divide the shard counts (they are padded). Compilation:
    recompiles when shapes, dtypes or the layout change, never for new values.
    """
    _check_axes(mesh, batch_axis, vocab_axis)
    from specjax.kernels.rejection import rejection_sample

    with _use_layout(MeshLayout(mesh, batch_axis, vocab_axis)):
        return rejection_sample(
            draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, validate=validate
        )


# --------------------------------------------------------------------------- #
# The logits front end on a mesh
# --------------------------------------------------------------------------- #


def _verify_body(
    draft_tokens,
    draft_logits,
    target_logits,
    u,
    temperature,
    top_k,
    one_minus_top_p,
    num_draft_tokens,
    *,
    vocab_axis: AxisName,
    use_top_k: bool,
    use_top_p: bool,
    per_shard: bool,
):
    from specjax.kernels.frontend import verify_core

    g = draft_tokens.shape[1]
    offset = lax.axis_index(vocab_axis) * target_logits.shape[2] if vocab_axis else 0
    out = verify_core(
        draft_tokens,
        draft_logits,
        target_logits,
        u[:, :g],
        u[:, g],
        temperature,
        top_k if use_top_k else None,
        one_minus_top_p if use_top_p else None,
        num_draft_tokens,
        axis_name=vocab_axis,
        offset=offset,
    )
    if per_shard:
        out = {key: v[None] for key, v in out.items()}
    return out


# Recompiles when shapes/dtypes change, when the key kind changes (one key or one
# per row), when top_k / top_p switch between None and given, or the layout changes.
@partial(jax.jit, static_argnames=("use_top_k", "use_top_p", "layout", "per_shard"), compiler_options=VECTOR_OPTIONS)
def _verify_mesh_jit(
    draft_tokens,
    draft_logits,
    target_logits,
    key,
    temperature,
    top_k,
    one_minus_top_p,
    num_draft_tokens,
    *,
    use_top_k,
    use_top_p,
    layout: MeshLayout,
    per_shard: bool = False,
):
    from specjax.kernels.frontend import _uniforms

    mesh, ba, va = layout.mesh, layout.batch_axis, layout.vocab_axis
    b, g = draft_tokens.shape
    vocab = target_logits.shape[2]
    # One draw for the whole batch, exactly as on one device, before any padding.
    u = _uniforms(key, b, g + 1)
    b_pad = _round_up(b, layout.size(ba))
    v_pad = _round_up(vocab, layout.size(va))
    row = P(ba)
    point_masses = draft_logits is None
    args = (
        _constrain(_pad_to(draft_tokens, 0, b_pad), mesh, P(ba, None)),
        *(
            ()
            if point_masses
            else (_constrain(_pad_to(_pad_to(draft_logits, 0, b_pad), 2, v_pad, -jnp.inf), mesh, P(ba, None, va)),)
        ),
        _constrain(_pad_to(_pad_to(target_logits, 0, b_pad), 2, v_pad, -jnp.inf), mesh, P(ba, None, va)),
        _constrain(_pad_to(u, 0, b_pad), mesh, P(ba, None)),
        _constrain(_pad_to(temperature, 0, b_pad, 1), mesh, row),
        _constrain(_pad_to(top_k, 0, b_pad), mesh, row),
        _constrain(_pad_to(one_minus_top_p, 0, b_pad), mesh, row),
        _constrain(_pad_to(num_draft_tokens, 0, b_pad), mesh, row),
    )
    body: Callable[..., Any] = partial(
        _verify_body, vocab_axis=va, use_top_k=use_top_k, use_top_p=use_top_p, per_shard=per_shard
    )
    if point_masses:
        body = _without_draft(body)
    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            P(ba, None),
            *(() if point_masses else (P(ba, None, va),)),
            P(ba, None, va),
            P(ba, None),
            row,
            row,
            row,
            row,
        ),
        out_specs=_out_specs(layout, per_shard),
        # all_gather results count as varying, so replication can't be inferred;
        # it holds by construction and tests check it with per_shard=True.
        check_vma=False,
    )(*args)
    return _trim(out, b, mesh, per_shard)


def verify_on_mesh(
    draft_tokens,
    draft_logits,
    target_logits,
    key,
    temperature,
    top_k,
    one_minus_top_p,
    num_draft_tokens,
    *,
    use_top_k: bool,
    use_top_p: bool,
    layout: MeshLayout,
    per_shard: bool = False,
) -> dict[str, jax.Array]:
    """The logits front end on ``layout``, for the arguments of ``frontend._verify_jit``."""
    ba, va = layout.batch_axis, layout.vocab_axis
    row = P(ba)
    return _verify_mesh_jit(
        _place(draft_tokens, layout, P(ba, None)),
        None if draft_logits is None else _place(draft_logits, layout, P(ba, None, va)),
        _place(target_logits, layout, P(ba, None, va)),
        _place(key, layout, P()),
        _place(temperature, layout, row),
        _place(top_k, layout, row),
        _place(one_minus_top_p, layout, row),
        _place(num_draft_tokens, layout, row),
        use_top_k=use_top_k,
        use_top_p=use_top_p,
        layout=layout,
        per_shard=per_shard,
    )


def verify_from_logits_sharded(
    draft_tokens: Any,
    draft_logits: Any,
    target_logits: Any,
    *,
    mesh: Mesh,
    batch_axis: AxisName = None,
    vocab_axis: AxisName = None,
    **kwargs: Any,
) -> dict[str, jax.Array]:
    """:func:`specjax.verify_from_logits` on ``mesh``, rows over ``batch_axis``, ids over ``vocab_axis``.

    Args:
      draft_tokens: i32/i64[B, G]; draft_logits: f[B, G, V]; target_logits:
        f[B, G+1, V]; keyword arguments (``key``, ``temperature``, ``top_k``,
        ``top_p``, ``num_draft_tokens``, ``validate``): as
        :func:`specjax.verify_from_logits`.
      mesh, batch_axis, vocab_axis: as :func:`rejection_sample_sharded`.

    Returns:
      ``{"num_accepted": i32[B], "tokens": i32[B, G+1]}`` on ``mesh``, split over
      ``batch_axis``. The uniforms come from ``key`` exactly as on one device,
      drawn once and shared by all vocabulary shards.
    """
    _check_axes(mesh, batch_axis, vocab_axis)
    from specjax.kernels.frontend import verify_from_logits

    with _use_layout(MeshLayout(mesh, batch_axis, vocab_axis)):
        return verify_from_logits(draft_tokens, draft_logits, target_logits, **kwargs)


# --------------------------------------------------------------------------- #
# Inspecting compiled programs
# --------------------------------------------------------------------------- #

_COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "collective-permute",
    "all-to-all",
    "reduce-scatter",
    "collective-broadcast",
    "ragged-all-to-all",
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}])(?P<op>[a-z][\w\-]*)\((?P<args>[^()]*)\)")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*|c\d+)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_BYTES = {"pred": 1, "bf16": 2}


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    width = _BYTES.get(dtype)
    if width is None:
        bits = re.match(r"[a-z]+(\d+)", dtype)
        width = max(int(bits.group(1)) // 8, 1) if bits else 1
    return width * math.prod(dims)


_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<kind>body|calls|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


def hlo_collectives(hlo_text: str) -> list[dict[str, Any]]:
    """The cross-device collectives of a compiled HLO module, with their sizes.

    Args:
      hlo_text: ``jitted.lower(...).compile().as_text()``.

    Returns:
      One dict per collective instruction (the ``-done`` halves of asynchronous
      pairs are skipped): ``op`` (e.g. ``"all-gather"``), ``operands`` and
      ``results`` (lists of ``(dtype, dims)``; operand shapes are looked up from
      their defining instructions), ``operand_bytes`` and ``result_bytes`` (per
      device and execution), ``count`` (executions per call: the product of the
      known trip counts of the while loops around it, 1 outside loops),
      ``max_dim`` (the largest dimension of any operand or result) and ``line``.
    """
    defined: dict[str, str] = {}
    calls = []
    edges: dict[str, list[tuple[str, int]]] = {}
    entry = None
    current = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group("name")
            if head.group("entry"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = m.group("rest")
        op = _OPCODE.search(rest)
        if not op:
            continue
        defined[m.group("name")] = rest[: op.start("op")]
        trip = _TRIP_COUNT.search(rest)
        for callee in _CALLEE.finditer(rest):
            factor = int(trip.group("n")) if callee.group("kind") == "body" and trip else 1
            edges.setdefault(current, []).append((callee.group("name"), factor))
        for branches in _BRANCHES.finditer(rest):
            for name in _OPERAND.findall(branches.group("names")):
                edges.setdefault(current, []).append((name, 1))
        name = op.group("op")
        is_async = name.endswith("-start")
        if is_async:
            name = name[: -len("-start")]
        if name in _COLLECTIVE_OPS:
            calls.append((current, name, is_async, rest[: op.start("op")], op.group("args"), line.strip()))

    count: dict[str, int] = {}

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        count[comp] = count.get(comp, 0) + times
        for callee, factor in edges.get(comp, ()):
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1)
    found = []
    for comp, name, is_async, result_text, args, line in calls:
        operands = _shapes(args)
        if not operands:
            operands = [s for ref in _OPERAND.findall(args) for s in _shapes(defined.get(ref, ""))]
        results = _shapes(result_text)
        if is_async:  # "-start" results repeat the operands and add u32[] context scalars
            if results[: len(operands)] == operands and len(results) > len(operands):
                results = results[len(operands) :]
            results = [r for r in results if r[1]] or results
        dims = [d for _, shape in operands + results for d in shape]
        found.append(
            {
                "op": name,
                "operands": operands,
                "results": results,
                "operand_bytes": sum(_nbytes(dt, s) for dt, s in operands),
                "result_bytes": sum(_nbytes(dt, s) for dt, s in results),
                "count": count.get(comp, 1),
                "max_dim": max(dims, default=0),
                "line": line,
            }
        )
    return found
