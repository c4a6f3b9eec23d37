"""Plugins end to end (issue #6): a third-party distribution installed with pip, used by name.

The test builds a tiny separate distribution in a temporary directory (setuptools, one
module with a call-counting sampler and a counting ``register()``), declaring a
``specjax.samplers`` and a ``specjax.plugins`` entry point, and installs it with
``pip install --no-index --no-build-isolation --no-deps --target DIR``. The checks run in
fresh processes (forked by ``forkserver``) with ``DIR`` on ``PYTHONPATH``: that is a real
installation (pip builds the wheel and writes the ``.dist-info`` with its
``entry_points.txt``, which ``importlib.metadata`` finds on ``sys.path``), but it is
visible only to the test's own processes, not to other test runs sharing the virtual
environment; removing ``DIR`` in the fixture's teardown uninstalls it, and the teardown
checks that it is gone.

Also here: the built-in ``numpy`` and ``torch`` samplers used by name in the generation loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import forkserver
import pytest
import torch

import specjax

DIST = "specjax-thirdparty-demo"
MODULE = "specjax_thirdparty_demo"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "0.0.1"

[project.entry-points."specjax.samplers"]
thirdparty = "{MODULE}:counting_sampler"

[project.entry-points."specjax.plugins"]
thirdparty_plugin = "{MODULE}:register"

[tool.setuptools]
py-modules = ["{MODULE}"]
"""

SOURCE = '''
"""A third-party specjax plugin: a sampler that counts its calls."""

CALLS = {"sampler": 0, "register": 0}


def counting_sampler(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, validate=True):
    CALLS["sampler"] += 1
    from specjax.plugin.reference_samplers import torch_rejection_sample

    return torch_rejection_sample(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms,
                                  validate=validate)


def register():
    CALLS["register"] += 1
    from specjax.registry import register_sampler

    register_sampler("thirdparty_registered", "specjax_thirdparty_demo:counting_sampler")
'''

# Tiny models built from configs in the subprocess (no files, no network).
MODELS = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def tiny(seed, layers):
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = None
    return m

target, draft = tiny(0, 2), tiny(1, 1)
ids = torch.tensor([[3, 7, 11, 5]])
"""


def _run(code: str, site: Path | None, env_filter: str | None, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_PLUGINS"}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    if env_filter is not None:
        env["SPECJAX_PLUGINS"] = env_filter
    env["HF_HUB_OFFLINE"] = "1"
    proc = forkserver.run([sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_GONE = f"""
import importlib.metadata as md, json, specjax
try:
    md.distribution({DIST!r})
    found = True
except md.PackageNotFoundError:
    found = False
print(json.dumps({{"found": found, "samplers": specjax.available_samplers()}}))
"""


@pytest.fixture(scope="module")
def thirdparty(tmp_path_factory):
    """The demo distribution, pip-installed into a private directory for the module's tests."""
    root = tmp_path_factory.mktemp("thirdparty")
    src = root / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT, encoding="utf-8")
    (src / f"{MODULE}.py").write_text(SOURCE, encoding="utf-8")
    site = root / "site"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-index",
                "--no-build-isolation",
                "--no-deps",
                "--disable-pip-version-check",
                "--quiet",
                "--target",
                str(site),
                str(src),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert any(
            p.name.startswith("specjax_thirdparty_demo-0.0.1") and p.suffix == ".dist-info" for p in site.iterdir()
        )
        yield site
    finally:
        shutil.rmtree(site, ignore_errors=True)  # uninstall
        # ... and check it is gone for a fresh process that still has the directory on its path
        gone = _run(_GONE, site, None)
        assert gone == {"found": False, "samplers": ["jax", "numpy", "torch"]}


def test_thirdparty_sampler_used_by_name_in_the_loop(thirdparty):
    code = (
        f"""
    import importlib.metadata as md, json
    import specjax, {MODULE} as demo
    from specjax.registry import load_plugins, plugin_status
    """
        + textwrap.indent(MODELS, "    ")
        + f"""
    groups = ("specjax.samplers", "specjax.plugins")
    dist = md.distribution({DIST!r})
    declared = {{g: sorted(ep.name for ep in dist.entry_points if ep.group == g) for g in groups}}
    visible = {{g: sorted(ep.name for ep in md.entry_points(group=g) if ep.dist and ep.dist.name == {DIST!r})
               for g in groups}}
    load_plugins()
    load_plugins()
    registered_calls = demo.CALLS["register"]
    want = target.generate(ids, max_new_tokens=5, do_sample=False)
    got = specjax.speculative_generate(target, draft, ids, max_new_tokens=5, num_draft_tokens=2,
                                       sampler="thirdparty")
    by_entry_point = demo.CALLS["sampler"]
    got2 = specjax.speculative_generate(target, draft, ids, max_new_tokens=5, num_draft_tokens=2,
                                        sampler="thirdparty_registered")
    print(json.dumps({{
        "declared": declared, "visible": visible,
        "status": plugin_status()["thirdparty_plugin"].status,
        "distribution": plugin_status()["thirdparty_plugin"].distribution,
        "register_calls": registered_calls,
        "samplers": specjax.available_samplers(),
        "by_entry_point": by_entry_point, "by_registration": demo.CALLS["sampler"] - by_entry_point,
        "identical": bool(torch.equal(got.sequences, want)) and bool(torch.equal(got2.sequences, want)),
    }}))
    """
    )
    got = _run(code, thirdparty, None)
    assert got["declared"] == {"specjax.samplers": ["thirdparty"], "specjax.plugins": ["thirdparty_plugin"]}
    assert got["visible"] == got["declared"]
    assert got["status"] == "loaded" and got["distribution"] == f"{DIST} 0.0.1"
    assert got["register_calls"] == 1  # load_plugins twice, register once
    assert got["samplers"] == ["jax", "numpy", "thirdparty", "thirdparty_registered", "torch"]
    assert got["by_entry_point"] >= 1 and got["by_registration"] >= 1  # the loop called the plugin's sampler
    assert got["identical"]  # greedy: the same tokens as plain target.generate


_FILTERED = (
    f"""
import json
import specjax, {MODULE} as demo
from specjax.registry import load_plugins, plugin_status

load_plugins()
errors = {{}}
for name in ("thirdparty", "thirdparty_registered"):
    try:
        specjax.load_sampler(name)
        errors[name] = None
    except ValueError as err:
        errors[name] = str(err)
loop_error = None
if errors["thirdparty"] is not None:  # excluded: the loop must refuse the name too (before any compilation)
"""
    + textwrap.indent(MODELS, "    ")
    + """
    try:
        specjax.speculative_generate(target, draft, ids, max_new_tokens=3, sampler="thirdparty")
    except ValueError as err:
        loop_error = str(err)
print(json.dumps({"status": plugin_status()["thirdparty_plugin"].status, "register_calls": demo.CALLS["register"],
                  "errors": errors, "loop_error": loop_error, "samplers": specjax.available_samplers()}))
"""
)


def test_filter_excludes_the_thirdparty_plugin(thirdparty):
    got = _run(_FILTERED, thirdparty, "builtin_samplers,transformers")
    assert got["status"] == "excluded"
    assert got["register_calls"] == 0
    assert got["samplers"] == ["jax", "numpy", "torch"]
    expected = (
        "sampler: unknown sampler 'thirdparty'; installed samplers: jax, numpy, torch "
        "(SPECJAX_PLUGINS='builtin_samplers,transformers' restricts which entry points load)"
    )
    assert got["errors"]["thirdparty"] == expected
    assert got["loop_error"] == expected
    assert got["errors"]["thirdparty_registered"].startswith("sampler: unknown sampler 'thirdparty_registered'")


def test_filter_by_sampler_name_allows_the_entry_point_only(thirdparty):
    got = _run(_FILTERED, thirdparty, "thirdparty")
    assert got["status"] == "excluded" and got["register_calls"] == 0  # the plugin did not run ...
    assert got["samplers"] == ["jax", "thirdparty"]  # ... but its sampler entry point is allowed by name
    assert got["errors"]["thirdparty"] is None
    assert (
        "unknown sampler 'thirdparty_registered'; installed samplers: jax, thirdparty"
        in got["errors"]["thirdparty_registered"]
    )


# --------------------------------------------------------------------------- built-in samplers in the loop


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=96, layers=2, seed=0)
    return target, perturbed_copy(target, noise=0.3, seed=1)


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_builtin_samplers_by_name_match_the_fused_kernel(pair, name):
    target, draft = pair
    ids = torch.tensor([[5, 17, 42, 8, 23]])
    kwargs = dict(max_new_tokens=8, num_draft_tokens=3, temperature=1.0, seed=7)
    kwargs["adaptive"] = False  # the same step structure in both runs, so the same draws
    want = specjax.speculative_generate(target, draft, ids, **kwargs)
    got = specjax.speculative_generate(target, draft, ids, sampler=name, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert got.stats.draft_tokens_accepted == want.stats.draft_tokens_accepted
    # the same callable passed directly
    direct = specjax.speculative_generate(target, draft, ids, sampler=specjax.load_sampler(name), **kwargs)
    assert torch.equal(direct.sequences, want.sequences)


def test_unknown_sampler_in_the_loop(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"sampler: unknown sampler 'nope'; installed samplers: jax, numpy, torch"):
        specjax.speculative_generate(target, draft, torch.tensor([[1, 2]]), max_new_tokens=2, sampler="nope")
