"""Tests of the acceptance kernel against its contract (issue #2): worked examples and edge cases.

Every sentence of the contract is pinned by a test: here the worked examples
verbatim (for every input type and dtype) and each edge case by name
(subnormal probabilities, which XLA:CPU flushes to zero in arithmetic, and
float64 uniforms that round to 1.0 in float32, among them). Random cases
against the float64 reference, property and chi-square tests are in
``test_rejection_random.py``; validation messages, compilation caching and
the memory footprint in ``test_rejection_validation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _straightforward import straightforward_rejection_sample
from reference import as_kernel_float, reference_rejection_sample
from rejection_helpers import (
    EDGE_B,
    EDGE_V,
    F32_BELOW_ONE,
    F32_TINY,
    compare_to_reference,
    f32,
    i32,
    run,
    valid_inputs,
)

from specjax import rejection_sample
from specjax.kernels import core

# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class Example:
    name: str
    draft_tokens: list
    draft_probs: list
    target_probs: list
    accept_uniforms: list
    sample_uniforms: list
    num_accepted: list
    tokens: list

    def inputs(self) -> tuple[list, list, list, list, list]:
        return (self.draft_tokens, self.draft_probs, self.target_probs, self.accept_uniforms, self.sample_uniforms)


EXAMPLES = [
    Example(
        name="ex1_correction",
        draft_tokens=[[3, 2]],
        draft_probs=[[[0.2, 0.59, 0.04, 0.17], [0.12, 0.43, 0.42, 0.03]]],
        target_probs=[[[0.04, 0.44, 0.24, 0.28], [0.27, 0.36, 0.23, 0.14], [0.19, 0.34, 0.07, 0.4]]],
        accept_uniforms=[[0.27, 0.79]],
        sample_uniforms=[0.92],
        num_accepted=[1],
        tokens=[[3, 3, -1]],
    ),
    Example(
        name="ex2_bonus_and_reject_first",
        draft_tokens=[[1, 0, 2], [2, 1, 1]],
        draft_probs=[
            [[0.38, 0.31, 0.2, 0.11], [0.16, 0.01, 0.55, 0.28], [0.26, 0.33, 0.06, 0.35]],
            [[0.01, 0.13, 0.49, 0.37], [0.26, 0.12, 0.37, 0.25], [0.05, 0.25, 0.67, 0.03]],
        ],
        target_probs=[
            [[0.3, 0.4, 0.05, 0.25], [0.63, 0.1, 0.2, 0.07], [0.16, 0.05, 0.46, 0.33], [0.14, 0.55, 0.18, 0.13]],
            [[0.11, 0.71, 0.08, 0.1], [0.21, 0.45, 0.01, 0.33], [0.07, 0.02, 0.49, 0.42], [0.22, 0.25, 0.28, 0.25]],
        ],
        accept_uniforms=[[0.83, 0.99, 0.77], [0.6, 0.08, 0.03]],
        sample_uniforms=[0.59, 0.73],
        num_accepted=[3, 0],
        tokens=[[1, 0, 2, 1], [1, -1, -1, -1]],
    ),
    Example(
        name="ex3_single_draft_rejected",
        draft_tokens=[[2]],
        draft_probs=[[[0.01, 0.25, 0.49, 0.01, 0.24]]],
        target_probs=[[[0.24, 0.31, 0.06, 0.05, 0.34], [0.04, 0.17, 0.1, 0.14, 0.55]]],
        accept_uniforms=[[0.66]],
        sample_uniforms=[0.38],
        num_accepted=[0],
        tokens=[[0, -1]],
    ),
]

NP_FLOAT = {"float16": np.float16, "bfloat16": jnp.bfloat16, "float32": np.float32, "float64": np.float64}
TORCH_FLOAT = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
NP_INT = {"int32": np.int32, "int64": np.int64}
TORCH_INT = {"int32": torch.int32, "int64": torch.int64}


def convert_inputs(ex: Example, kind: str, float_dtype: str, int_dtype: str) -> tuple:
    """The example's five inputs as ``kind`` (list/numpy/jax/torch) with the given dtypes.

    Probabilities and both uniform arguments get ``float_dtype``.
    """
    tokens, *floats = ex.inputs()
    if kind == "list":
        return (tokens, *floats)
    if kind == "numpy":
        return (np.asarray(tokens, NP_INT[int_dtype]), *(np.asarray(v, NP_FLOAT[float_dtype]) for v in floats))
    if kind == "jax":
        # Without jax_enable_x64, JAX stores float64/int64 as float32/int32.
        return (
            jnp.asarray(np.asarray(tokens, NP_INT[int_dtype])),
            *(jnp.asarray(np.asarray(v, NP_FLOAT[float_dtype])) for v in floats),
        )
    if kind == "torch":
        return (
            torch.tensor(tokens, dtype=TORCH_INT[int_dtype]),
            *(torch.tensor(v, dtype=TORCH_FLOAT[float_dtype]) for v in floats),
        )
    raise AssertionError(kind)


EXAMPLE_VARIANTS = [("list", "float64", "int64")] + [
    (kind, fd, idt)
    for kind in ("numpy", "jax", "torch")
    for fd in ("float16", "bfloat16", "float32", "float64")
    for idt in ("int32", "int64")
]


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: e.name)
def test_example_verbatim(ex: Example) -> None:
    """The contract's examples exactly as written (Python lists, default validate=True)."""
    out = rejection_sample(*ex.inputs())
    assert set(vars(out)) == {"num_accepted", "tokens"}
    b, g = len(ex.draft_tokens), len(ex.draft_tokens[0])
    assert out.num_accepted.dtype == jnp.int32 and out.num_accepted.shape == (b,)
    assert out.tokens.dtype == jnp.int32 and out.tokens.shape == (b, g + 1)
    assert np.asarray(out.num_accepted).tolist() == ex.num_accepted
    assert np.asarray(out.tokens).tolist() == ex.tokens


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: e.name)
def test_reference_reproduces_examples(ex: Example) -> None:
    """The independent reference agrees with the contract's examples (validates the reference)."""
    ref = reference_rejection_sample(*ex.inputs())
    assert ref.num_accepted.tolist() == ex.num_accepted
    assert ref.tokens.tolist() == ex.tokens


@pytest.mark.parametrize("kind,float_dtype,int_dtype", EXAMPLE_VARIANTS, ids=["-".join(v) for v in EXAMPLE_VARIANTS])
@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: e.name)
def test_example_every_input_type_and_dtype(ex: Example, kind: str, float_dtype: str, int_dtype: str) -> None:
    """Each example with lists, NumPy, JAX and torch inputs and every supported dtype.

    The examples' values survive rounding to float16/bfloat16 well enough to keep
    the answer: the reference on the rounded inputs is asserted to give the
    verbatim answer with a clear margin (so a change of example that breaks this
    is noticed), and the kernel must give it too.
    """
    args = convert_inputs(ex, kind, float_dtype, int_dtype)
    ref = reference_rejection_sample(*args)
    assert ref.num_accepted.tolist() == ex.num_accepted, "rounding changed n: test the reference instead"
    assert ref.tokens.tolist() == ex.tokens, "rounding changed y: test the reference instead"
    # No near ties on the rounded inputs: every test is far from its threshold and
    # s is far from every CDF boundary.
    assert np.all(ref.ratio_margin > 1e-3)
    s = as_kernel_float(args[4])
    for b, cdf in enumerate(ref.cdf):
        assert np.min(np.abs(cdf - s[b])) > 1e-3

    # Value checks only where their compiled summary is shared with test_example_verbatim
    # (float32); the other dtypes differ in the kernel, not in the checks.
    out = run(*args, validate=float_dtype in ("float32", "float64"))
    assert out.num_accepted.shape == (len(ex.num_accepted),)
    assert out.tokens.shape == (len(ex.tokens), len(ex.tokens[0]))
    assert out.num_accepted.tolist() == ex.num_accepted
    assert out.tokens.tolist() == ex.tokens


# --------------------------------------------------------------------------- edge cases

# The single-row edge cases below are zero-padded to V = 8 (extra zero-probability
# tokens at the end of the vocabulary change nothing in the contract: no test,
# residual or cumulative value moves) and repeated to B = 2 identical rows, so
# that they share compiled kernels with each other, the hypothesis tests and the
# validation table (EDGE_B, EDGE_V): compiling dominates these tests' run time.


def run_row(
    tokens: list, q: list, p: list, u: list, s: float, *, dtype: Any = np.float32, validate: bool = True
) -> tuple[int, list[int]]:
    """One row (x: [G], q: [G][V'], p: [G+1][V'], u: [G], s) through the public kernel.

    Returns ``(n, tokens)`` of the row, after checking both copies agree.
    """
    num_draft = len(tokens)
    p_arr = np.asarray(p, np.float64).reshape(num_draft + 1, -1)
    q_arr = np.asarray(q, np.float64).reshape(num_draft, p_arr.shape[1])
    pad = EDGE_V - p_arr.shape[1]
    assert pad >= 0
    p_arr = np.pad(p_arr, ((0, 0), (0, pad)))
    q_arr = np.pad(q_arr, ((0, 0), (0, pad)))
    rep = lambda a: np.repeat(np.asarray(a)[None], EDGE_B, axis=0)  # noqa: E731
    out = run(
        rep(np.asarray(tokens, np.int32).reshape(num_draft)),
        rep(q_arr.astype(dtype)),
        rep(p_arr.astype(dtype)),
        rep(np.asarray(u, np.float64).reshape(num_draft).astype(dtype)),
        np.full(EDGE_B, s, dtype),
        validate=validate,
    )
    assert np.array_equal(out.tokens[0], out.tokens[1])
    return int(out.num_accepted[0]), out.tokens[0].tolist()


def test_q_zero_with_p_positive_passes() -> None:
    # x = 1: q = 0, p = 0.25 > 0 passes, whatever u; the bonus comes from p_1 = [0, 0, 1].
    assert run_row([1], [[1.0, 0.0, 0.0]], [[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]], [F32_BELOW_ONE], 0.5) == (1, [1, 2])


def test_q_zero_with_p_zero_fails() -> None:
    """x = 1 has q = p = 0: the test fails, even with u = 0."""
    # p_0 == q_0, so the residual is empty and y is drawn from p_0: s = 0 -> token 0.
    assert run_row([1], [[0.25, 0.0, 0.75]], [[0.25, 0.0, 0.75], [1.0, 0.0, 0.0]], [0.0], 0.0) == (0, [0, -1])


def test_u_zero_with_p_zero_fails() -> None:
    """p_i(x_i) = 0 < q_i(x_i): the ratio is 0 and u = 0 < 0 is false."""
    # Residual max(p_0 - q_0, 0) = [0, 0, 0.5]: the only possible correction is 2.
    assert run_row(
        [0, 1], [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]], [[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], [0.0, 0.0], 0.0
    ) == (0, [2, -1, -1])


def test_u_zero_with_p_positive_passes() -> None:
    assert run_row([0], [[0.999, 0.001]], [[0.001, 0.999], [0.0, 1.0]], [0.0], 0.0) == (1, [0, 1])


@pytest.mark.parametrize("u,accepted", [(0.0, True), (0.4999, True), (0.5, False), (0.75, False)])
def test_acceptance_is_strict_inequality(u: float, accepted: bool) -> None:
    """u < p/q with p/q = 0.5 exactly: u = 0.5 fails."""
    n, tokens = run_row([0], [[0.5, 0.5]], [[0.25, 0.75], [1.0, 0.0]], [u], 0.0)
    assert (n, tokens) == ((1, [0, 0]) if accepted else (0, [1, -1]))


def test_tests_run_in_order_first_failure_stops() -> None:
    """n counts passes before the first failure: a later pass does not count."""
    q = [[0.5, 0.5]] * 3
    p = [[0.5, 0.5], [0.0, 1.0], [0.5, 0.5], [0.5, 0.5]]
    assert run_row([0, 0, 0], q, p, [0.1, 0.1, 0.1], 0.3) == (1, [0, 1, -1, -1])


@pytest.mark.parametrize("s,y", [(0.0, 0), (0.2499, 0), (0.25, 1), (0.4999, 1), (0.5, 2), (F32_BELOW_ONE, 2)])
def test_zero_sum_residual_unnormalized_draws_from_target(s: float, y: int) -> None:
    """q_n >= p_n everywhere (unnormalised q): the residual is empty, y is drawn from p_n."""
    q = [[0.5, 0.5, 0.5]]
    p = [[0.25, 0.25, 0.5], [0.0, 0.0, 1.0]]  # x = 0: ratio 0.5 < u = 0.9, rejected
    assert run_row([0], q, p, [0.9], s) == (0, [y, -1])


def test_zero_sum_residual_normalized_p_equals_q() -> None:
    """p_n == q_n and x_n outside the support (p = q = 0 there) fails: residual empty -> p_n."""
    dist = [0.0, 0.25, 0.75]
    assert run_row([0, 0], [[0.5, 0.5, 0.0], dist], [[0.5, 0.5, 0.0], dist, [1, 0, 0]], [0.3, 0.3], 0.2) == (
        1,
        [0, 1, -1],
    )


@pytest.mark.parametrize("s,y", [(0.0, 1), (0.2499, 1), (0.25, 3), (0.5, 3), (0.75, 5), (F32_BELOW_ONE, 5)])
def test_inverse_cdf_smallest_token_with_cdf_above_s(s: float, y: int) -> None:
    """y = smallest v with r(0)+…+r(v) > s (strict); zero-probability tokens never drawn."""
    p0 = [0.0, 0.25, 0.0, 0.5, 0.0, 0.25, 0.0]
    assert run_row([], [], [p0], [], s) == (0, [y])


@pytest.mark.parametrize("vocab", [1, 7, 128, 129, 50257])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_row_and_block_sums_equal_float64_sums(vocab: int, dtype: str) -> None:
    """row_sums pads to 128-blocks and sums them (a GEMV on CPU): any vocabulary, batch dims."""
    rng = np.random.default_rng(vocab)
    x = rng.random((3, 2, vocab)).astype(dtype)
    tol = 1e-6 if dtype == "float32" else 1e-12
    with jax.enable_x64(dtype == "float64"):
        rows = np.asarray(jax.jit(core.row_sums)(jnp.asarray(x)))
        blocks = np.asarray(jax.jit(core.block_sums)(jnp.asarray(x.reshape(3, 2 * vocab, 1))))
    assert rows.shape == (3, 2) and rows.dtype == np.dtype(dtype)
    np.testing.assert_allclose(rows, x.astype(np.float64).sum(-1), rtol=tol)
    np.testing.assert_allclose(blocks, x.reshape(3, 2 * vocab), rtol=tol)


@pytest.mark.parametrize("vocab", [300, pytest.param(50257, marks=pytest.mark.slow)])
def test_blocked_draw_equals_the_float64_inverse_cdf(vocab: int) -> None:
    """The blocked inverse CDF of the residual (the one draw every path runs) against float64.

    Rows include an empty residual (p = q, drawn from p). A row may differ only where
    s·Σr lies within float rounding of the cumulative value at the smaller of the two tokens.
    """
    rng = np.random.default_rng(vocab)
    b = 512 if vocab < 4096 else 128  # 128 rows of GPT-2's vocabulary: 100 MB of float64 per array
    p = rng.random((b, vocab)) ** 6
    p /= p.sum(1, keepdims=True)
    q = p * rng.uniform(0.5, 1.5, (b, vocab))
    q /= q.sum(1, keepdims=True)
    q[:8] = p[:8]  # empty residual: draw from p
    s = rng.random(b)
    s[-4:] = F32_BELOW_ONE
    p32, q32, s32 = (jnp.asarray(a, jnp.float32) for a in (p, q, s))
    got = jax.jit(lambda p, q, s: core.inverse_cdf(core.residual_weights(p, q), s))(p32, q32, s32)
    got = np.asarray(got)
    weights = np.maximum(np.asarray(p32, np.float64) - np.asarray(q32, np.float64), 0)
    weights[:8] = np.asarray(p32[:8], np.float64)
    cdf = np.cumsum(weights, axis=1) / weights.sum(1, keepdims=True)
    s64 = np.asarray(s32, np.float64)
    ref = np.minimum((cdf <= s64[:, None]).sum(1), vocab - 1)
    assert (weights[np.arange(b), got] > 0).all()
    differ = np.flatnonzero(got != ref)
    assert len(differ) <= 2, differ
    for row in differ:
        lo = min(got[row], ref[row])
        assert abs(cdf[row, lo] - s64[row]) < 1e-5, (row, got[row], ref[row])


def test_residual_draw_uses_max_of_difference() -> None:
    """r ∝ max(p - q, 0): tokens where q > p get nothing, the rest their excess."""
    q = [[0.5, 0.1, 0.1, 0.3]]
    p = [[0.1, 0.3, 0.5, 0.1], [1, 0, 0, 0]]  # x = 0 rejected (0.2 < u); r = [0, 0.2, 0.4, 0] / 0.6
    for s, y in [(0.0, 1), (0.33, 1), (0.34, 2), (F32_BELOW_ONE, 2)]:
        assert run_row([0], q, p, [0.5], s) == (0, [y, -1]), s


def test_g_zero_draws_from_p0() -> None:
    assert run_row([], [], [[0.1, 0.2, 0.3, 0.4]], [], 0.35) == (0, [2])


def test_g_zero_as_plain_python_lists() -> None:
    """Found in review: ``[[]]`` draft tokens (G = 0 as lists) became a float64 array in
    NumPy and were refused as "got float64"."""
    out = rejection_sample([[]], np.zeros((1, 0, 4)), [[[0.1, 0.2, 0.3, 0.4]]], [[]], [0.35])
    assert np.asarray(out.num_accepted).tolist() == [0]
    assert np.asarray(out.tokens).tolist() == [[2]]
    with pytest.raises(ValueError, match=r"draft_tokens: expected integer token ids .*got float64"):
        rejection_sample([[0.5]], [[[0.5, 0.5]]], [[[0.5, 0.5], [0.5, 0.5]]], [[0.1]], [0.35])


def test_all_accepted_emits_bonus_from_last_target() -> None:
    # Both tests pass (q = 0 at x with p > 0); y from p_2 = [0, 0, 1] regardless of p_0, p_1.
    assert run_row([0, 1], [[0, 1, 0], [1, 0, 0]], [[1, 0, 0], [0, 1, 0], [0, 0, 1]], [0.9, 0.9], 0.0) == (2, [0, 1, 2])


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("num_draft", [0, 3])
def test_b_zero_returns_empty(num_draft: int, validate: bool) -> None:
    vocab = 5
    out = run(
        np.zeros((0, num_draft), np.int32),
        np.zeros((0, num_draft, vocab), np.float32),
        np.zeros((0, num_draft + 1, vocab), np.float32),
        np.zeros((0, num_draft), np.float32),
        np.zeros((0,), np.float32),
        validate=validate,
    )
    assert out.num_accepted.shape == (0,)
    assert out.tokens.shape == (0, num_draft + 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_unnormalized_inputs_any_dtype(dtype: str) -> None:
    """Unnormalised weights (above 1 too) in every dtype: r is normalised by its own sum."""
    # ratio 2/8 = 0.25 < u = 0.5: rejected; residual [0, 6].
    assert run_row([0], [[8.0, 0.0]], [[2.0, 6.0], [4.0, 4.0]], [0.5], 0.0, dtype=NP_FLOAT[dtype], validate=False) == (
        0,
        [1, -1],
    )


def test_rounding_fallback_is_last_positive_token() -> None:
    """No cumulative value above s·total: y = the largest v with r(v) > 0, not a zero token or V.

    With float32 weights, whether rounding leaves the running sums below
    s·total depends on the kernel's summation order, so this test forces the
    situation exactly: dyadic weights (all sums exact) and s = 1.0 (past the
    valid range, hence validate=False), where no cumulative value exceeds
    s·total = total in any arithmetic. The last positive token sits in a later
    block of the vocabulary, followed by zeros, and is reached through a residual.
    """
    vocab = 1000
    w = np.zeros(vocab, np.float32)
    w[[3, 130, 300, 700]] = [0.25, 0.125, 0.5, 0.125]
    q = np.zeros(vocab, np.float32)
    q[5] = 1.0  # the draft token, p = 0 there: rejected; residual max(p - q, 0) = w
    args = (i32([[5]]), q[None, None], np.stack([w, w])[None], f32([[0.5]]), f32([1.0]))
    out = run(*args, validate=False)
    assert out.num_accepted.tolist() == [0]
    assert out.tokens.tolist() == [[700, -1]]
    assert reference_rejection_sample(*args).tokens.tolist() == [[700, -1]]
    # Negative control: the straightforward version has no fallback and emits V.
    wrong = straightforward_rejection_sample(*[jnp.asarray(a) for a in args])
    assert np.asarray(wrong.tokens).tolist() != [[700, -1]]


def test_rounding_near_one_never_emits_zero_probability_token() -> None:
    """Adversarial float32 rows, s = the largest float32 below 1: y stays in r's support.

    Rows hold a few large weights and many tiny ones (half an ulp of 1.0 and
    around it, so float32 running sums absorb them differently from the total),
    then zeros. The kernel's y must have r(y) > 0 and lie within float32
    rounding of the exact float64 draw; in many rows it is the largest v with
    r(v) > 0 (the rounding fallback or a tie next to it).
    """
    rng = np.random.default_rng(11)
    batch, vocab = 256, 256
    w = np.zeros((batch, vocab), np.float32)
    for b in range(batch):
        big = rng.choice(vocab, size=rng.integers(1, 4), replace=False)
        w[b, big] = rng.choice([1.0, 0.75, 1.5, 3.0], size=big.size)
        tiny = rng.choice(vocab, size=rng.integers(1, 200), replace=False)
        mag = rng.choice([2.0**-25, 2.0**-24, 3 * 2.0**-25, 2.0**-23])
        w[b, tiny] = np.where(w[b, tiny] > 0, w[b, tiny], mag)
        w[b, rng.integers(vocab // 2, vocab) :] = 0
        if not w[b].any():
            w[b, 0] = 1
    s = np.where(rng.random(batch) < 0.7, F32_BELOW_ONE, 1 - rng.choice([2, 3, 4, 8], size=batch) * 2.0**-24).astype(
        np.float32
    )
    args = (
        np.zeros((batch, 0), np.int32),
        np.zeros((batch, 0, vocab), np.float32),
        w[:, None],
        np.zeros((batch, 0), np.float32),
        s,
    )
    out = run(*args, validate=False)
    ref = reference_rejection_sample(*args)
    y = out.tokens[:, 0]
    assert np.all(w[np.arange(batch), y] > 0)
    c = compare_to_reference(args, out, ref)  # every difference is within rounding of s
    last = np.array([np.flatnonzero(row)[-1] for row in w])
    assert c.y_ties > 0 and np.sum(y == last) > 0  # the construction does reach the edge
    # Negative control: the straightforward version emits zero-probability tokens or V here.
    wrong = np.asarray(straightforward_rejection_sample(*[jnp.asarray(a) for a in args]).tokens[:, 0])
    outside = (wrong >= vocab) | (wrong < 0)
    assert np.any(outside | (w[np.arange(batch), np.minimum(wrong, vocab - 1)] == 0))


def test_subnormal_probabilities_are_positive_in_the_reference() -> None:
    """A subnormal float32 probability is positive in the contract: q(x) = 0, p(x) = 1e-40 passes."""
    tiny = np.float32(1e-40)
    assert 0 < tiny < F32_TINY
    ref = reference_rejection_sample(
        i32([[1]]), f32([[[1, 0]]]), f32([[[1, tiny], [0.5, 0.5]]]), f32([[0.5]]), f32([0.5])
    )
    assert ref.num_accepted.tolist() == [1]


def test_kernel_subnormal_target_probability_passes() -> None:
    """XLA:CPU flushes subnormals to zero; positivity is decided on the bits."""
    assert run_row([1], [[1, 0]], [[1, 1e-40], [0.5, 0.5]], [0.5], 0.5)[0] == 1


def test_kernel_subnormal_ratio_of_two_subnormals() -> None:
    """p = 3e-40, q = 1e-40: ratio 3 passes any u; p = 1e-40, q = 3e-40: ratio 1/3."""
    assert run_row([1], [[0.5, 1e-40]], [[0.5, 3e-40], [0.5, 0.5]], [0.9], 0.5)[0] == 1
    assert run_row([1], [[0.5, 3e-40]], [[0.5, 1e-40], [0.5, 0.5]], [0.3], 0.5)[0] == 1
    assert run_row([1], [[0.5, 3e-40]], [[0.5, 1e-40], [0.5, 0.5]], [0.34], 0.5)[0] == 0


def test_kernel_u_zero_with_subnormal_ratio_passes() -> None:
    """p = 1e-39 (subnormal), q = 0.5: p/q flushes to 0, but 0 < p/q in the contract."""
    assert run_row([1], [[0.5, 0.5]], [[1 - 1e-39, 1e-39], [0.5, 0.5]], [0.0], 0.5)[0] == 1
    assert run_row([1], [[0.5, 0.5]], [[1 - 1e-39, 1e-39], [0.5, 0.5]], [1e-30], 0.5)[0] == 0


def test_float64_uniform_just_below_one_with_p_equal_q_accepts() -> None:
    """float64 u = 1 - 1e-9 < 1 = p/q must pass although float32 would round u to 1.0."""
    dist = [[0.25, 0.25, 0.5, 0, 0, 0, 0, 0]] * 2
    out = run([[0]] * EDGE_B, [dist[:1]] * EDGE_B, [dist] * EDGE_B, [[1 - 1e-9]] * EDGE_B, [0.5] * EDGE_B)
    assert out.num_accepted.tolist() == [1] * EDGE_B


def test_float64_torch_uniforms_just_below_one_are_accepted_like_numpy() -> None:
    """Found in review: a torch float64 uniform 0.99999999 was narrowed to float32 (1.0)
    before the range check and refused, while the same NumPy value passed."""
    import torch

    inputs = valid_inputs()
    u = np.array(inputs["accept_uniforms"], np.float64)
    u[0, 0] = 1 - 1e-8
    s = np.array(inputs["sample_uniforms"], np.float64)
    s[1] = 1 - 1e-8
    args = (inputs["draft_tokens"], inputs["draft_probs"], inputs["target_probs"])
    from_numpy = rejection_sample(*args, u, s)
    from_torch = rejection_sample(*args, torch.from_numpy(u), torch.from_numpy(s))
    for key in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(from_torch, key)), np.asarray(getattr(from_numpy, key)))
    u[0, 0] = 1.0  # and 1.0 itself is still refused, for both
    with pytest.raises(ValueError, match="accept_uniforms: expected values in \\[0, 1\\)"):
        rejection_sample(*args, torch.from_numpy(u), torch.from_numpy(s))
