"""The golden table: the acceptance contract (docs/api.md), case by case, with the expected tokens.

One table drives every implementation of the probability kernel: the JAX
kernel with each ``impl`` (tests/test_reference_samplers.py), the shipped
numpy and torch samplers (same file), the float64 reference
(tests/reference.py, same file) and the kernel on device meshes
(tests/mesh/test_mesh_golden.py). Expected values were worked out by hand from
the contract's text; each case's ``note`` says how where it is not obvious.
Inputs are exact in float32 (multiples of powers of two), so every
implementation must give these tokens exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

F32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


@dataclass
class Case:
    name: str
    x: Any
    q: Any
    p: Any
    u: Any
    s: Any
    n: list[int]
    tokens: list[list[int]]
    note: str = field(default="")


def _one_hot(v: int, i: int) -> list[float]:
    row = [0.0] * v
    row[i] = 1.0
    return row


CASES = [
    Case(
        "all accepted, bonus from p_G",
        [[1, 2]],
        [[[0, 1, 0, 0], [0, 0, 1, 0]]],
        [[[0, 1, 0, 0], [0, 0, 1, 0], [0.25] * 4]],
        [[0.5, 0.5]],
        [0.6],
        [2],
        [[1, 2, 2]],
    ),
    Case(
        "rejection at 1, correction from the residual",
        [[1, 2]],
        [[[0, 1, 0, 0], [0, 0, 1, 0]]],
        [[[0, 1, 0, 0], [0.5, 0, 0.25, 0.25], [0.25] * 4]],
        [[0.5, 0.25]],
        [0.5],
        [1],
        [[1, 0, -1]],
        "u = 0.25 equals p/q = 0.25: strict < fails; residual (0.5, 0, 0, 0.25) has cdf 2/3 > 0.5 at 0",
    ),
    Case(
        "q(x) = 0 and p(x) > 0 passes whatever u",
        [[0]],
        [[[0, 1]]],
        [[[0.5, 0.5], [1, 0]]],
        [[F32_BELOW_ONE]],
        [0.5],
        [1],
        [[0, 0]],
    ),
    Case(
        "p(x) = 0 fails even with u = 0", [[1]], [[[0.5, 0.5]]], [[[1, 0], [0.5, 0.5]]], [[0.0]], [0.0], [0], [[0, -1]]
    ),
    Case(
        "G = 0 draws from p_0",
        np.zeros((2, 0), np.int32),
        np.zeros((2, 0, 3), np.float32),
        [[[0.5, 0.25, 0.25]], [[0, 0, 1]]],
        np.zeros((2, 0), np.float32),
        [0.5, 0.1],
        [0, 0],
        [[1], [2]],
    ),
    Case(
        "empty residual (unnormalised q) draws from p_n",
        [[0]],
        [[[1, 1]]],
        [[[0.5, 0.5], [0, 1]]],
        [[0.75]],
        [0.5],
        [0],
        [[1, -1]],
    ),
    Case(
        "s on a cumulative boundary moves to the next positive token",
        [[0]],
        [[[1, 0, 0, 0]]],
        [[[0.5, 0.25, 0, 0.25], [0.25, 0.25, 0.25, 0.25]]],
        [[0.5]],
        [0.5],
        [0],
        [[3, -1]],
        "u = p/q = 0.5 fails; residual (0, 0.25, 0, 0.25): cdf 0, 0.5, 0.5, 1 and s = 0.5 -> 3",
    ),
    Case(
        "second block of 128",
        [[200]],
        [[_one_hot(257, 200)]],
        [[_one_hot(257, 256), _one_hot(257, 5)]],
        [[0.0]],
        [F32_BELOW_ONE],
        [0],
        [[256, -1]],
    ),
    Case(
        "B = 0",
        np.zeros((0, 2), np.int32),
        np.zeros((0, 2, 3), np.float32),
        np.zeros((0, 3, 3), np.float32),
        np.zeros((0, 2), np.float32),
        np.zeros((0,), np.float32),
        [],
        np.zeros((0, 3), np.int32).tolist(),
    ),
]
