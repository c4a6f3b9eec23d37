"""Soak test: many random speculative generations for a given time (not run in CI).

Runs ``speculative_generate`` over and over, with random prompts (batch sizes, left
padding, lengths), ``max_new_tokens``, draft lengths, samplers (``jax``, ``numpy``,
``torch``) and sampling parameters (greedy, temperature, top-k, top-p, seeds), on one of
two workloads (``--pair``):

* ``tiny`` (default): a tiny Llama pair built from configs (offline);
* ``default``: the default pair's target (SmolLM2-135M-Instruct, as ``specjax generate``
  loads it) with the ``ngram`` drafter, greedy, prompts of 2-160 tokens that repeat themselves
  (so the drafter finds matches and steps vary in width), batches of 1 to ``--max-batch``
  rows, the largest request first: a long-lived process serving varied requests. Its linear layers run through oneDNN as
  ``SPECJAX_PACKED_LINEARS`` says (:mod:`specjax.packed`), whose per-shape primitives
  made RSS grow with every new prompt length before their rows were bucketed;

and reports:

* **errors**: calls that raised, or whose output breaks the contract (shape, prompt kept,
  ``1 <= new <= max_new_tokens``, ids in [0, V)); must be 0;
* **RSS over time**: the process's current and peak resident set size at each report.
  After the warm-up, the peak may rise only with new compilations (each compiled program
  stays in JAX's cache); over the calls that compiled nothing it must stay flat (growth
  within ``--rss-tolerance-mb``): memory must not grow per call;
* **recompilations after warm-up**: JAX compilations (from ``jax.monitoring``, see
  :mod:`specjax.generate.compile_time`) during *replays*, exact repeats of calls made
  during the warm-up (same inputs, parameters and seed, so the same shapes); must be 0.
  Compilations during new random calls after the warm-up are reported apart (new shapes
  may still appear there: rare batch-size and draft-length combinations).

Usage::

    python benchmarks/soak.py --seconds 300            # 5 minutes; exit status 1 if a check fails
    python benchmarks/soak.py --seconds 60 --json out.json
    python benchmarks/soak.py --pair default --seconds 240 --report-every 20

Absolute speeds on a shared CPU are noise here; the checks are counts.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import random
import resource
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Call:
    """One generation's inputs (enough to replay it exactly)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    kwargs: dict[str, Any]

    def describe(self) -> str:
        k = {n: v for n, v in self.kwargs.items() if n not in ("target", "draft")}
        return f"B={self.input_ids.shape[0]} P={self.input_ids.shape[1]} {k}"


@dataclass
class Report:
    calls: int = 0
    replays: int = 0
    new_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    warmup_compiles: int = 0
    replay_compiles: int = 0
    new_call_compiles: int = 0
    compiled_functions_after_warmup: Counter = field(default_factory=Counter)
    peak_growth_without_compiles_mb: float = 0.0  # after the warm-up, over calls that compiled nothing
    peak_growth_with_compiles_mb: float = 0.0  # after the warm-up, over calls that compiled new shapes
    calls_without_compiles: int = 0
    packing: str = ""
    rss_timeline: list[dict[str, float]] = field(default_factory=list)


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB."""
    with open("/proc/self/statm") as fh:
        current = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return current, peak


def tiny_pair(vocab: int, hidden: int) -> tuple[Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(layers: int, seed: int) -> Any:
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        )
        model = LlamaForCausalLM(cfg).eval()
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        return model

    target = make(2, 0)
    draft = make(1, 1)
    with torch.no_grad():  # a draft that agrees with the target often: rows accept different numbers of tokens
        for pt, pd in zip(target.parameters(), draft.parameters(), strict=False):
            if pt.shape == pd.shape:
                pd.copy_(pt + 0.05 * pt.std() * torch.randn_like(pt))
    return target, draft


def left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """i64[B, P] ids (0 as padding) and their attention mask, for rows of token ids."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = torch.tensor(row)
        mask[b, width - len(row) :] = 1
    return ids, mask


def random_call(
    rng: random.Random, vocab: int, max_batch: int, sampler_names: list[str], extra: dict[str, Any]
) -> Call:
    b = rng.choice([n for n in (1, 2, 4, 8) if n <= max_batch] or [1])  # few batch sizes: the warm-up can see them
    lengths = [rng.randint(1, 16) for _ in range(b)]
    ids, mask = left_padded([[rng.randint(1, vocab - 1) for _ in range(n)] for n in lengths])
    mode = rng.choice(["greedy", "temperature", "top_k", "top_p", "both", "per_row"])
    kwargs: dict[str, Any] = dict(
        max_new_tokens=rng.randint(1, 24),
        num_draft_tokens=rng.choice([2, 4]),
        seed=rng.randint(0, 2**31),
        sampler=rng.choice(sampler_names),
        **extra,
    )
    if mode == "greedy":
        kwargs["temperature"] = 0.0
    else:
        kwargs["temperature"] = rng.choice([0.3, 0.7, 1.0, 1.5])
    if mode in ("top_k", "both"):
        kwargs["top_k"] = rng.choice([1, 5, 20, 0])
    if mode in ("top_p", "both"):
        kwargs["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if mode == "per_row":
        kwargs["temperature"] = [rng.choice([0.0, 0.5, 1.0]) for _ in range(b)]
        kwargs["top_k"] = [rng.choice([0, 3, 50]) for _ in range(b)]
    if rng.random() < 0.3:
        kwargs["eos_token_id"] = rng.randint(1, vocab - 1)
    return Call(ids, mask, kwargs)


def default_pair_call(
    rng: random.Random,
    vocab: int,
    max_batch: int,
    sampler_names: list[str],
    extra: dict[str, Any],
    largest: bool = False,
) -> Call:
    """A request to the default pair: 1 to ``max_batch`` rows of 2-160 tokens, each a random
    motif repeated (the n-gram drafter finds matches), greedy, G = 4, 2-8 new tokens: the shapes
    vary with the prompts and batch sizes, as in a server; few programs to compile. ``largest``:
    the most rows and tokens (the run's first call, so that the peak RSS after it moves only with
    memory kept, not with a larger call's transient buffers)."""
    batches = [n for n in range(1, 9) if n <= max_batch] or [1]
    b = batches[-1] if largest else rng.choice(batches)
    rows = []
    for _ in range(b):
        n = 160 if largest else rng.randint(2, 160)
        motif = [rng.randint(100, vocab - 1) for _ in range(rng.randint(1, max(1, n // 3)))]
        rows.append((motif * (n // len(motif) + 1))[:n])
    ids, mask = left_padded(rows)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=8 if largest else rng.randint(2, 8),
        num_draft_tokens=4,
        seed=rng.randint(0, 2**31),
        sampler=rng.choice(sampler_names),
        temperature=0.0,
        **extra,
    )
    return Call(ids, mask, kwargs)


def check_output(call: Call, out: Any, vocab: int) -> str | None:
    ids = call.input_ids
    b, width = ids.shape
    seq, new = out.sequences, out.num_new_tokens
    if seq.shape[0] != b or not torch.equal(seq[:, :width], ids):
        return "the prompts are not kept"
    max_new = call.kwargs["max_new_tokens"]
    if int(new.min()) < 1 or int(new.max()) > max_new:
        return f"num_new_tokens {new.tolist()} outside [1, {max_new}]"
    for r in range(b):
        row = seq[r, width : width + int(new[r])]
        if not bool(((row >= 0) & (row < vocab)).all()):
            return f"row {r}: ids outside [0, {vocab})"
        eos = call.kwargs.get("eos_token_id")
        if int(new[r]) < max_new and (eos is None or int(row[-1]) != eos):
            return f"row {r} ended after {int(new[r])} tokens without EOS"
    return None


def run(args: argparse.Namespace) -> Report:
    import specjax
    from specjax.generate.compile_time import measure_compiles

    report = Report()

    from specjax.packed import packed_layers

    params = inspect.signature(specjax.speculative_generate).parameters
    extra: dict[str, Any] = {"adaptive": False} if "adaptive" in params else {}  # measured costs vary run to run
    if args.pair == "default":
        from specjax.pair import load_target

        target, _ = load_target()
        draft: Any = "ngram"
        vocab = int(target.config.vocab_size)
        make_call = default_pair_call
        eos = target.generation_config.eos_token_id
        extra["eos_token_id"] = eos[0] if isinstance(eos, list) else eos  # one id: check_output reads it
    else:
        target, draft = tiny_pair(args.vocab, args.hidden)
        vocab = args.vocab
        make_call = random_call
    mode, layers = packed_layers(target)
    report.packing = f"{mode} ({len(layers)} layers through oneDNN)"
    rng = random.Random(args.seed)
    samplers = args.samplers.split(",")
    seen: list[Call] = []
    t0 = time.perf_counter()
    next_report = 0.0
    warmup_done = False
    fn_counts: Counter = Counter()

    from jax import monitoring

    def on_event(event: str, duration: float, **kw: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and warmup_done:
            fn_counts[kw.get("fun_name", "?")] += 1

    monitoring.register_event_duration_secs_listener(on_event)
    print(
        f"soak: {args.pair} pair, {args.seconds:.0f} s ({args.warmup:.0f} s warm-up), vocab {vocab}, "
        f"batch <= {args.max_batch}, samplers {samplers}, linear layers: {report.packing}",
        flush=True,
    )
    print(
        f"{'time s':>7} {'calls':>6} {'replays':>7} {'tokens':>7} {'errors':>6} {'rss MiB':>8} {'peak MiB':>8} "
        f"{'compiles':>8} {'replay compiles':>15}",
        flush=True,
    )
    while True:
        elapsed = time.perf_counter() - t0
        if elapsed >= next_report or elapsed >= args.seconds:
            gc.collect()
            cur, peak = rss_mb()
            total = report.warmup_compiles + report.replay_compiles + report.new_call_compiles
            report.rss_timeline.append(
                {
                    "t": round(elapsed, 1),
                    "rss_mb": round(cur, 1),
                    "peak_mb": round(peak, 1),
                    "calls": report.calls,
                    "warmup": not warmup_done,
                }
            )
            print(
                f"{elapsed:7.0f} {report.calls:6d} {report.replays:7d} {report.new_tokens:7d} "
                f"{len(report.errors):6d} {cur:8.1f} {peak:8.1f} {total:8d} {report.replay_compiles:15d}",
                flush=True,
            )
            next_report += args.report_every
        if elapsed >= args.seconds:
            break
        if not warmup_done and elapsed >= args.warmup:
            warmup_done = True
            report.rss_timeline.append(
                {
                    "t": round(elapsed, 1),
                    "rss_mb": round(rss_mb()[0], 1),
                    "peak_mb": round(rss_mb()[1], 1),
                    "calls": report.calls,
                    "warmup": False,
                    "mark": "end of warm-up",
                }
            )
        replay = warmup_done and seen and rng.random() < args.replay_fraction
        if args.pair == "default" and report.calls == 0:
            call = default_pair_call(rng, vocab, args.max_batch, samplers, extra, largest=True)
        else:
            call = rng.choice(seen) if replay else make_call(rng, vocab, args.max_batch, samplers, extra)
        peak_before = rss_mb()[1]
        try:
            with measure_compiles() as clock:
                out = specjax.speculative_generate(target, draft, call.input_ids, call.attention_mask, **call.kwargs)
            problem = check_output(call, out, vocab)
            if problem:
                report.errors.append(f"{call.describe()}: {problem}")
            report.new_tokens += int(out.num_new_tokens.sum())
        except Exception as err:  # every failure of a valid call is an error to report
            report.errors.append(f"{call.describe()}: {type(err).__name__}: {err}")
            if args.verbose:
                traceback.print_exc()
            continue
        finally:
            report.calls += 1
        grown = rss_mb()[1] - peak_before
        if warmup_done and clock.compiles:
            report.peak_growth_with_compiles_mb += grown
        elif warmup_done:
            report.peak_growth_without_compiles_mb += grown
            report.calls_without_compiles += 1
        if not warmup_done:
            report.warmup_compiles += clock.compiles
            seen.append(call)
        elif replay:
            report.replays += 1
            report.replay_compiles += clock.compiles
            if clock.compiles:
                report.errors.append(f"replay recompiled {clock.compiles}x: {call.describe()}")
        else:
            report.new_call_compiles += clock.compiles
    report.compiled_functions_after_warmup = fn_counts
    return report


def summarize(report: Report, args: argparse.Namespace) -> bool:
    after = [p for p in report.rss_timeline if not p.get("warmup")]
    start = next((p for p in report.rss_timeline if p.get("mark")), after[0] if after else None)
    end = report.rss_timeline[-1]
    growth = end["peak_mb"] - start["peak_mb"] if start else 0.0
    flat = report.calls_without_compiles > 0 and report.peak_growth_without_compiles_mb <= args.rss_tolerance_mb
    print()
    print(f"{args.pair} pair, linear layers: {report.packing}")
    print(f"calls {report.calls} ({report.replays} replays of warm-up calls), new tokens {report.new_tokens}")
    print(f"errors: {len(report.errors)} (must be 0)")
    for e in report.errors[:20]:
        print(f"  {e}")
    print(
        f"peak RSS after warm-up: {start['peak_mb'] if start else float('nan'):.1f} MiB -> {end['peak_mb']:.1f} MiB "
        f"(+{growth:.1f} MiB): +{report.peak_growth_with_compiles_mb:.1f} MiB over the calls that compiled new "
        f"shapes, +{report.peak_growth_without_compiles_mb:.1f} MiB over the {report.calls_without_compiles} calls "
        f"that compiled nothing (flat: {'yes' if flat else 'NO'}, tolerance {args.rss_tolerance_mb:.0f} MiB)"
    )
    if start:
        print(
            f"current RSS (after gc): {start['rss_mb']:.1f} MiB at the end of the warm-up, {end['rss_mb']:.1f} MiB "
            f"at the end, {end['calls'] - start['calls']} calls later"
        )
    print(
        f"compilations: {report.warmup_compiles} in the warm-up, {report.replay_compiles} in replays of seen "
        f"shapes (must be 0), {report.new_call_compiles} in new random calls after the warm-up"
    )
    if report.compiled_functions_after_warmup:
        top = ", ".join(f"{n} x{c}" for n, c in report.compiled_functions_after_warmup.most_common(6))
        print(f"  compiled after the warm-up (new shapes): {top}")
    ok = not report.errors and report.replay_compiles == 0 and flat
    print(f"soak: {'PASS' if ok else 'FAIL'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "pair": args.pair,
                    "packing": report.packing,
                    "calls": report.calls,
                    "replays": report.replays,
                    "new_tokens": report.new_tokens,
                    "errors": report.errors,
                    "warmup_compiles": report.warmup_compiles,
                    "replay_compiles": report.replay_compiles,
                    "new_call_compiles": report.new_call_compiles,
                    "rss_timeline": report.rss_timeline,
                    "rss_growth_after_warmup_mb": growth,
                    "peak_growth_without_compiles_mb": report.peak_growth_without_compiles_mb,
                    "peak_growth_with_compiles_mb": report.peak_growth_with_compiles_mb,
                    "pass": ok,
                },
                fh,
                indent=1,
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 300)))
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default: a third of the run)")
    parser.add_argument("--pair", choices=("tiny", "default"), default="tiny", help="the workload (see above)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument(
        "--samplers",
        default=None,
        help="comma-separated, repeated = more often (tiny: jax,jax,numpy,torch; default: jax)",
    )
    parser.add_argument("--replay-fraction", type=float, default=0.5)
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument(
        "--rss-tolerance-mb",
        type=float,
        default=10.0,
        help="allowed peak-RSS growth over post-warm-up calls that compiled nothing",
    )
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of errors")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.seconds / 3
    if args.samplers is None:
        args.samplers = "jax" if args.pair == "default" else "jax,jax,numpy,torch"
    report = run(args)
    return 0 if summarize(report, args) else 1


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    sys.exit(main())
