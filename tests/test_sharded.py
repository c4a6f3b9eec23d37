"""Tests of the kernels under a device mesh (issue #9) that run on one device, see :mod:`specjax.kernels.sharded`.

The checks on 8 simulated devices are an ordinary pytest session of their own
(``tests/mesh/``, ``make test-mesh``; XLA must be asked for the devices before
JAX starts, and this session keeps one device):

* equality with one device (``num_accepted`` and ``tokens`` exactly) on the
  8x1, 1x8 and 2x4 (batch x vocabulary) meshes, both kernels, ragged drafts,
  greedy rows and mixed temperatures, G = 0, V = 1000 and V = 50257, top-k/top-p;
* every vocabulary shard's own copy of the results agrees (with a negative
  control that draws the uniforms per shard);
* the compiled HLO moves no vocabulary-sized array between devices (with a
  negative control that all-gathers the vocabulary);
* the sharded top-k/top-p cutoffs keep exactly the tokens of the sort-based ones;
* a rounding tie (s = 1 - 2**-24) lands within float32 rounding of the exact draw.

The rest of the matrix (every case on every mesh) runs with
``SPECJAX_SHARDED_FULL=1``. The tests here check the one-device pieces and
that the core cases cover every mesh, kernel and feature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sharded_inputs
from _hlo import hlo_collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import rejection_sample
from specjax.boundary import api
from specjax.kernels import core, sharded


def test_core_cases_cover_every_mesh_kernel_and_feature() -> None:
    core = {(mesh, case) for mesh, cases in sharded_inputs.CORE_CASES.items() for case in cases}
    names = [case.name(mesh) for mesh, case in core]
    assert all(case in sharded_inputs.FULL_MATRIX for _, case in core)
    for mesh in sharded_inputs.MESHES:
        for kernel in ("probs", "logits"):
            assert any(n.startswith(f"{kernel}_{mesh}_") for n in names), (kernel, mesh)
        assert {c.path for m, c in core if m == mesh} == {"detect", "explicit"}, mesh
    for needle in ("_G0_", "_V50257_", "_V1000_", "_rowkeys"):
        assert any(needle in n for n in names), needle


# --------------------------------------------------------------------------- in this process (one device)


def one_device_mesh():
    return jax.make_mesh((1, 1), ("b", "v"))


def test_mesh_layout_ignores_unsharded_inputs() -> None:
    x = np.zeros((2, 3, 5), np.float32)
    assert sharded.mesh_layout(x) is None
    assert sharded.mesh_layout(jnp.asarray(x)) is None
    mesh = one_device_mesh()
    assert sharded.mesh_layout(jax.device_put(x, NamedSharding(mesh, P()))) is None


@pytest.mark.parametrize(
    "spec,batch,vocab",
    [
        (P("b", None, "v"), "b", "v"),
        (P("b"), "b", None),
        (P(None, None, "v"), None, "v"),
        (P(("b", "v")), ("b", "v"), None),
    ],
)
def test_mesh_layout_reads_the_batch_and_vocab_axes(spec: P, batch, vocab) -> None:
    mesh = one_device_mesh()
    x = jax.device_put(np.zeros((2, 3, 5), np.float32), NamedSharding(mesh, spec))
    layout = sharded.mesh_layout(x)
    assert layout == sharded.MeshLayout(mesh, batch, vocab)


def test_mesh_layout_rejects_a_split_draft_axis() -> None:
    mesh = one_device_mesh()
    x = jax.device_put(np.zeros((2, 3, 5), np.float32), NamedSharding(mesh, P(None, "v", None)))
    with pytest.raises(ValueError, match=r"target_probs: expected a sharding over B and/or V only"):
        sharded.mesh_layout(x, "target_probs")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"batch_axis": "x"}, r"batch_axis: expected an axis of the mesh .*got 'x'"),
        ({"vocab_axis": "model"}, r"vocab_axis: expected an axis of the mesh .*got 'model'"),
        ({"batch_axis": "v", "vocab_axis": "v"}, r"batch_axis and vocab_axis: expected different mesh axes"),
    ],
)
def test_explicit_functions_check_their_axes(kwargs: dict, match: str) -> None:
    mesh = one_device_mesh()
    with pytest.raises(ValueError, match=match):
        api.rejection_sample_sharded([[0]], [[[1.0]]], [[[1.0], [1.0]]], [[0.5]], [0.5], mesh=mesh, **kwargs)
    with pytest.raises(ValueError, match=match):
        api.verify_from_logits_sharded(
            [[0]], [[[1.0]]], [[[1.0], [1.0]]], key=jax.random.key(0), temperature=1.0, mesh=mesh, **kwargs
        )


def test_sharded_path_on_a_one_device_mesh_equals_the_plain_kernel() -> None:
    """The whole sharded code path (shard_map, collectives over size-1 axes) in this process."""
    x, q, p, u, s = sharded_inputs.probs_inputs(8, 3, 300, seed=1)
    mesh = one_device_mesh()
    placed = [
        jax.device_put(a, NamedSharding(mesh, spec))
        for a, spec in zip(
            (x, q, p, u, s), (P("b", None), P("b", None, "v"), P("b", None, "v"), P("b", None), P("b")), strict=True
        )
    ]
    got = rejection_sample(*placed)
    ref = rejection_sample(x, q, p, u, s)
    assert isinstance(got.tokens.sharding, NamedSharding)  # it did take the mesh path
    for key in ("num_accepted", "tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(got, key)), np.asarray(getattr(ref, key)))


def test_float_keys_sort_like_floats_and_invert() -> None:
    tiny = np.finfo(np.float32).smallest_subnormal
    values = np.array([-np.inf, -3e38, -1.5, -tiny, -0.0, 0.0, tiny, 1e-30, 1.0, 1.5, 3e38, np.inf], np.float32)
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(200) * 10.0 ** rng.integers(-30, 30, 200)
    values = np.concatenate([values, spread.astype(np.float32)])
    keys = np.asarray(core._float_key(jnp.asarray(values)))
    order = np.argsort(values, kind="stable")
    assert np.all(np.diff(keys[order].astype(np.int64)) >= 0)
    back = np.asarray(core._key_float(jnp.asarray(keys)))
    np.testing.assert_array_equal(back.view(np.uint32), values.view(np.uint32))
    assert keys[0] == core._KEY_NEG_INF and keys[11] == core._KEY_POS_INF


def test_mesh_cutoff_keeps_what_the_single_device_cutoff_keeps() -> None:
    """Many rows with ties and -inf, on a one-shard mesh (the 8-shard case runs in tests/mesh).

    The mesh runs the bisection for every row; one device decides most rows from
    the 256 largest logits and the rest by the same bisection.
    """
    rng = np.random.default_rng(4)
    rows, vocab = 512, 257
    scaled = (2 * rng.standard_normal((rows, vocab))).astype(np.float32)
    scaled[::2] = np.round(scaled[::2] * 2) / 2
    scaled[1::5, 100:] = -np.inf
    scaled[3::16] = np.float32(-2.25)
    top_k = rng.choice([0, 1, 2, 3, 10, 100, 256, 257, 10**6], rows).astype(np.int32)
    omp = rng.choice([0.0, 0.05, 0.3, 0.5, 0.8, 0.95, 0.999], rows).astype(np.float32)
    mesh = one_device_mesh()
    specs = (P(None, "v"), P(), P())
    fn = jax.jit(
        jax.shard_map(
            lambda a, k, o: core.cutoff(a, k, o, "v"),
            mesh=mesh,
            in_specs=specs,
            out_specs=P(),
            check_vma=False,
        )
    )
    got = np.asarray(
        fn(*(jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip((scaled, top_k, omp), specs, strict=True)))
    )
    ref = np.asarray(jax.jit(core.cutoff)(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(omp)))
    np.testing.assert_array_equal(scaled >= got[:, None], scaled >= ref[:, None])
    only_k = (omp == 0) & (top_k > 0) & (top_k <= vocab)
    np.testing.assert_array_equal(got[only_k], ref[only_k])


SYNTHETIC_HLO = """\
HloModule synthetic

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %ar = f32[8,4]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,4]{1,0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,4], y: f32[8,1000]) -> f32[8,8000] {
  %x = f32[8,4]{1,0} parameter(0)
  %y = f32[8,1000]{1,0} parameter(1)
  %pair = (f32[8,4]{1,0}, s32[8]{0}) all-reduce(%x, %i8), channel_id=1, to_apply=%add
  %i8 = s32[8]{0} constant({0,0,0,0,0,0,0,0})
  %init = (s32[], f32[8,4]{1,0}) tuple(%i8, %x)
  %w = (s32[], f32[8,4]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"32"}}
  %ags = (f32[8,1000]{1,0}, f32[8,8000]{1,0}) all-gather-start(%y), channel_id=3, dimensions={1}
  ROOT %agd = f32[8,8000]{1,0} all-gather-done(%ags)
}
"""


def test_hlo_collectives_reads_sizes_loops_and_async_pairs() -> None:
    found = hlo_collectives(SYNTHETIC_HLO)
    assert [c["op"] for c in found] == ["all-reduce", "all-reduce", "all-gather"]
    in_loop, pair, gather = found
    assert in_loop["count"] == 32 and in_loop["operands"] == [("f32", (8, 4))]
    assert pair["count"] == 1 and pair["result_bytes"] == 8 * 4 * 4 + 8 * 4
    assert gather["operands"] == [("f32", (8, 1000))] and gather["max_dim"] == 8000
    assert gather["results"] == [("f32", (8, 8000))] and gather["result_bytes"] == 8 * 8000 * 4
    assert sharded_inputs.vocab_sized(found, 1000) == [gather]
