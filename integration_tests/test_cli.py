"""The installed ``specjax`` command: generate on local models, and its one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
import torch

EXE = Path(sys.executable).with_name("specjax")


def _tokenizer(words: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _model_dir(
    path: Path, *, layers: int, seed: int, words: list[str] | None, vocab: int = 64, with_tokenizer: bool = True
) -> Path:
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
    if with_tokenizer:
        _tokenizer(words or [f"w{i}" for i in range(vocab - 4)]).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    return {
        "target": _model_dir(root / "target", layers=2, seed=0, words=None),
        "draft": _model_dir(root / "draft", layers=1, seed=1, words=None),
        "notok": _model_dir(root / "notok", layers=1, seed=2, words=None, with_tokenizer=False),
        "other": _model_dir(root / "other", layers=1, seed=3, words=[f"x{i}" for i in range(60)]),
        "big": _model_dir(root / "big", layers=1, seed=4, words=[f"w{i}" for i in range(252)], vocab=256),
    }


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return forkserver.run([EXE, *args], timeout=timeout, env=env)  # a fresh `specjax` process, imports preloaded


def test_console_script_is_installed():
    assert EXE.exists(), f"console script missing at {EXE}: is the package installed?"


def test_generate_json_matches_target_greedy(models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3"}\n"w4 w5"\n{"prompt": "w7 w8 w9 w10 w11"}\n')
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--batch-size",
        "2",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert [r["prompt"] for r in records] == ["w1 w2 w3", "w4 w5", "w7 w8 w9 w10 w11"]
    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    tok = AutoTokenizer.from_pretrained(models["target"])
    for rec in records:
        ids = tok(rec["prompt"], return_tensors="pt")["input_ids"]
        ref = target.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert rec["token_ids"] == ref[0, ids.shape[1] :].tolist()
        assert set(rec["stats"]) >= {"acceptance_rate", "tokens_per_s", "mean_accepted_length", "steps"}
        assert rec["text"] == tok.decode(rec["token_ids"], skip_special_tokens=True)


@pytest.fixture(scope="module")
def char_model(tmp_path_factory, char_tokenizer) -> Path:
    """A target (also its own draft) with a character-level tokenizer: stop strings span tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("cli_char_model")
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,  # varied greedy output
        bos_token_id=None,
        eos_token_id=95,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def test_generate_json_logprobs_and_stop_match_target_generate(char_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(char_model).eval()
    tok = AutoTokenizer.from_pretrained(char_model)
    prompt = "Hello, world"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    free = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)[0, ids.shape[1] :]
    stop = tok.decode(free[4:7])  # completed by the 7th token
    ref = target.generate(
        ids,
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=0,
        stop_strings=[stop],
        tokenizer=tok,
        output_logits=True,
        return_dict_in_generate=True,
    )
    want_ids = ref.sequences[0, ids.shape[1] :].tolist()
    assert len(want_ids) <= 7
    args = ["--target", str(char_model), "--draft", str(char_model), "--prompt", prompt, "--max-new-tokens", "12"]
    proc = run_cli("generate", *args, "--stop", stop, "--json", "--logprobs")
    assert proc.returncode == 0, proc.stderr
    (record,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert record["token_ids"] == want_ids
    want = [float(torch.log_softmax(ref.logits[t][0], -1)[tkn]) for t, tkn in enumerate(want_ids)]
    assert record["logprobs"] == pytest.approx(want, abs=1e-4)
    plain = run_cli("generate", *args, "--json")  # no flag, no field
    assert plain.returncode == 0, plain.stderr
    assert "logprobs" not in json.loads(plain.stdout.splitlines()[0])


def test_generate_streams_single_prompt(models):
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompt",
        "w1 w2",
        "--max-new-tokens",
        "5",
        "--temperature",
        "0.7",
        "--top-k",
        "10",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "no text streamed"
    assert "tokens/s" in proc.stderr and "acceptance" in proc.stderr


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ["generate", "--target", "/nonexistent/model", "--draft", "/nonexistent/d", "--prompt", "x"],
            r"--target /nonexistent/model: no such model directory",
        ),
        (["generate", "--prompt", "x", "--max-new-tokens", "0"], r"--max-new-tokens: .*expected an integer >= 1"),
        (["generate", "--prompt", "x", "--temperature", "-1"], r"--temperature: .*expected a finite number >= 0"),
        (["generate", "--prompt", "x", "--top-p", "1.5"], r"--top-p: .*expected a number in \(0, 1\]"),
        (["generate", "--prompt", "x", "--top-k", "abc"], r"--top-k: .*expected an integer >= 0"),
        (["generate", "--prompt", "x", "--device", "tpu"], r"--device: invalid choice"),
        (["generate", "--max-new-tokens", "3"], r"give exactly one of --prompt TEXT or --prompts-file"),
        (["generate", "--prompt", "x", "--logprobs"], r"generate: --logprobs needs --json"),
        (["generate", "--prompt", "x", "--stop", ""], r"generate: --stop: expected a non-empty string"),
        (["frobnicate"], r"invalid choice: 'frobnicate'"),
        (
            ["generate", "--prompt", "x", "--seed", "99999999999999999999"],
            r"--seed: .*expected an integer in \[-2\*\*63, 2\*\*63 - 1\], got '99999999999999999999'",
        ),
        (["demo", "--seed", "x"], r"--seed: .*expected an integer in .*, got 'x'"),
        (["demo", "--device", "cuda"], r"--device: invalid choice: 'cuda' \(choose from '?cpu'?, '?jax'?\)"),
        (["bench", "--sections"], r"--sections: expected at least one argument"),
        (["bench", "--out", "/dev/null/x", "--sections", "kernel"], r"--out /dev/null/x: cannot create the output"),
    ],
)
def test_bad_flags_one_line_exit_2(args, pattern):
    proc = run_cli(*args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    import re

    assert re.search(pattern, lines[0]), lines[0]


def test_model_without_tokenizer(models):
    proc = run_cli("generate", "--target", str(models["notok"]), "--draft", str(models["draft"]), "--prompt", "w1")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "has no usable tokenizer" in proc.stderr


def test_incompatible_vocabularies(models):
    same_size = run_cli(
        "generate", "--target", str(models["target"]), "--draft", str(models["other"]), "--prompt", "w1"
    )
    assert same_size.returncode == 2, same_size.stderr
    assert "incompatible with the target" in same_size.stderr and "different strings" in same_size.stderr
    bigger = run_cli("generate", "--target", str(models["target"]), "--draft", str(models["big"]), "--prompt", "w1")
    assert bigger.returncode == 2
    assert "differ by more than padding" in bigger.stderr
    assert "Traceback" not in same_size.stderr + bigger.stderr


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (None, r"--prompts-file .*: cannot read it"),
        ("{not json\n", r"line 1 is not JSON"),
        ('{"text": "w1"}\n', r'line 1: expected \{"prompt": "..."\}'),
        ("\n\n", r"no prompts in the file"),
    ],
)
def test_unreadable_prompts_file(models, tmp_path, content, pattern):
    path = tmp_path / "p.jsonl"
    if content is not None:
        path.write_text(content)
    proc = run_cli(
        "generate", "--target", str(models["target"]), "--draft", str(models["draft"]), "--prompts-file", str(path)
    )
    assert proc.returncode == 2
    import re

    assert re.search(pattern, proc.stderr), proc.stderr
    assert proc.stderr.count("\n") == 1


def test_debug_shows_traceback():
    proc = run_cli("--debug", "generate", "--target", "/nonexistent/model", "--draft", "/x", "--prompt", "x")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (["--jax-cpu-threads", "0", "demo"], r"--jax-cpu-threads: .*expected an integer >= 1, got 0"),
        (
            ["--jax-cpu-threads", "100000", "demo", "--quick"],
            r"--jax-cpu-threads: n: expected an integer in \[1, \d+\] \(the CPUs this process may use\)",
        ),
        (
            ["--jax-cpu-threads", "1", "bench", "--sections", "sharded"],
            r"--jax-cpu-threads: applies to sections kernel, logits, draft-sweep, generate, overheads, not to sharded",
        ),
    ],
)
def test_bad_jax_cpu_threads_one_line_exit_2(args, pattern):
    test_bad_flags_one_line_exit_2(args, pattern)


def test_generate_with_a_one_thread_jax_pool(models):
    """--jax-cpu-threads 1 gives the same tokens as XLA's default pool (and the run succeeds)."""
    common = [
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompt",
        "w1 w2 w3",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.9",
        "--seed",
        "5",
        "--json",
    ]
    default, one = run_cli(*common), run_cli("--jax-cpu-threads", "1", *common)
    assert default.returncode == 0 and one.returncode == 0, (default.stderr, one.stderr)
    assert json.loads(one.stdout)["token_ids"] == json.loads(default.stdout)["token_ids"]


def test_generate_keeps_its_compiled_steps_in_the_specjax_cache(models, tmp_path):
    """Without JAX's own cache settings, `specjax generate` keeps its programs in SPECJAX_CACHE_DIR/jax."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT"))}
    # JAX_LOG_COMPILES: JAX reports each persistent-cache hit on stderr
    env.update(HF_HUB_OFFLINE="1", SPECJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_LOG_COMPILES="1")
    args = [EXE, "generate", "--target", str(models["target"]), "--draft", str(models["draft"])]
    args += ["--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--temperature", "0.9", "--seed", "5", "--json"]
    first = forkserver.run(args, timeout=300, env=env)
    assert first.returncode == 0, first.stderr
    hit = "Persistent compilation cache hit"
    assert list((tmp_path / "cache" / "jax").glob("*-cache")), "no compiled program was kept"
    assert hit not in first.stderr
    again = forkserver.run(args, timeout=300, env=env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert hit in again.stderr  # the second run loaded what the first compiled
    # caching off: nothing written, not even to ./off (the session's own JAX cache, which
    # the CLI leaves alone, spares this run its compilations)
    env = dict(os.environ, HF_HUB_OFFLINE="1", SPECJAX_CACHE_DIR="off")
    off = forkserver.run(args, timeout=300, env=env, cwd=tmp_path)
    assert off.returncode == 0, off.stderr
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_generate_on_the_jax_device_matches_target_greedy(models, tmp_path, drafter):
    """--device jax: the models on torchax's jax device (JAX's CPU backend here), the JAX path's loop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"w1 w2 w3"\n"w4 w5 w4 w5 w4"\n')
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        *(["--draft", str(models["draft"])] if drafter == "model" else []),
        "--drafter",
        drafter,
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        "6",
        "--device",
        "jax",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    target = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    tok = AutoTokenizer.from_pretrained(models["target"])
    for rec in records:
        ids = tok(rec["prompt"], return_tensors="pt")["input_ids"]
        ref = target.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert rec["token_ids"] == ref[0, ids.shape[1] :].tolist()
        assert rec["stats"]["adapter_copies"] == 0


def test_generate_regex_constrains_the_output(models):
    """--regex: every row's tokens spell a string the regex matches (then EOS), greedy and sampled."""
    import re

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["target"])
    for temperature in ("0", "0.9"):
        proc = run_cli(
            "generate",
            "--target",
            str(models["target"]),
            "--draft",
            str(models["draft"]),
            "--prompt",
            "w1 w2 w3",
            "--max-new-tokens",
            "8",
            "--temperature",
            temperature,
            "--regex",
            "w1(w2|w3){1,3}",
            "--json",
        )
        assert proc.returncode == 0, proc.stderr
        ids = json.loads(proc.stdout)["token_ids"]
        assert ids[-1] == tok.eos_token_id
        assert re.fullmatch("w1(w2|w3){1,3}", "".join(tok.convert_ids_to_tokens(ids[:-1]))), ids


@pytest.mark.parametrize(
    ("content", "extra", "pattern"),
    [
        (None, [], r"--json-schema .*: cannot read it"),
        ("{not json", [], r"--json-schema .*: not JSON \(Expecting property name"),
        ("[1, 2]", [], r"--json-schema .*: expected a JSON schema \(an object\), got a JSON list"),
        ('{"type": "nonsense"}', [], r"generate: json_schema: xgrammar cannot compile it: .*nonsense"),
        ('{"type": "string"}', ["--regex", "a"], r"argument --regex: not allowed with argument --json-schema"),
    ],
)
def test_bad_json_schema_one_line_exit_2(models, tmp_path, content, extra, pattern):
    import re

    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    proc = run_cli(
        "generate",
        "--target",
        str(models["target"]),
        "--draft",
        str(models["draft"]),
        "--prompt",
        "w1",
        "--json-schema",
        str(path),
        *extra,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # (xgrammar may warn about the word-level tokenizer first)
    assert re.search(pattern, last), proc.stderr
    assert "Traceback" not in proc.stderr
