"""Jitted JAX steps used by the generation loop (no torch here).

The loop never does probability arithmetic itself: the draft's token draw and
the acceptance step both go through :mod:`specjax.kernels.frontend`, so the draft
distribution ``q`` used in the acceptance test is exactly the one the draft
tokens were sampled from.

Keys: the loop holds one key per batch row (``row_keys``, typed keys of shape
(B,)) so that a row's draws do not depend on the other rows of its batch. For
step ``t`` the row key is ``fold_in(row_key, t)``; draft draw ``i`` uses
``fold_in(step_key, i + 1)`` and the acceptance step ``fold_in(step_key, 0)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels.compile_options import vector_jit
from specjax.kernels.core import first_argmax, inverse_cdf, point_mass
from specjax.kernels.frontend import _uniforms, row_probs, row_stats, verify_core
from specjax.kernels.types import AcceptanceResult, SamplingParams


def fit_vocab(logits: jax.Array, vocab: int) -> jax.Array:
    """Pad the last axis with -inf (ids the model cannot produce) or cut it to ``vocab``."""
    have = logits.shape[-1]
    if have == vocab:
        return logits
    if have > vocab:
        return logits[..., :vocab]
    pad = [(0, 0)] * (logits.ndim - 1) + [(0, vocab - have)]
    return jnp.pad(logits, pad, constant_values=-jnp.inf)


def step_keys(row_keys: jax.Array, step: jax.Array | int, purpose: int) -> jax.Array:
    """One key per row for ``purpose`` (0: acceptance, i + 1: draft draw i) at ``step``."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None))
    return fold(fold(row_keys, step), purpose)


# Recompiles when B, the draft vocabulary, `vocab` or params.use_top_k / use_top_p /
# impl (static fields of the SamplingParams pytree) change.
@vector_jit(static_argnames=("vocab",))
def draft_draw(logits, row_keys, step, purpose, params: SamplingParams, *, vocab):
    """Draw one draft token per row.

    Args:
      logits: f[B, V_draft], the draft's logits at its last position.
      row_keys: key[B]; step: i32[]; purpose: i32[].
      params: :class:`SamplingParams` of B rows (f32/i32[B] fields).
      vocab: the target's vocabulary size V (the draft's logits are padded/cut to it).

    Returns:
      i32[B] draft tokens, drawn from exactly the distribution
      :func:`specjax.verify_from_logits` will recompute from the same logits.
    """
    x = fit_vocab(logits, vocab)

    def drawn(x: jax.Array) -> jax.Array:
        stats = row_stats(x, params.temperature, params.active_top_k, params.active_one_minus_top_p, impl=params.impl)

        def draw() -> jax.Array:
            probs = row_probs(stats, x, params.impl)
            keys = step_keys(row_keys, step, purpose)
            return inverse_cdf(probs, _uniforms(keys, x.shape[0], 1)[:, 0])

        # An all-greedy batch draws argmax (what the inverse CDF of its one-hot rows
        # returns) without the probability and CDF passes over V.
        return lax.cond(jnp.all(stats.greedy), lambda: stats.argmax, draw)

    if params.all_greedy:  # static: off the CPU the argmax alone (the same rule), no statistics, no branch
        return lax.platform_dependent(x, cpu=drawn, default=lambda x: first_argmax(x.astype(jnp.float32)))
    return drawn(x)


def sampling_uniform(u: jax.Array, draft_lengths: jax.Array) -> jax.Array:
    """f32[B]: row b's sampling uniform ``u[b, k_b]`` (its acceptance uniforms are ``u[b, :k_b]``).

    Indexed by the row's own draft length, not the step's G (the batch's
    largest ``k_b``): the uniforms of ``key_b`` are a prefix-stable sequence, so
    a row's draws do not depend on the other rows of its batch.
    """
    return jnp.take_along_axis(u, draft_lengths[:, None].astype(jnp.int32), axis=1)[:, 0]


def _stack_draft(draft_logits, b: int, vocab: int):
    """f[B, G, V] from a tuple of G f[B, V_draft]; None stays None (point masses)."""
    if draft_logits is None:
        return None
    if not draft_logits:
        return jnp.zeros((b, 0, vocab), jnp.float32)
    return fit_vocab(jnp.stack(draft_logits, axis=1), vocab)


# Recompiles when B, G, the vocabularies, params.use_top_k / use_top_p, point
# masses (draft_logits None) versus logits, or a point-mass mask versus none change.
@vector_jit
def verify_step(
    draft_tokens,
    draft_logits,
    target_logits,
    row_keys,
    step,
    params: SamplingParams,
    draft_lengths,
    point_mass_rows=None,
) -> AcceptanceResult:
    """The acceptance step of the loop (the fused JAX sampler).

    Args:
      draft_tokens: i32[B, G]; draft_logits: a tuple of G f[B, V_draft], or None
        for deterministic proposals (point masses); target_logits: f[B, G+1, V].
      row_keys: key[B]; step: i32[]; params: :class:`SamplingParams` of B rows;
      draft_lengths: i32[B], ``k_b``.
      point_mass_rows: None, or bool[B] with ``draft_logits``: rows whose
        proposals are deterministic (point masses) beside rows with draft logits;
        each row gets the result it would get in a batch of its own kind.
    """
    vocab = target_logits.shape[-1]
    b, g = draft_tokens.shape
    d = _stack_draft(draft_logits, b, vocab)
    u = _uniforms(step_keys(row_keys, step, 0), b, g + 1)
    return verify_core(
        draft_tokens,
        d,
        target_logits,
        u[:, :g],
        sampling_uniform(u, draft_lengths),
        params,
        draft_lengths,
        point_mass_rows=point_mass_rows,
    )


# Recompiles when B, G, the vocabularies, params.use_top_k / use_top_p or a point-mass
# mask versus none change.
@vector_jit
def probs_step(
    draft_logits, target_logits, row_keys, step, params: SamplingParams, draft_tokens=None, point_mass_rows=None
):
    """Processed probabilities and uniforms for a sampler with the probabilities contract.

    ``point_mass_rows``: None, or bool[B] with ``draft_logits`` and
    ``draft_tokens`` (i32[B, G]): the draft probabilities of these rows are the
    point masses at their tokens (their draft logits are not read).

    Returns ``(draft_probs f32[B, G, V] (None for point masses), target_probs f32[B, G+1, V],
    uniforms f32[B, G+1])``; for a row with draft length ``k_b``,
    ``uniforms[b, :k_b]`` are its acceptance uniforms and ``uniforms[b, k_b]``
    its sampling uniform (:func:`sampling_uniform`), exactly those
    :func:`verify_step` uses, so every sampler sees the same randomness.
    """
    vocab = target_logits.shape[-1]
    b, g1 = target_logits.shape[:2]
    g = g1 - 1

    rows = jax.tree.map(lambda a: a[:, None], params)  # (B, 1): one value per row, for every position

    def probs(x):
        stats = row_stats(x, rows.temperature, rows.active_top_k, rows.active_one_minus_top_p, impl=params.impl)
        return row_probs(stats, x, params.impl)

    d = _stack_draft(draft_logits, b, vocab)
    u = _uniforms(step_keys(row_keys, step, 0), b, g + 1)
    q = None if d is None else probs(d)
    if q is not None and point_mass_rows is not None:
        masses = point_mass(draft_tokens, lax.iota(jnp.int32, vocab), q.dtype)
        q = jnp.where(point_mass_rows[:, None, None], masses, q)
    return q, probs(target_logits), u
