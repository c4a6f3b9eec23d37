"""The platform-specific paths of the kernels give the bits of the CPU path (issue 54).

Off CPU (TPU, GPU) the kernels pick values and rows out of the (B, G, V) inputs
with :func:`specjax.kernels.core.take_masked` (a compare and an integer sum, no
gather) where XLA:CPU gathers. The off-CPU branch is compared here, on the CPU,
against a plain ``take_along_axis``, bit for bit: subnormals (which a float sum
would flush on a TPU), NaN, -0, the last id, short vocabularies; and whole
kernels with it against the CPU's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import core, frontend, rejection

SHAPES = [(3, 2, 40), (4, 3, 300), (2, 4, 1000), (2, 1, 128), (1, 1, 1)]


def _bits(a) -> np.ndarray:
    # contiguous first: an array fetched from a TPU can come back with a strided last axis
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_masked_take_gives_the_bits_of_a_plain_gather(dtype, shape):
    b, g, v = shape
    rng = np.random.default_rng(sum(shape))
    p = jnp.asarray(rng.random((b, g + 1, v)), dtype)
    tiny = jnp.finfo(dtype).smallest_subnormal
    p = p.at[0, 0, :].set(tiny)  # every entry of row 0 subnormal
    ids = jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32).at[0, 0].set(v - 1)
    if b > 1:
        special = 5 % v
        p = p.at[1, 0, special].set(jnp.nan).at[1, g - 1, :].set(-0.0)
        ids = ids.at[1, 0].set(special)
    want = jnp.take_along_axis(p[:, :g], ids[..., None], axis=-1)[..., 0]
    got = jax.jit(lambda p, i: core.take_masked(p[:, :g], i, 2))(p, ids)
    assert got.dtype == p.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    rows = jnp.asarray(rng.integers(0, g + 1, (b,)), jnp.int32)
    want_rows = jnp.take_along_axis(p, rows[:, None, None], axis=1)[:, 0]
    got_rows = core.take_masked(p, rows[:, None], 1)
    np.testing.assert_array_equal(_bits(got_rows), _bits(want_rows))
    assert float(got[0, 0]) == float(tiny) or dtype != "float32"  # the subnormal survived


@pytest.mark.parametrize("point_masses", [False, True])
def test_kernel_with_the_masked_take_gives_the_same_tokens(point_masses, monkeypatch):
    """The whole kernel with the off-CPU picks, on the CPU, against the CPU's gathers."""
    rng = np.random.default_rng(54)
    b, g, v = 16, 4, 700
    p = rng.random((b, g + 1, v)) ** 4
    p = jnp.asarray(p / p.sum(-1, keepdims=True), jnp.float32)
    q = None if point_masses else jnp.asarray(jax.nn.softmax(jnp.log(p[:, :g]) + 0.3), jnp.float32)
    x = jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32).at[0, 1].set(v).at[1, 0].set(-1)  # outside [0, V)
    x = jnp.where(jnp.arange(g)[None, :] < 2, jnp.argmax(p[:, :g], -1), x)  # some tests pass
    u = jnp.asarray(rng.random((b, g)) * 0.02, jnp.float32)  # small: point-mass tests pass too
    s = jnp.asarray(rng.random(b), jnp.float32)
    want = jax.jit(rejection.rejection_body)(x, q, p, u, s)
    # Every off-CPU branch (the TPU's picks and block sums), traced on the CPU:
    monkeypatch.setattr(rejection.lax, "platform_dependent", lambda *a, cpu, default: default(*a))
    got = jax.jit(lambda *a: rejection.rejection_body(*a, impl="xla"))(x, q, p, u, s)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(np.asarray(want.num_accepted).max()) >= 1


@pytest.mark.parametrize("mode", ["T=1", "T=0.7 top-k top-p", "point masses"])
def test_verify_with_the_masked_take_gives_the_same_tokens(mode, monkeypatch):
    """verify_core (the JAX path, impl="xla") with the off-CPU picks, against the CPU's gathers."""
    from specjax.kernels.types import SamplingParams

    rng = np.random.default_rng(7)
    b, g, v = 8, 3, 500
    t = jnp.asarray(rng.normal(size=(b, g + 1, v)) * 2, jnp.float32)
    d = None if mode == "point masses" else jnp.asarray(t[:, :g] + rng.normal(size=(b, g, v)) * 0.5, jnp.float32)
    x = jnp.argmax(t[:, :g] + jnp.asarray(rng.gumbel(size=(b, g, v)), jnp.float32), -1).astype(jnp.int32)
    ones = jnp.ones((b,), jnp.float32)
    filtered = mode == "T=0.7 top-k top-p"
    params = SamplingParams(
        ones * (0.7 if filtered else 1.0), jnp.full((b,), 20, jnp.int32), ones * 0.1, filtered, filtered, "xla"
    )
    u = jnp.asarray(rng.random((b, g)) * (0.02 if d is None else 1), jnp.float32)  # point masses pass < p(x)
    s = jnp.asarray(rng.random(b), jnp.float32)
    k = jnp.full((b,), g, jnp.int32)
    want = jax.jit(frontend.verify_core)(x, d, t, u, s, params, k)
    monkeypatch.setattr(frontend, "take", core.take_masked)
    monkeypatch.setattr(core, "take", core.take_masked)
    got = jax.jit(lambda *a: frontend.verify_core(*a))(x, d, t, u, s, params, k)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert 0 < int(np.asarray(want.num_accepted).sum()) < b * g  # tests both pass and fail


@pytest.mark.parametrize("point_masses", [False, True])
@pytest.mark.parametrize("filtered", [False, True])
def test_greedy_verify_on_the_jax_path_is_the_greedy_rule(point_masses, filtered):
    """impl="xla", every row greedy (no draw): the accepted prefix of argmax matches, then argmax.

    The rule of :mod:`specjax.kernels.greedy`, against the JAX path whatever it
    skips (the draw is replaced by the statistics' argmax when every row is greedy).
    """
    from specjax.kernels.greedy import accept_greedy
    from specjax.kernels.types import SamplingParams

    rng = np.random.default_rng(11)
    b, g, v = 12, 4, 300
    t = rng.normal(size=(b, g + 1, v)).astype(np.float32)
    d = None if point_masses else (t[:, :g] + rng.normal(size=(b, g, v))).astype(np.float32)
    best = t.argmax(-1)
    # Some rows follow the target's argmax for a while, so n varies.
    x = np.where(rng.random((b, g)) < 0.6, best[:, :g], rng.integers(0, v, (b, g))).astype(np.int32)
    k = rng.integers(0, g + 1, b).astype(np.int32)
    zeros = jnp.zeros((b,), jnp.float32)
    params = SamplingParams(zeros, jnp.full((b,), 5, jnp.int32), zeros + 0.1, filtered, filtered, "xla")
    u = jnp.asarray(rng.random((b, g)), jnp.float32)
    s = jnp.asarray(rng.random(b), jnp.float32)
    got = jax.jit(frontend.verify_core)(
        jnp.asarray(x), None if d is None else jnp.asarray(d), jnp.asarray(t), u, s, params, jnp.asarray(k)
    )
    n, tokens = accept_greedy(x, best, k)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), n)
    np.testing.assert_array_equal(np.asarray(got.tokens), tokens)
    assert 0 < n.sum() and (n < k).any()
