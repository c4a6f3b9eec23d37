"""The kernels on an accelerator against a plain read of their inputs and the HBM floor (docs/tpu.md).

Usage (on a TPU host; the project need not be installed)::

    PYTHONPATH=src:benchmarks:$PYTHONPATH python3 benchmarks/bench_tpu_kernels.py \\
        --jsonl benchmarks/results/tpu-kernels.jsonl [--quick]

For every (B, G, V, dtype) of the grid, in the same process and on the same
inputs (generated on the device):

* ``kernel``: ``rejection_sample``'s jitted kernel
  (``specjax.kernels.rejection._rejection_sample_jit``, ``impl="xla"``), or
  ``verify_from_logits``'s (``specjax.kernels.frontend._verify_jit``: sampled,
  T = 0.7 with top-k 50 and top-p 0.9; and greedy);
* ``read``: a plain read of the same inputs, one jitted ``jnp.sum`` of each;
* ``floor``: the HBM floor, bytes / 819 GB/s (TPU v5e), of all the inputs
  (``floor_all``) and of what the kernel needs (``floor_needed``: two rows of V per
  batch row for ``rejection_sample``; every logit for ``verify_from_logits``);
* ``trivial``: a jitted call that adds 1 to 8 floats (the dispatch cost; B = 1 rows
  are judged against it: within 1.5x).

Each is timed two ways: the median of ``--reps`` blocking calls (call, then
``block_until_ready``: what a loop that needs the result pays) and the mean of
as many calls queued before one block (device time, dispatch overlapped). The
verdicts use the blocking medians, as issue 54's targets do. One row per
(section, mode, B, G, V, dtype) is appended to ``--jsonl`` as it is measured,
with the device named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from results_io import append_jsonl

from specjax.kernels import frontend
from specjax.kernels.rejection import _rejection_sample_jit
from specjax.kernels.types import SamplingParams

HBM_BYTES_PER_S = 819e9  # TPU v5e (Google Cloud's v5e page)
BATCHES = (1, 8, 64, 256)
DRAFTS = (4, 8)
VOCABS = (32000, 128256, 151936)
DTYPES = ("float32", "bfloat16")
VERIFY_VOCAB = 128256


def timed(fn: Callable[[], Any], reps: int) -> tuple[float, float]:
    """(median seconds of ``reps`` blocking calls, mean seconds of ``reps`` queued calls), after 2 warm-ups."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    jax.block_until_ready([fn() for _ in range(reps)])
    return statistics.median(times), (time.perf_counter() - t0) / reps


_read = jax.jit(lambda *arrays: [jnp.sum(a) for a in arrays])


def rejection_inputs(b: int, g: int, v: int, dtype: str) -> tuple[jax.Array, ...]:
    @jax.jit
    def build(key: jax.Array) -> tuple[jax.Array, ...]:
        k = jax.random.split(key, 5)
        t = jax.random.uniform(k[0], (b, g + 1, v), jnp.float32) ** 4
        t = t / jnp.sum(t, -1, keepdims=True)
        d = t[:, :g] * jax.random.uniform(k[1], (b, g, v), jnp.float32, 0.5, 1.5)
        d = d / jnp.sum(d, -1, keepdims=True)
        x = jax.random.randint(k[2], (b, g), 0, v, jnp.int32)
        return x, d.astype(dtype), t.astype(dtype), jax.random.uniform(k[3], (b, g)), jax.random.uniform(k[4], (b,))

    return jax.block_until_ready(build(jax.random.key(b * 7 + g * 3 + v)))


def verify_inputs(b: int, g: int, v: int, dtype: str) -> tuple[jax.Array, ...]:
    @jax.jit
    def build(key: jax.Array) -> tuple[jax.Array, ...]:
        k = jax.random.split(key, 3)
        t = 3 * jax.random.normal(k[0], (b, g + 1, v))
        d = t[:, :g] + jax.random.normal(k[1], (b, g, v))
        x = jnp.argmax(d + jax.random.gumbel(k[2], d.shape), axis=-1).astype(jnp.int32)
        return x, d.astype(dtype), t.astype(dtype)

    return jax.block_until_ready(build(jax.random.key(b + g + v)))


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def _record(section, mode, b, g, v, dtype, kernel, read, nbytes, need_bytes, limit, trivial_s, device, reps):
    """One row per (section, mode, B, G, V, dtype): the kernel, the read, the floors and the verdicts."""
    (kb, kq), (rb, rq) = kernel, read
    verdict = "-" if limit is None else ("ok" if kb <= limit * rb else "MISS")
    row = {
        "section": section,
        "mode": mode,
        "B": b,
        "G": g,
        "V": v,
        "dtype": dtype,
        "kernel_us": _us(kb),
        "read_us": _us(rb),
        "kernel_per_read": round(kb / rb, 2),
        "kernel_queued_us": _us(kq),
        "read_queued_us": _us(rq),
        "queued_per_read": round(kq / rq, 2),
        "floor_all_us": _us(nbytes / HBM_BYTES_PER_S),
        "floor_needed_us": _us(need_bytes / HBM_BYTES_PER_S),
        "limit_per_read": limit,
        "verdict": verdict,
        "device": device,
        "reps": reps,
    }
    if b == 1:
        row["per_trivial_call"] = round(kb / trivial_s, 2)
        row["verdict"] = "ok" if kb <= 1.5 * trivial_s else "MISS"
        row["limit_per_trivial_call"] = 1.5
    return row


def _print(row: dict[str, Any]) -> None:
    extra = f" {row['per_trivial_call']:6.2f}x trivial" if "per_trivial_call" in row else ""
    print(
        f"{row['section']:>9} {row['mode']:>8} {row['B']:4d} {row['G']:2d} {row['V']:7d} {row['dtype']:>8} "
        f"{row['kernel_us']:10.1f} {row['read_us']:9.1f} {row['kernel_per_read']:7.2f} {row['queued_per_read']:8.2f} "
        f"{row['floor_all_us']:9.1f} {row['floor_needed_us']:9.1f} {row['verdict']:>6}{extra}",
        flush=True,
    )


HEADER_LINE = (
    f"{'section':>9} {'mode':>8} {'B':>4} {'G':>2} {'V':>7} {'dtype':>8} {'kernel_us':>10} {'read_us':>9} "
    f"{'k/read':>7} {'k/read_q':>8} {'floor_all':>9} {'floor_need':>9} {'verdict':>6}"
)


def bench_rejection(batches, drafts, vocabs, dtypes, reps, device, trivial_s, sink) -> None:
    print(HEADER_LINE)
    for v in vocabs:
        for g in drafts:
            for dtype in dtypes:
                for b in batches:
                    args = rejection_inputs(b, g, v, dtype)
                    item = jnp.dtype(dtype).itemsize
                    kernel = timed(lambda a=args: _rejection_sample_jit(*a), reps)
                    read = timed(lambda a=args: _read(a[1], a[2]), reps)
                    row = _record(
                        "rejection", "probs", b, g, v, dtype, kernel, read, b * (2 * g + 1) * v * item,
                        b * 2 * v * item, 1.0 if b >= 64 else None, trivial_s, device, reps,
                    )  # fmt: skip
                    _print(row)
                    sink([row])
                    del args


def bench_verify(batches, drafts, dtypes, reps, device, trivial_s, sink) -> None:
    v = VERIFY_VOCAB
    limits = {"sampled": 3.0, "greedy": 1.5}
    print(HEADER_LINE)
    for g in drafts:
        for dtype in dtypes:
            for b in batches:
                x, d, t = verify_inputs(b, g, v, dtype)
                read = timed(lambda d=d, t=t: _read(d, t), reps)
                nbytes = b * (2 * g + 1) * v * jnp.dtype(dtype).itemsize
                key = jax.random.key(0)
                k = jnp.full((b,), g, jnp.int32)
                for mode in ("sampled", "greedy"):
                    args = (x, d, t, key, _params(b, mode), k)
                    kernel = timed(lambda a=args: frontend._verify_jit(*a), reps)
                    row = _record(
                        "verify", mode, b, g, v, dtype, kernel, read, nbytes, nbytes,
                        limits[mode] if b >= 8 else None, trivial_s, device, reps,
                    )  # fmt: skip
                    _print(row)
                    sink([row])
                del x, d, t


def _params(b: int, mode: str) -> SamplingParams:
    ones = jnp.ones((b,), jnp.float32)
    if mode == "greedy":
        return SamplingParams(ones * 0, jnp.zeros((b,), jnp.int32), ones * 0, False, False, "xla")
    return SamplingParams(ones * 0.7, jnp.full((b,), 50, jnp.int32), ones * 0.1, True, True, "xla")


def bench_trivial(reps: int) -> float:
    small = jnp.ones((8,), jnp.float32)
    trivial = jax.jit(lambda a: a + 1)
    tb, tq = timed(lambda: trivial(small), reps)
    print(f"trivial jitted call: {tb * 1e6:.1f} us blocking, {tq * 1e6:.1f} us queued")
    return tb


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", metavar="PATH", help="append result rows as JSON lines to PATH")
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run of the script)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", choices=("rejection", "verify"), help="one section")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes (default {BATCHES})")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="dtypes (default both)")
    parser.add_argument("--vocabs", type=int, nargs="+", help=f"rejection_sample's vocabularies (default {VOCABS})")
    parser.add_argument("--drafts", type=int, nargs="+", help=f"rejection_sample's draft lengths (default {DRAFTS})")
    args = parser.parse_args(argv)
    d = jax.devices()[0]
    device = f"{d.platform}:{d.device_kind}"
    print(f"device: {device}; JAX {jax.__version__}")
    if args.quick:
        batches, drafts, vocabs, dtypes, verify_batches = (1, 64), (4,), (4000,), DTYPES, (1, 8)
        global VERIFY_VOCAB
        VERIFY_VOCAB = 4000
    else:
        batches, drafts, vocabs, dtypes, verify_batches = BATCHES, DRAFTS, VOCABS, DTYPES, BATCHES
    if args.batches:
        batches = verify_batches = tuple(args.batches)
    if args.dtypes:
        dtypes = tuple(args.dtypes)
    vocabs = tuple(args.vocabs or vocabs)
    drafts = tuple(args.drafts or drafts)

    def sink(new_rows: list[dict[str, Any]]) -> None:  # rows land as they come (a run may be cut short)
        if args.jsonl:
            append_jsonl(args.jsonl, new_rows)

    trivial_s = bench_trivial(args.reps)
    if args.only in (None, "rejection"):
        bench_rejection(batches, drafts, vocabs, dtypes, args.reps, device, trivial_s, sink)
    if args.only in (None, "verify"):
        bench_verify(verify_batches, (4,), dtypes, args.reps, device, trivial_s, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
