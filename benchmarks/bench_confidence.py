"""Does pricing each draft token by the drafter's confidence speed up the default pair (B = 1)?

The ``eagle`` drafter reports its head's probability of each greedy choice
(``Proposal.confidence``; ``--drafter model``: the draft model's; ``hybrid``:
the head's on the rows without an n-gram match); the loop's adaptive schedule calibrates it against
the tests' outcomes, verifies per step the tokens it says pay and stops
drafting a row once one more token does not (``specjax.generate.schedule``).
This holds that against the same drafter and schedule with the confidence
withheld (each position then priced by the row's running acceptance) and
against target-only ``generate``, on the open-chat prompts (``--category
grounded``: the input-grounded ones), methods
alternating call by call within each prompt (order reversed every other
round), after one untimed warm-up call per method and prompt. Greedy, every
output is checked against target-only greedy (``same``). ``--temperature T``
samples (the target-only calls too); the drafter's confidence then stops the
drafting token by token and the loop tests every drawn token it proposed (a
sequential count: exact), and a call's length varies with its sample.

Prints the load average before and after, per prompt the speed-up of each
method over target-only (greedy: the median of its timed calls against the
median of the target's; sampled: tokens per second over all timed calls), and
the median and mean over prompts.

    python benchmarks/bench_confidence.py --max-new-tokens 128 --repeats 3
    python benchmarks/bench_confidence.py --max-new-tokens 128 --repeats 3 --temperature 0.7
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import time
from typing import Any

import torch
from pair_calls import eos_and_pad, greedy_target_only
from results_io import _cpu_model


class WithoutConfidence:
    """A drafter as given, its confidence withheld from the loop (and the early stop not offered)."""

    def __init__(self, drafter: Any) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.needs_target_hidden = drafter.needs_target_hidden
        self.target_hidden_layers = getattr(drafter, "target_hidden_layers", (-1,))
        self.cost_per_token_hint = drafter.cost_per_token_hint
        self.asks_every_step = getattr(drafter, "asks_every_step", self.cost_per_token_hint == 0.0)

    def start(self, setup: Any) -> None:
        self.drafter.start(setup)

    def propose(self, request: Any) -> Any:
        proposal = self.drafter.propose(dataclasses.replace(request, worth_drafting=None))
        return dataclasses.replace(proposal, confidence=None)

    def commit(self, info: Any) -> None:
        self.drafter.commit(info)

    def select_rows(self, rows: list[int]) -> None:
        self.drafter.select_rows(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per prompt and method")
    ap.add_argument("--num-draft-tokens", type=int, default=8, help="G, the most tokens a step drafts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--category", choices=["open", "grounded"], default="open", help="the built-in prompt set")
    ap.add_argument(
        "--drafter",
        choices=["eagle", "model", "hybrid"],
        default="eagle",
        help="the pair's drafter: the EAGLE head, the shipped draft model, or n-gram lookups else the head",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled at it")
    args = ap.parse_args(argv)
    if min(args.max_new_tokens, args.repeats, args.num_draft_tokens, args.threads) < 1:
        ap.error("--max-new-tokens, --repeats, --num-draft-tokens and --threads: expected positive integers")
    if not 0 <= args.temperature <= 100:
        ap.error(f"--temperature: expected a number in [0, 100], got {args.temperature}")
    greedy = args.temperature == 0
    torch.set_num_threads(args.threads)

    from specjax.demo import _encode
    from specjax.drafters import ModelDrafter
    from specjax.generate import speculative_generate
    from specjax.pair import load_default_pair, make_pair_drafter
    from specjax.prompts import GROUNDED, OPEN_CHAT

    prompts = OPEN_CHAT if args.category == "open" else GROUNDED

    print(f"load average before: {os.getloadavg()}; {_cpu_model()}; torch threads {args.threads}", flush=True)
    pair = load_default_pair()
    target, tok, head = pair.target, pair.tokenizer, pair.head
    eos, pad = eos_and_pad(pair)

    target_only = greedy_target_only(pair, args.max_new_tokens, args.temperature)

    def drafted(confidence: bool) -> Any:
        def call(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
            # (a drafter object: make_pair_drafter's "model" is the draft model itself)
            drafter = (
                ModelDrafter(pair.draft) if args.drafter == "model" else make_pair_drafter(args.drafter, head=head)
            )
            out = speculative_generate(
                target,
                drafter if confidence else WithoutConfidence(drafter),
                ids,
                mask,
                max_new_tokens=args.max_new_tokens,
                num_draft_tokens=args.num_draft_tokens,
                temperature=args.temperature,
                seed=next(seeds),
                eos_token_id=eos,
                pad_token_id=pad,
            )
            return out.sequences[0, ids.shape[1] :].tolist()

        return call

    seeds = itertools.count(1)  # a fresh sample each call (ignored when greedy)
    d = args.drafter
    methods = {"target-only": target_only, f"{d}, no confidence": drafted(False), f"{d}, confidence": drafted(True)}
    names = list(methods)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in names}
    tokens: dict[str, dict[str, int]] = {m: {} for m in names}
    same = {m: True for m in names}

    def rate(m: str, prompt: str) -> float:
        """Greedy (same lengths): 1 / median time; sampled: tokens per second over the timed calls."""
        if greedy:
            return 1.0 / statistics.median(times[m][prompt])
        return tokens[m][prompt] / sum(times[m][prompt])

    for prompt, messages in prompts.items():
        ids, mask = _encode(tok, messages)
        ref = target_only(ids, mask)
        for m in names:  # warm-up
            methods[m](ids, mask)
        for r in range(args.repeats):
            for m in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                got = methods[m](ids, mask)
                times[m].setdefault(prompt, []).append(time.perf_counter() - t0)
                tokens[m][prompt] = tokens[m].get(prompt, 0) + len(got)
                same[m] = same[m] and got == ref
        ratios = {m: rate(m, prompt) / rate("target-only", prompt) for m in names}
        print(
            f"  {prompt:10s} {len(ref):4d} tokens  " + "  ".join(f"{m}: {ratios[m]:.2f}x" for m in names[1:]),
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")
    mode = "greedy" if greedy else f"T = {args.temperature} (outputs are samples: not compared)"
    print(f"\n{mode}\n{'method':24s} {'speed-up median':>16s} {'mean':>6s} {'min':>6s} same")
    for m in names[1:]:
        r = [rate(m, p) / rate("target-only", p) for p in prompts]
        shown = same[m] if greedy else "-"
        print(f"{m:24s} {statistics.median(r):15.2f}x {statistics.mean(r):5.2f}x {min(r):5.2f}x {shown}")
    return 0 if not greedy or all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
