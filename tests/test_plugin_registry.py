"""Tests of plugin loading and the sampler registry (issue #6).

The installed entry points are read from the real distribution metadata; plugin
loading, idempotence, filtering and name clashes are tested with fake entry
points (``importlib.metadata.EntryPoint`` objects pointing at a module the test
puts in ``sys.modules``), and the ``SPECJAX_PLUGINS`` filter also in fresh
subprocesses against the real metadata.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator

import pytest

from specjax import registry
from specjax.plugin import builtin

EXPECTED = {
    "specjax.plugins": {
        "builtin_samplers": "specjax.plugin.builtin:register_samplers",
        "transformers": "specjax.plugin.hf:register",
    },
    "specjax.samplers": {
        "jax": "specjax.boundary.api:rejection_sample",
        "numpy": "specjax.plugin.reference_samplers:numpy_rejection_sample",
        "torch": "specjax.plugin.reference_samplers:torch_rejection_sample",
    },
}

FAKE = "specjax_test_fake_plugins"


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """A registry with nothing loaded, restored to a fresh state afterwards."""
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, clean_registry: None) -> types.SimpleNamespace:
    """A module of counting plugins and samplers, and a way to install fake entry points."""
    mod = types.ModuleType(FAKE)
    mod.calls = {"good": 0, "other": 0, "reentrant": 0}

    def good() -> None:
        mod.calls["good"] += 1
        registry.register_sampler("from_good", f"{FAKE}:sampler_a")

    def other() -> None:
        mod.calls["other"] += 1

    def reentrant() -> None:
        mod.calls["reentrant"] += 1
        registry.load_plugins()  # a plugin looking things up while loading
        registry.available_samplers()

    def broken() -> None:
        raise RuntimeError("boom")

    def sampler_a(*args, validate=True):
        return "a"

    def sampler_b(*args, validate=True):
        return "b"

    for fn in (good, other, reentrant, broken, sampler_a, sampler_b):
        fn.__module__ = FAKE
        fn.__qualname__ = fn.__name__
        setattr(mod, fn.__name__, fn)
    mod.not_callable = 42
    monkeypatch.setitem(sys.modules, FAKE, mod)

    groups: dict[str, list[md.EntryPoint]] = {registry.PLUGINS_GROUP: [], registry.SAMPLERS_GROUP: []}

    def install(
        plugins: dict[str, str] | None = None,
        samplers: list[tuple[str, str]] | None = None,
        drafters: list[tuple[str, str]] | None = None,
    ) -> None:
        groups[registry.PLUGINS_GROUP] = [
            md.EntryPoint(n, v, registry.PLUGINS_GROUP) for n, v in (plugins or {}).items()
        ]
        groups[registry.SAMPLERS_GROUP] = [md.EntryPoint(n, v, registry.SAMPLERS_GROUP) for n, v in (samplers or [])]
        groups["specjax.drafters"] = [md.EntryPoint(n, v, "specjax.drafters") for n, v in (drafters or [])]

    monkeypatch.setattr(registry, "_entry_points", lambda group: list(groups.get(group, [])))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    return types.SimpleNamespace(mod=mod, install=install)


# --------------------------------------------------------------------------- installed metadata


def test_entry_points_declared_by_the_installed_distribution() -> None:
    dist = md.distribution("specjax")
    for group, expected in EXPECTED.items():
        declared = {ep.name: ep.value for ep in dist.entry_points if ep.group == group}
        assert declared == expected, group
        visible = {ep.name: ep.value for ep in md.entry_points(group=group) if ep.dist and ep.dist.name == "specjax"}
        assert visible == expected, group


def test_installed_entry_points_load() -> None:
    from specjax import rejection_sample
    from specjax.plugin import hf, reference_samplers

    loaded = {ep.name: ep.load() for ep in md.distribution("specjax").entry_points if ep.group.startswith("specjax.")}
    assert loaded["jax"] is rejection_sample
    assert loaded["numpy"] is reference_samplers.numpy_rejection_sample
    assert loaded["torch"] is reference_samplers.torch_rejection_sample
    assert loaded["builtin_samplers"] is builtin.register_samplers
    assert loaded["transformers"] is hf.register


def test_builtin_plugin_registers_the_entry_point_targets() -> None:
    assert registry.BUILTIN_SAMPLERS == EXPECTED["specjax.samplers"]


def test_real_plugins_load_and_resolve(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from specjax import rejection_sample
    from specjax.plugin import hf
    from specjax.plugin.reference_samplers import numpy_rejection_sample, torch_rejection_sample

    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    status = registry.load_plugins()
    assert {n: i.status for n, i in status.items()} == {"builtin_samplers": "loaded", "transformers": "loaded"}
    assert status["transformers"].distribution.startswith("specjax ")
    assert registry.available_samplers() == ["jax", "numpy", "torch"]
    assert registry.load_sampler("jax") is rejection_sample
    assert registry.load_sampler("numpy") is numpy_rejection_sample
    assert registry.load_sampler("torch") is torch_rejection_sample
    assert registry.available_custom_generates() == ["specjax"]
    assert registry.load_custom_generate("specjax") is hf.speculative_decoding
    import specjax

    assert specjax.load_sampler is registry.load_sampler
    assert specjax.available_samplers is registry.available_samplers


def test_unknown_sampler_lists_installed(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    with pytest.raises(ValueError, match=r"sampler: unknown sampler 'nope'; installed samplers: jax, numpy, torch$"):
        registry.load_sampler("nope")
    with pytest.raises(TypeError, match=r"sampler: expected a sampler name \(str\), got int"):
        registry.load_sampler(3)


def test_generate_resolves_sampler_names_through_the_registry(clean_registry: None) -> None:
    from specjax.generate import _resolve_sampler
    from specjax.plugin.reference_samplers import torch_rejection_sample

    assert _resolve_sampler("jax") is None  # the fused path
    assert _resolve_sampler("torch").__wrapped__ is torch_rejection_sample  # its output checked by the loop
    with pytest.raises(ValueError, match=r"unknown sampler 'nope'; installed samplers: jax, numpy, torch"):
        _resolve_sampler("nope")


# --------------------------------------------------------------------------- loading


def test_load_plugins_is_idempotent(fake: types.SimpleNamespace) -> None:
    fake.install({"good": f"{FAKE}:good", "other": f"{FAKE}:other"})
    first = registry.load_plugins()
    second = registry.load_plugins()
    registry.available_samplers()
    registry.load_sampler("from_good")
    assert fake.mod.calls == {"good": 1, "other": 1, "reentrant": 0}
    assert first == second
    assert {n: i.status for n, i in first.items()} == {"good": "loaded", "other": "loaded"}


def test_nothing_is_loaded_until_asked(fake: types.SimpleNamespace) -> None:
    fake.install({"good": f"{FAKE}:good"})
    assert registry.plugin_status() == {}
    assert fake.mod.calls["good"] == 0
    registry.available_samplers()
    assert fake.mod.calls["good"] == 1


def test_plugin_calling_the_registry_while_loading(fake: types.SimpleNamespace) -> None:
    fake.install({"reentrant": f"{FAKE}:reentrant", "good": f"{FAKE}:good"})
    registry.load_plugins()
    registry.load_plugins()
    assert fake.mod.calls["reentrant"] == 1
    assert fake.mod.calls["good"] == 1


def test_failing_plugins_are_logged_and_the_others_load(
    fake: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    fake.install(
        {
            "broken": f"{FAKE}:broken",
            "missing": "specjax_no_such_module:register",
            "notfn": f"{FAKE}:not_callable",
            "good": f"{FAKE}:good",
        }
    )
    with caplog.at_level(logging.ERROR, logger="specjax.plugin"):
        status = registry.load_plugins()
    assert status["good"].status == "loaded"
    assert status["broken"].status == "failed" and status["broken"].error == "RuntimeError: boom"
    assert status["missing"].status == "failed" and "ModuleNotFoundError" in status["missing"].error
    assert status["notfn"].status == "failed" and "not a callable register()" in status["notfn"].error
    assert sum("failed" in r.getMessage() for r in caplog.records) == 3
    with pytest.raises(
        ValueError,
        match=r"unknown sampler 'x'; installed samplers: from_good, jax; plugins that "
        r"failed to load: broken \(RuntimeError: boom\)",
    ):
        registry.load_sampler("x")


def test_load_plugins_by_group_imports_without_calling(
    fake: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    fake.install({"good": f"{FAKE}:good", "missing": "specjax_no_such_module:register"})
    with caplog.at_level(logging.ERROR, logger="specjax.plugin"):
        loaded = registry.load_plugins_by_group(registry.PLUGINS_GROUP)
    assert loaded == {"good": fake.mod.good}
    assert fake.mod.calls["good"] == 0
    assert any("specjax_no_such_module" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------- SPECJAX_PLUGINS


@pytest.mark.parametrize(
    ("env", "plugins_run", "samplers"),
    [
        (None, {"good", "other"}, ["ep_sampler", "from_good", "jax"]),
        ("good", {"good"}, ["from_good", "jax"]),
        ("other, ep_sampler", {"other"}, ["ep_sampler", "jax"]),
        ("", set(), ["jax"]),
        (",", set(), ["jax"]),
    ],
)
def test_filter_applies_to_both_groups(
    fake: types.SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    env: str | None,
    plugins_run: set[str],
    samplers: list[str],
) -> None:
    fake.install({"good": f"{FAKE}:good", "other": f"{FAKE}:other"}, [("ep_sampler", f"{FAKE}:sampler_b")])
    if env is not None:
        monkeypatch.setenv(registry.ENV_VAR, env)
    status = registry.load_plugins()
    assert {n for n, i in status.items() if i.status == "loaded"} == plugins_run
    assert {n for n, i in status.items() if i.status == "excluded"} == {"good", "other"} - plugins_run
    assert {n for n, c in fake.mod.calls.items() if c} == plugins_run
    assert registry.available_samplers() == samplers
    if "ep_sampler" not in samplers:
        with pytest.raises(
            ValueError,
            match=rf"unknown sampler 'ep_sampler'; installed samplers: "
            rf"{', '.join(samplers)} \({registry.ENV_VAR}=",
        ):
            registry.load_sampler("ep_sampler")


def test_filter_is_read_once_per_process(fake: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.install({"good": f"{FAKE}:good"}, [("ep_sampler", f"{FAKE}:sampler_b")])
    monkeypatch.setenv(registry.ENV_VAR, "good")
    assert registry.available_samplers() == ["from_good", "jax"]
    monkeypatch.setenv(registry.ENV_VAR, "ep_sampler")  # too late: the first load_plugins() read it
    assert registry.available_samplers() == ["from_good", "jax"]
    with pytest.raises(ValueError, match=r"\(SPECJAX_PLUGINS='good' restricts which entry points load\)"):
        registry.load_sampler("ep_sampler")


_PROBE = """
import json, sys
import specjax
from specjax.registry import plugin_status
names = specjax.available_samplers()
print(json.dumps({"samplers": names,
                  "plugins": {n: i.status for n, i in plugin_status().items()},
                  "jax_imported": "jax" in sys.modules}))
"""


@pytest.mark.parametrize(
    ("env", "samplers", "plugins"),
    [
        (None, ["jax", "numpy", "torch"], {"builtin_samplers": "loaded", "transformers": "loaded"}),
        ("builtin_samplers", ["jax", "numpy", "torch"], {"builtin_samplers": "loaded", "transformers": "excluded"}),
        ("transformers", ["jax"], {"builtin_samplers": "excluded", "transformers": "loaded"}),
        ("numpy", ["jax", "numpy"], {"builtin_samplers": "excluded", "transformers": "excluded"}),
        ("", ["jax"], {"builtin_samplers": "excluded", "transformers": "excluded"}),
    ],
)
def test_filter_in_a_fresh_process(env: str | None, samplers: list[str], plugins: dict[str, str]) -> None:
    environ = {k: v for k, v in os.environ.items() if k != registry.ENV_VAR}
    if env is not None:
        environ[registry.ENV_VAR] = env
    out = subprocess.run([sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["samplers"] == samplers
    assert {k: v for k, v in got["plugins"].items() if k in plugins} == plugins
    assert got["jax_imported"] is False  # listing and registering import no sampler


def test_importing_the_plugin_modules_has_no_side_effects() -> None:
    code = """
import sys
import specjax, specjax.plugin, specjax.plugin.hf, specjax.plugin.builtin
import specjax.plugin.reference_samplers
from specjax import registry
heavy = sorted(m for m in ("jax", "torch", "transformers") if m in sys.modules)
assert heavy == [], heavy
assert registry.plugin_status() == {} and not registry._samplers.registered, "registered at import"
assert not registry._custom_generates.registered
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --------------------------------------------------------------------------- registration


def test_register_sampler_rules(fake: types.SimpleNamespace) -> None:
    fake.install()
    registry.register_sampler("mine", fake.mod.sampler_a)
    registry.register_sampler("mine", fake.mod.sampler_a)  # the same object: no-op
    registry.register_sampler("mine", f"{FAKE}:sampler_a")  # the same target by name: no-op
    assert registry.load_sampler("mine") is fake.mod.sampler_a
    with pytest.raises(
        ValueError,
        match=rf"sampler 'mine': already registered as {FAKE}:sampler_a .*refusing to "
        rf"replace it with {FAKE}:sampler_b \(pass override=True",
    ):
        registry.register_sampler("mine", fake.mod.sampler_b)
    registry.register_sampler("mine", fake.mod.sampler_b, override=True)
    assert registry.load_sampler("mine") is fake.mod.sampler_b
    with pytest.raises(ValueError, match=r"sampler name: expected letters, digits, '_', '.' or '-', got 'a b'"):
        registry.register_sampler("a b", fake.mod.sampler_a)
    with pytest.raises(ValueError, match=r"sampler name: .* got ''"):
        registry.register_sampler("", fake.mod.sampler_a)
    with pytest.raises(TypeError, match=r"sampler 'x': expected a callable or a 'module:attribute' string, got int"):
        registry.register_sampler("x", 3)
    with pytest.raises(
        ValueError,
        match=r"sampler 'x': expected a callable or a 'module:attribute' string, "
        r"got 'no_colon'",
    ):
        registry.register_sampler("x", "no_colon")
    with pytest.raises(ValueError, match=r"sampler 'jax': reserved for specjax.boundary.api:rejection_sample"):
        registry.register_sampler("jax", fake.mod.sampler_a)
    registry.register_sampler("jax", "specjax.boundary.api:rejection_sample")  # the same target: allowed


def test_lazy_targets_fail_clearly_on_use(fake: types.SimpleNamespace) -> None:
    fake.install()
    registry.register_sampler("gone", "specjax_no_such_module:sample")
    registry.register_sampler("number", f"{FAKE}:not_callable")
    assert "gone" in registry.available_samplers()  # registering imports nothing
    with pytest.raises(ImportError, match=r"sampler 'gone': cannot import specjax_no_such_module:sample"):
        registry.load_sampler("gone")
    with pytest.raises(TypeError, match=rf"sampler 'number': {FAKE}:not_callable is a int, not a callable"):
        registry.load_sampler("number")


def test_clashing_entry_points_are_ambiguous(fake: types.SimpleNamespace) -> None:
    fake.install(
        samplers=[
            ("twice", f"{FAKE}:sampler_a"),
            ("twice", f"{FAKE}:sampler_b"),
            ("same", f"{FAKE}:sampler_a"),
            ("same", f"{FAKE}:sampler_a"),
        ]
    )
    assert registry.load_sampler("same") is fake.mod.sampler_a  # a duplicate, not a clash
    with pytest.raises(
        ValueError,
        match=rf"sampler: 'twice' is ambiguous: declared as {FAKE}:sampler_a .* and as "
        rf"{FAKE}:sampler_b",
    ):
        registry.load_sampler("twice")
    assert registry.sampler_origins()["twice"].startswith("ambiguous: ")
    registry.register_sampler("same", f"{FAKE}:sampler_b", override=True)  # a plugin may override on purpose
    assert registry.load_sampler("same") is fake.mod.sampler_b


def test_plugin_registration_conflicting_with_an_entry_point(fake: types.SimpleNamespace) -> None:
    fake.install(samplers=[("dup", f"{FAKE}:sampler_a")])
    registry.register_sampler("dup", f"{FAKE}:sampler_b")
    with pytest.raises(ValueError, match=r"'dup' is ambiguous"):
        registry.load_sampler("dup")


def test_entry_point_named_jax_cannot_replace_the_kernel(
    fake: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    from specjax import rejection_sample

    fake.install(samplers=[("jax", f"{FAKE}:sampler_a")])
    with caplog.at_level(logging.WARNING, logger="specjax.plugin"):
        assert registry.load_sampler("jax") is rejection_sample
    assert any("reserved" in r.getMessage() for r in caplog.records)


def test_custom_generate_registry(fake: types.SimpleNamespace) -> None:
    fake.install({"hf": "specjax.plugin.hf:register"})
    from specjax.plugin import hf

    assert registry.available_custom_generates() == ["specjax"]
    assert registry.load_custom_generate("specjax") is hf.speculative_decoding
    with pytest.raises(ValueError, match=r"custom_generate: unknown name 'x'; registered: specjax"):
        registry.load_custom_generate("x")


def test_drafter_entry_points_follow_the_registry_rules(
    fake: types.SimpleNamespace, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reading of entry points for every group: drafters get the samplers' rules (issue 57)."""
    from specjax.drafters import available_drafters, load_drafter

    fake.install(
        drafters=[
            ("ngram", f"{FAKE}:sampler_a"),  # shadows a built-in: ignored, with a warning
            ("twice", f"{FAKE}:sampler_a"),
            ("twice", f"{FAKE}:sampler_b"),
            ("gone", "no_such_module_xyz:make"),
            ("kept", f"{FAKE}:sampler_a"),
        ]
    )
    with caplog.at_level(logging.WARNING, logger="specjax.plugin"):
        assert {"gone", "kept", "twice"} <= set(available_drafters())
    assert any("'ngram' is reserved for the built-in" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=rf"draft: drafter 'twice' is ambiguous: declared as {FAKE}:sampler_a"):
        load_drafter("twice")
    with pytest.raises(ValueError, match=r"draft: drafter 'gone': cannot import no_such_module_xyz:make"):
        load_drafter("gone")
    with pytest.raises(ValueError, match=r"draft: drafter 'kept' \(.*:sampler_a\) returned a str without start"):
        load_drafter("kept")
    monkeypatch.setenv(registry.ENV_VAR, "gone")  # SPECJAX_PLUGINS filters drafters by name too
    assert "kept" not in available_drafters() and "gone" in available_drafters()
