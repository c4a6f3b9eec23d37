"""A pytest plugin for every test session of the repository (`-p torchax_guard` in pyproject.toml).

A plugin rather than a root conftest.py: a root conftest would make `conftest` a first-party
module name and shadow the test folders' own conftest modules that tests import by name.
"""

from __future__ import annotations

import sys

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test not marked ``torchax`` must not import torchax into the session's process.

    Importing torchax makes torch report a "jax" accelerator without a device
    allocator, and accelerate's offloading then fails in every later test of
    the process (integration_tests/test_model_placement.py). Tests that need
    torchax in-process are marked ``torchax`` and run in their own session
    (``make test-torchax``).
    """
    before = "torchax" in sys.modules
    yield
    if not before and "torchax" in sys.modules and item.get_closest_marker("torchax") is None:
        pytest.fail(
            f"{item.nodeid} imported torchax into the test process; mark it torchax (its own session) "
            "or run what needs torchax in a subprocess",
            pytrace=False,
        )
