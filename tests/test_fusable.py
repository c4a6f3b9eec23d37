"""Every jitted entry point can be fused into a caller's own ``jax.jit`` (issue 54).

A jit that carries ``compiler_options`` cannot be nested in another jit (JAX
raises "can only be passed to top-level"); the entry points use
:func:`specjax.kernels.compile_options.vector_jit`, which leaves them out when
nested. Each entry point is called directly and inside ``jax.jit`` (with traced
arguments, and with closed-over constants, where JAX knows it is nested only by
its trace state) and the results must match: tokens and counts exactly, probabilities to float32
rounding (the nested program compiles with the caller's options).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from specjax.kernels import cpu_kernels, frontend, rejection, sharded, steps
from specjax.kernels.compile_options import vector_jit
from specjax.kernels.types import SamplingParams
from specjax.plugin.vllm import step as plugin_step

B, G, V = 3, 2, 40
IMPLS = ["xla"] + (["cpu"] if cpu_kernels.available() else [])


def _inputs(impl: str):
    rng = np.random.default_rng(54)
    tokens = jnp.asarray(rng.integers(0, V, (B, G)), jnp.int32)
    d = jnp.asarray(rng.normal(size=(B, G, V)) * 2, jnp.float32)
    t = jnp.asarray(rng.normal(size=(B, G + 1, V)) * 2, jnp.float32)
    f32 = jnp.asarray([0.0, 0.7, 1.0], jnp.float32)
    params = SamplingParams(
        f32, jnp.asarray([0, 5, 0], jnp.int32), jnp.asarray([0, 0.1, 0.2], jnp.float32), True, True, impl
    )
    probs_t = jax.nn.softmax(t, axis=-1)
    probs_d = jax.nn.softmax(d, axis=-1)
    u = jnp.asarray(rng.random((B, G)), jnp.float32)
    s = jnp.asarray(rng.random(B), jnp.float32)
    keys = jax.random.split(jax.random.key(0), B)
    return tokens, d, t, params, probs_t, probs_d, u, s, keys


def _calls(impl: str):
    """(name, function, args): each jitted entry point with arguments it takes."""
    tokens, d, t, params, probs_t, probs_d, u, s, keys = _inputs(impl)
    k = jnp.full((B,), G, jnp.int32)
    key = jax.random.key(1)
    layout = sharded.MeshLayout(Mesh(np.array(jax.devices()[:1]), ("x",)), batch_axis="x")
    summarise, finish, draw = plugin_step._point_mass_fns()
    key_words = jax.lax.bitcast_convert_type(jax.random.key_data(keys), jnp.int32)  # vLLM's int32 words
    flat_rows = t.reshape(-1, V)[: B * G]
    slots = jnp.arange(B * G, dtype=jnp.int32)
    temperature = params.temperature
    return [
        (
            "rejection._rejection_sample_jit",
            partial(rejection._rejection_sample_jit, impl=impl),
            (tokens, probs_d, probs_t, u, s),
        ),
        ("frontend._verify_jit", frontend._verify_jit, (tokens, d, t, key, params, k)),
        ("frontend._sample_jit", frontend._sample_jit, (t[:, 0], key, params)),
        ("steps.draft_draw", partial(steps.draft_draw, vocab=V), (t[:, 0], keys, 0, 1, params)),
        ("steps.verify_step", steps.verify_step, (tokens, tuple(d.transpose(1, 0, 2)), t, keys, 0, params, k)),
        ("steps.probs_step", steps.probs_step, (tuple(d.transpose(1, 0, 2)), t, keys, 0, params)),
        ("sharded._verify_mesh_jit", partial(sharded._verify_mesh_jit, layout=layout), (tokens, d, t, key, params, k)),
        (
            "sharded._rejection_sample_mesh_jit",
            partial(sharded._rejection_sample_mesh_jit, layout=layout),
            (tokens, probs_d, probs_t, u, s),
        ),
        (
            "plugin summarise",
            summarise,
            (
                jnp.zeros(B * G),
                jnp.zeros(B * G, jnp.int32),
                flat_rows,
                jnp.repeat(temperature, G),
                tokens.reshape(-1),
                slots,
            ),
        ),
        (
            "plugin finish",
            finish,
            (
                jnp.zeros(B * G),
                jnp.zeros(B * G, jnp.int32),
                flat_rows,
                jnp.repeat(temperature, G),
                tokens.reshape(-1),
                slots,
                tokens.reshape(-1),
                key_words,
                temperature,
                k,
                tokens[:, 0],
            ),
        ),
        ("plugin draw", draw, (t[:, 0], temperature, tokens[:, 0], s)),
        ("plugin target probs", plugin_step._target_probs_fn(), (t, key_words, temperature, k)),
    ]


def _assert_same(got, want, name):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(b.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_entry_point_runs_inside_a_users_jit_and_agrees(impl):
    for name, fn, args in _calls(impl):
        want = fn(*args)
        got = jax.jit(lambda *a, fn=fn: fn(*a))(*args)  # traced arguments
        _assert_same(got, want, name)
        got_const = jax.jit(lambda fn=fn, args=args: fn(*args))()  # nested, constants only
        _assert_same(got_const, want, name + " (constants)")


def test_vector_jit_passes_other_errors_through():
    @vector_jit
    def bad(x):
        raise ValueError("x: expected something else")

    with pytest.raises(ValueError, match="x: expected something else"):
        bad(jnp.ones(2))
    with pytest.raises(ValueError, match="x: expected something else"):
        jax.jit(bad)(jnp.ones(2))
