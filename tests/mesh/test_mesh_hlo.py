"""The compiled mesh programs move no vocabulary-sized array between devices; a rounding tie stays exact.

V = 32000 split 8 ways (shards not multiples of the 128-wide CDF blocks). The
same compiled program is checked for its collectives and then run against one
device; a negative control all-gathers the vocabulary and must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from sharded_inputs import (
    F32_BELOW_ONE,
    HLO_VOCAB,
    draw_weights,
    hlo_check,
    hlo_inputs,
    host,
    logits_inputs,
    make_mesh,
    naive_rejection_jit,
    place,
    probs_inputs,
    vocab_sized,
)


@pytest.mark.parametrize(
    ("mesh_name", "kernel", "filters"),
    [
        ("1x8", "probs", False),
        ("2x4", "probs", False),
        ("1x8", "logits", True),
        ("2x4", "logits", False),
    ],
    ids=[
        f"hlo_probs_1x8_V{HLO_VOCAB}",
        f"hlo_probs_2x4_V{HLO_VOCAB}",
        f"hlo_logits_1x8_V{HLO_VOCAB}_topkp",
        f"hlo_logits_2x4_V{HLO_VOCAB}",
    ],
)
def test_hlo_no_vocabulary_sized_collectives(mesh_name: str, kernel: str, filters: bool) -> None:
    hlo_check(mesh_name, kernel, filters)


def test_hlo_negative_control_naive_all_gather() -> None:
    from _hlo import hlo_collectives

    mesh = make_mesh("1x8")
    args, _, _ = hlo_inputs(mesh, "probs")
    found = hlo_collectives(naive_rejection_jit(mesh).lower(*args).compile().as_text())
    offenders = vocab_sized(found, HLO_VOCAB // 8)
    assert offenders, "the HLO check missed a version that all-gathers the vocabulary"


def test_rounding_edge_s_below_one_1x8() -> None:
    """s = 1 - 2**-24 makes the draw a float32 rounding tie at the end of the vocabulary.

    Shards and one device add the same weights in different orders, so they may
    pick different ids here (each within float32 rounding of the exact answer).
    Checked instead of equality: the acceptance decisions are equal, the sharded
    token has positive weight, and the exact (float64) cumulative distribution
    crosses s within 4 float32 ulps of it. Runs the program of the HLO check.
    """
    import jax

    from specjax import rejection_sample
    from specjax.kernels.sharded import _rejection_sample_mesh_jit

    mesh = make_mesh("1x8")
    args, static, _ = hlo_inputs(mesh, "probs")
    x, q, p, u, s = (np.asarray(a) for a in args)
    s = np.full_like(s, F32_BELOW_ONE)
    args = (*args[:4], jax.device_put(s, args[4].sharding))
    got = host(_rejection_sample_mesh_jit.lower(*args, **static).compile()(*args))
    ref = host(rejection_sample(x, q, p, u, s))
    assert np.array_equal(ref["num_accepted"], got["num_accepted"]), "acceptance decisions differ"
    tol = 4 * 2.0**-24
    for b, n in enumerate(got["num_accepted"]):
        y = got["tokens"][b, n]
        w = draw_weights(q[b], p[b], n)
        cdf = np.cumsum(w) / w.sum()
        below = cdf[y - 1] if y > 0 else 0.0
        assert w[y] > 0, f"row {b}: drew id {y} of zero weight"
        assert below <= s[b] + tol and cdf[y] > s[b] - tol, (
            f"row {b}: id {y} is not within float32 rounding of the exact draw (cdf {below}..{cdf[y]})"
        )


@pytest.mark.parametrize("kernel", ["probs", "logits"])
def test_collective_bytes_are_the_documented_formula(kernel: str) -> None:
    """The bytes each device sends per call (docs/distributed.md, ``_hlo.analytic_bytes``) are the
    compiled program's, at two vocabulary sizes (so independent of V); a wrong formula is caught."""
    import jax
    from _hlo import analytic_bytes, hlo_collectives
    from jax.sharding import PartitionSpec as P

    from specjax.boundary.validation import prepare_params
    from specjax.kernels.sharded import MeshLayout, _rejection_sample_mesh_jit, _verify_mesh_jit

    mesh = make_mesh("1x8")
    batch, g = 3, 2
    layout, split, rep = MeshLayout(mesh, None, "v"), P(None, None, "v"), P()
    for vocab in (512, 2048):
        if kernel == "probs":
            x, q, p, u, s = probs_inputs(batch, g, vocab, seed=5)
            args = tuple(place(a, mesh, split if a.ndim == 3 else rep) for a in (x, q, p, u, s))
            fn = _rejection_sample_mesh_jit
        else:
            x, dl, tl, kw = logits_inputs(batch, g, vocab, seed=5, filters=False, row_keys=False)
            params = prepare_params(kw["temperature"], kw.get("top_k"), kw.get("top_p"), batch, False)
            args = (
                place(x, mesh, rep),
                place(dl, mesh, split),
                place(tl, mesh, split),
                place(kw["key"], mesh, rep),
                jax.tree.map(lambda a: place(np.asarray(a), mesh, rep), params),
                place(np.asarray(kw["draft_lengths"]), mesh, rep),
            )
            fn = _verify_mesh_jit
        found = hlo_collectives(fn.lower(*args, layout=layout).compile().as_text())
        sent = sum(c["operand_bytes"] * c["count"] for c in found)
        assert sent == analytic_bytes(kernel, "sharded", batch, g, vocab), (vocab, found)
    assert analytic_bytes(kernel, "sharded", batch, g + 1, 512) != sent  # the formula sees G
