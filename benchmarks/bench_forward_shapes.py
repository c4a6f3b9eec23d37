"""What one target forward costs at B = 8 as the number of new tokens per row grows.

Usage::

    python benchmarks/bench_forward_shapes.py            # about 30 s
    python benchmarks/bench_forward_shapes.py --jsonl bench-results/forward.jsonl

Speculative decoding at batch size B replaces q = 1 new token per row and
forward (target-only decoding) by q = G + 1 (verification). Its speed-up rests
on how much more a forward over B·q rows costs than one over B rows. This script
measures, on the synthetic pair of ``bench_generate.py`` (8-layer Llama, d = 512)
with torch on CPU:

* the target forward with a KV cache of 40 positions, B = 8, q = 1 … 9 new
  tokens per row (median of 15 calls, the cache cropped back after each);
* the matrix product behind its linear layers, ``F.linear(x, W)`` with ``x``
  (8·q, 512) and ``W`` (1376, 512) as stored by ``nn.Linear``, beside the same
  product with ``W`` stored transposed (``x @ W.T`` from a contiguous ``W.T``).

The second table shows where the first one's step comes from: torch's CPU GEMM
for a transposed weight (how ``nn.Linear`` stores it) is cheap for 8 rows and
several times dearer per call from 16 rows on.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from results_io import append_jsonl


def _median_s(fn: Callable[[], Any], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_rows(batch: int = 8, prompt: int = 40, widths: Sequence[int] = (1, 2, 3, 5, 9)) -> list[dict]:
    import torch
    from bench_generate import synthetic_pair
    from transformers import DynamicCache

    from specjax.slots import crop_cache

    target, _ = synthetic_pair()
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    ids = torch.randint(1, target.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    with torch.inference_mode():
        cache = DynamicCache(config=target.config)
        target(input_ids=ids, use_cache=True, **{cache_kw: cache})
        for q in widths:
            new = torch.randint(1, target.config.vocab_size, (batch, q))

            def step(new=new, q=q):
                target(input_ids=new, use_cache=True, **{cache_kw: cache})
                crop_cache(cache, q)

            rows.append(
                {
                    "what": "target forward",
                    "B": batch,
                    "q": q,
                    "rows": batch * q,
                    "median_us": _median_s(step, reps=15) * 1e6,
                }
            )
    base = rows[0]["median_us"]
    for r in rows:
        r["relative_to_q1"] = r["median_us"] / base
    return rows


def linear_rows(ms: Sequence[int] = (8, 16, 24, 40, 72), d_in: int = 512, d_out: int = 1376) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=gen)
    w_t = w.t().contiguous()
    rows = []
    for m in ms:
        x = torch.randn(m, d_in, generator=gen)
        as_stored = _median_s(lambda x=x: torch.nn.functional.linear(x, w), reps=200) * 1e6
        transposed = _median_s(lambda x=x: x @ w_t, reps=200) * 1e6
        rows.append(
            {
                "what": "linear",
                "M": m,
                "nn_linear_us": as_stored,
                "pretransposed_us": transposed,
                "gflops_nn_linear": 2 * m * d_in * d_out / as_stored / 1e3,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON row per measurement to PATH")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    fwd = forward_rows()
    print("| target forward, B = 8 | new tokens per row q | median | vs q = 1 |")
    print("|---|---:|---:|---:|")
    for r in fwd:
        print(f"| synthetic 8L-d512 | {r['q']} | {r['median_us'] / 1000:.1f} ms | {r['relative_to_q1']:.2f}× |")
    lin = linear_rows()
    print()
    print("| linear (M, 512) x (512, 1376) | nn.Linear weight (transposed GEMM) | weight stored transposed | ratio |")
    print("|---:|---:|---:|---:|")
    for r in lin:
        print(
            f"| M = {r['M']} | {r['nn_linear_us']:.0f} µs | {r['pretransposed_us']:.0f} µs | "
            f"{r['nn_linear_us'] / r['pretransposed_us']:.1f}× |"
        )
    if args.jsonl:
        append_jsonl(args.jsonl, [*fwd, *lin])
    return 0


if __name__ == "__main__":
    sys.exit(main())
