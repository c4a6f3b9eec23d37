"""The point-mass acceptance step on a flattened, ragged layout (vLLM's), without copying the logits.

vLLM hands the rejection step the target's logits at every draft position of
every request as the rows of one f32[T, V] array (T = Σ_b k_b, request b's
rows contiguous, in order) and the draft tokens as i32[T]. The
(B, G+1, V) layout of :func:`specjax.kernels.frontend.verify_core` would need
those rows copied into a padded buffer, T·V floats per step: more than the
step itself. This module composes the same primitives on the flattened rows
instead, in three stages, each jitted by the caller
(:mod:`specjax.plugin.vllm`):

1. :func:`summarise_rows`: per flattened row, the processed distribution's
   statistics (:func:`~specjax.kernels.frontend.row_stats`) and from them
   ``p_i(x_i)`` and the argmax, scattered into a (B, G) grid. Callers run it
   on zero-copy slices of the (T, V) array whose lengths are powers of two,
   so it compiles once per slice length, not once per T.
2. :func:`accept`: on the (B, G) grid, the accepted prefix
   (:func:`~specjax.kernels.core.num_accepted_from_ratios` with
   ``q_i(x_i) = 1``, the point mass) and the emitted token wherever no draw is
   needed: the bonus token when every draft token passed, the argmax for a
   greedy row (the residual of a point mass ``p_n`` without ``x_n`` is
   ``p_n``).
3. :func:`residual_draw`: for the sampled rows that rejected ``x_n``, the
   draw from ``p_n`` without ``x_n``, on those rows alone (gathered by the
   caller), by :func:`~specjax.kernels.frontend._draw_from_logits`.

Given the same uniforms, the tokens are those of ``verify_core`` with
``draft_logits=None`` on the padded layout (tests/test_flat.py checks it),
with the bonus position taken from the caller. Leviathan et al. 2023
(arXiv 2211.17192); Chen et al. 2023 (arXiv 2302.01318).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.kernels.core import assemble_tokens, num_accepted_from_ratios, vocab_gather
from specjax.kernels.frontend import _draw_from_logits, probs_from_stats, row_stats

__all__ = ["accept", "residual_draw", "summarise_rows"]


def summarise_rows(
    grid_p: jax.Array,
    grid_argmax: jax.Array,
    target_logits: jax.Array,
    temperature: jax.Array,
    draft_tokens: jax.Array,
    slots: jax.Array,
    impl: str = "xla",
) -> tuple[jax.Array, jax.Array]:
    """Write ``p_i(x_i)`` and the argmax of N flattened rows into their grid slots.

    Args:
      grid_p: f32[S], the (B, G) grid of ``p_i(x_i)`` flattened (S = B·G).
      grid_argmax: i32[S], the grid of the processed rows' argmax.
      target_logits: f[N, V], N of the T flattened rows.
      temperature: f32[N], each row's temperature (0: greedy).
      draft_tokens: i32[N], each row's draft token ``x_i``; an id outside
        [0, V) gets probability 0 (never accepted).
      slots: i32[N], each row's slot ``b·G + i`` in the grid.
      impl: static, ``"xla"`` or ``"cpu"`` (:func:`~specjax.kernels.frontend.row_stats`).

    Returns:
      ``(grid_p, grid_argmax)`` with the N slots written.
    """
    stats = row_stats(target_logits, temperature, impl=impl)
    x = draft_tokens.astype(jnp.int32)
    p_x = probs_from_stats(stats, vocab_gather(target_logits, x, None, 0), x)
    return grid_p.at[slots].set(p_x, mode="drop"), grid_argmax.at[slots].set(stats.argmax, mode="drop")


def accept(
    target_at_draft: jax.Array,
    argmax: jax.Array,
    draft_tokens: jax.Array,
    draft_lengths: jax.Array,
    accept_uniforms: jax.Array,
    greedy: jax.Array,
    bonus_tokens: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The accepted prefix of point-mass drafts and the tokens that need no draw.

    Args:
      target_at_draft: f32[B, G], ``p_i(x_i)`` (:func:`summarise_rows`).
      argmax: i32[B, G], the argmax of each processed target row.
      draft_tokens: i32[B, G], ``x_i`` (any value past ``k_b``).
      draft_lengths: i32[B], ``k_b`` in [0, G].
      accept_uniforms: f32[B, G], ``u_i`` in [0, 1).
      greedy: bool[B], rows whose processed distributions are point masses.
      bonus_tokens: i32[B], emitted where all ``k_b`` tests pass.

    Returns:
      ``(tokens i32[B, G+1], num_accepted i32[B], needs_draw bool[B])``:
      ``tokens`` holds the accepted draft tokens, then the emitted token, then
      -1; where ``needs_draw`` (a sampled row that rejected ``x_n``) the
      emitted token is a placeholder for :func:`residual_draw`'s.
    """
    g = draft_tokens.shape[1]
    n = num_accepted_from_ratios(target_at_draft, jnp.ones_like(target_at_draft), accept_uniforms, draft_lengths)
    rejected = n < draft_lengths
    at_n = jnp.take_along_axis(argmax, jnp.minimum(n, max(g - 1, 0))[:, None], axis=1)[:, 0]
    emitted = jnp.where(rejected, at_n, bonus_tokens)
    return assemble_tokens(draft_tokens, n, emitted), n, rejected & ~greedy


def residual_draw(
    target_rows: jax.Array,
    temperature: jax.Array,
    rejected_tokens: jax.Array,
    sample_uniforms: jax.Array,
    impl: str = "xla",
) -> jax.Array:
    """i32[R]: a draw from each processed row ``p_n`` with the rejected token removed.

    Args:
      target_rows: f[R, V], the target's logits at each row's rejected position.
      temperature: f32[R] (0 gives the argmax, as for greedy rows).
      rejected_tokens: i32[R], ``x_n``.
      sample_uniforms: f32[R] in [0, 1).
      impl: static, ``"xla"`` or ``"cpu"`` (:func:`~specjax.kernels.frontend.row_stats`).
    """
    r = target_rows.shape[0]
    rows = target_rows[:, None, :]
    stats = row_stats(rows, temperature[:, None], impl=impl)
    t_sel = jax.tree.map(lambda f: f[:, 0], stats)
    zeros, ones = jnp.zeros((r,), jnp.int32), jnp.ones((r,), jnp.int32)
    y = _draw_from_logits(rows, None, t_sel, None, zeros, ones, sample_uniforms, rejected_tokens[:, None])
    return jnp.clip(y, 0, target_rows.shape[-1] - 1)
