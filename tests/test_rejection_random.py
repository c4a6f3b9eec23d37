"""The acceptance kernel against the independent float64 reference (``tests/reference.py``).

Thousands of random cases, hypothesis property tests, and a chi-square test of
the output distribution with a negative control (issue #2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from reference import reference_rejection_sample
from rejection_helpers import (
    EDGE_B,
    EDGE_V,
    Comparison,
    compare_to_reference,
    random_batch,
    run,
)
from scipy import stats

from specjax.kernels.results import AcceptanceResult

# --------------------------------------------------------------------------- random cases vs reference

# (B, G, V, number of calls): every call is B rows, every row a case. Few shapes
# (compiling dominates), many calls.
RANDOM_GROUPS = [
    (64, 0, 3, 6),
    (64, 1, 2, 10),
    (64, 2, 129, 10),
    (64, 3, 16, 10),
    (64, 4, 5, 10),
    (64, 5, 1000, 4),
    (64, 6, 50, 10),
    (64, 7, 7, 10),
    (64, 8, 100, 8),
]
RANDOM_GROUPS_LARGE_V = [
    (64, 4, 4096, 4),
    (16, 8, 50000, 2),
]


def test_random_groups_cover_at_least_5000_cases() -> None:
    rows = sum(b * calls for b, _, _, calls in RANDOM_GROUPS + RANDOM_GROUPS_LARGE_V)
    assert rows >= 5000, rows
    vocabs = {v for _, _, v, _ in RANDOM_GROUPS + RANDOM_GROUPS_LARGE_V}
    drafts = {g for _, g, _, _ in RANDOM_GROUPS + RANDOM_GROUPS_LARGE_V}
    assert min(vocabs) == 2 and max(vocabs) == 50000
    assert drafts == set(range(9))


@functools.cache
def _random_group(batch: int, num_draft: int, vocab: int, calls: int) -> Comparison:
    """Run one group of random cases against the reference (each group once per session)."""
    rng = np.random.default_rng([batch, num_draft, vocab])
    total = Comparison()
    for _ in range(calls):
        args = random_batch(rng, batch, num_draft, vocab)
        out = run(*args, validate=False)
        ref = reference_rejection_sample(*args)
        c = compare_to_reference(args, out, ref)
        total.rows += c.rows
        total.n_near_ties += c.n_near_ties
        total.y_ties += c.y_ties
    return total


def _check_random_group(batch: int, num_draft: int, vocab: int, calls: int) -> None:
    total = _random_group(batch, num_draft, vocab, calls)
    # Per group only a loose bound (a group of 64 rows may hold one tie); the
    # aggregate bound is test_random_near_ties_are_rare.
    assert total.n_near_ties + total.y_ties <= max(2, 0.05 * total.rows), total


@pytest.mark.parametrize(
    "batch,num_draft,vocab,calls", RANDOM_GROUPS, ids=[f"B{b}-G{g}-V{v}" for b, g, v, _ in RANDOM_GROUPS]
)
def test_random_cases_match_reference(batch: int, num_draft: int, vocab: int, calls: int) -> None:
    _check_random_group(batch, num_draft, vocab, calls)


@pytest.mark.slow
@pytest.mark.parametrize(
    "batch,num_draft,vocab,calls",
    RANDOM_GROUPS_LARGE_V,
    ids=[f"B{b}-G{g}-V{v}" for b, g, v, _ in RANDOM_GROUPS_LARGE_V],
)
def test_random_cases_match_reference_large_vocab(batch: int, num_draft: int, vocab: int, calls: int) -> None:
    _check_random_group(batch, num_draft, vocab, calls)


@pytest.mark.slow
def test_random_near_ties_are_rare() -> None:
    """Over all random cases (>= 5000 rows), near ties are < 0.5% of cases, each kind.

    Ties come mostly from rows with s = the largest float32 below 1 over a long
    tail of tiny probabilities. Groups already run by the tests above are cached.
    """
    groups = [_random_group(*g) for g in RANDOM_GROUPS + RANDOM_GROUPS_LARGE_V]
    rows = sum(g.rows for g in groups)
    n_ties = sum(g.n_near_ties for g in groups)
    y_ties = sum(g.y_ties for g in groups)
    assert rows >= 5000
    assert n_ties < 0.005 * rows, (n_ties, rows)
    assert y_ties < 0.005 * rows, (y_ties, rows)
    print(f"random cases: {rows} rows, {n_ties} near ties in n, {y_ties} near ties in y")


def test_compare_to_reference_can_fail() -> None:
    """The comparison catches a wrong acceptance rule and a wrong correction distribution."""
    rng = np.random.default_rng(7)
    args = random_batch(rng, 64, 2, 5)
    ref = reference_rejection_sample(*args)
    tokens, q, p, u, s = args

    def as_out(r: Any) -> AcceptanceResult:
        return AcceptanceResult(r.num_accepted.astype(np.int32), r.tokens.astype(np.int32))

    assert compare_to_reference(args, as_out(ref), ref).rows == 64
    # Acceptance as if q(x) = 0 (every token with p(x) > 0 passes).
    with pytest.raises(AssertionError, match="not a near tie"):
        compare_to_reference(args, as_out(reference_rejection_sample(tokens, 0 * q, p, u, s)), ref)
    # Corrections from p_n instead of the residual: same n, different y.
    from_target = reference_rejection_sample(tokens, q, p, u, s)
    for b in range(64):
        n = from_target.num_accepted[b]
        if n < 2:
            cdf = np.cumsum(p[b, n].astype(np.float64)) / p[b, n].astype(np.float64).sum()
            from_target.tokens[b, n] = np.flatnonzero(cdf > s[b])[0]
    with pytest.raises(AssertionError, match="reference"):
        compare_to_reference(args, as_out(from_target), ref)


# --------------------------------------------------------------------------- hypothesis properties

# The edge-case shapes (B = 2, V = 8), so that hypothesis reuses compiled kernels.
PROPERTY_SHAPES = [(EDGE_B, g, EDGE_V) for g in (0, 1, 2, 3)]


@st.composite
def kernel_inputs(draw: Callable, *, equal: bool | None = None) -> tuple:
    """Small inputs built from integer weights 0..4: many exact zeros, ties and p == q rows."""
    batch, num_draft, vocab = draw(st.sampled_from(PROPERTY_SHAPES))
    wp = draw(hnp.arrays(np.int64, (batch, num_draft + 1, vocab), elements=st.integers(0, 4)))
    wp[..., 0] += wp.sum(-1) == 0  # every target row needs a positive sum
    p = (wp / wp.sum(-1, keepdims=True)).astype(np.float32)
    if equal is None:
        equal = draw(st.booleans())
    if equal:
        q = p[:, :num_draft].copy()
    else:
        wq = draw(hnp.arrays(np.int64, (batch, num_draft, vocab), elements=st.integers(0, 4)))
        sums = wq.sum(-1, keepdims=True)
        q = np.where(sums > 0, wq / np.maximum(sums, 1), 0).astype(np.float32)  # zero rows allowed
    if equal:
        # Draft tokens from the draft's support, as a real draft model samples them.
        choice = draw(hnp.arrays(np.int64, (batch, num_draft), elements=st.integers(0, vocab - 1)))
        support = [[np.flatnonzero(q[b, i]) for i in range(num_draft)] for b in range(batch)]
        tokens = np.array(
            [[support[b][i][choice[b, i] % len(support[b][i])] for i in range(num_draft)] for b in range(batch)],
            np.int32,
        )
        tokens = tokens.reshape(batch, num_draft)
    else:
        tokens = draw(hnp.arrays(np.int32, (batch, num_draft), elements=st.integers(0, vocab - 1)))
    unit = st.floats(0, 1, exclude_max=True, width=32)
    u = draw(hnp.arrays(np.float32, (batch, num_draft), elements=unit))
    s = draw(hnp.arrays(np.float32, (batch,), elements=unit))
    return tokens, q, p, u, s


PROPERTY_SETTINGS = settings(deadline=None, max_examples=100, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(kernel_inputs())
def test_property_output_invariants(args: tuple) -> None:
    tokens, _, p, _, _ = args
    out = run(*args)
    n, t = out.num_accepted, out.tokens
    batch, num_draft = tokens.shape
    ref = reference_rejection_sample(*args)
    for b in range(batch):
        assert 0 <= n[b] <= num_draft
        assert t[b, : n[b]].tolist() == tokens[b, : n[b]].tolist()
        y = t[b, n[b]]
        assert 0 <= y < p.shape[2]
        if n[b] == ref.num_accepted[b]:
            assert ref.weights[b][y] > 0, "y has zero probability under r"
        assert np.all(t[b, n[b] + 1 :] == -1)


@PROPERTY_SETTINGS
@given(kernel_inputs())
def test_property_agrees_with_reference(args: tuple) -> None:
    out = run(*args)
    compare_to_reference(args, out, reference_rejection_sample(*args))


@settings(deadline=None, max_examples=40)
@given(kernel_inputs(equal=True))
def test_property_p_equals_q_accepts_everything(args: tuple) -> None:
    """With p_i == q_i and x_i in the draft's support, every test passes (u < 1 = ratio)."""
    tokens, _, p, _, _ = args
    out = run(*args)
    num_draft = tokens.shape[1]
    assert np.all(out.num_accepted == num_draft)
    assert np.array_equal(out.tokens[:, :num_draft], tokens)
    y = out.tokens[:, num_draft]
    assert np.all(p[np.arange(len(y)), num_draft, y] > 0)  # the bonus token is in p_G's support


# --------------------------------------------------------------------------- statistics


def _inverse_cdf_rows(weights: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Smallest v with cumsum(weights)[v] / total > s, row by row (vectorised, float64)."""
    cdf = np.cumsum(weights, axis=-1) / weights.sum(-1, keepdims=True)
    return np.minimum((cdf <= s[:, None]).sum(-1), weights.shape[-1] - 1)


@pytest.fixture(scope="module")
def chi_square_run() -> dict[str, Any]:
    """One batched call with 100k rows, V = 6, G = 2, fixed random p and q."""
    rng = np.random.default_rng(20240611)
    n_rows, num_draft, vocab = 100_000, 2, 6
    p = rng.dirichlet(np.ones(vocab), size=num_draft + 1).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab), size=num_draft).astype(np.float32)
    cq = np.cumsum(q.astype(np.float64), axis=-1)
    r = rng.random((n_rows, num_draft, 1))
    tokens = np.minimum((cq[None] / cq[None, :, -1:] <= r).sum(-1), vocab - 1).astype(np.int32)
    u = rng.random((n_rows, num_draft), dtype=np.float32)
    s = rng.random(n_rows, dtype=np.float32)
    args = (
        tokens,
        np.broadcast_to(q, (n_rows, num_draft, vocab)).copy(),
        np.broadcast_to(p, (n_rows, num_draft + 1, vocab)).copy(),
        u,
        s,
    )
    out = run(*args)
    return {
        "p": p.astype(np.float64),
        "q": q.astype(np.float64),
        "tokens": tokens,
        "u": u,
        "s": s,
        "out": out,
        "n_rows": n_rows,
    }


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs / probs.sum() * len(samples)
    return float(stats.chisquare(counts, expected).pvalue)


@pytest.mark.slow
def test_first_emitted_token_follows_target(chi_square_run: dict[str, Any]) -> None:
    """Position 0 of the output is distributed as p_0 (the point of speculative sampling)."""
    r = chi_square_run
    first = r["out"].tokens[:, 0]
    assert np.all(first >= 0)
    assert _chi2_pvalue(first, r["p"][0]) > 1e-3


@pytest.mark.slow
def test_later_tokens_follow_target(chi_square_run: dict[str, Any]) -> None:
    """Given n >= 1, position 1 follows p_1; given n = G, the bonus token follows p_G."""
    r = chi_square_run
    n, t = r["out"].num_accepted, r["out"].tokens
    assert _chi2_pvalue(t[n >= 1, 1], r["p"][1]) > 1e-3
    assert _chi2_pvalue(t[n == 2, 2], r["p"][2]) > 1e-3
    # The acceptance rate matches the theory: P(accept x_0) = Σ_v min(p_0(v), q_0(v)).
    accept0 = np.mean(n >= 1)
    expected = np.minimum(r["p"][0], r["q"][0]).sum()
    assert abs(accept0 - expected) < 5 * np.sqrt(expected * (1 - expected) / r["n_rows"])


@pytest.mark.slow
@pytest.mark.parametrize("wrong", ["correction_from_target", "correction_from_draft"])
def test_chi_square_catches_wrong_residual(chi_square_run: dict[str, Any], wrong: str) -> None:
    """Negative control: the same draws with a wrong correction distribution fail the test."""
    r = chi_square_run
    p0, q0 = r["p"][0], r["q"][0]
    x0, u0, s = r["tokens"][:, 0], r["u"][:, 0].astype(np.float64), r["s"].astype(np.float64)
    accepted = u0 < p0[x0] / q0[x0]
    source = p0 if wrong == "correction_from_target" else q0
    wrong_y = _inverse_cdf_rows(np.broadcast_to(source, (len(s), len(p0))), s)
    emitted = np.where(accepted, x0, wrong_y)
    assert _chi2_pvalue(emitted, p0) < 1e-6
    # ... while the right residual passes with the same draws.
    right_y = _inverse_cdf_rows(np.broadcast_to(np.maximum(p0 - q0, 0), (len(s), len(p0))), s)
    assert _chi2_pvalue(np.where(accepted, x0, right_y), p0) > 1e-3
