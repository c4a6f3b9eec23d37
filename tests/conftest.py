"""The main test session: everything under tests/ except tests/mesh/, which runs as its own session.

tests/mesh/ needs 8 simulated XLA devices, set before JAX starts (see
tests/mesh/conftest.py); this session's tests want one device.
"""

from __future__ import annotations

from pathlib import Path

import pytest

MESH_DIR = Path(__file__).parent / "mesh"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == MESH_DIR:
        asked = (Path(a.split("::")[0]).resolve() for a in config.args)
        if not any(p == MESH_DIR or MESH_DIR in p.parents for p in asked):
            return True
    return None
