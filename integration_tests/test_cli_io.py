"""The ``specjax`` command on awkward tokenizers, prompts and output streams (issue 58).

Each was a traceback and exit status 1 before:

* a tokenizer with neither a pad nor an EOS token (a batch needs padding: any
  token will do, since padding is masked) now generates;
* a chat template that raises, and a ``--prompt`` whose bytes are not UTF-8 (or
  a prompts file with a lone surrogate), are one line on stderr, status 2;
* a reader that stops early (``specjax generate --json ... | head -1``) ends the
  command quietly, status 1 (Python's documented handling of SIGPIPE);
* standard output on a full disk (``/dev/full``) is one line, status 74 (EX_IOERR).

The pipe, the non-UTF-8 argument and ``/dev/full`` need a real process (the fork
server hands commands a file for stdout and text arguments); the rest use it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_cli_errors import EXE, _model_dir, _tokenizer, one_line, run_cli

PROMPT = "w1 w2 w3"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("cli_io_models")
    target = _model_dir(root / "target", layers=2, seed=0)
    # neither pad nor EOS: a word-level vocabulary with an unknown token only, a model config without either
    bare = shutil.copytree(target, root / "bare")
    words = ["<unk>", *(f"w{i}" for i in range(63))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>").save_pretrained(bare)
    model = LlamaForCausalLM.from_pretrained(bare)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = cfg.pad_token_id = cfg.bos_token_id = None
    model.save_pretrained(bare)
    # a chat template that raises (as templates that require a system message do)
    bad_chat = shutil.copytree(target, root / "bad_chat")
    tok = _tokenizer(64)
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    tok.save_pretrained(bad_chat)
    return {"target": target, "bare": bare, "bad_chat": bad_chat}


def prompts_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return path


def real_cli(*args: str | bytes, **kwargs) -> subprocess.CompletedProcess:
    """``specjax ARGS`` as a real process (arguments may be bytes)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([str(EXE), *args], env=env, timeout=300, **kwargs)


def quiet(stderr: str) -> None:
    for word in ("Traceback", "Error", "Exception ignored"):
        assert word not in stderr, stderr[-3000:]


def test_a_tokenizer_without_pad_and_eos_tokens_generates_a_padded_batch(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = ["w1 w2 w3 w4", "w5"]  # different lengths: the batch is padded
    proc = run_cli(
        "generate",
        "--target",
        str(models["bare"]),
        "--drafter",
        "ngram",
        "--prompts-file",
        str(prompts_file(tmp_path / "p.jsonl", prompts)),
        "--max-new-tokens",
        "6",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    model = AutoModelForCausalLM.from_pretrained(models["bare"]).eval()
    tok = AutoTokenizer.from_pretrained(models["bare"])
    assert tok.pad_token is None and tok.eos_token is None
    for row, prompt in zip(rows, prompts, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        plain = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=0)[0, ids.shape[1] :]
        assert row["token_ids"] == plain.tolist()


def test_a_chat_template_that_raises_is_one_line(models):
    line = one_line(
        run_cli("generate", "--target", str(models["bad_chat"]), "--drafter", "ngram", "--chat", "--prompt", PROMPT)
    )
    assert line == (
        "error: --chat: the tokenizer's chat template failed on a user message (Conversation roles must "
        "alternate user/assistant); fix the template or leave out --chat"
    )


def test_a_prompt_that_is_not_utf8_is_one_line(models):
    proc = real_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--drafter",
        "ngram",
        "--prompt",
        b"w1 \xff w2",
        text=True,
        capture_output=True,
    )
    assert one_line(proc) == (
        "error: --prompt: not valid UTF-8 text (byte 0xff at character 3); pass the prompt as UTF-8"
    )


def test_a_prompts_file_with_a_lone_surrogate_is_one_line(models, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "w1"}\n{"prompt": "w2 \\ud800"}\n', encoding="utf-8")
    line = one_line(
        run_cli("generate", "--target", str(models["target"]), "--drafter", "ngram", "--prompts-file", str(path))
    )
    assert line == f"error: --prompts-file {path}: line 2: not valid UTF-8 text (U+D800 at character 3); " + (
        "pass the prompt as UTF-8"
    )


def test_a_reader_that_stops_early_ends_the_command_quietly(models, tmp_path):
    """``specjax generate --json ... | head -1``: the pipe closes after the first line of 40."""
    path = prompts_file(tmp_path / "p.jsonl", [f"w{i} w{i + 1}" for i in range(1, 41)])
    args = ["--target", str(models["target"]), "--drafter", "ngram", "--prompts-file", str(path)]
    proc = subprocess.Popen(
        [str(EXE), "generate", *args, "--batch-size", "1", "--max-new-tokens", "4", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` exits: every later write meets a closed pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 1, stderr[-3000:]
    assert json.loads(first)["prompt"] == "w1 w2"
    quiet(stderr)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("json_lines", [False, True], ids=["text", "json"])
def test_stdout_on_a_full_disk_is_one_line(models, json_lines):
    with open("/dev/full", "w") as full:
        proc = real_cli(
            "generate",
            "--target",
            str(models["target"]),
            "--drafter",
            "ngram",
            "--prompt",
            PROMPT,
            *(["--json"] if json_lines else []),
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert proc.returncode == 74, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].endswith(
        "error: cannot write the output to stdout ([Errno 28] No space left on device)"
    )


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_num_draft_tokens_flag_is_bounded_by_name(command):
    """The flag's own error, not the Python argument's from deep inside (issue 58, G is capped at 128)."""
    from specjax.cli import CLIError, build_parser
    from specjax.generate.checks import MAX_DRAFT_TOKENS

    assert build_parser().parse_args([command, "--num-draft-tokens", str(MAX_DRAFT_TOKENS)]).num_draft_tokens == 128
    with pytest.raises(CLIError, match=r"argument --num-draft-tokens: expected an integer in \[1, 128\], got 129"):
        build_parser().parse_args([command, "--num-draft-tokens", str(MAX_DRAFT_TOKENS + 1)])
