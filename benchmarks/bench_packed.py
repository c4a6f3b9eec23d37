"""The target's LM head and forward, dense against oneDNN's product (:mod:`specjax.packed`).

Two tables on the default pair's target (SmolLM2-135M-Instruct):

1. the LM head's product alone (f32[M, 576] × the 49,152 × 576 weight) for M
   rows: torch's ``linear`` (what the model runs) against
   :class:`specjax.packed.PackedLinear`;
2. one of the loop's forwards (:class:`specjax.slots.SlotCache`) of q new
   tokens after a 150-token prompt, at B = 1 and 8, with
   ``SPECJAX_PACKED_LINEARS`` 0 (nothing packed), head and all;
3. one step of the shipped EAGLE head (one row, a slot), its layers dense
   and packed (the drafter keeps them dense).

The number of layers each setting runs through oneDNN is printed first.

The settings alternate call by call; each cell is the median of
``--reps`` calls (min-max in brackets). The load average is printed before
and after: figures taken under load are not to be reported.

    python benchmarks/bench_packed.py [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def cell(times: list[float]) -> str:
    return f"{statistics.median(times):.1f} ({min(times):.0f}-{max(times):.0f})"


def cell2(times: list[float]) -> str:
    return f"{statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="calls per cell (default 15)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps: expected an integer >= 1, got {args.reps}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import numpy as np
    import torch

    from specjax import packed
    from specjax.drafters.eagle_head import load_head
    from specjax.pair import default_head_path, load_target
    from specjax.slots import SlotCache

    torch.set_num_threads(2)
    print(f"load average before: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    target, _ = load_target()
    head = target.get_output_embeddings()
    copy = packed.PackedLinear(head)
    for value in ("head", "all"):
        os.environ[packed.ENV] = value
        layers = packed.packed_layers(target)[1]
        print(f"{packed.ENV}={value}: {len(layers)} layers through oneDNN")
    g = torch.Generator().manual_seed(0)

    print("\nLM head alone (ms per product)\n\n| M | dense `linear` | packed |\n|---:|---:|---:|")
    with torch.inference_mode():
        for m in (1, 2, 4, 5, 8, 16):
            x = torch.randn(m, head.in_features, generator=g)
            times: dict[str, list[float]] = {"dense": [], "packed": []}
            for _ in range(args.reps + 2):
                for name, fn in (("dense", head), ("packed", copy)):
                    t = time.perf_counter()
                    fn(x)
                    times[name].append((time.perf_counter() - t) * 1e3)
            print(f"| {m} | {cell(times['dense'][2:])} | {cell(times['packed'][2:])} |")

    print("\nthe loop's forward of q tokens after 150 (ms)\n")
    print("| B | q | nothing packed | head | all | head / nothing | all / nothing |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    prompt = torch.randint(100, 20000, (8, 150), generator=g)
    for b, qs in ((1, (1, 2, 4, 5, 8)), (8, (1, 2))):
        for q in qs:
            times = {value: [] for value in packed.MODES}
            for _ in range(args.reps):
                for value in packed.MODES:
                    os.environ[packed.ENV] = value
                    cache = SlotCache(target, b, torch.device("cpu"))
                    cache.forward(prompt[:b], np.ones((b, 150), bool), last_only=True)
                    new = torch.randint(100, 20000, (b, q), generator=g)
                    t = time.perf_counter()
                    cache.forward(new, np.ones((b, q), bool))
                    times[value].append((time.perf_counter() - t) * 1e3)
            base = statistics.median(times["0"])
            ratios = " | ".join(f"{statistics.median(times[v]) / base:.2f}" for v in ("head", "all"))
            print(f"| {b} | {q} | {cell(times['0'])} | {cell(times['head'])} | {cell(times['all'])} | {ratios} |")

    print("\nthe EAGLE head's step, one row (ms)\n\n| layers dense | packed | packed / dense |\n|---:|---:|---:|")
    eagle = load_head(default_head_path()).float()
    d = eagle.config.hidden_size
    feature, embed = torch.randn(1, 1, d, generator=g), torch.randn(1, 1, d, generator=g)
    valid = torch.ones(1, 1, dtype=torch.bool)
    steps: dict[str, list[float]] = {"0": [], "all": []}
    with torch.inference_mode():
        for _ in range(10 * args.reps):
            for value in steps:
                os.environ[packed.ENV] = value
                t = time.perf_counter()
                with packed.model_packed(eagle):
                    eagle(feature, embed, valid)
                steps[value].append((time.perf_counter() - t) * 1e3)
    ratio = statistics.median(steps["all"]) / statistics.median(steps["0"])
    print(f"| {cell2(steps['0'])} | {cell2(steps['all'])} | {ratio:.2f} |")
    os.environ.pop(packed.ENV, None)
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
