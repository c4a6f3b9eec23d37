"""The mesh tests: the sharded kernels on 8 simulated CPU devices, in their own pytest process.

XLA simulates several CPU devices only when
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` is set before JAX
starts, so this directory runs as a separate session (``make test-mesh``;
``make test`` runs it after the main suite, whose tests want one device, and
``tests/conftest.py`` leaves this directory out of that session). Nothing may
initialise JAX in this process before this file sets the flags.

The core checks run by default; the rest of the matrix (every case on every
mesh, the tuple vocabulary axis, the two-process run) is marked ``slow`` and
runs with ``SPECJAX_SHARDED_FULL=1``.
"""

from __future__ import annotations

import os
import sys

import pytest

DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"


def _jax_backend_started() -> bool:
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(xla_bridge is not None and getattr(xla_bridge, "_backends", None))


if _jax_backend_started():
    raise pytest.UsageError(
        "tests/mesh: JAX was initialised before tests/mesh/conftest.py could ask for "
        f"{DEVICES} devices; run the mesh tests as their own session: pytest tests/mesh"
    )
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_sessionstart(session: pytest.Session) -> None:
    import jax

    if len(jax.devices()) < DEVICES:
        raise pytest.UsageError(
            f"tests/mesh: need {DEVICES} devices, got {len(jax.devices())}: XLA_FLAGS "
            "must be set before JAX starts (run pytest tests/mesh on its own)"
        )
