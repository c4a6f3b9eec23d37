"""Speed-up and mean accepted length against the number of draft tokens per step.

Runs the embedded default pair (or --target/--draft directories) at B=1 on a few
chat prompts, greedy and at temperature 0.7, for each G in the sweep, and
target-only ``generate`` with the same prompts and settings in the same run.
Rows (one JSON object per line with ``--jsonl``) follow Spec-Bench's spirit:
model pair, method, num_draft_tokens, temperature, batch size, tokens/s, mean
accepted length, acceptance rate, speed-up.

    python benchmarks/bench_draft_sweep.py [--quick] [--jsonl bench-results/sweep.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax_threads
from results_io import append_jsonl

PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain in simple terms what a computer program is.",
    "Give three tips for staying healthy.",
)


def _encode(tok: Any, prompt: str) -> tuple[Any, Any]:
    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        enc = tok(prompt, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, str]:
    if args.target:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(args.target).eval()
        draft = AutoModelForCausalLM.from_pretrained(args.draft).eval()
        return target, draft, AutoTokenizer.from_pretrained(args.target), f"{args.target}+{args.draft}"
    from specjax.pair import load_default_pair

    pair = load_default_pair()
    return pair.target, pair.draft, pair.tokenizer, "SmolLM2-135M-Instruct+specjax-draft"


def bench_draft_sweep(
    *,
    quick: bool,
    target: Any,
    draft: Any,
    tokenizer: Any,
    pair_name: str,
    drafts: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
) -> list[dict]:
    """One row per (method, G, temperature); target-only rows have G = 0."""
    import torch

    from specjax.generate import speculative_generate

    drafts = tuple(drafts or ((1, 2, 4) if quick else (1, 2, 3, 4, 5, 6, 8)))
    max_new = max_new_tokens or (24 if quick else 64)
    prompts = PROMPTS[:1] if quick else PROMPTS[:3]
    temps = (0.0,) if quick else (0.0, 0.7)
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = [_encode(tokenizer, p) for p in prompts]
    # warm-up (JAX compilation for these shapes)
    speculative_generate(
        target, draft, *encoded[0], max_new_tokens=8, num_draft_tokens=drafts[0], eos_token_id=eos, pad_token_id=pad
    )
    rows: list[dict] = []
    for temp in temps:
        base_tokens, base_time = 0, 0.0
        for i, (ids, mask) in enumerate(encoded):
            kwargs = (
                {"do_sample": False}
                if temp == 0
                else {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0}
            )
            torch.manual_seed(i)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=pad, **kwargs
                )
            base_time += time.perf_counter() - t0
            base_tokens += out.shape[1] - ids.shape[1]
        base_tps = base_tokens / base_time
        rows.append(_row(pair_name, "target_only", 0, temp, base_tps, None, None, 1.0))
        print(f"T={temp} target-only: {base_tps:.1f} tokens/s", file=sys.stderr, flush=True)
        for g in drafts:
            speculative_generate(
                target,
                draft,
                *encoded[0],
                max_new_tokens=2 * g + 2,
                num_draft_tokens=g,
                temperature=temp,
                eos_token_id=eos,
                pad_token_id=pad,
            )  # compile for this G
            tokens, elapsed, accepted, proposed, gained, steps = 0, 0.0, 0, 0, [], 0
            for i, (ids, mask) in enumerate(encoded):
                res = speculative_generate(
                    target,
                    draft,
                    ids,
                    mask,
                    max_new_tokens=max_new,
                    num_draft_tokens=g,
                    temperature=temp,
                    seed=i,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                s = res.stats
                tokens += s.new_tokens
                elapsed += s.wall_time_s
                accepted += s.draft_tokens_accepted
                proposed += s.draft_tokens_proposed
                gained.append(s.mean_accepted_length)
                steps += s.steps
            tps = tokens / elapsed
            row = _row(
                pair_name,
                "specjax",
                g,
                temp,
                tps,
                statistics.fmean(gained),
                accepted / proposed if proposed else 0.0,
                tps / base_tps,
            )
            rows.append(row)
            print(
                f"T={temp} G={g}: {tps:.1f} tokens/s, acceptance {row['acceptance_rate']:.2f}, "
                f"mean accepted length {row['mean_accepted_length']:.2f}, speed-up {row['speedup']:.2f}x",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _row(
    pair: str, method: str, g: int, temp: float, tps: float, mal: float | None, acc: float | None, speedup: float
) -> dict:
    return {
        "section": "draft_sweep",
        "model_pair": pair,
        "method": method,
        "num_draft_tokens": g,
        "temperature": temp,
        "batch_size": 1,
        "tokens_per_s": tps,
        "mean_accepted_length": mal,
        "acceptance_rate": acc,
        "speedup": speedup,
    }


def print_table(rows: list[dict]) -> None:
    print(f"{'method':<12} {'T':>4} {'G':>2} {'tokens/s':>9} {'accept':>7} {'mean len':>8} {'speed-up':>8}")
    for r in rows:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        print(
            f"{r['method']:<12} {r['temperature']:>4} {r['num_draft_tokens']:>2} {r['tokens_per_s']:>9.1f} "
            f"{acc:>7} {mal:>8} {r['speedup']:>7.2f}x"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--jsonl", metavar="PATH")
    parser.add_argument("--target", help="target model directory (default: the embedded pair)")
    parser.add_argument("--draft", help="draft model directory")
    parser.add_argument("--drafts", type=int, nargs="*", help="values of G to sweep")
    parser.add_argument("--max-new-tokens", type=int)
    jax_threads.add_argument(parser)
    args = parser.parse_args(argv)
    print(f"# {jax_threads.apply(args)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    target, draft, tok, name = _load(args)
    rows = bench_draft_sweep(
        quick=args.quick,
        target=target,
        draft=draft,
        tokenizer=tok,
        pair_name=name,
        drafts=args.drafts,
        max_new_tokens=args.max_new_tokens,
    )
    print_table(rows)
    if args.jsonl:
        append_jsonl(args.jsonl, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
