"""A fuzzer over the public API (issue 22): random shapes, dtypes, values, containers, keys,
per-row parameters, valid and invalid.

Surfaces: ``rejection_sample`` (and the ``numpy`` and ``torch`` samplers, which must agree
with it), ``sample_from_logits``, ``verify_from_logits``, ``speculative_generate`` on tiny
Llama models built from configs (also with one drafter object shared by concurrent calls in
threads, and any ``num_draft_tokens``), ``NgramDrafter``'s lengths, and the CLI's argument
parser.

The property: a call either returns a result that satisfies the documented contract (checked
against an independent reference where one is exact: the float64 ``numpy`` sampler on inputs
whose arithmetic is exact in float32, argmax for greedy rows, float64 softmax for
temperature-only rows, ``target.generate`` for greedy generation), or raises
``ValueError``/``TypeError`` whose message starts with the name of one of the call's
arguments. Another exception, a crash, a hang or a result outside the contract fails.

``SPECJAX_FUZZ`` selects the profile: unset or ``ci`` (``make test``) is bounded and
derandomized, so a run is reproducible and takes seconds; ``long`` (``make fuzz``, which
repeats runs for ``FUZZ_SECONDS`` with fresh seeds, see ``scripts/fuzz.py``) draws many
examples per run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import specjax
from specjax.generate.checks import PluginOutputError

# --------------------------------------------------------------------------- profiles and the property

settings.register_profile(
    "specjax-fuzz",
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
LONG = os.environ.get("SPECJAX_FUZZ", "ci") == "long"


def examples(ci: int, long: int = 300) -> settings:
    """``ci`` derandomized examples in the bounded profile; ``long`` random ones in the long profile."""
    return settings(settings.get_profile("specjax-fuzz"), max_examples=long if LONG else ci, derandomize=not LONG)


def assert_names_an_argument(err: BaseException, names: Iterable[str]) -> None:
    """The error is a ValueError/TypeError whose message starts with an argument's name."""
    names = tuple(names)
    assert isinstance(err, ValueError | TypeError), f"{type(err).__name__}: {err}"
    pattern = r"^({})[: ]".format("|".join(re.escape(n) for n in names))
    assert re.match(pattern, str(err)), f"the message names none of {names}: {err}"


def call(fn, *args, names: Iterable[str], **kwargs) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, error)`` for an error that names an argument; anything else fails."""
    try:
        return fn(*args, **kwargs), None
    except Exception as err:  # judged below: only ValueError/TypeError naming an argument pass
        assert_names_an_argument(err, names)
        return None, err


def host(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# NumPy in other byte orders and layouts too: big-endian arrays were read as garbage numbers (issue 58)
CONTAINERS = ("numpy", "list", "torch", "jax", "big-endian", "strided", "fortran")


def contain(x: np.ndarray, kind: str) -> Any:
    if kind == "big-endian":
        return x.astype(x.dtype.newbyteorder(">")) if x.dtype.kind in "fiu" else x
    if kind == "strided":  # a view that steps over every other element of a larger buffer
        return np.repeat(x, 2, axis=-1)[..., ::2] if x.ndim else x
    if kind == "fortran":
        return np.asfortranarray(x)
    if kind == "list":
        return x.tolist()
    if kind == "torch":
        if x.dtype == jnp.bfloat16:
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(x)) if x.dtype != object else x
    if kind == "jax":
        return jnp.asarray(x) if x.dtype != np.int64 else jnp.asarray(x.astype(np.int32))
    return x


def check_layout(n: np.ndarray, tokens: np.ndarray, x: np.ndarray, k: np.ndarray, vocab: int) -> None:
    """The rejection_sample layout: n in [0, k_b], accepted tokens, one emitted id in [0, V), then -1."""
    b, g = x.shape
    assert n.shape == (b,) and tokens.shape == (b, g + 1)
    assert n.dtype == np.int32 and tokens.dtype == np.int32
    for r in range(b):
        nr = int(n[r])
        assert 0 <= nr <= int(k[r]), (r, nr, k[r])
        assert tokens[r, :nr].tolist() == x[r, :nr].tolist()
        assert 0 <= tokens[r, nr] < vocab, tokens[r]
        assert np.all(tokens[r, nr + 1 :] == -1), tokens[r]


# --------------------------------------------------------------------------- rejection_sample

KERNEL_ARGS = ("draft_tokens", "draft_probs", "target_probs", "accept_uniforms", "sample_uniforms")
PROB_DTYPES = (np.float32, np.float16, np.float64, "bfloat16")


def _as_dtype(x: np.ndarray, dtype: Any) -> np.ndarray:
    if dtype == "bfloat16":
        return x.astype(jnp.bfloat16)
    return x.astype(dtype)


@st.composite
def kernel_case(draw):
    """Exact inputs (multiples of 2**-10, row sums < 1) and, maybe, one defect."""
    b = draw(st.integers(0, 3))
    g = draw(st.integers(0, 3))
    v = draw(st.sampled_from([1, 5, 8]))
    ints = st.integers(0, 12)
    q = np.array(draw(st.lists(ints, min_size=b * g * v, max_size=b * g * v)), np.float64).reshape(b, g, v) / 1024
    p = (
        np.array(draw(st.lists(ints, min_size=b * (g + 1) * v, max_size=b * (g + 1) * v)), np.float64).reshape(
            b, g + 1, v
        )
        / 1024
    )
    p[..., draw(st.integers(0, v - 1))] += 1 / 1024  # every p_i has a positive sum
    x = np.array(draw(st.lists(st.integers(0, v - 1), min_size=b * g, max_size=b * g)), np.int64).reshape(b, g)
    u = np.array(draw(st.lists(st.integers(0, 1023), min_size=b * g, max_size=b * g)), np.float64).reshape(b, g)
    s = np.array(draw(st.lists(st.integers(0, 1023), min_size=b, max_size=b)), np.float64)
    args = {
        "draft_tokens": x.astype(draw(st.sampled_from([np.int32, np.int64]))),
        "draft_probs": _as_dtype(q, draw(st.sampled_from(PROB_DTYPES))),
        "target_probs": _as_dtype(p, draw(st.sampled_from(PROB_DTYPES))),
        "accept_uniforms": (u / 1024).astype(draw(st.sampled_from([np.float32, np.float64]))),
        "sample_uniforms": (s / 1024).astype(draw(st.sampled_from([np.float32, np.float64]))),
    }
    defect = draw(
        st.sampled_from(
            [
                None,
                None,
                "token_low",
                "token_high",
                "token_float",
                "probs_nan",
                "probs_negative",
                "probs_inf",
                "target_zero_row",
                "uniform_one",
                "uniform_nan",
                "shape",
                "rank",
                "none",
                "string",
            ]
        )
    )
    blame = None
    if defect and b and g and defect.startswith("token"):
        blame = "draft_tokens"
        t = args["draft_tokens"].copy()
        if defect == "token_float":
            t = t.astype(np.float32)
        else:
            t[draw(st.integers(0, b - 1)), draw(st.integers(0, g - 1))] = (
                -1 if defect == "token_low" else draw(st.sampled_from([v, v + 7, 2**31 - 1]))
            )
        args["draft_tokens"] = t
    elif defect and b and defect.startswith("probs"):
        blame = draw(st.sampled_from(["target_probs", "draft_probs"] if g else ["target_probs"]))
        arr = args[blame].astype(np.float32)
        arr[(0,) * arr.ndim] = {"probs_nan": np.nan, "probs_negative": -0.25, "probs_inf": np.inf}[defect]
        args[blame] = arr
    elif defect == "target_zero_row" and b:
        blame = "target_probs"
        args[blame] = args[blame].copy()
        args[blame][draw(st.integers(0, b - 1)), draw(st.integers(0, g))] = 0
    elif defect and defect.startswith("uniform") and b:
        blame = draw(st.sampled_from(["sample_uniforms", "accept_uniforms"] if g else ["sample_uniforms"]))
        arr = args[blame].copy()
        arr[(0,) * arr.ndim] = 1.0 if defect == "uniform_one" else np.nan
        args[blame] = arr
    elif defect in ("shape", "rank", "none", "string"):
        blame = draw(st.sampled_from(KERNEL_ARGS))
        arr = args[blame]
        if defect == "shape":
            arr = np.concatenate([arr, arr[:1]], axis=0) if arr.shape[0] else np.zeros((1, *arr.shape[1:]), arr.dtype)
        elif defect == "rank":
            arr = arr[None]
        else:
            arr = None if defect == "none" else "not an array"
        args[blame] = arr
        if arr is None and blame == "draft_probs":  # valid: point masses at the draft tokens
            defect = blame = None
    else:
        defect = None
    # a list loses the shape (0, ...)
    container = draw(st.sampled_from(CONTAINERS if b and g else tuple(c for c in CONTAINERS if c != "list")))
    if container != "numpy":
        args = {
            k: (contain(a, container) if isinstance(a, np.ndarray) and a.dtype != jnp.bfloat16 else a)
            for k, a in args.items()
        }
    return args, (b, g, v), defect, blame, draw(st.booleans())


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=40)
@given(kernel_case(), st.sampled_from(["jax", "numpy", "torch"]))
def test_fuzz_rejection_sample(case, sampler):
    args, (b, g, v), defect, blame, validate = case
    fn = specjax.load_sampler(sampler)
    out, err = call(fn, **args, validate=validate, names=KERNEL_ARGS)
    if defect is None:
        assert err is None, f"valid inputs refused: {err}"
    if err is not None:
        if validate and blame is not None and defect not in ("shape", "rank"):
            assert str(err).startswith(blame), f"{defect} in {blame} blamed on: {err}"
        return
    assert not (validate and defect is not None and defect not in ("shape", "rank")), f"{defect} not caught"
    n, tokens = host(out.num_accepted), host(out.tokens)
    x = (
        host(args["draft_tokens"])
        if not isinstance(args["draft_tokens"], list)
        else np.asarray(args["draft_tokens"]).reshape(b, g)
    )
    check_layout(n, tokens, x.astype(np.int64), np.full(b, g), v)
    if defect is None:  # exact inputs: every sampler agrees with the float64 reference
        ref = specjax.load_sampler("numpy")(
            **{k: a if a is None or isinstance(a, list) else host(a) for k, a in args.items()}, validate=True
        )
        np.testing.assert_array_equal(n, ref.num_accepted)
        np.testing.assert_array_equal(tokens, ref.tokens)


# --------------------------------------------------------------------------- sample_from_logits / verify_from_logits

PARAM_ARGS = ("key", "temperature", "top_k", "top_p")


def _param(draw, name: str, b: int, valid: bool) -> Any:
    if name == "temperature":
        good = st.sampled_from([0.0, 1e-3, 0.5, 1.0, 3.0, 1e6])
        bad = st.sampled_from([-1.0, float("nan"), float("inf"), 1e38, 1e-39, "hot", None, 10**400])
    elif name == "top_k":
        good = st.sampled_from([None, 0, 1, 3, 100, 2**40, 2**70])
        bad = st.sampled_from([-1, -(2**70), 1.5, "3", True])
    else:
        good = st.sampled_from([None, 0.1, 0.5, 0.9, 1.0, 1])
        bad = st.sampled_from([0.0, -0.5, 1.5, float("nan"), "0.9"])
    value = draw(good if valid else bad)
    if b and value is not None and not isinstance(value, str) and draw(st.booleans()):
        rows = [draw(good) for _ in range(b)] if valid else [value] * b
        if any(r is None for r in rows) or any(isinstance(r, int) and abs(r) > 2**62 for r in rows):
            return value
        kind = draw(st.sampled_from(["list", "numpy", "torch", "jax", "big-endian"]))
        arr = np.asarray(rows)
        if arr.dtype == object:
            return value
        return contain(arr, kind) if kind != "jax" or arr.dtype != np.float64 else jnp.asarray(arr, jnp.float32)
    return value


def _key(draw, b: int, valid: bool) -> Any:
    if valid:
        key = jax.random.key(draw(st.integers(0, 9)))
        return key if draw(st.booleans()) else jax.random.split(key, b)
    return draw(
        st.sampled_from(
            [
                None,
                3,
                "key",
                np.zeros(2, np.uint32),
                jnp.zeros((3,), jnp.uint32),
                jnp.zeros((b + 1, 2), jnp.uint32),
                jnp.zeros((2,), jnp.float32),
                jax.random.split(jax.random.key(0), b + 2),
            ]
        )
    )


@st.composite
def logits_case(draw, rank: int):
    b = draw(st.integers(0, 3))
    g = draw(st.integers(0, 2)) if rank == 3 else 0
    v = draw(st.sampled_from([1, 6, 16]))
    shape = (b, v) if rank == 2 else (b, g + 1, v)
    n = int(np.prod(shape))
    vals = np.array(draw(st.lists(st.floats(-30, 30, width=32), min_size=n, max_size=n)), np.float32).reshape(shape)
    if n and draw(st.booleans()):  # some -inf logits (never a whole row)
        mask = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n))).reshape(shape)
        mask[..., 0] = False
        vals[mask] = -np.inf
    bad = draw(st.sampled_from([None] * 6 + ["key", "temperature", "top_k", "top_p", "logits_nan", "logits_rank"]))
    params = {name: _param(draw, name, b, bad != name) for name in ("temperature", "top_k", "top_p")}
    params["key"] = _key(draw, b, bad != "key")
    if bad == "logits_nan" and n:
        vals[(0,) * vals.ndim] = np.nan
    elif bad == "logits_rank":
        vals = vals[..., None]
    elif bad in ("logits_nan",):
        bad = None
    dtype = draw(st.sampled_from([np.float32, np.float16, np.float64, "bfloat16"]))
    if dtype == np.float16:
        vals = np.clip(vals, -60000, 60000)
    return vals, _as_dtype(vals, dtype), params, bad, draw(st.booleans()), (b, g, v)


def _softmax64(row: np.ndarray, t: float) -> np.ndarray:
    z = row.astype(np.float64) / t
    z = z - np.max(z)
    e = np.exp(z)
    return e / e.sum()


def _row(value: Any, r: int) -> Any:
    if value is None or np.ndim(host(value) if not isinstance(value, list) else value) == 0:
        return value
    return (host(value) if not isinstance(value, list) else np.asarray(value))[r]


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=40)
@given(logits_case(rank=2), st.sampled_from(CONTAINERS))
def test_fuzz_sample_from_logits(case, container):
    _, logits, params, bad, validate, (b, _, v) = case
    container = container if b else "numpy"  # a list loses the shape (0, V)
    arg = contain(logits, container) if not (container == "list" and logits.dtype == jnp.bfloat16) else logits
    out, err = call(specjax.sample_from_logits, arg, **params, validate=validate, names=("logits", *PARAM_ARGS))
    if bad is None:
        assert err is None, f"valid inputs refused: {err}"
    if err is not None:
        if validate and bad not in (None, "logits_rank"):
            assert str(err).startswith(bad.split("_")[0]), f"{bad} blamed on: {err}"
        return
    assert not (validate and bad is not None), f"{bad} not caught"
    tokens, probs = host(out[0]), host(out[1])
    assert tokens.shape == (b,) and probs.shape == (b, v)
    assert np.all((tokens >= 0) & (tokens < v)), tokens
    if bad is not None:
        return  # unvalidated bad values: in-range tokens are all the contract promises
    x = np.asarray(jnp.asarray(logits).astype(jnp.float32))  # what the kernel sees
    x = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)  # XLA:CPU flushes subnormals to 0
    for r in range(b):
        assert np.all(probs[r] >= 0) and abs(probs[r].sum() - 1) < 1e-4, probs[r]
        assert probs[r, tokens[r]] > 0
        t, k, p = (
            float(_row(params[n], r)) if _row(params[n], r) is not None else None
            for n in ("temperature", "top_k", "top_p")
        )
        if t == 0:
            assert tokens[r] == int(np.argmax(x[r])) and probs[r, tokens[r]] == 1
        elif (k is None or k == 0 or k >= v) and (p is None or p == 1):
            np.testing.assert_allclose(probs[r], _softmax64(x[r], t), atol=2e-5)
        elif k:
            # top-k keeps the relative scaled logits (x - max)·(1/T) >= the k-th largest, in float32
            # (RowStats): logits that differ by less than max's rounding there tie and are kept together
            rel = (x[r] - x[r].max()) * np.float32(1 / np.float32(t))
            kth = np.sort(rel)[::-1][int(min(k, v)) - 1]
            assert np.all(probs[r][rel < kth] == 0)


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=40)
@given(logits_case(rank=3), st.data())
def test_fuzz_verify_from_logits(case, data):
    _, target, params, bad, validate, (b, g, v) = case
    draft = data.draw(st.sampled_from([target[:, :g] if target.ndim == 3 else target, np.zeros((b, g, v), np.float32)]))
    x = np.array(data.draw(st.lists(st.integers(0, max(v - 1, 0)), min_size=b * g, max_size=b * g)), np.int64).reshape(
        b, g
    )
    k = None
    if b and data.draw(st.booleans()):
        k = np.array(data.draw(st.lists(st.integers(0, g), min_size=b, max_size=b)), np.int32)
    tok_defect = b and g and bad is None and data.draw(st.integers(0, 5)) == 0
    if tok_defect:
        x[0, 0] = data.draw(st.sampled_from([-1, v, 2**31 - 1]))
        if k is not None:
            k[0] = max(k[0], 1)
    kinds = [c for c in CONTAINERS if c != "list" or (b and g)]  # a list loses the shape (0, ...)
    container = data.draw(st.sampled_from(kinds))
    wrap = (lambda a: contain(a, container) if a.dtype != jnp.bfloat16 else a) if container != "numpy" else np.asarray
    out, err = call(
        specjax.verify_from_logits,
        wrap(x),
        wrap(draft),
        wrap(target),
        **params,
        draft_lengths=k,
        validate=validate,
        names=("draft_tokens", "draft_logits", "target_logits", "draft_lengths", *PARAM_ARGS),
    )
    if bad is None and not tok_defect:
        assert err is None, f"valid inputs refused: {err}"
    if err is not None:
        return
    assert not (validate and (bad not in (None, "logits_rank") or tok_defect)), f"{bad or 'token'} not caught"
    n, tokens = host(out.num_accepted), host(out.tokens)
    kk = np.full(b, g) if k is None else k
    check_layout(n, tokens, x, kk, v)
    if bad is not None:
        return
    t_x = np.asarray(jnp.asarray(target).astype(jnp.float32))
    t_x = np.where(np.abs(t_x) < np.finfo(np.float32).tiny, np.float32(0), t_x)  # XLA:CPU flushes subnormals
    for r in range(b):
        if _row(params["temperature"], r) is not None and float(_row(params["temperature"], r)) == 0:
            # greedy rows: x_i accepted iff it is the argmax; the emitted token is the argmax
            want = 0
            while want < kk[r] and x[r, want] == int(np.argmax(t_x[r, want])):
                want += 1
            assert n[r] == want and tokens[r, want] == int(np.argmax(t_x[r, want])), (r, n[r], tokens[r])


# --------------------------------------------------------------------------- speculative_generate on tiny models

V = 48
GEN_ARGS = (
    "target",
    "draft",
    "input_ids",
    "attention_mask",
    "max_new_tokens",
    "num_draft_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "eos_token_id",
    "pad_token_id",
    "sampler",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_p",
    "bad_words_ids",
)


@pytest.fixture(scope="module")
def tiny_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(layers: int, seed: int) -> Any:
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = LlamaForCausalLM(cfg).eval()
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        return model

    return make(2, 0), make(1, 1)


@st.composite
def generate_case(draw):
    b = draw(st.integers(1, 2))
    lengths = [draw(st.integers(1, 5)) for _ in range(b)]
    width = max(lengths)
    ids = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.tensor(draw(st.lists(st.integers(1, V - 1), min_size=n, max_size=n)))
        mask[r, width - n :] = 1
    kwargs = dict(
        max_new_tokens=draw(st.integers(1, 6)),
        num_draft_tokens=draw(st.integers(1, 2)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.8])),
        seed=draw(st.integers(0, 3)),
        sampler=draw(st.sampled_from(["jax", "jax", "numpy"])),
    )
    if draw(st.booleans()):
        kwargs["eos_token_id"] = draw(st.integers(1, V - 1))
    if draw(st.booleans()):  # logits processors (specjax.generate.processors)
        kwargs["repetition_penalty"] = draw(st.sampled_from([1.0, 1.3, 2]))
        kwargs["no_repeat_ngram_size"] = draw(st.sampled_from([0, 1, 2]))
        kwargs["min_p"] = draw(st.sampled_from([None, 0.05]))
    bad = draw(
        st.sampled_from(
            [None] * 8
            + [
                "input_ids",
                "attention_mask",
                "max_new_tokens",
                "num_draft_tokens",
                "temperature",
                "top_k",
                "top_p",
                "seed",
                "eos_token_id",
                "sampler",
                "target",
                "positions",
                "repetition_penalty",
                "no_repeat_ngram_size",
                "min_p",
                "bad_words_ids",
            ]
        )
    )
    if bad == "input_ids":
        ids = draw(st.sampled_from([ids + V, ids - 100, ids.float(), ids[0], "text"]))
    elif bad == "attention_mask":
        mask = draw(st.sampled_from([mask[:, :-1], torch.zeros_like(mask), mask.flip(1), "mask"]))
        if isinstance(mask, torch.Tensor) and mask.shape == ids.shape and bool(mask[:, -1].all()):
            bad = None
    elif bad == "positions":
        kwargs["max_new_tokens"] = 64
        bad = "max_new_tokens"
    elif bad == "target":
        kwargs["target"] = draw(st.sampled_from([None, "gpt2", torch.nn.Linear(2, 2)]))
    elif bad is not None:
        kwargs[bad] = draw(
            st.sampled_from(
                {
                    "max_new_tokens": [0, -1, 2.5, None, True],
                    "num_draft_tokens": [0, 1.0, "4"],
                    "temperature": [-1.0, float("nan"), 1e39, "warm"],
                    "top_k": [-3, 0.5],
                    "top_p": [0.0, 2.0],
                    "seed": [2**64, 1.5, "s"],
                    "eos_token_id": [-1, "eos", 1.5],
                    "sampler": ["no-such-sampler", 42],
                    "repetition_penalty": [-1.0, 0.0, "strong", True],
                    "no_repeat_ngram_size": [1.5, "2"],
                    "min_p": [1.5, -0.1, "p"],
                    "bad_words_ids": [[7], "bad", [[-1]]],
                }[bad]
            )
        )
    return ids, mask, kwargs, bad


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=8, long=100)
@given(case=generate_case())
def test_fuzz_speculative_generate(tiny_pair, case):
    target, draft = tiny_pair
    ids, mask, kwargs, bad = case
    kwargs = dict(kwargs)
    target = kwargs.pop("target", target)
    out, err = call(specjax.speculative_generate, target, draft, ids, mask, names=GEN_ARGS, **kwargs)
    if bad is None:
        assert err is None, f"valid inputs refused: {err}"
    if err is not None:
        return
    assert bad is None, f"bad {bad} not refused"
    b, width = ids.shape
    seq = out.sequences
    new = out.num_new_tokens
    assert seq.shape[0] == b and torch.equal(seq[:, :width], ids)
    assert int(new.max()) <= kwargs["max_new_tokens"] and int(new.min()) >= 1
    gen = seq[:, width:]
    for r in range(b):
        row = gen[r, : int(new[r])]
        assert bool(((row >= 0) & (row < V)).all())
        eos = kwargs.get("eos_token_id")
        if eos is not None and eos in row.tolist():
            assert row.tolist().index(eos) == len(row) - 1  # EOS ends the row
        elif int(new[r]) != kwargs["max_new_tokens"]:
            raise AssertionError(f"row {r} stopped early at {int(new[r])} tokens without EOS")
    if kwargs["temperature"] == 0:  # greedy: exactly the target's own greedy output, with the same processors
        processors = {k: kwargs[k] for k in ("repetition_penalty", "no_repeat_ngram_size") if k in kwargs}
        if "repetition_penalty" in processors:  # specjax takes an int penalty, transformers a float only
            processors["repetition_penalty"] = float(processors["repetition_penalty"])
        want = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=kwargs["max_new_tokens"],
            do_sample=False,
            pad_token_id=0,
            eos_token_id=kwargs.get("eos_token_id"),
            **processors,
        )
        assert torch.equal(seq[:, : want.shape[1]], want)


# --------------------------------------------------------------------------- drafters' outputs (issue 58)

DRAFT_DEFECTS = (None, None, "nan", "+inf", "all -inf", "narrow", "-inf at token", "lists", "hindsight nan", "count")


class FuzzDrafter:
    """Proposes drawn-looking tokens with draft logits over the vocabulary, or with one ``defect``."""

    name = "fuzz-drafter"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self, defect: str | None, seed: int, array: str) -> None:
        self.defect, self.rng, self.array = defect, np.random.default_rng(seed), array

    def start(self, setup) -> None:
        pass

    def propose(self, request):
        from specjax.drafters import Proposal

        b = len(request.contexts)
        g = int(np.max(request.max_tokens, initial=0))
        k = np.asarray(request.max_tokens, np.int64).copy()
        logits = self.rng.normal(size=(g, b, V)).astype(np.float32)
        tokens = np.stack([np.argmax(row, axis=-1) for row in logits], axis=1) if g else np.zeros((b, 0), np.int64)
        hindsight = None
        d, r, i = self.defect, int(self.rng.integers(0, b)), int(self.rng.integers(0, max(g, 1)))
        if g and d in ("nan", "+inf", "all -inf"):
            k[r] = max(k[r], i + 1) if request.max_tokens[r] > i else k[r]
            logits[i, r] = -np.inf if d == "all -inf" else logits[i, r]
            if d != "all -inf":
                logits[i, r, int(self.rng.integers(0, V))] = np.nan if d == "nan" else np.inf
        elif g and d == "narrow":
            logits = logits[:, :, : V // 2]
            tokens[:, :] = V - 1
        elif g and d == "-inf at token":
            logits[i, r, tokens[r, i]] = -np.inf
        elif d == "hindsight nan":
            hindsight = (np.full(b, np.nan), np.ones(b))
        convert = {"torch": lambda a: torch.from_numpy(a.copy()), "numpy": np.copy, "jax": jnp.asarray}[self.array]
        arrays: Any = tuple(convert(a) for a in logits)
        if g and d == "lists":
            arrays = tuple(a.tolist() for a in logits)
        elif g and d == "count":
            arrays = arrays[:-1]
        return Proposal(tokens, k, arrays, hindsight=hindsight)

    def commit(self, info) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=10, long=100)
@given(
    defect=st.sampled_from(DRAFT_DEFECTS),
    seed=st.integers(0, 2**16),
    array=st.sampled_from(["torch", "numpy", "jax"]),
    temperature=st.sampled_from([0.0, 0.8]),
    b=st.integers(1, 2),
)
def test_fuzz_drafter_outputs(tiny_pair, defect, seed, array, temperature, b):
    """A drafter's broken output is refused naming it, or (greedy, where q is never read) harmless.

    Never a silent result outside the contract: with valid proposals the output is the
    target's greedy output (greedy) or a full-length generation (sampled).
    """
    target, _ = tiny_pair
    ids = torch.tensor([[5, 17, 42, 8], [3, 3, 9, 1]][:b])
    drafter = FuzzDrafter(defect, seed, array)
    kw = dict(max_new_tokens=5, num_draft_tokens=2, adaptive=False, temperature=temperature, seed=seed)
    try:
        out = specjax.speculative_generate(target, drafter, ids, **kw)
    except PluginOutputError as err:
        assert str(err).startswith("drafter 'fuzz-drafter'"), err
        assert defect is not None, f"valid proposals refused: {err}"
        reads_q = defect not in ("lists", "count", "hindsight nan")
        assert not (temperature == 0 and reads_q), f"greedy steps read q: {err}"
        return
    # shapes and hindsight are checked every step, values on sampled steps only
    assert defect is None or (temperature == 0 and defect not in ("lists", "count", "hindsight nan")), (
        f"{defect} not refused"
    )
    assert out.num_new_tokens.tolist() == [5] * b
    if temperature == 0:
        want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
        assert torch.equal(out.sequences, want)


# --------------------------------------------------------------------------- drafters: shared, n-gram lengths, G


def _greedy(target: Any, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    return target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)


@st.composite
def shared_drafter_case(draw):
    """A drafter kind and 2-3 calls (prompts, lengths, temperature, seed) that will share one drafter object."""
    kind = draw(st.sampled_from(["ngram", "model", "hybrid"]))
    calls = []
    for _ in range(draw(st.integers(2, 3))):
        b = draw(st.integers(1, 3))
        n = draw(st.integers(2, 10))
        phrase = draw(st.lists(st.integers(1, V - 1), min_size=1, max_size=4))
        rows = [
            (phrase * n)[:n] if draw(st.booleans()) else draw(st.lists(st.integers(1, V - 1), min_size=n, max_size=n))
            for _ in range(b)
        ]
        calls.append(
            dict(
                ids=torch.tensor(rows),
                max_new_tokens=draw(st.integers(2, 8)),
                num_draft_tokens=draw(st.integers(1, 4)),
                temperature=draw(st.sampled_from([0.0, 0.0, 1.0])),
                seed=draw(st.integers(0, 3)),
            )
        )
    return kind, calls


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=6, long=60)
@given(case=shared_drafter_case())
def test_fuzz_shared_drafter_across_threads(tiny_pair, case):
    """Calls sharing one drafter object, all inside their loops at once (threads): each gives what it gives alone."""
    import threading

    from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter

    target, draft = tiny_pair
    kind, calls = case

    def fresh() -> Any:
        return {"ngram": NgramDrafter, "model": lambda: ModelDrafter(draft)}.get(
            kind, lambda: HybridDrafter(NgramDrafter(), ModelDrafter(draft))
        )()

    def run(c: dict, drafter: Any, on_tokens: Any = None) -> torch.Tensor:
        return specjax.speculative_generate(
            target,
            drafter,
            c["ids"],
            max_new_tokens=c["max_new_tokens"],
            num_draft_tokens=c["num_draft_tokens"],
            temperature=c["temperature"],
            seed=c["seed"],
            adaptive=False,  # sampled outputs reproducible from the seed
            on_tokens=on_tokens,
        ).sequences

    alone = [run(c, fresh()) for c in calls]
    shared = fresh()
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def work(i: int) -> None:
        waited = [False]

        def on_tokens(row: int, tokens: list[int]) -> None:
            if not waited[0]:  # every call has started (holds its drafter) before any goes on
                waited[0] = True
                barrier.wait(timeout=60)

        try:
            results[i] = run(calls[i], shared, on_tokens)
        except BaseException as err:  # judged below
            barrier.abort()
            results[i] = err

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a call hung"
    for c, want, got in zip(calls, alone, results, strict=True):
        assert isinstance(got, torch.Tensor), [repr(r) for r in results]
        assert torch.equal(got, want)
        if c["temperature"] == 0:
            assert torch.equal(got, _greedy(target, c["ids"], torch.ones_like(c["ids"]), c["max_new_tokens"]))


_LENGTHS = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([10**3, 10**7, 2**70, 1.0, 2.5, True, None, "5", np.int64(3), np.int32(40)]),
)


@examples(ci=60, long=1000)
@given(_LENGTHS, _LENGTHS, st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(0, 8))
def test_fuzz_ngram_lengths(min_n, max_n, context, k):
    """Any (min_n, max_n): refused by name, or an index that proposes what a brute-force search finds."""
    from specjax.drafters import NgramDrafter
    from specjax.drafters.ngram import MAX_NGRAM, NgramIndex

    drafter, err = call(NgramDrafter, min_n, max_n, names=("min_n", "max_n"))
    if err is not None:
        return
    assert 1 <= drafter.min_n <= drafter.max_n <= MAX_NGRAM
    idx = NgramIndex(context, drafter.min_n, drafter.max_n)
    want: list[int] = []
    for n in range(min(drafter.max_n, len(context)), drafter.min_n - 1, -1):
        suffix = context[len(context) - n :]
        ends = [e for e in range(n - 1, len(context) - 1) if context[e - n + 1 : e + 1] == suffix]
        if ends:
            want = context[ends[-1] + 1 : ends[-1] + 1 + k]
            break
    assert idx.lookup(k) == want
    assert len(idx.tables) == drafter.max_n - drafter.min_n + 1


@pytest.mark.slow  # seconds of examples: make test, not make test-fast
@examples(ci=8, long=100)
@given(
    st.one_of(st.integers(-2, 200), st.sampled_from([10**7, 2**63, 2**70, np.int64(128), np.int64(129)])),
    st.integers(1, 6),
    st.sampled_from(["ngram", "model"]),
)
def test_fuzz_num_draft_tokens(tiny_pair, g, max_new_tokens, drafter):
    """Any G: refused by name, or the greedy output with statistics no longer than a row can draft."""
    from specjax.generate.checks import MAX_DRAFT_TOKENS

    target, draft = tiny_pair
    ids = torch.tensor([[3, 9, 4, 3, 9, 4, 3]])
    out, err = call(
        specjax.speculative_generate,
        target,
        draft if drafter == "model" else drafter,
        ids,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=g,
        names=GEN_ARGS,
    )
    if err is not None:
        assert str(err).startswith("num_draft_tokens") and not 1 <= g <= MAX_DRAFT_TOKENS, err
        return
    assert 1 <= g <= MAX_DRAFT_TOKENS
    assert torch.equal(out.sequences, _greedy(target, ids, torch.ones_like(ids), max_new_tokens))
    positions = len(out.stats.acceptance_rate_per_position)
    assert positions == len(out.stats.tests_per_position) == min(int(g), max(max_new_tokens - 1, 1))


# --------------------------------------------------------------------------- the CLI's argument parser

FLAGS = [
    "--target",
    "--draft",
    "--gguf-file",
    "--prompt",
    "--prompts-file",
    "--max-new-tokens",
    "--num-draft-tokens",
    "--temperature",
    "--top-k",
    "--top-p",
    "--seed",
    "--batch-size",
    "--device",
    "--sampler",
    "--chat",
    "--json",
    "--debug",
    "--quick",
    "--out",
    "--sections",
    "--jax-cpu-threads",
    "--bogus",
    "-x",
]
VALUES = [
    "0",
    "1",
    "-1",
    "4",
    "0.5",
    "1e38",
    "1e400",
    "nan",
    "inf",
    "-inf",
    "",
    " ",
    "abc",
    "cuda",
    "cpu",
    "jax",
    "9" * 30,
    "-9" * 20,
    "0x10",
    "1_000",
    "  7 ",
    "\u0661",
    "--",
    "=",
    "ü",
]


@examples(ci=200, long=3000)
@given(
    st.lists(st.sampled_from(["generate", "demo", "bench", "nope"]), max_size=1),
    st.lists(st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES), st.text(max_size=6)), max_size=8),
)
def test_fuzz_cli_argument_parser(command, rest):
    from specjax.cli import CLIError, build_parser
    from specjax.generate.checks import MAX_DRAFT_TOKENS

    argv = [*command, *rest]
    assume(not any(a in ("-h", "--help") or a.startswith("--h") for a in argv))
    try:
        args = build_parser().parse_args(argv)
    except CLIError as err:
        text = str(err)
        assert text.startswith("specjax") and "\n" not in text, text
        return
    # parsed: every numeric option satisfies its type's contract
    for name in ("max_new_tokens", "num_draft_tokens", "batch_size", "jax_cpu_threads"):
        value = getattr(args, name, None)
        assert value is None or (isinstance(value, int) and value >= 1), (name, value)
    assert getattr(args, "num_draft_tokens", None) is None or args.num_draft_tokens <= MAX_DRAFT_TOKENS
    if getattr(args, "top_k", None) is not None:
        assert args.top_k >= 0
    if getattr(args, "temperature", None) is not None:
        assert np.isfinite(args.temperature) and args.temperature >= 0
    if getattr(args, "top_p", None) is not None:
        assert 0 < args.top_p <= 1
    if getattr(args, "seed", None) is not None:
        assert -(2**63) <= args.seed < 2**63
