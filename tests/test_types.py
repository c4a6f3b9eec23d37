"""SamplingParams and AcceptanceResult: pytrees, jit static-ness, and the deprecated dict-style access."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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
# The deprecated dict-style access
# --------------------------------------------------------------------------- #


def _result() -> AcceptanceResult:
    out = specjax.rejection_sample([[1, 0]], [[[0.5, 0.5], [0.5, 0.5]]], [[[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]],
                                   [[0.1, 0.2]], [0.3])  # fmt: skip
    assert isinstance(out, AcceptanceResult)
    return out


@dataclass(frozen=True)
class Access:
    """One dict-style access: what it does, what it must equal, what the warning must advise."""

    name: str
    call: Callable[[AcceptanceResult], Any]
    expected: Callable[[AcceptanceResult], Any]
    advice: str  # a regex the warning's message must match


def _np(x: Any) -> Any:
    if isinstance(x, tuple | list):
        return [_np(v) for v in x]
    return np.asarray(x).tolist() if isinstance(x, jax.Array) else x


ACCESSES = [
    Access(
        "getitem tokens", lambda o: o["tokens"], lambda o: o.tokens, r"out\['tokens'\].*use the attribute out\.tokens"
    ),
    Access(
        "getitem num_accepted",
        lambda o: o["num_accepted"],
        lambda o: o.num_accepted,
        r"use the attribute out\.num_accepted",
    ),
    Access("get", lambda o: o.get("tokens"), lambda o: o.tokens, r"use the attribute out\.tokens"),
    Access("get missing", lambda o: o.get("probs", 7), lambda o: 7, r"out\.get\('probs'\)"),
    Access("in", lambda o: "tokens" in o, lambda o: True, r"'tokens' in out.*use the attributes"),
    Access("not in", lambda o: "probs" in o, lambda o: False, r"use the attributes"),
    Access("keys", lambda o: list(o.keys()), lambda o: ["num_accepted", "tokens"], r"out\.keys\(\).*vars\(out\)"),
    Access("values", lambda o: list(o.values()), lambda o: [o.num_accepted, o.tokens], r"out\.values\(\)"),
    Access(
        "items",
        lambda o: list(o.items()),
        lambda o: [("num_accepted", o.num_accepted), ("tokens", o.tokens)],
        r"vars\(out\)\.items\(\)",
    ),
    Access("iter", lambda o: [k for k in o], lambda o: ["num_accepted", "tokens"], r"iterating over out"),
    Access("len", len, lambda o: 2, r"len\(out\)"),
]


def _warns_once(call: Callable[[], Any], advice: str) -> Any:
    """Run ``call``; assert it emitted exactly one DeprecationWarning, pointing at this file, matching ``advice``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, f"expected one DeprecationWarning, got {[str(w.message) for w in caught]}"
    (w,) = deprecations
    assert str(w.message).startswith("AcceptanceResult: "), w.message
    assert re.search(advice, str(w.message)), (advice, str(w.message))
    # stacklevel: the warning names the caller's line, not specjax's
    assert w.filename == __file__, w.filename
    return value


@pytest.mark.parametrize("access", ACCESSES, ids=lambda a: a.name)
def test_dict_style_access_still_works_and_warns(access: Access) -> None:
    out = _result()
    got = _warns_once(lambda: access.call(out), access.advice)
    assert _np(got) == _np(access.expected(out))


def test_dict_style_getitem_of_an_unknown_key_raises_key_error() -> None:
    with pytest.raises(KeyError, match="probs"):
        _result()["probs"]


def test_dict_from_a_result_still_works() -> None:
    out = _result()
    with pytest.warns(DeprecationWarning, match="AcceptanceResult"):
        as_dict = dict(out)
    assert list(as_dict) == ["num_accepted", "tokens"] and as_dict["tokens"] is out.tokens


class _SilentResult(AcceptanceResult):
    """The old dict behaviour without the warning: what the check below must catch."""

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def test_the_warning_check_fails_when_the_warning_is_missing() -> None:
    """Negative control: an accessor that does not warn fails :func:`_warns_once` (and pytest.warns)."""
    out = _result()
    silent = _SilentResult(out.num_accepted, out.tokens)
    with pytest.raises(AssertionError, match="expected one DeprecationWarning"):
        _warns_once(lambda: silent["tokens"], r"out\.tokens")
    with pytest.raises(pytest.fail.Exception, match="DID NOT WARN"), pytest.warns(DeprecationWarning):
        silent["tokens"]
    # ... and a warning with the wrong advice is caught too.
    with pytest.raises(AssertionError):
        _warns_once(lambda: out["tokens"], r"out\.num_accepted")


def test_attribute_access_and_vars_do_not_warn() -> None:
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
