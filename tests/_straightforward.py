"""The straightforward JAX acceptance kernel: a benchmark peer and a test reference, not part of specjax.

It builds the full (B, G, V) residual, as the obvious JAX code would, so the
benchmarks can measure what :func:`specjax.rejection_sample`'s gather-first
design buys (docs/benchmarks.md), and tests compare the kernel with it.
Benchmarks put tests/ on their ``sys.path`` to import it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels.core import assemble_tokens, num_accepted_from_ratios
from specjax.kernels.types import AcceptanceResult

__all__ = ["straightforward_cutoff", "straightforward_rejection_sample"]


def straightforward_rejection_sample(
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    target_probs: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
) -> AcceptanceResult:
    """The obvious JAX version, for benchmarks: builds the full (B, G, V) residual.

    Same contract as :func:`rejection_sample` (without the rounding fallbacks),
    kept to measure what the kernel's gather-first design buys.
    """
    return _straightforward_jit(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)


@jax.jit
def _straightforward_jit(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    g = draft_tokens.shape[1]
    p = target_probs.astype(jnp.float32)
    q = draft_probs.astype(jnp.float32)
    onehot = jax.nn.one_hot(draft_tokens, p.shape[-1], dtype=jnp.float32)
    p_x = jnp.sum(p[:, :g] * onehot, axis=-1)
    q_x = jnp.sum(q * onehot, axis=-1)
    n = num_accepted_from_ratios(p_x, q_x, accept_uniforms)
    residual = jnp.maximum(p[:, :g] - q, 0)  # (B, G, V)
    residual = residual / jnp.sum(residual, axis=-1, keepdims=True)
    dists = jnp.concatenate([residual, p[:, g:] / jnp.sum(p[:, g:], axis=-1, keepdims=True)], axis=1)
    cdf = jnp.cumsum(dists, axis=-1)  # (B, G+1, V)
    ys = jnp.sum(cdf <= sample_uniforms[:, None, None], axis=-1, dtype=jnp.int32)
    y = jnp.take_along_axis(ys, n[:, None], axis=1)[:, 0]
    return AcceptanceResult(n, assemble_tokens(draft_tokens, n, y, target_probs.shape[-1]))


@jax.jit
def straightforward_cutoff(scaled: jax.Array, top_k: jax.Array, one_minus_top_p: jax.Array) -> jax.Array:
    """The top-k then top-p cutoff by a full sort of every row, as transformers' warpers do it.

    f32[R, V] scaled logits, i32[R] top_k (0 keeps all), f32[R] ``1 - top_p``
    (0 keeps all) -> f32[R], the smallest kept value (-inf when nothing is
    dropped): the sort-based algorithm that :func:`specjax.kernels.core.cutoff`
    replaced, kept as its benchmark peer (benchmarks/bench_cutoff.py).
    """
    vocab = scaled.shape[-1]
    asc = jnp.sort(scaled, axis=-1)
    k = jnp.clip(top_k, 0, vocab)
    kth = jnp.take_along_axis(asc, (vocab - jnp.maximum(k, 1))[:, None], axis=-1)[:, 0]
    cut = jnp.where(k > 0, kth, -jnp.inf)
    masked = jnp.where(asc >= cut[:, None], asc, -jnp.inf)
    cum = jnp.cumsum(jax.nn.softmax(masked, axis=-1), axis=-1)
    dropped = jnp.sum(cum <= one_minus_top_p[:, None], axis=-1)
    cut_p = jnp.take_along_axis(asc, jnp.minimum(dropped, vocab - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(one_minus_top_p > 0, jnp.maximum(cut, cut_p), cut)


def tied_rows(vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows whose k-th largest value is tied far past the 256 candidates, with top-k and top-p.

    f32[6, V] relative scaled logits, i32[6] top_k, f32[6] ``1 - top_p``. Ten
    large values, then 2000 copies of 0 (the k-th for k = 50), then -5: the
    kept set of top-k 50 is all 2010 entries, and the copies hold more than
    ``1 - top_p`` of its mass although 246 of them would not. Also: every value
    equal; all ties at the top; top-k alone; and an untied control row.
    """
    rows = np.full((6, vocab), -5.0, np.float32)
    rows[:, :2000] = 0.0
    rows[:, 2000:2010] = np.log(600.0)
    rows[1] = 0.0  # every value equal
    rows[2, 2000:2010] = 0.0  # the ties are the top
    rows[5, :2000] = np.linspace(-1, 0, 2000, endpoint=False)  # no ties: the candidates decide
    rows -= rows.max(1, keepdims=True)
    top_k = np.array([50, 50, 50, 50, 3000, 50], np.int32)
    one_minus_top_p = np.array([0.1, 0.1, 0.1, 0.0, 0.1, 0.1], np.float32)
    return rows, top_k, one_minus_top_p
