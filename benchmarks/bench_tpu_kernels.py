"""The kernels on an accelerator against a plain read of their inputs and the HBM floor (docs/tpu.md).

Usage (on a TPU host; the project need not be installed)::

    PYTHONPATH=src:benchmarks:$PYTHONPATH python3 benchmarks/bench_tpu_kernels.py \\
        --out benchmarks/results [--compare-cutoff] [--budget-s 400] [--quick]

For every (B, G, V, dtype) of the grid (issue 54: B in {1, 8, 64, 256}, G in
{4, 8}, V in {32000, 128256, 151936}, float32 and bfloat16; the front end at
V = 128256), in the same process and on the same inputs (generated on the device):

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

``--compare-cutoff`` adds, first, the top-k / top-p cutoff alone on the target's
B·(G+1) rows of scaled logits (G = 4, V = 128256; k = 50, p = 0.9), each against
the same read: the TPU's route (``core.cutoff_by_lanes``), its Pallas pass alone
(``tpu_pallas.lane_candidates``), and the previous path (``lax.top_k`` of every
row, then the same rule); whether both give the same cutoffs, bit for bit, and the
share of rows the lane candidates decide. It also times the sampled front end
with the previous path (mode ``sampled-topk``) beside the current one.

Each is timed two ways: the median of ``--reps`` blocking calls (call, then
``block_until_ready``: what a loop that needs the result pays) and the mean of
as many calls queued before one block (device time, dispatch overlapped). The
verdicts use the blocking medians, as issue 54's targets do. Rows are appended
as they are measured to ``--out``/tpu-cutoff.jsonl, tpu-verify.jsonl and
tpu-rejection.jsonl (that order: the cutoff, the front end, then the
probability kernel), each with the device named. ``--budget-s`` stops starting
new cases once that many seconds have passed (one device call is limited), and
says which were skipped. Off a TPU (a dry run, ``JAX_PLATFORMS=cpu --quick``)
the Pallas pass runs in its interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from results_io import append_jsonl

from specjax.kernels import core, frontend, tpu_pallas
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


def _print(row: dict[str, Any], tail: str = "") -> None:
    extra = f" {row['per_trivial_call']:6.2f}x trivial" if "per_trivial_call" in row else ""
    print(
        f"{row['section']:>9} {row['mode']:>12} {row['B']:4d} {row['G']:2d} {row['V']:7d} {row['dtype']:>8} "
        f"{row['kernel_us']:10.1f} {row['read_us']:9.1f} {row['kernel_per_read']:7.2f} {row['queued_per_read']:8.2f} "
        f"{row['floor_all_us']:9.1f} {row['floor_needed_us']:9.1f} {row['verdict']:>6}{extra}{tail}",
        flush=True,
    )


HEADER_LINE = (
    f"{'section':>9} {'mode':>12} {'B':>4} {'G':>2} {'V':>7} {'dtype':>8} {'kernel_us':>10} {'read_us':>9} "
    f"{'k/read':>7} {'k/read_q':>8} {'floor_all':>9} {'floor_need':>9} {'verdict':>6}"
)


class Budget:
    """Stops new cases once ``seconds`` have passed since the start (a device call is limited)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.skipped: list[str] = []

    def allows(self, case: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(case)
        print(f"skipped (time budget spent): {case}", flush=True)
        return False


def bench_rejection(batches, drafts, vocabs, dtypes, reps, device, trivial_s, sink, budget) -> None:
    print(HEADER_LINE)
    for v in vocabs:
        for g in drafts:
            for dtype in dtypes:
                for b in batches:
                    if not budget.allows(f"rejection B={b} G={g} V={v} {dtype}"):
                        continue
                    args = rejection_inputs(b, g, v, dtype)
                    item = jnp.dtype(dtype).itemsize
                    kernel = timed(lambda a=args: _rejection_sample_jit(*a), reps)
                    read = timed(lambda a=args: _read(a[1], a[2]), reps)
                    row = _record(
                        "rejection", "probs", b, g, v, dtype, kernel, read, b * (2 * g + 1) * v * item,
                        b * 2 * v * item, 1.0 if b >= 64 else None, trivial_s, device, reps,
                    )  # fmt: skip
                    _print(row)
                    sink("tpu-rejection", [row])
                    del args


@contextlib.contextmanager
def topk_cutoff() -> Iterator[None]:
    """Within: the cutoff's TPU branch takes ``lax.top_k`` of every row (the path before the lane candidates)."""
    keep = core.cutoff_by_lanes

    def previous(scaled, k, one_minus_top_p, source=None, *, interpret=False):
        vocab = scaled.shape[-1]

        def read() -> jax.Array:
            return scaled if source is None else source[1](source[0])

        return core._cutoff_from_candidates(read, vocab, core._largest(read(), min(256, vocab)), k, one_minus_top_p)

    core.cutoff_by_lanes = previous
    try:
        yield
    finally:
        core.cutoff_by_lanes = keep


def bench_verify(batches, drafts, dtypes, reps, device, trivial_s, sink, budget, compare) -> None:
    v = VERIFY_VOCAB
    limits = {"sampled": 3.0, "sampled-topk": 3.0, "sampled-t": None, "greedy": 1.5}
    # sampled-t: T = 0.7 alone, the loop's sampling (the acceptance walks the positions in order off the CPU)
    modes = ("sampled", "sampled-topk", "sampled-t", "greedy") if compare else ("sampled", "sampled-t", "greedy")
    print(HEADER_LINE)
    for g in drafts:
        for dtype in dtypes:
            for b in batches:
                if not budget.allows(f"verify B={b} G={g} V={v} {dtype}"):
                    continue
                x, d, t = verify_inputs(b, g, v, dtype)
                read = timed(lambda d=d, t=t: _read(d, t), reps)
                nbytes = b * (2 * g + 1) * v * jnp.dtype(dtype).itemsize
                key = jax.random.key(0)
                k = jnp.full((b,), g, jnp.int32)
                for mode in modes:
                    args = (x, d, t, key, _params(b, mode), k)
                    if mode == "sampled-topk":
                        # a new function, traced inside the context (jit reuses a trace per function)
                        fresh = jax.jit(lambda *a: frontend._verify_jit.__wrapped__(*a))
                        with topk_cutoff():
                            kernel = timed(lambda a=args, f=fresh: f(*a), reps)
                    else:
                        kernel = timed(lambda a=args: frontend._verify_jit(*a), reps)
                    row = _record(
                        "verify", mode, b, g, v, dtype, kernel, read, nbytes, nbytes,
                        limits[mode] if b >= 8 else None, trivial_s, device, reps,
                    )  # fmt: skip
                    _print(row)
                    sink("tpu-verify", [row])
                del x, d, t


def bench_cutoff(batches, dtypes, reps, device, trivial_s, sink, budget, interpret) -> None:
    """The cutoff alone on the target's B·(G+1) rows (G = 4): the lane route, its pass, the ``lax.top_k`` path."""
    g, v = 4, VERIFY_VOCAB
    print(HEADER_LINE + " same_bits decided")
    for dtype in dtypes:
        for b in batches:
            if budget.allows(f"cutoff B={b} G={g} V={v} {dtype}"):
                rows = _cutoff_case(verify_inputs(b, g, v, dtype)[2], reps, interpret)
                for mode, kernel, read, same, share in rows:
                    row = _record(
                        "cutoff", mode, b, g, v, dtype, kernel, read, b * (g + 1) * v * jnp.dtype(dtype).itemsize,
                        b * (g + 1) * v * jnp.dtype(dtype).itemsize, 3.0 if b >= 8 and mode == "lanes-route" else None,
                        trivial_s, device, reps,
                    )  # fmt: skip
                    row.update(same_bits=same, decided_share=share)
                    _print(row, f" {same!s:>9} {share:7.4f}")
                    sink("tpu-cutoff", [row])


def _cutoff_case(t: jax.Array, reps: int, interpret: bool) -> list[tuple[str, Any, Any, bool, float]]:
    """(mode, kernel times, read times, same cutoffs bit for bit, share of rows decided) for logits ``t``."""
    v = t.shape[-1]
    top_k = jnp.full(t.shape[:-1], 50, jnp.int32)
    omp = jnp.full(t.shape[:-1], 0.1, jnp.float32)

    def parts(x: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:  # as the front end scales
        x_max = jnp.max(x, axis=-1, keepdims=True).astype(jnp.float32)

        def to_scaled(a: jax.Array) -> jax.Array:
            return (a.astype(jnp.float32) - x_max) * jnp.float32(1 / 0.7)

        return to_scaled(x), to_scaled

    @jax.jit
    def lanes_route(x, k, o):
        scaled, to_scaled = parts(x)
        return core.cutoff_by_lanes(scaled, k, o, (x, to_scaled), interpret=interpret)

    @jax.jit
    def topk_path(x, k, o):
        scaled, _ = parts(x)
        return core._cutoff_from_candidates(lambda: scaled, v, core._largest(scaled, 256), k, o)

    @jax.jit
    def decided(x, k, o):
        scaled, to_scaled = parts(x)
        return jnp.mean(core.lane_candidates_decide(scaled, k, o, (x, to_scaled), interpret=interpret)[1])

    lanes_pass = jax.jit(lambda x: tpu_pallas.lane_candidates(x, 8, interpret=interpret))
    new, old = lanes_route(t, top_k, omp), topk_path(t, top_k, omp)
    same = bool(jnp.all(lax.bitcast_convert_type(new, jnp.int32) == lax.bitcast_convert_type(old, jnp.int32)))
    share = round(float(decided(t, top_k, omp)), 4)
    read = timed(lambda: _read(t), reps)
    return [
        ("lanes-route", timed(lambda: lanes_route(t, top_k, omp), reps), read, same, share),
        ("lanes-pass", timed(lambda: lanes_pass(t), reps), read, same, share),
        ("topk-path", timed(lambda: topk_path(t, top_k, omp), reps), read, same, share),
    ]


def _params(b: int, mode: str) -> SamplingParams:
    ones = jnp.ones((b,), jnp.float32)
    if mode == "greedy":
        return SamplingParams(ones * 0, jnp.zeros((b,), jnp.int32), ones * 0, False, False, "xla")
    if mode == "sampled-t":
        return SamplingParams(ones * 0.7, jnp.zeros((b,), jnp.int32), ones * 0, False, False, "xla")
    return SamplingParams(ones * 0.7, jnp.full((b,), 50, jnp.int32), ones * 0.1, True, True, "xla")


def bench_trivial(reps: int) -> float:
    small = jnp.ones((8,), jnp.float32)
    trivial = jax.jit(lambda a: a + 1)
    tb, tq = timed(lambda: trivial(small), reps)
    print(f"trivial jitted call: {tb * 1e6:.1f} us blocking, {tq * 1e6:.1f} us queued")
    return tb


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", metavar="DIR", help="append rows to DIR/tpu-{cutoff,verify,rejection}.jsonl")
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run of the script)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--only", choices=("cutoff", "verify", "rejection"), help="one section")
    parser.add_argument("--compare-cutoff", action="store_true", help="time the previous (lax.top_k) cutoff too")
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no case after this many seconds")
    parser.add_argument("--batches", type=int, nargs="+", help=f"batch sizes (default {BATCHES})")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="dtypes (default both)")
    parser.add_argument("--vocabs", type=int, nargs="+", help=f"rejection_sample's vocabularies (default {VOCABS})")
    parser.add_argument("--drafts", type=int, nargs="+", help=f"draft lengths (default {DRAFTS})")
    args = parser.parse_args(argv)
    d = jax.devices()[0]
    device = f"{d.platform}:{d.device_kind}"
    interpret = d.platform != "tpu"  # the Pallas pass off a TPU: its interpreter (a dry run)
    print(f"device: {device}; JAX {jax.__version__}", flush=True)
    global VERIFY_VOCAB
    if args.quick:
        batches, drafts, vocabs, dtypes = (1, 8), (4,), (2048,), DTYPES
        VERIFY_VOCAB = 2048
    else:
        batches, drafts, vocabs, dtypes = BATCHES, DRAFTS, VOCABS, DTYPES
    batches = tuple(args.batches or batches)
    dtypes = tuple(args.dtypes or dtypes)
    vocabs = tuple(args.vocabs or vocabs)
    drafts = tuple(args.drafts or drafts)
    budget = Budget(args.budget_s)

    def sink(name: str, new_rows: list[dict[str, Any]]) -> None:  # rows land as they come (a run may be cut short)
        if args.out:
            append_jsonl(os.path.join(args.out, f"{name}.jsonl"), new_rows)

    trivial_s = bench_trivial(args.reps)
    if args.only == "cutoff" or (args.only is None and args.compare_cutoff):
        bench_cutoff(batches, dtypes, args.reps, device, trivial_s, sink, budget, interpret)
    if args.only in (None, "verify"):
        bench_verify(batches, drafts, dtypes, args.reps, device, trivial_s, sink, budget, args.compare_cutoff)
    if args.only in (None, "rejection"):
        bench_rejection(batches, drafts, vocabs, dtypes, args.reps, device, trivial_s, sink, budget)
    if budget.skipped:
        print(f"{len(budget.skipped)} cases skipped by --budget-s: {'; '.join(budget.skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
