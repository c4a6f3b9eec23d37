"""The front end's boundary: keys and determinism, compilation caching, validation messages, compile options.

``sample_from_logits`` and ``verify_from_logits``: per-row keys make a row's
result independent of its batch; new parameter values never recompile; every
error message names the argument, what was expected and what it got; every
jitted function that turns logits into probabilities compiles with the same
vector options (so the draft's and the test's ``q`` are the same bits).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from frontend_reference import (
    MB,
    MG,
    MV,
    SB,
    SV,
    make_case,
    sample_draft_tokens,
)

from specjax import sample_from_logits, verify_from_logits
from specjax.kernels import frontend
from specjax.kernels.types import SamplingParams

# --------------------------------------------------------------------------- #
# Keys and determinism
# --------------------------------------------------------------------------- #


def _main_inputs(seed=10, noise=0.3):
    rng = np.random.default_rng(seed)
    draft, target = make_case(rng, MB, MG, MV, noise=noise)
    x = sample_draft_tokens(rng, draft, np.full(MB, 0.9), np.zeros(MB, int), np.ones(MB))
    params = dict(
        temperature=rng.choice([0.0, 0.5, 0.9, 1.2], MB),
        top_k=rng.choice([0, 1, 5, 30], MB),
        top_p=rng.choice([1.0, 0.95, 0.7], MB),
        draft_lengths=rng.integers(0, MG + 1, MB),
    )
    return x, draft, target, params


def _rows(params, index):
    return {k: np.asarray(v)[index] for k, v in params.items()}


def test_per_row_keys_make_rows_independent_of_their_batch():
    x, draft, target, params = _main_inputs()
    keys = jax.random.split(jax.random.key(5), MB)
    full = np.asarray(verify_from_logits(x, draft, target, key=keys, **params).tokens)
    for i in (0, 1, 7, MB - 1):
        alone = verify_from_logits(
            x[i : i + 1], draft[i : i + 1], target[i : i + 1], key=keys[i : i + 1], **_rows(params, slice(i, i + 1))
        )
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], full[i], err_msg=f"row {i}")
    # In another batch order (other neighbours, same shapes) the rows move with their keys.
    perm = np.random.default_rng(0).permutation(MB)
    shuffled = verify_from_logits(x[perm], draft[perm], target[perm], key=keys[perm], **_rows(params, perm))
    np.testing.assert_array_equal(np.asarray(shuffled.tokens), full[perm])
    # Sampling too.
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((SB, SV)).astype(np.float32)
    skeys = jax.random.split(jax.random.key(6), SB)
    sp = dict(
        temperature=rng.choice([0.0, 0.7, 1.0], SB), top_k=rng.choice([0, 5], SB), top_p=rng.choice([1.0, 0.8], SB)
    )
    t_full, _ = sample_from_logits(logits, key=skeys, **sp)
    sperm = np.array([3, 0, 5, 1, 4, 2])
    t_perm, _ = sample_from_logits(logits[sperm], key=skeys[sperm], **_rows(sp, sperm))
    np.testing.assert_array_equal(np.asarray(t_perm), np.asarray(t_full)[sperm])


def test_same_key_same_result_and_keys_matter():
    x, draft, target, _ = _main_inputs(noise=2.0)  # a poor draft: outcomes spread over many tokens
    kw = dict(temperature=1.0, top_k=30, top_p=1.0)
    a = verify_from_logits(x, draft, target, key=jax.random.key(7), **kw)
    b = verify_from_logits(x, draft, target, key=jax.random.key(7), **kw)
    c = verify_from_logits(x, draft, target, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
    logits = np.random.default_rng(3).standard_normal((SB, SV)).astype(np.float32)
    s1, _ = sample_from_logits(logits, key=jax.random.key(7), **kw)
    s2, _ = sample_from_logits(logits, key=jax.random.key(7), **kw)
    s3, _ = sample_from_logits(logits, key=jax.random.key(8), **kw)
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s2))
    assert not np.array_equal(np.asarray(s1), np.asarray(s3))


def test_raw_uint32_keys_are_accepted():
    x, draft, target, _ = _main_inputs()
    typed = verify_from_logits(x, draft, target, key=jax.random.key(3), temperature=0.8)
    raw = verify_from_logits(x, draft, target, key=jax.random.PRNGKey(3), temperature=0.8)
    np.testing.assert_array_equal(np.asarray(typed.tokens), np.asarray(raw.tokens))
    kw = dict(temperature=0.8, top_k=0, top_p=1.0)
    a = verify_from_logits(x, draft, target, key=jax.random.split(jax.random.PRNGKey(3), MB), **kw)  # u32[B, 2]
    b = verify_from_logits(x, draft, target, key=jax.random.split(jax.random.key(3), MB), **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    logits = np.random.default_rng(2).standard_normal((SB, SV)).astype(np.float32)
    t1, _ = sample_from_logits(logits, key=jax.random.PRNGKey(4), temperature=0.8, top_k=0, top_p=1.0)
    t2, _ = sample_from_logits(logits, key=jax.random.key(4), temperature=0.8, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))


# --------------------------------------------------------------------------- #
# Compilation
# --------------------------------------------------------------------------- #


def test_changing_parameter_values_never_recompiles():
    # bfloat16 logits: a dtype no other test feeds to verify, so the first call compiles.
    x, draft, target, _ = _main_inputs()
    draft, target = jnp.asarray(draft, jnp.bfloat16), jnp.asarray(target, jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), MB)

    def call(**kw):
        params = dict(temperature=0.7, top_k=5, top_p=0.9, key=keys)
        params.update(kw)
        jax.block_until_ready(verify_from_logits(x, draft, target, **params))

    before = frontend._verify_jit._cache_size()
    call()
    assert frontend._verify_jit._cache_size() == before + 1  # the counter can fail
    rng = np.random.default_rng(0)
    variants = [
        dict(temperature=1.3),
        dict(temperature=0.0),
        dict(temperature=rng.choice([0.0, 0.5, 1.0, 2.0], MB).tolist()),
        dict(temperature=rng.random(MB).astype(np.float32)),
        dict(temperature=jnp.asarray(rng.random(MB))),
        dict(temperature=jnp.asarray(0.5)),
        dict(temperature=2),
        dict(top_k=0),
        dict(top_k=rng.integers(0, 100, MB).tolist()),
        dict(top_k=jnp.asarray(rng.integers(0, 10, MB))),
        dict(top_k=np.int64(3)),
        dict(top_p=1.0),
        dict(top_p=rng.uniform(0.1, 1.0, MB).tolist()),
        dict(top_p=jnp.asarray(rng.uniform(0.1, 1.0, MB), jnp.float32)),
        dict(draft_lengths=rng.integers(0, MG + 1, MB)),
        dict(draft_lengths=np.zeros(MB, np.int32)),
        dict(draft_lengths=MG),
        dict(key=jax.random.split(jax.random.key(9), MB)),
        dict(key=jax.random.split(jax.random.PRNGKey(9), MB)),  # raw uint32 keys
    ]
    for kw in variants:
        call(**kw)
        assert frontend._verify_jit._cache_size() == before + 1, f"recompiled for {kw}"


def test_changing_parameter_values_never_recompiles_sampling():
    rng = np.random.default_rng(12)
    logits = rng.standard_normal((SB, SV)).astype(np.float32)
    jax.block_until_ready(sample_from_logits(logits, key=jax.random.key(0), temperature=0.7, top_k=5, top_p=0.9))
    before = frontend._sample_jit._cache_size()
    for t, k, p in [
        (0.0, 1, 0.1),
        ([0.0, 1.0, 2.0, 0.5, 1, 1], [0, 1, 2, 50, 3, 3], [1.0, 0.2, 0.5, 0.9, 1, 1]),
        (jnp.asarray(1.5), jnp.asarray(3), jnp.asarray(0.4)),
    ]:
        jax.block_until_ready(sample_from_logits(logits, key=jax.random.key(3), temperature=t, top_k=k, top_p=p))
        assert frontend._sample_jit._cache_size() == before, (t, k, p)


# --------------------------------------------------------------------------- #
# Validation: table-driven; every message names the argument, what was expected
# and what was got. One row (B = 1) for verify, SB rows for sampling.
# --------------------------------------------------------------------------- #

VB, VG = 1, MG


def _good_verify_args():
    rng = np.random.default_rng(13)
    return dict(
        draft_tokens=rng.integers(0, MV, (VB, VG)),
        draft_logits=rng.standard_normal((VB, VG, MV)).astype(np.float32),
        target_logits=rng.standard_normal((VB, VG + 1, MV)).astype(np.float32),
        key=jax.random.split(jax.random.key(0), VB),
        temperature=0.7,
        top_k=5,
        top_p=0.9,
    )


def _with(**changes):
    return changes


VERIFY_ERRORS = [
    (
        "draft_tokens-rank",
        _with(draft_tokens=np.zeros((VB,), np.int32)),
        r"draft_tokens: expected rank 2 with shape \(B, G\), got shape \(1,\)",
    ),
    (
        "draft_logits-shape",
        _with(draft_logits=np.zeros((VB, VG + 1, MV), np.float32)),
        r"draft_logits: expected shape \(B, G, V\) = \(1, 4, 40\), got \(1, 5, 40\)",
    ),
    (
        "target_logits-shape",
        _with(target_logits=np.zeros((VB, VG, MV), np.float32)),
        r"target_logits: expected shape \(B, G\+1, V\) = \(1, 5, 40\), got \(1, 4, 40\)",
    ),
    (
        "target_logits-batch",
        _with(target_logits=np.zeros((VB + 2, VG + 1, MV), np.float32)),
        r"target_logits: expected shape \(B, G\+1, V\) = \(1, 5, 40\), got \(3, 5, 40\)",
    ),
    (
        "draft_tokens-batch",
        _with(draft_tokens=np.zeros((VB + 1, VG), np.int32)),
        r"draft_tokens: expected shape \(B, G\) = \(1, 4\) like the logits, got \(2, 4\)",
    ),
    (
        "draft_tokens-draft-length",
        _with(draft_tokens=np.zeros((VB, VG - 1), np.int32)),
        r"draft_tokens: expected shape \(B, G\) = \(1, 4\) like the logits, got \(1, 3\)",
    ),
    (
        "vocab-mismatch",
        _with(draft_logits=np.zeros((VB, VG, MV - 8), np.float32)),
        r"draft_logits: expected the target's vocabulary size V = 40, got 32",
    ),
    (
        "logits-int",
        _with(target_logits=np.zeros((VB, VG + 1, MV), np.int32)),
        r"target_logits: expected a floating dtype .*, got int32",
    ),
    (
        "draft-token-range",
        _with(draft_tokens=np.full((VB, VG), MV)),
        r"draft_tokens: expected token ids in \[0, V\) = \[0, 40\) .*got values in \[40, 40\]",
    ),
    (
        "draft-token-negative",
        _with(draft_tokens=np.full((VB, VG), -3)),
        r"draft_tokens: expected token ids in \[0, V\) = \[0, 40\) .*got values in \[-3, -3\]",
    ),
    (
        "nan-logits",
        _with(target_logits=np.full((VB, VG + 1, MV), np.nan, np.float32)),
        r"target_logits: expected no NaN or \+inf logits, got 200 NaN",
    ),
    (
        "inf-draft-logits",
        _with(draft_logits=np.full((VB, VG, MV), np.inf, np.float32)),
        r"draft_logits: expected no NaN or \+inf logits, got 0 NaN and 160 \+inf",
    ),
    (
        "temperature-negative",
        _with(temperature=-0.5),
        r"temperature: expected finite values >= 0 \(0 = greedy\), got \[-0.5\]",
    ),
    ("temperature-nan", _with(temperature=float("nan")), r"temperature: expected finite values >= 0"),
    (
        "temperature-shape",
        _with(temperature=[0.5, 0.5]),
        r"temperature: expected a scalar or shape \(B,\) = \(1,\), got shape \(2,\)",
    ),
    (
        "temperature-none",
        _with(temperature=None),
        r"temperature: expected a number >= 0 or an array of shape \(B,\), got None",
    ),
    ("top_p-zero", _with(top_p=0.0), r"top_p: expected values in \(0, 1\], got \[0.0\]"),
    ("top_p-above-one", _with(top_p=1.5), r"top_p: expected values in \(0, 1\], got \[1.5\]"),
    ("top_p-negative", _with(top_p=[-0.1]), r"top_p: expected values in \(0, 1\], got \[-0.1\]"),
    (
        "top_p-shape",
        _with(top_p=np.full((VB, 1), 0.9)),
        r"top_p: expected a scalar or shape \(B,\) = \(1,\), got shape \(1, 1\)",
    ),
    ("top_k-negative", _with(top_k=-1), r"top_k: expected integers >= 0 \(0 = no top-k\), got \[-1\]"),
    ("top_k-float", _with(top_k=2.5), r"top_k: expected integers, got dtype float64"),
    ("top_k-shape", _with(top_k=[1, 2, 3]), r"top_k: expected a scalar or shape \(B,\) = \(1,\), got shape \(3,\)"),
    (
        "draft_lengths-too-big",
        _with(draft_lengths=[VG + 1]),
        r"draft_lengths: expected values in \[0, G\] = \[0, 4\], got \[5\]",
    ),
    (
        "draft_lengths-negative",
        _with(draft_lengths=-1),
        r"draft_lengths: expected values in \[0, G\] = \[0, 4\], got \[-1\]",
    ),
    (
        "draft_lengths-shape",
        _with(draft_lengths=[1, 2]),
        r"draft_lengths: expected a scalar or shape \(B,\) = \(1,\), got shape \(2,\)",
    ),
    ("draft_lengths-float", _with(draft_lengths=[1.0]), r"draft_lengths: expected integers, got dtype float64"),
    ("key-none", _with(key=None), r"key: expected a JAX PRNG key .*got None"),
    ("key-int", _with(key=0), r"key: expected a JAX PRNG key .*got int"),
    (
        "key-shape",
        _with(key=jax.random.split(jax.random.key(0), VB + 2)),
        r"key: expected one key \(shape \(\)\) or one per row \(shape \(1,\)\), got shape \(3,\)",
    ),
    (
        "key-float-array",
        _with(key=jnp.zeros((2,), jnp.float32)),
        r"key: expected a JAX PRNG key .*got an array of dtype float32",
    ),
]


@pytest.mark.parametrize("name,changes,pattern", VERIFY_ERRORS, ids=[c[0] for c in VERIFY_ERRORS])
def test_verify_rejects_bad_input(name, changes, pattern):
    args = _good_verify_args()
    args.update(changes)
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    with pytest.raises(ValueError, match=pattern):
        verify_from_logits(*positional, **args)


def test_verify_good_args_are_accepted():
    """The table's baseline is valid, so each error above comes from its one change."""
    args = _good_verify_args()
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    out = verify_from_logits(*positional, **args)
    assert out.tokens.shape == (VB, VG + 1)


def test_missing_key_argument():
    """Omitting ``key`` (a required keyword) is Python's TypeError; key=None is the ValueError above."""
    args = _good_verify_args()
    del args["key"]
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    with pytest.raises(TypeError, match="key"):
        verify_from_logits(*positional, **args)


SAMPLE_ERRORS = [
    (
        "logits-rank",
        _with(logits=np.zeros((SB, 3, SV), np.float32)),
        r"logits: expected rank 2 with shape \(B, V\), got shape \(6, 3, 64\)",
    ),
    ("logits-int", _with(logits=np.zeros((SB, SV), np.int64)), r"logits: expected a floating dtype .*got int64"),
    ("logits-nan", _with(logits=np.full((SB, SV), np.nan, np.float32)), r"logits: expected no NaN or \+inf"),
    (
        "logits-all-neg-inf",
        _with(logits=np.full((SB, SV), -np.inf, np.float32)),
        r"logits: expected every row to have a finite logit, got 6 rows of all -inf",
    ),
    (
        "temperature-row-negative",
        _with(temperature=[1.0, 1.0, -1.0, 1.0, 1.0, 1.0]),
        r"temperature: expected finite values >= 0 \(0 = greedy\), got \[1.0, 1.0, -1.0, 1.0, 1.0, 1.0\]",
    ),
    ("temperature-inf", _with(temperature=float("inf")), r"temperature: expected finite values >= 0"),
    (
        "top_p-zero-row",
        _with(top_p=[0.9, 0.9, 0.9, 0.0, 0.9, 0.9]),
        r"top_p: expected values in \(0, 1\], got \[0.9, 0.9, 0.9, 0.0, 0.9, 0.9\]",
    ),
    (
        "top_k-negative-row",
        _with(top_k=[3, 3, 3, 3, 3, -2]),
        r"top_k: expected integers >= 0 \(0 = no top-k\), got \[3, 3, 3, 3, 3, -2\]",
    ),
    ("key-none", _with(key=None), r"key: expected a JAX PRNG key"),
    (
        "key-shape",
        _with(key=jax.random.split(jax.random.key(0), 3)),
        r"key: expected one key \(shape \(\)\) or one per row \(shape \(6,\)\), got shape \(3,\)",
    ),
]


@pytest.mark.parametrize("name,changes,pattern", SAMPLE_ERRORS, ids=[c[0] for c in SAMPLE_ERRORS])
def test_sample_rejects_bad_input(name, changes, pattern):
    args = dict(logits=np.zeros((SB, SV), np.float32), key=jax.random.key(0), temperature=1.0, top_k=3, top_p=0.9)
    args.update(changes)
    logits = args.pop("logits")
    with pytest.raises(ValueError, match=pattern):
        sample_from_logits(logits, **args)


def test_validate_false_skips_value_checks_only():
    args = _good_verify_args()
    positional = [args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits")]
    verify_from_logits(*positional, **{**args, "temperature": -1.0}, validate=False)  # no host sync, no error
    with pytest.raises(ValueError, match=re.escape("draft_logits: expected shape (B, G, V) = (1, 4, 40)")):
        verify_from_logits(positional[0], positional[1][:, :2], positional[2], **args, validate=False)


def test_validate_false_narrows_torch_int64_ids_without_the_int32_range_check():
    """With validate=False, torch int64 ids are narrowed by torch (no range check, like
    the unchecked [0, V) range); with validate=True an id beyond int32 is refused."""

    args = _good_verify_args()
    x, draft, target = (args.pop(k) for k in ("draft_tokens", "draft_logits", "target_logits"))
    ids = torch.from_numpy(np.asarray(x, np.int64))
    want = verify_from_logits(np.asarray(x, np.int32), draft, target, **args)
    got = verify_from_logits(ids, draft, target, **args, validate=False)
    for key in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(got, key)), np.asarray(getattr(want, key)))
    # "tensor: " where the tensor crosses by DLPack (a JAX whose default device is not the CPU)
    with pytest.raises(ValueError, match=r"draft_tokens: (tensor: )?token ids must fit in int32 \["):
        verify_from_logits(ids + 2**33, draft, target, **args)


# --------------------------------------------------------------------------- #
# Compile options: every function that turns logits into probabilities agrees
# --------------------------------------------------------------------------- #


def _logits_jits():
    """(name, lowered) for every jitted entry point that processes logits."""
    from jax.sharding import Mesh

    from specjax.kernels import sharded, steps

    b, g, v = 2, 3, 40
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, v, (b, g)), jnp.int32)
    d, t = jnp.zeros((b, g, v)), jnp.zeros((b, g + 1, v))
    key, keys = jax.random.key(0), jax.random.split(jax.random.key(0), b)
    f32, i32 = jnp.zeros((b,), jnp.float32), jnp.zeros((b,), jnp.int32)
    params = SamplingParams(f32, i32, f32, use_top_k=True, use_top_p=True)
    layout = sharded.MeshLayout(Mesh(np.array(jax.devices()[:1]), ("x",)), batch_axis="x")
    return [
        ("frontend._verify_jit", frontend._verify_jit.lower(tokens, d, t, key, params, i32 + g)),
        ("frontend._sample_jit", frontend._sample_jit.lower(t[:, 0], key, params)),
        ("steps.draft_draw", steps.draft_draw.lower(t[:, 0], keys, 0, 1, params, vocab=v)),
        (
            "steps.verify_step",
            steps.verify_step.lower(tokens, tuple(d.transpose(1, 0, 2)), t, keys, 0, params, i32 + g),
        ),
        ("steps.probs_step", steps.probs_step.lower(tuple(d.transpose(1, 0, 2)), t, keys, 0, params)),
        (
            "sharded._verify_mesh_jit",
            sharded._verify_mesh_jit.lower(tokens, d, t, key, params, i32 + g, layout=layout),
        ),
    ]


def test_every_logits_jit_compiles_with_the_same_vector_options():
    """The draft's draw and the acceptance step must compute q bit for bit alike.

    512-bit vectors can change a normaliser's last bit (bench_overheads.py checks
    only 1e-6 agreement), so a function compiled without the shared options could
    process the same logits differently from the others.
    """
    from specjax.kernels.compile_options import VECTOR_OPTIONS

    want = tuple(VECTOR_OPTIONS.items())
    for name, lowered in _logits_jits():
        # jax 0.10's record of a jit's compiler_options (private; the lowering keeps them).
        got = lowered._lowering._compiler_options_kvs
        assert set(want) <= set(got), f"{name}: compiled with {got}, expected {want}"
