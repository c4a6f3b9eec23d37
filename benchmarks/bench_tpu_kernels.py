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
* ``trivial``: a jitted call that adds 1 to 8 floats (the dispatch cost, for B = 1).

Each is timed two ways: the median of ``--reps`` blocking calls (call, then
``block_until_ready``: what a loop that needs the result pays) and the mean of
as many calls queued before one block (device time, dispatch overlapped). The
verdicts use the blocking medians, as issue 54's targets do. Rows are appended
to ``--jsonl`` with the device named.
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


def _row(section: str, method: str, b: int, g: int, v: int, dtype: str, **fields: Any) -> dict[str, Any]:
    return {"section": section, "method": method, "B": b, "G": g, "V": v, "dtype": dtype, **fields}


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def bench_rejection(batches, drafts, vocabs, dtypes, reps: int, device: str, sink) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    print(
        f"\n{'B':>4} {'G':>2} {'V':>7} {'dtype':>8} {'kernel_us':>10} {'read_us':>9} {'k/read':>7} "
        f"{'k/read_q':>8} {'floor_all_us':>12} {'floor_need_us':>13} {'verdict':>8}"
    )
    for v in vocabs:
        for g in drafts:
            for dtype in dtypes:
                for b in batches:
                    args = rejection_inputs(b, g, v, dtype)
                    item = jnp.dtype(dtype).itemsize
                    kb, kq = timed(lambda a=args: _rejection_sample_jit(*a), reps)
                    rb, rq = timed(lambda a=args: _read(a[1], a[2]), reps)
                    all_bytes = b * (2 * g + 1) * v * item
                    need_bytes = b * 2 * v * item
                    verdict = "-" if b < 64 else ("ok" if kb <= rb else "MISS")
                    common = {"device": device, "reps": reps}
                    rows += [
                        _row(
                            "rejection",
                            "kernel",
                            b,
                            g,
                            v,
                            dtype,
                            median_us=_us(kb),
                            queued_us=_us(kq),
                            ratio_to_read=kb / rb,
                            ratio_to_read_queued=kq / rq,
                            verdict=verdict,
                            **common,
                        ),
                        _row(
                            "rejection",
                            "read",
                            b,
                            g,
                            v,
                            dtype,
                            median_us=_us(rb),
                            queued_us=_us(rq),
                            bytes=all_bytes,
                            **common,
                        ),
                        _row(
                            "rejection",
                            "floor",
                            b,
                            g,
                            v,
                            dtype,
                            floor_all_us=_us(all_bytes / HBM_BYTES_PER_S),
                            floor_needed_us=_us(need_bytes / HBM_BYTES_PER_S),
                            bytes=all_bytes,
                            bytes_needed=need_bytes,
                            device=device,
                        ),
                    ]
                    print(
                        f"{b:4d} {g:2d} {v:7d} {dtype:>8} {kb * 1e6:10.1f} {rb * 1e6:9.1f} {kb / rb:7.2f} "
                        f"{kq / rq:8.2f} {all_bytes / HBM_BYTES_PER_S * 1e6:12.1f} "
                        f"{need_bytes / HBM_BYTES_PER_S * 1e6:13.1f} {verdict:>8}",
                        flush=True,
                    )
                    sink(rows[-3:])
                    del args
    return rows


def _params(b: int, mode: str) -> SamplingParams:
    ones = jnp.ones((b,), jnp.float32)
    if mode == "greedy":
        return SamplingParams(ones * 0, jnp.zeros((b,), jnp.int32), ones * 0, False, False, "xla")
    return SamplingParams(ones * 0.7, jnp.full((b,), 50, jnp.int32), ones * 0.1, True, True, "xla")


def bench_verify(batches, drafts, dtypes, reps: int, device: str, sink) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    v = VERIFY_VOCAB
    limits = {"sampled": 3.0, "greedy": 1.5}
    print(
        f"\n{'B':>4} {'G':>2} {'V':>7} {'dtype':>8} {'mode':>8} {'kernel_us':>10} {'read_us':>9} {'k/read':>7} "
        f"{'k/read_q':>8} {'floor_us':>9} {'verdict':>8}"
    )
    for g in drafts:
        for dtype in dtypes:
            for b in batches:
                x, d, t = verify_inputs(b, g, v, dtype)
                rb, rq = timed(lambda d=d, t=t: _read(d, t), reps)
                nbytes = b * (2 * g + 1) * v * jnp.dtype(dtype).itemsize
                rows.append(
                    _row(
                        "verify",
                        "read",
                        b,
                        g,
                        v,
                        dtype,
                        median_us=_us(rb),
                        queued_us=_us(rq),
                        bytes=nbytes,
                        device=device,
                        reps=reps,
                    )
                )
                rows.append(
                    _row(
                        "verify",
                        "floor",
                        b,
                        g,
                        v,
                        dtype,
                        floor_all_us=_us(nbytes / HBM_BYTES_PER_S),
                        bytes=nbytes,
                        device=device,
                    )
                )
                key = jax.random.key(0)
                k = jnp.full((b,), g, jnp.int32)
                for mode in ("sampled", "greedy"):
                    params = _params(b, mode)
                    kb, kq = timed(lambda a=(x, d, t, key, params, k): frontend._verify_jit(*a), reps)
                    verdict = "-" if b < 8 else ("ok" if kb <= limits[mode] * rb else "MISS")
                    rows.append(
                        _row(
                            "verify",
                            mode,
                            b,
                            g,
                            v,
                            dtype,
                            median_us=_us(kb),
                            queued_us=_us(kq),
                            ratio_to_read=kb / rb,
                            ratio_to_read_queued=kq / rq,
                            limit=limits[mode],
                            verdict=verdict,
                            device=device,
                            reps=reps,
                        )
                    )
                    print(
                        f"{b:4d} {g:2d} {v:7d} {dtype:>8} {mode:>8} {kb * 1e6:10.1f} {rb * 1e6:9.1f} "
                        f"{kb / rb:7.2f} {kq / rq:8.2f} {nbytes / HBM_BYTES_PER_S * 1e6:9.1f} {verdict:>8}",
                        flush=True,
                    )
                sink(rows[-4:])
                del x, d, t
    return rows


def bench_trivial(reps: int, device: str) -> tuple[list[dict[str, Any]], float]:
    small = jnp.ones((8,), jnp.float32)
    trivial = jax.jit(lambda a: a + 1)
    tb, tq = timed(lambda: trivial(small), reps)
    print(f"\ntrivial jitted call: {tb * 1e6:.1f} us blocking, {tq * 1e6:.1f} us queued")
    return [
        _row("dispatch", "trivial", 1, 0, 8, "float32", median_us=_us(tb), queued_us=_us(tq), device=device, reps=reps)
    ], tb


def b1_verdicts(rows: list[dict[str, Any]], trivial_s: float) -> None:
    """B = 1: each kernel within 1.5x of the trivial jitted call (blocking)."""
    print("\nB = 1 against the trivial call (limit 1.5x):")
    for r in rows:
        if r["B"] == 1 and r["method"] in ("kernel", "sampled", "greedy"):
            ratio = r["median_us"] / (trivial_s * 1e6)
            r["ratio_to_trivial"] = ratio
            r["verdict_b1"] = "ok" if ratio <= 1.5 else "MISS"
            print(f"  {r['section']} {r['method']} G={r['G']} V={r['V']} {r['dtype']}: {ratio:.2f}x {r['verdict_b1']}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jsonl", metavar="PATH", help="append result rows as JSON lines to PATH")
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run of the script)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", choices=("rejection", "verify"), help="one section")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes (default {BATCHES})")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="dtypes (default both)")
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

    def sink(new_rows: list[dict[str, Any]]) -> None:  # rows land as they come (a run may be cut short)
        if args.jsonl:
            append_jsonl(args.jsonl, new_rows)

    rows, trivial_s = bench_trivial(args.reps, device)
    sink(rows)
    if args.only in (None, "rejection"):
        rows += bench_rejection(batches, drafts, vocabs, dtypes, args.reps, device, sink)
    if args.only in (None, "verify"):
        rows += bench_verify(verify_batches, (4,), dtypes, args.reps, device, sink)
    b1_verdicts(rows, trivial_s)
    if args.jsonl:  # the B = 1 verdicts, as rows of their own
        append_jsonl(args.jsonl, [dict(r, method=r["method"] + "_b1") for r in rows if "verdict_b1" in r])
    return 0


if __name__ == "__main__":
    sys.exit(main())
