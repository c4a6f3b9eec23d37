"""How well does the ``eagle`` drafter's confidence predict its tests, and what would pricing by it gain?

Runs the default pair with the ``eagle`` drafter at a fixed draft length
(``adaptive=False``, greedy) on the built-in prompts, records per step the
head's confidence in each proposed token (``Proposal.confidence``) and how many
passed, then prints per category:

* the pass rate of the tested tokens per bin of confidence (calibration);
* a replay against the target's forward costs measured in the same run
  (median of 7 forwards per width after a warm-up, a 100-token cache; each
  width priced at the cheapest measured width at least as wide, as the
  schedule pads): the speed-up over plain decoding of every fixed draft
  length, and of choosing each step's length from the confidence (the
  expected tokens per second of the recorded tokens, the drafter's measured
  time per token included).

The replay prices what a schedule would choose from the step's own record,
so it is an estimate, not a timing of the loop
(``benchmarks/bench_confidence.py`` times that).

    python scripts/confidence_calibration.py --num-draft-tokens 6 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

import numpy as np
import torch


def forward_costs(target: Any, widths: int) -> dict[int, float]:
    """Seconds per target forward over ``q`` new tokens (q = 1 .. widths), a 100-token cache."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 40000, (1, 100), generator=gen)
    times: dict[int, list[float]] = {q: [] for q in range(1, widths + 1)}
    with torch.inference_mode():
        for _ in range(8):
            for q in times:
                cache = DynamicCache()
                target(ctx, past_key_values=cache, use_cache=True)
                x = torch.randint(0, 40000, (1, q), generator=gen)
                t0 = time.perf_counter()
                target(x, past_key_values=cache, use_cache=True)
                times[q].append(time.perf_counter() - t0)
    raw = {q: statistics.median(t[1:]) for q, t in times.items()}
    return {q: min(raw[w] for w in raw if w >= q) for q in raw}  # padded to a cheaper wider width


def replay(steps: list[tuple[np.ndarray, int]], cost: dict[int, float], draft_s: float, g: int) -> dict[str, float]:
    """Speed-ups over plain decoding of fixed lengths and of the confidence's choice, from recorded steps."""
    out = {}
    for k in range(1, g + 1):
        tokens = sum(min(n, k) + 1 for _, n in steps)
        seconds = sum(cost[k + 1] + draft_s * k for _ in steps)
        out[f"fixed {k}"] = tokens / seconds * cost[1]
    tokens = seconds = 0.0
    for conf, n in steps:
        best_rate, best_k, reach, gain = 1.0 / cost[1], 0, 1.0, 1.0
        for i, c in enumerate(conf[:g]):
            reach *= c
            gain += reach
            rate = gain / (cost[i + 2] + draft_s * (i + 1))
            if rate > best_rate:
                best_rate, best_k = rate, i + 1
        tokens += min(n, best_k) + 1
        seconds += cost[best_k + 1] + draft_s * max(best_k, 1)  # the first token is drafted to see its confidence
    out["by confidence"] = tokens / seconds * cost[1]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if min(args.num_draft_tokens, args.max_new_tokens, args.threads) < 1:
        ap.error("--num-draft-tokens, --max-new-tokens and --threads: expected positive integers")
    torch.set_num_threads(args.threads)

    from specjax.demo import _encode
    from specjax.drafters import EagleDrafter
    from specjax.generate import speculative_generate
    from specjax.pair import load_default_pair
    from specjax.prompts import all_prompts

    print(f"load average before: {os.getloadavg()}", flush=True)
    pair = load_default_pair()
    g = args.num_draft_tokens

    class Recording(EagleDrafter):
        def start(self, setup: Any) -> None:
            super().start(setup)
            self.steps: list[tuple[np.ndarray, int]] = []
            self.draft_s: list[float] = []
            self._last: Any = None

        def propose(self, request: Any) -> Any:
            t0 = time.perf_counter()
            p = super().propose(request)
            if int(p.num_tokens[0]) > 0:
                self.draft_s.append((time.perf_counter() - t0) / int(p.num_tokens[0]))
            self._last = p
            return p

        def commit(self, info: Any) -> None:
            if self._last is not None and self._last.confidence is not None and int(info.num_proposed[0]) > 0:
                self.steps.append((self._last.confidence[0, : int(info.num_proposed[0])], int(info.num_accepted[0])))
            self._last = None
            super().commit(info)

    records: dict[str, list[tuple[np.ndarray, int]]] = {}
    draft_times: list[float] = []
    for category, prompts in all_prompts().items():
        for messages in prompts.values():
            ids, mask = _encode(pair.tokenizer, messages)
            drafter = Recording(pair.head)
            speculative_generate(
                pair.target, drafter, ids, mask, max_new_tokens=args.max_new_tokens, num_draft_tokens=g, adaptive=False
            )
            records.setdefault(category, []).extend(drafter.steps)
            draft_times.extend(drafter.draft_s[1:])
    cost = forward_costs(pair.target, g + 1)
    draft_s = statistics.median(draft_times)
    print(f"load average after: {os.getloadavg()}")
    print("forward ms by width (padded): " + ", ".join(f"{q}: {1000 * t:.1f}" for q, t in cost.items()))
    print(f"drafting: {1000 * draft_s:.2f} ms per token")
    edges = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.97, 1.0001]
    for category, steps in records.items():
        conf = np.concatenate([c[: min(n + 1, len(c))] for c, n in steps])
        passed = np.concatenate([np.arange(min(n + 1, len(c))) < n for c, n in steps])
        print(f"\n{category}: {len(steps)} steps, {len(conf)} tests, pass rate {passed.mean():.2f}")
        for lo, hi in itertools.pairwise(edges):
            m = (conf >= lo) & (conf < hi)
            if m.any():
                print(
                    f"  confidence [{lo:.2f}, {min(hi, 1):.2f}): {m.sum():4d} tests, pass rate {passed[m].mean():.2f}"
                )
        print("  replay: " + ", ".join(f"{k} {v:.2f}x" for k, v in replay(steps, cost, draft_s, g).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
