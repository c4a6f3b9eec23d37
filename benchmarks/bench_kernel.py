"""Benchmark the acceptance kernel against the straightforward JAX version and the memory floor.

Usage::

    python benchmarks/bench_kernel.py              # full run (a few minutes on a 2-core CPU)
    python benchmarks/bench_kernel.py --quick      # a short run: a few sizes, few repetitions
    python benchmarks/bench_kernel.py --jsonl bench-results/kernel.jsonl
    python benchmarks/bench_kernel.py --logits     # then the front end from logits against
                                                   # transformers (benchmarks/bench_logits.py)

For every (B, G, V) the table shows the median wall time of one call (after
warm-up, with ``block_until_ready``) of

* ``kernel``: ``specjax.kernels.rejection._rejection_sample_jit``, the jitted
  kernel without the Python boundary (what ``rejection_sample(validate=False)``
  runs after converting its inputs);
* ``straightforward``: ``straightforward_rejection_sample``, which builds the full
  (B, G, V) residual and CDF; skipped where XLA reports more than
  ``--max-straightforward-gb`` of temporaries for it;
* ``floor``: the bytes the kernel must read, two rows of V float32 per batch row
  (``p_n`` and ``q_n``: B·2·V·4 bytes), divided by the copy bandwidth measured in
  the same run (``np.copyto`` of 128 MiB into a preallocated buffer, much
  larger than the caches, counting bytes read + bytes written). The kernel and
  the bandwidth are timed in alternating rounds for every row (the load of a
  shared machine drifts within seconds), and ``kernel/floor`` is the median of
  the rounds' ratios (:func:`time_against_floor`); the JSON rows keep every
  round's ratio.

Absolute times on a shared CPU are noise; the ratios, measured in the same run,
are what to read. Rows are appended to ``--jsonl`` as JSON objects, one per
(kernel, method, B, G, V), so later sections (e.g. the logits front end) can add
their own ``bench_*`` function and share :func:`time_call` and :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jax_threads
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers
from _straightforward import _straightforward_jit, straightforward_rejection_sample
from results_io import append_jsonl, flat_record

from specjax import rejection_sample
from specjax.kernels import cpu_kernels
from specjax.kernels.rejection import _rejection_sample_jit

FULL_BATCHES = (1, 8, 64, 256)
FULL_DRAFTS = (4, 8)
FULL_VOCABS = (32000, 128256)
QUICK_BATCHES = (1, 64)
QUICK_DRAFTS = (4,)
QUICK_VOCABS = (32000,)


@dataclass
class Row:
    """One result row (also one JSON line)."""

    kernel: str
    method: str
    B: int
    G: int
    V: int
    median_us: float | None
    reps: int = 0
    ratio: float | None = None  # median_us / the reference method named in ratio_to
    ratio_to: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- timing


def time_call(
    fn: Callable[[], Any], *, budget_s: float, min_reps: int = 5, max_reps: int = 200, warmup: int = 2
) -> tuple[float, int]:
    """Median seconds per call of ``fn`` (which must return JAX arrays), after warm-up.

    Repeats until ``budget_s`` is spent, at least ``min_reps`` and at most
    ``max_reps`` times; every call is followed by ``block_until_ready``. Slow
    calls take fewer samples: the last warm-up call counts as one, and calls
    over 0.3 s stop at three samples, over 1 s at one.
    """
    times: list[float] = []
    for i in range(warmup):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())  # the first call compiles
        dt = time.perf_counter() - t0
        if i == warmup - 1 and warmup > 1 and dt > 0.3:
            times.append(dt)
            min_reps = max_reps = 1 if dt > 1.0 else 3
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def measure_copy_bandwidth(*, nbytes: int = 128 * 2**20, reps: int = 5) -> float:
    """Memory bandwidth in bytes per second: ``np.copyto`` of ``nbytes``, read + write counted.

    The destination is preallocated (page faults of fresh allocations are not
    timed) and the buffer is far larger than the last-level cache. Median of
    ``reps`` copies. Called again for every table row, so that the floor
    follows the machine's load (on a shared CPU the bandwidth drifts).
    """
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch every page once
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


FLOOR_ROUNDS = 5


def time_against_floor(
    fn: Callable[[], Any], floor_bytes: int, *, budget_s: float, max_reps: int, rounds: int
) -> tuple[float, int, float, list[float]]:
    """Time ``fn`` and the copy bandwidth in alternating rounds; the floor ratio per round.

    On a shared machine the load drifts within seconds, and a kernel timed
    under one load against a bandwidth measured under another gives a ratio
    that says more about the drift than about the kernel. Each round times
    ``fn`` (``budget_s / rounds``) and then measures the copy bandwidth
    (:func:`measure_copy_bandwidth`, 3 copies), so each round's ratio compares
    the two under nearly the same load.

    Returns:
      ``(median over the rounds of each round's median seconds per call,
      calls timed, median copy bandwidth in bytes/s, [kernel time / floor
      time, one per round])``; the row's
      ``kernel/floor`` is the median of the per-round ratios.
    """
    times: list[float] = []
    calls = 0
    bandwidths: list[float] = []
    ratios: list[float] = []
    for r in range(rounds):
        t, n = time_call(
            fn,
            budget_s=budget_s / rounds,
            min_reps=max(2, 5 // rounds),
            max_reps=max(1, max_reps // rounds),
            warmup=2 if r == 0 else 1,
        )
        times.append(t)
        calls += n
        bw = measure_copy_bandwidth(reps=3)
        bandwidths.append(bw)
        ratios.append(t / (floor_bytes / bw))
    return statistics.median(times), calls, statistics.median(bandwidths), ratios


def measure_read_bandwidth(*, nbytes: int = 128 * 2**20, reps: int = 5) -> float:
    """Read-only bandwidth in bytes per second of a jitted ``jnp.sum`` (for reference)."""
    x = jnp.ones(nbytes // 4, jnp.float32)
    t, _ = time_call(lambda: jnp.sum(x), budget_s=0.0, min_reps=reps, max_reps=reps)
    return nbytes / t


# --------------------------------------------------------------------------- inputs


def make_inputs(batch: int, num_draft: int, vocab: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """float32 inputs on the default device, cheap to build at the largest sizes.

    p is a peaked random distribution (uniform**4, normalised), q a perturbation
    of it (p times uniform noise in [0.5, 1.5), normalised), draft tokens are
    uniform: about half the tests pass, so ``n`` varies across rows. The
    kernel's work does not depend on the values (it reads rows ``n`` of p and q
    whatever ``n`` is).
    """
    keys = jax.random.split(jax.random.key(seed), 5)

    @jax.jit
    def build(keys: jax.Array) -> tuple[jax.Array, ...]:
        target = jax.random.uniform(keys[0], (batch, num_draft + 1, vocab), jnp.float32) ** 4
        target = target / jnp.sum(target, axis=-1, keepdims=True)
        noise = jax.random.uniform(keys[1], (batch, num_draft, vocab), jnp.float32, 0.5, 1.5)
        draft = target[:, :num_draft] * noise
        draft = draft / jnp.sum(draft, axis=-1, keepdims=True)
        tokens = jax.random.randint(keys[2], (batch, num_draft), 0, vocab, jnp.int32)
        u = jax.random.uniform(keys[3], (batch, num_draft), jnp.float32)
        s = jax.random.uniform(keys[4], (batch,), jnp.float32)
        return tokens, draft, target, u, s

    return jax.block_until_ready(build(keys))


# --------------------------------------------------------------------------- sections


def _budget(batch: int, num_draft: int, vocab: int, quick: bool) -> float:
    """Seconds of timing per method: less for the largest inputs."""
    size = batch * (2 * num_draft + 1) * vocab * 4
    if quick:
        return 0.3
    if size > 1e9:
        return 0.8
    if size > 2e8:
        return 1.0
    return 1.5


def bench_probs_kernel(
    batches: Sequence[int],
    drafts: Sequence[int],
    vocabs: Sequence[int],
    *,
    quick: bool = False,
    max_straightforward_bytes: float = 4e9,
    impl: str = "xla",
) -> list[Row]:
    """The acceptance kernel (probabilities in) vs the straightforward version and the floor.

    ``impl``: the kernel's static ``impl`` (``"xla"``, or ``"cpu"`` for the C++ CPU kernels).
    """
    rows: list[Row] = []
    for vocab in vocabs:
        for num_draft in drafts:
            for batch in batches:
                args = make_inputs(batch, num_draft, vocab)
                budget = _budget(batch, num_draft, vocab, quick)
                max_reps = 50 if quick else 200
                floor_bytes = batch * 2 * vocab * 4
                t_kernel, n_kernel, copy_bytes_per_s, floor_ratios = time_against_floor(
                    lambda a=args: _rejection_sample_jit(*a, impl=impl),
                    floor_bytes,
                    budget_s=budget,
                    max_reps=max_reps,
                    rounds=2 if quick else FLOOR_ROUNDS,
                )
                t_floor = floor_bytes / copy_bytes_per_s

                shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
                sf_temp = _straightforward_jit.lower(*shapes).compile().memory_analysis().temp_size_in_bytes
                compiled = _rejection_sample_jit.lower(*shapes, impl=impl).compile()
                kernel_temp = compiled.memory_analysis().temp_size_in_bytes
                if sf_temp > max_straightforward_bytes:
                    t_sf, n_sf = None, 0
                    sf_note = f"skipped: needs {sf_temp / 1e9:.1f} GB of (B, G, V) temporaries"
                else:
                    t_sf, n_sf = time_call(
                        lambda a=args: straightforward_rejection_sample(*a),
                        budget_s=budget,
                        max_reps=max_reps,
                    )
                    sf_note = ""
                common = {"kernel": "probs", "B": batch, "G": num_draft, "V": vocab}
                rows.append(
                    Row(
                        method="kernel",
                        median_us=t_kernel * 1e6,
                        reps=n_kernel,
                        ratio=(t_kernel / t_sf) if t_sf else None,
                        ratio_to="straightforward" if t_sf else None,
                        extra={
                            "ratio_to_floor": statistics.median(floor_ratios),
                            "ratio_to_floor_rounds": floor_ratios,
                            "temp_bytes": kernel_temp,
                            "impl": impl,
                            "load_avg_1min": os.getloadavg()[0],
                        },
                        **common,
                    )
                )
                rows.append(
                    Row(
                        method="straightforward",
                        median_us=None if t_sf is None else t_sf * 1e6,
                        reps=n_sf,
                        note=sf_note,
                        extra={"temp_bytes": sf_temp},
                        **common,
                    )
                )
                rows.append(
                    Row(
                        method="floor",
                        median_us=t_floor * 1e6,
                        note="B*2*V*4 bytes / copy bandwidth",
                        extra={"bytes": floor_bytes, "copy_bytes_per_s": copy_bytes_per_s},
                        **common,
                    )
                )
                if batch == 1:
                    # The public entry point with validate=False: conversion and
                    # shape checks in Python, then the same jitted kernel.
                    t_pub, n_pub = time_call(
                        lambda a=args: rejection_sample(*a, validate=False),
                        budget_s=budget,
                        max_reps=max_reps,
                    )
                    rows.append(
                        Row(
                            method="public_validate_false",
                            median_us=t_pub * 1e6,
                            reps=n_pub,
                            ratio=t_pub / t_kernel,
                            ratio_to="kernel",
                            **common,
                        )
                    )
                del args
                print(_format_row(rows, batch, num_draft, vocab), flush=True)
    return rows


# --------------------------------------------------------------------------- output


HEADER = (
    f"{'B':>4} {'G':>2} {'V':>7} {'kernel_us':>10} {'straightforward_us':>18} "
    f"{'kernel/sf':>9} {'floor_us':>9} {'kernel/floor':>12} {'kernel_temp_MB':>14}"
)


def _find(rows: list[Row], method: str, batch: int, num_draft: int, vocab: int) -> Row | None:
    for r in rows:
        if (r.method, r.B, r.G, r.V) == (method, batch, num_draft, vocab):
            return r
    return None


def _format_row(rows: list[Row], batch: int, num_draft: int, vocab: int) -> str:
    k = _find(rows, "kernel", batch, num_draft, vocab)
    s = _find(rows, "straightforward", batch, num_draft, vocab)
    f = _find(rows, "floor", batch, num_draft, vocab)
    assert k is not None and s is not None and f is not None
    sf = f"{s.median_us:18.1f}" if s.median_us is not None else f"{'skipped':>18}"
    ratio = f"{k.ratio:9.3f}" if k.ratio is not None else f"{'-':>9}"
    line = (
        f"{batch:>4} {num_draft:>2} {vocab:>7} {k.median_us:10.1f} {sf} {ratio} "
        f"{f.median_us:9.1f} {k.extra['ratio_to_floor']:12.2f} {k.extra['temp_bytes'] / 1e6:14.1f}"
    )
    p = _find(rows, "public_validate_false", batch, num_draft, vocab)
    if p is not None:
        line += f"   (public rejection_sample(validate=False): {p.median_us:.1f} us = {p.ratio:.2f}x kernel)"
    return line


def check_targets(rows: list[Row]) -> list[str]:
    """Lines saying whether the speed targets are met."""
    out = []
    k = _find(rows, "kernel", 64, 4, 32000)
    if k is not None and k.ratio is not None:
        ok = k.ratio <= 0.25
        out.append(
            f"target kernel <= 0.25x straightforward at B=64 G=4 V=32000: "
            f"{k.ratio:.3f}x -> {'met' if ok else 'NOT met'}"
        )
    worst = None
    for r in rows:
        if r.method == "kernel" and r.B >= 8:
            rf = r.extra["ratio_to_floor"]
            if worst is None or rf > worst[0]:
                worst = (rf, r)
    if worst is not None:
        rf, r = worst
        bad = [
            f"B={x.B} G={x.G} V={x.V}: {x.extra['ratio_to_floor']:.2f}x"
            for x in rows
            if x.method == "kernel" and x.B >= 8 and x.extra["ratio_to_floor"] > 3
        ]
        out.append(
            f"target kernel within 3x of the memory floor for B >= 8: worst {rf:.2f}x "
            f"(B={r.B} G={r.G} V={r.V}) -> {'met' if not bad else 'NOT met: ' + '; '.join(bad)}"
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run: few sizes, few repetitions")
    parser.add_argument("--jsonl", metavar="PATH", help="append result rows as JSON lines to PATH")
    parser.add_argument(
        "--max-straightforward-gb",
        type=float,
        default=4.0,
        help="skip the straightforward version above this many GB of temporaries",
    )
    parser.add_argument(
        "--logits",
        action="store_true",
        help="then run the logits front end against transformers' _speculative_sampling "
        "(benchmarks/bench_logits.py, with the same --quick and --jsonl)",
    )
    jax_threads.add_argument(parser)
    args = parser.parse_args(argv)
    pool = jax_threads.apply(args)

    batches, drafts, vocabs = (
        (QUICK_BATCHES, QUICK_DRAFTS, QUICK_VOCABS) if args.quick else (FULL_BATCHES, FULL_DRAFTS, FULL_VOCABS)
    )
    start = time.perf_counter()
    # What impl="auto" (the public functions' default) runs here: the C++ CPU
    # kernels on a CPU with a compiler, else the JAX code.
    impl = cpu_kernels.resolve("auto")
    print(f"# load average at start: {os.getloadavg()[0]:.2f} (1 min); kernel impl={impl!r} (what 'auto' picks here)")
    print(
        f"# jax {jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
        f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}; float32 inputs; {pool}"
    )
    copy_bw, read_bw = measure_copy_bandwidth(), measure_read_bandwidth()
    print(
        f"# memory bandwidth at start: np.copyto of 128 MiB into a preallocated buffer, read + write "
        f"counted: {copy_bw / 1e9:.2f} GB/s; read-only (jitted jnp.sum): {read_bw / 1e9:.2f} GB/s"
    )
    print(
        f"# floor = B*2*V*4 bytes (rows p_n and q_n) / copy bandwidth; kernel and bandwidth are timed in "
        f"{2 if args.quick else FLOOR_ROUNDS} alternating rounds per row and kernel/floor is the median of the "
        "rounds' ratios"
    )
    print()
    print("## Acceptance kernel (probabilities in)")
    print(HEADER)
    rows = bench_probs_kernel(
        batches,
        drafts,
        vocabs,
        quick=args.quick,
        max_straightforward_bytes=args.max_straightforward_gb * 1e9,
        impl=impl,
    )
    for r in rows:
        if r.method == "straightforward" and r.note:
            print(f"# B={r.B} G={r.G} V={r.V}: straightforward {r.note}")
    for line in check_targets(rows):
        print("# " + line)
    print(f"# total {time.perf_counter() - start:.0f} s")

    if args.jsonl:
        append_jsonl(args.jsonl, (flat_record(r) for r in rows))
    if args.logits:
        import bench_logits  # lazy: torch and transformers are needed only here

        print()
        print("## Acceptance from logits (front end)")
        return bench_logits.run(quick=args.quick, jsonl=args.jsonl, pool=pool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
