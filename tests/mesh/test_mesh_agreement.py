"""Every vocabulary shard's own copy of the results agrees, and the sharded top-k/top-p cutoffs are exact."""

from __future__ import annotations

import numpy as np
import pytest
from sharded_inputs import (
    AGREE_MESH,
    check_copies,
    full_matrix,
    logits_inputs,
    make_mesh,
    per_shard_probs,
    place,
    probs_inputs,
    shards_agree,
)


def test_agreement_probs_1x8() -> None:
    from specjax import rejection_sample

    check_copies(rejection_sample(*probs_inputs(16, 4, 1000, seed=7)), per_shard_probs(bad=False))


@pytest.mark.slow
@full_matrix
def test_agreement_logits_1x8() -> None:
    import jax.numpy as jnp

    from specjax import verify_from_logits
    from specjax.kernels.sharded import MeshLayout, verify_on_mesh
    from specjax.kernels.types import SamplingParams

    x, dl, tl, kwargs = logits_inputs(16, 4, 1000, seed=11, filters=False, row_keys=False)
    got = verify_on_mesh(
        jnp.asarray(x),
        jnp.asarray(dl),
        jnp.asarray(tl),
        kwargs["key"],
        SamplingParams(jnp.asarray(kwargs["temperature"]), jnp.zeros(16, jnp.int32), jnp.zeros(16, jnp.float32)),
        jnp.asarray(kwargs["draft_lengths"]),
        layout=MeshLayout(make_mesh(AGREE_MESH), "b", "v"),
        per_shard=True,
    )
    check_copies(verify_from_logits(x, dl, tl, **kwargs), got)


def test_agreement_negative_control_per_shard_uniforms() -> None:
    bad = shards_agree(per_shard_probs(bad=True))
    assert bad, "per-shard random streams went unnoticed: the agreement check cannot fail"


def test_cutoff_topk_topp_1x8() -> None:
    """The cutoff over 8 shards (bisection) keeps exactly the tokens the single-device cutoff keeps."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.core import cutoff

    rng = np.random.default_rng(3)
    rows, vocab = 64, 1000
    scaled = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    scaled[::3] = np.round(scaled[::3])  # heavy ties
    scaled[1::4, 500:] = -np.inf
    scaled[2::8, :] = np.float32(1.5)  # all tied
    top_k = rng.choice([0, 1, 2, 7, 50, 999, 1000, 5000], rows).astype(np.int32)
    omp = rng.choice([0.0, 0.1, 0.5, 0.9, 0.99, 1 - 1e-9], rows).astype(np.float32)
    mesh = make_mesh("1x8")
    specs = (P(None, "v"), P(), P())
    fn = jax.jit(
        jax.shard_map(lambda s, k, o: cutoff(s, k, o, "v"), mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    )
    got = np.asarray(fn(*(place(a, mesh, spec) for a, spec in zip((scaled, top_k, omp), specs, strict=True))))
    ref = np.asarray(jax.jit(cutoff)(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(omp)))
    kept_ref = scaled >= ref[:, None]
    kept_got = scaled >= got[:, None]
    bad = np.nonzero(np.any(kept_ref != kept_got, axis=1))[0]
    assert bad.size == 0, f"kept sets differ in rows {bad.tolist()}: cutoffs {ref[bad]} vs {got[bad]}"
    only_k = (omp == 0) & (top_k > 0) & (top_k <= vocab)
    assert np.array_equal(ref[only_k], got[only_k]), "top-k cutoffs are not bit-equal"
