"""Benchmark the acceptance step from logits against transformers' ``_speculative_sampling``.

Usage::

    python benchmarks/bench_logits.py                 # full run (a few minutes on a 2-core CPU)
    python benchmarks/bench_logits.py --quick         # a short run: fewer sizes and repetitions
    python benchmarks/bench_logits.py --jsonl bench-results/logits.jsonl

Every row is the median wall time of one call, after warm-up, on the same
float32 logits (G = 4 draft tokens, V = 49152, SmolLM2's vocabulary), measured
in the same run in interleaved rounds (each round calls every method once, so
load changes on a shared machine hit all of them alike):

* ``specjax _verify_jit``: the jitted front end + kernel
  (``specjax.kernels.frontend._verify_jit``) called directly with prepared
  arguments: what ``verify_from_logits`` runs after its Python boundary. On
  CPU it uses the C++ kernels (``specjax.kernels.cpu_kernels``) when they are
  built;
* ``specjax _verify_jit (JAX code)``: the same step compiled with the C++
  kernels switched off (what GPUs, the mesh path and a machine without a
  compiler run), for comparison;
* ``specjax verify_from_logits(validate=False)``: the public function on the
  very torch tensors the peer gets (they cross to JAX zero-copy: on this
  CPU-only JAX as NumPy views that XLA reads in place, see
  ``specjax.adapters.jit_input``), with shape checks but no value checks (no
  device→host sync);
* ``specjax verify_from_logits(validate=True)``: the same with the value checks
  (one fused check, one device→host sync; B = 1);
* ``transformers _speculative_sampling``: ``transformers.generation.utils.
  _speculative_sampling`` (torch, 2 threads), which softmaxes the draft and
  target logits, tests the draft tokens and draws the correction/bonus token. It
  takes one sequence only (B = 1); for B > 1 the row times a Python loop of B
  calls, for reference;
* the ``top_k=20, top_p=0.9`` rows run temperature 0.7 + top-k + top-p: ours
  inside the jitted function; the peer as transformers' assisted decoding does,
  ``TemperatureLogitsWarper`` / ``TopKLogitsWarper`` / ``TopPLogitsWarper`` on
  the draft and target logits, then ``_speculative_sampling``;
* ``torch 1 thread`` rows repeat the peer with one torch thread: on a busy
  2-core machine two OpenMP threads can be slower than one, and the ratio should
  not rest on that;
* ``(blocks of 20 calls)`` rows (B = 1, plain): the jitted step and the peer
  again, each timed over consecutive calls (the first of each block not
  counted), in alternating blocks. Strict alternation puts a torch call, with
  its own buffers and threads, before each of ours; these rows show each
  function warm. The target verdict uses the alternating rows.

``speed-up`` is the peer's time divided by ours, for the same B and the same
processing. The target is a speed-up of at least 3 at B = 1 (plain logits).
Absolute times on a shared CPU are noise; read the ratios. Rows are appended to
``--jsonl`` as JSON objects, one per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
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
import transformers
from results_io import append_jsonl
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.utils import _speculative_sampling

from specjax import verify_from_logits
from specjax.kernels import cpu_kernels
from specjax.kernels.frontend import _verify_jit
from specjax.kernels.types import SamplingParams

G = 4
V = 49152
PROMPT = 16
TORCH_THREADS = 2
TARGET_SPEEDUP = 3.0
FULL_BATCHES = (1, 8, 64)
QUICK_BATCHES = (1, 8)
TOPK, TOPP, TOPK_T = 20, 0.9, 0.7
ALL_ACCEPTED = "(every draft token accepted)"
KEYS = 64  # keys cycled through per timed function (see _key_cycle)
TOPK_MAX_B = 8  # both sides sort every row (≈ 40 ms a row here): B = 64 would take minutes


# --------------------------------------------------------------------------- timing


def time_interleaved(
    fns: dict[str, tuple[Callable[[], Any], int]],
    *,
    budget_s: float,
    min_rounds: int,
    max_rounds: int = 200,
    warmup: int = 2,
) -> dict[str, tuple[float, int]]:
    """Median seconds per call of each ``fns[name] = (fn, torch_threads)``, measured in rounds.

    Every round calls each function once, so a change in the machine's load
    (a shared CPU) hits ours and the peer alike and the ratios stay fair. JAX
    outputs are waited for; the torch thread count is set outside the timed call.
    """
    for fn, threads in fns.values():
        torch.set_num_threads(threads)
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or time.perf_counter() - start < budget_s):
        for name, (fn, threads) in fns.items():
            torch.set_num_threads(threads)
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: (statistics.median(ts), len(ts)) for name, ts in times.items()}


def time_in_blocks(
    fns: dict[str, tuple[Callable[[], Any], int]], *, block: int = 20, rounds: int = 5
) -> dict[str, tuple[float, int]]:
    """Like :func:`time_interleaved`, but each function runs ``block`` calls in a row per round.

    The first call of each block (right after the other function ran) is not
    counted: this measures each function warm, as it runs back to back,
    while the rounds still spread the machine's load changes over all of them.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, (fn, threads) in fns.items():
            torch.set_num_threads(threads)
            for i in range(block + 1):
                t0 = time.perf_counter()
                jax.block_until_ready(fn())
                if i:
                    times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), len(ts)) for name, ts in times.items()}


# --------------------------------------------------------------------------- inputs


def make_inputs(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 logits with a draft close to the target; x_i ~ softmax(draft_logits_i).

    About half of the tests pass, so ``n`` varies across rows (host NumPy arrays).
    """
    rng = np.random.default_rng(seed)
    target = (2.0 * rng.standard_normal((batch, G + 1, V), dtype=np.float32)).astype(np.float32)
    draft = (target[:, :G] + rng.standard_normal((batch, G, V), dtype=np.float32)).astype(np.float32)
    gumbel = -np.log(-np.log(rng.random((batch, G, V), dtype=np.float32) + 1e-12) + 1e-12)
    tokens = np.argmax(draft + gumbel, axis=-1).astype(np.int32)  # Gumbel-max: x ~ softmax(draft)
    return {"draft_tokens": tokens, "draft_logits": draft, "target_logits": target}


def with_processed_draft_tokens(inp: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``inp`` with each x_i drawn from the draft row processed as the top-k rows ask
    (temperature, top-k, top-p: transformers' warpers), as a draft model sampling with
    those settings would give them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = np.empty_like(inp["draft_tokens"])
    for b in range(tokens.shape[0]):
        probs = torch.softmax(_hf_warp(torch.from_numpy(inp["draft_logits"][b : b + 1]))[0], dim=-1)
        tokens[b] = torch.multinomial(probs, 1, generator=gen)[:, 0].numpy()
    return {**inp, "draft_tokens": tokens}


def _ours_args(
    inp: dict[str, np.ndarray], temperature: float, top_k: int | None, top_p: float | None, impl: str = "auto"
):
    b = inp["draft_tokens"].shape[0]
    args = (
        jnp.asarray(inp["draft_tokens"]),
        jnp.asarray(inp["draft_logits"]),
        jnp.asarray(inp["target_logits"]),
        jax.random.split(jax.random.key(0), b),
        SamplingParams(
            jnp.full((b,), temperature, jnp.float32),
            jnp.full((b,), 0 if top_k is None else top_k, jnp.int32),
            jnp.full((b,), 0.0 if top_p is None else 1.0 - top_p, jnp.float32),
            use_top_k=top_k is not None,
            use_top_p=top_p is not None,
            impl=cpu_kernels.resolve(impl),
        ),
        jnp.full((b,), G, jnp.int32),
    )
    # No static keyword arguments left: the modes are static fields of SamplingParams.
    return jax.block_until_ready(args), {}


def _key_cycle(b: int) -> Callable[[], jax.Array]:
    """A new (B,) key per call, from a cycle of ``KEYS`` (made before timing).

    Where a rejection comes early, ours reads fewer rows; with one fixed key a
    B = 1 timing would rest on one outcome. (The peer draws from torch's global
    generator, which also moves on at every call.)
    """
    keys = itertools.cycle(jax.block_until_ready([jax.random.split(jax.random.key(i), b) for i in range(KEYS)]))
    return lambda: next(keys)


def _with_keys(fn: Callable[..., Any], args: tuple, static: dict[str, bool]) -> Callable[[], Any]:
    """``fn(*args, **static)`` with the key argument (``args[3]``) taken from :func:`_key_cycle`."""
    key = _key_cycle(args[0].shape[0])
    return lambda: fn(*args[:3], key(), *args[4:], **static)


def mean_accepted(args: tuple, static: dict[str, bool]) -> float:
    """The mean of ``num_accepted`` over the key cycle (how far ours reads into the draft)."""
    key = _key_cycle(args[0].shape[0])
    return float(
        np.mean([np.asarray(_verify_jit(*args[:3], key(), *args[4:], **static).num_accepted) for _ in range(KEYS)])
    )


def _hf_inputs(inp: dict[str, np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One (candidate_input_ids (1, PROMPT+G), candidate_logits (1, G, V), new_logits (1, G+1, V)) per row."""
    rows = []
    for b in range(inp["draft_tokens"].shape[0]):
        ids = torch.cat(
            [torch.zeros((1, PROMPT), dtype=torch.long), torch.from_numpy(inp["draft_tokens"][b : b + 1]).long()], dim=1
        )
        rows.append(
            (ids, torch.from_numpy(inp["draft_logits"][b : b + 1]), torch.from_numpy(inp["target_logits"][b : b + 1]))
        )
    return rows


def _hf_warp(logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0.7, top-k 20, top-p 0.9 on every position of a (1, L, V) tensor."""
    flat = logits[0]
    flat = TemperatureLogitsWarper(TOPK_T)(None, flat)
    flat = TopKLogitsWarper(TOPK)(None, flat)
    flat = TopPLogitsWarper(TOPP)(None, flat)
    return flat[None]


def _hf_call(rows, warp: bool) -> Callable[[], Any]:
    def run():
        out = None
        for ids, cand, new in rows:
            if warp:
                cand, new = _hf_warp(cand), _hf_warp(new)
            out = _speculative_sampling(ids, cand, G, new)
        return out

    return run


def _jax_code_step(args: tuple, static: dict[str, bool]) -> Callable[[], Any] | None:
    """``_verify_jit`` with ``impl="xla"`` (the JAX code; None when the C++ CPU kernels are not in use)."""
    params = args[4]
    if params.impl != "cpu":
        return None
    xla = dataclasses.replace(params, impl="xla")
    return _with_keys(_verify_jit, (*args[:4], xla, *args[5:]), static)


# --------------------------------------------------------------------------- the benchmark


def bench_logits(quick: bool) -> list[dict[str, Any]]:
    """Time ours and transformers' on the same logits; one dict per row (see the module doc)."""
    budget = 2.0 if quick else 10.0
    min_rounds = 3 if quick else 7
    batches = QUICK_BATCHES if quick else FULL_BATCHES
    previous_threads = torch.get_num_threads()
    rows: list[dict[str, Any]] = []
    plain, topk = "T=1", f"T={TOPK_T}, top_k={TOPK}, top_p={TOPP}"
    hf_plain, hf_topk = "transformers _speculative_sampling", "transformers warpers + _speculative_sampling"
    ours, public_name = "specjax _verify_jit", "specjax verify_from_logits(validate=False)"

    def add(results, method, peer, b, processing, note="", accepted=None):
        seconds, reps = results[method]
        rows.append(
            {
                "bench": "logits",
                "method": method,
                "peer": peer,
                "B": b,
                "G": G,
                "V": V,
                "processing": processing,
                "median_us": seconds * 1e6,
                "per_row_us": seconds * 1e6 / b,
                "reps": reps,
                "note": note,
                "mean_accepted": accepted,
            }
        )

    def public(tin: dict[str, torch.Tensor], validate: bool) -> Callable[[], Any]:
        key = _key_cycle(tin["draft_tokens"].shape[0])
        return lambda: verify_from_logits(
            tin["draft_tokens"],
            tin["draft_logits"],
            tin["target_logits"],
            key=key(),
            temperature=1.0,
            validate=validate,
        )

    def torch_inputs(inp: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        # Torch tensors as a model returns them (torch's allocator aligns them to 64
        # bytes, so they cross to JAX without a copy; NumPy's arrays need not be
        # aligned, hence the clone).
        return {name: torch.from_numpy(a).clone() for name, a in inp.items()}

    try:
        for b in batches:
            inp = make_inputs(b, seed=b)
            hf_rows = _hf_inputs(inp)
            loop_note = "" if b == 1 else f"loop of {b} calls (the function takes B = 1 only)"
            rounds = min_rounds if b < 64 else 3

            args, static = _ours_args(inp, 1.0, None, None)
            accepted = mean_accepted(args, static)
            tin = torch_inputs(inp)
            fns = {
                ours: (_with_keys(_verify_jit, args, static), TORCH_THREADS),
                public_name: (public(tin, validate=False), TORCH_THREADS),
                hf_plain: (_hf_call(hf_rows, warp=False), TORCH_THREADS),
            }
            if b == 1:
                fns["specjax verify_from_logits(validate=True)"] = (public(tin, validate=True), TORCH_THREADS)
            fns[hf_plain + " (torch 1 thread)"] = (_hf_call(hf_rows, warp=False), 1)
            jax_code = _jax_code_step(args, static)
            if jax_code is not None:
                fns[ours + " (JAX code)"] = (jax_code, TORCH_THREADS)
            res = time_interleaved(fns, budget_s=budget, min_rounds=rounds)
            add(res, ours, hf_plain, b, plain, accepted=accepted)
            if jax_code is not None:
                add(res, ours + " (JAX code)", hf_plain, b, plain, "C++ CPU kernels off", accepted)
            add(res, public_name, hf_plain, b, plain, "torch inputs (zero-copy)", accepted)
            if b == 1:
                add(
                    res,
                    "specjax verify_from_logits(validate=True)",
                    hf_plain,
                    b,
                    plain,
                    "torch inputs; the value checks sync with the host",
                    accepted,
                )
            add(res, hf_plain, None, b, plain, loop_note)
            add(res, hf_plain + " (torch 1 thread)", None, b, plain, loop_note)
            if b == 1:
                # The same two, each warm: blocks of consecutive calls (see time_in_blocks).
                warm = " (blocks of 20 calls)"
                res = time_in_blocks({ours + warm: fns[ours], hf_plain + warm: fns[hf_plain]}, rounds=3 if quick else 7)
                add(res, ours + warm, hf_plain + warm, b, plain, accepted=accepted)
                add(res, hf_plain + warm, None, b, plain, "each warm: the other's calls are not in between")

                # Every draft token accepted (draft logits = target logits): ours reads all
                # 2G + 1 rows, the case where stopping at the first rejection saves nothing.
                same = {**inp, "draft_logits": np.ascontiguousarray(inp["target_logits"][:, :G])}
                args_all, _ = _ours_args(same, 1.0, None, None)
                accepted_all = mean_accepted(args_all, static)
                hf_all = hf_plain + " " + ALL_ACCEPTED
                fns = {
                    ours + " " + ALL_ACCEPTED: (_with_keys(_verify_jit, args_all, static), TORCH_THREADS),
                    public_name + " " + ALL_ACCEPTED: (public(torch_inputs(same), validate=False), TORCH_THREADS),
                    hf_all: (_hf_call(_hf_inputs(same), warp=False), TORCH_THREADS),
                }
                res = time_interleaved(fns, budget_s=budget, min_rounds=rounds)
                add(res, ours + " " + ALL_ACCEPTED, hf_all, b, plain, accepted=accepted_all)
                add(res, public_name + " " + ALL_ACCEPTED, hf_all, b, plain, "torch inputs (zero-copy)", accepted_all)
                add(res, hf_all, None, b, plain)

            if b == 1 or (b <= TOPK_MAX_B and not quick):
                inp = with_processed_draft_tokens(inp, seed=b)
                args, static = _ours_args(inp, TOPK_T, TOPK, TOPP)
                fns = {
                    ours: (_with_keys(_verify_jit, args, static), TORCH_THREADS),
                    hf_topk: (_hf_call(_hf_inputs(inp), warp=True), TORCH_THREADS),
                }
                jax_code = _jax_code_step(args, static)
                if jax_code is not None:
                    fns[ours + " (JAX code)"] = (jax_code, TORCH_THREADS)
                res = time_interleaved(fns, budget_s=budget, min_rounds=3)
                accepted = mean_accepted(args, static)
                add(res, ours, hf_topk, b, topk, accepted=accepted)
                if jax_code is not None:
                    add(res, ours + " (JAX code)", hf_topk, b, topk, "C++ CPU kernels off", accepted)
                add(res, hf_topk, None, b, topk, loop_note)
    finally:
        torch.set_num_threads(previous_threads)
    # Ratios: the peer's time over ours, same B and processing.
    times = {(r["method"], r["B"], r["processing"]): r["median_us"] for r in rows}
    for r in rows:
        peer_us = times.get((r["peer"], r["B"], r["processing"])) if r["peer"] else None
        r["speedup"] = None if peer_us is None else peer_us / r["median_us"]
        one = times.get((f"{r['peer']} (torch 1 thread)", r["B"], r["processing"])) if r["peer"] else None
        r["speedup_1_thread"] = None if one is None else one / r["median_us"]
    return rows


# --------------------------------------------------------------------------- output


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "jax_device": str(jax.devices()[0]),
        "torch_threads": TORCH_THREADS,
        "cpu_kernels": cpu_kernels.available(),
    }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        "| method | processing | B | mean n | median | per row | speed-up vs transformers (2 threads) "
        "| vs transformers (1 thread) | note |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---|"
    )
    lines = [header]
    for r in rows:
        speed = "" if r["speedup"] is None else f"{r['speedup']:.1f}×"
        speed1 = "" if r.get("speedup_1_thread") is None else f"{r['speedup_1_thread']:.1f}×"
        n = "" if r.get("mean_accepted") is None else f"{r['mean_accepted']:.2f}"
        lines.append(
            f"| {r['method']} | {r['processing']} | {r['B']} | {n} | {_fmt_us(r['median_us'])} | "
            f"{_fmt_us(r['per_row_us'])} | {speed} | {speed1} | {r['note']} |"
        )
    return "\n".join(lines)


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def target_verdict(rows: Sequence[dict[str, Any]]) -> tuple[bool, str]:
    """Whether ours (jitted and public, validate=False) is >= 3× faster than transformers at B = 1."""
    at_b1 = {r["method"]: r for r in rows if r["B"] == 1 and r["processing"] == "T=1"}
    kernel = at_b1["specjax _verify_jit"]["speedup"]
    public = at_b1["specjax verify_from_logits(validate=False)"]["speedup"]
    met = kernel >= TARGET_SPEEDUP and public >= TARGET_SPEEDUP
    one_thread = at_b1.get("transformers _speculative_sampling (torch 1 thread)")
    extra = ""
    if one_thread:
        us = one_thread["median_us"]
        extra = (
            f"; against torch with 1 thread: _verify_jit {us / at_b1['specjax _verify_jit']['median_us']:.1f}×, "
            f"verify_from_logits(validate=False) "
            f"{us / at_b1['specjax verify_from_logits(validate=False)']['median_us']:.1f}×"
        )
    every = {r["method"]: r["speedup"] for r in rows if r["B"] == 1 and ALL_ACCEPTED in r["method"]}
    if every:
        extra += (
            "; with every draft token accepted: _verify_jit "
            f"{every['specjax _verify_jit ' + ALL_ACCEPTED]:.1f}×, verify_from_logits(validate=False) "
            f"{every['specjax verify_from_logits(validate=False) ' + ALL_ACCEPTED]:.1f}×"
        )
    return met, (
        f"target (>= {TARGET_SPEEDUP:.0f}× faster than transformers' _speculative_sampling with "
        f"{TORCH_THREADS} torch threads at B = 1): {'met' if met else 'NOT met'}: _verify_jit "
        f"{kernel:.1f}×, verify_from_logits(validate=False) {public:.1f}×{extra}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON object per row to PATH")
    jax_threads.add_argument(parser)
    args = parser.parse_args(argv)
    return run(quick=args.quick, jsonl=args.jsonl, pool=jax_threads.apply(args))


def run(*, quick: bool, jsonl: str | None, pool: str) -> int:
    """Run, print the table and the verdict, append the rows to ``jsonl``; ``pool`` describes XLA's pool."""
    env = environment()
    print(
        f"# specjax logits front end vs transformers, G={G}, V={V}, float32; "
        f"jax {env['jax']}, torch {env['torch']} ({TORCH_THREADS} threads), "
        f"transformers {env['transformers']}, {env['jax_device']}, {env['cpus']} CPUs; {pool}; "
        f"C++ CPU kernels: {'on' if env['cpu_kernels'] else 'off (' + str(cpu_kernels.build_error()) + ')'}"
    )
    rows = bench_logits(quick)
    print(format_table(rows))
    _, verdict = target_verdict(rows)
    print(verdict)
    if jsonl:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        append_jsonl(jsonl, ({**r, "quick": quick, "time": stamp, "env": env, "jax_pool": pool} for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
