"""The ``numpy`` and ``torch`` samplers against the contract and against the JAX kernel (issue #6).

The three built-in samplers must give identical results on the same inputs. A
float64 (numpy) and a float32 (jax, torch) implementation can legitimately
differ where a uniform sits within rounding of a boundary, so exact agreement is
tested on inputs whose arithmetic is exact in float32: probabilities and
uniforms that are multiples of 2^-10 (2^-7 for bfloat16) with row sums at most
1. Then every sum, product and comparison is exact in all three (``u < p/q``
with ``p, q, u`` such multiples is decided identically: a ratio below 1 differs
from a multiple of 2^-10 by at least 2^-20, far above float32's relative
rounding of 2^-24), and exact ties (``u = p/q``, ``s`` on a cumulative boundary)
occur often, which exercises the strict comparisons. On generic float32 inputs
the test counts disagreements and requires each one to be such a tie.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from golden import CASES, Case
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_rejection_sample

from specjax.boundary.api import rejection_sample
from specjax.kernels import cpu_kernels
from specjax.plugin.reference_samplers import numpy_rejection_sample, torch_rejection_sample
from specjax.slots import to_host as _host

SAMPLERS = {"numpy": numpy_rejection_sample, "torch": torch_rejection_sample, "jax": rejection_sample}
# Every implementation of the JAX kernel on this machine: the JAX code and, where
# they build, the C++ CPU kernels (the golden table runs each).
IMPLS = ["xla"] + (["cpu"] if cpu_kernels.available() else [])


def run(name: str, *args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    out = SAMPLERS[name](*args, **kwargs)
    n, tokens = _host(out.num_accepted), _host(out.tokens)
    assert n.dtype == np.int32 and tokens.dtype == np.int32
    return n, tokens


def f32(x: Any) -> np.ndarray:
    return np.asarray(x, np.float32)


def i32(x: Any) -> np.ndarray:
    return np.asarray(x, np.int32)


# --------------------------------------------------------------------------- the contract, by example (tests/golden.py)


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_contract_examples(sampler: str, case: Case) -> None:
    n, tokens = run(sampler, i32(case.x), f32(case.q), f32(case.p), f32(case.u), f32(case.s))
    assert n.tolist() == case.n
    assert tokens.tolist() == case.tokens


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_contract_examples_on_every_kernel_implementation(impl: str, case: Case) -> None:
    n, tokens = run("jax", i32(case.x), f32(case.q), f32(case.p), f32(case.u), f32(case.s), impl=impl)
    assert n.tolist() == case.n
    assert tokens.tolist() == case.tokens


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_contract_examples_in_the_float64_reference(case: Case) -> None:
    ref = reference_rejection_sample(i32(case.x), f32(case.q), f32(case.p), f32(case.u), f32(case.s))
    assert ref.num_accepted.tolist() == case.n
    assert ref.tokens.tolist() == case.tokens


# --------------------------------------------------------------------------- exact agreement of the three


def dyadic_inputs(rng: np.random.Generator, b: int, g: int, v: int, unit: int = 1024) -> tuple[np.ndarray, ...]:
    """Random inputs whose probabilities and uniforms are multiples of 1/unit (rows sum to 1)."""

    def dists(count: int) -> np.ndarray:
        if count == 0:
            return np.zeros((0, v))
        alpha = rng.choice([0.05, 0.3, 2.0])
        w = rng.dirichlet(np.full(v, alpha), size=count)
        return np.stack([rng.multinomial(unit, wi) for wi in w]) / unit

    q = dists(b * g).reshape(b, g, v)
    p = dists(b * (g + 1)).reshape(b, g + 1, v)
    share = rng.random()  # make the target agree with the draft in part, so runs of acceptances happen
    mask = rng.random((b, g)) < share
    p[:, :g][mask] = q[mask]
    x = np.zeros((b, g), np.int64)
    for i in range(b):
        for j in range(g):
            # mostly drawn from q; sometimes arbitrary (q(x) = 0 cases)
            x[i, j] = rng.choice(v, p=q[i, j]) if rng.random() < 0.9 else rng.integers(v)
    u = rng.integers(0, unit, (b, g)) / unit
    s = rng.integers(0, unit, (b,)) / unit
    return x, q, p, u, s


SHAPES = [(1, 1, 8), (3, 4, 50), (2, 0, 7), (5, 3, 200), (4, 2, 257), (0, 2, 5), (6, 1, 2), (2, 6, 128)]


def assert_all_agree(x: Any, q: Any, p: Any, u: Any, s: Any) -> np.ndarray:
    results = {name: run(name, x, q, p, u, s) for name in SAMPLERS}
    ref_n, ref_tokens = results["numpy"]
    for name, (n, tokens) in results.items():
        np.testing.assert_array_equal(n, ref_n, err_msg=name)
        np.testing.assert_array_equal(tokens, ref_tokens, err_msg=name)
    return ref_n


@pytest.mark.slow
def test_three_samplers_agree_on_exact_inputs() -> None:
    rng = np.random.default_rng(1234)
    full = partial = 0
    for b, g, v in SHAPES:
        for _ in range(6):
            x, q, p, u, s = dyadic_inputs(rng, b, g, v)
            n = assert_all_agree(
                x.astype(np.int32),
                q.astype(np.float32),
                p.astype(np.float32),
                u.astype(np.float32),
                s.astype(np.float32),
            )
            if g:
                full += int(np.sum(n == g))
                partial += int(np.sum(n < g))
    assert full > 10 and partial > 10  # both rejections and full acceptance (bonus draws) happen


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES))
def test_three_samplers_agree_property(seed: int, shape: tuple[int, int, int]) -> None:
    x, q, p, u, s = dyadic_inputs(np.random.default_rng(seed), *shape)
    assert_all_agree(
        x.astype(np.int32), q.astype(np.float32), p.astype(np.float32), u.astype(np.float32), s.astype(np.float32)
    )


@pytest.mark.parametrize(("dtype", "unit"), [(torch.float16, 1024), (torch.bfloat16, 128), (torch.float64, 1024)])
def test_low_and_high_precision_inputs(dtype: torch.dtype, unit: int) -> None:
    """float16/bfloat16 are widened to float32 (torch and jax); float64 stays float64 in torch and numpy."""
    rng = np.random.default_rng(7)
    for b, g, v in [(3, 3, 40), (2, 2, 150)]:
        x, q, p, u, s = dyadic_inputs(rng, b, g, v, unit=unit)
        qt, pt = torch.tensor(q, dtype=dtype), torch.tensor(p, dtype=dtype)
        assert torch.equal(qt.double(), torch.tensor(q)) and torch.equal(pt.double(), torch.tensor(p))  # exact
        ut, st_ = torch.tensor(u, dtype=torch.float32), torch.tensor(s, dtype=torch.float32)
        xt = torch.tensor(x)
        results = {name: run(name, xt, qt, pt, ut, st_) for name in SAMPLERS}
        for name in ("torch", "jax"):
            for got, want in zip(results[name], results["numpy"], strict=True):
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {dtype}")


def test_generic_float32_inputs_differ_only_at_ties() -> None:
    """Softmax probabilities: torch and jax test ``u < p/q`` with the same float32 division, so ``n``
    agrees exactly; the draws (sequential vs blocked cumulative sums) and numpy's float64 may differ
    only where ``s`` or ``u`` is within rounding of a boundary."""
    rng = np.random.default_rng(99)
    b, g, v = 600, 3, 300
    q_logits = rng.normal(0, 2, (b, g, v))
    p_logits = np.concatenate([q_logits + rng.normal(0, 0.7, (b, g, v)), rng.normal(0, 2, (b, 1, v))], axis=1)
    q = torch.softmax(torch.tensor(q_logits, dtype=torch.float32), -1)
    p = torch.softmax(torch.tensor(p_logits, dtype=torch.float32), -1)
    x = torch.multinomial(q.reshape(-1, v), 1, generator=torch.Generator().manual_seed(0)).reshape(b, g)
    u = torch.rand((b, g), generator=torch.Generator().manual_seed(1))
    s = torch.rand((b,), generator=torch.Generator().manual_seed(2))
    out = {name: run(name, x, q, p, u, s) for name in SAMPLERS}
    np.testing.assert_array_equal(out["torch"][0], out["jax"][0])
    assert 0 < out["jax"][0].mean() < g  # some rejections, some acceptances

    p64, q64, u64, s64 = p.double().numpy(), q.double().numpy(), u.double().numpy(), s.double().numpy()
    x64 = x.numpy()
    ties = 0
    for name in ("torch", "numpy"):
        n_other, tok_other = out[name]
        n_jax, tok_jax = out["jax"]
        for row in np.flatnonzero((n_other != n_jax) | (tok_other != tok_jax).any(axis=1)):
            ties += 1
            k = min(n_other[row], n_jax[row])
            if n_other[row] != n_jax[row]:  # the test at position k was a near tie
                ratio = p64[row, k, x64[row, k]] / q64[row, k, x64[row, k]]
                assert abs(u64[row, k] - ratio) < 1e-6 * max(1.0, ratio), (name, row)
                continue
            w = np.maximum(p64[row, k] - q64[row, k], 0) if k < g else p64[row, g]
            cdf = np.cumsum(w) / w.sum()
            lo, hi = sorted((tok_other[row, k], tok_jax[row, k]))
            assert np.all(np.abs(cdf[lo:hi] - s64[row]) < 1e-5), (name, row)
    assert ties <= 3  # ties are rare: about one draw in 10^5 or fewer


# --------------------------------------------------------------------------- input kinds and return types


def _small() -> tuple[list, ...]:
    return ([[1, 1]], [[[0.5, 0.5], [0.25, 0.75]]], [[[0.25, 0.75], [1.0, 0.0], [0.5, 0.5]]], [[0.3, 0.9]], [0.4])


def test_torch_sampler_accepts_every_input_kind() -> None:
    x, q, p, u, s = _small()
    kinds = {
        "lists": (x, q, p, u, s),
        "numpy": (i32(x), f32(q), f32(p), f32(u), f32(s)),
        "numpy int64": (np.asarray(x, np.int64), f32(q), f32(p), f32(u), f32(s)),
        "torch": (torch.tensor(x), torch.tensor(q), torch.tensor(p), torch.tensor(u), torch.tensor(s)),
        "jax": (jnp.asarray(x, jnp.int32), jnp.asarray(q), jnp.asarray(p), jnp.asarray(u), jnp.asarray(s)),
        "jax bfloat16": (
            jnp.asarray(x, jnp.int32),
            jnp.asarray(q, jnp.bfloat16),
            jnp.asarray(p, jnp.bfloat16),
            jnp.asarray(u),
            jnp.asarray(s),
        ),
    }
    expected = run("numpy", *kinds["numpy"])
    assert expected[0].tolist() == [1] and expected[1].tolist() == [[1, 0, -1]]
    for kind, args in kinds.items():
        out = torch_rejection_sample(*args)
        assert isinstance(out.tokens, torch.Tensor) and out.tokens.dtype == torch.int32, kind
        assert isinstance(out.num_accepted, torch.Tensor) and out.num_accepted.dtype == torch.int32, kind
        assert out.tokens.tolist() == expected[1].tolist(), kind
        assert out.num_accepted.tolist() == expected[0].tolist(), kind


class _ForeignDeviceArray:
    """An array on a device torch cannot import by DLPack (as JAX's TPU arrays): only a host copy works."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __dlpack_device__(self) -> tuple[int, int]:
        return (4, 0)  # kDLOpenCL: not a device torch.from_dlpack takes

    def __dlpack__(self, *args: object, **kwargs: object) -> object:
        raise BufferError("__dlpack__ device only supported for CPU and GPU")

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return self.data if dtype is None else self.data.astype(dtype)


def test_torch_sampler_copies_arrays_torch_cannot_import_through_the_host() -> None:
    x, q, p, u, s = _small()
    expected = run("numpy", i32(x), f32(q), f32(p), f32(u), f32(s))
    args = [_ForeignDeviceArray(a) for a in (i32(x), f32(q), f32(p), f32(u), f32(s))]
    out = torch_rejection_sample(*args)
    assert out.tokens.tolist() == expected[1].tolist()
    assert out.num_accepted.tolist() == expected[0].tolist()


def test_numpy_sampler_accepts_torch_and_jax() -> None:
    x, q, p, u, s = _small()
    for args in (
        (torch.tensor(x), torch.tensor(q, dtype=torch.bfloat16), torch.tensor(p), torch.tensor(u), torch.tensor(s)),
        (jnp.asarray(x), jnp.asarray(q), jnp.asarray(p), jnp.asarray(u), jnp.asarray(s)),
    ):
        out = numpy_rejection_sample(*args)
        assert isinstance(out.tokens, np.ndarray) and out.tokens.dtype == np.int32
        assert out.tokens.tolist() == [[1, 0, -1]]


def test_loop_host_conversion_of_every_result_type() -> None:
    """``slots.to_host``, which the generation loop reads samplers' outputs with, turns each into NumPy int32."""
    x, q, p, u, s = _small()
    for name in SAMPLERS:
        out = SAMPLERS[name](*(np.asarray(a) for a in (x, q, p, u, s)))
        tokens = _host(out.tokens)
        assert isinstance(tokens, np.ndarray) and tokens.dtype == np.int32, name
        assert tokens.tolist() == [[1, 0, -1]], name
    assert _host(jnp.asarray([[3, -1]], jnp.int32)).tolist() == [[3, -1]]
    assert _host(torch.tensor([[3, -1]], dtype=torch.int32)).dtype == np.int32


@pytest.mark.slow  # a fresh interpreter importing torch
def test_torch_sampler_never_imports_jax() -> None:
    code = """
import sys
sys.modules["jax"] = None  # any `import jax` now raises ImportError
sys.modules["jaxlib"] = None
import torch
from specjax.plugin.reference_samplers import torch_rejection_sample
out = torch_rejection_sample([[1]], [[[0.5, 0.5]]], [[[0.5, 0.5], [1.0, 0.0]]], [[0.1]], [0.3])
assert out.tokens.tolist() == [[1, 0]] and out.tokens.dtype == torch.int32
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


# --------------------------------------------------------------------------- validation


def valid() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x, q, p, u, s = dyadic_inputs(rng, 2, 3, 4)
    return {
        "x": x.astype(np.int32),
        "q": q.astype(np.float32),
        "p": p.astype(np.float32),
        "u": u.astype(np.float32),
        "s": s.astype(np.float32),
    }


def _with(**changes: Any) -> dict[str, Any]:
    args = valid()
    args.update(changes)
    return args


STRUCTURE_ERRORS = [
    (
        dict(q=np.zeros((2, 4, 4), np.float32)),
        r"^draft_probs: expected shape \(B, G, V\) = \(2, 3, 4\), got \(2, 4, 4\)$",
    ),
    (
        dict(p=np.zeros((2, 4), np.float32)),
        r"^target_probs: expected rank 3 with shape \(B, G\+1, V\), got shape \(2, 4\)$",
    ),
    (
        dict(p=np.zeros((2, 3, 4), np.float32)),
        r"^target_probs: expected shape \(B, G\+1, V\) = \(2, 4, 4\), got \(2, 3, 4\)$",
    ),
    (dict(u=np.zeros((2, 2), np.float32)), r"^accept_uniforms: expected shape \(B, G\) = \(2, 3\), got \(2, 2\)$"),
    (dict(s=np.zeros((3,), np.float32)), r"^sample_uniforms: expected shape \(B\) = \(2,\), got \(3,\)$"),
    (
        dict(x=np.zeros((2, 3), np.float32)),
        r"^draft_tokens: expected integer token ids \(int32 or int64\), got float32$",
    ),
    (dict(q=np.zeros((2, 3, 4), np.int32)), r"^draft_probs: expected a floating dtype .* got int32$"),
]
VALUE_ERRORS = [
    (
        dict(x=np.full((2, 3), 4, np.int32)),
        r"^draft_tokens: expected token ids in \[0, V\) = \[0, 4\), got values in \[4, 4\]$",
    ),
    (
        dict(q=np.full((2, 3, 4), -0.25, np.float32)),
        r"^draft_probs: expected non-negative probabilities, got 24 negative values$",
    ),
    (
        dict(p=np.full((2, 4, 4), np.nan, np.float32)),
        r"^target_probs: expected finite probabilities, got 32 NaN or infinite values$",
    ),
    (dict(p=np.zeros((2, 4, 4), np.float32)), r"^target_probs: expected every distribution p_i to have a positive sum"),
    (
        dict(u=np.ones((2, 3), np.float32)),
        r"^accept_uniforms: expected values in \[0, 1\), got values in \[1.0, 1.0\]$",
    ),
    (
        dict(s=np.array([0.5, -0.5], np.float32)),
        r"^sample_uniforms: expected values in \[0, 1\), got values in \[-0.5, 0.5\]$",
    ),
]


@pytest.mark.parametrize("sampler", ["numpy", "torch"])
@pytest.mark.parametrize(("changes", "message"), STRUCTURE_ERRORS + VALUE_ERRORS)
def test_validation_messages(sampler: str, changes: dict[str, Any], message: str) -> None:
    a = _with(**changes)
    with pytest.raises(ValueError, match=message):
        SAMPLERS[sampler](a["x"], a["q"], a["p"], a["u"], a["s"])


@pytest.mark.parametrize("sampler", ["numpy", "torch"])
def test_validate_false_skips_value_checks_only(sampler: str) -> None:
    a = _with(u=np.ones((2, 3), np.float32))
    SAMPLERS[sampler](a["x"], a["q"], a["p"], a["u"], a["s"], validate=False)  # u = 1 always fails: no error
    a = _with(q=np.zeros((2, 4, 4), np.float32))
    with pytest.raises(ValueError, match=r"draft_probs: expected shape"):
        SAMPLERS[sampler](a["x"], a["q"], a["p"], a["u"], a["s"], validate=False)


@pytest.mark.gpu
def test_torch_sampler_on_gpu_with_jax_arrays() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend")
    rng = np.random.default_rng(5)
    x, q, p, u, s = (
        a.astype(np.float32) if a.dtype.kind == "f" else a.astype(np.int32) for a in dyadic_inputs(rng, 4, 3, 300)
    )
    on_gpu = [jax.device_put(a, gpu) for a in (x, q, p, u, s)]
    out = torch_rejection_sample(*on_gpu)
    assert out.tokens.device.type == "cuda"
    ref = numpy_rejection_sample(x, q, p, u, s)
    np.testing.assert_array_equal(out.tokens.cpu().numpy(), ref.tokens)
    cuda_out = torch_rejection_sample(*(torch.as_tensor(a, device="cuda") for a in (x, q, p, u, s)))
    np.testing.assert_array_equal(cuda_out.tokens.cpu().numpy(), ref.tokens)
