"""Statistical tests of the logits front end (slow: 100k draws per check).

* ``sample_from_logits``: the histogram of the drawn tokens follows the returned
  (and the reference) processed distribution.
* ``verify_from_logits``: with draft tokens drawn by ``sample_from_logits`` from
  the draft logits with the same (temperature, top-k, top-p), the token emitted
  at position 0 follows the *processed target* distribution (Leviathan et al.
  2023, Chen et al. 2023), whatever the draft. The negative control samples the
  draft tokens at another temperature while verify assumes the same parameters
  (the bug class of transformers #32867 / #47932): the test must see the bias.

One batched call per check: B = 100k rows of the same small-vocabulary logits
(V = 64, so top-k = 20 and top-p = 0.9 both cut), one key per row from
``jax.random.split``. Tokens outside the processed support must never appear;
on the support, Pearson's chi-square (scipy.stats.chisquare) must give p > 0.001
(and p < 1e-6 for the negative control).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from scipy import stats

from specjax import sample_from_logits, verify_from_logits

pytestmark = pytest.mark.slow

N = 100_000
V = 64
T, K, P = 0.7, 20, 0.9


def ref_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Float64 temperature → top-k → top-p → softmax, transformers semantics (see test_frontend)."""
    s = (np.asarray(logits, np.float32) / np.float32(temperature)).astype(np.float64)
    keep = np.ones(s.shape[0], bool)
    if top_k > 0:
        keep &= s >= np.sort(s)[::-1][min(top_k, s.shape[0]) - 1]
    if top_p < 1:
        masked = np.where(keep, s, -np.inf)
        order = np.argsort(masked, kind="stable")
        e = np.exp(masked[order] - masked[order][-1])
        remove = np.cumsum(e / e.sum()) <= 1 - top_p
        remove[-1] = False
        keep[order[remove]] = False
    e = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return e / e.sum()


def chisquare_on_support(tokens: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of the histogram of ``tokens`` against ``expected_probs``; none may fall outside."""
    counts = np.bincount(tokens, minlength=expected_probs.shape[0])
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {np.flatnonzero(counts * ~support)}"
    expected = expected_probs[support] / expected_probs[support].sum() * tokens.shape[0]
    assert expected.min() >= 5, "merge bins: some expected counts are below 5"
    return float(stats.chisquare(counts[support], expected).pvalue)


def logits_rows(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target logits f32[2, V] (positions 0 and 1) and a draft that differs, f32[1, V]."""
    rng = np.random.default_rng(seed)
    target = (2.0 * rng.standard_normal((2, V))).astype(np.float32)
    draft = (target[:1] + 1.0 * rng.standard_normal((1, V))).astype(np.float32)
    return target, draft


SEEDS = [0, 14, 48]  # 14 and 48: the target / draft cutoff token lies where x/T != x*(1/T) in float32


def test_sample_from_logits_tokens_follow_probs():
    rng = np.random.default_rng(10)
    row = (2.0 * rng.standard_normal(V)).astype(np.float32)
    logits = np.broadcast_to(row, (N, V))
    half = N // 2
    # Two parameter sets in one call: (0.7, 20, 0.9) and (1.3, none, none).
    temperature = np.where(np.arange(N) < half, T, 1.3)
    top_k = np.where(np.arange(N) < half, K, 0)
    top_p = np.where(np.arange(N) < half, P, 1.0)
    tokens, probs = sample_from_logits(
        logits, key=jax.random.key(0), temperature=temperature, top_k=top_k, top_p=top_p, validate=False
    )
    tokens, probs = np.asarray(tokens), np.asarray(probs)
    first = ref_process(row, T, K, P)
    second = ref_process(row, 1.3, 0, 1.0)
    np.testing.assert_allclose(probs[0], first, atol=1e-6)
    np.testing.assert_allclose(probs[-1], second, atol=1e-6)
    assert chisquare_on_support(tokens[:half], first) > 1e-3
    assert chisquare_on_support(tokens[half:], second) > 1e-3
    # Negative control: the same draws do not fit a nearby distribution (T = 0.8).
    assert chisquare_on_support(tokens[:half], ref_process(row, 0.8, K, P)) < 1e-6


def _position0_tokens(seed: int, draft_temperature: float) -> tuple[np.ndarray, np.ndarray]:
    target, draft = logits_rows(seed)
    target_logits = np.broadcast_to(target, (N, 2, V))
    draft_logits = np.broadcast_to(draft, (N, 1, V))
    key_draft, key_verify = jax.random.split(jax.random.key(seed))
    x, _ = sample_from_logits(
        draft_logits[:, 0], key=key_draft, temperature=draft_temperature, top_k=K, top_p=P, validate=False
    )
    out = verify_from_logits(
        np.asarray(x)[:, None],
        draft_logits,
        target_logits,
        key=jax.random.split(key_verify, N),
        temperature=T,
        top_k=K,
        top_p=P,
        validate=False,
    )
    return np.asarray(out.tokens)[:, 0], ref_process(target[0], T, K, P)


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_emits_the_processed_target_distribution(seed):
    tokens, expected = _position0_tokens(seed, T)
    assert chisquare_on_support(tokens, expected) > 1e-3


def test_verify_detects_a_draft_sampled_differently():
    """Negative control: draft tokens drawn at T = 1.2 while verify assumes T = 0.7."""
    seed = SEEDS[0]
    tokens, expected = _position0_tokens(seed, 1.2)
    assert chisquare_on_support(tokens, expected) < 1e-6
