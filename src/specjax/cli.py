"""The ``specjax`` command line: ``demo``, ``generate`` and ``bench``.

Errors a user can fix (a missing model, a bad flag value, an unreadable prompts
file, models that do not share a tokenizer) print one line on stderr and exit
with status 2; ``--debug`` shows the traceback instead. Output that cannot be
written (a full disk: ``> /dev/full``) is one line and status 74 (EX_IOERR); a
reader that stops reading (``specjax generate --json ... | head -1``) ends the
command quietly with status 1, as Python's documentation advises for SIGPIPE.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from specjax.console import CLIError, TextStream
from specjax.runtime import enable_compilation_cache

EXIT_USAGE = 2
EXIT_IO = 74  # EX_IOERR (sysexits.h): the output could not be written
EXIT_BROKEN_PIPE = 1  # the reader went away (Python's documented handling of SIGPIPE)


class OutputError(Exception):
    """Writing to standard output failed (``__cause__``: the ``OSError``)."""


class _GuardedStdout:
    """Standard output whose write and flush errors become :class:`OutputError`, told apart from the
    ``OSError`` of anything else (a model file that cannot be read stays what it is)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            raise OutputError(str(err)) from err

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            raise OutputError(str(err)) from err

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        one_line = message.replace("\r", "\\r").replace("\n", "\\n")  # argv may hold line breaks
        raise CLIError(f"{self.prog}: {one_line} (see --help)")


# --------------------------------------------------------------------------- #
# Argument types
# --------------------------------------------------------------------------- #


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _draft_tokens(text: str) -> int:
    from specjax.generate.checks import MAX_DRAFT_TOKENS

    value = _positive_int(text)
    if value > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_DRAFT_TOKENS}], got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _seed(text: str) -> int:
    from specjax.generate import check_seed

    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [-2**63, 2**63 - 1], got {text!r}") from None


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 = greedy), got {text}")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


# --------------------------------------------------------------------------- #
# Model loading
# --------------------------------------------------------------------------- #


def _torch_device(name: str) -> Any:
    import torch

    if name == "jax":  # models on torchax's jax device: the JAX path (docs/torchax.md)
        try:
            import torchax  # noqa: F401  (registers torch's "jax" device)
        except ImportError as err:
            raise CLIError(
                f"--device jax: torchax is not installed ({_first_line(err)}); pip install 'specjax[tpu]', see "
                "docs/torchax.md"
            ) from err
        return torch.device("jax")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(
                "--device cuda: torch has no CUDA device here (install a CUDA build of torch, see docs/gpu.md)"
            )
        from specjax.adapters import configure_jax_memory

        configure_jax_memory()
    return torch.device(name)


def load_model(path: str, *, gguf_file: str | None, device: Any, role: str) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a local directory (or a cached hub id)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per error; our own bars show progress
    hf_logging.set_verbosity_error()
    local = Path(path)
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
    if not local.exists() and (offline or "/" not in path or path.startswith((".", "/"))):
        raise CLIError(
            f"--{role} {path}: no such model directory (pass a local directory with config.json, "
            "or omit --target/--draft to use the embedded default pair)"
        )
    if local.exists():
        check_model_dir(local, role=role, gguf_file=gguf_file)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as err:  # whatever a broken model makes transformers raise: one line, not a traceback
        raise CLIError(f"--{role} {path}: could not load a causal LM ({_first_line(err)})") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as err:
        raise CLIError(
            f"--{role} {path}: the model has no usable tokenizer ({_first_line(err)}); save one beside it"
        ) from err
    return place(model, device).eval(), tokenizer


def place(model: Any, device: Any) -> Any:
    """``model`` on ``device``; torchax's ``jax`` device under torchax's environment (which moves it there)."""
    if getattr(device, "type", device) == "jax":
        from specjax.generate.jax_model import to_jax_device

        return to_jax_device(model)
    return model.to(device)


def check_model_dir(local: Path, *, role: str, gguf_file: str | None) -> None:
    """Raise CLIError naming the file unless ``local`` looks like a loadable model directory.

    Checked before transformers reads anything, whose errors for these cases are
    tracebacks or misleading (a file given as the directory is read as a pickle,
    and the error suggests turning off torch's safe loading). Reads only headers:
    ``config.json`` must parse, and every ``*.safetensors`` file must have a
    valid safetensors header that its size covers.
    """
    flag = f"--{role} {local}"
    if not local.is_dir():
        hint = " (for a GGUF file, pass its directory and --gguf-file NAME)" if local.suffix == ".gguf" else ""
        raise CLIError(f"{flag}: is a file, expected a model directory with config.json and the weights{hint}")
    if gguf_file:
        if not (local / gguf_file).is_file():
            raise CLIError(f"{flag}: no file {gguf_file} in the directory (--gguf-file)")
        return
    config = local / "config.json"
    if not config.is_file():
        raise CLIError(f"{flag}: no config.json in the directory (expected a transformers model directory)")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CLIError(f"{flag}: {config.name} is not readable JSON ({_first_line(err)})") from err
    from safetensors import safe_open

    for weights in sorted(local.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt") as fh:
                fh.keys()
        except Exception as err:  # safetensors raises its own SafetensorError
            raise CLIError(
                f"{flag}: {weights.name} is not a valid safetensors file ({_first_line(err)}); "
                "save or download the model again"
            ) from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_pair(
    args: argparse.Namespace, device: Any, progress: bool, need_draft: bool = True
) -> tuple[Any, Any, Any, Any]:
    """(target, draft, target_tokenizer, draft_tokenizer) from the flags or the embedded pair.

    With ``need_draft=False`` (a drafter without a model, e.g. ``ngram``) ``--target``
    may come alone; draft and its tokenizer are then None.
    """
    if args.target is None and args.draft is None:
        from specjax.demo import pair_overrides
        from specjax.pair import DefaultPairError, load_default_pair

        on_jax = device.type == "jax"  # loaded on the CPU, then moved
        try:
            pair = load_default_pair(device="cpu" if on_jax else str(device), progress=progress, **pair_overrides())
        except DefaultPairError as err:
            raise CLIError(str(err)) from err
        if on_jax:
            pair.target, pair.draft = place(pair.target, device), place(pair.draft, device)
        if getattr(args, "eagle_head", None) is None:
            args.eagle_head = pair.head  # the pair's own head drafts for `eagle` and `hybrid`
        return pair.target, pair.draft, pair.tokenizer, pair.tokenizer
    if args.target is not None and args.draft is None and not need_draft:
        target, t_tok = load_model(args.target, gguf_file=args.gguf_file, device=device, role="target")
        return target, None, t_tok, None
    if args.target is None or args.draft is None:
        raise CLIError("--target and --draft go together (omit both to use the embedded default pair)")
    target, t_tok = load_model(args.target, gguf_file=args.gguf_file, device=device, role="target")
    draft, d_tok = load_model(args.draft, gguf_file=None, device=device, role="draft")
    from specjax.generate import check_pair

    try:
        check_pair(target, draft, t_tok, d_tok)
    except ValueError as err:
        raise CLIError(f"--draft {args.draft}: incompatible with the target: {err}") from err
    return target, draft, t_tok, d_tok


# --------------------------------------------------------------------------- #
# Prompts
# --------------------------------------------------------------------------- #


def read_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file: one object per line with a "prompt" string (or a bare string)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise CLIError(f"--prompts-file {path}: cannot read it ({_first_line(err)})") from err
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise CLIError(f"--prompts-file {path}: line {number} is not JSON ({err.msg})") from err
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str):
            raise CLIError(f'--prompts-file {path}: line {number}: expected {{"prompt": "..."}} or a JSON string')
        check_text(f"--prompts-file {path}: line {number}", text)
        prompts.append(text)
    if not prompts:
        raise CLIError(f"--prompts-file {path}: no prompts in the file")
    return prompts


def read_json_schema(path: str) -> Any:
    """The JSON schema in file ``path`` (``--json-schema``), read before the models load."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CLIError(f"--json-schema {path}: cannot read it ({_first_line(err)})") from err
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise CLIError(f"--json-schema {path}: not JSON ({err.msg} at line {err.lineno})") from err
    if not isinstance(schema, dict):
        raise CLIError(f"--json-schema {path}: expected a JSON schema (an object), got a JSON {type(schema).__name__}")
    return schema


def check_text(where: str, text: str) -> None:
    """Raise CLIError unless ``text`` is Unicode text UTF-8 can encode.

    Command-line bytes that are not UTF-8 reach Python as lone surrogates
    (``surrogateescape``), as do ``\\ud800``-style escapes in JSON; tokenizers
    refuse both with a ``TypeError`` about their input type.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = text[err.start]
        what = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"U+{ord(bad):04X}"
        raise CLIError(
            f"{where}: not valid UTF-8 text ({what} at character {err.start}); pass the prompt as UTF-8"
        ) from None


def encode(tokenizer: Any, prompts: Sequence[str], *, chat: bool, device: Any) -> tuple[Any, Any]:
    """Left-padded input_ids and attention_mask (i64[B, P])."""
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise CLIError("--chat: the tokenizer has no chat template")
        try:
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        except Exception as err:  # a template is code (Jinja): whatever it raises is one line
            raise CLIError(
                f"--chat: the tokenizer's chat template failed on a user message ({_first_line(err)}); "
                "fix the template or leave out --chat"
            ) from err
    else:
        texts = list(prompts)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        # Padding slots are masked: any token the vocabulary has will do.
        tokenizer.pad_token = next(
            t for t in (tokenizer.eos_token, tokenizer.unk_token, tokenizer.convert_ids_to_tokens(0)) if t is not None
        )
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)
    if getattr(device, "type", device) == "jax":  # the JAX path takes host ids
        return enc["input_ids"], enc["attention_mask"]
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def cmd_generate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from specjax.generate import speculative_generate

    if (args.prompt is None) == (args.prompts_file is None):
        raise CLIError("generate: give exactly one of --prompt TEXT or --prompts-file FILE.jsonl")
    if args.prompt is not None:
        check_text("--prompt", args.prompt)
    if args.logprobs and not args.json:
        raise CLIError("generate: --logprobs needs --json (the log-probabilities are a field of each JSON object)")
    for stop in args.stop or []:
        check_text("--stop", stop)
        if not stop:
            raise CLIError("generate: --stop: expected a non-empty string")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts_file)
    schema = read_json_schema(args.json_schema) if args.json_schema is not None else None
    _check_sampler(args.sampler)  # before the slow model load
    drafter_name = _check_drafter(args)
    device = _torch_device(args.device)
    t_load = time.perf_counter()
    target, draft, tok, d_tok = load_pair(
        args, device, progress=not args.json, need_draft=drafter_name in ("model", "hybrid", "hybrid-model")
    )
    load_s = _elapsed(t_load)
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    single = len(prompts) == 1 and not args.json
    bar = None if single else tqdm(total=len(prompts), desc="generating", unit="prompt", file=sys.stderr)
    try:  # the bar ends its line before any error message
        for start in range(0, len(prompts), args.batch_size):
            chunk = prompts[start : start + args.batch_size]
            ids, mask = encode(tok, chunk, chat=args.chat, device=device)
            stream = TextStream(tok) if single else None
            try:
                drafter = _make_drafter(drafter_name, draft, args.eagle_head)
                out = speculative_generate(
                    target,
                    drafter,
                    ids,
                    mask,
                    max_new_tokens=args.max_new_tokens,
                    num_draft_tokens=args.num_draft_tokens,
                    temperature=args.temperature,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    seed=args.seed,
                    eos_token_id=eos,
                    pad_token_id=tok.pad_token_id,
                    sampler=args.sampler,
                    target_tokenizer=tok,
                    draft_tokenizer=d_tok,
                    on_tokens=stream,
                    stop_strings=args.stop,
                    output_logprobs=args.logprobs,
                    json_schema=schema,
                    regex=args.regex,
                )
            except (ValueError, TypeError, ImportError) as err:
                raise CLIError(f"generate: {_first_line(err)}") from err
            stats = out.stats.as_dict()
            for row, prompt in enumerate(chunk):
                new = out.sequences[row, ids.shape[1] : ids.shape[1] + int(out.num_new_tokens[row])].tolist()
                text = tok.decode(new, skip_special_tokens=True)
                if args.json:
                    record = {"prompt": prompt, "text": text, "token_ids": new}
                    if out.logprobs is not None:
                        record["logprobs"] = out.logprobs[row, : len(new)].tolist()
                    print(json.dumps({**record, "stats": stats, "load_time_s": load_s}), flush=True)
                elif single:
                    print()
                    _print_stats(stats, file=sys.stderr, load_s=load_s)
                else:
                    print(f"### {prompt}\n{text}\n", flush=True)
            if bar is not None:
                bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return 0


def _check_drafter(args: argparse.Namespace) -> str:
    """The drafter's name from ``--drafter`` (a model path there means ``--draft PATH``), checked before loading."""
    from specjax.drafters import available_drafters

    name = args.drafter
    args.eagle_head = None
    if name == "eagle":
        if args.target is None and args.draft is None:
            return name  # the embedded pair's head
        raise CLIError(
            "--drafter eagle: with --target, give the head's directory instead, --drafter DIR "
            "(config.json and model.safetensors, e.g. written by `python -m recipes.eagle torch`)"
        )
    if name not in ("model", "hybrid", "hybrid-model") and _is_eagle_head(Path(name)):
        from specjax.drafters.eagle_head import load_head

        try:  # before the slow model load: a damaged head is one line, exit 2
            args.eagle_head = load_head(name)
        except ValueError as err:
            raise CLIError(f"--drafter {name}: {_first_line(err)}") from err
        return "eagle"
    if name not in ("model", "hybrid", "hybrid-model") and Path(name).exists():
        if args.draft is not None and args.draft != name:
            raise CLIError(f"--drafter {name}: a model path, but --draft {args.draft} names another model")
        args.draft = name
        return "model"
    try:
        names = available_drafters()
    except Exception as err:  # a broken plugin installation: say so in one line
        raise CLIError(f"--drafter: cannot list the installed drafters: {_first_line(err)}") from err
    if name not in names and name != "hybrid-model":
        raise CLIError(
            f"--drafter: unknown drafter {name!r} (and no such model path); available drafters: {', '.join(names)}"
        )
    return name


def _is_eagle_head(path: Path) -> bool:
    """Whether ``path`` is a directory whose config.json declares an EAGLE head (even a damaged one)."""
    from specjax.drafters.eagle_head import MODEL_TYPE

    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return MODEL_TYPE in config.read_text(errors="replace")
    except OSError:
        return False


def _make_drafter(name: str, draft: Any, eagle_head: Any = None) -> Any:
    from specjax.drafters import load_drafter
    from specjax.pair import PAIR_DRAFTERS, make_pair_drafter

    if name in PAIR_DRAFTERS:
        return make_pair_drafter(name, draft=draft, head=eagle_head)
    return load_drafter(name)


def _print_stats(stats: dict[str, Any], file: Any, load_s: float) -> None:
    """One line of statistics; tokens/s excludes the one-time work, reported after it."""
    print(
        f"[{stats['new_tokens']} tokens, {stats['tokens_per_s']:.1f} tokens/s, acceptance "
        f"{stats['acceptance_rate']:.2f}, mean accepted length {stats['mean_accepted_length']:.2f}, "
        f"{stats['steps']} steps; one-time work not counted: model load {load_s:.1f} s, "
        f"JIT compilation {stats['compile_time_s']:.1f} s]",
        file=file,
    )


def _check_sampler(name: str) -> None:
    """Load a sampler plugin by name now: a missing or broken plugin is one line, exit 2."""
    if name == "jax":
        return
    from specjax.registry import load_sampler

    try:
        load_sampler(name)
    except (ImportError, ValueError, TypeError) as err:
        raise CLIError(f"--sampler {name}: {_first_line(err)}") from err


def cmd_demo(args: argparse.Namespace) -> int:
    from specjax.demo import run_demo

    _torch_device(args.device)  # torchax present for --device jax (a one-line error otherwise)
    return run_demo(
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        seed=args.seed,
        quick=args.quick,
        device=args.device,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from specjax.bench import run_bench

    return run_bench(
        out_dir=Path(args.out), quick=args.quick, sections=args.sections, jax_cpu_threads=args.jax_cpu_threads
    )


# --------------------------------------------------------------------------- #
# Parser
# --------------------------------------------------------------------------- #


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specjax", description="Exact speculative decoding for Hugging Face models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument(
        "--jax-cpu-threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="start JAX with an XLA:CPU intra-op pool of N threads (specjax.set_jax_cpu_threads; "
        "default: XLA's, one per CPU)",
    )
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, required=True)

    demo = sub.add_parser("demo", help="run the embedded default pair on built-in prompts")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=64)
    demo.add_argument(
        "--num-draft-tokens",
        type=_draft_tokens,
        default=None,
        help="draft tokens per step (default: the pair's tuned value)",
    )
    demo.add_argument("--seed", type=_seed, default=0)
    demo.add_argument("--quick", action="store_true", help="one prompt, fewer tokens")
    demo.add_argument(
        "--device",
        choices=["cpu", "jax"],
        default="cpu",
        help="where the models run; jax: JAX's default device (a TPU) through torchax, against the target alone "
        "on the same device (docs/torchax.md)",
    )
    demo.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    gen = sub.add_parser("generate", help="generate text with a target/draft pair")
    gen.add_argument("--target", metavar="ID_OR_PATH", help="target model (default: the embedded pair)")
    gen.add_argument("--draft", metavar="ID_OR_PATH", help="draft model (default: the embedded pair)")
    gen.add_argument("--gguf-file", metavar="NAME", help="GGUF file inside the target directory")
    gen.add_argument("--prompt", metavar="TEXT")
    gen.add_argument("--prompts-file", metavar="FILE.jsonl")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64)
    gen.add_argument("--num-draft-tokens", type=_draft_tokens, default=4)
    gen.add_argument("--temperature", type=_temperature, default=0.0)
    gen.add_argument("--top-k", type=_non_negative_int, default=None)
    gen.add_argument("--top-p", type=_top_p, default=None)
    gen.add_argument("--seed", type=_seed, default=0)
    gen.add_argument("--batch-size", type=_positive_int, default=8)
    gen.add_argument(
        "--device",
        choices=["cpu", "cuda", "jax"],
        default="cpu",
        help="where the models run; jax: JAX's default device (a TPU) through torchax, docs/torchax.md",
    )
    gen.add_argument("--sampler", default="jax", help="sampler name (see specjax.load_sampler)")
    gen.add_argument(
        "--drafter",
        default="model",
        metavar="NAME_OR_PATH",
        help="what drafts: model (the --draft model, the default), ngram (prompt lookup, no draft "
        "model needed), eagle (the embedded pair's EAGLE head), hybrid (ngram where it matches, "
        "else the EAGLE head, or the draft model where there is no head), hybrid-model (ngram, "
        "else the draft model), a draft model path, an EAGLE head's directory, or an installed "
        "drafter's name",
    )
    constrain = gen.add_mutually_exclusive_group()
    constrain.add_argument(
        "--json-schema",
        metavar="FILE",
        help="constrain the output to JSON that the schema in FILE accepts (needs xgrammar: "
        "pip install 'specjax[grammar]')",
    )
    constrain.add_argument(
        "--regex", metavar="PATTERN", help="constrain the output to a string PATTERN matches (needs xgrammar)"
    )
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    gen.add_argument(
        "--logprobs",
        action="store_true",
        help='with --json: add "logprobs", each generated token\'s log-probability under the distribution '
        "it was drawn from (temperature/top-k/top-p applied; greedy: the target's softmax)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end a row once it generates TEXT (kept in the output); repeat for several strings",
    )
    gen.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    bench = sub.add_parser("bench", help="kernel and end-to-end benchmarks, JSONL and PNG plots")
    bench.add_argument("--quick", action="store_true", help="a short run (under 2 minutes)")
    bench.add_argument("--out", default="bench-results", help="output directory (default: bench-results)")
    bench.add_argument(
        "--sections", nargs="+", default=None, help="subset of: kernel logits draft-sweep generate sharded overheads"
    )
    bench.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not debug:
        _one_line_plugin_warnings()
    stdout = sys.stdout
    sys.stdout = _GuardedStdout(stdout)
    try:
        args = build_parser().parse_args(argv)
        handler = {"demo": cmd_demo, "generate": cmd_generate, "bench": cmd_bench}[args.command]
        if args.command != "bench":  # bench's scripts are processes of their own (it passes them the flag)
            # compiled steps kept for the next run (specjax's cache, unless the user set JAX's own)
            enable_compilation_cache()
            if args.jax_cpu_threads is not None:
                _start_jax(args.jax_cpu_threads)
        status = handler(args)
        sys.stdout.flush()  # a full disk shows here, not at the interpreter's exit
        return status
    except CLIError as err:
        if debug:
            raise
        _print_error(str(err))
        return EXIT_USAGE
    except OutputError as err:
        _discard_stdout(stdout)  # what is still buffered would fail again at exit
        if isinstance(err.__cause__, BrokenPipeError) or getattr(err.__cause__, "errno", None) == errno.EPIPE:
            return EXIT_BROKEN_PIPE  # the reader stopped reading: nothing to report
        if debug:
            raise
        _print_error(f"cannot write the output to stdout ({err})")
        return EXIT_IO
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


def _print_error(text: str) -> None:
    one_line = text.replace("\r", "\\r").replace("\n", "\\n")  # one line, whatever a path or value holds
    print(f"error: {one_line}", file=sys.stderr)


def _discard_stdout(stream: Any) -> None:
    """Point the process's standard output at /dev/null, so that flushing it at exit cannot fail again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture): nothing flushes at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class _NoTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def _one_line_plugin_warnings() -> None:
    """Plugins that fail to load are reported as one line each on stderr (``--debug``: with tracebacks)."""
    log = logging.getLogger("specjax.plugin")
    if any(isinstance(f, _NoTraceback) for h in log.handlers for f in h.filters):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_NoTraceback())
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    log.addHandler(handler)
    log.propagate = False


def _start_jax(threads: int) -> None:
    from specjax.runtime import set_jax_cpu_threads

    try:
        set_jax_cpu_threads(threads)
    except (ValueError, RuntimeError) as err:
        raise CLIError(f"--jax-cpu-threads: {err}") from None


def _elapsed(t0: float) -> float:
    return time.perf_counter() - t0


if __name__ == "__main__":
    sys.exit(main())
