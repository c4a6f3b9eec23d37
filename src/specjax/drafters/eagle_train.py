"""Training an EAGLE head on the target's own features (used by ``scripts/train_eagle.py`` and the tests).

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
"training-time test" of later EAGLE versions), weighted by ``unroll_weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specjax.drafters.eagle_head import EagleHead

__all__ = [
    "LossWeights",
    "agreement_counts",
    "agreement_hits",
    "cosine_lr",
    "frequent_tokens",
    "head_loss",
    "pack_by_length",
    "target_features",
    "teacher_agreement",
    "train_step",
]


@dataclass(frozen=True)
class LossWeights:
    regression: float = 1.0
    distill: float = 0.1
    unroll: float = 0.0  # weight of the unrolled second pass (0: off)
    noise: float = 0.0  # std of the Gaussian noise on input features, relative to their RMS


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


def frequent_tokens(sequences: list[list[int]], n: int, vocab: int) -> torch.Tensor:
    """i64[n]: the n most frequent ids in ``sequences`` (ties by id), sorted; all ids if n >= vocab."""
    if n >= vocab:
        return torch.arange(vocab, dtype=torch.long)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(torch.as_tensor(s, dtype=torch.long), minlength=vocab)[:vocab]
    order = torch.argsort(-counts * (vocab + 1) + torch.arange(vocab))  # count desc, then id asc
    return order[:n].sort().values


def head_loss(
    head: EagleHead,
    embed: nn.Module,
    lm_head_weight: torch.Tensor,
    z: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    weights: LossWeights = LossWeights(),
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


def pack_by_length(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Batches of sequence indices, similar lengths together, at most ``max_tokens`` padded tokens each.

    Sorted by length (stable), then cut greedily; the caller shuffles the
    batches. A sequence longer than ``max_tokens`` is a batch of its own.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def cosine_lr(peak: float, step: int, progress: float, warmup: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then cosine decay to 0 at
    ``progress`` = 1 (the share of the time budget spent)."""
    return peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_step(head: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float) -> None:
    """One optimizer step on ``loss`` at learning rate ``lr``, gradients clipped to norm 1."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    optimizer.step()
