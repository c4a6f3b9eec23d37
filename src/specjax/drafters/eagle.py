"""The ``eagle`` drafter: a draft head over the target's own hidden states (EAGLE, arXiv 2401.15077).

Each step the loop hands the drafter the target's final hidden states from the
verification forward it ran anyway (:attr:`CommitInfo.target_hidden`; never a
second target forward). For every committed token the drafter appends one pair
``(z_t, E x_{t+1})`` to its head's cache (:mod:`specjax.drafters.eagle_head`),
slot ``j`` of the verification holding ``z`` of the token before
``emitted[j]``; the head's output at a row's last pair is the predicted feature
of the token just committed, whose scores under the target's LM head give the
first draft token. Drafting token ``i + 1`` runs the head once more on
``(predicted feature, E x_i)``. The drafted pairs are dropped at the next
commit and replaced by the target's real features.

Proposals: when every row is greedy, the argmax of the head's scores as point
masses (no logits, nothing to process); otherwise the head's logits over the
target vocabulary (−inf outside the tokens it scores, below), drawn through
:func:`specjax.kernels.steps.draft_draw` with the target's sampling
parameters, so ``q`` is exactly the distribution each token came from. Each
token comes with the head's probability of it (softmax over the tokens it scores;
sampled: the largest probability at the row's temperature, known before the
draw) as its confidence (``Proposal.confidence``), and
drafting stops for a row once the request's ``worth_drafting`` says another
token does not pay.

Besides the head's N tokens, the drafter scores the tokens of the rows'
contexts (prompt and committed tokens, the union over the batch's rows, until
``context_tokens`` more are scored; none are dropped after): rare words a
prompt brings (a topic's names) are what a fixed frequent set misses most
(docs/drafters.md gives the shipped head's figures).

A head with ``feature_layers`` (EAGLE-3's low/mid/high-layer input, arXiv
2503.01840) asks the loop for those layers' states beside z
(``target_hidden_layers``) and fuses them into the input feature of each
committed pair (:meth:`~specjax.drafters.eagle_head.EagleHead.fuse_features`).

The prompt's pairs come from the loop's prefill forward
(:attr:`DraftSetup.target_hidden`), so the first step drafts too (not for a
prompt of one token: there is no pair before the target scores it).

A commit only keeps its pairs; the head reads them when it next drafts,
all pending commits (and at first the prompt's
pairs) in one forward; when every row is greedy, that forward also scores the
head in hindsight on the tokens the target committed in plain steps (its first
choice just before each), which the proposal reports to the loop's schedule
(``Proposal.hindsight``). Steps where the loop's adaptive length does not draft
(a plain decoding step) then cost the head nothing (a head forward per step
would be about the margin between a plain step of the loop and one of
transformers' ``generate`` at batch 1). Positions
in the head's cache count valid pairs only, so one forward over the
concatenated commits gives the features of one forward per commit.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from specjax.drafters.base import (
    CommitInfo,
    DraftRequest,
    DraftSetup,
    Proposal,
    check_sampled_logits,
    drafted_host,
    greedy_pick,
    sampled_confidence,
    stop_rows,
)
from specjax.drafters.eagle_head import EagleHead, FeatureCache, load_head

__all__ = ["CONTEXT_TOKENS", "EagleDrafter", "check_head", "context_ids"]

CONTEXT_TOKENS = 2048  # EagleDrafter's default context_tokens


def context_ids(scored: np.ndarray, tokens: np.ndarray, room: int) -> np.ndarray:
    """i64[n]: the ids of ``tokens`` (a context's, any shape) the head scores next: those in [0, V) not
    ``scored`` yet (bool[V]), ascending, at most ``room`` of them (the rule of both loops' eagle drafters)."""
    seen = np.unique(np.asarray(tokens).astype(np.int64).ravel())
    seen = seen[(seen >= 0) & (seen < len(scored))]  # ids the head can score
    return seen[~scored[seen]][: max(room, 0)]


def check_head(head: EagleHead, target: Any, target_vocab: int) -> None:
    """Raise ``ValueError`` unless ``head`` fits ``target`` (its hidden size, depth and vocabulary V)."""
    embed = target.get_input_embeddings()
    cfg = head.config
    if embed.weight.shape[1] != cfg.hidden_size:
        raise ValueError(
            f"draft: the eagle head expects the target's hidden size {cfg.hidden_size}, "
            f"the target has {embed.weight.shape[1]}"
        )
    depth = int(getattr(target.config, "num_hidden_layers", 0) or 0)
    if depth and any(i >= depth for i in cfg.feature_layers):
        raise ValueError(
            f"draft: the eagle head reads the target's hidden states after layers {list(cfg.feature_layers)}, "
            f"the target has {depth} layers (expected indices below {depth})"
        )
    if target_vocab != cfg.target_vocab_size:
        raise ValueError(
            f"draft: the eagle head was made for a vocabulary of {cfg.target_vocab_size}, "
            f"the target's is {target_vocab}"
        )


class EagleDrafter:
    """Draft with an :class:`~specjax.drafters.eagle_head.EagleHead` over the target's features.

    Args:
      head: the head, or the directory it was saved in
        (:func:`~specjax.drafters.eagle_head.save_head`).
      context_tokens: how many tokens of the rows' contexts the head scores
        beside its own N (int ≥ 0; 0: its N only).
    """

    needs_target_hidden = True
    cost_per_token_hint = 0.001  # seconds; replaced by the loop's measurements

    def __init__(self, head: EagleHead | str | os.PathLike[str], context_tokens: int = CONTEXT_TOKENS) -> None:
        if isinstance(context_tokens, bool) or not isinstance(context_tokens, int | np.integer) or context_tokens < 0:
            raise ValueError(f"draft: context_tokens: expected an int >= 0, got {context_tokens!r}")
        self.head = head if isinstance(head, EagleHead) else load_head(head)
        self.context_tokens = int(context_tokens)
        self.name = "eagle"
        self.target_hidden_layers = self.head.target_hidden_layers
        self.cache: FeatureCache | None = None
        self._feature: torch.Tensor | None = None  # f[B', d]: the predicted feature at each row's last pair
        self._has_feature = np.zeros(0, bool)
        self._committed_length = 0
        # commits the head has not read yet: (the target's hidden states f[B', w, k·d] of
        # target_hidden_layers, token ids i64[B', w], valid bool[B', w])
        self._unread: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # greedy: per unread commit, bool[B', w]: tokens the target committed without testing a
        # proposal (plain steps); and after-the-fact tests not yet reported (hits, tests)
        self._untested: list[np.ndarray] = []
        self._late = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._read_any = np.zeros(0, bool)
        # the target tokens scored: the head's N, then context tokens (i64[N + n] on the device)
        self._ids = self.head.token_ids
        self._scored = np.zeros(0, bool)  # bool[V]: in _ids

    def fork(self) -> EagleDrafter:
        """A fresh drafter over the same head (for a concurrent call; see :class:`~specjax.drafters.Drafter`)."""
        return EagleDrafter(self.head, self.context_tokens)

    # ------------------------------------------------------------------ #
    def start(self, setup: DraftSetup) -> None:
        target = setup.target
        check_head(self.head, target, setup.target_vocab)
        embed = target.get_input_embeddings()
        out = target.get_output_embeddings()
        cfg = self.head.config
        device = setup.input_ids.device
        dtype = embed.weight.dtype
        self.head.to(device=device, dtype=dtype).eval()
        self._embed = embed
        self._lm_head = out.weight
        self._head_weight: torch.Tensor | None = None  # f[N + n, d]: rows of the target's LM head for _ids
        self.vocab = setup.target_vocab
        self._ids = self.head.token_ids
        self._scored = np.zeros(self.vocab, bool)
        self._scored[self._ids.cpu().numpy()] = True
        self._context_room = self.context_tokens
        self._score_context(setup.input_ids[setup.attention_mask.bool()])
        batch = setup.input_ids.shape[0]
        self.cache = FeatureCache(batch, cfg, device, dtype)
        self._feature = torch.zeros((batch, cfg.hidden_size), device=device, dtype=dtype)
        self._has_feature = np.zeros(batch, bool)
        self._committed_length = 0
        self._unread = []
        self._untested = []
        self._late = (np.zeros(batch, np.int64), np.zeros(batch, np.int64))
        self._read_any = np.zeros(batch, bool)  # rows whose kept feature comes from a read pair
        # every row greedy (fixed for the generation): point-mass proposals, no logits
        self._greedy = bool(np.all(np.asarray(setup.sampling.temperature) == 0))
        hidden = setup.target_hidden
        if hidden is not None and hidden.shape[1] > 0:
            # The prompt's pairs (z_t, E x_{t+1}), t < P - 1, from the loop's prefill, read
            # with the first commits when the head first drafts (never, if the loop never
            # asks); the head's output at the last one predicts z of the last prompt token.
            mask = setup.attention_mask.bool()
            valid = mask[:, :-1] & mask[:, 1:]
            self._unread.append((hidden.to(dtype), setup.input_ids[:, 1:], valid))
            self._untested.append(np.zeros(tuple(valid.shape), bool))  # the prompt: not the target's choices
            self._has_feature = valid[:, -1].cpu().numpy().copy()
        self._committed_length = self.cache.length

    @property
    def scored_token_ids(self) -> torch.Tensor:
        """i64[N + n]: the target tokens the head scores now (its N, then the context tokens added)."""
        return self._ids

    def _score_context(self, tokens: torch.Tensor) -> None:
        """Score ``tokens`` (i64[...], the rows' context) too, those not scored yet, while there is room."""
        if self._context_room <= 0 or tokens.numel() == 0:
            return
        new = context_ids(self._scored, tokens.cpu().numpy(), self._context_room)
        if len(new) == 0:
            return
        self._scored[new] = True
        self._context_room -= len(new)
        self._ids = torch.cat([self._ids, torch.as_tensor(new, device=self._ids.device)])

    def _scores(self, feature: torch.Tensor) -> torch.Tensor:
        weight = self._head_weight
        have = 0 if weight is None else weight.shape[0]
        if have < len(self._ids):
            rows = self._lm_head[self._ids[have:]]
            weight = self._head_weight = rows if weight is None else torch.cat([weight, rows])
        assert weight is not None
        return feature @ weight.T  # f[B', N + n]

    def propose(self, request: DraftRequest) -> Proposal:
        import jax.numpy as jnp

        from specjax.adapters import jit_input, to_torch
        from specjax.kernels import steps

        assert self.cache is not None and self._feature is not None, "start() first"
        b = len(self._has_feature)
        want = np.where(self._has_feature & request.active, request.max_tokens, 0).astype(np.int64)
        g = int(want.max(initial=0))
        if g == 0:
            return Proposal(np.zeros((b, 0), np.int32), np.zeros(b, np.int64), None, paid_tokens=0)
        self._read_commits()
        s = request.sampling
        greedy = self._greedy
        device = self._feature.device
        rows = torch.as_tensor(want > 0, device=device)[:, None]  # bool[B', 1]
        ids = self._ids
        feature = self._feature
        tokens: list[Any] = []
        logits_out: list[Any] = []
        confidence: list[np.ndarray] = []  # f64[B'] per position (greedy_pick's or sampled_confidence)
        temperature = np.asarray(s.temperature, np.float64)  # f64[B']
        self._held: list[torch.Tensor] = []
        with torch.inference_mode():
            for i in range(g):
                scores = self._scores(feature)
                if greedy:
                    if request.process is None:
                        best, conf = greedy_pick(scores)
                        x = ids[best]
                    else:  # the logits processors, over the whole vocabulary
                        full = torch.full((b, self.vocab), float("-inf"), device=device, dtype=scores.dtype)
                        full[:, ids] = scores
                        x, conf = greedy_pick(request.process(full, drafted_host(tokens, b)))
                    tokens.append(x)
                    confidence.append(conf)
                    want, go_on = stop_rows(request, confidence, want)
                    if not go_on:
                        break
                else:
                    full = torch.full((b, self.vocab), float("-inf"), device=device, dtype=scores.dtype)
                    full[:, ids] = scores
                    if request.process is not None:  # the logits processors, on this position's prefixes
                        full = request.process(full, drafted_host(tokens, b))
                    self._held.append(full)
                    lj = jit_input(full)
                    logits_out.append(lj)
                    xj = steps.draft_draw(
                        lj,
                        s.keys,
                        request.step,
                        i + 1,
                        s.params,
                        vocab=self.vocab,
                    )
                    tokens.append(xj)
                    x = to_torch(xj).to(device=device, dtype=torch.long)
                    confidence.append(sampled_confidence(full, temperature))
                    check_sampled_logits("the eagle head (drafter 'eagle')", full, confidence[-1], want > i, i + 1)
                    want, go_on = stop_rows(request, confidence, want)
                    if not go_on:
                        break
                if i < g - 1:
                    feature = self.head(feature[:, None], self._embed(x)[:, None], rows, self.cache)[:, 0]
        if greedy:
            stacked: Any = torch.stack(tokens, dim=1).to(torch.int32).cpu().numpy()
            hindsight, self._late = self._late, (np.zeros(b, np.int64), np.zeros(b, np.int64))
            return Proposal(
                stacked,
                want,
                None,
                paid_tokens=len(tokens),
                hindsight=hindsight,
                confidence=np.stack(confidence, axis=1),
            )
        return Proposal(
            jnp.stack(tokens, axis=1),
            want,
            tuple(logits_out),
            paid_tokens=len(tokens),
            confidence=np.stack(confidence, axis=1),
        )

    def commit(self, info: CommitInfo) -> None:
        """Keep the committed pairs for the head's next forward (:meth:`_read_commits`)."""
        assert self.cache is not None and self._feature is not None
        self._held = []
        self.cache.truncate(self._committed_length)  # the drafted pairs go; the target's real ones come
        hidden = info.target_hidden
        if hidden is None:
            raise ValueError("draft: the eagle drafter needs the target's hidden states (needs_target_hidden)")
        counts = np.array([len(e) for e in info.emitted], np.int64)
        w = int(counts.max(initial=0))
        if w == 0:
            return
        device = self._feature.device
        b = len(counts)
        ids = np.zeros((b, w), np.int64)
        for j, e in enumerate(info.emitted):
            ids[j, : len(e)] = e
        valid = torch.as_tensor(np.arange(w)[None, :] < counts[:, None], device=device)
        # a copy: the slice would keep the whole verification's hidden states alive
        self._unread.append(
            (hidden[:, :w].to(self._feature.dtype, copy=True), torch.as_tensor(ids, device=device), valid)
        )
        plain = np.asarray(info.num_proposed) == 0
        self._untested.append(plain[:, None] & (np.arange(w)[None, :] < counts[:, None]))
        self._has_feature |= counts > 0

    def _read_commits(self) -> None:
        """Run the head once over every pair committed since it last ran; each row's feature is its last output."""
        assert self.cache is not None and self._feature is not None
        if not self._unread:
            return
        hidden, ids, valid = (torch.cat(parts, dim=1) for parts in zip(*self._unread, strict=True))
        untested = np.concatenate(self._untested, axis=1)
        self._unread, self._untested = [], []
        b, w = valid.shape
        with torch.inference_mode():
            out = self.head(self.head.fuse_features(hidden), self._embed(ids), valid, self.cache)
            if self._greedy and untested.any():
                self._score_in_hindsight(out, ids, valid, untested)
            self._score_context(ids[valid])  # after the hindsight: it scores what the head knew before
            # each row's last valid slot (rows without one keep their feature)
            last = (valid.long() * torch.arange(1, w + 1, device=valid.device)).argmax(dim=1)
            picked = out[torch.arange(b, device=valid.device), last]
            self._feature = torch.where(valid.any(dim=1)[:, None], picked, self._feature)
        self._read_any |= valid.any(dim=1).cpu().numpy()
        self._committed_length = self.cache.length

    def _score_in_hindsight(
        self, out: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, untested: np.ndarray
    ) -> None:
        """Add to the after-the-fact tests: the head's first choice before each untested committed token.

        The token of a row's valid pair ``i`` was predicted from the head's
        output at the row's previous valid pair (or, for its first unread pair,
        from the feature kept at the last read one).
        """
        assert self._feature is not None
        b = out.shape[0]
        # predictions from [kept feature, out[:, 0], ..., out[:, w-2]]: f[B', w, d] -> ids i64[B', w]
        before = torch.cat([self._feature[:, None], out[:, :-1]], dim=1)
        predicted = self._ids[self._scores(before).max(dim=-1).indices].cpu().numpy()
        ids_h, valid_h = ids.cpu().numpy(), valid.cpu().numpy()
        hits, tests = self._late
        for j in range(b):
            slots = np.flatnonzero(valid_h[j])
            # slot s's token was predicted at the previous valid slot's output (column prev + 1)
            prev = np.concatenate([[-1], slots[:-1]])
            use = untested[j, slots] & ((prev >= 0) | self._read_any[j])
            hits[j] += int(np.sum(predicted[j, prev[use] + 1] == ids_h[j, slots[use]]))
            tests[j] += int(use.sum())

    def select_rows(self, rows: list[int]) -> None:
        """Keep ``rows``; their unread commits stay unread (the head reads them when it next drafts:
        reading them here ran the head over the prompt at the first finished row of a call that never
        drafted)."""
        assert self.cache is not None and self._feature is not None
        index = torch.as_tensor(rows, device=self._feature.device)
        self._unread = [(f[index], i[index], v[index]) for f, i, v in self._unread]
        self._untested = [u[rows] for u in self._untested]
        self.cache.select_rows(index)
        self._feature = self._feature[index]
        self._has_feature = self._has_feature[rows]
        self._read_any = self._read_any[rows]
        self._late = (self._late[0][rows], self._late[1][rows])
