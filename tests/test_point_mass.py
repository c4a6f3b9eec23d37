"""Point-mass drafts (``draft_probs=None`` / ``draft_logits=None``): deterministic proposals.

A drafter that proposes tokens without sampling them (n-gram prompt lookup, a
greedy head) has ``q_i`` = the point mass at ``x_i``. The contract then reads:
test ``i`` passes iff ``u_i < p_i(x_i)``; a rejected position draws from
``p_n`` without ``x_n``, renormalised. Checked here:

* the kernel with ``None`` gives the tokens of the float64 reference fed the
  explicit one-hot ``q`` (ties within rounding allowed), and of the kernel fed
  that one-hot array, for float32/bfloat16/float16 inputs;
* the shipped NumPy and torch samplers give the same results with ``None``;
* ``verify_from_logits(draft_logits=None)``: greedy rows keep exactly the
  argmax-matching prefix, ragged ``draft_lengths`` are honoured, bad input
  still gets named errors;
* the mesh path equals one device (tests/mesh/test_mesh_point_mass.py);
* statistics (slow): at T = 0.7 with top-k and top-p the emitted tokens follow
  the processed target distribution at positions 0 and 1, with a negative
  control (the same deterministic proposals verified as if they had been
  sampled from the draft's distribution) that the test must catch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import is_tie, reference_rejection_sample
from scipy import stats
from test_frontend_stats import ref_process

from specjax import rejection_sample, verify_from_logits
from specjax.plugin.reference_samplers import numpy_rejection_sample, torch_rejection_sample


def _case(seed: int, b: int, g: int, vocab: int, accept_bias: float = 0.5):
    """Random target probabilities and draft tokens, half of them the target's likeliest."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, g + 1, vocab)) * 2.0
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = rng.integers(0, vocab, size=(b, g))
    likely = rng.random((b, g)) < accept_bias
    x = np.where(likely, np.argmax(p[:, :g], axis=-1), x).astype(np.int32)
    u = rng.random((b, g)).astype(np.float32)
    s = rng.random(b).astype(np.float32)
    return x, p.astype(np.float32), u, s


def _one_hot(x: np.ndarray, vocab: int) -> np.ndarray:
    return (x[..., None] == np.arange(vocab)).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("seed,b,g,vocab", [(0, 16, 4, 50), (1, 9, 1, 300), (2, 5, 7, 1000), (3, 4, 0, 17)])
def test_point_masses_match_reference_with_explicit_one_hot(seed, b, g, vocab, dtype):
    x, p, u, s = _case(seed, b, g, vocab)
    p = np.asarray(jnp.asarray(p, dtype))
    out = rejection_sample(x, None, p, u, s)
    ref = reference_rejection_sample(x, _one_hot(x, vocab), p, u, s)
    n = np.asarray(out.num_accepted)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(n, ref.num_accepted)
    for row in range(b):
        y = int(tokens[row, n[row]])
        assert y == ref.emitted[row] or is_tie(ref, row, y, float(s[row])), (row, y, ref.emitted[row])
        np.testing.assert_array_equal(tokens[row, : n[row]], x[row, : n[row]])
        assert np.all(tokens[row, n[row] + 1 :] == -1)
    # The same tokens as the kernel fed the explicit one-hot q (which reads a (B, G, V) array).
    explicit = rejection_sample(x, np.asarray(jnp.asarray(_one_hot(x, vocab), dtype)), p, u, s)
    np.testing.assert_array_equal(np.asarray(explicit.num_accepted), n)
    np.testing.assert_array_equal(np.asarray(explicit.tokens), tokens)


def test_point_mass_residual_never_redraws_the_rejected_token():
    """A rejected x_n has residual weight 0, whatever s: the correction token differs from it."""
    vocab, b = 8, 2000
    rng = np.random.default_rng(7)
    p = np.full((b, 2, vocab), 1.0 / vocab, np.float32)
    x = rng.integers(0, vocab, size=(b, 1)).astype(np.int32)
    u = np.full((b, 1), 0.999, np.float32)  # 0.999 >= p(x) = 1/8: every test fails
    s = rng.random(b).astype(np.float32)
    out = rejection_sample(x, None, p, u, s)
    assert np.all(np.asarray(out.num_accepted) == 0)
    y = np.asarray(out.tokens)[:, 0]
    assert np.all(y != x[:, 0])
    # Negative control: with q = 0 (an explicit all-zero draft row) the residual is p and x comes back.
    zero_q = rejection_sample(x, np.zeros((b, 1, vocab), np.float32), p, u, s)
    assert np.any(np.asarray(zero_q.tokens)[:, 0] == x[:, 0])


def test_point_mass_acceptance_is_u_below_p():
    p = np.zeros((1, 2, 4), np.float32)
    p[0, 0] = [0.1, 0.6, 0.2, 0.1]
    p[0, 1] = [0.25, 0.25, 0.25, 0.25]
    x = np.array([[1]], np.int32)
    for u, accepted in [(0.0, 1), (0.5999, 1), (0.6, 0), (0.9, 0)]:
        out = rejection_sample(x, None, p, np.array([[u]], np.float32), np.array([0.5], np.float32))
        assert int(out.num_accepted[0]) == accepted, u
    # a token the target gives probability 0 is never accepted, also with u = 0
    p[0, 0] = [0.5, 0.0, 0.5, 0.0]
    out = rejection_sample(x, None, p, np.array([[0.0]], np.float32), np.array([0.5], np.float32))
    assert int(out.num_accepted[0]) == 0


@pytest.mark.parametrize("sampler", [numpy_rejection_sample, torch_rejection_sample])
def test_shipped_samplers_take_point_masses(sampler):
    x, p, u, s = _case(11, 32, 3, 64)
    ours = rejection_sample(x, None, p, u, s)
    theirs = sampler(x, None, p, u, s)
    np.testing.assert_array_equal(np.asarray(theirs.num_accepted), np.asarray(ours.num_accepted))
    ref = reference_rejection_sample(x, _one_hot(x, 64), p, u, s)
    got = np.asarray(theirs.tokens)
    n = np.asarray(ours.num_accepted)
    for row in range(x.shape[0]):
        y = int(got[row, n[row]])
        assert y == ref.emitted[row] or is_tie(ref, row, y, float(s[row]))


def test_point_mass_shape_errors_still_name_the_argument():
    x, p, u, s = _case(0, 2, 3, 10)
    with pytest.raises(ValueError, match=r"target_probs: expected shape"):
        rejection_sample(x, None, p[:, :3], u, s)
    with pytest.raises(ValueError, match=r"draft_tokens: expected token ids in \[0, V\)"):
        rejection_sample(np.full_like(x, 10), None, p, u, s)
    t = np.zeros((2, 4, 10), np.float32)
    with pytest.raises(ValueError, match=r"target_logits: expected shape"):
        verify_from_logits(x, None, t[:, :3], key=jax.random.key(0), temperature=0.5)
    with pytest.raises(ValueError, match=r"draft_tokens: expected token ids"):
        verify_from_logits(np.full_like(x, -1), None, t, key=jax.random.key(0), temperature=0.5)


def test_verify_point_masses_greedy_keeps_the_argmax_prefix():
    rng = np.random.default_rng(3)
    b, g, vocab = 64, 5, 40
    t = rng.normal(size=(b, g + 1, vocab)).astype(np.float32)
    am = np.argmax(t, axis=-1)
    x = am[:, :g].copy()
    first_miss = rng.integers(0, g + 1, size=b)
    for row in range(b):
        if first_miss[row] < g:
            x[row, first_miss[row]] = (am[row, first_miss[row]] + 1) % vocab
    out = verify_from_logits(x, None, t, key=jax.random.key(0), temperature=0.0)
    n = np.asarray(out.num_accepted)
    np.testing.assert_array_equal(n, first_miss)
    tokens = np.asarray(out.tokens)
    np.testing.assert_array_equal(tokens[np.arange(b), n], am[np.arange(b), n])


def test_verify_point_masses_ragged_rows_match_the_kernel_on_processed_probs():
    """Ragged k_b: the tests past k_b do not run; rows equal the probability kernel on a cut draft."""
    rng = np.random.default_rng(5)
    b, g, vocab = 12, 4, 30
    t = rng.normal(size=(b, g + 1, vocab)).astype(np.float32) * 2
    am = np.argmax(t, axis=-1)
    x = np.where(rng.random((b, g)) < 0.7, am[:, :g], rng.integers(0, vocab, (b, g))).astype(np.int32)
    k = rng.integers(0, g + 1, size=b).astype(np.int32)
    keys = jax.random.split(jax.random.key(9), b)
    out = verify_from_logits(x, None, t, key=keys, temperature=1.0, draft_lengths=k)
    n, tokens = np.asarray(out.num_accepted), np.asarray(out.tokens)
    assert np.all(n <= k)
    p = np.asarray(jax.nn.softmax(jnp.asarray(t), axis=-1))
    for row in range(b):
        # the same row's uniforms, as verify draws them: u[:G] accept, u[G] sample
        uu = np.asarray(jax.random.uniform(keys[row], (g + 1,), jnp.float32))
        kb = int(k[row])
        one = rejection_sample(x[row : row + 1, :kb], None, p[row : row + 1, : kb + 1], uu[None, :kb], uu[g : g + 1])
        assert int(one.num_accepted[0]) == n[row]
        ref_y, y = int(one.tokens[0, n[row]]), int(tokens[row, n[row]])
        ref = reference_rejection_sample(
            x[row : row + 1, :kb],
            _one_hot(x[row : row + 1, :kb], vocab),
            p[row : row + 1, : kb + 1],
            uu[None, :kb],
            uu[g : g + 1],
        )
        assert y == ref_y or is_tie(ref, 0, y, float(uu[g]), tol=1e-4)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #

N = 60_000
V = 48
T, K, P = 0.7, 16, 0.9


def _processed(logits: np.ndarray) -> np.ndarray:
    """Float64 temperature -> top-k -> top-p -> softmax (transformers semantics), as the front end's tests."""
    return ref_process(logits, T, K, P)


def _pvalue(tokens: np.ndarray, probs: np.ndarray) -> float:
    counts = np.bincount(tokens, minlength=probs.shape[0])
    support = probs > 0
    assert counts[~support].sum() == 0, "tokens outside the processed support"
    expected = probs[support] / probs[support].sum() * tokens.shape[0]
    return float(stats.chisquare(counts[support], expected).pvalue)


def _run(draft_logits):
    rng = np.random.default_rng(21)
    target = (2.0 * rng.standard_normal((3, V))).astype(np.float32)
    p0, p1 = _processed(target[0]), _processed(target[1])
    # Deterministic proposals: the likeliest token for a third of the rows, the
    # second likeliest for a third, and a token outside the top-k for the rest.
    order = np.argsort(-p0)
    choice = np.array([order[0], order[1], order[-1]])[np.arange(N) % 3]
    second = np.full(N, int(np.argmax(p1)), np.int64)
    x = np.stack([choice, second], axis=1).astype(np.int32)
    logits = np.broadcast_to(target, (N, 3, V))
    d = None if draft_logits is None else np.broadcast_to(draft_logits, (N, 2, V))
    out = verify_from_logits(
        x, d, logits, key=jax.random.split(jax.random.key(2), N), temperature=T, top_k=K, top_p=P, validate=False
    )
    return np.asarray(out.tokens), np.asarray(out.num_accepted), x, p0, p1


@pytest.mark.slow
def test_point_mass_verification_is_lossless_at_t07_with_top_k_top_p():
    tokens, n, x, p0, p1 = _run(None)
    assert _pvalue(tokens[:, 0], p0) > 1e-3
    # Where x_0 was accepted, position 1 follows p_1 (x_1 itself accepted or corrected).
    ok = (n >= 1) & (tokens[:, 0] == x[:, 0])
    assert ok.sum() > 5000
    assert _pvalue(tokens[ok, 1], p1) > 1e-3


@pytest.mark.slow
def test_point_mass_statistics_catch_a_wrong_draft_distribution():
    """Negative control: the same deterministic proposals verified as if sampled from a spread-out q."""
    flat = np.zeros((2, V), np.float32)  # q = the processed uniform distribution (top-k keeps 16 of them)
    tokens, *_, p0, _ = _run(flat)
    assert _pvalue(tokens[:, 0], p0) < 1e-6


def test_all_greedy_point_masses_match_the_sampled_path_on_their_rows():
    """The all-greedy shortcut (argmax from the statistics, no draw) against the general path: a sampled row
    added to the batch sends the greedy rows through the draw, and their tokens must not change."""
    rng = np.random.default_rng(8)
    b, g, vocab = 6, 4, 300
    t = np.round(rng.normal(size=(b, g + 1, vocab)) * 2).astype(np.float32)  # rounded: ties in the argmax
    am = t.argmax(-1)
    x = np.where(rng.random((b, g)) < 0.7, am[:, :g], rng.integers(0, vocab, (b, g))).astype(np.int32)
    k = np.array([4, 3, 0, 2, 4, 1], np.int32)
    keys = jax.random.split(jax.random.key(3), b)
    greedy = verify_from_logits(x, None, t, key=keys, temperature=0.0, draft_lengths=k)
    mixed = verify_from_logits(x, None, t, key=keys, temperature=[0.0] * (b - 1) + [0.7], draft_lengths=k)
    np.testing.assert_array_equal(np.asarray(greedy.tokens)[:-1], np.asarray(mixed.tokens)[:-1])
    n = np.asarray(greedy.num_accepted)
    for row in range(b):
        m = 0
        while m < k[row] and x[row, m] == am[row, m]:
            m += 1
        assert n[row] == m and np.asarray(greedy.tokens)[row, m] == am[row, m]
