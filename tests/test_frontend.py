"""Tests of the logits front end: ``sample_from_logits`` and ``verify_from_logits``.

Every check compares against something independent of ``specjax.kernels.frontend``:

* the probabilities against transformers' own warpers (``TemperatureLogitsWarper``,
  ``TopKLogitsWarper``, ``TopPLogitsWarper``, then softmax, in torch float32);
* the whole verify step against a float64 NumPy reference written here
  (:func:`ref_process`, :func:`ref_verify_row`) that reproduces the contract of
  :func:`specjax.rejection_sample` from the processed distributions;
* greedy rows against ``np.argmax`` / ``torch.argmax``.

Floating-point boundaries (a top-p cumulative sum, an acceptance ratio or a
cumulative residual within ~1e-5 of its threshold) can legitimately go either
way between float32 and float64; such rows are counted and skipped, and the
count is bounded. The statistical tests live in ``test_frontend_stats.py``.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specjax import rejection_sample, sample_from_logits, verify_from_logits
from specjax.kernels import frontend

# Distance to a threshold below which float32 and float64 may disagree.
BOUNDARY_TOL = 1e-5

# --------------------------------------------------------------------------- #
# Independent float64 reference
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Processed:
    probs: np.ndarray  # f64[V]
    margin: float  # distance of the top-p cumulative sums to 1 - top_p (inf: no top-p)


def ref_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> Processed:
    """Temperature, top-k, top-p (transformers semantics, min_tokens_to_keep=1), softmax.

    ``logits``: one row f[V]; ``top_k = 0`` and ``top_p = 1`` switch the step off;
    ``temperature = 0`` is greedy (one-hot at the first maximum).
    """
    x = np.asarray(logits, np.float64)
    vocab = x.shape[0]
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return Processed(out, np.inf)
    # The implementation divides in float32; so does the reference, then widens.
    s = (x.astype(np.float32) / np.float32(temperature)).astype(np.float64)
    keep = np.ones(vocab, bool)
    if top_k > 0:
        kth = np.sort(s)[::-1][min(top_k, vocab) - 1]
        keep &= s >= kth
    margin = np.inf
    if top_p < 1:
        masked = np.where(keep, s, -np.inf)
        order = np.argsort(masked, kind="stable")  # ascending
        srt = masked[order]
        e = np.exp(srt - srt[-1])
        cum = np.cumsum(e / e.sum())
        threshold = 1.0 - top_p
        remove = cum <= threshold
        remove[-1] = False
        keep[order[remove]] = False
        finite = np.isfinite(srt)
        if finite.any():
            margin = float(np.min(np.abs(cum[finite] - threshold)))
    e = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return Processed(e / e.sum(), margin)


@dataclasses.dataclass
class RefResult:
    num_accepted: int
    tokens: np.ndarray  # i64[G+1]
    near_boundary: bool


def ref_verify_row(x, draft_logits, target_logits, u, s, temperature, top_k, top_p, k_b) -> RefResult:
    """The whole verify step for one row, in float64 (the contract of rejection_sample).

    ``x``: i[G]; ``draft_logits``: f[G, V]; ``target_logits``: f[G+1, V];
    ``u``: f[G]; ``s``: float; ``k_b``: the number of draft tokens to test.
    """
    g = len(x)
    P = [ref_process(target_logits[i], temperature, top_k, top_p) for i in range(g + 1)]
    Q = [ref_process(draft_logits[i], temperature, top_k, top_p) for i in range(g)]
    near = any(d.margin < BOUNDARY_TOL for d in P + Q)
    n = 0
    while n < k_b:
        pv, qv = P[n].probs[x[n]], Q[n].probs[x[n]]
        if qv > 0:
            ratio = pv / qv
            near |= abs(u[n] - ratio) < BOUNDARY_TOL * max(1.0, ratio)
            passed = u[n] < ratio
        else:
            passed = pv > 0
        if not passed:
            break
        n += 1
    r = np.maximum(P[n].probs - Q[n].probs, 0) if n < k_b else P[n].probs.copy()
    near |= 0 < r.sum() < BOUNDARY_TOL
    if r.sum() <= 0:
        r = P[n].probs.copy()
    cdf = np.cumsum(r) / r.sum()
    near |= bool(np.any(np.abs(cdf[r > 0] - s) < BOUNDARY_TOL))
    above = np.nonzero(cdf > s)[0]
    y = int(above[0]) if above.size else int(np.nonzero(r > 0)[0][-1])
    tokens = np.full(g + 1, -1, np.int64)
    tokens[:n] = x[:n]
    tokens[n] = y
    return RefResult(n, tokens, near)


def kernel_uniforms(key: jax.Array, batch: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The draws verify_from_logits is documented to make: u = [:, :G], s = [:, G]."""
    if key.ndim == 0:
        draws = jax.random.uniform(key, (batch, g + 1), jnp.float32)
    else:
        draws = jax.vmap(lambda k: jax.random.uniform(k, (g + 1,)))(key)
    draws = np.asarray(draws, np.float64)
    return draws[:, :g], draws[:, g]


def hf_process(logits_f32: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """transformers' warpers in torch float32, then softmax (one row f32[V] -> f32[V])."""
    scores = torch.from_numpy(np.array(logits_f32, np.float32))[None, :]
    if temperature == 0:
        out = np.zeros(scores.shape[1], np.float32)
        out[int(torch.argmax(scores[0]))] = 1.0
        return out
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(float(top_p))(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


def hf_top_p_margin(logits_f32: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How close transformers' own top-p cumulative sums come to 1 - top_p (inf: no top-p)."""
    if temperature == 0 or top_p >= 1:
        return np.inf
    scores = torch.from_numpy(np.array(logits_f32, np.float32))[None, :]
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    srt, _ = torch.sort(scores, descending=False)
    cum = srt.softmax(dim=-1).cumsum(dim=-1)[0].double().numpy()
    finite = np.isfinite(srt[0].numpy())
    return float(np.min(np.abs(cum[finite] - (1 - top_p))))


def per_row(value, batch: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value), (batch,))


# Shapes shared by the tests: every new shape, dtype or static variant (key kind,
# top_k / top_p None or given) is one more XLA compilation (seconds on a busy
# 2-core machine), so the tests reuse a few.
SB, SV = 6, 64  # sample_from_logits
MB, MG, MV = 48, 4, 40  # verify_from_logits


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #


def make_case(rng: np.random.Generator, batch: int, g: int, vocab: int, *, scale: float = 2.0,
              noise: float = 0.7):
    """Target logits f32[B, G+1, V] and draft logits close to them, f32[B, G, V]."""
    target = (scale * rng.standard_normal((batch, g + 1, vocab))).astype(np.float32)
    draft = (target[:, :g] + noise * rng.standard_normal((batch, g, vocab))).astype(np.float32)
    return draft, target


def sample_draft_tokens(rng, draft_logits, temperature, top_k, top_p) -> np.ndarray:
    """x_i ~ q_i with the reference processing (so tests pass often); i64[B, G]."""
    b, g, vocab = draft_logits.shape
    x = np.zeros((b, g), np.int64)
    for i in range(b):
        for j in range(g):
            q = ref_process(draft_logits[i, j], temperature[i], top_k[i], top_p[i]).probs
            x[i, j] = rng.choice(vocab, p=q)
    return x


# --------------------------------------------------------------------------- #
# Probabilities: transformers' warpers
# --------------------------------------------------------------------------- #

PARAM_CASES = [
    # (temperature, top_k, top_p): scalars or per-row lists (B = 6)
    (1.0, None, None),
    (0.7, None, None),
    (1.3, 5, None),
    (0.7, 20, 0.9),
    (1.0, None, 0.5),
    (0.5, 1, None),
    (2.0, 200, 0.95),  # top_k > V keeps all
    ([0.7, 1.0, 0.0, 1.5, 0.3, 1.0], [20, 0, 3, 10, 0, 64], [0.9, 1.0, 0.5, 1.0, 0.8, 0.3]),
    ([0.0, 0.0, 0.9, 0.9, 1.1, 1.1], 7, [1.0, 0.2, 0.99, 0.6, 0.9, 1.0]),
]


def _param_id(case):
    return "T={}-k={}-p={}".format(*case)


def _expand(case, batch):
    t, k, p = case
    return (
        per_row(t, batch).astype(np.float64),
        per_row(0 if k is None else k, batch).astype(np.int64),
        per_row(1.0 if p is None else p, batch).astype(np.float64),
    )


def _compare_to_hf(probs: np.ndarray, logits_f32: np.ndarray, ts, ks, ps) -> int:
    """Assert rows equal transformers' warpers (atol 1e-6); returns the boundary rows skipped."""
    skipped = 0
    for i in range(logits_f32.shape[0]):
        expected = hf_process(logits_f32[i], ts[i], ks[i], ps[i])
        if hf_top_p_margin(logits_f32[i], ts[i], ks[i], ps[i]) < 1e-6:
            skipped += 1
            continue
        np.testing.assert_allclose(probs[i], expected, atol=1e-6, rtol=0, err_msg=f"row {i}")
        # The support is exactly transformers' support.
        np.testing.assert_array_equal(probs[i] > 0, expected > 0, err_msg=f"row {i}")
    return skipped


@pytest.mark.parametrize("case", PARAM_CASES, ids=_param_id)
def test_sample_probs_equal_transformers_warpers(case):
    batch, vocab = SB, SV
    rng = np.random.default_rng(1)
    logits = (2.0 * rng.standard_normal((batch, vocab))).astype(np.float32)
    t, k, p = case
    _, probs = sample_from_logits(logits, key=jax.random.key(0), temperature=t, top_k=k, top_p=p)
    ts, ks, ps = _expand(case, batch)
    skipped = _compare_to_hf(np.asarray(probs), logits, ts, ks, ps)
    assert skipped == 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", [PARAM_CASES[3], PARAM_CASES[7]], ids=_param_id)
def test_low_precision_logits_processed_in_float32(dtype, case):
    batch, vocab = SB, SV
    rng = np.random.default_rng(2)
    logits = jnp.asarray(2.0 * rng.standard_normal((batch, vocab)), dtype)
    upcast = np.asarray(logits.astype(jnp.float32))
    t, k, p = case
    _, probs = sample_from_logits(logits, key=jax.random.key(0), temperature=t, top_k=k, top_p=p)
    assert probs.dtype == jnp.float32
    ts, ks, ps = _expand(case, batch)
    assert _compare_to_hf(np.asarray(probs), upcast, ts, ks, ps) == 0


def test_many_random_rows_equal_transformers_and_boundaries_are_rare():
    """200 rows with random per-row (T, k, p), V = 256; count rows at a top-p boundary."""
    batch, vocab = 200, 256
    rng = np.random.default_rng(3)
    logits = (3.0 * rng.standard_normal((batch, vocab))).astype(np.float32)
    ts = rng.choice([0.0, 0.3, 0.7, 1.0, 1.7], batch)
    ks = rng.choice([0, 1, 5, 40, 300], batch)
    ps = rng.choice([1.0, 0.95, 0.9, 0.5, 0.1], batch)
    _, probs = sample_from_logits(logits, key=jax.random.key(0), temperature=ts, top_k=ks, top_p=ps)
    skipped = _compare_to_hf(np.asarray(probs), logits, ts, ks, ps)
    assert skipped <= 2, f"{skipped} of {batch} rows sit on a top-p float boundary"


def test_row_stats_on_verify_shapes_equal_transformers():
    """The (B, G+1, V) path verify uses (row_stats + probs_from_stats) equals the warpers."""
    batch, g, vocab = 4, 3, 64
    rng = np.random.default_rng(4)
    _, target = make_case(rng, batch, g, vocab)
    ts = np.array([0.7, 0.0, 1.2, 1.0])
    ks = np.array([20, 5, 0, 3])
    ps = np.array([0.9, 0.8, 0.6, 1.0])

    @jax.jit
    def probs_of(logits, t, k, one_minus_p):
        col = (slice(None), None)
        stats = frontend.row_stats(logits, t[col], k[col], one_minus_p[col])
        return frontend.probs_from_stats(stats, logits, jnp.arange(vocab, dtype=jnp.int32))

    probs = np.asarray(probs_of(jnp.asarray(target), jnp.asarray(ts, jnp.float32),
                                jnp.asarray(ks, jnp.int32), jnp.asarray(1.0 - ps, jnp.float32)))
    for i in range(batch):
        for j in range(g + 1):
            np.testing.assert_allclose(
                probs[i, j], hf_process(target[i, j], ts[i], ks[i], ps[i]), atol=1e-6, rtol=0
            )


@pytest.mark.parametrize("greedy_rows", [0, 2, 4])
def test_row_stats_of_a_reader_equal_row_stats_of_the_array(greedy_rows):
    """row_stats(lambda: x[:, i]) (the lazy path's form) gives the stats of the slice itself."""
    batch, g, vocab = 4, 3, 300
    rng = np.random.default_rng(5)
    _, target = make_case(rng, batch, g, vocab)
    temps = jnp.asarray(np.where(np.arange(batch) < greedy_rows, 0.0, 0.8), jnp.float32)
    logits = jnp.asarray(target)

    @jax.jit
    def both(logits, i):
        row = jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)
        lazy = frontend.row_stats(lambda: jax.lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False), temps)
        return lazy, frontend.row_stats(row, temps)

    for i in range(g + 1):
        lazy, eager = both(logits, i)
        for name, a, b in zip(frontend.RowStats._fields, lazy, eager, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} at position {i}")
        assert not np.array_equal(np.asarray(lazy.max), np.asarray(both(logits, (i + 1) % (g + 1))[0].max))


def test_reference_processing_agrees_with_transformers():
    """The float64 reference used below is itself checked against the warpers."""
    rng = np.random.default_rng(5)
    for _ in range(30):
        row = (2.0 * rng.standard_normal(40)).astype(np.float32)
        t, k, p = rng.choice([0.0, 0.6, 1.0, 1.4]), rng.choice([0, 2, 10, 50]), rng.choice([1.0, 0.9, 0.4])
        if hf_top_p_margin(row, t, k, p) < 1e-6:
            continue
        np.testing.assert_allclose(ref_process(row, t, k, p).probs, hf_process(row, t, k, p), atol=1e-6)


# --------------------------------------------------------------------------- #
# Greedy
# --------------------------------------------------------------------------- #


def test_greedy_sample_is_first_argmax_and_one_hot():
    rng = np.random.default_rng(6)
    logits = rng.integers(0, 3, (SB, SV)).astype(np.float32)  # many ties for the maximum
    tokens, probs = sample_from_logits(logits, key=jax.random.key(0), temperature=0.0, top_k=3, top_p=0.5)
    expected = np.argmax(logits, axis=1)
    np.testing.assert_array_equal(expected, torch.argmax(torch.from_numpy(logits), dim=1).numpy())
    np.testing.assert_array_equal(np.asarray(tokens), expected)
    np.testing.assert_array_equal(np.asarray(probs), np.eye(SV, dtype=np.float32)[expected])


@pytest.mark.parametrize("num_draft", ["full", "ragged"])
def test_greedy_verify_equals_argmax_decisions(num_draft):
    """Greedy rows: x_i accepted iff x_i = argmax p_i; emitted token = argmax p_n."""
    batch, g, vocab = MB, MG, MV
    rng = np.random.default_rng(7)
    draft, target = make_case(rng, batch, g, vocab)
    target[::5] = np.round(target[::5])  # rows with tied logits
    am = np.argmax(target, axis=2)
    # Draft tokens equal the target argmax with probability 0.8, else random.
    x = np.where(rng.random((batch, g)) < 0.8, am[:, :g], rng.integers(0, vocab, (batch, g)))
    k = np.full(batch, g) if num_draft == "full" else rng.integers(0, g + 1, batch)
    out = verify_from_logits(x, draft, target, key=jax.random.key(1), temperature=0.0,
                             top_k=7, top_p=0.9, num_draft_tokens=k)
    tokens = np.asarray(out["tokens"])
    n_seen = np.asarray(out["num_accepted"])
    for b in range(batch):
        n = 0
        while n < k[b] and x[b, n] == am[b, n]:
            n += 1
        assert n_seen[b] == n, b
        expected = np.full(g + 1, -1)
        expected[:n] = x[b, :n]
        expected[n] = am[b, n]
        np.testing.assert_array_equal(tokens[b], expected, err_msg=f"row {b}")
    assert 0 < n_seen.mean() < g  # both acceptances and rejections happened


# --------------------------------------------------------------------------- #
# The whole verify step against the float64 reference
# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class VerifyCase:
    name: str
    batch: int
    g: int
    temperature: object
    top_k: object
    top_p: object
    num_draft: object  # None, "random" (with 0 and G included), or a list
    per_row_keys: bool
    seed: int = 0


def _mixed(batch, seed, values):
    return np.random.default_rng(seed).choice(values, batch)


VERIFY_CASES = [
    VerifyCase("T1-plain-one-key", MB, MG, 1.0, None, None, None, False),
    VerifyCase("T0.7-k20-p0.9-row-keys", MB, MG, 0.7, 20, 0.9, None, True),
    VerifyCase("mixed-rows-ragged-row-keys", MB, MG, _mixed(MB, 1, [0.0, 0.5, 1.0, 1.3]),
               _mixed(MB, 2, [0, 3, 10, 45]), _mixed(MB, 3, [1.0, 0.5, 0.9]), "random", True),
    VerifyCase("mixed-ragged-one-key", MB, MG, _mixed(MB, 4, [0.0, 0.8]), 8,
               _mixed(MB, 5, [1.0, 0.7]), "random", False),
    VerifyCase("ragged-extremes", MB, MG, [0.0, 1.0, 0.7] * (MB // 3), 10, 0.9,
               [0, MG] * (MB // 2), True),
    VerifyCase("G=0-top-p-only", 8, 0, [0.0, 1.0] * 4, None, 0.8, None, True),
]


def _run_case(case: VerifyCase, key_seed: int):
    rng = np.random.default_rng(case.seed + 100 * key_seed)
    b, g, vocab = case.batch, case.g, MV
    draft, target = make_case(rng, b, g, vocab)
    ts = per_row(case.temperature, b).astype(np.float64)
    ks = per_row(0 if case.top_k is None else case.top_k, b).astype(np.int64)
    ps = per_row(1.0 if case.top_p is None else case.top_p, b).astype(np.float64)
    x = sample_draft_tokens(rng, draft, ts, ks, ps)
    if case.num_draft is None:
        kb = np.full(b, g)
    elif isinstance(case.num_draft, str):
        kb = rng.integers(0, g + 1, b)
        kb[:2] = [0, g]
    else:
        kb = np.asarray(case.num_draft)
    key = jax.random.key(key_seed)
    if case.per_row_keys:
        key = jax.random.split(key, b)
    out = verify_from_logits(
        x, draft, target, key=key, temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
        num_draft_tokens=None if case.num_draft is None else kb,
    )
    u, s = kernel_uniforms(key, b, g)
    refs = [
        ref_verify_row(x[i], draft[i], target[i], u[i], s[i], ts[i], ks[i], ps[i], kb[i]) for i in range(b)
    ]
    return out, refs, kb


@pytest.mark.parametrize(
    "case",
    VERIFY_CASES,
    ids=lambda c: c.name,
)
def test_verify_matches_float64_reference(case):
    near, accepted = 0, 0
    for key_seed in range(3):
        out, refs, kb = _run_case(case, key_seed)
        tokens = np.asarray(out["tokens"])
        n = np.asarray(out["num_accepted"])
        assert tokens.shape == (case.batch, case.g + 1) and tokens.dtype == np.int32
        for i, ref in enumerate(refs):
            # The layout holds for every row, at a float boundary or not.
            assert 0 <= n[i] <= kb[i]
            assert np.all(tokens[i, n[i] + 1:] == -1) and 0 <= tokens[i, n[i]] < MV
            if ref.near_boundary:
                near += 1
                continue
            accepted += n[i]
            assert n[i] == ref.num_accepted, f"row {i}, key {key_seed}"
            np.testing.assert_array_equal(tokens[i], ref.tokens, err_msg=f"row {i}, key {key_seed}")
    total = 3 * case.batch
    assert near <= max(1, total // 50), f"{near} of {total} rows at a float boundary"
    if case.g > 0:
        assert accepted > 0  # the cases exercise acceptance, not only rejection


def test_cutoff_token_keeps_its_probability_in_the_acceptance_test():
    """Minimal reproducer. Top-2 of [5, 3.0299606, -1, ...] at T = 0.7 keeps tokens 0 and 1.

    With draft logits = target logits, p = q, so ``u < p(x)/q(x) = 1`` passes for
    every u: x_i = 1 (probability 0.057) must be accepted at every position. In
    float32, 3.0299606 / 0.7 = 4.328515 but 3.0299606 * (1 / 0.7) = 4.3285155:
    if the row's cutoff were computed one way and the gathered logit of x the
    other, p(x) = q(x) = 0 in the test and nothing would be accepted (a bug the
    front end had: it now scales by a stored reciprocal everywhere). (Shape
    (1, 4, 40), as the validation table, to share its compilation.)
    """
    row = np.full(MV, -1.0, np.float32)
    row[:2] = [5.0, 3.0299606]
    assert np.float32(3.0299606) / np.float32(0.7) != np.float32(3.0299606) * (np.float32(1) / np.float32(0.7))
    assert ref_process(row, 0.7, 2, 1.0).probs[1] > 0.05  # token 1 is in the support
    logits = np.broadcast_to(row, (1, MG + 1, MV))
    out = verify_from_logits(np.ones((1, MG), np.int32), logits[:, :MG], logits,
                             key=jax.random.split(jax.random.key(0), 1), temperature=0.7, top_k=2, top_p=1.0)
    assert int(out["num_accepted"][0]) == MG


def test_ragged_ignores_draft_tokens_past_k():
    """Entries at positions >= k_b may be anything (even out of range); they never matter."""
    batch, g, vocab = MB, MG, MV
    rng = np.random.default_rng(8)
    draft, target = make_case(rng, batch, g, vocab)
    x = rng.integers(0, vocab, (batch, g))
    kb = rng.integers(0, g + 1, batch)
    garbage = x.copy()
    pos = np.arange(g)[None, :] >= kb[:, None]
    garbage[pos] = rng.choice([-1, vocab, vocab + 99], pos.sum())
    key = jax.random.split(jax.random.key(3), batch)
    kw = dict(key=key, temperature=0.8, top_k=10, top_p=1.0, num_draft_tokens=kb)
    a = verify_from_logits(x, draft, target, **kw)
    b = verify_from_logits(garbage, draft, target, **kw)
    np.testing.assert_array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))
    tokens = np.asarray(a["tokens"])
    n = np.asarray(a["num_accepted"])
    assert np.all(n <= kb)
    for i in range(batch):
        assert np.all(tokens[i, n[i] + 1:] == -1)
        assert tokens[i, n[i]] >= 0
    # The emitted token of a k_b = 0 row is a draw from p_0, whatever the draft says.
    assert np.all(n[kb == 0] == 0)


@pytest.mark.parametrize("seed", range(4))
def test_position_by_position_path_equals_the_all_rows_path(seed):
    """Without top-k/top-p the step stops at the first rejection (a while_loop over
    positions); top_k=0, top_p=1 keep every token but take the path that
    summarises all rows at once. Same key, same processing: the same answer,
    for mixed greedy/sampled rows, ragged k_b (including 0) and draft tokens the
    target rejects or accepts at every position."""
    rng = np.random.default_rng(100 + seed)
    batch, g, vocab = 6, 5, 300
    target = (2.0 * rng.standard_normal((batch, g + 1, vocab))).astype(np.float32)
    # Rows 0-2: a draft close to the target (long accepted prefixes); rows 3-5: unrelated.
    close = target[:3, :g] + 0.3 * rng.standard_normal((3, g, vocab)).astype(np.float32)
    draft = np.concatenate([close, rng.standard_normal((3, g, vocab)).astype(np.float32)])
    x = np.argmax(draft + rng.gumbel(size=draft.shape), axis=-1).astype(np.int32)
    temperature = np.array([1.0, 0.0, 0.7, 1.3, 0.0, 0.9], np.float32)
    kb = np.array([g, g, 3, 0, 2, g], np.int32)
    key = jax.random.split(jax.random.key(seed), batch)
    lazy = verify_from_logits(x, draft, target, key=key, temperature=temperature, num_draft_tokens=kb)
    full = verify_from_logits(x, draft, target, key=key, temperature=temperature, num_draft_tokens=kb,
                              top_k=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(lazy["num_accepted"]), np.asarray(full["num_accepted"]))
    np.testing.assert_array_equal(np.asarray(lazy["tokens"]), np.asarray(full["tokens"]))
    # The case is not degenerate: some row accepts its whole draft and some none.
    n = np.asarray(lazy["num_accepted"])
    assert np.any((n == kb) & (kb > 0)) and np.any((n == 0) & (kb > 0)), (n, kb)


def test_uniform_draws_are_the_documented_ones():
    """verify_from_logits == rejection_sample(probabilities, u, s) with u, s drawn from the key.

    u = uniform(key, (B, G+1))[:, :G] and s = [:, G] for one key; the same per
    row through vmap for per-row keys. The probabilities are computed here (the
    float64 reference, stored as float32); rows near a float boundary are skipped.
    No top-k/top-p here (k = 0, p = 1 as values), so the cutoff bug cannot interfere.
    """
    batch, g, vocab = MB, MG, MV
    rng = np.random.default_rng(9)
    draft, target = make_case(rng, batch, g, vocab)
    ts = rng.choice([0.0, 0.7, 1.0], batch)
    ks, ps = np.zeros(batch, int), np.ones(batch)
    x = sample_draft_tokens(rng, draft, ts, ks, ps)
    q = np.stack([[ref_process(draft[i, j], ts[i], ks[i], ps[i]).probs for j in range(g)] for i in range(batch)])
    p = np.stack([[ref_process(target[i, j], ts[i], ks[i], ps[i]).probs for j in range(g + 1)]
                  for i in range(batch)])
    compared = 0
    for key in (jax.random.key(11), jax.random.split(jax.random.key(12), batch)):
        got = verify_from_logits(x, draft, target, key=key, temperature=ts, top_k=ks, top_p=ps)
        u, s = kernel_uniforms(key, batch, g)
        want = rejection_sample(x, q.astype(np.float32), p.astype(np.float32), u.astype(np.float32),
                                s.astype(np.float32))
        for i in range(batch):
            ref = ref_verify_row(x[i], draft[i], target[i], u[i], s[i], ts[i], ks[i], ps[i], g)
            if ref.near_boundary:
                continue
            compared += 1
            np.testing.assert_array_equal(np.asarray(got["tokens"][i]), np.asarray(want["tokens"][i]),
                                          err_msg=f"row {i}")
    assert compared >= 0.8 * 2 * batch


def test_empty_batch():
    out = verify_from_logits(np.zeros((0, 2), np.int32), np.zeros((0, 2, 5), np.float32),
                             np.zeros((0, 3, 5), np.float32), key=jax.random.key(0), temperature=1.0)
    assert out["tokens"].shape == (0, 3) and out["num_accepted"].shape == (0,)
    tokens, probs = sample_from_logits(np.zeros((0, 5), np.float32), key=jax.random.key(0), temperature=1.0)
    assert tokens.shape == (0,) and probs.shape == (0, 5)


# --------------------------------------------------------------------------- #
# Keys and determinism
# --------------------------------------------------------------------------- #


def _main_inputs(seed=10, noise=0.3):
    rng = np.random.default_rng(seed)
    draft, target = make_case(rng, MB, MG, MV, noise=noise)
    x = sample_draft_tokens(rng, draft, np.full(MB, 0.9), np.zeros(MB, int), np.ones(MB))
    params = dict(
        temperature=rng.choice([0.0, 0.5, 0.9, 1.2], MB),
        top_k=rng.choice([0, 1, 5, 30], MB),
        top_p=rng.choice([1.0, 0.95, 0.7], MB),
        num_draft_tokens=rng.integers(0, MG + 1, MB),
    )
    return x, draft, target, params


def _rows(params, index):
    return {k: np.asarray(v)[index] for k, v in params.items()}


def test_per_row_keys_make_rows_independent_of_their_batch():
    x, draft, target, params = _main_inputs()
    keys = jax.random.split(jax.random.key(5), MB)
    full = np.asarray(verify_from_logits(x, draft, target, key=keys, **params)["tokens"])
    for i in (0, 1, 7, MB - 1):
        alone = verify_from_logits(x[i:i + 1], draft[i:i + 1], target[i:i + 1], key=keys[i:i + 1],
                                   **_rows(params, slice(i, i + 1)))
        np.testing.assert_array_equal(np.asarray(alone["tokens"])[0], full[i], err_msg=f"row {i}")
    # In another batch order (other neighbours, same shapes) the rows move with their keys.
    perm = np.random.default_rng(0).permutation(MB)
    shuffled = verify_from_logits(x[perm], draft[perm], target[perm], key=keys[perm], **_rows(params, perm))
    np.testing.assert_array_equal(np.asarray(shuffled["tokens"]), full[perm])
    # Sampling too.
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((SB, SV)).astype(np.float32)
    skeys = jax.random.split(jax.random.key(6), SB)
    sp = dict(temperature=rng.choice([0.0, 0.7, 1.0], SB), top_k=rng.choice([0, 5], SB),
              top_p=rng.choice([1.0, 0.8], SB))
    t_full, _ = sample_from_logits(logits, key=skeys, **sp)
    sperm = np.array([3, 0, 5, 1, 4, 2])
    t_perm, _ = sample_from_logits(logits[sperm], key=skeys[sperm], **_rows(sp, sperm))
    np.testing.assert_array_equal(np.asarray(t_perm), np.asarray(t_full)[sperm])


def test_same_key_same_result_and_keys_matter():
    x, draft, target, _ = _main_inputs(noise=2.0)  # a poor draft: outcomes spread over many tokens
    kw = dict(temperature=1.0, top_k=30, top_p=1.0)
    a = verify_from_logits(x, draft, target, key=jax.random.key(7), **kw)
    b = verify_from_logits(x, draft, target, key=jax.random.key(7), **kw)
    c = verify_from_logits(x, draft, target, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))
    assert not np.array_equal(np.asarray(a["tokens"]), np.asarray(c["tokens"]))
    logits = np.random.default_rng(3).standard_normal((SB, SV)).astype(np.float32)
    s1, _ = sample_from_logits(logits, key=jax.random.key(7), **kw)
    s2, _ = sample_from_logits(logits, key=jax.random.key(7), **kw)
    s3, _ = sample_from_logits(logits, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    assert not np.array_equal(np.asarray(s1), np.asarray(s3))


def test_raw_uint32_keys_are_accepted():
    x, draft, target, _ = _main_inputs()
    typed = verify_from_logits(x, draft, target, key=jax.random.key(3), temperature=0.8)
    raw = verify_from_logits(x, draft, target, key=jax.random.PRNGKey(3), temperature=0.8)
    np.testing.assert_array_equal(np.asarray(typed["tokens"]), np.asarray(raw["tokens"]))
    kw = dict(temperature=0.8, top_k=0, top_p=1.0)
    a = verify_from_logits(x, draft, target, key=jax.random.split(jax.random.PRNGKey(3), MB), **kw)  # u32[B, 2]
    b = verify_from_logits(x, draft, target, key=jax.random.split(jax.random.key(3), MB), **kw)
    np.testing.assert_array_equal(np.asarray(a["tokens"]), np.asarray(b["tokens"]))
    logits = np.random.default_rng(2).standard_normal((SB, SV)).astype(np.float32)
    t1, _ = sample_from_logits(logits, key=jax.random.PRNGKey(4), temperature=0.8, top_k=0, top_p=1.0)
    t2, _ = sample_from_logits(logits, key=jax.random.key(4), temperature=0.8, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))


# --------------------------------------------------------------------------- #
# Compilation
# --------------------------------------------------------------------------- #


def test_changing_parameter_values_never_recompiles():
    # bfloat16 logits: a dtype no other test feeds to verify, so the first call compiles.
    x, draft, target, _ = _main_inputs()
    draft, target = jnp.asarray(draft, jnp.bfloat16), jnp.asarray(target, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), MB)

    def call(**kw):
        params = dict(temperature=0.7, top_k=5, top_p=0.9, key=keys)
        params.update(kw)
        jax.block_until_ready(verify_from_logits(x, draft, target, **params))

    before = frontend._verify_jit._cache_size()
    call()
    assert frontend._verify_jit._cache_size() == before + 1  # the counter can fail
    rng = np.random.default_rng(0)
    variants = [
        dict(temperature=1.3),
        dict(temperature=0.0),
        dict(temperature=rng.choice([0.0, 0.5, 1.0, 2.0], MB).tolist()),
        dict(temperature=rng.random(MB).astype(np.float32)),
        dict(temperature=jnp.asarray(rng.random(MB))),
        dict(temperature=jnp.asarray(0.5)),
        dict(temperature=2),
        dict(top_k=0),
        dict(top_k=rng.integers(0, 100, MB).tolist()),
        dict(top_k=jnp.asarray(rng.integers(0, 10, MB))),
        dict(top_k=np.int64(3)),
        dict(top_p=1.0),
        dict(top_p=rng.uniform(0.1, 1.0, MB).tolist()),
        dict(top_p=jnp.asarray(rng.uniform(0.1, 1.0, MB), jnp.float32)),
        dict(num_draft_tokens=rng.integers(0, MG + 1, MB)),
        dict(num_draft_tokens=np.zeros(MB, np.int32)),
        dict(num_draft_tokens=MG),
        dict(key=jax.random.split(jax.random.key(9), MB)),
        dict(key=jax.random.split(jax.random.PRNGKey(9), MB)),  # raw uint32 keys
    ]
    for kw in variants:
        call(**kw)
        assert frontend._verify_jit._cache_size() == before + 1, f"recompiled for {kw}"


def test_changing_parameter_values_never_recompiles_sampling():
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((SB, SV)).astype(np.float32)
    jax.block_until_ready(sample_from_logits(logits, key=jax.random.key(0), temperature=0.7, top_k=5, top_p=0.9))
    before = frontend._sample_jit._cache_size()
    for t, k, p in [(0.0, 1, 0.1), ([0.0, 1.0, 2.0, 0.5, 1, 1], [0, 1, 2, 50, 3, 3], [1.0, 0.2, 0.5, 0.9, 1, 1]),
                    (jnp.asarray(1.5), jnp.asarray(3), jnp.asarray(0.4))]:
        jax.block_until_ready(sample_from_logits(logits, key=jax.random.key(3), temperature=t, top_k=k, top_p=p))
        assert frontend._sample_jit._cache_size() == before, (t, k, p)


# --------------------------------------------------------------------------- #
# Validation: table-driven; every message names the argument, what was expected
# and what was got. One row (B = 1) for verify, SB rows for sampling.
# --------------------------------------------------------------------------- #

VB, VG = 1, MG


def _good_verify_args():
    rng = np.random.default_rng(13)
    return dict(
        draft_tokens=rng.integers(0, MV, (VB, VG)),
        draft_logits=rng.standard_normal((VB, VG, MV)).astype(np.float32),
        target_logits=rng.standard_normal((VB, VG + 1, MV)).astype(np.float32),
        key=jax.random.split(jax.random.key(0), VB),
        temperature=0.7,
        top_k=5,
        top_p=0.9,
    )


def _with(**changes):
    return changes


VERIFY_ERRORS = [
    ("draft_tokens-rank", _with(draft_tokens=np.zeros((VB,), np.int32)),
     r"draft_tokens: expected rank 2 with shape \(B, G\), got shape \(1,\)"),
    ("draft_logits-shape", _with(draft_logits=np.zeros((VB, VG + 1, MV), np.float32)),
     r"draft_logits: expected shape \(B, G, V\) = \(1, 4, 40\), got \(1, 5, 40\)"),
    ("target_logits-shape", _with(target_logits=np.zeros((VB, VG, MV), np.float32)),
     r"target_logits: expected shape \(B, G\+1, V\) = \(1, 5, 40\), got \(1, 4, 40\)"),
    ("target_logits-batch", _with(target_logits=np.zeros((VB + 2, VG + 1, MV), np.float32)),
     r"target_logits: expected shape \(B, G\+1, V\) = \(1, 5, 40\), got \(3, 5, 40\)"),
    ("draft_tokens-batch", _with(draft_tokens=np.zeros((VB + 1, VG), np.int32)),
     r"draft_tokens: expected shape \(B, G\) = \(1, 4\) like the logits, got \(2, 4\)"),
    ("draft_tokens-draft-length", _with(draft_tokens=np.zeros((VB, VG - 1), np.int32)),
     r"draft_tokens: expected shape \(B, G\) = \(1, 4\) like the logits, got \(1, 3\)"),
    ("vocab-mismatch", _with(draft_logits=np.zeros((VB, VG, MV - 8), np.float32)),
     r"draft_logits: expected the target's vocabulary size V = 40, got 32"),
    ("logits-int", _with(target_logits=np.zeros((VB, VG + 1, MV), np.int32)),
     r"target_logits: expected a floating dtype .*, got int32"),
    ("draft-token-range", _with(draft_tokens=np.full((VB, VG), MV)),
     r"draft_tokens: expected token ids in \[0, V\) = \[0, 40\) .*got values in \[40, 40\]"),
    ("draft-token-negative", _with(draft_tokens=np.full((VB, VG), -3)),
     r"draft_tokens: expected token ids in \[0, V\) = \[0, 40\) .*got values in \[-3, -3\]"),
    ("nan-logits", _with(target_logits=np.full((VB, VG + 1, MV), np.nan, np.float32)),
     r"target_logits: expected no NaN or \+inf logits, got 200 NaN"),
    ("inf-draft-logits", _with(draft_logits=np.full((VB, VG, MV), np.inf, np.float32)),
     r"draft_logits: expected no NaN or \+inf logits, got 0 NaN and 160 \+inf"),
    ("temperature-negative", _with(temperature=-0.5),
     r"temperature: expected finite values >= 0 \(0 = greedy\), got \[-0.5\]"),
    ("temperature-nan", _with(temperature=float("nan")), r"temperature: expected finite values >= 0"),
    ("temperature-shape", _with(temperature=[0.5, 0.5]),
     r"temperature: expected a scalar or shape \(B,\) = \(1,\), got shape \(2,\)"),
    ("temperature-none", _with(temperature=None),
     r"temperature: expected a number >= 0 or an array of shape \(B,\), got None"),
    ("top_p-zero", _with(top_p=0.0), r"top_p: expected values in \(0, 1\], got \[0.0\]"),
    ("top_p-above-one", _with(top_p=1.5), r"top_p: expected values in \(0, 1\], got \[1.5\]"),
    ("top_p-negative", _with(top_p=[-0.1]), r"top_p: expected values in \(0, 1\], got \[-0.1\]"),
    ("top_p-shape", _with(top_p=np.full((VB, 1), 0.9)),
     r"top_p: expected a scalar or shape \(B,\) = \(1,\), got shape \(1, 1\)"),
    ("top_k-negative", _with(top_k=-1), r"top_k: expected integers >= 0 \(0 = no top-k\), got \[-1\]"),
    ("top_k-float", _with(top_k=2.5), r"top_k: expected integers, got dtype float64"),
    ("top_k-shape", _with(top_k=[1, 2, 3]),
     r"top_k: expected a scalar or shape \(B,\) = \(1,\), got shape \(3,\)"),
    ("num_draft-too-big", _with(num_draft_tokens=[VG + 1]),
     r"num_draft_tokens: expected values in \[0, G\] = \[0, 4\], got \[5\]"),
    ("num_draft-negative", _with(num_draft_tokens=-1),
     r"num_draft_tokens: expected values in \[0, G\] = \[0, 4\], got \[-1\]"),
    ("num_draft-shape", _with(num_draft_tokens=[1, 2]),
     r"num_draft_tokens: expected a scalar or shape \(B,\) = \(1,\), got shape \(2,\)"),
    ("num_draft-float", _with(num_draft_tokens=[1.0]), r"num_draft_tokens: expected integers, got dtype float64"),
    ("key-none", _with(key=None), r"key: expected a JAX PRNG key .*got None"),
    ("key-int", _with(key=0), r"key: expected a JAX PRNG key .*got int"),
    ("key-shape", _with(key=jax.random.split(jax.random.key(0), VB + 2)),
     r"key: expected one key \(shape \(\)\) or one per row \(shape \(1,\)\), got shape \(3,\)"),
    ("key-float-array", _with(key=jnp.zeros((2,), jnp.float32)),
     r"key: expected a JAX PRNG key .*got an array of dtype float32"),
]


@pytest.mark.parametrize("name,changes,pattern", VERIFY_ERRORS, ids=[c[0] for c in VERIFY_ERRORS])
def test_verify_rejects_bad_input(name, changes, pattern):
    args = _good_verify_args()
    args.update(changes)
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    with pytest.raises(ValueError, match=pattern):
        verify_from_logits(*positional, **args)


def test_verify_good_args_are_accepted():
    """The table's baseline is valid, so each error above comes from its one change."""
    args = _good_verify_args()
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    out = verify_from_logits(*positional, **args)
    assert out["tokens"].shape == (VB, VG + 1)


def test_missing_key_argument():
    """Omitting ``key`` (a required keyword) is Python's TypeError; key=None is the ValueError above."""
    args = _good_verify_args()
    del args["key"]
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    with pytest.raises(TypeError, match="key"):
        verify_from_logits(*positional, **args)


SAMPLE_ERRORS = [
    ("logits-rank", _with(logits=np.zeros((SB, 3, SV), np.float32)),
     r"logits: expected rank 2 with shape \(B, V\), got shape \(6, 3, 64\)"),
    ("logits-int", _with(logits=np.zeros((SB, SV), np.int64)), r"logits: expected a floating dtype .*got int64"),
    ("logits-nan", _with(logits=np.full((SB, SV), np.nan, np.float32)), r"logits: expected no NaN or \+inf"),
    ("logits-all-neg-inf", _with(logits=np.full((SB, SV), -np.inf, np.float32)),
     r"logits: expected every row to have a finite logit, got 6 rows of all -inf"),
    ("temperature-row-negative", _with(temperature=[1.0, 1.0, -1.0, 1.0, 1.0, 1.0]),
     r"temperature: expected finite values >= 0 \(0 = greedy\), got \[1.0, 1.0, -1.0, 1.0, 1.0, 1.0\]"),
    ("temperature-inf", _with(temperature=float("inf")), r"temperature: expected finite values >= 0"),
    ("top_p-zero-row", _with(top_p=[0.9, 0.9, 0.9, 0.0, 0.9, 0.9]),
     r"top_p: expected values in \(0, 1\], got \[0.9, 0.9, 0.9, 0.0, 0.9, 0.9\]"),
    ("top_k-negative-row", _with(top_k=[3, 3, 3, 3, 3, -2]),
     r"top_k: expected integers >= 0 \(0 = no top-k\), got \[3, 3, 3, 3, 3, -2\]"),
    ("key-none", _with(key=None), r"key: expected a JAX PRNG key"),
    ("key-shape", _with(key=jax.random.split(jax.random.key(0), 3)),
     r"key: expected one key \(shape \(\)\) or one per row \(shape \(6,\)\), got shape \(3,\)"),
]


@pytest.mark.parametrize("name,changes,pattern", SAMPLE_ERRORS, ids=[c[0] for c in SAMPLE_ERRORS])
def test_sample_rejects_bad_input(name, changes, pattern):
    args = dict(logits=np.zeros((SB, SV), np.float32), key=jax.random.key(0), temperature=1.0, top_k=3, top_p=0.9)
    args.update(changes)
    logits = args.pop("logits")
    with pytest.raises(ValueError, match=pattern):
        sample_from_logits(logits, **args)


def test_validate_false_skips_value_checks_only():
    args = _good_verify_args()
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    verify_from_logits(*positional, **{**args, "temperature": -1.0}, validate=False)  # no host sync, no error
    with pytest.raises(ValueError, match=re.escape("draft_logits: expected shape (B, G, V) = (1, 4, 40)")):
        verify_from_logits(positional[0], positional[1][:, :2], positional[2], **args, validate=False)


def test_validate_false_narrows_torch_int64_ids_without_the_int32_range_check():
    """With validate=False, torch int64 ids are narrowed by torch (no range check, like
    the unchecked [0, V) range); with validate=True an id beyond int32 is refused."""
    import torch

    args = _good_verify_args()
    x, draft, target = (args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits"))
    ids = torch.from_numpy(np.asarray(x, np.int64))
    want = verify_from_logits(np.asarray(x, np.int32), draft, target, **args)
    got = verify_from_logits(ids, draft, target, **args, validate=False)
    for key in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))
    with pytest.raises(ValueError, match="draft_tokens: token ids must fit in int32"):
        verify_from_logits(ids + 2**33, draft, target, **args)


# --------------------------------------------------------------------------- #
# Properties (hypothesis; the shared verify shape, values drawn per row)
# --------------------------------------------------------------------------- #


@st.composite
def verify_inputs(draw):
    b, g, vocab = MB, MG, MV
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 5.0]))
    draft, target = make_case(rng, b, g, vocab, scale=scale, noise=draw(st.sampled_from([0.0, 0.5, 3.0])))

    def rows(strategy):
        return np.array(draw(st.lists(strategy, min_size=b, max_size=b)))

    x = rng.integers(0, vocab, (b, g))
    if draw(st.booleans()):  # draft tokens at the target's argmax: long accepted prefixes
        x = np.argmax(target[:, :g], axis=2)
    return dict(
        x=x, draft=draft, target=target, seed=seed,
        temperature=rows(st.sampled_from([0.0, 0.3, 1.0, 2.0])),
        top_k=rows(st.integers(0, vocab + 2)),
        top_p=rows(st.sampled_from([0.05, 0.5, 0.9, 1.0])),
        kb=rows(st.integers(0, g)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(verify_inputs())
def test_verify_invariants(inp):
    b = inp["x"].shape[0]
    out = verify_from_logits(inp["x"], inp["draft"], inp["target"],
                             key=jax.random.split(jax.random.key(inp["seed"] % 1000), b),
                             temperature=inp["temperature"], top_k=inp["top_k"], top_p=inp["top_p"],
                             num_draft_tokens=inp["kb"])
    tokens = np.asarray(out["tokens"])
    n = np.asarray(out["num_accepted"])
    for i in range(b):
        t, k, p = inp["temperature"][i], inp["top_k"][i], inp["top_p"][i]
        assert 0 <= n[i] <= inp["kb"][i]
        np.testing.assert_array_equal(tokens[i, :n[i]], inp["x"][i, :n[i]])
        assert np.all(tokens[i, n[i] + 1:] == -1)
        y = tokens[i, n[i]]
        # The emitted token lies in the processed target's support at position n.
        p_n = ref_process(inp["target"][i, n[i]], t, k, p)
        assert p_n.probs[y] > 0 or p_n.margin < BOUNDARY_TOL
        # Every accepted token has positive target probability.
        for j in range(n[i]):
            pj = ref_process(inp["target"][i, j], t, k, p)
            assert pj.probs[tokens[i, j]] > 0 or pj.margin < BOUNDARY_TOL
        if t == 0:
            assert y == np.argmax(inp["target"][i, n[i]])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5, 1.0, 3.0]), st.integers(0, SV + 5),
       st.sampled_from([0.01, 0.3, 0.9, 1.0]), st.sampled_from([0.01, 1.0, 30.0]))
def test_sample_invariants(seed, temperature, top_k, top_p, scale):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((SB, SV))).astype(np.float32)
    tokens, probs = sample_from_logits(logits, key=jax.random.key(seed % 1000), temperature=temperature,
                                       top_k=top_k, top_p=top_p)
    tokens, probs = np.asarray(tokens), np.asarray(probs)
    assert probs.dtype == np.float32 and tokens.dtype == np.int32
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    rows = np.arange(SB)
    assert np.all(probs[rows, tokens] > 0)  # tokens are drawn from probs' support
    am = np.argmax(logits, axis=1)
    assert np.all(probs[rows, am] > 0)  # the argmax is always kept
    support = (probs > 0).sum(axis=1)
    if top_k > 0:
        kth = -np.sort(-logits, axis=1)[:, min(top_k, SV) - 1]
        assert np.all(support <= (logits >= kth[:, None]).sum(axis=1))
    if temperature == 0:
        np.testing.assert_array_equal(tokens, am)
        assert np.all(support == 1)


# --------------------------------------------------------------------------- #
# Compile options: every function that turns logits into probabilities agrees
# --------------------------------------------------------------------------- #


def _logits_jits():
    """(name, lowered) for every jitted entry point that processes logits."""
    from jax.sharding import Mesh

    from specjax.generate import steps
    from specjax.kernels import sharded

    b, g, v = 2, 3, 40
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32)
    d, t = jnp.zeros((b, g, v)), jnp.zeros((b, g + 1, v))
    key, keys = jax.random.key(0), jax.random.split(jax.random.key(0), b)
    f32, i32 = jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32)
    static = {"use_top_k": True, "use_top_p": True}
    layout = sharded.MeshLayout(Mesh(np.array(jax.devices()[:1]), ("x",)), batch_axis="x")
    return [
        ("frontend._verify_jit", frontend._verify_jit.lower(tokens, d, t, key, f32, i32, f32, i32 + g, **static)),
        ("frontend._sample_jit", frontend._sample_jit.lower(t[:, 0], key, f32, i32, f32, **static)),
        ("steps.draft_draw", steps.draft_draw.lower(t[:, 0], keys, 0, 1, f32, i32, f32, vocab=v, **static)),
        ("steps.verify_step", steps.verify_step.lower(tuple(tokens.T), tuple(d.transpose(1, 0, 2)), t, keys, 0,
                                                      f32, i32, f32, i32 + g, **static)),
        ("steps.probs_step", steps.probs_step.lower(tuple(d.transpose(1, 0, 2)), t, keys, 0, f32, i32, f32,
                                                    **static)),
        ("sharded._verify_mesh_jit", sharded._verify_mesh_jit.lower(tokens, d, t, key, f32, i32, f32, i32 + g,
                                                                    layout=layout, **static)),
    ]


def test_every_logits_jit_compiles_with_the_same_vector_options():
    """The draft's draw and the acceptance step must compute q bit for bit alike.

    512-bit vectors can change a normaliser's last bit (bench_overheads.py checks
    only 1e-6 agreement), so a function compiled without the shared options could
    process the same logits differently from the others.
    """
    from specjax.kernels.compile_options import VECTOR_OPTIONS

    want = tuple(VECTOR_OPTIONS.items())
    for name, lowered in _logits_jits():
        # jax 0.10's record of a jit's compiler_options (private; the lowering keeps them).
        got = lowered._lowering._compiler_options_kvs
        assert set(want) <= set(got), f"{name}: compiled with {got}, expected {want}"
