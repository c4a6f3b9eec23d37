"""The C++ CPU kernels (specjax.kernels.cpu_kernels) against the JAX code they replace on CPU.

* maxima, argmaxes and kept sets are bit-equal; normalisers agree to float rounding;
* the draw gives the JAX draw's token except where the two differ only by
  rounding at a CDF boundary (checked against a float64 reference);
* rows split over the intra-op pool give the same results as one at a time;
* the public functions give the same tokens either way, including tiny
  temperatures, greedy and mixed rows, top-k/top-p and ragged drafts;
* a failed build or ``SPECJAX_CPU_KERNELS=0`` falls back to the JAX code
  (fresh processes);
* ``impl`` chooses per call, with no process-wide switch: both in one process,
  checked at the boundary, never resolved (or built) while tracing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.kernels import cpu_kernels
from specjax.kernels import frontend as F
from specjax.kernels.core import inverse_cdf, residual_weights
from specjax.kernels.types import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no CPU kernels: {cpu_kernels.build_error()}")


def logits(shape, seed, scale=3.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal(shape)).astype(dtype)


def stats_both_ways(x, temperature, top_k=None, top_p=None):
    """RowStats of ``x`` with the kernels, then with the JAX code (both as NumPy)."""
    t = jnp.asarray(temperature, jnp.float32)
    k = None if top_k is None else jnp.asarray(top_k, jnp.int32)
    p = None if top_p is None else 1 - jnp.asarray(top_p, jnp.float32)

    def run(impl):
        return [np.asarray(f) for f in jax.jit(partial(F.row_stats, impl=impl))(jnp.asarray(x), t, k, p)]

    return F.RowStats(*run("cpu")), F.RowStats(*run("xla"))


@pytest.mark.parametrize("vocab", [1, 5, 16, 127, 128, 129, 1000, 4099])
@pytest.mark.parametrize("filtered", [False, True])
def test_row_stats_equal_the_jax_code(vocab, filtered):
    x = logits((6, vocab), seed=vocab)
    if vocab > 1:
        x[1, vocab // 2] = -np.inf  # masked tokens (a row of only -inf is invalid input)
    x[2, :] = x[2, 0]  # all tied: the first index is the argmax
    temperature = np.array([1.0, 0.7, 1.3, 0.0, 2.0, 0.5], np.float32)
    top_k = np.array([0, 3, 1, 2, 50, 7]) if filtered else None
    top_p = np.array([1.0, 0.9, 0.5, 1.0, 0.8, 0.95]) if filtered else None
    ours, ref = stats_both_ways(x, temperature, top_k, top_p)
    np.testing.assert_array_equal(ours.max, ref.max)
    np.testing.assert_array_equal(ours.cutoff, ref.cutoff)
    greedy = temperature == 0
    np.testing.assert_array_equal(ours.argmax[greedy], ref.argmax[greedy])
    assert ours.argmax[2] == 0
    np.testing.assert_allclose(ours.normaliser[~greedy], ref.normaliser[~greedy], rtol=2e-6)


def test_row_stats_argmax_and_max_for_every_row():
    """Greedy rows everywhere: the argmax of every row, at every position of the max."""
    x = logits((64, 3000), seed=1)
    where = np.random.default_rng(2).integers(0, 3000, 64)
    x[np.arange(64), where] = 100.0
    x[5, where[5] + 1 :] = 100.0  # ties after the first: still the first
    ours, ref = stats_both_ways(x, np.zeros(64, np.float32))
    np.testing.assert_array_equal(ours.argmax, where)
    np.testing.assert_array_equal(ours.argmax, ref.argmax)
    np.testing.assert_array_equal(ours.max, ref.max)


def test_rows_split_over_threads_equal_rows_one_at_a_time():
    """80 rows of 49152 entries are split over the intra-op pool; each row's result
    must not depend on that (one row per call never splits)."""
    x = jnp.asarray(logits((80, 49152), seed=3))
    scale = jnp.asarray(np.linspace(0.5, 2.0, 80, dtype=np.float32))
    cut = jnp.full((80,), -jnp.inf, jnp.float32)
    whole = [np.asarray(a) for a in jax.jit(cpu_kernels.row_stats)(x, scale, cut)]
    one = jax.jit(cpu_kernels.row_stats)
    for r in range(0, 80, 7):
        single = [np.asarray(a) for a in one(x[r : r + 1], scale[r : r + 1], cut[r : r + 1])]
        for w, s in zip(whole, single, strict=True):
            assert w[r] == s[0]


def _draw_inputs(batch, vocab, seed):
    rng = np.random.default_rng(seed)
    t = logits((batch, 2, vocab), seed)
    d = (t[:, :1] + rng.standard_normal((batch, 1, vocab))).astype(np.float32)
    temperature = rng.choice(np.array([0.6, 1.0, 1.7], np.float32), batch)
    n = rng.integers(0, 2, batch).astype(np.int32)  # 0: a rejected draft token (residual); 1: bonus (p)
    s = rng.random(batch).astype(np.float32)
    return t, d, temperature, n, s


def _draw(t, d, temperature, n, s, impl="cpu"):
    """One draw per row with F._draw_from_logits, the statistics from ``impl``'s row_stats."""

    @jax.jit
    def run(t, d, temperature, n, s):
        ts = F.row_stats(t, temperature[:, None], impl=impl)
        ds = F.row_stats(d, temperature[:, None], impl=impl)
        t_sel = F._take_rows(ts, n)
        d_sel = F._take_rows(ds, jnp.zeros_like(n))
        return F._draw_from_logits(t, d, t_sel, d_sel, n, jnp.ones_like(n), s, jnp.zeros(d.shape[:2], jnp.int32))

    return np.asarray(run(t, d, temperature, n, s))


def _float64_draw(t, d, temperature, n, s):
    """The draw in float64 (NumPy), and whether ``s`` lies within 1e-5 of a CDF step."""

    def probs(x, c):
        z = (x - x.max()) / c
        e = np.exp(z)
        return e / e.sum()

    out, near = [], []
    for b in range(len(s)):
        p = probs(t[b, n[b]].astype(np.float64), temperature[b])
        w = p if n[b] == 1 else np.maximum(p - probs(d[b, 0].astype(np.float64), temperature[b]), 0)
        cdf = np.cumsum(w) / w.sum()
        y = int(np.searchsorted(cdf, s[b], side="right"))
        out.append(y)
        near.append(bool(np.min(np.abs(cdf - s[b])) < 1e-5))
    return np.array(out), np.array(near)


def test_draw_equals_the_jax_draw_and_a_float64_reference():
    t, d, temperature, n, s = _draw_inputs(256, 700, seed=4)
    ours = _draw(t, d, temperature, n, s)
    with_jax = _draw(t, d, temperature, n, s, impl="xla")
    ref, near = _float64_draw(t, d, temperature, n, s)
    assert np.all(ours[~near] == ref[~near])
    assert np.all(with_jax[~near] == ref[~near])
    assert near.sum() <= 3, near.sum()
    # Both kinds of row were drawn (residual and bonus).
    assert 0 < n.sum() < len(n)


def test_draw_falls_back_to_p_when_the_residual_is_zero():
    """q == p: max(p - q, 0) is all zero, so the token is drawn from p (core.residual_weights)."""
    t, _, temperature, _, s = _draw_inputs(64, 300, seed=5)
    d = t[:, :1].copy()
    n = np.zeros(64, np.int32)
    ours = _draw(t, d, temperature, n, s)
    p_rows = np.stack([t[:, 0], t[:, 0]], axis=1)  # the reference's bonus row is p_0: a draw from p
    ref, near = _float64_draw(p_rows, d, temperature, np.ones(64, np.int32), s)
    assert np.all(ours[~near] == ref[~near])
    # The JAX definition agrees: the residual weights of equal rows are p.
    p = jnp.asarray(np.full((1, 4), 0.25, np.float32))
    np.testing.assert_array_equal(np.asarray(residual_weights(p, p)), np.asarray(p))


def test_jax_draw_still_draws_by_inverse_cdf():
    """The JAX draw that GPUs and meshes run, called directly here (no kernels)."""
    p = jnp.asarray(np.array([[0.0, 0.25, 0.75]], np.float32))
    q = jnp.zeros_like(p)
    y = inverse_cdf(residual_weights(p, q), jnp.asarray([0.5], jnp.float32))
    assert int(y[0]) == 2


TINY = [1e-4, 1e-6, 1e-7, 1e-20, 1e-45]


@pytest.mark.parametrize("impl", ["cpu", "xla"])
@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_give_normalised_distributions(impl, temperature):
    """(x - max)·(1/T), never x·(1/T) - max·(1/T): with a small T the two products
    round far apart and exp of their difference was not normalised (row sums of
    0.4 to 2000 at T = 1e-7, NaN and token -1 at T = 1e-20)."""
    x = logits((4, 32000), seed=6, scale=3.0) + 15.0
    for kwargs in ({}, {"top_k": 50, "top_p": 0.9}):
        # validate=False: T = 1e-45 is below the faithful range (a ValueError with validation); the
        # kernel's arithmetic must still give normalised rows
        tokens, probs = specjax.sample_from_logits(
            x, key=jax.random.key(0), temperature=temperature, validate=False, impl=impl, **kwargs
        )
        probs = np.asarray(probs)
        np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.isfinite(probs)) and np.all(probs >= 0)
        if temperature <= 1e-6:  # the gaps between these logits make the distribution one-hot
            np.testing.assert_array_equal(np.asarray(tokens), x.argmax(-1))
    g = 3
    draft = x[:, None, :].repeat(g, 1)
    target = np.concatenate([draft, x[:, None, :]], axis=1)
    out = specjax.verify_from_logits(
        np.tile(x.argmax(-1)[:, None], (1, g)).astype(np.int32),
        draft,
        target,
        key=jax.random.key(1),
        temperature=temperature,
        validate=False,
        impl=impl,
    )
    np.testing.assert_array_equal(np.asarray(out.num_accepted), g)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, g], x.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_public_functions_give_the_same_tokens_either_way(seed):
    rng = np.random.default_rng(seed)
    b, g, v = 48, 4, 2000
    target = logits((b, g + 1, v), seed)
    draft = (target[:, :g] + 0.7 * rng.standard_normal((b, g, v))).astype(np.float32)
    x = np.argmax(draft + rng.gumbel(size=draft.shape), -1).astype(np.int32)
    temperature = rng.choice(np.array([0.0, 0.7, 1.0], np.float32), b)
    kb = rng.integers(0, g + 1, b).astype(np.int32)
    key = jax.random.split(jax.random.key(seed), b)
    results = []
    for impl in ("cpu", "xla"):
        plain = specjax.verify_from_logits(
            x, draft, target, key=key, temperature=temperature, draft_lengths=kb, impl=impl
        )
        filtered = specjax.verify_from_logits(
            x, draft, target, key=key, temperature=temperature, draft_lengths=kb, top_k=40, top_p=0.9, impl=impl
        )
        sampled = specjax.sample_from_logits(target[:, 0], key=key, temperature=temperature, top_k=40, impl=impl)
        results.append(
            [
                np.asarray(a)
                for a in (plain.num_accepted, plain.tokens, filtered.num_accepted, filtered.tokens, sampled[0])
            ]
        )
    for ours, ref in zip(*results, strict=True):
        # Rounding can move a draw at a CDF boundary: at most one row in 48 per output.
        assert np.sum(np.any((ours != ref).reshape(b, -1), axis=1)) <= 1
    assert np.any(results[0][0] > 0) and np.any(results[0][0] < kb)  # accepts and rejects both happen


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
        check=False,
    )


PROBE = """
    import warnings, numpy as np, jax, specjax
    from specjax.kernels import cpu_kernels
    x = np.random.default_rng(0).standard_normal((2, 50)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, probs = specjax.sample_from_logits(x, key=jax.random.key(0), temperature=0.0)
    print(cpu_kernels.available(), list(np.asarray(tokens)) == list(x.argmax(-1)),
          sum("C++ CPU kernels" in str(w.message) for w in caught), cpu_kernels.build_error())
"""


def test_a_failed_build_falls_back_to_the_jax_code_with_a_warning(tmp_path):
    proc = _run(
        PROBE, CXX=str(tmp_path / "no-such-compiler"), PATH=str(tmp_path), SPECJAX_CACHE_DIR=str(tmp_path / "cache")
    )
    assert proc.returncode == 0, proc.stderr
    available, correct, warned, reason = proc.stdout.split(" ", 3)
    assert (available, correct, warned) == ("False", "True", "1")
    assert "no C++ compiler" in reason


def test_the_environment_variable_turns_the_kernels_off_silently():
    proc = _run(PROBE, SPECJAX_CPU_KERNELS="0")
    assert proc.returncode == 0, proc.stderr
    available, correct, warned, reason = proc.stdout.split(" ", 3)
    assert (available, correct, warned) == ("False", "True", "0")
    assert "SPECJAX_CPU_KERNELS" in reason


@pytest.mark.slow
def test_a_fresh_build_is_cached(tmp_path):
    proc = _run(PROBE, SPECJAX_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True True 0")
    libs = list(tmp_path.glob("cpu-kernels/*/libspecjax_cpu.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    assert _run(PROBE, SPECJAX_CACHE_DIR=str(tmp_path)).stdout.startswith("True True 0")
    assert libs[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_impl_is_checked_at_the_boundary_and_never_resolved_while_tracing():
    x = logits((2, 10), seed=0)
    for bad in ("gpu", "", None, 1):
        with pytest.raises(ValueError, match=f"impl: expected one of 'auto', 'xla', 'cpu', got {bad!r}"):
            specjax.sample_from_logits(x, key=jax.random.key(0), temperature=1.0, impl=bad)
    # Kernels take a resolved choice: "auto" inside a trace is an error, not a build.
    with pytest.raises(ValueError, match="impl: a kernel takes 'xla' or 'cpu'"):
        jax.jit(partial(F.row_stats, impl="auto"))(jnp.asarray(x), jnp.ones(2, jnp.float32))


def test_both_implementations_live_in_one_process_without_clearing_caches():
    """impl is static: each choice compiles its own function, and switching back
    reuses the first one (no retrace, no jax.clear_caches)."""
    x = logits((3, 500), seed=1)
    key = jax.random.key(0)
    size = F._sample_jit._cache_size()
    first = np.asarray(specjax.sample_from_logits(x, key=key, temperature=0.8, impl="cpu")[1])
    second = np.asarray(specjax.sample_from_logits(x, key=key, temperature=0.8, impl="xla")[1])
    again = np.asarray(specjax.sample_from_logits(x, key=key, temperature=0.8, impl="cpu")[1])
    assert F._sample_jit._cache_size() <= size + 2
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first, second, rtol=2e-6, atol=1e-9)
    assert not np.array_equal(first, np.zeros_like(first))


CPU_WITHOUT_KERNELS = """
    import numpy as np, jax, specjax
    x = np.zeros((1, 8), np.float32)
    try:
        specjax.sample_from_logits(x, key=jax.random.key(0), temperature=1.0, impl="cpu")
    except ValueError as e:
        print("ValueError:", e)
    print(np.asarray(specjax.sample_from_logits(x, key=jax.random.key(0), temperature=0.0)[0]).tolist())
"""


def test_impl_cpu_where_the_kernels_are_off_is_a_clear_error():
    proc = _run(CPU_WITHOUT_KERNELS, SPECJAX_CPU_KERNELS="0")
    assert proc.returncode == 0, proc.stderr
    error, tokens = proc.stdout.strip().splitlines()
    assert error.startswith("ValueError: impl: 'cpu' asks for the C++ CPU kernels")
    assert "SPECJAX_CPU_KERNELS" in error
    assert tokens == "[0]"  # "auto" (the default) runs the JAX code there


def test_the_build_targets_a_portable_level_unless_native_is_asked_for(monkeypatch):
    monkeypatch.delenv("SPECJAX_CPU_NATIVE", raising=False)
    flags = cpu_kernels.target_flags()
    assert "-march=native" not in flags
    import platform

    if platform.machine().lower() in ("x86_64", "amd64"):
        assert flags[0] in ("-march=x86-64", "-march=x86-64-v2", "-march=x86-64-v3", "-march=x86-64-v4")
    monkeypatch.setenv("SPECJAX_CPU_NATIVE", "1")
    assert cpu_kernels.target_flags() == ("-march=native",)


def test_several_cpu_devices_keep_the_jax_code():
    """With a CPU device mesh possible, single-device results must equal mesh results
    exactly, and the mesh paths run the JAX code: the kernels stay off."""
    probe = PROBE.replace("import warnings", "import os, warnings")
    proc = _run(probe, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert proc.returncode == 0, proc.stderr
    available, correct, warned, reason = proc.stdout.split(" ", 3)
    assert (available, correct, warned) == ("False", "True", "0")
    assert "4 CPU devices" in reason


def test_probability_kernel_same_acceptance_and_draws_but_at_ties():
    """rejection_sample with the C++ draw and with the JAX draw: the acceptance is the
    same code (n bit-equal); the drawn token differs at most where s sits within
    rounding of a CDF step (float64 reference)."""
    rng = np.random.default_rng(8)
    b, g, v = 256, 3, 1500
    q = rng.dirichlet(np.full(v, 0.3), size=(b, g)).astype(np.float32)
    p = rng.dirichlet(np.full(v, 0.3), size=(b, g + 1)).astype(np.float32)
    p[:, :g] = 0.7 * q + 0.3 * p[:, :g]
    gumbel = -np.log(-np.log(rng.random((b, g, v))))
    x = np.argmax(np.log(q.astype(np.float64) + 1e-30) + gumbel, axis=-1).astype(np.int32)  # x ~ q
    u = rng.random((b, g)).astype(np.float32)
    s = rng.random(b).astype(np.float32)
    ours = specjax.rejection_sample(x, q, p, u, s, impl="cpu")
    ref = specjax.rejection_sample(x, q, p, u, s, impl="xla")
    n = np.asarray(ours.num_accepted)
    np.testing.assert_array_equal(n, np.asarray(ref.num_accepted))
    y, y_ref = np.asarray(ours.tokens)[np.arange(b), n], np.asarray(ref.tokens)[np.arange(b), n]
    for i in np.nonzero(y != y_ref)[0]:
        w = p[i, n[i]].astype(np.float64) - (q[i, n[i]].astype(np.float64) if n[i] < g else 0)
        cdf = np.cumsum(np.maximum(w, 0))
        cdf /= cdf[-1]
        assert np.min(np.abs(cdf[min(y[i], y_ref[i]) : max(y[i], y_ref[i])] - s[i])) < 1e-5, i
    assert np.sum(y != y_ref) <= 3
    assert 0 < n.mean() < g  # accepts and rejects both happen


def _reference_step(x, draft, target, u, s, temperature, k):
    """The acceptance step in float64 NumPy, row by row: ``(n, y, margin)``.

    ``margin`` is, per row, how far the deciding quantity lay from a rounding
    boundary: ``|u - p/q|`` at the position that ended the row, and the distance
    of ``s`` to the drawn token's CDF step.
    """
    b = x.shape[0]
    n, y, margin = np.zeros(b, int), np.zeros(b, int), np.full(b, np.inf)

    def dist(row, t):
        if t == 0:
            return np.eye(row.size)[np.argmax(row)]
        e = np.exp((row.astype(np.float64) - row.max()) / t)
        return e / e.sum()

    for r in range(b):
        t, i = float(temperature[r]), 0
        while i < k[r]:
            p, q = dist(target[r, i], t)[x[r, i]], dist(draft[r, i], t)[x[r, i]]
            ratio = p / q if q > 0 else (np.inf if p > 0 else 0.0)
            margin[r] = min(margin[r], abs(u[r, i] - ratio))
            if not u[r, i] < ratio:
                break
            i += 1
        p_row = dist(target[r, i], t)
        w = np.maximum(p_row - dist(draft[r, i], t), 0) if i < k[r] else p_row
        if w.sum() <= 0:
            w = p_row
        cdf = np.cumsum(w) / w.sum()
        n[r], y[r] = i, int(np.argmax(cdf > s[r]))
        if t > 0:
            margin[r] = min(margin[r], np.min(np.abs(cdf - s[r])))
    return n, y, margin


@pytest.mark.parametrize(("g", "v"), [(0, 7), (1, 5), (3, 129), (4, 1000)])
def test_fused_step_equals_a_float64_reference_and_the_jax_code(g, v):
    """cpu_kernels.verify (the whole step, reading positions only until a test fails)
    against a float64 reference and against the JAX code, with greedy and sampled rows,
    ragged drafts (k_b = 0 … G) and draft tokens x ~ q: n and the emitted token agree
    except where the deciding quantity lies within float32 rounding of a boundary."""
    rng = np.random.default_rng(100 + 10 * g + v)
    b = 96
    target = logits((b, g + 1, v), g, scale=2.0)
    draft = (target[:, :g] + rng.standard_normal((b, g, v))).astype(np.float32)
    temperature = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), b)
    scaled = draft / np.where(temperature > 0, temperature, 1)[:, None, None]
    x = np.argmax(scaled + rng.gumbel(size=draft.shape) * (temperature > 0)[:, None, None], -1).astype(np.int32)
    k = rng.integers(0, g + 1, b).astype(np.int32)
    u = rng.random((b, g)).astype(np.float32)
    s = rng.random(b).astype(np.float32)

    @partial(jax.jit, static_argnames=("impl",))
    def step(x, draft, target, u, s, temperature, k, impl):
        return F.verify_core(x, draft, target, u, s, SamplingParams(temperature, impl=impl), k)

    def run(impl):
        out = step(x, draft, target, u, s, temperature, k, impl=impl)
        n = np.asarray(out.num_accepted)
        return n, np.asarray(out.tokens)[np.arange(b), n]

    n, y = run("cpu")
    n_jax, y_jax = run("xla")
    n_ref, y_ref, margin = _reference_step(x, draft, target, u, s, temperature, k)
    for other_n, other_y in ((n_ref, y_ref), (n_jax, y_jax)):
        differ = (n != other_n) | (y != other_y)
        assert np.all(margin[differ] < 1e-5), np.nonzero(differ)[0]
        assert differ.sum() <= 2
    assert np.all((n >= 0) & (n <= k))
    if g:
        assert np.any(n == k) and np.any(n < k)  # bonus draws and corrections both happen
    assert np.any(temperature == 0) and np.any(temperature > 0)


@pytest.mark.slow
@pytest.mark.parametrize("filtered", [False, True])
def test_out_of_range_ids_are_never_accepted_on_either_path(filtered):
    """With validate=False nothing checks the ids: an id outside [0, V) has probability 0
    on every path (the kernel reads nothing outside the row), so the row stops there."""
    b, g, v = 16, 3, 50
    target = logits((b, g + 1, v), 1)
    draft = logits((b, g, v), 2)
    x = np.tile(np.array([[v + 3, -2, v - 1], [-2, v + 3, v - 1]], np.int32), (b // 2, 1))
    r = np.arange(b)  # every mix of: the id pattern (r % 2), greedy or not, p = q or not
    temperature = np.where((r // 2) % 2, 1.0, 0.0).astype(np.float32)
    draft = np.where(((r // 4) % 2 == 0)[:, None, None], target[:, :g], draft)  # p = q: only the id can fail
    key = jax.random.split(jax.random.key(3), b)
    results = []
    for impl in ("cpu", "xla"):
        out = specjax.verify_from_logits(
            x,
            draft,
            target,
            key=key,
            temperature=temperature,
            validate=False,
            top_k=10 if filtered else None,
            impl=impl,
        )
        results.append((np.asarray(out.num_accepted), np.asarray(out.tokens)))
    np.testing.assert_array_equal(results[0][0], 0)
    np.testing.assert_array_equal(results[1][0], 0)
    # The correction token: where p = q the residual is 0/0 and only its rounding
    # is left (the JAX code's exp can differ in the last bits between the two rows),
    # so compare where p and q differ; greedy rows emit the argmax either way.
    defined = ((r // 4) % 2 == 1) | (temperature == 0)
    np.testing.assert_array_equal(results[0][1][defined], results[1][1][defined])
    assert np.all((results[0][1][:, 0] >= 0) & (results[0][1][:, 0] < v))


@pytest.mark.parametrize("top_k", [None, 30])
def test_the_draft_draw_and_the_acceptance_test_see_the_same_q_bit_for_bit(top_k):
    """A token's probability from sample_from_logits (cpu_kernels.probs, vectorised) and
    inside the acceptance step (cpu_kernels.verify, one token) are the same float32 bits:
    with u = p(x) / q(x) computed from the sampler's probabilities the test fails
    (``u < ratio`` is false), with the next float below it, it passes."""
    rng = np.random.default_rng(5)
    b, v, t = 64, 3000, 0.7
    target = logits((b, 2, v), 11, scale=2.0)
    draft = (target[:, :1] + 0.5 * rng.standard_normal((b, 1, v))).astype(np.float32)
    key = jax.random.key(0)
    x, q = specjax.sample_from_logits(draft[:, 0], key=key, temperature=t, top_k=top_k, impl="cpu")
    _, p = specjax.sample_from_logits(target[:, 0], key=key, temperature=t, top_k=top_k, impl="cpu")
    x = np.asarray(x)
    rows = np.arange(b)
    px, qx = np.asarray(p)[rows, x], np.asarray(q)[rows, x]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (px / qx).astype(np.float32)
    tiny = np.finfo(np.float32).tiny
    use = (ratio < 1) & (px > tiny) & (qx > tiny)
    assert use.sum() >= b // 4
    temperature = np.full(b, t, np.float32)
    k_row = None if top_k is None else np.full(b, top_k, np.int32)

    @jax.jit
    def num_accepted(x, draft, target, u, temperature, k_row):  # arguments, not constants XLA would fold
        out = F.verify_core(
            x[:, None],
            draft,
            target,
            u[:, None],
            jnp.zeros(b, jnp.float32),
            SamplingParams(temperature, k_row, use_top_k=k_row is not None, impl="cpu"),
            jnp.ones(b, jnp.int32),
        )
        return out.num_accepted

    u_at = np.where(use, ratio, 0.5).astype(np.float32)
    u_below = np.nextafter(u_at, np.float32(0))
    for u, expected in ((u_at, 0), (u_below, 1)):
        n = np.asarray(num_accepted(x, draft, target, u, temperature, k_row))
        np.testing.assert_array_equal(n[use], expected)


@pytest.mark.slow
def test_draft_lengths_outside_0_g_mean_their_clamped_value_on_every_path():
    """With validate=False, k_b > G acts as G and k_b < 0 as 0, with and without the kernels."""
    b, g, v = 12, 3, 40
    target = logits((b, g + 1, v), 4)
    draft = np.ascontiguousarray(target[:, :g])  # p = q: every test passes
    x = np.argmax(draft, -1).astype(np.int32)
    key = jax.random.split(jax.random.key(5), b)
    temperature = np.where(np.arange(b) % 3 == 0, 0.0, 1.0).astype(np.float32)
    wild = np.array([g + 2, -1, g, 0] * (b // 4), np.int32)
    clamped = np.clip(wild, 0, g)
    results = []
    for impl in ("cpu", "xla"):
        for k in (wild, clamped):
            out = specjax.verify_from_logits(
                x, draft, target, key=key, temperature=temperature, draft_lengths=k, validate=False, impl=impl
            )
            results.append(np.asarray(out.tokens))
    for tokens in results[1:]:
        np.testing.assert_array_equal(tokens, results[0])
    np.testing.assert_array_equal(np.sum(results[0] >= 0, axis=1), clamped + 1)
