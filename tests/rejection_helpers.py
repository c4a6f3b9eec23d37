"""Helpers shared by the acceptance kernel's tests (tests/test_rejection*.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from reference import Reference, as_kernel_float, is_tie

from specjax import rejection_sample
from specjax.kernels.results import AcceptanceResult

F32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))  # 1 - 2**-24
F32_TINY = np.finfo(np.float32).tiny  # smallest normal float32
EDGE_B, EDGE_V = 2, 8  # the shape family shared by edge cases, properties and validation

# --------------------------------------------------------------------------- helpers


def run(*args: Any, validate: bool = True) -> AcceptanceResult:
    """Call the public kernel and check the result's structure; return host copies."""
    out = rejection_sample(*args, validate=validate)
    assert isinstance(out, AcceptanceResult) and set(vars(out)) == {"num_accepted", "tokens"}
    for key in ("num_accepted", "tokens"):
        assert isinstance(getattr(out, key), jax.Array), (key, type(getattr(out, key)))
        assert getattr(out, key).dtype == jnp.int32, (key, getattr(out, key).dtype)
    return jax.tree.map(np.asarray, out)


def f32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def i32(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def random_batch(rng: np.random.Generator, batch: int, num_draft: int, vocab: int) -> tuple:
    """B random rows of mixed kinds, as float32 NumPy arrays.

    Row kinds: ``flat`` (softmax at temperature 1), ``sharp`` (low-temperature
    softmax: a few tokens carry the mass, many are exactly 0), ``sparse`` (most
    entries zeroed), ``near`` (q a perturbation of p), ``equal`` (q == p exactly).
    80% of rows draw x_i from q_i, the others pick x_i uniformly (so q(x) = 0 and
    p(x) = 0 occur in sparse rows). 5% of the uniforms are exactly 0; 2% of the s
    are the largest float32 below 1.

    Subnormal float32 probabilities are flushed to 0: XLA on CPU treats them as 0
    (see test_subnormal_probabilities_are_positive).
    """
    kinds = rng.choice(np.array(["flat", "sharp", "sparse", "near", "equal"]), size=batch)
    temp = np.where(kinds == "sharp", rng.choice([0.1, 0.03, 0.01], size=batch), 1.0)[:, None, None]
    temp = temp.astype(np.float32)
    logits_p = rng.standard_normal((batch, num_draft + 1, vocab), dtype=np.float32)
    logits_q = rng.standard_normal((batch, num_draft, vocab), dtype=np.float32)
    near = (kinds == "near")[:, None, None]
    logits_q = np.where(near, logits_p[:, :num_draft] + 0.5 * logits_q, logits_q)
    p = _softmax(logits_p / temp)
    q = _softmax(logits_q / temp)

    sparse = (kinds == "sparse")[:, None, None]
    if sparse.any():
        keep_frac = rng.choice([0.5, 0.1, 0.01], size=batch)[:, None, None]
        keep_p = rng.random(p.shape, dtype=np.float32) < keep_frac
        keep_q = rng.random(q.shape, dtype=np.float32) < keep_frac
        np.put_along_axis(keep_p, logits_p.argmax(-1)[..., None], True, axis=-1)
        np.put_along_axis(keep_q, logits_q.argmax(-1)[..., None], True, axis=-1)
        p = np.where(sparse & ~keep_p, 0, p)
        q = np.where(sparse & ~keep_q, 0, q)
        p = p / p.sum(-1, keepdims=True)
        q = q / q.sum(-1, keepdims=True)
    p = p.astype(np.float32)
    q = q.astype(np.float32)
    equal = (kinds == "equal")[:, None, None]
    q = np.where(equal, p[:, :num_draft], q)
    p[p < F32_TINY] = 0
    q[q < F32_TINY] = 0

    # Draft tokens: inverse CDF of q_i for most rows, uniform for the others.
    cq = np.cumsum(q, axis=-1, dtype=np.float64)
    r = rng.random((batch, num_draft, 1)) * cq[..., -1:]
    from_q = np.minimum((cq <= r).sum(-1), vocab - 1)
    uniform_tok = rng.integers(0, vocab, size=(batch, num_draft))
    use_q = rng.random((batch, 1)) < 0.8
    tokens = np.where(use_q, from_q, uniform_tok).astype(np.int32)

    u = rng.random((batch, num_draft), dtype=np.float32)
    u[rng.random(u.shape) < 0.05] = 0
    s = rng.random(batch, dtype=np.float32)
    s[rng.random(batch) < 0.05] = 0
    s[rng.random(batch) < 0.02] = F32_BELOW_ONE
    return tokens, q, p, u, s


@dataclass
class Comparison:
    rows: int = 0
    n_near_ties: int = 0
    y_ties: int = 0


def compare_to_reference(
    args: tuple, out: AcceptanceResult, ref: Reference, *, ratio_tol: float = 1e-6, cdf_tol: float = 1e-5
) -> Comparison:
    """Assert the kernel's output matches the reference up to float32 near ties; count the ties."""
    tokens_in = np.asarray(args[0])
    s = as_kernel_float(args[4])
    n_k, t_k = out.num_accepted, out.tokens
    batch, g1 = t_k.shape
    stats_ = Comparison(rows=batch)
    # Output invariants for every row.
    assert np.all((n_k >= 0) & (n_k <= g1 - 1))
    pos = np.arange(g1)[None, :]
    n_col = n_k[:, None]
    padded = np.concatenate([tokens_in, np.full((batch, 1), -1)], axis=1)
    assert np.array_equal(np.where(pos < n_col, t_k, 0), np.where(pos < n_col, padded, 0))
    assert np.all(np.where(pos > n_col, t_k, -1) == -1)
    y_k = t_k[np.arange(batch), n_k]
    assert np.all((y_k >= 0) & (y_k < ref.weights[0].shape[0]))

    for b in np.flatnonzero((n_k != ref.num_accepted) | (y_k != ref.emitted)):
        if n_k[b] != ref.num_accepted[b]:
            i = min(n_k[b], ref.num_accepted[b])
            margin = ref.ratio_margin[b, i]
            assert margin <= ratio_tol, (
                f"row {b}: n = {n_k[b]}, reference {ref.num_accepted[b]}; test {i} is not a near tie "
                f"(|u - p/q| = {margin:.3g})"
            )
            stats_.n_near_ties += 1
            continue
        assert is_tie(ref, b, int(y_k[b]), s[b], tol=cdf_tol), (
            f"row {b}: y = {y_k[b]}, reference {ref.emitted[b]}, s = {s[b]!r}, "
            f"weight(y) = {ref.weights[b][y_k[b]]!r}, "
            f"cdf around = {ref.cdf[b][max(0, min(y_k[b], ref.emitted[b]) - 1) : max(y_k[b], ref.emitted[b]) + 1]}"
        )
        stats_.y_ties += 1
    return stats_


def valid_inputs(batch: int = EDGE_B, num_draft: int = 3, vocab: int = EDGE_V) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(vocab), size=(batch, num_draft + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), size=(batch, num_draft)).astype(np.float32)
    return {
        "draft_tokens": rng.integers(0, vocab, (batch, num_draft)).astype(np.int32),
        "draft_probs": q,
        "target_probs": p,
        "accept_uniforms": rng.random((batch, num_draft), dtype=np.float32),
        "sample_uniforms": rng.random(batch, dtype=np.float32),
    }
