#!/usr/bin/env python
"""Does a verification forward cost more at a longer context? The default pair's target, B = 1.

The draft schedule (``specjax.generate.schedule``) keeps one table of
verification times per model and batch size, whatever the context length. This
script times the default pair's target (SmolLM2-135M-Instruct) on ``q`` new
tokens over a KV cache of ``L`` positions, for the widths the schedule prices
most (q = 1, 2, 4, 5, 8, 9) at the context lengths of the benchmark's prompts
(40: open chat; 150-300: input-grounded) and beyond (600): per repetition, every
(L, q) in turn, each the median of ``--calls`` forwards on the live cache,
cropped back after each; the table shows each cell's median over the
repetitions and the spread (min-max) of those, with the load average before
and after. About a minute::

    python benchmarks/bench_verify_context.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="40,150,300,600", help="context lengths L, comma-separated")
    ap.add_argument("--widths", default="1,2,4,5,8,9", help="new tokens q per forward, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="passes over every (L, q)")
    ap.add_argument("--calls", type=int, default=5, help="forwards per cell and pass (their median counts)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        widths = [int(x) for x in args.widths.split(",")]
    except ValueError:
        ap.error("--lengths and --widths: expected comma-separated positive integers")
    if min(lengths + widths + [args.reps, args.calls, args.threads]) < 1:
        ap.error("--lengths, --widths, --reps, --calls and --threads: expected positive integers")
    torch.set_num_threads(args.threads)
    from specjax.pair import load_target
    from specjax.slots import cache_argument

    model, _ = load_target()
    model.eval()
    cache_arg = cache_argument(model)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    print(f"load average before: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    times: dict[tuple[int, int], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.reps + 1):  # the first pass warms every shape up and is not counted
            for length in lengths:
                ids = torch.randint(100, vocab, (1, length), generator=gen)
                out = model(ids, use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                for q in widths:
                    calls = []
                    for _ in range(args.calls):
                        extra = cache.get_seq_length() - length
                        if extra > 0:
                            cache.crop(-extra)
                        new = torch.randint(100, vocab, (1, q), generator=gen)
                        t = time.perf_counter()
                        model(new, use_cache=True, **{cache_arg: cache})
                        calls.append(time.perf_counter() - t)
                    if rep:
                        times.setdefault((length, q), []).append(statistics.median(calls) * 1e3)
    print(f"load average after: {os.getloadavg()}")
    print("| L \\ q | " + " | ".join(f"{q}" for q in widths) + " |")
    print("|---:|" + "---:|" * len(widths))
    for length in lengths:
        cells = []
        for q in widths:
            v = times[(length, q)]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.0f}-{max(v):.0f})")
        print(f"| {length} | " + " | ".join(cells) + " |")
    print("(ms per forward: median over passes, (min-max) of the passes' medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
