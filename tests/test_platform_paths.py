"""The platform-specific paths of the kernels give the bits of the CPU path (issue 54).

Off CPU (TPU, GPU), ``rejection_sample`` reads ``p_i(x_i)`` and ``q_i(x_i)`` as
aligned windows (:func:`specjax.kernels.rejection._read_by_window`) where XLA:CPU
maps over rows (:func:`~specjax.kernels.rejection._read_by_row`). Both branches
are traced on every platform, so they are compared here, on the CPU, against a
plain ``take_along_axis``, bit for bit: subnormals (which a float sum would flush
on a TPU), NaN, -0, the last id, vocabularies shorter than or not a multiple of
the window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import rejection

SHAPES = [(3, 2, 40), (4, 3, 300), (2, 4, 1000), (2, 1, 128), (1, 1, 1)]


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_window_read_gives_the_bits_of_a_plain_gather(dtype, shape):
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
    got = jax.jit(rejection._read_by_window)(p, ids)
    assert got.dtype == p.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    assert float(got[0, 0]) == float(tiny) or dtype != "float32"  # the subnormal survived


@pytest.mark.parametrize("point_masses", [False, True])
def test_kernel_with_the_window_read_gives_the_same_tokens(point_masses, monkeypatch):
    """The whole kernel with the off-CPU read, on the CPU, against the CPU's read."""
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
    monkeypatch.setattr(rejection, "_read_at", rejection._read_by_window)
    got = jax.jit(lambda *a: rejection.rejection_body(*a))(x, q, p, u, s)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(np.asarray(want.num_accepted).max()) >= 1
