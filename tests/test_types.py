"""SamplingParams and AcceptanceResult: pytrees, jit static-ness, attribute access only."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.generate.checks import checked_sampler
from specjax.kernels import frontend
from specjax.kernels.results import AcceptanceResult
from specjax.kernels.types import SamplingParams

# --------------------------------------------------------------------------- #
# Attribute access only
# --------------------------------------------------------------------------- #


def _result() -> AcceptanceResult:
    out = specjax.rejection_sample([[1, 0]], [[[0.5, 0.5], [0.5, 0.5]]], [[[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]],
                                   [[0.1, 0.2]], [0.3])  # fmt: skip
    assert isinstance(out, AcceptanceResult)
    return out


#: The dict-style accesses of a plain ``dict[str, jax.Array]`` result: none is answered.
DICT_ACCESSES: list[tuple[str, Callable[[AcceptanceResult], Any], type[Exception]]] = [
    ("getitem", lambda o: o["tokens"], TypeError),
    ("in", lambda o: "tokens" in o, TypeError),
    ("iter", lambda o: list(o), TypeError),
    ("dict", lambda o: dict(o), TypeError),
    ("len", len, TypeError),
    ("get", lambda o: o.get("tokens"), AttributeError),
    ("keys", lambda o: o.keys(), AttributeError),
    ("items", lambda o: o.items(), AttributeError),
]


@pytest.mark.parametrize(("name", "access", "error"), DICT_ACCESSES, ids=[a[0] for a in DICT_ACCESSES])
def test_a_result_is_not_a_mapping(name: str, access: Callable[[AcceptanceResult], Any], error: type) -> None:
    with pytest.raises(error, match="AcceptanceResult"):
        access(_result())


def test_attribute_access_and_vars() -> None:
    out = _result()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert out.tokens.shape == (1, 3) and out.num_accepted.shape == (1,)
        assert list(vars(out)) == ["num_accepted", "tokens"]
        assert bool(out)
        assert [f.name for f in dataclasses.fields(out)] == ["num_accepted", "tokens"]


# --------------------------------------------------------------------------- #
# Pytrees
# --------------------------------------------------------------------------- #


def test_acceptance_result_is_a_frozen_pytree() -> None:
    out = _result()
    doubled = jax.tree.map(lambda a: a * 2, out)
    assert isinstance(doubled, AcceptanceResult)
    np.testing.assert_array_equal(doubled.tokens, np.asarray(out.tokens) * 2)
    assert len(jax.tree.leaves(out)) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.tokens = out.tokens  # type: ignore[misc]
    jitted = jax.jit(lambda r: AcceptanceResult(r.num_accepted + 1, r.tokens))(out)
    assert isinstance(jitted, AcceptanceResult) and int(jitted.num_accepted[0]) == int(out.num_accepted[0]) + 1


def test_sampling_params_fields_are_data_and_modes_are_static() -> None:
    b = 3
    params = SamplingParams(jnp.ones(b), jnp.zeros(b, jnp.int32), jnp.zeros(b), use_top_k=True, use_top_p=False)
    leaves, treedef = jax.tree.flatten(params)
    assert len(leaves) == 3  # temperature, top_k, one_minus_top_p
    other = jax.tree.structure(dataclasses.replace(params, use_top_p=True))
    assert treedef != other  # the modes are part of the structure: a jit cache key
    assert params.active_top_k is params.top_k and params.active_one_minus_top_p is None


def test_public_functions_return_acceptance_results() -> None:
    rng = np.random.default_rng(0)
    t = rng.standard_normal((2, 3, 10)).astype(np.float32)
    p = np.array(jax.nn.softmax(t, axis=-1))  # a writable copy (torch warns on read-only arrays)
    x = rng.integers(0, 10, (2, 2))
    for out in (
        specjax.verify_from_logits(x, t[:, :2], t, key=jax.random.key(0), temperature=1.0),
        specjax.verify_from_logits(x, None, t, key=jax.random.key(0), temperature=0.5, top_k=3, top_p=0.9),
        specjax.verify_from_logits(x[:0], t[:0, :2], t[:0], key=jax.random.key(0), temperature=1.0),  # B = 0
        specjax.rejection_sample(x, p[:, :2], p, rng.random((2, 2)), rng.random(2)),
        specjax.load_sampler("numpy")(x, None, p, rng.random((2, 2)), rng.random(2)),
        specjax.load_sampler("torch")(x, None, p, rng.random((2, 2)), rng.random(2)),
    ):
        assert isinstance(out, AcceptanceResult), type(out)


def test_jitted_kernel_recompiles_for_modes_never_for_values() -> None:
    rng = np.random.default_rng(3)
    b, g, v = 2, 2, 16
    x = rng.integers(0, v, (b, g)).astype(np.int32)
    d = rng.standard_normal((b, g, v)).astype(np.float32)
    t = rng.standard_normal((b, g + 1, v)).astype(np.float32)
    k = np.full(b, g, np.int32)

    def params(temperature: float, top_k: int, use_top_k: bool) -> SamplingParams:
        return SamplingParams(
            np.full(b, temperature, np.float32), np.full(b, top_k, np.int32), np.zeros(b, np.float32), use_top_k
        )

    call = frontend._verify_jit
    jax.block_until_ready(call(x, d, t, jax.random.key(0), params(0.5, 3, True), k))
    before = call._cache_size()
    for temperature, top_k in ((1.5, 1), (0.0, 7)):
        jax.block_until_ready(call(x, d, t, jax.random.key(1), params(temperature, top_k, True), k))
    assert call._cache_size() == before, "recompiled for new values"
    jax.block_until_ready(call(x, d, t, jax.random.key(1), params(0.5, 3, False), k))
    assert call._cache_size() == before + 1, "a mode switch must compile a new program"


# --------------------------------------------------------------------------- #
# The sampler plugin contract: a result or, as before, a dict
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("form", ["result", "dict"])
def test_checked_sampler_takes_a_result_or_a_dict(form: str) -> None:
    def sampler(x, q, p, u, s, *, validate=True):
        n, tokens = np.zeros(x.shape[0], np.int32), np.concatenate([x[:, :0], np.ones((x.shape[0], 1), np.int32)], 1)
        tokens = np.concatenate([tokens, np.full((x.shape[0], x.shape[1]), -1, np.int32)], 1)
        return AcceptanceResult(n, tokens) if form == "result" else {"num_accepted": n, "tokens": tokens}

    x = np.zeros((2, 2), np.int32)
    p = np.full((2, 3, 4), 0.25, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out = checked_sampler(sampler, "sampler")(x, None, p, np.zeros((2, 2)), np.zeros(2))
    assert isinstance(out, AcceptanceResult)
    assert out.num_accepted.tolist() == [0, 0] and out.tokens.tolist() == [[1, -1, -1], [1, -1, -1]]
