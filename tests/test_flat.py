"""specjax.kernels.flat (the vLLM plugin's point-mass step on flattened rows) against verify_core.

The flat step reads vLLM's (T, V) rows in place; the reference copies them into
the front end's padded (B', G+1, V) layout and runs ``verify_core`` with
``draft_logits=None``, the same uniforms and vLLM's bonus spliced in. The tokens
must be equal, bit for bit, for greedy and sampled rows, ragged drafts, rows
that accept everything and rows that reject (so the residual draw runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from specjax.kernels import cpu_kernels, flat
from specjax.kernels.frontend import verify_core
from specjax.kernels.types import SamplingParams
from specjax.plugin.vllm import step as plugin_step


def reference(draft, ks, logits, width, temperature, keys, bonus):
    """verify_core on the padded layout, vLLM's bonus where every draft token passed."""
    bp = len(temperature)
    vocab = logits.shape[1]
    target = np.zeros((bp, width + 1, vocab), np.float32)
    grid = np.zeros((bp, width), np.int32)
    start = 0
    for b, k in enumerate(ks):
        target[b, :k] = logits[start : start + k]
        grid[b, :k] = draft[start : start + k]
        start += k
    k = np.zeros(bp, np.int32)
    k[: len(ks)] = ks
    return np.asarray(_reference_jit(grid, target, keys, temperature, k, bonus))


@jax.jit  # one compilation per case's shapes, not op-by-op dispatch in each of its 16 trials
def _reference_jit(grid, target, keys, temperature, k, bonus):
    width = grid.shape[1]
    u = plugin_step._uniforms(keys, width + 1)
    out = verify_core(grid, None, target, u[:, :width], u[:, width], SamplingParams(temperature), k)
    return plugin_step._splice_bonus(jnp, out.tokens, out.num_accepted, k, bonus)


def flat_step(draft, ks, logits, width, temperature, keys, bonus):
    bp = len(temperature)
    k = np.zeros(bp, np.int32)
    k[: len(ks)] = ks
    starts = np.cumsum(k, dtype=np.int64) - k
    request = np.repeat(np.arange(len(ks)), ks)
    position = np.arange(sum(ks)) - starts[request]
    return plugin_step._point_mass_flat(
        torch.from_numpy(draft), torch.from_numpy(logits), width, k, starts, request, position, temperature, keys, bonus
    )


CASES = [
    # (ks, width, vocab, greedy rows)
    ([4], 4, 50, [True]),
    ([4], 4, 50, [False]),
    ([2, 0, 3, 4, 1], 4, 50, [True, False, False, True, False]),
    ([3] * 7, 5, 1000, [False] * 7),
    ([1, 4, 4, 0, 2, 3, 4, 2, 1], 4, 333, [i % 3 == 0 for i in range(9)]),
]


@pytest.mark.parametrize("ks,width,vocab,greedy", CASES)
def test_flat_point_mass_step_equals_verify_core(ks, width, vocab, greedy):
    rng = np.random.default_rng(sum(ks) + vocab)
    bp = plugin_step._bucket(len(ks))
    draws = bonuses = 0
    for trial in range(16):
        t = sum(ks)
        # trial 0: sharp rows and drafts at their argmax, so that rows accept everything
        logits = (rng.standard_normal((t, vocab)) * (50 if trial == 0 else 5)).astype(np.float32)
        draft = rng.integers(0, vocab, t).astype(np.int32)
        # the argmax, or a likely token, often enough that rows accept a few tokens
        likely = np.argsort(-logits, axis=1)[:, :2]
        pick = rng.random(t) * (trial > 0)
        draft = np.where(pick < 0.75, likely[:, 0], np.where(pick < 0.85, likely[:, 1], draft)).astype(np.int32)
        temperature = np.zeros(bp, np.float32)
        temperature[: len(ks)] = [0.0 if gr else 1.0 for gr in greedy]
        keys = rng.integers(-(2**31), 2**31, (bp, 2)).astype(np.int32)
        bonus = np.full(bp, -1, np.int32)
        bonus[: len(ks)] = rng.integers(0, vocab, len(ks))
        got = flat_step(draft, ks, logits, width, temperature, keys, bonus)
        want = reference(draft, ks, logits, width, temperature, keys, bonus)
        np.testing.assert_array_equal(got[: len(ks)], want[: len(ks)], err_msg=f"trial {trial}")
        for b, k in enumerate(ks):
            emitted = int((got[b] != -1).sum())
            if emitted == k + 1 and k > 0:
                bonuses += got[b, k] == bonus[b]
            elif not greedy[b] and emitted <= k:
                draws += 1
    assert bonuses > 0  # some rows accepted everything
    if not all(greedy):
        assert draws > 0  # and the residual draw ran


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_out_of_range_draft_ids_are_never_accepted(impl):
    if impl == "cpu" and not cpu_kernels.available():
        pytest.skip(f"no CPU kernels: {cpu_kernels.build_error()}")
    vocab = 20
    logits = np.zeros((3, vocab), np.float32)
    logits[:, 5] = 10.0
    for ids, greedy in [([-1, vocab, 5], True), ([vocab + 7, -3, 5], False)]:
        grid_p, grid_am = flat.summarise_rows(
            jnp.zeros(4, jnp.float32),
            jnp.zeros(4, jnp.int32),
            jnp.asarray(logits),
            jnp.full(3, 0.0 if greedy else 1.0, jnp.float32),
            jnp.asarray(ids, jnp.int32),
            jnp.arange(3, dtype=jnp.int32),
            impl,
        )
        p = np.asarray(grid_p)
        assert p[0] == 0 and p[1] == 0 and p[2] > 0.99, p
        if greedy:  # the argmax is what a greedy row emits (a sampled row's is never read)
            assert np.asarray(grid_am)[:3].tolist() == [5, 5, 5]


def test_residual_draw_leaves_the_rejected_token_out():
    logits = np.log(np.array([[0.5, 0.5, 0, 0, 0, 0, 0, 0]] * 64, np.float32) + 1e-30)
    u = jax.random.uniform(jax.random.key(0), (64,))
    y = np.asarray(flat.residual_draw(jnp.asarray(logits), jnp.ones(64), jnp.zeros(64, jnp.int32), u))
    assert (y == 1).all()  # p without token 0 is the point mass at 1
    # negative control: with token 1 rejected instead, the draws go to 0
    y = np.asarray(flat.residual_draw(jnp.asarray(logits), jnp.ones(64), jnp.ones(64, jnp.int32), u))
    assert (y == 0).all()
