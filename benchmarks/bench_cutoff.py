"""Benchmark the top-k / top-p cutoff: the candidates, the bisection, and a full sort.

Usage::

    python benchmarks/bench_cutoff.py [--jsonl PATH]

:func:`specjax.kernels.core.cutoff` on one device decides a row from its 256
largest logits (``lax.top_k``) when it can (top-k with k <= 256, or a nucleus
inside the candidates), and by a bisection over float32 bit patterns (the
algorithm the mesh runs for every row) when it cannot. The peer is the sort
every row would otherwise need (``straightforward_cutoff``, transformers'
algorithm). Rows of V = 49152 (the default pair's vocabulary), R = 5 (B = 1,
G = 4) and 40 (B = 8), methods alternating call by call; the load average
is printed first. The three cases:

* ``top_k=50``: the candidates decide every row;
* ``top_k=1000``: past the candidates: the bisection;
* ``top_p=0.9`` over flat logits (unit normal): the nucleus holds most of the
  vocabulary, past the candidates' mass: the bisection.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from results_io import append_jsonl

from specjax.kernels.core import cutoff

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers
from _straightforward import straightforward_cutoff

VOCAB = 49152


def _alternate(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    """Median seconds per call of each function, calls alternating."""
    for f in fns.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", help="append one JSON object per row to PATH")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"# load average at start: {os.getloadavg()[0]:.2f} (1 min); jax {jax.__version__} on CPU")
    rng = np.random.default_rng(0)
    ours = jax.jit(cutoff)
    rows_out = []
    print("| rows | case | `core.cutoff` | full sort | sort / ours |")
    print("|---:|---|---:|---:|---:|")
    for rows in (5, 40):
        scaled = jnp.asarray(rng.standard_normal((rows, VOCAB)).astype(np.float32))
        cases = {
            "top_k=50": (50, 0.0),
            "top_k=1000": (1000, 0.0),
            "top_p=0.9": (0, 0.1),
        }
        for case, (k, omp) in cases.items():
            top_k = jnp.full((rows,), k, jnp.int32)
            one_minus_top_p = jnp.full((rows,), omp, jnp.float32)
            got = np.asarray(ours(scaled, top_k, one_minus_top_p))
            ref = np.asarray(straightforward_cutoff(scaled, top_k, one_minus_top_p))
            kept_equal = bool(np.array_equal(np.asarray(scaled) >= got[:, None], np.asarray(scaled) >= ref[:, None]))
            t = _alternate(
                {
                    "ours": lambda s=scaled, k=top_k, o=one_minus_top_p: ours(s, k, o),
                    "sort": lambda s=scaled, k=top_k, o=one_minus_top_p: straightforward_cutoff(s, k, o),
                },
                args.reps,
            )
            print(
                f"| {rows} | {case} | {t['ours'] * 1e3:.2f} ms | {t['sort'] * 1e3:.1f} ms | "
                f"{t['sort'] / t['ours']:.0f}× |" + ("" if kept_equal else " (kept sets differ!)")
            )
            rows_out.append(
                {
                    "rows": rows,
                    "V": VOCAB,
                    "case": case,
                    "ours_ms": t["ours"] * 1e3,
                    "sort_ms": t["sort"] * 1e3,
                    "ratio": t["sort"] / t["ours"],
                    "kept_sets_equal": kept_equal,
                }
            )
    print(f"# load average at end: {os.getloadavg()[0]:.2f}")
    if args.jsonl:
        append_jsonl(args.jsonl, rows_out)


if __name__ == "__main__":
    main()
