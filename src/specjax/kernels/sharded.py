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
4. The inverse-CDF draw (:func:`~specjax.kernels.core.inverse_cdf`, the
   single-device function with the axis name): per-shard totals (the local
   blocked sums) are all-gathered, (B, S);
   their cumulative sum names the shard holding the draw; that shard searches
   its blocks, the others answer -1, and one ``pmax`` of (2, B) int32 returns
   its global id together with the global rounding fallback (the largest id
   with positive weight).

Logits: :func:`specjax.kernels.frontend.verify_core` runs with ``axis_name``;
row maxima, normalisers and argmaxes are combined with ``pmax``/``psum``/``pmin``
of row-shaped arrays, and top-k / top-p cutoffs come from
:func:`specjax.kernels.core.cutoff`, which on a mesh runs its exact bisection
over float32 bit patterns with ``psum``'d counts and masses (32 steps each).

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

Entry points: :func:`rejection_sample_on_mesh` and :func:`verify_on_mesh` run
validated JAX inputs on a :class:`MeshLayout`: ``shard_map`` over the very
functions one device runs (:func:`specjax.kernels.rejection.rejection_body`,
:func:`specjax.kernels.frontend.verify_core`), given the vocabulary axis. The public functions
(:func:`~specjax.boundary.api.rejection_sample_sharded` and ``verify_from_logits_sharded``,
which take the mesh and axis names explicitly, and :func:`specjax.rejection_sample`
/ :func:`specjax.verify_from_logits`, which come here when their
probabilities/logits are a ``NamedSharding`` that splits B and/or V, see
:func:`mesh_layout`) live in :mod:`specjax.boundary.api`, above this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax.kernels.compile_options import vector_jit
from specjax.kernels.core import AxisName
from specjax.kernels.frontend import _uniforms, verify_core
from specjax.kernels.rejection import rejection_body
from specjax.kernels.types import AcceptanceResult, SamplingParams

__all__ = [
    "AxisName",
    "MeshLayout",
    "check_axes",
    "mesh_layout",
    "rejection_sample_on_mesh",
    "verify_on_mesh",
]


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


def check_axes(mesh: Mesh, batch_axis: AxisName, vocab_axis: AxisName) -> None:
    """Raise ``ValueError`` unless both axes name axes of ``mesh`` and share none."""
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


def mesh_layout(x: Any, name: str = "target") -> MeshLayout | None:
    """The mesh layout of a (B, ..., V) array, or None for single-device inputs.

    ``x`` counts as sharded when it is a :class:`jax.Array` whose sharding is a
    :class:`~jax.sharding.NamedSharding` whose spec splits its first axis (B)
    and/or its last axis (V). (:func:`specjax.boundary.api.rejection_sample_sharded`
    and ``verify_from_logits_sharded`` pass their layout explicitly instead.)

    Raises:
      ValueError: when the spec splits a middle axis (G or G+1).
    """
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
# The probability kernel on a mesh
# --------------------------------------------------------------------------- #


def _rejection_body(
    draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, vocab_axis: AxisName, per_shard: bool
):
    """One shard's step (:func:`specjax.kernels.rejection.rejection_body` with the vocabulary axis).

    ``draft_probs=None``: point masses at the draft tokens (``q_i(x_i) = 1``).
    """
    out = rejection_body(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, axis_name=vocab_axis
    )
    if per_shard:
        out = jax.tree.map(lambda v: v[None], out)
    return out


def _without_draft(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` for point-mass drafts: shard_map passes no draft array, the body gets None."""

    def run(draft_tokens, *rest, **kwargs):
        return body(draft_tokens, None, *rest, **kwargs)

    return run


def _out_specs(layout: MeshLayout, per_shard: bool) -> AcceptanceResult:
    """The partition specs of the results, as the result pytree (``num_accepted``, ``tokens``)."""
    ba, va = layout.batch_axis, layout.vocab_axis
    if per_shard:
        return AcceptanceResult(P(va, ba), P(va, ba, None))
    return AcceptanceResult(P(ba), P(ba, None))


def _trim(out: AcceptanceResult, batch: int, mesh: Mesh, per_shard: bool) -> AcceptanceResult:
    """Cut padded rows off (replicating the small results first, which explicit meshes need)."""
    rows = 1 if per_shard else 0
    if out.num_accepted.shape[rows] == batch:
        return out
    return jax.tree.map(lambda v: lax.slice_in_dim(_constrain(v, mesh, P()), 0, batch, axis=rows), out)


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
) -> AcceptanceResult:
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


# --------------------------------------------------------------------------- #
# The logits front end on a mesh
# --------------------------------------------------------------------------- #


def _verify_body(
    draft_tokens,
    draft_logits,
    target_logits,
    u,
    params: SamplingParams,
    draft_lengths,
    *,
    vocab_axis: AxisName,
    per_shard: bool,
):
    g = draft_tokens.shape[1]
    offset = lax.axis_index(vocab_axis) * target_logits.shape[2] if vocab_axis else 0
    out = verify_core(
        draft_tokens,
        draft_logits,
        target_logits,
        u[:, :g],
        u[:, g],
        params,
        draft_lengths,
        axis_name=vocab_axis,
        offset=offset,
    )
    if per_shard:
        out = jax.tree.map(lambda v: v[None], out)
    return out


# Recompiles when shapes/dtypes change, when the key kind changes (one key or one
# per row), when params.use_top_k / use_top_p change (static fields of the
# SamplingParams pytree), or the layout changes. Never for values.
@vector_jit(static_argnames=("layout", "per_shard"))
def _verify_mesh_jit(
    draft_tokens,
    draft_logits,
    target_logits,
    key,
    params: SamplingParams,
    draft_lengths,
    *,
    layout: MeshLayout,
    per_shard: bool = False,
):
    mesh, ba, va = layout.mesh, layout.batch_axis, layout.vocab_axis
    b, g = draft_tokens.shape
    vocab = target_logits.shape[2]
    # One draw for the whole batch, exactly as on one device, before any padding.
    u = _uniforms(key, b, g + 1)
    b_pad = _round_up(b, layout.size(ba))
    v_pad = _round_up(vocab, layout.size(va))
    row = P(ba)
    point_masses = draft_logits is None
    # Padded rows: temperature 1, no top-k/top-p (their results are cut off).
    padded = replace(
        jax.tree.map(lambda a: _pad_to(a, 0, b_pad), params), temperature=_pad_to(params.temperature, 0, b_pad, 1)
    )
    args = (
        _constrain(_pad_to(draft_tokens, 0, b_pad), mesh, P(ba, None)),
        *(
            ()
            if point_masses
            else (_constrain(_pad_to(_pad_to(draft_logits, 0, b_pad), 2, v_pad, -jnp.inf), mesh, P(ba, None, va)),)
        ),
        _constrain(_pad_to(_pad_to(target_logits, 0, b_pad), 2, v_pad, -jnp.inf), mesh, P(ba, None, va)),
        _constrain(_pad_to(u, 0, b_pad), mesh, P(ba, None)),
        jax.tree.map(lambda a: _constrain(a, mesh, row), padded),
        _constrain(_pad_to(draft_lengths, 0, b_pad), mesh, row),
    )
    body: Callable[..., Any] = partial(_verify_body, vocab_axis=va, per_shard=per_shard)
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
            row,  # every field of params
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
    params: SamplingParams,
    draft_lengths,
    *,
    layout: MeshLayout,
    per_shard: bool = False,
) -> AcceptanceResult:
    """The logits front end on ``layout``, for the arguments of ``frontend._verify_jit``."""
    ba, va = layout.batch_axis, layout.vocab_axis
    row = P(ba)
    return _verify_mesh_jit(
        _place(draft_tokens, layout, P(ba, None)),
        None if draft_logits is None else _place(draft_logits, layout, P(ba, None, va)),
        _place(target_logits, layout, P(ba, None, va)),
        _place(key, layout, P()),
        jax.tree.map(lambda a: _place(a, layout, row), params),
        _place(draft_lengths, layout, row),
        layout=layout,
        per_shard=per_shard,
    )
