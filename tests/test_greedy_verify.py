"""The loop's all-greedy acceptance step (torch argmax) against the JAX kernel's.

``specjax.generate.verify.greedy_verify`` decides a step when every row is
greedy, without the kernel: it must give exactly
:func:`specjax.kernels.steps.verify_step`'s accepted counts and tokens, with
point-mass drafts and with draft logits (a greedy target's result does not
depend on ``q``), for ragged draft lengths, ties in the target's logits and
every acceptance count from 0 to G.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from specjax.boundary.validation import prepare_params
from specjax.generate.verify import greedy_verify
from specjax.kernels import steps


def _case(seed: int, b: int, g: int, vocab: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, g + 1, vocab)).astype(np.float32)
    # ties: a second maximum at a larger index in some positions (the first one wins)
    tie_rows = rng.random((b, g + 1)) < 0.3
    first = logits.argmax(-1)
    later = np.minimum(first + 1 + rng.integers(0, 5, size=first.shape), vocab - 1)
    for r, c in zip(*np.nonzero(tie_rows), strict=True):
        logits[r, c, later[r, c]] = logits[r, c, first[r, c]]
    best = logits.argmax(-1)  # the first maximum
    # draft tokens: row r matches the target's choice for its first m_r positions, then not
    m = rng.integers(0, g + 1, size=b)
    m[: min(b, g + 1)] = np.arange(min(b, g + 1))  # every count from 0 to G occurs (b >= g + 1)
    draft = np.where(np.arange(g)[None, :] < m[:, None], best[:, :g], (best[:, :g] + 1) % vocab)
    # past the first mismatch, some positions match again (they must not count)
    again = (np.arange(g)[None, :] > m[:, None]) & (rng.random((b, g)) < 0.5)
    draft = np.where(again, best[:, :g], draft)
    k_rows = rng.integers(0, g + 1, size=b)
    k_rows[: min(b, g + 1)] = g  # the full-length rows reach every acceptance count
    # short rows that match everywhere, also past k_b (stale values there must never count)
    short = np.arange(b) >= g + 1
    draft[short] = best[short, :g]
    return logits, draft.astype(np.int64), k_rows.astype(np.int64)


@pytest.mark.parametrize(("b", "g", "vocab"), [(8, 4, 64), (6, 5, 1000), (1, 0, 32)])
@pytest.mark.parametrize("with_draft_logits", [False, True])
def test_greedy_verify_equals_the_kernel(b, g, vocab, with_draft_logits):
    logits, draft, k_rows = _case(b * 100 + g, b, g, vocab)
    n, tokens = greedy_verify(torch.from_numpy(draft), torch.from_numpy(logits), k_rows)

    params = jax.device_put(prepare_params(0.0, None, None, b, True, "auto"))
    keys = jax.random.split(jax.random.key(3), b)
    d_logits = None
    if with_draft_logits:  # any draft distribution: a greedy target decides alone
        rng = np.random.default_rng(7)
        d_logits = tuple(rng.normal(size=(b, vocab)).astype(np.float32) for _ in range(g))
    ref = steps.verify_step(draft.astype(np.int32), d_logits, logits, keys, 0, params, k_rows.astype(np.int32))
    assert n.tolist() == np.asarray(ref.num_accepted).tolist()
    assert tokens.tolist() == np.asarray(ref.tokens).tolist()
    assert tokens.dtype == np.int32
    if b >= g + 1 and g:
        assert set(n.tolist()) == set(range(g + 1)), "not every acceptance count occurred: the test does not test"
