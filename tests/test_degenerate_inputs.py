"""Degenerate inputs the kernels must not turn into silent wrong answers (issue 58).

* A NaN draft probability ``q(x)`` (a non-finite draft distribution, reachable
  with ``validate=False``) fails the accept test, and a NaN in ``q_n`` sends the
  correction draw to ``p_n``: a broken draft costs speed, never the target's
  law. Before, a NaN with its sign bit set read as ``q = 0`` and passed every
  draft token the target allows. Both signs, on the JAX code and the C++ path.
* Big-endian NumPy arrays (``'>f4'``) are converted at the boundary: they used
  to reach XLA as garbage numbers (a one-hot "softmax", wrong counts).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from specjax import rejection_sample, sample_from_logits, verify_from_logits
from specjax.kernels import cpu_kernels

IMPLS = ["xla"] + (["cpu"] if cpu_kernels.available() else [])
NAN = np.float32(np.nan)
NANS = pytest.mark.parametrize("nan", [NAN, -NAN], ids=["+nan", "-nan"])


def _draw(q: np.ndarray, p: np.ndarray, u: float, s: float, impl: str, x: int = 1):
    out = rejection_sample(
        np.array([[x]], np.int32),
        q[None].astype(np.float32),
        p[None].astype(np.float32),
        np.array([[u]], np.float32),
        np.array([s], np.float32),
        validate=False,
        impl=impl,
    )
    return int(out.num_accepted[0]), np.asarray(out.tokens[0]).tolist()


P = np.array([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])


@NANS
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_draft_probability_at_the_token_fails_and_draws_from_the_target(nan, impl):
    q = np.array([[0.25, nan, 0.25, 0.25]])
    # p_0 is uniform: s = 0.6 draws token 2 (cdf 0.25, 0.5, 0.75)
    assert _draw(q, P, 0.1, 0.6, impl) == (0, [2, -1])
    # negative control: the same row with q(x) = 0.25 passes (u = 0.1 < p/q = 1)
    assert _draw(np.array([[0.25, 0.25, 0.25, 0.25]]), P, 0.1, 0.6, impl) == (1, [1, 0])


@NANS
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_elsewhere_in_the_draft_row_sends_the_correction_to_the_target(nan, impl):
    # x = 0: p/q = 0.25/0.5 = 0.5 < u = 0.9, rejected; the residual holds a NaN, so y ~ p_0
    q = np.array([[0.5, 0.25, nan, 0.25]])
    assert _draw(q, P, 0.9, 0.3, impl, x=0) == (0, [1, -1])
    # negative control: a finite q_0 = [0.5, 0.5, 0, 0] leaves the residual [0, 0, .25, .25]: y = 2
    assert _draw(np.array([[0.5, 0.5, 0.0, 0.0]]), P, 0.9, 0.3, impl, x=0) == (0, [2, -1])


@NANS
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_target_probability_at_the_token_fails(nan, impl):
    p = P.copy()
    p[0, 1] = nan
    # q(x) = 0 would pass any p(x) > 0; a NaN p(x) is not one
    n, _ = _draw(np.array([[0.5, 0.0, 0.5, 0.0]]), p, 0.0, 0.1, impl)
    assert n == 0


@pytest.mark.parametrize("bad", [NAN, np.float32(np.inf)], ids=["nan", "+inf"])
def test_verify_from_logits_refuses_non_finite_draft_logits_by_name(bad):
    """The logits kernel's contract for them: validate=True refuses them, naming the argument."""
    rng = np.random.default_rng(3)
    t = rng.normal(size=(2, 2, 8)).astype(np.float32)
    d = rng.normal(size=(2, 1, 8)).astype(np.float32)
    x = np.full((2, 1), 5, np.int32)
    verify_from_logits(x, d, t, key=jax.random.key(1), temperature=1.0)  # negative control
    d[1, 0, 5] = bad
    with pytest.raises(ValueError, match=r"draft_logits: expected no NaN or \+inf logits"):
        verify_from_logits(x, d, t, key=jax.random.key(1), temperature=1.0)


# --------------------------------------------------------------------------- byte order


def _be(a: np.ndarray) -> np.ndarray:
    out = a.astype(a.dtype.newbyteorder(">"))
    assert not out.dtype.isnative and np.array_equal(out, a)
    return out


@pytest.mark.parametrize("validate", [True, False])
def test_big_endian_inputs_read_as_their_values(validate):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 16)).astype(np.float32)
    key = jax.random.key(0)
    want_tokens, want_probs = sample_from_logits(logits, key=key, temperature=1.0, validate=validate)
    got_tokens, got_probs = sample_from_logits(
        _be(logits), key=key, temperature=_be(np.full(3, 1.0, np.float32)), validate=validate
    )
    assert np.array_equal(np.asarray(got_tokens), np.asarray(want_tokens))
    np.testing.assert_array_equal(np.asarray(got_probs), np.asarray(want_probs))
    assert float(np.asarray(got_probs).max()) < 0.9  # not the one-hot a misread gave

    t = rng.normal(size=(3, 4, 16)).astype(np.float32)
    d = rng.normal(size=(3, 3, 16)).astype(np.float32)
    x = rng.integers(0, 16, size=(3, 3)).astype(np.int32)
    want_v = verify_from_logits(x, d, t, key=key, temperature=0.7, top_p=0.9, validate=validate)
    got_v = verify_from_logits(_be(x), _be(d), _be(t), key=key, temperature=0.7, top_p=0.9, validate=validate)
    assert np.array_equal(np.asarray(got_v.tokens), np.asarray(want_v.tokens))

    q = rng.dirichlet(np.ones(16), size=(3, 3)).astype(np.float32)
    p = rng.dirichlet(np.ones(16), size=(3, 4)).astype(np.float32)
    u, s = rng.random((3, 3)).astype(np.float32), rng.random(3).astype(np.float32)
    want_r = rejection_sample(x, q, p, u, s, validate=validate)
    got_r = rejection_sample(_be(x), _be(q), _be(p), _be(u), _be(s), validate=validate)
    assert np.array_equal(np.asarray(got_r.num_accepted), np.asarray(want_r.num_accepted))
    assert np.array_equal(np.asarray(got_r.tokens), np.asarray(want_r.tokens))
