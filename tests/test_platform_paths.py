"""The platform-specific paths of the kernels give the bits of the CPU path (issue 54).

Off CPU (TPU, GPU) the kernels pick values and rows out of the (B, G, V) inputs
with :func:`specjax.kernels.core.take_masked` (a compare and an integer sum, no
gather) where XLA:CPU gathers. The off-CPU branch is compared here, on the CPU,
against a plain ``take_along_axis``, bit for bit: subnormals (which a float sum
would flush on a TPU), NaN, -0, the last id, short vocabularies; and whole
kernels with it against the CPU's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import core, frontend, rejection, tpu_pallas

SHAPES = [(3, 2, 40), (4, 3, 300), (2, 4, 1000), (2, 1, 128), (1, 1, 1)]


def _tpu_branch(*args, default, **platforms):
    """``lax.platform_dependent`` as a TPU lowers it: its ``tpu`` branch where it has one, else ``default``."""
    return platforms["tpu"](*args) if "tpu" in platforms else default(*args)


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


@pytest.mark.parametrize("v", [700, 768])  # 768: rows a multiple of 128 (a whole number of tiles)
@pytest.mark.parametrize("point_masses", [False, True])
def test_kernel_with_the_masked_take_gives_the_same_tokens(point_masses, v, monkeypatch):
    """The whole kernel with the off-CPU picks, on the CPU, against the CPU's gathers."""
    rng = np.random.default_rng(54)
    b, g = 13, 4
    p = rng.random((b, g + 1, v)) ** 4
    p = jnp.asarray(p / p.sum(-1, keepdims=True), jnp.float32)
    q = None if point_masses else jnp.asarray(jax.nn.softmax(jnp.log(p[:, :g]) + 0.3), jnp.float32)
    x = jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32).at[0, 1].set(v).at[1, 0].set(-1)  # outside [0, V)
    x = jnp.where(jnp.arange(g)[None, :] < 2, jnp.argmax(p[:, :g], -1), x)  # some tests pass
    u = jnp.asarray(rng.random((b, g)) * 0.02, jnp.float32)  # small: point-mass tests pass too
    s = jnp.asarray(rng.random(b), jnp.float32)
    want = jax.jit(rejection.rejection_body)(x, q, p, u, s)
    # Every off-CPU branch (the default: the masked picks, the block sums), traced on the CPU:
    monkeypatch.setattr(rejection.lax, "platform_dependent", _tpu_branch)
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


# --------------------------------------------------------------------------- #
# The TPU's top-k / top-p cutoff (core.cutoff_by_lanes), in Pallas' interpreter
# --------------------------------------------------------------------------- #

LANE_SHAPES = [(16, 1024), (3, 5, 2048), (2, 9, 1024), (1024,), (3, 1000)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", LANE_SHAPES, ids=str)
def test_lane_candidates_are_the_largest_of_each_lane(shape, dtype):
    """tpu_pallas.lane_candidates against a sort of each strided lane, with ties, -inf and a short lane."""
    rng = np.random.default_rng(sum(shape))
    x = rng.integers(-6, 6, shape).astype(np.float32)  # many ties
    x[..., 5::11] = -np.inf
    x.reshape(-1, shape[-1])[0] = -np.inf  # a row of -inf
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    got = np.asarray(jax.jit(lambda a: tpu_pallas.lane_candidates(a, 8, interpret=True))(jnp.asarray(x, dtype)))
    vocab = shape[-1]
    padded = -(-vocab // 128) * 128
    lanes = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - vocab)], constant_values=-np.inf)
    lanes = lanes.reshape(*shape[:-1], padded // 128, 128)
    want = -np.sort(-lanes, axis=-2)[..., :8, :]  # the 8 largest per lane, descending
    want = np.pad(want, [(0, 0)] * (want.ndim - 2) + [(0, 8 - want.shape[-2]), (0, 0)], constant_values=-np.inf)
    assert got.shape == (*shape[:-1], 8 * 128) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want.reshape(*shape[:-1], 8 * 128))


def _lane_case(name: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(scaled f32[R, V], top_k i32[R], 1 - top_p f32[R], whether the lane candidates decide every row)."""
    from _straightforward import tied_rows

    rows, vocab = 8, 4096
    scaled = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    top_k = np.full(rows, 50, np.int32)
    omp = np.full(rows, 0.1, np.float32)
    decided = True
    if name == "normal, mixed k and p":
        top_k = np.array([50, 1, 256, 0, 0, 4096, 10**6, 7], np.int32)  # k >= V, k > 256, k = 0
        omp = np.array([0.1, 0.5, 0.0, 0.05, 0.0, 0.1, 0.2, 0.999], np.float32)
    elif name == "ties at the k-th past the lanes":
        scaled, top_k, omp = tied_rows(vocab)
        decided = False  # 2000 copies of the k-th value: some lane holds more than 8
    elif name == "all equal":
        scaled[:] = 0.0
        decided = False
    elif name == "-inf entries and an all -inf row":
        scaled[:, 1::3] = -np.inf
        scaled[2] = -np.inf  # tau = -inf: the candidates are the row's
        scaled[5, 128:] = -np.inf  # 128 finite values: k = 50 decided
    elif name == "k-th below tau (one crowded lane)":
        scaled[:] = rng.uniform(-20, -10, (rows, vocab))
        scaled[:, ::128] = np.linspace(10, 0, vocab // 128)  # lane 0 holds the 32 largest
        top_k[:] = 20  # the 20th largest is in lane 0, 12 places below its 8th: undecided
        decided = False
    elif name == "k-th tied at tau (one lane of ties)":
        scaled[:] = -5.0
        scaled[:, 1:11] = np.log(100.0)  # ten large values, in lanes 1..10
        scaled[:, 0 : 300 * 128 : 128] = 0.0  # 300 copies of the k-th value, all in lane 0: 8 reach the lanes
        top_k[:] = 15  # the k-th is 0 = tau; the kept set's 300 zeros outweigh 1 - top_p, the lanes' 8 do not
        decided = False
    elif name == "top-p alone, nucleus beyond the candidates":
        top_k[:] = 0
        omp[:] = 0.01  # the nucleus spans the flat rest: the bisection, after candidates that decide
        scaled *= 0.1
        scaled[:, 3 : 3 + 300 * 13 : 13] += 2.0  # the 300 largest, at most 3 per lane: all above tau
    elif name == "NaN":
        scaled[3, 7] = np.nan
        decided = False
    finite = np.isfinite(scaled).any(1)
    scaled[finite] -= np.max(scaled[finite], 1, keepdims=True, where=np.isfinite(scaled[finite]), initial=-np.inf)
    return scaled.astype(np.float32), top_k, omp, decided


LANE_CASES = [
    "normal",
    "normal, mixed k and p",
    "ties at the k-th past the lanes",
    "all equal",
    "-inf entries and an all -inf row",
    "k-th below tau (one crowded lane)",
    "k-th tied at tau (one lane of ties)",
    "top-p alone, nucleus beyond the candidates",
    "NaN",
]


@pytest.mark.parametrize("name", LANE_CASES)
def test_tpu_cutoff_gives_the_cpu_cutoff(name):
    """core.cutoff_by_lanes (the TPU branch, Pallas interpreted) equals the CPU's cutoff on every row.

    Also checks which way the batch went (the lane candidates, or the fallback to
    ``lax.top_k``), so that each case tests the branch it is named for.
    """
    rng = np.random.default_rng(LANE_CASES.index(name))
    scaled, top_k, omp, decided = (jnp.asarray(a) for a in _lane_case(name, rng))
    want = jax.jit(core.cutoff)(scaled, top_k, omp)
    k = jnp.clip(top_k, 0, scaled.shape[-1])
    got = jax.jit(lambda s, k, o: core.cutoff_by_lanes(s, k, o, interpret=True))(scaled, k, omp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    _, rows_decided = jax.jit(lambda s, k, o: core.lane_candidates_decide(s, k, o, interpret=True))(scaled, k, omp)
    assert bool(jnp.all(rows_decided)) == decided, np.asarray(rows_decided)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verify_with_the_tpu_cutoff_gives_the_same_tokens(dtype, monkeypatch):
    """verify_core (impl="xla") with every TPU branch traced on the CPU, against the CPU's.

    The front end hands the cutoff its logits and the map to scaled logits
    (``source``), so the Pallas pass reads the logits themselves; T = 0.7,
    top-k 50 / top-p 0.9 and mixed rows (k = 0, p = 1, greedy).
    """
    from specjax.kernels.types import SamplingParams

    rng = np.random.default_rng(3)
    b, g, v = 6, 3, 2048
    t = jnp.asarray(rng.normal(size=(b, g + 1, v)) * 3, dtype)
    d = jnp.asarray(np.asarray(t, np.float32)[:, :g] + rng.normal(size=(b, g, v)), dtype)
    x = jnp.argmax(d.astype(jnp.float32) + jnp.asarray(rng.gumbel(size=(b, g, v)), jnp.float32), -1).astype(jnp.int32)
    temperature = jnp.asarray([0.7, 0.7, 0.7, 1.0, 0.0, 0.7], jnp.float32)
    top_k = jnp.asarray([50, 50, 0, 50, 50, 3000], jnp.int32)
    omp = jnp.asarray([0.1, 0.0, 0.1, 0.1, 0.1, 0.1], jnp.float32)
    params = SamplingParams(temperature, top_k, omp, True, True, "xla")
    u = jnp.asarray(rng.random((b, g)), jnp.float32)
    s = jnp.asarray(rng.random(b), jnp.float32)
    k = jnp.full((b,), g, jnp.int32)
    want = jax.jit(frontend.verify_core)(x, d, t, u, s, params, k)

    seen = []

    def choose(*args, default, **platforms):
        seen.append(sorted(platforms))
        return _tpu_branch(*args, default=default, **platforms)

    monkeypatch.setattr(core.lax, "platform_dependent", choose)
    monkeypatch.setattr(core, "cutoff_by_lanes", partial(core.cutoff_by_lanes, interpret=True))
    got = jax.jit(lambda *a: frontend.verify_core(*a))(x, d, t, u, s, params, k)
    assert ["tpu"] in seen  # the cutoff took its TPU branch
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert 0 < int(np.asarray(want.num_accepted).sum()) < b * g


GREEDY_CASES = ["draft-logits", "point-masses", "mixed-point-mass-rows", "top-k-top-p", "nan-rows", "ragged", "g0"]


@pytest.mark.parametrize("static", [False, True], ids=["at-run-time", "static"])
@pytest.mark.parametrize("case", GREEDY_CASES)
def test_an_all_greedy_batch_off_cpu_gives_the_cpu_tokens(case, static, monkeypatch):
    """Off CPU an all-greedy batch takes one argmax over the target's rows (verify_core's
    ``greedy_batch``); traced on the CPU, it gives the CPU path's counts and tokens. Known all greedy
    (``SamplingParams.all_greedy``, static) the off-CPU step has no branch at all."""
    from specjax.kernels.types import SamplingParams

    rng = np.random.default_rng(GREEDY_CASES.index(case))
    b, g, v = 8, 0 if case == "g0" else 4, 640
    t = jnp.asarray(rng.normal(size=(b, g + 1, v)) * 3, jnp.float32)
    d = jnp.asarray(np.asarray(t)[:, :g] + rng.normal(size=(b, g, v)), jnp.float32)
    # half the draft tokens are the target's argmax, so rows accept 0 .. g tokens
    am = np.argmax(np.asarray(t)[:, :g], -1)
    x = np.where(rng.random((b, g)) < 0.7, am, rng.integers(0, v, (b, g)))
    x = jnp.asarray(x, jnp.int32)
    filtered = case == "top-k-top-p"
    params = SamplingParams(
        jnp.zeros((b,), jnp.float32),
        jnp.full((b,), 5, jnp.int32) if filtered else None,
        jnp.full((b,), 0.1, jnp.float32) if filtered else None,
        filtered,
        filtered,
        "xla",
        static,
    )
    if case == "nan-rows":
        d = d.at[0].set(jnp.nan).at[1, 0, 7].set(jnp.nan)
        t = t.at[2, 1].set(jnp.nan).at[3, :, 9].set(jnp.inf)
    k = jnp.asarray(rng.integers(0, g + 1, b) if case == "ragged" else np.full(b, g), jnp.int32)
    u = jnp.asarray(rng.random((b, g)), jnp.float32)
    s = jnp.asarray(rng.random(b), jnp.float32)
    draft = None if case == "point-masses" else d
    pm = jnp.asarray(rng.random(b) < 0.5) if case == "mixed-point-mass-rows" else None

    def verify(*a):
        return frontend.verify_core(*a, point_mass_rows=pm)

    want = jax.jit(verify)(x, draft, t, u, s, params, k)
    monkeypatch.setattr(core.lax, "platform_dependent", _tpu_branch)
    monkeypatch.setattr(core, "cutoff_by_lanes", partial(core.cutoff_by_lanes, interpret=True))
    got = jax.jit(lambda *a: verify(*a))(x, draft, t, u, s, params, k)  # a new function: traced again
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    if g:
        assert 0 < int(np.asarray(want.num_accepted).sum()) < int(np.asarray(k).sum())
    branches = str(jax.make_jaxpr(lambda *a: verify(*a))(x, draft, t, u, s, params, k)).count("cond[")
    assert (branches == 0) == static, branches


@pytest.mark.parametrize("case", ["plain", "nan-rows", "short-draft-vocab"])
def test_a_known_all_greedy_draft_draw_off_cpu_is_the_draws_argmax(case, monkeypatch):
    """steps.draft_draw with ``all_greedy`` (static) takes the argmax alone off the CPU: the tokens the
    statistics' branch draws, NaN rows and a draft vocabulary padded to the target's included."""
    from specjax.kernels import steps
    from specjax.kernels.types import SamplingParams

    rng = np.random.default_rng(len(case))
    b, v = 6, 300
    logits = rng.normal(size=(b, 200 if case == "short-draft-vocab" else v)).astype(np.float32) * 3
    logits[1, 17] = logits[1].max()  # a tie: the first maximum
    if case == "nan-rows":
        logits[2, 5] = np.nan
        logits[3] = -np.inf
    keys = jax.random.split(jax.random.key(0), b)

    def draw(static):
        params = SamplingParams(jnp.zeros((b,), jnp.float32), all_greedy=static)
        return jax.jit(lambda lg: steps.draft_draw(lg, keys, jnp.int32(3), 1, params, vocab=v))(jnp.asarray(logits))

    want = np.asarray(draw(False))
    monkeypatch.setattr(core.lax, "platform_dependent", _tpu_branch)
    got = jax.jit(
        lambda lg: steps.draft_draw(
            lg, keys, jnp.int32(3), 1, SamplingParams(jnp.zeros((b,)), all_greedy=True), vocab=v
        )
    )(jnp.asarray(logits))
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(want[:2], np.nanargmax(np.where(np.isnan(logits[:2]), -np.inf, logits[:2]), -1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_read_argmax_keeps_the_rule(dtype, monkeypatch):
    """core.first_argmax's TPU form (a max and jnp.argmax of one read) gives vocab_argmax(x, vocab_max(x)) bit
    for bit: ties (the first index), -0 beside +0, +inf, rows all -inf, NaN anywhere (V - 1), one entry."""
    rng = np.random.default_rng(7)
    v = 300
    x = np.round(rng.normal(size=(12, v)) * 2) / 2  # many ties
    x[1, [4, 9]] = x[1].max() + 1  # a tie at the max: index 4
    x[2, :] = -0.0
    x[2, 17] = 0.0  # ±0 tie: index 0 (-0 == +0)
    x[3, [30, 40]] = np.inf
    x[4, :] = -np.inf
    x[5, 0] = np.nan
    x[6, v - 1] = np.nan
    x[7, [50, 60]] = [np.inf, np.nan]
    x[8, :] = np.nan
    xs = jnp.asarray(x, dtype)
    want = jax.jit(lambda x: core.vocab_argmax(x, core.vocab_max(x)))(xs)
    plain = jax.jit(core.first_argmax)(xs)  # the CPU lowers the two passes
    monkeypatch.setattr(core.lax, "platform_dependent", _tpu_branch)
    got = jax.jit(lambda x: core.first_argmax(x))(xs)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(want)[[1, 2, 3, 4, 5, 6, 7, 8]].tolist() == [4, 0, 30, 0, v - 1, v - 1, v - 1, v - 1]
    one = jnp.asarray([[2.5]], dtype)
    assert int(jax.jit(lambda x: core.first_argmax(x))(one)[0]) == 0
