"""A transformers causal LM as the drafter (the ``model`` drafter): classic draft-model speculation.

Each step feeds the model the committed tokens it has not seen yet (at least
the last one; more after steps that did not draft or that accepted its last
proposal), then draws ``g`` tokens autoregressively through
:func:`specjax.kernels.steps.draft_draw`: the front end's processing
(temperature / top-k / top-p / greedy) of its logits, so the tokens come from
exactly the ``q`` the acceptance step recomputes from the returned logits.

Its KV cache is a :class:`~specjax.slots.SlotCache`: after a step,
the fed proposals that were committed stay valid, the rest are marked invalid.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, Proposal
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
        self.model = model
        self.name = f"model:{type(model).__name__}"
        self.cache: SlotCache | None = None
        self.pending: list[list[int]] = []
        self._fed: Any = None  # the proposals fed to the model during the last propose (JAX, g - 1 columns)
        self._fed_start = 0
        self._proposed = False

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
            self.cache.forward(setup.input_ids[:, :-1], setup.attention_mask[:, :-1].bool(), last_only=True)
        self.pending = [[int(t)] for t in setup.input_ids[:, -1].tolist()]
        self.sampling = setup.sampling
        self._proposed = False

    def propose(self, request: DraftRequest) -> Proposal:
        import jax.numpy as jnp

        from specjax.adapters import jit_input, to_torch
        from specjax.kernels import steps

        assert self.cache is not None, "start() first"
        g = int(request.max_tokens.max(initial=0))
        b = len(self.pending)
        if g == 0:
            self._proposed = False
            return Proposal(np.zeros((b, 0), np.int32), np.zeros(b, np.int64), None)
        device = self.cache.mask.device
        active = request.active
        width = max(len(p) for p in self.pending)
        # Left-pad each row's pending tokens so that its last real token is in the last slot.
        feed_h = np.zeros((b, width), np.int64)
        valid_h = np.zeros((b, width), bool)
        for j, p in enumerate(self.pending):
            feed_h[j, width - len(p) :] = p
            valid_h[j, width - len(p) :] = active[j]
        feed = torch.as_tensor(feed_h, device=device)
        feed_valid = torch.as_tensor(valid_h, device=device)
        all_valid = bool(valid_h.all())
        all_active = bool(active.all())
        active_t = torch.as_tensor(active, device=device)[:, None]
        s = request.sampling
        self._fed_start = self.cache.length + width
        draws: list[Any] = []
        logits_out: list[Any] = []
        self._held: list[torch.Tensor] = []  # torch buffers JAX reads, kept until the step is done
        for i in range(g):
            logits = self.cache.forward(feed, feed_valid, last_only=True, all_valid=all_valid)[:, 0]
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
            if i < g - 1:
                feed = to_torch(x).to(torch.long)[:, None]
                feed_valid, all_valid = active_t, all_active
        tokens = jnp.stack(draws, axis=1)
        self._fed = tokens[:, : g - 1]
        self._active = active.copy()
        self._proposed = True
        k = np.where(active, np.minimum(request.max_tokens, g), 0).astype(np.int64)
        return Proposal(tokens, k, tuple(logits_out))

    def commit(self, info: CommitInfo) -> None:
        assert self.cache is not None
        self._held = []
        if not self._proposed:
            for p, e in zip(self.pending, info.emitted, strict=True):
                p.extend(e)
            return
        self._proposed = False
        fed = np.asarray(self._fed)  # i32[B', g - 1]: ready (the step already synchronised)
        keep = np.zeros(len(self.pending), np.int64)
        for j, e in enumerate(info.emitted):
            if not self._active[j]:  # not fed this step: its pending tokens wait
                self.pending[j].extend(e)
                continue
            m = 0  # the fed proposals that the row committed, in order
            while m < fed.shape[1] and m < len(e) and int(fed[j, m]) == e[m]:
                m += 1
            keep[j] = m
            self.pending[j] = list(e[m:])
        self.cache.invalidate(self._fed_start, torch.as_tensor(keep, device=self.cache.mask.device))

    def select_rows(self, rows: list[int]) -> None:
        assert self.cache is not None
        self.cache.select_rows(torch.as_tensor(rows, device=self.cache.mask.device))
        self.pending = [self.pending[j] for j in rows]
