"""torch ↔ JAX adapters on CPU (issue #4): zero-copy, explicit copies, dtypes, counters, memory.

Zero-copy is checked by pointer equality (``tensor.data_ptr()`` against
``array.unsafe_buffer_pointer()``) and by mutation: a write through torch after
the import is visible to JAX exactly when the memory is shared. (Those writes
break the aliasing rule on purpose; nothing is in flight when they happen.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specjax.adapters import (
    COPY_REASONS,
    JAX_TO_TORCH,
    TORCH_TO_JAX,
    borrowed,
    configure_jax_memory,
    copy_stats,
    count_copies,
    reset_copy_stats,
    to_jax,
    to_torch,
)

ZERO_COPY_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.bool,
]
GPT2_VOCAB = 50257  # V·4 is not a multiple of 64: rows of a float32 (…, V) tensor start misaligned


def ptr(a: jax.Array) -> int:
    return a.unsafe_buffer_pointer()


def filled(dtype: torch.dtype, shape=(4, 64)) -> torch.Tensor:
    """A tensor with distinct-ish values of ``dtype`` (0/1 for bool)."""
    base = torch.arange(int(np.prod(shape)), dtype=torch.int32).reshape(shape)
    if dtype == torch.bool:
        return base % 2 == 1
    return (base % 100).to(dtype)


def one(dtype: torch.dtype):
    return True if dtype == torch.bool else 7


def as_np(t: torch.Tensor) -> np.ndarray:
    """Reference values of a torch tensor (test-side only), widened so NumPy can hold them."""
    if t.dtype == torch.bfloat16:
        t = t.float()
    if t.dtype in (torch.uint16, torch.uint32):
        t = t.to(torch.int64)
    return t.detach().numpy().copy()


def jax_np(a: jax.Array) -> np.ndarray:
    out = np.asarray(a)
    if out.dtype == jnp.bfloat16:
        out = out.astype(np.float32)
    if out.dtype in (np.uint16, np.uint32):
        out = out.astype(np.int64)
    return out


# ---------------------------------------------------------------------------- zero-copy


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_zero_copy_shares_memory(dtype):
    t = filled(dtype)
    with count_copies() as c:
        a = to_jax(t)
    assert ptr(a) == t.data_ptr()
    assert a.dtype == TORCH_TO_JAX[dtype]
    assert a.shape == tuple(t.shape)
    assert c.copies == 0
    t[1, 3] = one(dtype)
    t[2, 5] = 0
    seen = jax_np(a)
    assert seen[1, 3] == one(dtype) and seen[2, 5] == 0


@pytest.mark.parametrize("dtype", ZERO_COPY_DTYPES, ids=str)
def test_copy_true_makes_an_independent_buffer(dtype):
    t = filled(dtype)
    before = as_np(t).copy()
    with count_copies() as c:
        a = to_jax(t, copy=True)
    assert ptr(a) != t.data_ptr()
    assert ptr(a) % 64 == 0
    assert c.copies == 1 and c.by_reason["requested"] == 1
    t.zero_()
    t[1, 3] = one(dtype)
    np.testing.assert_array_equal(jax_np(a), before)


def test_copy_false_on_a_zero_copy_tensor_is_fine():
    t = torch.randn(8, 64)
    a = to_jax(t, copy=False)
    assert ptr(a) == t.data_ptr()


def test_zero_size_and_scalar_tensors():
    for t in (torch.zeros(0, 5), torch.tensor(3.5), torch.randn(2, 3, 64)[:, 3:]):
        a = to_jax(t, copy=False)
        assert a.shape == tuple(t.shape)
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_requires_grad_is_detached_without_a_copy():
    leaf = torch.randn(4, 64, requires_grad=True)
    for t in (leaf, leaf * 2):
        with count_copies() as c:
            a = to_jax(t)
        assert ptr(a) == t.data_ptr()
        assert c.copies == 0
        np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())
    assert leaf.requires_grad  # the caller's tensor is untouched


# ---------------------------------------------------------------------------- explicit copies


@dataclass(frozen=True)
class CopyCase:
    name: str
    make: object  # () -> torch.Tensor
    reason: str
    message: str  # regex for the copy=False error


def _misaligned():
    logits = torch.randn(2, 3, GPT2_VOCAB)
    return logits[0, -1]


COPY_CASES = [
    CopyCase("last_k_positions_B2", lambda: torch.randn(2, 5, 64)[:, -3:], "non_contiguous", "strided"),
    CopyCase("transpose", lambda: torch.randn(16, 64).t(), "non_contiguous", "strided"),
    CopyCase("expand", lambda: torch.randn(1, 64).expand(4, 64), "non_contiguous", "strided"),
    CopyCase("gpt2_last_row", _misaligned, "misaligned", "misaligned .*64-byte"),
    CopyCase("int64_ids", lambda: torch.arange(12).reshape(3, 4), "int64_to_int32", "int64 .*int32"),
    CopyCase("strided_int64", lambda: torch.arange(40).reshape(4, 10)[:, ::2], "int64_to_int32", "int64"),
    CopyCase("float64", lambda: torch.randn(3, 64, dtype=torch.float64), "float64_to_float32", "jax_enable_x64"),
]


@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.name)
def test_one_explicit_copy_when_jax_cannot_import_as_is(case):
    t = case.make()
    with count_copies() as c:
        a = to_jax(t)
    assert c.copies == 1, c
    assert c.by_reason[case.reason] == 1
    assert c.by_reason["dlpack_copy"] == 0  # JAX itself never copied
    assert ptr(a) != t.data_ptr()
    assert ptr(a) % 64 == 0
    assert c.bytes == a.size * a.dtype.itemsize
    expected = as_np(t)
    if case.reason == "float64_to_float32":
        expected = expected.astype(np.float32)
    np.testing.assert_array_equal(jax_np(a), expected)
    assert a.dtype == {"int64_to_int32": jnp.int32, "float64_to_float32": jnp.float32}.get(
        case.reason, TORCH_TO_JAX[t.dtype]
    )
    # The copy is independent of the source.
    t.fill_(1)
    np.testing.assert_array_equal(jax_np(a), expected)


@pytest.mark.parametrize("case", COPY_CASES, ids=lambda c: c.name)
def test_copy_false_refuses_with_the_reason(case):
    t = case.make()
    with count_copies() as c, pytest.raises(ValueError, match=f"tensor: copy=False but .*{case.message}"):
        to_jax(t, copy=False)
    assert c.copies == 0


def test_misaligned_view_premise_and_jax_silent_copy():
    """The premise of the explicit copy: JAX's own import copies a misaligned view silently."""
    v = _misaligned()
    assert v.data_ptr() % 64 != 0
    raw = jax.dlpack.from_dlpack(v)
    assert ptr(raw) != v.data_ptr()  # JAX copied, and said nothing
    with count_copies() as c:
        to_jax(v)
    assert c.copies == 1 and c.by_reason["misaligned"] == 1


def test_strided_premise_jax_refuses_even_with_copy_true():
    v = torch.randn(2, 5, 64)[:, -3:]
    with pytest.raises(Exception, match="compact"):
        jax.dlpack.from_dlpack(v, copy=True)


def test_aligned_row_of_a_larger_tensor_is_zero_copy():
    logits = torch.randn(2, 3, 128)  # 128·4 bytes per row: every row starts 64-byte aligned
    v = logits[1, -1]
    with count_copies() as c:
        a = to_jax(v)
    assert ptr(a) == v.data_ptr() and c.copies == 0


def test_int64_ids_out_of_int32_range_name_the_range():
    for bad in (2**31, -(2**31) - 1, 2**40):
        t = torch.tensor([[1, bad]], dtype=torch.int64)
        with pytest.raises(ValueError, match=r"token ids must fit in int32 \[-2147483648, 2147483647\], got values in"):
            to_jax(t)
    edge = torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int64)
    np.testing.assert_array_equal(np.asarray(to_jax(edge)), edge.numpy().astype(np.int32))


def test_int64_check_range_false_skips_the_check():
    t = torch.tensor([2**32 + 5], dtype=torch.int64)
    assert int(to_jax(t, check_range=False)[0]) == 5  # wrapped, as documented


def test_float64_is_zero_copy_under_x64():
    t = torch.randn(4, 64, dtype=torch.float64)
    with jax.enable_x64(True):
        with count_copies() as c:
            a = to_jax(t, copy=False)
        assert a.dtype == jnp.float64
        assert ptr(a) == t.data_ptr() and c.copies == 0


# ---------------------------------------------------------------------------- dtype table


def test_dtype_table_is_complete_and_reversible():
    torch_names = {str(d).removeprefix("torch.") for d in TORCH_TO_JAX}
    assert torch_names == {
        "float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "bool",
    }  # fmt: skip
    for tdt, jdt in TORCH_TO_JAX.items():
        if tdt != torch.int64:
            assert JAX_TO_TORCH[jdt] == tdt


@pytest.mark.parametrize("dtype", list(TORCH_TO_JAX), ids=str)
def test_round_trip_every_table_entry(dtype):
    t = filled(dtype, (3, 32))
    a = to_jax(t)
    back = to_torch(a)
    want = {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)
    assert back.dtype == want
    assert back.data_ptr() == ptr(a)
    np.testing.assert_array_equal(as_np(back), as_np(t.to(want)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64], ids=str)
def test_round_trip_x64_entries(dtype):
    with jax.enable_x64(True):
        t = filled(dtype, (3, 32))
        a = to_jax(t)
        back = to_torch(a)
    want = torch.int32 if dtype == torch.int64 else torch.float64  # ids are always int32
    assert back.dtype == want
    np.testing.assert_array_equal(as_np(back), as_np(t.to(want)))


@pytest.mark.parametrize("name", [d.name for d in JAX_TO_TORCH])
def test_jax_to_torch_is_zero_copy(name):
    with jax.enable_x64(True):
        a = jnp.arange(96).reshape(3, 32).astype(name)
        with count_copies() as c:
            t = to_torch(a, copy=False)
    assert t.data_ptr() == ptr(a)
    assert t.dtype == JAX_TO_TORCH[jnp.dtype(name)]
    assert t.device == torch.device("cpu")
    assert c.copies == 0
    np.testing.assert_array_equal(as_np(t), jax_np(a))


def test_jax_to_torch_copy_true():
    a = jnp.arange(64, dtype=jnp.int32)
    with count_copies() as c:
        t = to_torch(a, copy=True)
    assert t.data_ptr() != ptr(a)
    assert c.copies == 1 and c.by_reason["requested"] == 1
    t.fill_(-1)
    assert int(a[3]) == 3


@pytest.mark.parametrize(
    "make, got",
    [
        (lambda: torch.zeros(4, dtype=torch.complex64), "complex64"),
        (lambda: torch.zeros(4, dtype=torch.complex128), "complex128"),
        (lambda: torch.zeros(4).to(torch.float8_e4m3fn), "float8_e4m3fn"),
        (lambda: torch.zeros(4).to(torch.float8_e5m2), "float8_e5m2"),
        (lambda: torch.zeros(4, dtype=torch.uint64), "uint64"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_unsupported_torch_dtypes_list_the_supported_ones(make, got):
    with pytest.raises(TypeError, match=f"tensor: expected one of the dtypes float32, .*bool, got {got}"):
        to_jax(make())


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.float8_e4m3fn], ids=str)
def test_unsupported_jax_dtypes(dtype):
    with pytest.raises(TypeError, match=r"array: expected one of the dtypes float32, .*got"):
        to_torch(jnp.zeros(4, dtype))


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"tensor: expected a torch\.Tensor, got ndarray"):
        to_jax(np.zeros(3))
    with pytest.raises(TypeError, match="copy: expected True, False or None, got 'yes'"):
        to_jax(torch.zeros(3), copy="yes")
    with pytest.raises(TypeError, match=r"tensor: expected a dense .*sparse"):
        to_jax(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="tensor: expected a tensor on cpu or cuda, got one on meta"):
        to_jax(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match=r"array: expected a jax\.Array, got Tensor"):
        to_torch(torch.zeros(3))
    deleted = jnp.arange(3.0) + 1
    deleted.delete()
    with pytest.raises(ValueError, match=r"array: expected a live jax\.Array"):
        to_torch(deleted)

    @jax.jit
    def inside(x):
        to_torch(x)
        return x

    with pytest.raises(TypeError, match=r"array: expected a concrete jax\.Array, got a tracer"):
        inside(jnp.zeros(3))


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3),
    v=st.integers(1, 80),
    start=st.integers(0, 4),
    step=st.integers(1, 3),
    transpose=st.booleans(),
)
def test_values_preserved_and_copy_iff_needed(b, v, start, step, transpose):
    base = torch.randn(b, 5, v)
    t = base[:, start::step]
    if transpose:
        t = t.transpose(0, 2)
    needs_copy = not t.is_contiguous() or (t.numel() > 0 and t.data_ptr() % 64 != 0)
    with count_copies() as c:
        a = to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert c.copies == int(needs_copy)
    assert (t.numel() == 0) or ((ptr(a) == t.data_ptr()) == (not needs_copy))


# ---------------------------------------------------------------------------- counters and logging


def test_counter_counts_each_copy_once_and_warns_once(caplog):
    reset_copy_stats()
    views = [torch.randn(2, 4, 64)[:, -2:] for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="specjax.adapters"):
        with count_copies() as c:
            for view in views:
                to_jax(view)
            to_jax(torch.randn(4, 64), copy=True)  # requested: counted, not warned
            to_jax(torch.randn(4, 64))  # zero-copy: neither
    stats = copy_stats()
    assert c.copies == 4
    assert c.by_reason["non_contiguous"] == 3 and c.by_reason["requested"] == 1
    assert c.bytes == 3 * (2 * 2 * 64 * 4) + 4 * 64 * 4
    assert stats.copies == 4 and stats.bytes == c.bytes
    assert set(stats.by_reason) == set(COPY_REASONS)
    records = [r for r in caplog.records if r.name == "specjax.adapters"]
    assert len(records) == 1
    assert "non_contiguous" in records[0].getMessage()
    assert records[0].levelno == logging.WARNING

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specjax.adapters"):
        to_jax(torch.arange(3))
        to_jax(torch.arange(3))
    assert [r.getMessage().split(")")[0] for r in caplog.records] == ["specjax.adapters made a copy (int64_to_int32"]


def test_count_copies_nests_and_is_per_thread():
    reset_copy_stats()
    with count_copies() as outer:
        to_jax(torch.arange(4))
        with count_copies() as inner:
            to_jax(torch.arange(4))
        worker = threading.Thread(target=lambda: to_jax(torch.arange(4)))
        worker.start()
        worker.join()
    assert inner.copies == 1
    assert outer.copies == 2  # the worker thread's copy is not ours
    assert copy_stats().copies == 3
    snap = outer.snapshot()
    assert snap.copies == 2 and snap.by_reason["int64_to_int32"] == 2


def test_copy_stats_is_a_snapshot():
    reset_copy_stats()
    snap = copy_stats()
    to_jax(torch.arange(4))
    assert snap.copies == 0 and copy_stats().copies == 1
    with pytest.raises(TypeError):
        snap.by_reason["requested"] = 5  # read-only


# ---------------------------------------------------------------------------- aliasing helper


def test_borrowed_waits_for_registered_results(monkeypatch):
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    logits = torch.randn(2, 64)
    with borrowed(logits) as b:
        (a,) = b.arrays
        assert ptr(a) == logits.data_ptr()
        out = b.reads({"s": jnp.sum(a, axis=-1)})
        assert not b.released and waited == []
    assert b.released and len(waited) == 1 and len(waited[0]) == 1 and waited[0][0] is out
    # Sums of 64 normals can be near 0, where a relative tolerance alone is too strict
    # for float32 (it failed in about 1 % of random draws); the absolute one covers rounding.
    np.testing.assert_allclose(np.asarray(out["s"]), logits.sum(-1).numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="already released"):
        b.reads(out)


def test_borrowed_still_waits_when_the_block_raises(monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or x)
    with pytest.raises(KeyError, match="boom"):
        with borrowed(torch.randn(3, 64)) as b:
            b.reads(b.arrays[0] * 2)
            raise KeyError("boom")
    assert b.released and len(waited) == 1


def test_kernel_accepts_torch_inputs_through_the_adapter():
    """CPU tensors reach the kernel as NumPy views where they can, else through to_jax's copies.

    Aligned contiguous float32 tensors need no copy; the strided and the
    misaligned ones (NumPy-allocated) are copied by to_jax, counted; int64 ids
    are narrowed on the host after a range check.
    """
    import specjax

    rng = np.random.default_rng(0)
    b, g, v = 3, 2, 64
    q = rng.dirichlet(np.ones(v), size=(b, g)).astype(np.float32)
    p = rng.dirichlet(np.ones(v), size=(b, g + 2)).astype(np.float32)  # one extra row, sliced off
    x = rng.integers(0, v, size=(b, g))
    u = rng.random((b, g)).astype(np.float32)
    s = rng.random(b).astype(np.float32)
    want = specjax.rejection_sample(x.astype(np.int32), q, p[:, 1:], u, s)
    aligned = [torch.from_numpy(a).clone() for a in (q, u, s)]  # torch's allocator aligns to 64 bytes
    assert all(t.data_ptr() % 64 == 0 for t in aligned)
    with count_copies() as c:
        got = specjax.rejection_sample(torch.from_numpy(x), aligned[0], torch.from_numpy(p)[:, 1:], *aligned[1:])
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert c.copies == 1 and c.by_reason["non_contiguous"] == 1  # p[:, 1:] only
    with count_copies() as c:
        got = specjax.rejection_sample(torch.from_numpy(x), torch.from_numpy(q), torch.from_numpy(p[:, 1:].copy()),
                                       torch.from_numpy(u), torch.from_numpy(s))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    misaligned = sum(a.ctypes.data % 64 != 0 for a in (q, u, s))
    assert c.copies == c.by_reason["misaligned"] + c.by_reason["non_contiguous"] >= misaligned
    with pytest.raises(ValueError, match=r"draft_tokens: token ids must fit in int32 .*, got values in \[8589934592"):
        specjax.rejection_sample(torch.full((b, g), 2**33), q, p[:, 1:], u, s)


def test_jit_input_passes_aligned_cpu_floats_as_views_and_the_rest_through_to_jax():
    """A view only where XLA:CPU reads the buffer in place; everything else is to_jax's."""
    from specjax.adapters import jit_input

    t = torch.randn(4, 256)
    view = jit_input(t)
    assert isinstance(view, np.ndarray) and view.ctypes.data == t.data_ptr()
    # What the shortcut rests on: XLA:CPU aliases an aligned host buffer instead of copying it.
    assert jax.device_put(view).unsafe_buffer_pointer() == t.data_ptr()
    t[0, 0] = 123.0  # a view, not a snapshot
    assert view[0, 0] == 123.0
    for other in (t.to(torch.bfloat16), t[:, ::2], t.view(-1)[1 : 1 + 64], torch.arange(8), t.to(torch.float64)):
        out = jit_input(other)
        assert isinstance(out, jax.Array), other.dtype
        np.testing.assert_array_equal(np.asarray(out, np.float64), other.double().numpy())


# ---------------------------------------------------------------------------- configure_jax_memory


def _run_fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    clean.update(env, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=clean, capture_output=True, text=True, timeout=120
    )


def test_configure_jax_memory_before_jax_starts():
    proc = _run_fresh(
        """
        import os, jax
        from specjax.adapters import configure_jax_memory, jax_backends_initialized
        assert not jax_backends_initialized()
        got = configure_jax_memory(memory_fraction=0.3, allocator="platform")
        assert got == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": "0.3",
                       "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, got
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ  # deprecated name removed
        assert all(os.environ[k] == v for k, v in got.items())
        import jax.numpy as jnp
        jnp.zeros(1).block_until_ready()
        assert jax_backends_initialized()
        configure_jax_memory(memory_fraction=0.3, allocator="platform")  # idempotent
        configure_jax_memory()  # a subset of the same settings
        try:
            configure_jax_memory(preallocate=True)
        except RuntimeError as err:
            assert "already running with XLA_PYTHON_CLIENT_PREALLOCATE='false'" in str(err), err
        else:
            raise AssertionError("no RuntimeError")
        print("OK")
        """,
        XLA_PYTHON_CLIENT_MEM_FRACTION="0.9",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "OK"


def test_configure_jax_memory_after_jax_started_raises():
    proc = _run_fresh(
        """
        import jax.numpy as jnp
        jnp.zeros(1)
        from specjax.adapters import configure_jax_memory
        configure_jax_memory()
        """
    )
    assert proc.returncode != 0
    assert "RuntimeError: configure_jax_memory: expected to run before JAX initialises its backends" in proc.stderr


def test_configure_jax_memory_already_matching_environment_is_fine_after_start():
    proc = _run_fresh(
        """
        import jax.numpy as jnp
        jnp.zeros(1)
        from specjax.adapters import configure_jax_memory
        print(configure_jax_memory())
        """,
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"memory_fraction": 1.5}, ValueError, r"memory_fraction: expected a value in \(0, 1\], got 1.5"),
        ({"memory_fraction": 0}, ValueError, "memory_fraction: expected a value in"),
        ({"memory_fraction": "0.5"}, TypeError, "memory_fraction: expected a float"),
        (
            {"allocator": "cuda"},
            ValueError,
            "allocator: expected one of default, platform, bfc, cuda_async, vmm, got 'cuda'",
        ),
        ({"preallocate": "no"}, TypeError, "preallocate: expected a bool, got str"),
    ],
)
def test_configure_jax_memory_argument_checks(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        configure_jax_memory(**kwargs)


def test_import_has_no_side_effects():
    proc = _run_fresh(
        """
        import sys
        import specjax.adapters
        assert "torch" not in sys.modules and "jax" not in sys.modules, sorted(sys.modules)
        from specjax.adapters import configure_jax_memory, count_copies
        assert "torch" not in sys.modules and "jax" not in sys.modules
        print("OK")
        """
    )
    assert proc.returncode == 0, proc.stderr


def test_explicit_copy_realigns_when_the_allocator_returns_a_misaligned_buffer(monkeypatch):
    """The copy's destination is checked: a misaligned fresh buffer is replaced by an aligned slice."""
    real_empty = torch.empty
    calls = []

    def misaligned_once(*shape, dtype=None, device=None):
        calls.append(shape)
        if len(calls) == 1:  # hand back a buffer 4 bytes past a 64-byte boundary
            flat = real_empty(int(np.prod(shape[0])) + 1, dtype=dtype, device=device)[1:]
            assert flat.data_ptr() % 64 != 0
            return flat.view(shape[0])
        return real_empty(*shape, dtype=dtype, device=device)

    monkeypatch.setattr(torch, "empty", misaligned_once)
    v = torch.randn(2, 5, 64)[:, -3:]
    with count_copies() as c:
        a = to_jax(v)
    monkeypatch.undo()
    assert len(calls) == 2
    assert c.copies == 1 and c.by_reason["dlpack_copy"] == 0  # JAX did not have to copy it again
    assert ptr(a) % 64 == 0
    np.testing.assert_array_equal(np.asarray(a), v.numpy())
