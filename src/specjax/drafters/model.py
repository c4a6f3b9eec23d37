"""A transformers causal LM as the drafter (the ``model`` drafter): classic draft-model speculation.

Each step feeds the model the committed tokens it has not seen yet (at least
the last one; more after steps that did not draft or that accepted its last
proposal), then draws ``g`` tokens autoregressively through
:func:`specjax.kernels.steps.draft_draw`: the front end's processing
(temperature / top-k / top-p / greedy) of its logits, so the tokens come from
exactly the ``q`` the acceptance step recomputes from the returned logits
(with logits processors, the logits ``DraftRequest.process`` returns).
When every row is greedy the proposal is deterministic: the first argmax of
the draft's logits (over the target's vocabulary), proposed as point masses
(no logits; :func:`specjax.verify_from_logits` with ``draft_logits=None``),
drawn by torch on the model's device: no JAX call per draft token. Each
token comes with the model's probability of it as its confidence
(``Proposal.confidence``; sampled: its distribution's largest probability at
the row's temperature, known before the draw), and
drafting stops for a row once the request's ``worth_drafting`` says another
token does not pay.

Its KV cache is a :class:`~specjax.slots.SlotCache`: after a step,
the fed proposals that were committed stay valid, the rest are marked invalid.
"""

from __future__ import annotations

import dataclasses
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
from specjax.slots import SlotCache

__all__ = ["ModelDrafter"]


class ModelDrafter:
    """Draft with a smaller causal LM sharing the target's tokenizer.

    Args:
      model: a transformers causal LM on the target's device (vocabularies may
        differ by padding: ids the draft cannot embed are fed as id 0 and ids
        beyond its head get probability 0).
    """

    needs_target_hidden = False
    cost_per_token_hint = 0.003  # seconds; replaced by the loop's measurements

    def __init__(self, model: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"draft: ModelDrafter expects a transformers causal LM, got {type(model).__name__}")
        self.model: Any = model  # a transformers causal LM
        self.name = f"model:{type(model).__name__}"
        self._who = f"the draft model {type(model).__name__} (drafter {self.name!r})"
        self.cache: SlotCache | None = None
        self.pending: list[list[int]] = []
        self._fed: Any = None  # the proposals fed to the model during the last propose (JAX, g - 1 columns)
        self._fed_start = 0
        self._proposed = False
        # greedy: per row, how many trailing pending tokens the target committed without
        # testing a proposal (plain steps), and after-the-fact tests not yet reported
        self._untested: list[int] = []
        self._late = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        self._first: np.ndarray | None = None

    def fork(self) -> ModelDrafter:
        """A fresh drafter over the same model (for a concurrent call; see :class:`~specjax.drafters.Drafter`)."""
        return ModelDrafter(self.model)

    # ------------------------------------------------------------------ #
    def start(self, setup: DraftSetup) -> None:
        model = self.model
        model.eval()
        batch, prompt_len = setup.input_ids.shape
        device = setup.input_ids.device
        embed = model.get_input_embeddings().weight.shape[0]
        self.vocab = setup.target_vocab
        self.cache = SlotCache(model, batch, device, input_vocab=embed if embed < setup.target_vocab else None)
        if prompt_len > 1:
            # all but the last prompt token: it is the first pending token
            valid = setup.attention_mask[:, :-1].bool().cpu().numpy()
            self.cache.forward(setup.input_ids[:, :-1], valid, last_only=True)
        self.pending = [[int(t)] for t in setup.input_ids[:, -1].tolist()]
        self.sampling = setup.sampling
        # every row greedy (fixed for the generation): point-mass proposals, no logits
        self._greedy = bool(np.all(np.asarray(setup.sampling.temperature) == 0))
        self._proposed = False
        self._untested = [0] * batch
        self._late = (np.zeros(batch, np.int64), np.zeros(batch, np.int64))

    def propose(self, request: DraftRequest) -> Proposal:
        import jax.numpy as jnp

        from specjax.adapters import host_array, jit_input, to_torch
        from specjax.kernels import steps

        assert self.cache is not None, "start() first"
        g = int(request.max_tokens.max(initial=0))
        b = len(self.pending)
        if g == 0:
            self._proposed = False
            return Proposal(np.zeros((b, 0), np.int32), np.zeros(b, np.int64), None)
        device = self.cache.device
        active = request.active
        width = max(len(p) for p in self.pending)
        # Left-pad each row's pending tokens so that its last real token is in the last slot.
        feed_h = np.zeros((b, width), np.int64)
        valid_h = np.zeros((b, width), bool)
        for j, p in enumerate(self.pending):
            feed_h[j, width - len(p) :] = p
            valid_h[j, width - len(p) :] = active[j]
        feed = torch.as_tensor(feed_h, device=device)
        all_valid = bool(valid_h.all())
        all_active = bool(active.all())
        active_col = active[:, None]  # bool[B', 1]: the validity of each drafted slot
        s = request.sampling
        self._fed_start = self.cache.length + width
        if self._greedy:
            return self._propose_greedy(request, feed, valid_h, all_valid, active_col, all_active, g)
        draws: list[Any] = []
        logits_out: list[Any] = []
        self._held: list[torch.Tensor] = []  # torch buffers JAX reads, kept until the step is done
        feed_valid: np.ndarray = valid_h
        confidence: list[np.ndarray] = []  # f64[B'] per position: its peak probability (sampled_confidence)
        temperature = np.asarray(s.temperature, np.float64)
        want = np.where(active, np.minimum(request.max_tokens, g), 0).astype(np.int64)
        for i in range(g):
            logits = self.cache.forward(feed, feed_valid, last_only=True, all_valid=all_valid)[:, 0]
            if request.process is not None:  # the logits processors, on this position's prefixes
                logits = request.process(logits, drafted_host(draws, b))
            self._held.append(logits)
            lj = jit_input(logits)
            logits_out.append(lj)
            x = steps.draft_draw(
                lj,
                s.keys,
                request.step,
                i + 1,
                s.params,
                vocab=self.vocab,
            )
            draws.append(x)
            confidence.append(sampled_confidence(logits[:, : self.vocab], temperature))
            check_sampled_logits(self._who, logits[:, : self.vocab], confidence[-1], want > i, i + 1)
            want, go_on = stop_rows(request, confidence, want)
            if not go_on:
                break  # x was not fed: the fed proposals are the first i
            feed = to_torch(x).to(torch.long)[:, None]
            feed_valid, all_valid = active_col, all_active
        host = [host_array(x) for x in draws]  # on a CPU: NumPy (no eager JAX op, no compilation per shape)
        tokens = np.stack(host, axis=1) if all(h is not None for h in host) else jnp.stack(draws, axis=1)
        proposal = self._proposal(request, tokens, tuple(logits_out), len(draws), want)
        return dataclasses.replace(proposal, confidence=np.stack(confidence, axis=1))

    def _propose_greedy(
        self,
        request: DraftRequest,
        feed: torch.Tensor,
        feed_valid: np.ndarray,
        all_valid: bool,
        active_col: np.ndarray,
        all_active: bool,
        g: int,
    ) -> Proposal:
        """Every row greedy: ``g`` first argmaxes over the target's vocabulary, as point masses.

        The first forward also scores the pending tokens the target committed in
        plain steps (:meth:`_hindsight`): logits for the last ``u + 1`` slots,
        ``u`` the most such tokens in a row.
        """
        assert self.cache is not None
        drawn: list[torch.Tensor] = []
        confidence: list[np.ndarray] = []  # f64[B'] per position: the model's probability of its choice
        want = np.where(request.active, np.minimum(request.max_tokens, g), 0).astype(np.int64)
        width = feed.shape[1]
        keep = min(width, max(self._untested, default=0) + 1)
        hindsight = None
        for i in range(g):
            if i == 0 and keep > 1:
                scored = self.cache.forward(feed, feed_valid, keep_last=keep, all_valid=all_valid)
                hindsight = self._hindsight(scored[:, :-1], request.active)
                logits = scored[:, -1]
            else:
                logits = self.cache.forward(feed, feed_valid, last_only=True, all_valid=all_valid)[:, 0]
            if request.process is not None:  # the logits processors, on this position's prefixes
                logits = request.process(logits, drafted_host(drawn, len(feed_valid)))
            x, conf = greedy_pick(logits[:, : self.vocab])  # i64[B'], f64[B']
            drawn.append(x)
            confidence.append(conf)
            want, go_on = stop_rows(request, confidence, want)
            if not go_on:
                break  # x was not fed: the fed proposals are the first i
            feed = x[:, None]
            feed_valid, all_valid = active_col, all_active
        tokens = torch.stack(drawn, dim=1).to(torch.int32).cpu().numpy()
        self._first = tokens[:, 0].copy()
        hits, tests = self._late
        if hindsight is not None:
            hits, tests = hits + hindsight[0], tests + hindsight[1]
        self._late = (np.zeros_like(hits), np.zeros_like(tests))
        proposal = self._proposal(request, tokens, None, len(drawn), want)
        return dataclasses.replace(proposal, hindsight=(hits, tests), confidence=np.stack(confidence, axis=1))

    def _hindsight(self, logits: torch.Tensor, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: of its pending tokens the target committed in plain steps, how many the model predicted.

        ``logits``: f[B', K, V], the slots before the last K + 1 ... before the
        last one of this step's feed (pending tokens right-aligned): column c
        predicts the token in slot ``width - K + c``. A row's first pending
        token has no prediction here (its predecessor was fed before).
        """
        k = logits.shape[1]
        best = logits[:, :, : self.vocab].max(dim=-1).indices.cpu().numpy()
        hits = np.zeros(len(self.pending), np.int64)
        tests = np.zeros(len(self.pending), np.int64)
        for j, p in enumerate(self.pending):
            n = len(p)
            u = min(self._untested[j], n - 1, k)
            if u <= 0 or not active[j]:
                continue
            # pending token i sits in slot width - n + i, predicted by column k - n + i: the
            # last u tokens by the last u columns
            hits[j] = int(np.sum(best[j, k - u :] == np.asarray(p[n - u :])))
            tests[j] = u
        return hits, tests

    def _proposal(
        self,
        request: DraftRequest,
        tokens: Any,
        logits: tuple[Any, ...] | None,
        g: int,
        k: np.ndarray | None = None,
    ) -> Proposal:
        """Keep what :meth:`commit` needs (the fed proposals, the rows that drafted) and answer.

        ``g``: the tokens drawn per row (the first ``g - 1`` were fed to the model);
        ``k``: i64[B'], each row's proposals (default ``min(max_tokens, g)`` for active rows).
        """
        self._fed = tokens[:, : g - 1]
        self._active = request.active.copy()
        self._proposed = True
        if k is None:
            k = np.where(request.active, np.minimum(request.max_tokens, g), 0).astype(np.int64)
        return Proposal(tokens, k, logits, paid_tokens=g)

    def commit(self, info: CommitInfo) -> None:
        assert self.cache is not None
        self._held = []
        if not self._proposed:
            for j, (p, e) in enumerate(zip(self.pending, info.emitted, strict=True)):
                p.extend(e)
                self._untested[j] += len(e)
            return
        self._proposed = False
        fed = np.asarray(self._fed)  # i32[B', g - 1]: ready (the step already synchronised)
        keep = np.zeros(len(self.pending), np.int64)
        for j, e in enumerate(info.emitted):
            if not self._active[j]:  # not fed this step: its pending tokens wait
                self.pending[j].extend(e)
                self._untested[j] += len(e)
                continue
            if self._greedy and e and int(info.num_proposed[j]) == 0 and self._first is not None:
                # proposed, but the loop tested none: its first token is still a test, after the fact
                self._late[0][j] += int(self._first[j]) == e[0]
                self._late[1][j] += 1
            m = 0  # the fed proposals that the row committed, in order
            while m < fed.shape[1] and m < len(e) and int(fed[j, m]) == e[m]:
                m += 1
            # every emitted token already fed (the loop tested fewer proposals than were fed, and the
            # target's token after them is the next fed one): feed the last again, so that the next
            # forward has an input
            m = min(m, max(len(e) - 1, 0))
            keep[j] = m
            self.pending[j] = list(e[m:])
            self._untested[j] = 0
        self.cache.invalidate(self._fed_start, keep)

    def select_rows(self, rows: list[int]) -> None:
        assert self.cache is not None
        self.cache.select_rows(np.asarray(rows, np.int64))
        self.pending = [self.pending[j] for j in rows]
        self._untested = [self._untested[j] for j in rows]
        self._late = (self._late[0][rows], self._late[1][rows])
