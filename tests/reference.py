"""An independent float64 NumPy reference of the acceptance-kernel contract (issue #2).

Written from the contract's text, not from the kernel: plain loops over rows and
over draft positions, float64 arithmetic. Inputs are first rounded to the dtype
the kernel computes in (float32; float16/bfloat16 inputs are exact in float32,
float64 inputs are narrowed to float32 as JAX does without ``jax_enable_x64``),
then every comparison, difference, sum and division is done in float64.

The contract, per row b (x_i = draft_tokens[b, i], q_i = draft_probs[b, i],
p_i = target_probs[b, i], u_i = accept_uniforms[b, i], s = sample_uniforms[b]):

* draft token i passes iff u_i < p_i(x_i) / q_i(x_i); q_i(x_i) = 0 passes iff
  p_i(x_i) > 0. Tests run in order; n is the number passed before the first
  failure, or G.
* r(v) = max(p_n(v) - q_n(v), 0) / Σ_w max(p_n(w) - q_n(w), 0) if n < G,
  r(v) = p_G(v) / Σ_w p_G(w) if n = G; a residual summing to zero is replaced
  by p_n.
* y is the smallest v with r(0) + … + r(v) > s; if there is none (rounding), the
  largest v with r(v) > 0.
* tokens[b] = x_0 … x_{n-1}, y, then -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Reference:
    """What the contract says, row by row.

    Attributes:
      num_accepted: i64[B], ``n``.
      tokens: i64[B, G+1], ``n`` accepted draft tokens, ``y``, then -1.
      emitted: i64[B], ``y``.
      weights: list of B float64 arrays of shape (V,): the unnormalised weights
        ``y`` was drawn from (residual, ``p_G``, or ``p_n`` for an empty residual).
      cdf: list of B float64 arrays of shape (V,): ``r(0) + … + r(v)``, the
        normalised cumulative distribution of the draw.
      ratio_margin: f64[B, G]: ``|u_i − p_i(x_i)/q_i(x_i)|`` for every test,
        ``inf`` where ``q_i(x_i) = 0`` (no near tie possible there).
      residual_was_empty: bool[B]: the residual summed to zero and ``p_n`` was used.
    """

    num_accepted: np.ndarray
    tokens: np.ndarray
    emitted: np.ndarray
    weights: list[np.ndarray]
    cdf: list[np.ndarray]
    ratio_margin: np.ndarray
    residual_was_empty: np.ndarray


def as_kernel_float(x: Any) -> np.ndarray:
    """Round to the dtype the kernel computes in (float32), then widen to float64.

    Accepts lists, NumPy arrays (including ml_dtypes bfloat16), JAX arrays and
    torch tensors.
    """
    if type(x).__module__.split(".")[0] == "torch":
        x = x.float().numpy()
    arr = np.asarray(x)
    return arr.astype(np.float32).astype(np.float64)


def reference_rejection_sample(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
) -> Reference:
    """The contract in float64 (see the module docstring)."""
    if type(draft_tokens).__module__.split(".")[0] == "torch":
        draft_tokens = draft_tokens.numpy()
    x = np.asarray(draft_tokens).astype(np.int64)
    q = as_kernel_float(draft_probs)
    p = as_kernel_float(target_probs)
    u = as_kernel_float(accept_uniforms)
    s = as_kernel_float(sample_uniforms)
    batch, num_draft = x.shape
    vocab = p.shape[2]
    assert q.shape == (batch, num_draft, vocab), q.shape
    assert p.shape == (batch, num_draft + 1, vocab), p.shape
    assert u.shape == (batch, num_draft) and s.shape == (batch,)

    num_accepted = np.zeros(batch, np.int64)
    emitted = np.zeros(batch, np.int64)
    tokens = np.full((batch, num_draft + 1), -1, np.int64)
    margins = np.full((batch, num_draft), np.inf)
    empty = np.zeros(batch, bool)
    weights_out: list[np.ndarray] = []
    cdf_out: list[np.ndarray] = []

    for b in range(batch):
        n = 0
        for i in range(num_draft):
            tok = x[b, i]
            p_x, q_x = p[b, i, tok], q[b, i, tok]
            passed = (u[b, i] < p_x / q_x) if q_x > 0 else (p_x > 0)
            if not passed:
                break
            n += 1
        for i in range(num_draft):
            tok = x[b, i]
            if q[b, i, tok] > 0:
                margins[b, i] = abs(u[b, i] - p[b, i, tok] / q[b, i, tok])

        if n < num_draft:
            w = np.maximum(p[b, n] - q[b, n], 0.0)
        else:
            w = p[b, num_draft].copy()
        if w.sum() <= 0:
            w = p[b, n].copy()
            empty[b] = True
        total = w.sum()
        assert total > 0, "the target row sums to zero (invalid input)"
        cdf = np.cumsum(w) / total
        above = np.flatnonzero(cdf > s[b])
        y = int(above[0]) if above.size else int(np.flatnonzero(w > 0)[-1])

        num_accepted[b] = n
        emitted[b] = y
        tokens[b, :n] = x[b, :n]
        tokens[b, n] = y
        weights_out.append(w)
        cdf_out.append(cdf)

    return Reference(num_accepted, tokens, emitted, weights_out, cdf_out, margins, empty)


def is_tie(ref: Reference, row: int, y_other: int, s: float, *, tol: float = 1e-5) -> bool:
    """Whether ``y_other`` differs from the reference draw only by rounding of the CDF.

    True when ``y_other`` has positive weight and every CDF boundary between the
    two draws lies within ``tol`` (absolute, in units of the normalised CDF,
    i.e. relative to the row's total weight) of ``s``.
    """
    y_ref = int(ref.emitted[row])
    w, cdf = ref.weights[row], ref.cdf[row]
    if not (0 <= y_other < w.shape[0]) or w[y_other] <= 0:
        return False
    lo, hi = min(y_ref, y_other), max(y_ref, y_other)
    # Boundaries crossed going from one draw to the other: cdf[lo], …, cdf[hi - 1].
    crossed = cdf[lo:hi]
    return bool(np.all(np.abs(crossed - s) <= tol))
