"""The speculative loop on JAX's default device (a TPU) through torchax: right answers, then timings (issue 55).

Run where JAX's default backend is the accelerator; every section logs as it goes:

1. **Backend**: JAX's platform and devices, torch / torchax / transformers versions.
2. **Logits**: the target's jitted JAX forward (:mod:`specjax.generate.jax_model`)
   against torch's eager forward on the CPU, at JAX's default matmul precision and
   at ``highest``: max |difference| and argmax agreement per position.
3. **Greedy identity**, per matmul precision (``--precisions``): ``speculative_generate`` with the
   model drafter, ``ngram`` and ``hybrid`` (each on both paths) and the eagle head against the target alone on
   the same device (:func:`specjax.generate.jax_loop.greedy_decode`), every row, no EOS on either side;
   and the first rows against torch's ``generate`` on the CPU (how many rows differ). The identity on
   the device must hold at ``highest``; at ``default`` (bf16 passes) differing rows are counted.
4. **Law** at T = 0.7 (tests/torchax_law.py, the same check as
   tests/test_torchax_law.py): N copies of one prompt, three new tokens each, from a
   tiny random pair (V = 8): chi-square of the joint counts against the target's
   exact law computed on the CPU; negative controls (must be rejected): the same
   counts against the draft's law, and one step with the draft's q mis-stated.
5. **Timings**: for each prompt group (``--categories``), B, drafter (``--drafters``) and mode
   (``--temperatures``), the loop against the target alone (:func:`specjax.generate.jax_loop.target_decode`:
   the same forward, one token a step, every step in one program; greedy, or sampled at the same T),
   both warmed up first (compilation excluded), both making exactly ``--max-new`` tokens a row (no EOS):
   tokens/s, the ratio, the acceptance rate, ms per step; median of ``--reps`` runs. Every batch is
   padded to the longest prompt of all groups (one compilation per program for every group). The
   model, ``ngram`` and ``hybrid`` drafters run on both JAX paths side by side (``--paths``): ``device``,
   the device-resident loop (every step in one program, n-gram lookups on the device; their default), and
   ``per-step``, one program per step with the host reading each step and looking up n-grams
   (``jax_loop.per_step_loop``); ``eagle`` runs device-resident only. ``--rows FILE`` appends each row as
   it comes (benchmarks/results_io.py).

6. **Anatomy**: per B, where a step's time goes: the target's forward over 1 and G + 1 positions, one
   draft-model token, the acceptance step alone (greedy, T = 0.7), each repeated in one jitted loop.
7. **Profile** (only when ``--order`` names it): for each ``--profile`` case ``category:drafter:B:T``, one
   loop call and one call of the target alone traced by ``jax.profiler``: device time by program, op and
   op category, the largest ops with their HLO (rows with ``--rows``).

Sections run in ``--order`` (``--skip`` leaves some out).
A JSON summary of every section is the last line printed (and ``--out FILE``).
Exit status 1 if a greedy identity on the device fails, or the law test rejects the
target's law or a negative control passes.

Usage::

    PYTHONPATH=src:tests python3 scripts/tpu_loop.py [--pair default|random|tiny] [--batches 1,8,32] \\
        [--max-new 64] [--draft-tokens 4] [--reps 3] [--threads 8] [--out results.json]

``--threads N`` compiles the timing and anatomy grids' programs (and runs the greedy section's calls) N at a
time before timing: a program of the default pair takes tens of seconds to compile for a TPU.

Dry run on JAX's CPU backend (small and quick)::

    JAX_PLATFORMS=cpu PYTHONPATH=src:tests python3 scripts/tpu_loop.py --pair tiny --batches 1,2 --max-new 16 \\
        --law-rows 2048 --reps 1

``--pair default`` is the embedded SmolLM2-135M-Instruct pair (float32; its shipped
draft model and EAGLE head); ``random`` random Llamas of the issue's check (target 4×512, V =
128256; draft 2×256); ``tiny`` 2×64 / a perturbed copy (V = 256); with ``random`` and ``tiny``
the EAGLE head is an untrained one (``init_weights``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from torchax_models import on_jax, perturbed  # tests/ (PYTHONPATH=src:tests), as the torchax tests use them

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
from results_io import append_jsonl  # benchmarks/: rows as the benchmarks write them

T0 = time.perf_counter()
DEVICE = f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:8.1f}s] {msg}", flush=True)


def random_llama(
    seed: int, layers: int, hidden: int, vocab: int, heads: int = 8, kv: int = 4, init: float = 0.02
) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        initializer_range=init,
    )
    return LlamaForCausalLM(cfg).eval()


def random_head(hidden: int, vocab: int, tokens: int) -> Any:
    """An EAGLE head with init_weights' start (near ``z_t``: the same code path, not a trained head)."""
    from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

    head = EagleHead(EagleConfig(hidden, 4, 2, 2 * hidden, vocab, tokens))
    init_weights(head, 0)
    return head.eval()


def load_pair(kind: str) -> tuple[Any, Any, Any, Any]:
    """``(target, draft, eagle head, tokenizer or None)`` on the CPU."""
    if kind == "default":
        from specjax.pair import DefaultPairError, load_default_pair

        try:
            pair = load_default_pair(dtype="float32")
        except DefaultPairError as err:
            sys.exit(f"--pair default: {err} (or run --pair random: random Llamas of the same code path)")
        return pair.target.eval(), pair.draft.eval(), pair.head, pair.tokenizer
    if kind == "random":
        target = random_llama(0, 4, 512, 128256)
        return target, random_llama(1, 2, 256, 128256, heads=4, kv=2), random_head(512, 128256, 4096), None
    target = random_llama(0, 2, 64, 256, heads=4, kv=2)
    return target, perturbed(target, 0.002), random_head(64, 256, 64), None


def prompts(
    tokenizer: Any, batch: int, vocab: int, seed: int = 0, category: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` left-padded prompts: the project's chat prompts (tokenizer; ``category`` one of
    :func:`specjax.prompts.all_prompts`' groups, else all of them in turn), else random ids of ragged lengths."""
    if tokenizer is not None:
        from specjax.prompts import all_prompts

        groups = all_prompts()
        chosen = [groups[category]] if category is not None else list(groups.values())
        chats = [m for group in chosen for m in group.values()]
        texts = [
            tokenizer.apply_chat_template(chats[i % len(chats)], tokenize=False, add_generation_prompt=True)
            for i in range(batch)
        ]
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:  # a GGUF tokenizer read by some transformers releases has none
            tokenizer.pad_token = tokenizer.eos_token
        # every batch padded to one width (the loop strips the padding: its programs are sized by the batch's
        # longest prompt, so each prompt group compiles its own; the timings' warm-up compiles them all)
        every = [m for group in groups.values() for m in group.values()]
        width = max(
            len(tokenizer(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True))["input_ids"])
            for m in every
        )
        enc = tokenizer(texts, return_tensors="pt", padding="max_length", max_length=width)
        return enc["input_ids"], enc["attention_mask"]
    gen = torch.Generator().manual_seed(seed)
    width = 24
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    mask = torch.ones_like(ids)
    for b in range(batch):
        mask[b, : int(torch.randint(0, width // 2, (1,), generator=gen))] = 0
    return ids.masked_fill(mask == 0, 0), mask


def section_logits(target: Any, target_j: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    import jax.numpy as jnp

    from specjax.generate.jax_model import jax_model

    rows = []
    m = jax_model("target", target_j)
    for b in range(min(2, ids.shape[0])):
        row = ids[b : b + 1, mask[b].bool()]
        with torch.no_grad():
            ref = target(row).logits[0].float().numpy()
        for precision in ("default", "highest"):
            fwd = jax.jit(lambda w, c, t, s: m.forward(w, c, t, s, None))
            tokens, start = jnp.asarray(row.numpy(), jnp.int32), jnp.zeros(1, jnp.int32)
            with jax.default_matmul_precision(precision):
                cache = m.init_cache(1, row.shape[1] + 1)  # in jax_model.cache_dtype's dtype
                logits, _ = fwd(m.weights, cache, tokens, start)
                # the same forward through a cache of the weights' dtype: where cache_dtype narrows the cache
                # (a TPU at the default precision), the same arithmetic, so the same bits
                wide = tuple((k.astype(m.dtype), v.astype(m.dtype)) for k, v in cache)
                wide_logits, _ = fwd(m.weights, wide, tokens, start)
            got = np.asarray(jax.device_get(logits))[0].astype(np.float32)
            wide_gap = float(np.abs(got - np.asarray(jax.device_get(wide_logits))[0].astype(np.float32)).max())
            diff = float(np.abs(got - ref).max())
            agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
            rows.append(
                {
                    "row": b,
                    "precision": precision,
                    "max_abs_diff": diff,
                    "argmax_agreement": agree,
                    "max_abs_logit": float(np.abs(ref).max()),
                    "positions": int(row.shape[1]),
                    "cache_dtype": str(cache[0][0].dtype),
                    "vs_weights_dtype_cache_max_abs_diff": wide_gap,
                }
            )
            log(
                f"logits row {b} ({row.shape[1]} positions) precision={precision}: max|diff| {diff:.3g} "
                f"(|logits| <= {np.abs(ref).max():.3g}), argmax agreement {agree:.3f}; cache "
                f"{cache[0][0].dtype}, against a {m.dtype} cache max|diff| {wide_gap:.3g}"
            )
    return {"rows": rows}


def section_greedy(
    pair: dict[str, Any],
    ids,
    mask,
    max_new: int,
    g: int,
    cpu_rows: int,
    precisions: list[str],
    paths: list[str],
    threads: int = 1,
) -> dict[str, Any]:
    """Per matmul precision: each drafter's greedy output on each of ``paths`` (``device``, ``per-step``)
    against the target alone on the device, and the target alone against torch's ``generate`` on the CPU (the
    first ``cpu_rows`` rows). The identity on the
    device must hold at ``highest`` (float32 passes); at ``default`` (bf16 passes) the rows that differ are
    counted, not failed: a forward over G + 1 positions rounds differently from one over a single position."""
    from specjax.generate import speculative_generate
    from specjax.generate.jax_loop import greedy_decode, per_step_loop

    ok = True
    result: dict[str, Any] = {}
    cpu = []
    with torch.no_grad():
        for b in range(min(cpu_rows, ids.shape[0])):
            row = ids[b : b + 1, mask[b].bool()]
            out = pair["target"].generate(
                row, attention_mask=torch.ones_like(row), max_new_tokens=max_new, do_sample=False
            )
            cpu.append(out[0, row.shape[1] :].numpy())
    runs = [
        (name + suffix, functools.partial(make_drafter, pair, name), per_step)
        for name in ("model", "ngram", "hybrid")
        for suffix, per_step in (("", False), ("-per-step", True))
        if ("per-step" if per_step else "device") in paths
    ]
    if "device" in paths:
        runs.append(("eagle", functools.partial(make_drafter, pair, "eagle"), False))

    def reference(precision: str) -> Any:
        with jax.default_matmul_precision(precision):  # a thread's own setting (JAX's config is per thread)
            return greedy_decode(pair["target_j"], ids, mask, max_new)

    def loop(precision: str, make: Callable[[], Any], per_step: bool) -> Any:
        with jax.default_matmul_precision(precision), per_step_loop() if per_step else contextlib.nullcontext():
            return speculative_generate(
                pair["target_j"], make(), ids, mask, max_new_tokens=max_new, num_draft_tokens=g,
                eos_token_id=[],  # as the reference: every row runs to max_new tokens
            )  # fmt: skip

    for precision in precisions:
        # every run of this precision at once, ``threads`` at a time: their compilations overlap
        with concurrent.futures.ThreadPoolExecutor(max(threads, 1)) as pool:
            ref_f = pool.submit(reference, precision)
            outs = [pool.submit(loop, precision, make, per_step) for _, make, per_step in runs]
            ref = ref_f.result()
        for (name, _, _), fut in zip(runs, outs, strict=True):
            out = fut.result()
            got = out.sequences[:, ids.shape[1] :].numpy()
            same = int((got == ref).all(axis=1).sum())
            if precision == "highest":
                ok &= same == ids.shape[0]
            result[f"{name}_{precision}"] = {
                "rows_identical": same,
                "rows": int(ids.shape[0]),
                "acceptance": out.stats.acceptance_rate,
                "adapter_copies": out.stats.adapter_copies,
            }
            log(
                f"greedy (precision={precision}) {name} drafter vs target-only on the device: "
                f"{same}/{ids.shape[0]} rows identical, acceptance {out.stats.acceptance_rate:.3f}, "
                f"adapter copies {out.stats.adapter_copies}"
            )
        first = [int(np.argmax(ref[b] != cpu[b])) if (ref[b] != cpu[b]).any() else None for b in range(len(cpu))]
        same = sum(f is None for f in first)
        result[f"cpu_{precision}"] = {"rows_identical": same, "rows": len(cpu), "first_difference": first}
        log(
            f"greedy target-only on the device (precision={precision}) vs torch generate on the CPU: "
            f"{same}/{len(cpu)} rows identical; first differing token per row {first}"
        )
    result["ok"] = ok
    return result


def section_law(rows: int) -> dict[str, Any]:
    """The first tokens of N copies of one prompt at T = 0.7 against the target's exact law; negative controls:
    the draft's law, and one step with the draft's q mis-stated (tests/torchax_law.py, shared with
    tests/test_torchax_law.py)."""
    from torchax_law import (
        ALPHA,
        DRAFT_TOKENS,
        LENGTH,
        POWER,
        TEMPERATURE,
        VOCAB,
        chi_square_p,
        exact_law,
        law_pair,
        misstated_first_tokens,
        sample_law,
    )

    target, draft = law_pair()
    target_j, draft_j = on_jax(target), on_jax(draft)
    counts, stats = sample_law(target_j, draft_j, rows, LENGTH, DRAFT_TOKENS)
    p_target = chi_square_p(counts, exact_law(target, LENGTH))
    p_draft = chi_square_p(counts, exact_law(draft, LENGTH))
    first = exact_law(target, 1)
    p_misstated = chi_square_p(misstated_first_tokens(target_j, draft_j, rows, drawn_at=1.0), first)
    ok = p_target > ALPHA and p_draft < POWER and p_misstated < POWER
    log(
        f"law at T={TEMPERATURE}, {rows} rows, {LENGTH} tokens (V = {VOCAB}): chi-square vs the target's law "
        f"p = {p_target:.3g}; negative controls: the draft's law p = {p_draft:.3g}, the draft's q mis-stated "
        f"p = {p_misstated:.3g}; acceptance {stats.acceptance_rate:.3f} -> {'ok' if ok else 'FAILED'}"
    )
    return {
        "rows": rows,
        "tokens": LENGTH,
        "p_target": p_target,
        "p_draft": p_draft,
        "p_misstated_q": p_misstated,
        "acceptance": stats.acceptance_rate,
        "ok": ok,
    }


def _anatomy_pieces(t: Any, d: Any, batch: int, g: int, vocab: int, iters: int) -> dict[str, Any]:
    """The pieces :func:`section_anatomy` times at batch size ``batch``: name -> a blocking call running the
    piece ``iters`` times in one jitted ``fori_loop``."""
    import jax.numpy as jnp

    from specjax.kernels import steps
    from specjax.kernels.types import SamplingParams

    start = jnp.full(batch, 8, jnp.int32)

    def forward_loop(model: Any, width: int) -> Any:
        @jax.jit
        def run(weights: Any, cache: Any) -> jax.Array:
            def body(i: Any, carry: Any) -> Any:  # the next tokens depend on the last logits: no hoisting
                cache, acc = carry
                tokens = jnp.full((batch, width), 1, jnp.int32) + (acc % 7)[:, None]
                logits, cache = model.forward(weights, cache, tokens, start, 1)
                return cache, acc + jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

            return jax.lax.fori_loop(0, iters, body, (cache, jnp.zeros(batch, jnp.int32)))[1]

        return lambda: run(model.weights, model.init_cache(batch, 64)).block_until_ready()

    key = jax.random.key(0)
    tl = jax.random.normal(key, (batch, g + 1, vocab), jnp.float32)
    dl = tuple(jax.random.normal(jax.random.fold_in(key, i), (batch, vocab), jnp.float32) for i in range(g))
    x = jax.random.randint(key, (batch, g), 0, vocab, jnp.int32)
    row_keys = jax.random.split(key, batch)
    k = jnp.full(batch, g, jnp.int32)

    def verify_loop(temperature: float) -> Any:
        params = SamplingParams(jnp.full(batch, temperature, jnp.float32))

        @jax.jit
        def run(tl: jax.Array, dl: Any) -> jax.Array:
            def body(i: Any, carry: Any) -> Any:
                # a fresh step (keys) each iteration, its logits depending on the last result (one element
                # rewritten in place), so that no part of the step is hoisted out of the loop
                tl, acc = carry
                tl = tl.at[:, 0, 0].add((acc * 0).astype(tl.dtype))
                return tl, acc + steps.verify_step(x, dl, tl, row_keys, i, params, k).num_accepted

            return jax.lax.fori_loop(0, iters, body, (tl, jnp.zeros(batch, jnp.int32)))[1]

        return lambda: run(tl, dl).block_until_ready()

    return {
        "target forward, 1 position": forward_loop(t, 1),
        f"target forward, {g + 1} positions": forward_loop(t, g + 1),
        "draft forward, 1 position": forward_loop(d, 1),
        "acceptance step, greedy": verify_loop(0.0),
        "acceptance step, T = 0.7": verify_loop(0.7),
    }


def section_anatomy(pair: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Where a step's time goes, per B: each piece repeated 32 times inside one jitted ``fori_loop``
    (dispatch amortised; compilation excluded), ms per iteration: the target's forward over 1 and over G + 1
    positions, the draft model's forward over 1 position (each with an argmax), and the acceptance step
    alone (:func:`specjax.kernels.steps.verify_step` on the target's G + 1 rows and G draft rows of random
    logits, greedy and T = 0.7)."""
    from specjax.generate.jax_model import jax_model

    iters, g = 32, args.draft_tokens
    t, d = jax_model("target", pair["target_j"]), jax_model("draft", pair["draft_j"])
    vocab = int(pair["target"].config.vocab_size)
    rows = []
    pieces = {batch: _anatomy_pieces(t, d, batch, g, vocab, iters) for batch in args.batches}
    if args.threads > 1:
        prewarm([(f"{name} B={b}", fn) for b, by in pieces.items() for name, fn in by.items()], args.threads)
    for batch in args.batches:
        for name, fn in pieces[batch].items():
            fn()  # compile (or, after the warm-up, a first run)
            ms = 1e3 * _median_time(fn, args.reps) / iters
            row = {"section": "anatomy", "pair": args.pair, "device": DEVICE, "batch": batch, "G": g, "piece": name,
                   "ms": ms}  # fmt: skip
            rows.append(row)
            if args.rows:
                append_jsonl(args.rows, [row])
            log(f"anatomy B={batch:3d}: {name:32s} {ms:7.3f} ms")
    return rows


def make_drafter(pair: dict[str, Any], name: str) -> Any:
    """The drafter ``name`` of the timed grid (model, ngram, eagle, hybrid) for ``pair``."""
    from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter
    from specjax.drafters.eagle import EagleDrafter

    if name == "model":
        return pair["draft_j"]
    if name == "ngram":
        return NgramDrafter()
    if name == "eagle":
        return EagleDrafter(pair["head"])
    return HybridDrafter(NgramDrafter(), ModelDrafter(pair["draft_j"]))


def loop_call(
    pair: dict[str, Any], args: argparse.Namespace, name: str, path: str, temp: float, ids: Any, mask: Any
) -> Any:
    """One timed loop call: ``speculative_generate`` with drafter ``name`` on ``path`` (device, per-step),
    ``--max-new`` tokens a row and no EOS (as the reference: both sides make B · max_new tokens)."""
    from specjax.generate import speculative_generate
    from specjax.generate.jax_loop import draft_cost_ratio, per_step_loop

    fixed = args.draft_cost_ratio
    with (
        per_step_loop() if path == "per-step" else contextlib.nullcontext(),
        draft_cost_ratio(fixed) if fixed is not None else contextlib.nullcontext(),
    ):
        out = speculative_generate(
            pair["target_j"], make_drafter(pair, name), ids, mask, max_new_tokens=args.max_new,
            num_draft_tokens=args.draft_tokens, temperature=temp, seed=1, eos_token_id=[],
            adaptive=args.adaptive == "on",
        )  # fmt: skip
    if out.num_new_tokens.sum() != ids.shape[0] * args.max_new:
        raise SystemExit(f"{name}: {out.num_new_tokens.tolist()} new tokens, expected {args.max_new} a row")
    return out


def target_call(pair: dict[str, Any], args: argparse.Namespace, temp: float, ids: Any, mask: Any) -> Any:
    """One call of the reference: the target alone on the device, ``--max-new`` tokens a row."""
    from specjax.generate.jax_loop import target_decode

    return target_decode(pair["target_j"], ids, mask, args.max_new, temperature=temp, seed=1)


def _profile_summary(trace_dir: str, top: int) -> dict[str, Any]:
    """Device time by program and op in the trace under ``trace_dir`` (``jax.profiler.trace``'s xplane).

    On an accelerator: every line of its device planes (XLA Modules, XLA Ops, ...), events summed by name, the
    ``top`` largest with their count and their first event's ``hlo_category`` / ``long_name`` stats. On a CPU:
    the host's events that carry an ``hlo_op`` stat, by module and op.
    """
    import glob
    from collections import defaultdict

    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        return {"error": f"no xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(files[0])
    lines: dict[str, Any] = {}
    for plane in data.planes:
        device = any(tag in plane.name for tag in ("TPU", "GPU"))
        for line in plane.lines:
            total: dict[str, list[Any]] = defaultdict(lambda: [0.0, 0, None])
            for ev in line.events:
                stats = dict(ev.stats)
                if not device and "hlo_op" not in stats:
                    continue
                name = ev.name if device else f"{stats.get('hlo_module')}/{stats['hlo_op']}"
                entry = total[name]
                entry[0] += ev.duration_ns / 1e3
                entry[1] += 1
                if entry[2] is None:
                    entry[2] = {k: str(stats[k])[:240] for k in ("hlo_category", "long_name") if k in stats}
            if not total:
                continue
            by_category: dict[str, float] = defaultdict(float)
            for entry in total.values():
                by_category[(entry[2] or {}).get("hlo_category", "-")] += entry[0]
            ranked = sorted(total.items(), key=lambda kv: -kv[1][0])
            lines[f"{plane.name} | {line.name}"] = {
                "total_us": sum(e[0] for e in total.values()),
                "by_category_us": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
                "top": [{"name": n, "us": e[0], "count": e[1], **(e[2] or {})} for n, e in ranked[:top]],
            }
    return lines


def section_profile(pair: dict[str, Any], tokenizer: Any, vocab: int, args: argparse.Namespace) -> list[dict]:
    """Where a call's device time goes: for each ``--profile`` case ``category:drafter:B:T``, one loop call
    (``speculative_generate`` on the device-resident path, as the timings run it) and one call of the target
    alone, each warmed up first and then traced once (``jax.profiler.trace``); device time by program, op
    and op category (:func:`_profile_summary`), with the call's wall time."""
    import tempfile

    rows = []
    for case in args.profile:
        category, name, batch_s, temp_s = case.split(":")
        batch, temp = int(batch_s), float(temp_s)
        ids, mask = prompts(tokenizer, batch, vocab, seed=batch, category=category if tokenizer else None)

        spec = functools.partial(loop_call, pair, args, name, "device", temp, ids, mask)
        base = functools.partial(target_call, pair, args, temp, ids, mask)
        for kind, fn in (("loop", spec), ("target-only", base)):
            fn(), fn()  # compile, then the schedule's calibration (the loop's second call)
            with tempfile.TemporaryDirectory() as trace_dir:
                t0 = time.perf_counter()
                with jax.profiler.trace(trace_dir):
                    result = fn()
                wall = time.perf_counter() - t0
                summary = _profile_summary(trace_dir, args.profile_top)
            row = {"section": "profile", "pair": args.pair, "device": DEVICE, "category": category,
                   "drafter": name, "batch": batch, "temperature": temp, "call": kind, "wall_s": wall,
                   "steps": result.stats.steps if kind == "loop" else args.max_new,
                   "draft_steps": result.stats.draft_steps if kind == "loop" else 0, "lines": summary}  # fmt: skip
            rows.append(row)
            if args.rows:
                append_jsonl(args.rows, [row])
            log(f"profile {case} {kind}: wall {1e3 * wall:.1f} ms, steps {row['steps']}, drafted {row['draft_steps']}")
            for line_name, line in summary.items():
                if not isinstance(line, dict):
                    continue
                log(f"  {line_name}: {line['total_us']:.0f} us; by category " + ", ".join(
                    f"{c} {us:.0f}" for c, us in list(line["by_category_us"].items())[:8]))  # fmt: skip
                for op in line["top"][: min(12, args.profile_top)]:
                    op_name, op_kind = op["name"][:60], op.get("hlo_category", "")
                    log(f"    {op['us']:9.0f} us  x{op['count']:<5d} {op_name:60s} {op_kind}")
    return rows


def draft_cost_ratios(pair: dict[str, Any], name: str, batch: int) -> list[float]:
    """The device-resident schedule's measured cost of a drafted step in plain steps (``jax_loop._calibrated``,
    once per program) for drafter ``name`` at ``batch`` rows, one per cache shape measured (prompt groups)."""
    from specjax.generate import jax_loop
    from specjax.generate.jax_model import JaxModel, jax_model

    def kind(d: Any, lookup: Any) -> str:
        if d is None:
            return "ngram"
        if not isinstance(d, JaxModel):
            return "eagle"
        return "model" if lookup is None else "hybrid"

    known = jax_loop._RATIOS.get(jax_model("target", pair["target_j"]), {})
    return sorted(r for key, r in known.items() if key[2] == batch and kind(key[0], key[1]) == name)


def _median_time(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def prewarm(thunks: list[tuple[str, Callable[[], Any]]], threads: int) -> None:
    """Run each thunk once, ``threads`` at a time, so that their compilations overlap (XLA compiles with
    the GIL released; a program of the default pair takes tens of seconds to compile for the chip). A thunk
    that fails is logged and left to the timed loop, which compiles what is missing."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = {pool.submit(fn): name for name, fn in thunks}
        for fut in concurrent.futures.as_completed(futures):
            if fut.exception() is not None:
                log(f"warm-up {futures[fut]}: {fut.exception()!r}")
    log(f"warm-up: {len(thunks)} programs run once in {time.perf_counter() - t0:.1f} s, {threads} at a time")


def section_timings(pair: dict[str, Any], tokenizer: Any, vocab: int, args: argparse.Namespace) -> list[dict]:
    run_spec = functools.partial(loop_call, pair, args)
    run_base = functools.partial(target_call, pair, args)
    rows: list[dict[str, Any]] = []
    categories = args.categories if tokenizer is not None else [None]
    # the drafters on both paths side by side: the device-resident loop (their default) and one program
    # per step with the host reading each step (per_step_loop); the eagle head is device-resident only
    cases = [
        (name, path, temp)
        for name in args.drafters
        for temp in args.temperatures
        for path in (("device",) if name == "eagle" else ("device", "per-step"))
        if path in args.paths
    ]
    if args.threads > 1:  # every program compiled up front, its compilations overlapping
        # per prompt group too: the caches are sized by the longest prompt (in blocks of 128 positions), so the
        # grounded prompts' programs are not the open ones'
        warm: list[tuple[str, Callable[[], Any]]] = []
        for category, batch in ((c, b) for c in categories for b in args.batches):
            ids, mask = prompts(tokenizer, batch, vocab, seed=batch, category=category)
            warm += [
                (f"{category} target-only B={batch} T={t}", functools.partial(run_base, t, ids, mask))
                for t in args.temperatures
            ]
            warm += [
                (f"{category} {name} {path} B={batch} T={t}", functools.partial(run_spec, name, path, t, ids, mask))
                for name, path, t in cases
            ]
        prewarm(warm, args.threads)
        # a program whose compilation came from JAX's persistent cache measured its step costs in the warm-up,
        # beside other programs on the device: measured again, alone, by each cell's first call
        from specjax.generate import jax_loop

        jax_loop._RATIOS.clear()
    for category, batch in ((c, b) for c in categories for b in args.batches):
        ids, mask = prompts(tokenizer, batch, vocab, seed=batch, category=category)

        base_s: dict[float, float] = {}
        for temp in args.temperatures:  # the reference: the target alone, greedy or sampled at T
            base = functools.partial(run_base, temp, ids, mask)
            base()  # compile (or, after the warm-up, a first run)
            base_s[temp] = _median_time(base, args.reps)
        for name, path, temp in cases:
            stats: list[Any] = []

            def spec(temp: float = temp, stats: list[Any] = stats, ids=ids, mask=mask, name=name, path=path) -> None:
                stats.append(run_spec(name, path, temp, ids, mask).stats)

            spec()  # compile
            spec_s = _median_time(spec, args.reps)
            new = batch * args.max_new
            row = {
                "section": "loop",
                "pair": args.pair,
                "category": category,
                "device": DEVICE,
                "max_new_tokens": args.max_new,
                "draft_tokens": args.draft_tokens,
                "reps": args.reps,
                "drafter": name,
                "path": path,
                "adaptive": args.adaptive == "on",
                "draft_steps": stats[-1].draft_steps,
                "batch": batch,
                "temperature": temp,
                "loop_tok_s": new / spec_s,
                "target_only_tok_s": new / base_s[temp],
                "ratio": base_s[temp] / spec_s,
                "acceptance": stats[-1].acceptance_rate,
                "mean_accepted_length": stats[-1].mean_accepted_length,
                "steps": stats[-1].steps,
                "ms_per_step": 1e3 * spec_s / max(stats[-1].steps, 1),
                "target_only_ms_per_token": 1e3 * base_s[temp] / args.max_new,
                "adapter_copies": stats[-1].adapter_copies,
                "draft_cost_ratios": (
                    [args.draft_cost_ratio]
                    if args.draft_cost_ratio is not None
                    else draft_cost_ratios(pair, name, batch)
                    if path == "device"
                    else []
                ),
                "draft_cost_ratio_fixed": args.draft_cost_ratio is not None,
                "loop_s": spec_s,
                "target_only_s": base_s[temp],
            }
            rows.append(row)
            if args.rows:
                append_jsonl(args.rows, [row])  # rows land as they come (a run may be cut short)
            log(
                f"{category or '-'} {name:6s} {path:8s} B={batch:3d} T={temp}: loop {row['loop_tok_s']:9.1f} tok/s, "
                f"target-only {row['target_only_tok_s']:9.1f} tok/s, ratio {row['ratio']:.2f}x, "
                f"acceptance {row['acceptance']:.3f}, tau {row['mean_accepted_length']:.2f}, "
                f"{row['ms_per_step']:.2f} ms/step (target-only {row['target_only_ms_per_token']:.2f} ms/token), "
                f"drafted {row['draft_steps']}/{row['steps']} steps at a "
                f"{'fixed' if row['draft_cost_ratio_fixed'] else 'measured'} cost ratio "
                f"{', '.join(f'{r:.2f}' for r in row['draft_cost_ratios']) or '-'}"
            )
        here = [r for r in rows if (r["category"], r["batch"]) == (category, batch)]
        for name, temp in sorted({(r["drafter"], r["temperature"]) for r in here}):
            by_path = {r["path"]: r["ratio"] for r in here if (r["drafter"], r["temperature"]) == (name, temp)}
            if len(by_path) > 1:
                log(
                    f"side by side {category or '-'} {name} B={batch} T={temp}: "
                    + ", ".join(f"{p} {ratio:.2f}x" for p, ratio in by_path.items())
                    + " target-only"
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=("default", "random", "tiny"), default="default")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--drafters",
        type=lambda s: s.split(","),
        default=["model"],
        help="timed drafters, comma-separated: model, ngram, hybrid (ngram, else the model), eagle (the head)",
    )
    parser.add_argument(
        "--categories",
        type=lambda s: s.split(","),
        default=["open", "grounded"],
        help="timed prompt groups of specjax.prompts (the default pair only), comma-separated",
    )
    parser.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    parser.add_argument(
        "--paths",
        type=lambda s: s.split(","),
        default=["device", "per-step"],
        help="the paths of the model, ngram and hybrid drafters (timings and greedy identity): device (resident "
        "loop), per-step",
    )
    parser.add_argument("--rows", default=None, help="append each timing row to this JSONL file as it comes")
    parser.add_argument(
        "--precisions",
        type=lambda s: s.split(","),
        default=["default", "highest"],
        help="JAX matmul precisions of the greedy identity section",
    )
    parser.add_argument("--greedy-batch", type=int, default=None, help="rows of the greedy section (default: max B)")
    parser.add_argument("--law-rows", type=int, default=8192)
    parser.add_argument("--cpu-rows", type=int, default=2, help="rows compared with torch generate on the CPU")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: logits,greedy,law,timings,anatomy"
    )
    parser.add_argument(
        "--order",
        default="logits,greedy,law,timings,anatomy",
        help="the sections' order (comma-separated names; the ones left out follow in the default order)",
    )
    parser.add_argument(
        "--adaptive",
        choices=("on", "off"),
        default="on",
        help="the timed loop's schedule: on (plain or drafted steps, the cost measured once per program: the "
        "call after the warm-up measures it), off (every step drafts)",
    )
    parser.add_argument(
        "--draft-cost-ratio",
        type=float,
        default=None,
        help="with --adaptive on: the schedule's cost of a drafted step in plain steps, fixed (jax_loop."
        "draft_cost_ratio) instead of measured: how the schedule decides at a given cost",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="compile the timings' programs (and run the greedy section's) this many at a time (threads)",
    )
    parser.add_argument(
        "--profile",
        type=lambda s: s.split(","),
        default=["grounded:model:8:0.0"],
        help="the profile section's cases, comma-separated category:drafter:B:T (category ignored without a tokenizer)",
    )
    parser.add_argument("--profile-top", type=int, default=40, help="ops kept per trace line in the profile rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import torchax
    import transformers

    summary: dict[str, Any] = {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "torchax": torchax.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "args": vars(args),
    }
    log(f"backend {summary['backend']} {summary['devices']}; {summary['versions']}")
    ok = True
    target, draft, head, tokenizer = load_pair(args.pair)
    vocab = int(target.config.vocab_size)
    pair = {"target": target, "target_j": on_jax(target), "draft_j": on_jax(draft), "head": head}
    log(
        f"pair {args.pair}: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters, "
        f"draft {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M, V = {vocab}"
    )
    ids, mask = prompts(tokenizer, args.greedy_batch or max(args.batches), vocab)
    sections = {
        "logits": lambda: section_logits(target, pair["target_j"], ids, mask),
        "greedy": lambda: section_greedy(
            pair, ids, mask, args.max_new, args.draft_tokens, args.cpu_rows, args.precisions, args.paths, args.threads
        ),
        "law": lambda: section_law(args.law_rows),
        "timings": lambda: section_timings(pair, tokenizer, vocab, args),
        "anatomy": lambda: section_anatomy(pair, args),
        "profile": lambda: section_profile(pair, tokenizer, vocab, args),
    }
    order = [name for name in args.order.split(",") if name]
    if len(set(order)) != len(order) or not set(order) <= set(sections):
        parser.error(f"--order: expected names among {','.join(sections)}, each at most once, got {args.order!r}")
    # the others after them, in the default order (the profile only when asked for)
    order += [name for name in sections if name not in order and name != "profile"]
    for name in order:
        run = sections[name]
        if name in skip:
            continue
        log(f"--- {name}")
        summary[name] = run()
        if isinstance(summary[name], dict) and summary[name].get("ok") is False:
            ok = False
    summary["ok"] = ok
    line = json.dumps(summary)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")
    print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
