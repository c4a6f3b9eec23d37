"""Fixed costs behind the B = 1 front end and the B = 8 kernel, measured part by part.

Usage::

    python benchmarks/bench_overheads.py            # about 30 s
    python benchmarks/bench_overheads.py --jsonl bench-results/overheads.jsonl

Four tables of medians per call, each method timed warm in blocks of 20
consecutive calls, the blocks rotating over the methods for ``--rounds``
rounds (see :func:`in_blocks`):

1. **Handing a torch tensor to a jitted call** (f32[1, 5, 49152], the B = 1
   target logits at G = 4). The call reads one element. ``DLPack import``
   times ``jax.dlpack.from_dlpack`` alone; ``DLPack import + call`` times both,
   as the loop did before ``specjax.adapters.jit_input``; ``NumPy view + call``
   passes ``tensor.numpy()`` (what ``jit_input`` does on a CPU-only JAX);
   ``prepared JAX array + call`` is the call on an array made beforehand.
2. **One reduction over a vocabulary row** (f32[49152]): a jitted ``jnp.max``,
   the same inside one jitted call that loops over 9 rows (per row), NumPy's
   ``max``, and a jitted no-op call for the fixed cost of a call.
3. **The kernel at B = 8, G = 8, V = 32000, part by part**: the whole jitted
   kernel; the B·G gathers and ``n`` alone; the draw's per-row pass alone (read
   rows ``p_n`` and ``q_n``, write their residual, its 128-wide block sums as a
   GEMV with ones), and the same pass without the block sums, which separates
   the reads and the residual from the sums.
4. **512-bit vectors** (``specjax.kernels.compile_options.VECTOR_OPTIONS``):
   the same jitted functions compiled with XLA's default vector width and with
   ``xla_cpu_prefer_vector_width=512``: a normaliser pass (exp of 5 scaled
   49152-wide rows, block sums as a GEMV, row sums), the front end's step at
   B = 1 and B = 8 (``_verify_jit``, G = 4, V = 49152, T = 1; the inputs of
   ``bench_logits.py``), and the probability kernel at B = 8. Each pair must
   give the same tokens (checked); the normalisers agree to 1e-6 (checked;
   not always to the bit).
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
import jax_threads
import numpy as np
import torch
from bench_kernel import make_inputs
from jax import lax
from results_io import append_jsonl

from specjax.kernels import rejection as R

V_LOGITS = 49152


def in_blocks(fns: dict[str, Callable[[], Any]], rounds: int, per_call: int = 1, block: int = 20) -> dict[str, float]:
    """Median seconds per call (divided by ``per_call``) of each function, timed warm.

    Each round runs every function ``block + 1`` times in a row and keeps the
    last ``block`` timings: each is measured as it runs back to back, while the
    rotation over rounds spreads the shared machine's load changes over all of
    them. (Strict call-by-call alternation would mostly measure waking each
    library's idle threads after the other's call.)
    """
    for fn in fns.values():
        for _ in range(3):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for i in range(block + 1):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                if i:
                    times[name].append((time.perf_counter() - t0) / per_call)
    return {name: statistics.median(ts) for name, ts in times.items()}


def crossing(rounds: int) -> dict[str, float]:
    t = torch.randn(1, 5, V_LOGITS)
    first = jax.jit(lambda a: a[0, 0, :1])
    prepared = jax.dlpack.from_dlpack(t)
    return in_blocks(
        {
            "DLPack import": lambda: jax.dlpack.from_dlpack(t),
            "DLPack import + call": lambda: first(jax.dlpack.from_dlpack(t)),
            "NumPy view + call": lambda: first(t.numpy()),
            "prepared JAX array + call": lambda: first(prepared),
        },
        rounds,
    )


def row_reduction(rounds: int) -> dict[str, float]:
    rows = np.random.default_rng(0).standard_normal((9, V_LOGITS)).astype(np.float32)
    row_j = jnp.asarray(rows[0])
    rows_j = jnp.asarray(rows)
    row_max = jax.jit(jnp.max)
    noop = jax.jit(lambda a: a[:1])

    @jax.jit
    def nine_maxes(a: jax.Array) -> jax.Array:
        def body(i, acc):
            return acc + jnp.max(lax.dynamic_index_in_dim(a, i, 0, keepdims=False))

        return lax.fori_loop(0, a.shape[0], body, jnp.float32(0))

    out = in_blocks(
        {
            "jitted jnp.max of one row": lambda: row_max(row_j),
            "NumPy max of one row": lambda: rows[0].max(),
            "jitted no-op call": lambda: noop(row_j),
        },
        rounds,
    )
    out["jnp.max per row, 9 rows in one jitted call"] = in_blocks(
        {"x": lambda: nine_maxes(rows_j)}, rounds, per_call=9
    )["x"]
    return out


def vector_width(rounds: int) -> dict[str, float]:
    from bench_logits import _ours_args
    from bench_logits import make_inputs as logits_inputs

    from specjax.kernels import frontend as F
    from specjax.kernels.compile_options import VECTOR_OPTIONS

    def both(fn: Callable[..., Any], **jit_kw: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
        return jax.jit(fn, **jit_kw), jax.jit(fn, compiler_options=VECTOR_OPTIONS, **jit_kw)

    rows = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, V_LOGITS)).astype(np.float32))
    scale, top = jnp.float32(0.9), jnp.max(rows, axis=-1)

    def normaliser(x, c, m):
        return R.row_sums(jnp.exp(x * c - m[..., None]))

    cases: dict[str, tuple[tuple[Callable[..., Any], Callable[..., Any]], Callable[[Callable[..., Any]], Any]]] = {
        "normaliser pass, 5 rows of 49152": (both(normaliser), lambda f: f(rows, scale, top)),
    }
    for b in (1, 8):
        args, kw = _ours_args(logits_inputs(b, seed=b), 1.0, None, None)
        cases[f"_verify_jit B={b} G=4 V=49152"] = (
            both(F._verify_jit.__wrapped__),
            lambda f, a=args, k=kw: f(*a, **k),
        )
    kargs = make_inputs(8, 8, 32000)
    cases["probability kernel B=8 G=8 V=32000"] = (both(R._rejection_sample_jit.__wrapped__), lambda f, a=kargs: f(*a))
    fns: dict[str, Callable[[], Any]] = {}
    for name, ((default, wide), call) in cases.items():

        def agree(x: Any, y: Any, close: bool = name.startswith("normaliser")) -> bool:
            x, y = np.asarray(x), np.asarray(y)
            return bool(np.allclose(x, y, rtol=1e-6) if close else np.array_equal(x, y))

        if not all(jax.tree.leaves(jax.tree.map(agree, call(default), call(wide)))):
            raise AssertionError(f"{name}: 512-bit vectors changed the result")
        fns[f"{name}, XLA default"] = lambda c=call, f=default: c(f)
        fns[f"{name}, 512-bit"] = lambda c=call, f=wide: c(f)
    return in_blocks(fns, rounds)


def kernel_parts(rounds: int) -> dict[str, float]:
    b, g, v = 8, 8, 32000
    tokens, draft, target, u, s = make_inputs(b, g, v)
    n = R._rejection_sample_jit(tokens, draft, target, u, s).num_accepted

    @jax.jit
    def gathers(tokens, draft, target, u):
        p_x, q_x = R._gather_draft_probs(target, draft, tokens)
        return R.num_accepted_from_ratios(p_x, q_x, R.below_one(u))

    def rows(draft, target, n, i):
        p = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(target, i, 0, False), n[i], 0, False)
        q = lax.dynamic_index_in_dim(lax.dynamic_index_in_dim(draft, i, 0, False), jnp.minimum(n[i], g - 1), 0, False)
        return p, q

    def per_row(body):
        @jax.jit
        def run(draft, target, n):
            return lax.map(lambda i: body(draft, target, n, i), jnp.arange(b, dtype=jnp.int32))

        return run

    def residual_and_sums(draft, target, n, i):
        p, q = rows(draft, target, n, i)
        return R.block_sums(jnp.maximum(R.to_blocks(p) - R.to_blocks(q), 0))

    def residual_only(draft, target, n, i):
        p, q = rows(draft, target, n, i)
        # The barrier makes XLA write the whole residual row, as the pass does.
        return lax.optimization_barrier(jnp.maximum(p - q, 0))[:1]

    passes = {name: per_row(body) for name, body in (("pass", residual_and_sums), ("residual", residual_only))}
    return in_blocks(
        {
            "whole kernel": lambda: R._rejection_sample_jit(tokens, draft, target, u, s),
            "B*G gathers and n": lambda: gathers(tokens, draft, target, u),
            "per-row pass: residual of rows p_n, q_n and its 128-wide block sums (GEMV)": lambda: passes["pass"](
                draft, target, n
            ),
            "per-row pass without the block sums (residual row only)": lambda: passes["residual"](draft, target, n),
        },
        rounds,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON row per measurement to PATH")
    jax_threads.add_argument(parser)
    args = parser.parse_args(argv)
    pool = jax_threads.apply(args)
    print(
        f"# jax {jax.__version__}, torch {torch.__version__}, {jax.devices()[0]}; medians of "
        f"{args.rounds} rounds of 20-call blocks; {pool}"
    )
    records: list[dict[str, Any]] = []
    for section, fn in (
        ("crossing f32[1, 5, 49152] into a jitted call", crossing),
        ("one reduction over a 49152-wide row", row_reduction),
        ("kernel at B=8 G=8 V=32000, part by part", kernel_parts),
        ("XLA's default vector width against 512-bit vectors", vector_width),
    ):
        print(f"\n## {section}\n\n| what | median |\n|---|---:|")
        for name, sec in fn(args.rounds).items():
            print(f"| {name} | {sec * 1e6:.1f} µs |")
            records.append(
                {"bench": "overheads", "table": section, "what": name, "median_us": sec * 1e6, "jax_pool": pool}
            )
    if args.jsonl:
        append_jsonl(args.jsonl, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
