"""The installed ``specjax`` command on broken inputs (issue 22): one line naming what is wrong, exit 2.

Before the fixes these were tracebacks: a garbage or truncated ``model.safetensors``, a
``--target`` naming a file (whose message suggested turning off torch's safe loading), and a
``--sampler`` whose plugin fails to import (here a real entry-point distribution on
``PYTHONPATH`` whose module calls ``sys.exit``). Also here: the statistics line reports
tokens/s without the one-time model load and JIT compilation, which it reports apart.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import forkserver
import pytest
import torch

EXE = Path(sys.executable).with_name("specjax")


def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"w{i}" for i in range(vocab_size - 4)]
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _model_dir(path: Path, *, layers: int, seed: int, vocab: int = 64) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    _tokenizer(vocab).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_error_models")
    good = _model_dir(root / "target", layers=2, seed=0)
    draft = _model_dir(root / "draft", layers=1, seed=1)
    broken = {}
    for name, damage in {
        "garbage": lambda data: b"definitely not a safetensors file " * 8,
        "truncated": lambda data: data[: len(data) // 2],
        "empty": lambda data: b"",
    }.items():
        d = shutil.copytree(draft, root / name)
        weights = d / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
        broken[name] = d
    no_config = shutil.copytree(draft, root / "no_config")
    (no_config / "config.json").unlink()
    bad_config = shutil.copytree(draft, root / "bad_config")
    (bad_config / "config.json").write_text("{not json", encoding="utf-8")
    return {"target": good, "draft": draft, "no_config": no_config, "bad_config": bad_config, **broken}


def run_cli(*args: str, pythonpath: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return forkserver.run([EXE, *args], timeout=timeout, env=env)  # a fresh `specjax` process, imports preloaded


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


# --------------------------------------------------------------------------- model files


@pytest.mark.parametrize(
    ("broken", "role", "reason"),
    [
        ("garbage", "target", r"header too large"),
        ("truncated", "draft", r"incomplete metadata, file not fully covered"),
        ("empty", "draft", r"header too small"),
    ],
)
def test_corrupted_safetensors_is_one_line_naming_the_file(models, broken, role, reason):
    paths = {"target": models["target"], "draft": models["draft"], role: models[broken]}
    line = one_line(
        run_cli("generate", "--target", str(paths["target"]), "--draft", str(paths["draft"]), "--prompt", "w1 w2")
    )
    assert re.fullmatch(
        rf"error: --{role} {re.escape(str(models[broken]))}: model.safetensors is not a valid "
        rf"safetensors file \(.*{reason}.*\); save or download the model again",
        line,
    ), line


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_target_naming_a_file_is_one_line(models, name):
    path = models["target"] / name
    line = one_line(run_cli("generate", "--target", str(path), "--draft", str(models["draft"]), "--prompt", "w1"))
    assert line == f"error: --target {path}: is a file, expected a model directory with config.json and the weights"
    assert "weights_only" not in line


@pytest.mark.parametrize(
    ("which", "message"),
    [
        ("no_config", r"no config.json in the directory \(expected a transformers model directory\)"),
        ("bad_config", r"config.json is not readable JSON \(Expecting property name"),
    ],
)
def test_model_directory_without_a_usable_config(models, which, message):
    line = one_line(
        run_cli("generate", "--target", str(models["target"]), "--draft", str(models[which]), "--prompt", "w1")
    )
    assert re.fullmatch(rf"error: --draft {re.escape(str(models[which]))}: {message}.*", line), line


# --------------------------------------------------------------------------- sampler plugins failing on import


@pytest.fixture(scope="module")
def failing_site(tmp_path_factory) -> Path:
    """A real distribution (a ``.dist-info`` with entry points) whose sampler and plugin exit on import."""
    site = tmp_path_factory.mktemp("failing_site")
    (site / "specjax_cli_exits.py").write_text("import sys\nsys.exit(3)\n", encoding="utf-8")
    (site / "specjax_cli_raises.py").write_text("raise ImportError('needs libfoo.so')\n", encoding="utf-8")
    info = site / "specjax_cli_failing-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: specjax-cli-failing\nVersion: 0.1\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""
        [specjax.samplers]
        exits_on_import = specjax_cli_exits:sampler
        raises_on_import = specjax_cli_raises:sampler

        [specjax.plugins]
        cli_exiting_plugin = specjax_cli_exits:register
    """),
        encoding="utf-8",
    )
    return site


@pytest.mark.parametrize(
    ("sampler", "why"),
    [
        ("exits_on_import", r"SystemExit: 3"),
        ("raises_on_import", r"ImportError: needs libfoo.so"),
    ],
)
def test_sampler_plugin_failing_to_import_is_one_error_line(failing_site, sampler, why):
    proc = run_cli("generate", "--prompt", "w1", "--sampler", sampler, pythonpath=failing_site)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    # the failing plugin (another entry point of the same distribution) is one warning line
    assert lines[:-1] == [
        "warning: specjax.plugins: plugin cli_exiting_plugin = specjax_cli_exits:register failed: SystemExit: 3"
    ], lines
    assert re.fullmatch(
        rf"error: --sampler {sampler}: sampler '{sampler}': cannot import "
        rf"specjax_cli_\w+:sampler \(entry point specjax.samplers:{sampler} of specjax-cli-failing "
        rf"0.1\): {why}",
        lines[-1],
    ), lines[-1]


def test_unknown_sampler_lists_the_plugins_that_failed(failing_site):
    proc = run_cli("generate", "--prompt", "w1", "--sampler", "from_the_failed_plugin", pythonpath=failing_site)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: --sampler from_the_failed_plugin: sampler: unknown sampler 'from_the_failed_plugin'; "
        r"installed samplers: .*; plugins that failed to load: cli_exiting_plugin \(SystemExit: 3\)",
        last,
    ), last


# --------------------------------------------------------------------------- one-time work apart from tokens/s


def test_stats_line_reports_one_time_work_apart(models):
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        "5",
        "--temperature",  # sampled: the draws and the acceptance step are jitted (greedy ones are torch argmaxes)
        "0.7",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(
        r"\[(\d+) tokens, (\d+\.\d) tokens/s, .* steps; one-time work not counted: model load "
        r"(\d+\.\d) s, JIT compilation (\d+\.\d) s\]",
        proc.stderr,
    )
    assert m, proc.stderr[-3000:]
    assert float(m.group(4)) > 0  # a fresh process traces and compiles (or loads) the loop's steps


def test_json_records_carry_compile_and_load_time(models):
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        "3",
        "--temperature",
        "0.7",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    stats = record["stats"]
    assert stats["compile_time_s"] > 0 and record["load_time_s"] > 0
    wall, compile_s = stats["wall_time_s"], stats["compile_time_s"]
    # at least the compile time is left out of the decoding time tokens/s is computed over
    assert stats["tokens_per_s"] >= stats["new_tokens"] / (wall - compile_s) * (1 - 1e-9)
