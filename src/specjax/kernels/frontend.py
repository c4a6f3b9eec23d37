"""The logits front end: the one place where logits become a sampling distribution.

Speculative decoding is lossless only if the draft distribution ``q`` in the
acceptance test is exactly the distribution the draft token was sampled from,
and the target distribution ``p`` is processed exactly as the user asked. Both
:func:`specjax.sample_from_logits` (the draft side) and :func:`specjax.verify_from_logits` (the
acceptance step) go through the same :func:`row_stats` / :func:`probs_from_stats`
pair, so they cannot disagree (vocabulary: see :mod:`specjax.kernels.rejection`).

Processing, per row, with the semantics of transformers' warpers
(``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` with
``min_tokens_to_keep=1``), in float32 whatever the input dtype:

1. temperature: ``logits / T``; ``T = 0`` means greedy: the distribution is
   one-hot at ``argmax(logits)`` (first index on ties, like ``torch.argmax``);
2. top-k: keep the logits ``>=`` the k-th largest; ``k = 0`` keeps all;
3. top-p: sort ascending, softmax, cumulative sum; drop the tokens whose
   cumulative probability is ``<= 1 - top_p``, always keeping the largest;
   ``top_p = 1`` keeps all;
4. softmax over the kept logits.

A processed row is summarised by :class:`RowStats` (scale, cutoff, max,
normaliser, argmax), so probabilities are computed only where needed: at the B·G
draft tokens, and on the one row per batch row the correction token is drawn
from. The (B, G+1, V) probabilities are never materialised. On CPU (one CPU
device) the row statistics and the residual draw run as C++ kernels inside the
jitted functions (:mod:`specjax.kernels.cpu_kernels`); elsewhere, on one device
without top-k/top-p, the acceptance step summarises position ``i`` only while
some row of the batch is still accepting (rows after every row's first
rejection are never read).

Per-row parameters (temperature, top_k, top_p, draft_lengths) are arrays:
changing their values never recompiles. The sampling parameters travel as one
:class:`~specjax.kernels.types.SamplingParams` pytree; whether top-k / top-p are
used at all is one of its static fields (the primitives below take ``None``
for an unused one), because it decides whether rows get sorted.

This module takes and returns JAX arrays; the public functions
(:func:`specjax.sample_from_logits`, :func:`specjax.verify_from_logits`), which
convert and validate user inputs first, live in :mod:`specjax.boundary.api`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specjax.kernels import cpu_kernels
from specjax.kernels.compile_options import vector_jit
from specjax.kernels.core import (
    AxisName,
    assemble_tokens,
    cutoff,
    first_argmax,
    inverse_cdf,
    num_accepted_from_ratios,
    point_mass,
    residual_weights,
    take_rows,
    vocab_argmax,
    vocab_gather,
    vocab_max,
    vocab_sum,
)
from specjax.kernels.types import AcceptanceResult, SamplingParams

__all__ = ["TEMPERATURE_RANGE", "RowStats", "probs_from_stats", "row_probs", "row_stats", "verify_core"]

_NEG_INF = -jnp.inf
_F32_MAX = float(np.finfo(np.float32).max)
#: Positive temperatures whose reciprocal is a normal float32 (2**-126 to 2**126): the
#: range where the processed distribution is computed faithfully. Beyond 2**126, 1/T
#: would be subnormal, which the CPU flushes to 0 (and 0 would read as greedy).
TEMPERATURE_RANGE = (2.0**-126, 2.0**126)
_INT32_MAX = int(np.iinfo(np.int32).max)


class RowStats(NamedTuple):
    """Summary of one processed distribution per row (all f32/i32 of the row shape).

    ``prob(v) = [v == argmax]`` for greedy rows, else ``exp(s(v)) / normaliser``
    where ``s(v) >= cutoff``, and 0 elsewhere, with the *relative scaled logit*
    ``s(v) = (logit(v) - max)·inv_temperature`` (<= 0; 0 at the max).

    The max is subtracted before scaling: computed as ``logit·c - max·c``, the
    two products round differently (XLA may even fuse one into an FMA), and with
    a large ``c`` (a small temperature) their difference is off by far more than
    1, so ``exp`` of it is not normalised, or overflows.

    The scaling is a multiplication by a stored reciprocal, never a division:
    XLA may turn ``x / t`` into ``x * (1/t)`` in one fused loop and not in
    another, and a one-ulp difference would move the token at the top-k/top-p
    cutoff in or out of the distribution between the full-row and the
    gathered-token paths.
    """

    inv_temperature: jax.Array  # f32[...]: 1 / temperature (1 for greedy rows)
    greedy: jax.Array  # bool[...]
    cutoff: jax.Array  # f32[...]: smallest kept relative scaled logit s(v) (-inf: keep all)
    max: jax.Array  # f32[...]: max logit (unscaled)
    normaliser: jax.Array  # f32[...]: sum of exp(s(v)) over kept tokens
    argmax: jax.Array  # i32[...]: first index of the largest logit


# --------------------------------------------------------------------------- #
# Processing (the primitives, reductions and cutoff included, are in
# specjax.kernels.core; each takes an optional mesh axis)
# --------------------------------------------------------------------------- #


def _inverse_temperature(temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(1 / T, T <= 0)`` per row: f32 and bool of ``temperature``'s shape; 1 for greedy rows.

    1 / T is at most the largest float (a subnormal T would give inf, and 0·inf is NaN)
    and at least 2**-126 (a T past :data:`TEMPERATURE_RANGE`, possible with
    ``validate=False``, must not flush 1 / T to 0 and so turn a sampling row greedy).
    """
    greedy = temperature <= 0
    inv_t = jnp.where(
        greedy,
        jnp.float32(1),
        jnp.clip(1 / jnp.where(greedy, jnp.float32(1), temperature), TEMPERATURE_RANGE[0], _F32_MAX),
    )
    return inv_t, greedy


def _row_cutoffs(
    x: jax.Array,
    inv_t: jax.Array,
    top_k: jax.Array | None,
    one_minus_top_p: jax.Array | None,
    x_max: jax.Array | None = None,
    axis_name: AxisName = None,
    raw: jax.Array | None = None,
) -> jax.Array:
    """f32[...]: each row's smallest kept ``s_j = (x_j - max)·inv_t`` (-inf without top-k/top-p).

    ``x`` is f32[..., V]; ``inv_t`` and the optional parameters broadcast to its
    rows; ``x_max`` is the rows' max when already known; ``raw``: ``x`` in its
    own dtype (``x`` is its float32 conversion), for the TPU's candidates pass
    to read as it lies in memory.
    """
    rows = x.shape[:-1]
    if top_k is None and one_minus_top_p is None:
        return jnp.full(rows, _NEG_INF, jnp.float32)
    if x_max is None:
        x_max = vocab_max(x, axis_name)
    row_max, inv = x_max[..., None], jnp.broadcast_to(inv_t, rows)[..., None]

    def to_scaled(v: jax.Array) -> jax.Array:  # non-decreasing in v: inv > 0
        return (v.astype(jnp.float32) - row_max) * inv

    return cutoff(
        to_scaled(x),
        None if top_k is None else jnp.broadcast_to(top_k, rows),
        None if one_minus_top_p is None else jnp.broadcast_to(one_minus_top_p, rows),
        axis_name,
        source=(x if raw is None else raw, to_scaled),
    )


def row_stats(
    logits: jax.Array | Callable[[], jax.Array],
    temperature: jax.Array,
    top_k: jax.Array | None = None,
    one_minus_top_p: jax.Array | None = None,
    *,
    axis_name: AxisName = None,
    offset: jax.Array | int = 0,
    impl: str = "xla",
) -> RowStats:
    """Summarise the processed distribution of every row of ``logits``.

    Args:
      logits: f[..., V] (any float dtype; processed in float32), or a function
        of no arguments that returns them (e.g. a slice of a larger input):
        the conditional passes below then call it inside their branches and
        read the input in place, where an array would be copied into them.
      temperature: f32[...] (broadcast to the row shape); 0 means greedy.
      top_k: optional i32[...]; 0 keeps all.
      one_minus_top_p: optional f32[...], ``1 - top_p``; 0 keeps all.
      axis_name: the mesh axis the vocabulary is split over, inside shard_map.
      offset: the global index of this shard's first vocabulary entry.
      impl: ``"xla"`` or ``"cpu"`` (static; :mod:`specjax.kernels.cpu_kernels`):
        on one device, ``"cpu"`` summarises each row in one C++ pass where the
        function is lowered for a CPU.
    """

    def read() -> jax.Array:
        return (logits() if callable(logits) else logits).astype(jnp.float32)

    x = read()
    rows = x.shape[:-1]
    inv_t, greedy = _inverse_temperature(jnp.broadcast_to(temperature, rows))
    filtered = top_k is not None or one_minus_top_p is not None

    def relative(x: jax.Array, x_max: jax.Array) -> jax.Array:
        return (x - x_max[..., None]) * inv_t[..., None]

    x_max = vocab_max(x, axis_name) if filtered else None
    raw = logits() if callable(logits) else logits
    cut = _row_cutoffs(x, inv_t, top_k, one_minus_top_p, x_max, axis_name, raw=raw)
    vocab = x.shape[-1]

    def jax_summary() -> tuple[jax.Array, jax.Array, jax.Array]:
        row_max = vocab_max(x, axis_name) if x_max is None else x_max

        def normaliser() -> jax.Array:
            s = relative(read(), row_max)
            e = jnp.exp(s)
            if filtered:
                e = jnp.where(s >= cut[..., None], e, 0)
            return vocab_sum(e, axis_name)

        # Skip the exp pass when every row is greedy and the argmax pass when none
        # is (the predicates are replicated on a mesh). Both branches read the
        # logits through ``read`` (an input buffer, or a reader of a slice of one)
        # and (B,) vectors, so the conditionals copy nothing of size V.
        z = lax.cond(jnp.all(greedy), lambda: jnp.ones(rows, jnp.float32), normaliser)
        am = lax.cond(
            jnp.any(greedy),
            lambda: vocab_argmax(read(), row_max, axis_name, offset),
            lambda: jnp.zeros(rows, jnp.int32),
        )
        return row_max, z, am

    def cpu_summary() -> tuple[jax.Array, jax.Array, jax.Array]:
        # One C++ pass per row (specjax.kernels.cpu_kernels); greedy rows are
        # marked by a scale of 0 and get no exp pass.
        flat = read().reshape(-1, vocab)
        scale = jnp.where(greedy, jnp.float32(0), inv_t).reshape(-1)
        x_max, z, am = cpu_kernels.row_stats(flat, scale, jnp.broadcast_to(cut, rows).reshape(-1))
        return x_max.reshape(rows), z.reshape(rows), am.reshape(rows) + offset

    if not axis_name and cpu_kernels.require(impl):
        row_max, z, am = lax.platform_dependent(cpu=cpu_summary, default=jax_summary)
    else:
        row_max, z, am = jax_summary()
    return RowStats(inv_t, greedy, cut, row_max, z, am)


def probs_from_stats(stats: RowStats, logit_values: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Probability of ``token_ids`` (whose logits are ``logit_values``) under ``stats``.

    ``stats`` fields have the shape of ``logit_values`` without its trailing
    axes; both ``logit_values`` and ``token_ids`` broadcast against each other.
    Returns f32 of their broadcast shape.
    """
    extra = logit_values.ndim - stats.max.ndim

    def e(a):
        return a.reshape(a.shape + (1,) * extra)

    rel = (logit_values.astype(jnp.float32) - e(stats.max)) * e(stats.inv_temperature)
    soft = jnp.where(rel >= e(stats.cutoff), jnp.exp(rel) / e(stats.normaliser), 0)
    onehot = (token_ids == e(stats.argmax)).astype(jnp.float32)
    return jnp.where(e(stats.greedy), onehot, soft)


def row_probs(stats: RowStats, logits: jax.Array, impl: str = "xla") -> jax.Array:
    """f32[..., V]: the processed distribution of every row of ``logits`` (f[..., V], one device).

    :func:`probs_from_stats` over all ids; with ``impl="cpu"`` (static), on a
    CPU the C++ :func:`specjax.kernels.cpu_kernels.probs`, whose arithmetic for
    a token is that of the acceptance step's
    (:func:`specjax.kernels.cpu_kernels.verify`), so a draft token's
    probability is the same there, bit for bit.
    """
    vocab = logits.shape[-1]
    rows = logits.shape[:-1]

    def jax_probs() -> jax.Array:
        return probs_from_stats(stats, logits, lax.iota(jnp.int32, vocab))

    def cpu_probs() -> jax.Array:
        params = jnp.stack(
            [jnp.where(stats.greedy, jnp.float32(0), stats.inv_temperature), stats.max, stats.normaliser, stats.cutoff],
            axis=-1,
        )
        out = cpu_kernels.probs(
            logits.astype(jnp.float32).reshape(-1, vocab), params.reshape(-1, 4), stats.argmax.reshape(-1)
        )
        return out.reshape(*rows, vocab)

    if cpu_kernels.require(impl):
        return lax.platform_dependent(cpu=cpu_probs, default=jax_probs)
    return jax_probs()


def _take_rows(stats: RowStats, index: jax.Array) -> RowStats:
    """Select one position per batch row: fields [B, P] -> [B]."""
    return RowStats(*(jnp.take_along_axis(f, index[:, None], axis=1)[:, 0] for f in stats))


def _uniforms(key: jax.Array, batch: int, count: int) -> jax.Array:
    """f32[B, count] uniforms in [0, 1) from one key, or from one key per row."""
    if key.ndim == 0:
        return jax.random.uniform(key, (batch, count), jnp.float32)
    return jax.vmap(lambda k: jax.random.uniform(k, (count,), jnp.float32))(key)


# --------------------------------------------------------------------------- #
# Jitted cores
# --------------------------------------------------------------------------- #


def verify_core(
    draft_tokens: jax.Array,
    draft_logits: jax.Array | None,
    target_logits: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
    params: SamplingParams,
    draft_lengths: jax.Array,
    *,
    point_mass_rows: jax.Array | None = None,
    axis_name: AxisName = None,
    offset: jax.Array | int = 0,
) -> AcceptanceResult:
    """The acceptance step from logits (traceable; see :func:`verify_from_logits`).

    ``params`` holds f32/i32[B] per-row fields (:class:`SamplingParams`).
    ``point_mass_rows``: None, or bool[B] with ``draft_logits`` given: the rows
    whose ``q_i`` is the point mass at ``x_i`` (their draft logits are not read),
    as if ``draft_logits`` were None for them alone.
    With ``axis_name``, the last axis of the logits is this shard's slice of the
    vocabulary (starting at global index ``offset``) inside ``shard_map``.
    """
    b, g = draft_tokens.shape
    vocab_local = target_logits.shape[-1]
    row = (slice(None), None)
    temperature, top_k, one_minus_top_p = params.temperature, params.active_top_k, params.active_one_minus_top_p
    point_masses = draft_logits is None  # q_i is the point mass at x_i
    # k_b outside [0, G] (possible with validate=False) means what its clamped value
    # means, on every path: the C++ step clamps it too.
    draft_lengths = jnp.clip(draft_lengths, 0, g)
    positions = jnp.arange(g, dtype=jnp.int32)
    valid = positions[None, :] < draft_lengths[:, None]
    x = jnp.where(valid, draft_tokens, 0).astype(jnp.int32)

    def stats(logits: jax.Array) -> RowStats:  # the same processing for both sides
        return row_stats(
            logits,
            temperature[row],
            None if top_k is None else top_k[row],
            None if one_minus_top_p is None else one_minus_top_p[row],
            axis_name=axis_name,
            offset=offset,
            impl=params.impl,
        )

    def summarise_all_rows() -> tuple[RowStats, RowStats | None, jax.Array]:
        t_stats = stats(target_logits)
        if g == 0:
            return t_stats, None, jnp.zeros((b,), jnp.int32)
        t_first = RowStats(*(f[:, :g] for f in t_stats))
        p_x = probs_from_stats(t_first, vocab_gather(target_logits[:, :g], x, axis_name, offset), x)
        if point_masses:  # q_i(x_i) = 1
            return t_stats, None, num_accepted_from_ratios(p_x, jnp.ones_like(p_x), accept_uniforms, draft_lengths)
        assert draft_logits is not None
        d_stats = stats(draft_logits)
        q_x = probs_from_stats(d_stats, vocab_gather(draft_logits, x, axis_name, offset), x)
        if point_mass_rows is not None:
            q_x = jnp.where(point_mass_rows[:, None], jnp.float32(1), q_x)
        return t_stats, d_stats, num_accepted_from_ratios(p_x, q_x, accept_uniforms, draft_lengths)

    def draw(n: jax.Array, t_sel: RowStats, d_sel: RowStats | None) -> AcceptanceResult:
        y = _draw_from_logits(
            target_logits,
            draft_logits,
            t_sel,
            d_sel,
            n,
            draft_lengths,
            sample_uniforms,
            x,
            axis_name,
            offset,
            point_mass_rows,
        )
        return AcceptanceResult(n, assemble_tokens(x, n, y, None if axis_name else vocab_local))

    def draw_unless_greedy(n: jax.Array, t_sel: RowStats, d_sel: RowStats | None) -> AcceptanceResult:
        # Every row greedy: p_n is the point mass at argmax p_n, and so is q_n (the same
        # temperature) or the draft's point mass; a rejected x_n is not argmax p_n
        # (p_n(x_n) = 0), so the residual (or, emptied, p_n itself) and the bonus draw
        # all give argmax p_n: the statistics hold it; no draw, no pass over V.
        def greedy_rows() -> AcceptanceResult:
            return AcceptanceResult(n, assemble_tokens(x, n, t_sel.argmax))

        return lax.cond(jnp.all(t_sel.greedy), greedy_rows, lambda: draw(n, t_sel, d_sel))

    def all_rows() -> AcceptanceResult:
        t_stats, d_stats, n = summarise_all_rows()
        d_sel = None if d_stats is None else _take_rows(d_stats, jnp.minimum(n, g - 1))
        return draw_unless_greedy(n, _take_rows(t_stats, n), d_sel)

    def lazily_one_device() -> AcceptanceResult:
        return draw_unless_greedy(
            *_accept_lazily(x, draft_logits, target_logits, accept_uniforms, temperature, draft_lengths)
        )

    def fused_cpu() -> AcceptanceResult:
        # The whole step in one C++ call (cpu_kernels.verify): per batch row,
        # position by position, summarising a row only while the tests pass.
        # Only the top-k/top-p cutoffs (a top-k over every row) run in XLA first.
        assert draft_logits is not None  # point masses return before the C++ path
        inv_t, greedy = _inverse_temperature(temperature)

        def cutoffs(logits: jax.Array) -> jax.Array:
            return _row_cutoffs(
                logits.astype(jnp.float32),
                inv_t[row],
                None if top_k is None else top_k[row],
                None if one_minus_top_p is None else one_minus_top_p[row],
            )

        n, y = cpu_kernels.verify(
            target_logits.astype(jnp.float32),
            draft_logits.astype(jnp.float32),
            x,
            draft_lengths,
            accept_uniforms.astype(jnp.float32),
            sample_uniforms.astype(jnp.float32),
            jnp.where(greedy, jnp.float32(0), inv_t),
            cutoffs(target_logits),
            cutoffs(draft_logits),
        )
        return AcceptanceResult(n, assemble_tokens(x, n, y, None if axis_name else vocab_local))

    def greedy_batch() -> AcceptanceResult:
        # Every row greedy: p_i is the point mass at argmax p_i whatever the filters, and
        # q_i(x_i) is 0 or 1 (a greedy draft row's point mass, or the drafter's), never
        # NaN; so test i passes iff x_i = argmax p_i, and the token after the accepted
        # prefix is argmax p_n. One argmax over the target's G+1 rows decides the step;
        # the draft logits are not read. The same rule as :func:`num_accepted_from_ratios`.
        am = first_argmax(target_logits.astype(jnp.float32))  # on a TPU one read (core.first_argmax)
        p_x = (x == am[:, :g]).astype(jnp.float32)
        n = num_accepted_from_ratios(p_x, jnp.ones_like(p_x), accept_uniforms, draft_lengths)
        return AcceptanceResult(n, assemble_tokens(x, n, jnp.take_along_axis(am, n[:, None], axis=1)[:, 0]))

    if not axis_name:
        if point_masses or point_mass_rows is not None:
            # One pass summarises the target's G+1 rows (and the draft's, for rows
            # with logits); the draw then reads row n only. No C++ fast path: the
            # target's forward dwarfs this step, and the JAX code is the contract.
            jax_path = all_rows
        elif top_k is not None or one_minus_top_p is not None:
            # Every row needs its cutoff (a top-k or a full pass anyway), and one
            # call over all rows is cheaper than one per position.
            jax_path = all_rows
        else:  # summarise positions only as far as needed
            jax_path = lazily_one_device

        def off_cpu() -> AcceptanceResult:
            # On an accelerator the per-position passes read strided slices of the
            # (B, G+1, V) tiles (several reads of the input); an all-greedy batch needs
            # one argmax (docs/tpu.md). XLA:CPU keeps its programs. Known all greedy
            # (params.all_greedy, static): no branch, so nothing but the argmax reads
            # the logits (on a TPU the loop's were materialised in float32 for the
            # cond: benchmarks/results/tpu-loop/run-4fa2176.log).
            if params.all_greedy:
                return greedy_batch()
            return lax.cond(jnp.all(temperature <= 0), greedy_batch, jax_path)

        if cpu_kernels.require(params.impl) and not (point_masses or point_mass_rows is not None):
            return lax.platform_dependent(cpu=fused_cpu, default=off_cpu)
        return lax.platform_dependent(cpu=jax_path, default=off_cpu)

    # On a mesh: the same composition with the vocabulary axis (no C++, no lazy pass).
    return all_rows()


def _accept_lazily(x, draft_logits, target_logits, accept_uniforms, temperature, draft_lengths):
    """``n`` and the statistics of the rows the draw needs, position by position (one device).

    Without top-k/top-p only (see :func:`verify_core`).

    The tests run in order and the first failure ends a row, so position ``i``
    is summarised (max and normaliser: a pass over V for each side) only
    while some row of the batch is still accepting: a ``while_loop`` over
    positions that stops when every row has failed or used its ``k_b`` tests.
    With rejection early in the draft, most of the 2G+1 rows are never read.
    Each row's arithmetic is that of :func:`row_stats` on a (B, V) slice.

    Returns:
      ``(n, t_sel, d_sel)``: i32[B]; the target's statistics at position
      ``n`` (the row the correction or bonus token comes from) and the draft's
      at ``n`` when ``n < k_b`` (else unused), as :class:`RowStats` of (B,)
      fields; ``d_sel`` is None when G = 0.
    """
    b, g = x.shape

    def stats(logits, i):
        return row_stats(lambda: at(logits, i), temperature)

    def at(logits, i):
        return lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)

    def placeholder():
        return RowStats(
            jnp.ones((b,), jnp.float32),
            jnp.zeros((b,), bool),
            jnp.full((b,), _NEG_INF, jnp.float32),
            jnp.zeros((b,), jnp.float32),
            jnp.ones((b,), jnp.float32),
            jnp.zeros((b,), jnp.int32),
        )

    def select(mask, new, old):
        return RowStats(*(jnp.where(mask, a, c) for a, c in zip(new, old, strict=True)))

    n = jnp.zeros((b,), jnp.int32)
    t_sel = placeholder()
    d_sel = None
    if g > 0:

        def cond(carry):
            i, alive = carry[0], carry[1]
            return (i < g) & jnp.any(alive)

        def body(carry):
            i, alive, n, t_sel, d_sel = carry
            t_row, d_row = at(target_logits, i), at(draft_logits, i)
            ts, ds = stats(target_logits, i), stats(draft_logits, i)
            xi = lax.dynamic_index_in_dim(x, i, axis=1, keepdims=True)  # (B, 1)
            p = probs_from_stats(ts, vocab_gather(t_row, xi[:, 0], None, 0), xi[:, 0])
            q = probs_from_stats(ds, vocab_gather(d_row, xi[:, 0], None, 0), xi[:, 0])
            u = lax.dynamic_index_in_dim(accept_uniforms, i, axis=1, keepdims=True)
            passes = num_accepted_from_ratios(p[:, None], q[:, None], u) == 1
            rejected = alive & ~passes
            t_sel, d_sel = select(rejected, ts, t_sel), select(rejected, ds, d_sel)
            n = jnp.where(alive & passes, i + 1, n)
            return i + 1, alive & passes & (i + 1 < draft_lengths), n, t_sel, d_sel

        alive = draft_lengths > 0
        _, _, n, t_sel, d_sel = lax.while_loop(cond, body, (jnp.int32(0), alive, n, t_sel, placeholder()))

    # Rows that passed all their k_b tests emit the bonus token from p at k_b.
    bonus = n >= draft_lengths

    def bonus_stats():
        def t_row():
            return jnp.take_along_axis(target_logits, n[:, None, None], axis=1)[:, 0]

        return select(bonus, row_stats(t_row, temperature), t_sel)

    t_sel = lax.cond(jnp.any(bonus), bonus_stats, lambda: t_sel)
    return n, t_sel, d_sel


def _draw_from_logits(
    target_logits,
    draft_logits,
    t_sel,
    d_sel,
    n,
    draft_lengths,
    sample_uniforms,
    x,
    axis_name=None,
    offset=0,
    point_mass_rows=None,
):
    """i32[B]: y per row from the residual of the processed rows ``p_n``, ``q_n`` (JAX code).

    ``t_sel`` / ``d_sel`` are the statistics of row ``n`` (:class:`RowStats` of
    (B,) fields). Only row ``n`` of the target logits (and of the draft logits,
    when a draft token was rejected) is turned into probabilities, (B, L) each.
    ``draft_logits=None``: ``q_n`` is the point mass at ``x_n`` (i32[B, G]
    ``x``), and so it is for the rows of ``point_mass_rows`` (bool[B]). With
    ``axis_name`` the logits are this shard's vocabulary slice, global ids from
    ``offset``. (On one CPU device the C++
    :func:`specjax.kernels.cpu_kernels.verify` does the step with draft logits.)
    """
    g = x.shape[1]
    size = target_logits.shape[-1]
    ids = (lax.iota(jnp.int32, size) + offset)[None, :]
    t_row = take_rows(target_logits, n, axis_name)
    p_n = probs_from_stats(t_sel, t_row, ids)
    if g == 0:
        q_n = jnp.zeros_like(p_n)
    else:
        d_pos = jnp.minimum(n, g - 1)
        x_n = jnp.take_along_axis(x, d_pos[:, None], axis=1)[:, 0]
        if draft_logits is None:
            q_n = point_mass(x_n, ids[0], jnp.float32)
        else:
            d_row = take_rows(draft_logits, d_pos, axis_name)
            q_n = probs_from_stats(d_sel, d_row, ids)
            if point_mass_rows is not None:
                q_n = jnp.where(point_mass_rows[:, None], point_mass(x_n, ids[0], jnp.float32), q_n)
        q_n = jnp.where((n < draft_lengths)[:, None], q_n, 0)
    return inverse_cdf(residual_weights(p_n, q_n, axis_name), sample_uniforms, axis_name, offset)


# Recompiles when shapes/dtypes change, when the key kind changes (one key or one
# per row), or when params.use_top_k / use_top_p change (static fields of the
# SamplingParams pytree). Never for values.
@vector_jit
def _verify_jit(draft_tokens, draft_logits, target_logits, key, params: SamplingParams, draft_lengths):
    b, g = draft_tokens.shape
    u = _uniforms(key, b, g + 1)
    return verify_core(draft_tokens, draft_logits, target_logits, u[:, :g], u[:, g], params, draft_lengths)


# Recompiles when shapes/dtypes, the key kind or params.use_top_k / use_top_p change.
@vector_jit
def _sample_jit(logits, key, params: SamplingParams):
    b = logits.shape[0]
    stats = row_stats(logits, params.temperature, params.active_top_k, params.active_one_minus_top_p, impl=params.impl)
    probs = row_probs(stats, logits, params.impl)
    # clipped: an unvalidated degenerate row (NaN) still gives an id in [0, V), never -1
    tokens = jnp.clip(inverse_cdf(probs, _uniforms(key, b, 1)[:, 0]), 0, logits.shape[-1] - 1)
    return tokens, probs
