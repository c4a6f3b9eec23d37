"""Benchmark the vocabulary-sharded kernels against a naive all-gather version on 8 simulated devices.

Usage::

    python benchmarks/bench_sharded.py              # B in {8, 64}, G = 4, V in {32000, 128256}
    python benchmarks/bench_sharded.py --quick      # V = 32000 only, fewer repetitions
    python benchmarks/bench_sharded.py --jsonl bench-results/sharded.jsonl

The script sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` itself
(before JAX starts) and runs on a 1x8 mesh: batch not split, vocabulary split
over 8 "devices" that share this machine's cores.

For each kernel (``probs``: :func:`specjax.rejection_sample`; ``logits``:
:func:`specjax.verify_from_logits`, temperature 1, no top-k/top-p) and size
(B, G, V) the table compares

* ``sharded``: the kernel on V-sharded inputs (what the public functions
  dispatch to), with collectives of per-row scalars only;
* ``naive``: the obvious version: all-gather the (B, G, V) and (B, G+1, V)
  inputs over the vocabulary axis, then run the single-device kernel on every
  device (skipped above ``--max-naive-gb`` of gathered inputs on all devices);
* ``one_device``: the single-device kernel on device 0, for scale.

Bytes moved between devices per call, per device, two ways: from the compiled
HLO (the operand sizes of every all-reduce / all-gather / collective-permute /
all-to-all, times the trip count of the loops around it; see
:func:`specjax.kernels.sharded.hlo_collectives`), and analytically from the
algorithm (formulas in ``tests/_hlo.py``'s :func:`analytic_bytes`). Times are medians of calls
after warm-up with ``block_until_ready``. Eight simulated devices share two
cores here, so absolute times say little; the ratios measured in the same run
are what to read.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    _flag = "--xla_force_host_platform_device_count=8"
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from results_io import append_jsonl, flat_record

from specjax.kernels.frontend import _verify_jit, verify_core
from specjax.kernels.rejection import _rejection_sample_jit
from specjax.kernels.sharded import (
    MeshLayout,
    _rejection_body,
    _rejection_sample_mesh_jit,
    _verify_mesh_jit,
)
from specjax.kernels.types import AcceptanceResult, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test helpers
from _hlo import analytic_bytes, hlo_collectives

FULL_BATCHES = (8, 64)
FULL_DRAFTS = (4,)
FULL_VOCABS = (32000, 128256)
QUICK_BATCHES = (8, 64)
QUICK_DRAFTS = (4,)
QUICK_VOCABS = (32000,)
SHARDS = 8


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
    hlo_bytes: int | None = None  # collective operand bytes per device per call, from the HLO
    analytic_bytes: int | None = None
    collectives: int | None = None  # collective executions per call
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- timing


def time_call(fn: Callable[[], Any], *, budget_s: float, min_reps: int = 3, max_reps: int = 100) -> tuple[float, int]:
    """Median seconds per call of ``fn`` after warm-up (the first call compiles).

    A second warm-up call slower than 1 s counts as the only sample (the naive
    version at the largest sizes takes tens of seconds here).
    """
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    dt = time.perf_counter() - t0
    if dt > 1.0:
        return dt, 1
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


# --------------------------------------------------------------------------- the naive versions


def naive_probs(mesh):
    """All-gather both probability tensors over the vocabulary, then the one-device kernel everywhere."""

    def body(x, q, p, u, s):
        q = lax.all_gather(q, "v", axis=2, tiled=True)
        p = lax.all_gather(p, "v", axis=2, tiled=True)
        return _rejection_body(x, q, p, u, s, vocab_axis=None, per_shard=False)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(None, None), P(None, None, "v"), P(None, None, "v"), P(None, None), P(None)),
            out_specs=AcceptanceResult(P(), P()),
            check_vma=False,
        )
    )


def naive_logits(mesh):
    """All-gather both logits tensors over the vocabulary, then the one-device front end everywhere."""

    def body(x, dl, tl, u, temperature, k):
        dl = lax.all_gather(dl, "v", axis=2, tiled=True)
        tl = lax.all_gather(tl, "v", axis=2, tiled=True)
        g = x.shape[1]
        return verify_core(x, dl, tl, u[:, :g], u[:, g], SamplingParams(temperature), k)

    rep = P()
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(rep, P(None, None, "v"), P(None, None, "v"), rep, rep, rep),
            out_specs=AcceptanceResult(rep, rep),
            check_vma=False,
        )
    )


# --------------------------------------------------------------------------- inputs


def make_inputs(kernel: str, batch: int, g: int, vocab: int, mesh) -> dict[str, tuple]:
    """Arguments for each method: V-sharded on the mesh, and plain on device 0."""
    keys = jax.random.split(jax.random.key(0), 5)
    if kernel == "probs":
        target = jax.random.uniform(keys[0], (batch, g + 1, vocab)) ** 4
        target = target / jnp.sum(target, -1, keepdims=True)
        draft = target[:, :g] * jax.random.uniform(keys[1], (batch, g, vocab), minval=0.5, maxval=1.5)
        draft = draft / jnp.sum(draft, -1, keepdims=True)
        big = (draft, target)
    else:
        target = 3 * jax.random.normal(keys[0], (batch, g + 1, vocab))
        draft = target[:, :g] + jax.random.normal(keys[1], (batch, g, vocab))
        big = (draft, target)
    tokens = jax.random.randint(keys[2], (batch, g), 0, vocab, jnp.int32)
    u = jax.random.uniform(keys[3], (batch, g + 1))
    split = NamedSharding(mesh, P(None, None, "v"))
    rep = NamedSharding(mesh, P())

    def on_mesh(x, sharding):
        return jax.block_until_ready(jax.device_put(x, sharding))

    if kernel == "probs":
        small = (tokens, u[:, :g], u[:, g])
        one = (tokens, *big, *small[1:])
        sharded = (on_mesh(tokens, rep), *(on_mesh(a, split) for a in big), *(on_mesh(a, rep) for a in small[1:]))
        return {"one_device": one, "sharded": sharded, "naive": sharded}
    temperature = jnp.ones((batch,), jnp.float32)
    k = jnp.full((batch,), g, jnp.int32)
    dummy_k, dummy_p = jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), jnp.float32)
    key = jax.random.key(1)
    params = SamplingParams(temperature, dummy_k, dummy_p)  # no top-k / top-p
    one = (tokens, *big, key, params, k)
    sharded = (
        on_mesh(tokens, rep),
        *(on_mesh(a, split) for a in big),
        on_mesh(key, rep),
        jax.tree.map(lambda a: on_mesh(a, rep), params),
        on_mesh(k, rep),
    )
    naive = (
        on_mesh(tokens, rep),
        *(on_mesh(a, split) for a in big),
        on_mesh(u, rep),
        on_mesh(temperature, rep),
        on_mesh(k, rep),
    )
    return {"one_device": one, "sharded": sharded, "naive": naive}


def hlo_bytes(jitted, args: tuple, **static: Any) -> tuple[int, int, int]:
    """(operand bytes, result bytes, executions) of the collectives of the compiled call, per device."""
    found = hlo_collectives(jitted.lower(*args, **static).compile().as_text())
    return (
        sum(c["operand_bytes"] * c["count"] for c in found),
        sum(c["result_bytes"] * c["count"] for c in found),
        sum(c["count"] for c in found),
    )


# --------------------------------------------------------------------------- the benchmark


def bench(kernel: str, batch: int, g: int, vocab: int, mesh, *, budget_s: float, max_naive_bytes: float) -> list[Row]:
    layout = MeshLayout(mesh, None, "v")
    inputs = make_inputs(kernel, batch, g, vocab, mesh)
    if kernel == "probs":
        fns = {
            "one_device": (_rejection_sample_jit, {}),
            "sharded": (_rejection_sample_mesh_jit, {"layout": layout}),
            "naive": (naive_probs(mesh), {}),
        }
    else:
        fns = {
            "one_device": (_verify_jit, {}),
            "sharded": (_verify_mesh_jit, {"layout": layout}),
            "naive": (naive_logits(mesh), {}),
        }
    gathered = SHARDS * 4 * batch * (2 * g + 1) * vocab  # the naive inputs, on all devices together
    rows = []
    for method, (fn, static) in fns.items():
        args = inputs[method]
        common = {"kernel": kernel, "method": method, "B": batch, "G": g, "V": vocab}
        if method == "naive" and gathered > max_naive_bytes:
            row = Row(median_us=None, note=f"not run: would gather {gathered / 1e9:.1f} GB", **common)
        else:
            t, reps = time_call(lambda f=fn, a=args, s=static: f(*a, **s), budget_s=budget_s)
            row = Row(median_us=t * 1e6, reps=reps, **common)
        if method != "one_device":
            row.hlo_bytes, result_bytes, row.collectives = hlo_bytes(fn, args, **static)
            row.analytic_bytes = analytic_bytes(kernel, method, batch, g, vocab, SHARDS)
            row.extra["hlo_result_bytes"] = result_bytes
        rows.append(row)
    return rows


HEADER = (
    "| kernel | B | G | V | sharded bytes (HLO) | analytic | naive bytes (HLO) | analytic | "
    "naive/sharded bytes | sharded µs | naive µs | one device µs | naive/sharded time |"
)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_line(rows: list[Row]) -> str:
    by = {r.method: r for r in rows}
    s, n, o = by["sharded"], by["naive"], by["one_device"]
    byte_ratio = n.hlo_bytes / s.hlo_bytes if n.hlo_bytes and s.hlo_bytes else None
    time_ratio = n.median_us / s.median_us if n.median_us and s.median_us else None
    return (
        f"| {s.kernel} | {s.B} | {s.G} | {s.V} | {_fmt(s.hlo_bytes, ',')} | {_fmt(s.analytic_bytes, ',')} | "
        f"{_fmt(n.hlo_bytes, ',')} | {_fmt(n.analytic_bytes, ',')} | {_fmt(byte_ratio, ',.0f')} | "
        f"{_fmt(s.median_us, '.0f')} | {_fmt(n.median_us, '.0f')} | {_fmt(o.median_us, '.0f')} | "
        f"{_fmt(time_ratio, '.2f')} |"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="V = 32000 only, fewer repetitions")
    parser.add_argument("--jsonl", metavar="PATH", help="append result rows as JSON lines to PATH")
    parser.add_argument(
        "--max-naive-gb",
        type=float,
        default=6.0,
        help="skip the naive version above this many GB of gathered inputs (all devices)",
    )
    args = parser.parse_args(argv)
    if len(jax.devices()) < SHARDS:
        print(
            f"need {SHARDS} devices, got {len(jax.devices())}: run this file as a script "
            "(it sets XLA_FLAGS before JAX starts)",
            file=sys.stderr,
        )
        return 2
    batches, drafts, vocabs = (
        (QUICK_BATCHES, QUICK_DRAFTS, QUICK_VOCABS) if args.quick else (FULL_BATCHES, FULL_DRAFTS, FULL_VOCABS)
    )
    mesh = jax.make_mesh((1, SHARDS), ("b", "v"))
    start = time.perf_counter()
    print(
        f"# jax {jax.__version__}, {len(jax.devices())} simulated {jax.devices()[0].platform} devices on "
        f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); 1x{SHARDS} mesh, "
        "vocabulary split; float32"
    )
    print("# bytes: collective operand bytes per device per call (all-gather: the local slice)")
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    rows: list[Row] = []
    for kernel in ("probs", "logits"):
        for vocab in vocabs:
            for g in drafts:
                for batch in batches:
                    group = bench(
                        kernel,
                        batch,
                        g,
                        vocab,
                        mesh,
                        budget_s=0.5 if args.quick else 2.0,
                        max_naive_bytes=args.max_naive_gb * 1e9,
                    )
                    rows.extend(group)
                    print(table_line(group), flush=True)
    for r in rows:
        if r.note:
            print(f"# {r.kernel} B={r.B} G={r.G} V={r.V} {r.method}: {r.note}")
    print(f"# total {time.perf_counter() - start:.0f} s")
    if args.jsonl:
        append_jsonl(args.jsonl, ({**flat_record(r), "section": "sharded"} for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
