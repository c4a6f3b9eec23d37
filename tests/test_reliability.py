"""Reliability defects of issue 22 that need no model: each test failed before its fix.

* plugins whose import calls ``sys.exit`` or raises any ``BaseException``, installed as a
  real entry-point distribution (a ``.dist-info`` directory on ``sys.path``);
* ``patch_speculative_sampling`` blocks exited in any order, also from several threads;
* temperatures outside the range where the processed distribution is computed faithfully;
* errors of the right kind for ``top_k = 2**70`` and malformed keys;
* ``validate=False`` with draft ids outside [0, V): never accepted or emitted, and the
  ``jax``, ``numpy`` and ``torch`` samplers agree.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax import registry

# --------------------------------------------------------------------------- plugins failing on import

DIST = "specjax_reliability_plugins"
EXITS, RAISES, GOOD = "specjax_rel_exits", "specjax_rel_raises", "specjax_rel_good"


def write_plugin_distribution(site: Path) -> None:
    """A real distribution in ``site``: its modules and a ``.dist-info`` with entry points.

    ``importlib.metadata`` finds it on ``sys.path`` as it finds a pip-installed one. The
    failing plugins come first in the file, so the good one loads only if loading goes on.
    """
    (site / f"{EXITS}.py").write_text("import sys\nsys.exit(3)\n", encoding="utf-8")
    (site / f"{RAISES}.py").write_text("raise GeneratorExit('plugin says goodbye')\n", encoding="utf-8")
    (site / f"{GOOD}.py").write_text(
        textwrap.dedent(f"""
        from specjax.plugin.reference_samplers import numpy_rejection_sample as sampler

        def register():
            from specjax.registry import register_sampler
            register_sampler("rel_good_registered", "{GOOD}:sampler")
    """),
        encoding="utf-8",
    )
    info = site / f"{DIST}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(f"""
        [specjax.plugins]
        rel_exits = {EXITS}:register
        rel_raises = {RAISES}:register
        rel_good = {GOOD}:register

        [specjax.samplers]
        rel_exits_sampler = {EXITS}:sampler
    """),
        encoding="utf-8",
    )


@pytest.fixture
def failing_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    write_plugin_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    importlib.invalidate_caches()
    registry._reset_for_tests()
    yield tmp_path
    registry._reset_for_tests()
    for name in (EXITS, RAISES, GOOD):
        sys.modules.pop(name, None)


def test_plugins_exiting_or_raising_base_exceptions_are_reported_per_plugin(failing_plugins: Path) -> None:
    status = registry.load_plugins()
    assert status["rel_exits"].status == "failed"
    assert status["rel_exits"].error == "SystemExit: 3"
    assert status["rel_raises"].status == "failed"
    assert status["rel_raises"].error == "GeneratorExit: plugin says goodbye"
    # loading went on: the plugin after them and the package's own plugins loaded
    assert status["rel_good"].status == "loaded"
    assert status["builtin_samplers"].status == "loaded"
    # and the registry is consistent for the rest of the process
    assert registry.load_plugins() == status
    assert {"numpy", "torch", "rel_good_registered"} <= set(registry.available_samplers())
    assert registry.load_sampler("rel_good_registered") is not None
    with pytest.raises(
        ValueError,
        match=r"unknown sampler 'nope'.*plugins that failed to load: .*rel_exits "
        r"\(SystemExit: 3\)",
    ):
        registry.load_sampler("nope")


def test_sampler_module_exiting_on_import_is_an_import_error(failing_plugins: Path) -> None:
    with pytest.raises(
        ImportError,
        match=rf"sampler 'rel_exits_sampler': cannot import {EXITS}:sampler .*"
        r"SystemExit: 3",
    ):
        registry.load_sampler("rel_exits_sampler")
    assert registry.load_sampler("numpy") is not None  # still usable


# --------------------------------------------------------------------------- patch_speculative_sampling


def test_patch_contexts_exited_in_any_order_restore_the_original() -> None:
    from transformers.generation import utils as gu

    from specjax.plugin.hf import patch_speculative_sampling

    original = gu._speculative_sampling
    a, b = patch_speculative_sampling(), patch_speculative_sampling()
    a.__enter__()
    b.__enter__()
    patched_b = gu._speculative_sampling
    a.__exit__(None, None, None)  # A exits first: B's replacement stays installed
    assert gu._speculative_sampling is patched_b
    b.__exit__(None, None, None)
    assert gu._speculative_sampling is original


def test_patch_contexts_from_several_threads_restore_the_original() -> None:
    from transformers.generation import utils as gu

    from specjax.plugin.hf import patch_speculative_sampling

    original = gu._speculative_sampling
    threads = 4
    entered = threading.Barrier(threads)
    exit_turn = [threading.Event() for _ in range(threads)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            with patch_speculative_sampling():
                entered.wait(timeout=30)  # all blocks open at once
                assert exit_turn[i].wait(timeout=30)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    # exit in entry-unrelated order: 0, 2, 1, 3 (the first to enter need not be the last to exit)
    for i in (0, 2, 1, 3):
        exit_turn[i].set()
        pool[i].join(timeout=30)
        if i != 3:
            assert gu._speculative_sampling is not original
    assert not errors
    assert gu._speculative_sampling is original


# --------------------------------------------------------------------------- parameters and keys

LOGITS = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)


@pytest.mark.parametrize("temperature", [1e38, 3e38, 3.4e38, [1.0, 1e38], 1e-39])
def test_temperature_outside_the_faithful_range_is_refused(temperature) -> None:
    with pytest.raises(
        ValueError,
        match=r"temperature: expected 0 \(greedy\) or a value in \[2\*\*-126, 2\*\*126\] "
        r"= \[1.175494e-38, 8.507059e\+37\], the range where the processed "
        r"distribution is computed faithfully",
    ):
        specjax.sample_from_logits(LOGITS, key=jax.random.key(0), temperature=temperature)


@pytest.mark.parametrize("temperature", [2.0**126, 3e38])
def test_huge_temperature_without_validation_is_near_uniform_not_greedy(temperature) -> None:
    _, probs = specjax.sample_from_logits(LOGITS, key=jax.random.key(0), temperature=temperature, validate=False)
    np.testing.assert_allclose(np.asarray(probs), 1 / 8, rtol=1e-5)


def test_temperature_at_the_ends_of_the_range_is_accepted() -> None:
    _, probs = specjax.sample_from_logits(LOGITS, key=jax.random.key(0), temperature=[2.0**-126, 2.0**126])
    probs = np.asarray(probs)
    assert probs[0].max() == 1.0  # T = 2**-126: all mass on the argmax
    np.testing.assert_allclose(probs[1], 1 / 8, rtol=1e-5)


@pytest.mark.parametrize("top_k", [2**70, 2**63])
def test_huge_top_k_keeps_everything(top_k) -> None:
    _, probs = specjax.sample_from_logits(LOGITS, key=jax.random.key(0), temperature=1.0, top_k=top_k)
    assert np.all(np.asarray(probs) > 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(top_k=-(2**70)), r"top_k: expected integers >= 0 \(0 = no top-k\), got \[-1180591620717411303424, "),
        (
            dict(temperature=10**400),
            r"temperature: expected a number that fits in a float, got an integer of 1329 bits",
        ),
        (dict(top_p=10**400), r"top_p: expected a number that fits in a float"),
    ],
)
def test_out_of_range_python_integers_are_value_errors(kwargs, match) -> None:
    args = dict(key=jax.random.key(0), temperature=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        specjax.sample_from_logits(LOGITS, **args)


@pytest.mark.parametrize(
    "key", [jnp.zeros((3,), jnp.uint32), jnp.zeros((2, 3), jnp.uint32), jnp.zeros((2, 5), jnp.uint32)]
)
def test_malformed_raw_key_data_is_a_value_error(key) -> None:
    with pytest.raises(ValueError, match=r"key: expected a JAX PRNG key .*got a uint32 array of shape"):
        specjax.sample_from_logits(LOGITS, key=key, temperature=1.0)
    with pytest.raises(ValueError, match=r"key: expected a JAX PRNG key"):
        specjax.verify_from_logits(
            [[1], [2]], np.zeros((2, 1, 8), np.float32), np.zeros((2, 2, 8), np.float32), key=key, temperature=1.0
        )


# --------------------------------------------------------------------------- validate=False, ids outside [0, V)

V = 8
SAMPLERS = ("jax", "numpy", "torch")


def _uniform_case(ids):
    """Every id has p = q = 1/V and u = 0: any in-range id passes its test, so only the id decides."""
    g = len(ids[0])
    b = len(ids)
    q = np.full((b, g, V), 1 / V, np.float32)
    p = np.full((b, g + 1, V), 1 / V, np.float32)
    return q, p, np.zeros((b, g), np.float32), np.full((b,), 0.5, np.float32)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize(
    "ids",
    [
        np.array([[-1, 2]], np.int32),
        np.array([[2, -1]], np.int32),
        np.array([[V, 1]], np.int32),
        np.array([[1, 2**31 - 1]], np.int32),
        np.array([[-(2**31), 0]], np.int32),
        torch.tensor([[2**32 + 3, 1]]),  # int64 that narrowing to int32 would wrap to 3
        torch.tensor([[2**31, 1]]),  # int64 that narrowing would wrap to -2**31
        torch.tensor([[1, -(2**32) + 5]]),  # wraps to 5
    ],
)
def test_unvalidated_ids_outside_the_vocabulary_are_never_accepted(sampler, ids) -> None:
    q, p, u, s = _uniform_case(ids.tolist())
    fn = specjax.load_sampler(sampler)
    out = fn(ids, q, p, u, s, validate=False)
    n = np.asarray(out.num_accepted if sampler != "torch" else out.num_accepted.numpy())
    tokens = np.asarray(out.tokens if sampler != "torch" else out.tokens.numpy())
    first_bad = next(i for i, x in enumerate(ids[0].tolist()) if not 0 <= x < V)
    assert n.tolist() == [first_bad]  # accepted up to the first out-of-range id, never it
    assert np.all((tokens[0, : first_bad + 1] >= 0) & (tokens[0, : first_bad + 1] < V))
    assert np.all(tokens[0, first_bad + 1 :] == -1)


def test_the_three_samplers_agree_on_unvalidated_random_ids() -> None:
    rng = np.random.default_rng(1)
    b, g = 64, 3
    ids = rng.integers(-3, V + 3, size=(b, g))
    q = rng.dirichlet(np.ones(V), size=(b, g)).astype(np.float32)
    p = rng.dirichlet(np.ones(V), size=(b, g + 1)).astype(np.float32)
    u = rng.random((b, g)).astype(np.float32)
    s = rng.random(b).astype(np.float32)
    results = {}
    for name in SAMPLERS:
        out = specjax.load_sampler(name)(torch.tensor(ids), q, p, u, s, validate=False)
        results[name] = {k: np.asarray(v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in vars(out).items()}
        tokens = results[name]["tokens"]
        n = results[name]["num_accepted"]
        emitted = np.arange(g + 1)[None, :] <= n[:, None]
        assert np.all((tokens[emitted] >= 0) & (tokens[emitted] < V)), name
    for name in ("numpy", "torch"):
        np.testing.assert_array_equal(results[name]["num_accepted"], results["jax"]["num_accepted"])
