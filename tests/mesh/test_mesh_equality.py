"""The sharded kernels equal one device exactly (``num_accepted`` and ``tokens``), on 8x1, 1x8 and 2x4 meshes.

Both kernels, ragged drafts, greedy rows and mixed temperatures, G = 0,
V = 1000 and V = 50257, top-k/top-p, per-row keys; the public functions on
NamedSharding inputs ("detect") and the explicit ``*_sharded`` functions on
NumPy inputs ("explicit"). The core cases cover every feature on every mesh;
the full matrix runs with ``SPECJAX_SHARDED_FULL=1``.
"""

from __future__ import annotations

import pytest
from sharded_inputs import (
    CORE_CASES,
    FULL_EXTRA,
    FULL_MATRIX,
    MESHES,
    Case,
    assert_equal,
    full_matrix,
    logits_inputs,
    make_mesh,
    probs_inputs,
    run_case,
)

CORE = [(mesh, case) for mesh in MESHES for case in FULL_MATRIX if case in CORE_CASES[mesh]]
FULL_ONLY = [(mesh, case) for mesh in MESHES for case in FULL_MATRIX if case not in CORE_CASES[mesh]]
FULL_ONLY += list(FULL_EXTRA)


@pytest.mark.parametrize(("mesh_name", "case"), CORE, ids=[c.name(m) for m, c in CORE])
def test_mesh_equals_one_device(mesh_name: str, case: Case) -> None:
    run_case(case, mesh_name)


@pytest.mark.slow
@full_matrix
@pytest.mark.parametrize(("mesh_name", "case"), FULL_ONLY, ids=[c.name(m) for m, c in FULL_ONLY])
def test_mesh_equals_one_device_full_matrix(mesh_name: str, case: Case) -> None:
    run_case(case, mesh_name)


@pytest.mark.slow
@full_matrix
def test_tuple_vocab_axis_2x4() -> None:
    """The vocabulary split over both mesh axes at once (a tuple of axis names, 8 shards)."""
    from specjax import rejection_sample, verify_from_logits
    from specjax.boundary.api import rejection_sample_sharded, verify_from_logits_sharded

    mesh = make_mesh("2x4")
    args = probs_inputs(16, 4, 1000, seed=3)
    assert_equal(
        rejection_sample(*args),
        rejection_sample_sharded(*args, mesh=mesh, vocab_axis=("b", "v")),
        "probs over ('b', 'v')",
    )
    x, dl, tl, kw = logits_inputs(16, 4, 1000, seed=4, filters=True, row_keys=False)
    assert_equal(
        verify_from_logits(x, dl, tl, **kw),
        verify_from_logits_sharded(x, dl, tl, mesh=mesh, vocab_axis=("v", "b"), **kw),
        "logits over ('v', 'b')",
    )
