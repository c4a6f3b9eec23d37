"""The acceptance kernel's boundary: every validation message, compilation caching, and its memory footprint.

The temporary-memory bound (no (B, G, V) intermediate) has a test of its own (issue #2).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _straightforward
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from rejection_helpers import (
    EDGE_B,
    EDGE_V,
    random_batch,
    run,
    valid_inputs,
)

from specjax import rejection_sample
from specjax.boundary import validation as validation_module
from specjax.kernels import rejection as rejection_module

# --------------------------------------------------------------------------- validation


def _set(name: str, value: Any) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        inputs[name] = value(inputs[name]) if callable(value) else value

    return mutate


def _poke(name: str, value: float, index: tuple = (0, 0, 0)) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        arr = np.array(inputs[name])
        arr[index[: arr.ndim]] = value
        inputs[name] = arr

    return mutate


def _as_jax(name: str, inner: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(inputs: dict) -> None:
        inner(inputs)
        inputs[name] = jnp.asarray(inputs[name])

    return mutate


@dataclass(frozen=True)
class BadInput:
    id: str
    mutate: Callable[[dict], None]
    message: str  # an exact substring of the expected message
    shape_error: bool = False  # raised with validate=False too


BAD_INPUTS = [
    # rank
    BadInput(
        "rank-draft_tokens",
        _set("draft_tokens", lambda x: x[0]),
        "draft_tokens: expected rank 2 with shape (B, G), got shape (3,)",
        True,
    ),
    BadInput(
        "rank-draft_probs",
        _set("draft_probs", lambda x: x[0]),
        "draft_probs: expected rank 3 with shape (B, G, V), got shape (3, 8)",
        True,
    ),
    BadInput(
        "rank-target_probs",
        _set("target_probs", lambda x: x[None]),
        "target_probs: expected rank 3 with shape (B, G+1, V), got shape (1, 2, 4, 8)",
        True,
    ),
    BadInput(
        "rank-accept_uniforms",
        _set("accept_uniforms", lambda x: x[..., None]),
        "accept_uniforms: expected rank 2 with shape (B, G), got shape (2, 3, 1)",
        True,
    ),
    BadInput(
        "rank-sample_uniforms",
        _set("sample_uniforms", lambda x: x[:, None]),
        "sample_uniforms: expected rank 1 with shape (B), got shape (2, 1)",
        True,
    ),
    BadInput(
        "rank-sample_uniforms-scalar",
        _set("sample_uniforms", np.float32(0.5)),
        "sample_uniforms: expected rank 1 with shape (B), got shape ()",
        True,
    ),
    # B disagreements
    BadInput(
        "B-target_probs",
        _set("target_probs", lambda x: np.concatenate([x, x])),
        "target_probs: expected shape (B, G+1, V) = (2, 4, 8), got (4, 4, 8)",
        True,
    ),
    BadInput(
        "B-draft_probs",
        _set("draft_probs", lambda x: x[:1]),
        "draft_probs: expected shape (B, G, V) = (2, 3, 8), got (1, 3, 8)",
        True,
    ),
    BadInput(
        "B-accept_uniforms",
        _set("accept_uniforms", lambda x: x[:1]),
        "accept_uniforms: expected shape (B, G) = (2, 3), got (1, 3)",
        True,
    ),
    BadInput(
        "B-sample_uniforms",
        _set("sample_uniforms", lambda x: np.concatenate([x, x])),
        "sample_uniforms: expected shape (B) = (2,), got (4,)",
        True,
    ),
    # G disagreements (target_probs needs G+1 positions)
    BadInput(
        "G-target_probs-G-positions",
        _set("target_probs", lambda x: x[:, :3]),
        "target_probs: expected shape (B, G+1, V) = (2, 4, 8), got (2, 3, 8)",
        True,
    ),
    BadInput(
        "G-draft_probs",
        _set("draft_probs", lambda x: x[:, :2]),
        "draft_probs: expected shape (B, G, V) = (2, 3, 8), got (2, 2, 8)",
        True,
    ),
    BadInput(
        "G-accept_uniforms",
        _set("accept_uniforms", lambda x: x[:, :2]),
        "accept_uniforms: expected shape (B, G) = (2, 3), got (2, 2)",
        True,
    ),
    BadInput(
        "G-draft_tokens",
        _set("draft_tokens", lambda x: x[:, :2]),
        "target_probs: expected shape (B, G+1, V) = (2, 3, 8), got (2, 4, 8)",
        True,
    ),
    # V disagreements
    BadInput(
        "V-draft_probs",
        _set("draft_probs", lambda x: x[..., :7]),
        "draft_probs: expected shape (B, G, V) = (2, 3, 8), got (2, 3, 7)",
        True,
    ),
    BadInput(
        "V-zero",
        lambda d: d.update(draft_probs=d["draft_probs"][..., :0], target_probs=d["target_probs"][..., :0]),
        "target_probs: expected a vocabulary size V >= 1, got V = 0",
        True,
    ),
    # token ids
    BadInput(
        "tokens-negative",
        _poke("draft_tokens", -1),
        "draft_tokens: expected token ids in [0, V) = [0, 8), got values in [-1, ",
    ),
    BadInput(
        "tokens-equal-V",
        _poke("draft_tokens", 8),
        "draft_tokens: expected token ids in [0, V) = [0, 8), got values in [",
    ),
    BadInput(
        "tokens-int64-huge",
        _set("draft_tokens", lambda x: x.astype(np.int64) + 2**40),
        "draft_tokens: token ids must fit in int32",
    ),
    # probabilities
    *[
        BadInput(f"{name}-{label}", _poke(name, value), message)
        for name in ("draft_probs", "target_probs")
        for label, value, message in [
            ("negative", -0.1, f"{name}: expected non-negative probabilities, got 1 negative values"),
            ("nan", np.nan, f"{name}: expected finite probabilities, got 1 NaN or infinite values"),
            ("inf", np.inf, f"{name}: expected finite probabilities, got 1 NaN or infinite values"),
            ("-inf", -np.inf, f"{name}: expected finite probabilities, got 1 NaN or infinite values"),
        ]
    ],
    BadInput(
        "target-row-sums-to-zero",
        _poke("target_probs", 0.0, (1, 2, slice(None))),
        "target_probs: expected every distribution p_i to have a positive sum, got a row summing to 0",
    ),
    # uniforms, checked on the host (NumPy) and on the device (JAX)
    *[
        BadInput(
            f"{name}-{label}-{where}",
            wrap(name, _poke(name, value)),
            f"{name}: expected values in [0, 1), got values in [",
        )
        for name in ("accept_uniforms", "sample_uniforms")
        for label, value in [("one", 1.0), ("negative", -0.25), ("nan", np.nan), ("above", 1.5)]
        for where, wrap in [("numpy", lambda n, m: m), ("jax", _as_jax)]
    ],
    # dtypes
    *[
        BadInput(
            f"dtype-{name}-{label}",
            _set(name, conv),
            f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), got {got}",
            True,
        )
        for name in ("draft_probs", "target_probs", "accept_uniforms", "sample_uniforms")
        for label, conv, got in [
            ("str", lambda x: np.full(x.shape, "a"), "str32"),
            ("bool", lambda x: x > 0.5, "bool"),
            ("complex", lambda x: x.astype(np.complex64), "complex64"),
            ("int", lambda x: (x * 10).astype(np.int32), "int32"),
        ]
    ],
    BadInput(
        "dtype-draft_tokens-float",
        _set("draft_tokens", lambda x: x.astype(np.float32)),
        "draft_tokens: expected integer token ids (int32 or int64), got float32",
        True,
    ),
    BadInput(
        "dtype-draft_tokens-str",
        _set("draft_tokens", lambda x: np.full(x.shape, "a")),
        "draft_tokens: expected integer token ids (int32 or int64), got str32",
        True,
    ),
    BadInput(
        "dtype-draft_tokens-bool",
        _set("draft_tokens", lambda x: x > 1),
        "draft_tokens: expected integer token ids (int32 or int64), got bool",
        True,
    ),
    BadInput("none-target_probs", _set("target_probs", None), "target_probs: expected an array, got None", True),
    BadInput(
        "ragged-target_probs",
        _set("target_probs", [[[0.5, 0.5]], [[1.0]]]),
        "target_probs: expected a rectangular array, got a ragged nested list",
        True,
    ),
    BadInput(
        "torch-nan-target_probs",
        _set("target_probs", lambda x: torch.tensor(np.where(np.arange(8) == 2, np.nan, x)).float()),
        "target_probs: expected finite probabilities, got 8 NaN or infinite values",
    ),
]


@pytest.mark.parametrize("bad", BAD_INPUTS, ids=[b.id for b in BAD_INPUTS])
def test_bad_input_raises_value_error(bad: BadInput) -> None:
    inputs = valid_inputs()
    bad.mutate(inputs)
    with pytest.raises(ValueError, match=re.escape(bad.message)):
        rejection_sample(**inputs)


@pytest.mark.parametrize(
    "bad", [b for b in BAD_INPUTS if b.shape_error], ids=[b.id for b in BAD_INPUTS if b.shape_error]
)
def test_shape_and_dtype_errors_raise_without_validate(bad: BadInput) -> None:
    inputs = valid_inputs()
    bad.mutate(inputs)
    with pytest.raises(ValueError, match=re.escape(bad.message)):
        rejection_sample(**inputs, validate=False)


@pytest.mark.parametrize(
    "bad", [b for b in BAD_INPUTS if not b.shape_error], ids=[b.id for b in BAD_INPUTS if not b.shape_error]
)
def test_validate_false_skips_value_checks(bad: BadInput) -> None:
    inputs = valid_inputs()
    bad.mutate(inputs)
    if bad.id == "tokens-int64-huge":  # narrowing int64 to int32 is checked even without validate
        with pytest.raises(ValueError, match=re.escape(bad.message)):
            rejection_sample(**inputs, validate=False)
        return
    out = rejection_sample(**inputs, validate=False)
    assert out.num_accepted.shape == (2,) and out.tokens.shape == (2, 4)


def test_valid_inputs_pass_validation() -> None:
    """The table's base inputs are valid, so each error above comes from its one mutation."""
    out = rejection_sample(**valid_inputs())
    assert out.tokens.shape == (EDGE_B, 4)


def test_validate_false_does_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """validate=False neither runs the value summary nor fetches anything to the host."""
    calls: list[str] = []
    real_summary = validation_module._kernel_value_summary
    real_get = jax.device_get

    def summary_spy(*a: Any) -> Any:
        calls.append("summary")
        return real_summary(*a)

    def get_spy(x: Any) -> Any:
        calls.append("device_get")
        return real_get(x)

    monkeypatch.setattr(validation_module, "_kernel_value_summary", summary_spy)
    monkeypatch.setattr(jax, "device_get", get_spy)
    inputs = {k: jnp.asarray(v) for k, v in valid_inputs().items()}
    jax.block_until_ready(rejection_sample(**inputs, validate=False))
    assert calls == []
    rejection_sample(**inputs, validate=True)  # negative control: the spies do see validation
    assert "summary" in calls and "device_get" in calls


# --------------------------------------------------------------------------- compilation


def test_no_recompilation_on_new_values_recompiles_on_new_shape() -> None:
    jitted = rejection_module._rejection_sample_jit
    shape = (EDGE_B, 3, EDGE_V)
    rng = np.random.default_rng(3)
    base = random_batch(rng, *shape)
    run(*base, validate=False)
    size = jitted._cache_size()
    # New values, and the same values as other input kinds of the same dtypes.
    for _ in range(3):
        run(*random_batch(rng, *shape), validate=False)
    run(*[jnp.asarray(a) for a in base], validate=False)
    run(*[a.tolist() for a in base], validate=False)  # lists: float64 -> float32, int64 -> int32
    run(base[0].astype(np.int64), *base[1:], validate=False)
    run(*random_batch(rng, *shape))  # validate=True does not touch the kernel's cache either
    assert jitted._cache_size() == size
    # A new shape (used nowhere else in this file) compiles once, then is cached.
    run(*random_batch(rng, EDGE_B, 3, EDGE_V + 1), validate=False)
    assert jitted._cache_size() == size + 1
    run(*random_batch(rng, EDGE_B, 3, EDGE_V + 1), validate=False)
    assert jitted._cache_size() == size + 1
    # A new dtype (bfloat16 at this shape: used nowhere else) compiles too.
    tokens, q, p, u, s = random_batch(rng, *shape)
    run(tokens, q.astype(jnp.bfloat16), p.astype(jnp.bfloat16), u, s, validate=False)
    assert jitted._cache_size() == size + 2


# --------------------------------------------------------------------------- memory


@functools.cache
def _temp_bytes(which: str, batch: int, num_draft: int, vocab: int, cpu_kernels_on: bool = True) -> int:
    """XLA's temporary allocation of the compiled kernel for float32 inputs (no execution).

    ``cpu_kernels_on=False`` compiles the JAX code (what GPUs run) in place of the
    C++ CPU kernel's draw.
    """
    from specjax.kernels import cpu_kernels

    fn = {"kernel": rejection_module._rejection_sample_jit, "straightforward": _straightforward._straightforward_jit}[
        which
    ]
    spec = jax.ShapeDtypeStruct
    shapes = (
        spec((batch, num_draft), jnp.int32),
        spec((batch, num_draft, vocab), jnp.float32),
        spec((batch, num_draft + 1, vocab), jnp.float32),
        spec((batch, num_draft), jnp.float32),
        spec((batch,), jnp.float32),
    )
    options = {"impl": cpu_kernels.resolve("auto" if cpu_kernels_on else "xla")} if which == "kernel" else {}
    return int(fn.lower(*shapes, **options).compile().memory_analysis().temp_size_in_bytes)


MEM_B, MEM_G, MEM_V = 64, 8, 32000
BGV_BYTES = MEM_B * MEM_G * MEM_V * 4  # 65.5 MB: one (B, G, V) float32 array
BV_BYTES = MEM_B * MEM_V * 4  # 8.2 MB: one (B, V) float32 array


@pytest.mark.parametrize("cpu_kernels_on", [True, False], ids=["cpu-kernels", "jax-code"])
def test_kernel_has_no_bgv_intermediate(cpu_kernels_on: bool) -> None:
    """The kernel's temporaries are O(B·V) (a few rows per batch row), not O(B·G·V).

    Measured (jax 0.10.2, CPU, B = 64, V = 32000), JAX code: 24.6 MB = 3.0 (B, V)
    float32 buffers for G = 2, 4 and 8 (4.0 buffers at V = 32001, where padding
    to the CDF block adds one); with the C++ CPU kernel's draw, a few kB (the
    (B, G) gathers); the straightforward version: 204.8 MB at G = 8.
    """
    small_g = _temp_bytes("kernel", MEM_B, 2, MEM_V, cpu_kernels_on)
    big_g = _temp_bytes("kernel", MEM_B, MEM_G, MEM_V, cpu_kernels_on)
    assert big_g <= 1.01 * small_g + MEM_V * 4, (small_g, big_g)  # grows with G by less than one V-row
    assert big_g <= 4 * BV_BYTES, big_g


def test_kernel_temporaries_below_quarter_of_bgv() -> None:
    temp = _temp_bytes("kernel", MEM_B, MEM_G, MEM_V)
    assert temp < BGV_BYTES / 4, temp


def test_straightforward_exceeds_both_memory_bounds() -> None:
    """The bounds above can fail: the straightforward version materialises (B, G, V) arrays."""
    temp = _temp_bytes("straightforward", MEM_B, MEM_G, MEM_V)
    assert temp > BGV_BYTES > 4 * BV_BYTES, temp
