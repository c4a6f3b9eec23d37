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
count is bounded. The statistical tests live in ``test_frontend_stats.py``; keys,
compilation, validation messages and compile options in
``test_frontend_boundary.py``; the references in ``frontend_reference.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from frontend_reference import (
    BOUNDARY_TOL,
    MB,
    MG,
    MV,
    SB,
    SV,
    hf_process,
    hf_top_p_margin,
    kernel_uniforms,
    make_case,
    per_row,
    ref_process,
    ref_verify_row,
    sample_draft_tokens,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specjax import rejection_sample, sample_from_logits, verify_from_logits
from specjax.kernels import frontend

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

    probs = np.asarray(
        probs_of(
            jnp.asarray(target),
            jnp.asarray(ts, jnp.float32),
            jnp.asarray(ks, jnp.int32),
            jnp.asarray(1.0 - ps, jnp.float32),
        )
    )
    for i in range(batch):
        for j in range(g + 1):
            np.testing.assert_allclose(probs[i, j], hf_process(target[i, j], ts[i], ks[i], ps[i]), atol=1e-6, rtol=0)


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
    out = verify_from_logits(
        x, draft, target, key=jax.random.key(1), temperature=0.0, top_k=7, top_p=0.9, draft_lengths=k
    )
    tokens = np.asarray(out.tokens)
    n_seen = np.asarray(out.num_accepted)
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
    VerifyCase(
        "mixed-rows-ragged-row-keys",
        MB,
        MG,
        _mixed(MB, 1, [0.0, 0.5, 1.0, 1.3]),
        _mixed(MB, 2, [0, 3, 10, 45]),
        _mixed(MB, 3, [1.0, 0.5, 0.9]),
        "random",
        True,
    ),
    VerifyCase(
        "mixed-ragged-one-key", MB, MG, _mixed(MB, 4, [0.0, 0.8]), 8, _mixed(MB, 5, [1.0, 0.7]), "random", False
    ),
    VerifyCase("ragged-extremes", MB, MG, [0.0, 1.0, 0.7] * (MB // 3), 10, 0.9, [0, MG] * (MB // 2), True),
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
        x,
        draft,
        target,
        key=key,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        draft_lengths=None if case.num_draft is None else kb,
    )
    u, s = kernel_uniforms(key, b, g)
    refs = [ref_verify_row(x[i], draft[i], target[i], u[i], s[i], ts[i], ks[i], ps[i], kb[i]) for i in range(b)]
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
        tokens = np.asarray(out.tokens)
        n = np.asarray(out.num_accepted)
        assert tokens.shape == (case.batch, case.g + 1) and tokens.dtype == np.int32
        for i, ref in enumerate(refs):
            # The layout holds for every row, at a float boundary or not.
            assert 0 <= n[i] <= kb[i]
            assert np.all(tokens[i, n[i] + 1 :] == -1) and 0 <= tokens[i, n[i]] < MV
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


@pytest.mark.parametrize("seed", [0, 1])
def test_cutoff_keeps_what_the_float64_sorted_reference_keeps(seed):
    """kernels.core.cutoff on one device: both ways a row can go, against the sorted float64 reference.

    600 logits per row, so the 256 candidates do not hold every row's cutoff: rows with
    top_k > 256, or a flat nucleus, take the bisection; the others are decided from
    the candidates. Rows whose cumulative sums come within rounding of 1 - top_p are
    skipped (their kept set is a float32 rounding question). The cutoff is also tight:
    the smallest kept logit itself.
    """
    from specjax.kernels.core import cutoff

    rng = np.random.default_rng(seed)
    rows, vocab = 96, 600
    scale = rng.choice([0.3, 1.0, 4.0], rows)[:, None]
    scaled = (scale * rng.standard_normal((rows, vocab))).astype(np.float32)
    scaled[1::7, 300:] = -np.inf
    scaled -= scaled.max(1, keepdims=True)  # relative to the max, as the front end passes them
    top_k = rng.choice([0, 1, 5, 256, 257, 400, 600, 10**6], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.999, 0.95, 0.9, 0.5, 0.05], rows)
    got = np.asarray(jax.jit(cutoff)(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(1 - top_p, jnp.float32)))
    bisected = checked = 0
    for r in range(rows):
        ref = ref_process(scaled[r], 1.0, int(top_k[r]), float(top_p[r]))
        if ref.margin < BOUNDARY_TOL:
            continue
        keep_ref = ref.probs > 0
        # -inf logits have probability 0 whatever the cutoff.
        np.testing.assert_array_equal((scaled[r] >= got[r]) & np.isfinite(scaled[r]), keep_ref, err_msg=f"row {r}")
        if np.isfinite(got[r]):  # tight: the smallest kept logit is the cutoff
            assert got[r] == scaled[r][keep_ref].min(), f"row {r}"
        checked += 1
        bisected += int(top_k[r] > 256 or (top_k[r] == 0 and top_p[r] < 1 and keep_ref.sum() > 200))
    assert checked > rows * 3 // 4 and bisected > 5, (checked, bisected)


def test_cutoff_keeps_every_tie_of_the_kth_value():
    """Top-k keeps every logit equal to the k-th, and top-p weighs them all (issue 54).

    Against the sort-based cutoff (tests/_straightforward.py: transformers'
    algorithm, cutting at a value, docs/api.md). The candidates route once
    decided such rows from the 256 largest alone: row 0 then dropped all 2000
    tied copies (cutoff 0.0, the large values'), as they hold less than
    ``1 - top_p`` of the 256 candidates' mass but more of the kept set's.
    """
    from _straightforward import straightforward_cutoff, tied_rows

    from specjax.kernels.core import cutoff

    args = tuple(jnp.asarray(a) for a in tied_rows(8192))
    got = np.asarray(jax.jit(cutoff)(*args))
    np.testing.assert_array_equal(got, np.asarray(straightforward_cutoff(*args)))
    scaled = np.asarray(args[0])
    assert (scaled[0] >= got[0]).sum() == 2010  # the ties and the large values
    assert (scaled[5] >= got[5]).sum() < 50  # the control: top-p cuts inside the top 50


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
    out = verify_from_logits(
        np.ones((1, MG), np.int32),
        logits[:, :MG],
        logits,
        key=jax.random.split(jax.random.key(0), 1),
        temperature=0.7,
        top_k=2,
        top_p=1.0,
    )
    assert int(out.num_accepted[0]) == MG


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
    kw = dict(key=key, temperature=0.8, top_k=10, top_p=1.0, draft_lengths=kb)
    a = verify_from_logits(x, draft, target, **kw)
    b = verify_from_logits(garbage, draft, target, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    tokens = np.asarray(a.tokens)
    n = np.asarray(a.num_accepted)
    assert np.all(n <= kb)
    for i in range(batch):
        assert np.all(tokens[i, n[i] + 1 :] == -1)
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
    lazy = verify_from_logits(x, draft, target, key=key, temperature=temperature, draft_lengths=kb)
    full = verify_from_logits(x, draft, target, key=key, temperature=temperature, draft_lengths=kb, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(lazy.num_accepted), np.asarray(full.num_accepted))
    np.testing.assert_array_equal(np.asarray(lazy.tokens), np.asarray(full.tokens))
    # The case is not degenerate: some row accepts its whole draft and some none.
    n = np.asarray(lazy.num_accepted)
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
    p = np.stack([[ref_process(target[i, j], ts[i], ks[i], ps[i]).probs for j in range(g + 1)] for i in range(batch)])
    compared = 0
    for key in (jax.random.key(11), jax.random.split(jax.random.key(12), batch)):
        got = verify_from_logits(x, draft, target, key=key, temperature=ts, top_k=ks, top_p=ps)
        u, s = kernel_uniforms(key, batch, g)
        want = rejection_sample(
            x, q.astype(np.float32), p.astype(np.float32), u.astype(np.float32), s.astype(np.float32)
        )
        for i in range(batch):
            ref = ref_verify_row(x[i], draft[i], target[i], u[i], s[i], ts[i], ks[i], ps[i], g)
            if ref.near_boundary:
                continue
            compared += 1
            np.testing.assert_array_equal(np.asarray(got.tokens[i]), np.asarray(want.tokens[i]), err_msg=f"row {i}")
    assert compared >= 0.8 * 2 * batch


def test_empty_batch():
    out = verify_from_logits(
        np.zeros((0, 2), np.int32),
        np.zeros((0, 2, 5), np.float32),
        np.zeros((0, 3, 5), np.float32),
        key=jax.random.key(0),
        temperature=1.0,
    )
    assert out.tokens.shape == (0, 3) and out.num_accepted.shape == (0,)
    tokens, probs = sample_from_logits(np.zeros((0, 5), np.float32), key=jax.random.key(0), temperature=1.0)
    assert tokens.shape == (0,) and probs.shape == (0, 5)


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
        x=x,
        draft=draft,
        target=target,
        seed=seed,
        temperature=rows(st.sampled_from([0.0, 0.3, 1.0, 2.0])),
        top_k=rows(st.integers(0, vocab + 2)),
        top_p=rows(st.sampled_from([0.05, 0.5, 0.9, 1.0])),
        kb=rows(st.integers(0, g)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(verify_inputs())
def test_verify_invariants(inp):
    b = inp["x"].shape[0]
    out = verify_from_logits(
        inp["x"],
        inp["draft"],
        inp["target"],
        key=jax.random.split(jax.random.key(inp["seed"] % 1000), b),
        temperature=inp["temperature"],
        top_k=inp["top_k"],
        top_p=inp["top_p"],
        draft_lengths=inp["kb"],
    )
    tokens = np.asarray(out.tokens)
    n = np.asarray(out.num_accepted)
    for i in range(b):
        t, k, p = inp["temperature"][i], inp["top_k"][i], inp["top_p"][i]
        assert 0 <= n[i] <= inp["kb"][i]
        np.testing.assert_array_equal(tokens[i, : n[i]], inp["x"][i, : n[i]])
        assert np.all(tokens[i, n[i] + 1 :] == -1)
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
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    st.integers(0, SV + 5),
    st.sampled_from([0.01, 0.3, 0.9, 1.0]),
    st.sampled_from([0.01, 1.0, 30.0]),
)
def test_sample_invariants(seed, temperature, top_k, top_p, scale):
    rng = np.random.default_rng(seed)
    logits = (scale * rng.standard_normal((SB, SV))).astype(np.float32)
    tokens, probs = sample_from_logits(
        logits, key=jax.random.key(seed % 1000), temperature=temperature, top_k=top_k, top_p=top_p
    )
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
