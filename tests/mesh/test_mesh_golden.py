"""The golden table (tests/golden.py) on device meshes: the sharded kernel gives the contract's tokens.

The single-device implementations (the JAX code, the C++ CPU kernels, the
numpy and torch samplers, the float64 reference) run the same table in the
main session (tests/test_reference_samplers.py); here the probability kernel
runs it with rows split over "b", ids over "v", or both, padded as needed (the
cases have V = 2..257 and B = 0..2, none a multiple of 8). Matching the same
expected tokens, the mesh path agrees with whichever single-device path a user
runs, the C++ one included, on every case of the table.
"""

from __future__ import annotations

import numpy as np
import pytest
from golden import CASES, Case
from sharded_inputs import MESHES, make_mesh


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_cases_on_a_mesh(mesh_name: str, case: Case) -> None:
    from specjax.boundary.api import rejection_sample_sharded

    rows, ids = MESHES[mesh_name]
    out = rejection_sample_sharded(
        np.asarray(case.x, np.int32),
        np.asarray(case.q, np.float32),
        np.asarray(case.p, np.float32),
        np.asarray(case.u, np.float32),
        np.asarray(case.s, np.float32),
        mesh=make_mesh(mesh_name),
        batch_axis="b" if rows > 1 else None,
        vocab_axis="v" if ids > 1 else None,
    )
    assert np.asarray(out.num_accepted).tolist() == case.n
    assert np.asarray(out.tokens).tolist() == case.tokens
