"""The loop's bucketed sampled verification (``specjax.generate.verify.bucketed``).

``verify_step`` compiles once per shape, so the loop pads its inputs to a few
bucketed shapes (rows to a power of two, positions to 1, 2, 3, 5, 9, ...). The
padding must change no token: each case compares the padded call's results,
cut back to the real rows and positions, with the unpadded call's, sampled
(T = 0.7 with per-row top-k / top-p), with point masses, with draft logits, and
with both in one batch (a point-mass mask).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from specjax.boundary.validation import prepare_params
from specjax.generate.verify import bucketed as _bucketed
from specjax.generate.verify import buckets as _buckets
from specjax.kernels import steps


def test_buckets():
    assert _buckets(10) == [1, 2, 3, 5, 9, 10]
    assert _buckets(9) == [1, 2, 3, 5, 9]
    assert _buckets(4) == [1, 2, 3, 4]


@pytest.mark.parametrize(("b", "batch", "width"), [(3, 8, 3), (5, 8, 6), (1, 4, 0), (8, 8, 7), (2, 2, 4)])
@pytest.mark.parametrize("kind", ["point masses", "logits", "mixed"])
def test_padding_changes_no_token(b, batch, width, kind):
    vocab, max_width = 50, 10
    rng = np.random.default_rng(b * 10 + width)
    logits = rng.normal(size=(b, width + 1, vocab)).astype(np.float32) * 3
    best = logits.argmax(-1)
    draft = np.where(rng.random((b, width)) < 0.7, best[:, :width], rng.integers(0, vocab, (b, width)))
    k_rows = rng.integers(0, width + 1, size=b)
    temps = np.full(b, 0.7, np.float32)
    temps[0] = 0.0  # a greedy row among sampled ones
    if kind != "point masses":  # per-row parameters, a greedy row among them
        params = jax.device_put(prepare_params(temps, rng.integers(0, 20, b), np.full(b, 0.9), b, True, "auto"))
    else:  # one temperature, no top-k / top-p (their fields hold placeholders)
        params = prepare_params(0.7, None, None, b, True, "auto")
    keys = jax.random.split(jax.random.key(11), b)
    d_logits = None
    if kind != "point masses" and width:
        d_logits = tuple(rng.normal(size=(b, vocab)).astype(np.float32) for _ in range(width))
    mask = np.arange(b) % 2 == 0 if kind == "mixed" and d_logits is not None else None

    x32, k32 = draft.astype(np.int32), k_rows.astype(np.int32)
    ref = steps.verify_step(x32, d_logits, logits, keys, 5, params, k32, mask)
    x, d, t, kb, pb, nb, mb = _bucketed(
        x32, d_logits, torch.from_numpy(logits), keys, params, k_rows, batch, max_width, jax.numpy, mask
    )
    rows, cols = t.shape[:2]
    assert rows == min(batch, 1 << (b - 1).bit_length()) and cols == next(s for s in _buckets(10) if s > width)
    assert x.shape == (rows, cols - 1) and nb.tolist() == k_rows.tolist() + [0] * (rows - b)
    assert mb is None if mask is None else mb.tolist() == mask.tolist() + [False] * (rows - b)
    got = steps.verify_step(x, d, t.numpy(), kb, 5, pb, nb, mb)
    assert np.asarray(got.num_accepted)[:b].tolist() == np.asarray(ref.num_accepted).tolist()
    assert np.asarray(got.tokens)[:b, : width + 1].tolist() == np.asarray(ref.tokens).tolist()
    # negative control: another step's keys give other tokens somewhere (the comparison can fail)
    other = steps.verify_step(x, d, t.numpy(), kb, 6, pb, nb, mb)
    if width >= 3 and b >= 3:
        assert np.asarray(other.tokens)[:b, : width + 1].tolist() != np.asarray(ref.tokens).tolist()
