"""A pytest plugin for every test session of the repository (`-p torchax_guard` in pyproject.toml).

Importing torchax makes torch report a "jax" accelerator without a device allocator;
accelerate's offloading then fails in every later test of the process
(integration_tests/test_model_placement.py). So the tests that need torchax in-process are
marked ``torchax`` and run in a session of their own (``make test-torchax``); the main
session runs with ``-m "not torchax"``, and there this plugin

* does not even collect the modules named ``test_torchax_*.py`` (collecting imports them,
  and with them torchax, before any marker deselects their tests);
* stops the session if torchax was imported during collection anyway;
* fails a test not marked ``torchax`` that leaves torchax imported.

A plugin rather than a root conftest.py: a root conftest would make ``conftest`` a
first-party module name and shadow the test folders' own conftest modules.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def _excludes_torchax(config: pytest.Config) -> bool:
    return "not torchax" in (config.option.markexpr or "")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if _excludes_torchax(config) and collection_path.name.startswith("test_torchax_"):
        return True
    return None


def pytest_collection_finish(session: pytest.Session) -> None:
    if _excludes_torchax(session.config) and "torchax" in sys.modules:
        pytest.exit(
            "torchax was imported while collecting a session that excludes the torchax tests; a module "
            "that imports it must be named test_torchax_*.py (or import it inside a test marked torchax)",
            returncode=3,
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test not marked ``torchax`` must not import torchax into the session's process."""
    before = "torchax" in sys.modules
    yield
    if not before and "torchax" in sys.modules and item.get_closest_marker("torchax") is None:
        pytest.fail(
            f"{item.nodeid} imported torchax into the test process; mark it torchax (its own session) "
            "or run what needs torchax in a subprocess",
            pytrace=False,
        )
