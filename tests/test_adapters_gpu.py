"""torch ↔ JAX adapters on an NVIDIA GPU (issue #4). Skipped without CUDA builds of torch and JAX.

Run with ``make gpu-check`` (``pytest -m gpu``). The fixture checks for a GPU
lazily, so collecting this file on a CPU machine never starts JAX.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from specjax.adapters import (  # noqa: E402
    borrowed,
    configure_jax_memory,
    count_copies,
    to_jax,
    to_torch,
)

pytestmark = pytest.mark.gpu

ZERO_COPY_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.uint8, torch.uint16, torch.uint32, torch.bool,
]  # fmt: skip


@pytest.fixture(scope="module")
def cuda():
    """torch's current CUDA device; skips unless torch and JAX both have a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    try:
        configure_jax_memory()  # share the GPU with torch, if JAX has not started yet
    except RuntimeError:
        pass  # JAX already started in this process (another test module); share as configured
    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX has no GPU backend (install a CUDA build of JAX, see docs/gpu.md)")
    return torch.device("cuda", torch.cuda.current_device())


def jax_gpu(index: int):
    return next(d for d in jax.devices("gpu") if d.local_hardware_id == index)


def ptr(a) -> int:
    return a.unsafe_buffer_pointer()


def host(x) -> np.ndarray:
    """Test-side host copy for comparisons (float32/int64 so NumPy can hold every dtype)."""
    if isinstance(x, torch.Tensor):
        x = x.cpu()
        return (x.float() if x.dtype.is_floating_point else x.to(torch.int64)).numpy()
    out = np.asarray(x)
    return out.astype(np.float32) if out.dtype.kind == "f" or out.dtype == jnp.bfloat16 else out.astype(np.int64)


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_cuda_zero_copy_every_dtype(cuda, dtype):
    t = (
        (torch.arange(4 * 64, device=cuda) % 2 == 1)
        if dtype == torch.bool
        else (torch.arange(4 * 64, device=cuda) % 100).to(dtype)
    )
    t = t.reshape(4, 64)
    with count_copies() as c:
        a = to_jax(t, copy=False)
    assert c.copies == 0
    assert ptr(a) == t.data_ptr()
    assert a.devices() == {jax_gpu(cuda.index)}
    t[1, 3] = True if dtype == torch.bool else 7
    torch.cuda.synchronize()
    assert host(a)[1, 3] == (1 if dtype == torch.bool else 7)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: torch.randn(2, 5, 64, device=d)[:, -3:], "non_contiguous"),
        (lambda d: torch.randn(16, 64, device=d).t(), "non_contiguous"),
        (lambda d: torch.randn(2, 3, 50257, device=d)[0, -1], "misaligned"),
        (lambda d: torch.arange(40, device=d).reshape(4, 10), "int64_to_int32"),
    ],
    ids=["last_k", "transpose", "gpt2_row", "int64"],
)
def test_cuda_copies_stay_on_the_device(cuda, monkeypatch, make, reason):
    t = make(cuda)
    want = host(t)

    def no_host(*args, **kwargs):
        raise AssertionError("host round trip")

    monkeypatch.setattr(torch.Tensor, "numpy", no_host)
    monkeypatch.setattr(torch.Tensor, "cpu", no_host)
    with count_copies() as c:
        a = to_jax(t)
    monkeypatch.undo()
    assert c.copies == 1 and c.by_reason[reason] == 1
    assert a.devices() == {jax_gpu(cuda.index)}
    assert ptr(a) % 64 == 0 and ptr(a) != t.data_ptr()
    np.testing.assert_array_equal(host(a), want)


def test_torch_work_on_the_current_stream_is_ordered_before_jax_reads(cuda):
    n = 1 << 22
    x = torch.zeros(n, device=cuda)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(cuda)
    with torch.cuda.stream(side):
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(200_000_000)  # keep the stream busy so a missing wait shows
        x.fill_(3.0)
        a = to_jax(x)
        total = jnp.sum(a)
    assert float(total) == 3.0 * n


def test_jax_results_return_to_torch_without_a_copy(cuda):
    a = jax.device_put(jnp.arange(4096, dtype=jnp.int32), jax_gpu(cuda.index)) * 2
    with count_copies() as c:
        t = to_torch(a, copy=False)
    assert c.copies == 0
    assert t.device == cuda and t.dtype == torch.int32
    assert t.data_ptr() == ptr(a)
    assert int(t[-1]) == 2 * 4095  # torch's stream waited for the JAX computation


def test_kernel_on_cuda_tensors_matches_cpu(cuda):
    import specjax

    gen = torch.Generator(device=cuda).manual_seed(0)
    b, g, v = 8, 4, 1000
    q = torch.softmax(torch.randn(b, g, v, device=cuda, generator=gen), -1)
    p = torch.softmax(torch.randn(b, g + 1, v, device=cuda, generator=gen), -1)
    x = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, g).to(torch.int32)
    u = torch.rand(b, g, device=cuda, generator=gen)
    s = torch.rand(b, device=cuda, generator=gen)
    with borrowed(x, q, p, u, s, copy=False) as loan:
        out = loan.reads(specjax.rejection_sample(*loan.arrays, validate=False))
    assert out.tokens.devices() == {jax_gpu(cuda.index)}
    tokens = to_torch(out.tokens, copy=False)
    assert tokens.is_cuda and tokens.dtype == torch.int32
    cpu = specjax.rejection_sample(*(t.cpu() for t in (x, q, p, u, s)), validate=False)
    np.testing.assert_array_equal(tokens.cpu().numpy(), np.asarray(cpu.tokens))


def test_second_gpu_maps_to_the_same_jax_index(cuda):
    if torch.cuda.device_count() < 2 or len(jax.devices("gpu")) < 2:
        pytest.skip("needs two GPUs")
    t = torch.randn(8, 64, device="cuda:1")
    a = to_jax(t, copy=False)
    assert a.devices() == {jax_gpu(1)}
    assert to_torch(a).device == torch.device("cuda", 1)
