"""N-gram lookup where it matches, another drafter (a draft model) for the other rows (``hybrid``).

Each step asks the n-gram drafter first. When every row that may draft has a
match, the step uses the n-gram proposals alone (point masses) and the
fallback does not run. Otherwise the fallback proposes for the whole batch
(one batched forward per position) and rows with an n-gram match take the
n-gram proposals instead. The proposal keeps the fallback's draft logits and
marks the n-gram rows as point masses (``Proposal.point_mass_rows``): one
acceptance step verifies each row by its own kind, the n-gram rows by the
point-mass rule and the others against the fallback's distribution. When the
fallback proposes point masses too (every row greedy), the rows simply take
their tokens from one drafter or the other. The proposal also marks the
n-gram rows as free (``free_rows``), so the loop's draft schedule learns the
two drafters' acceptance apart: whether to pay for the fallback is decided
from the fallback's acceptance alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from specjax.drafters.base import DRAFTER_METHODS, CommitInfo, DraftRequest, DraftSetup, Proposal, is_drafter
from specjax.slots import to_host

__all__ = ["HybridDrafter"]


class HybridDrafter:
    """``ngram`` where the context's suffix occurred before, ``fallback`` elsewhere.

    Args:
      ngram: an :class:`~specjax.drafters.ngram.NgramDrafter` (or another
        drafter of free, deterministic proposals).
      fallback: any drafter proposing with logits (e.g. a
        :class:`~specjax.drafters.model.ModelDrafter`).

    Raises:
      TypeError: ``ngram`` or ``fallback`` is not a drafter (e.g. a model
        passed where ``ModelDrafter(model)`` was meant, or None).
    """

    needs_target_hidden = False
    asks_every_step = True  # its n-gram rows cost nothing, whatever the fallback costs

    def __init__(self, ngram: Any, fallback: Any) -> None:
        for arg, value in (("ngram", ngram), ("fallback", fallback)):
            if not is_drafter(value):
                hint = " (wrap a draft model as ModelDrafter(model))" if isinstance(value, torch.nn.Module) else ""
                raise TypeError(
                    f"{arg}: HybridDrafter expects a drafter (with {', '.join(DRAFTER_METHODS)}), "
                    f"got {type(value).__name__}{hint}"
                )
        self.ngram, self.fallback = ngram, fallback
        self.name = f"hybrid({ngram.name}, {fallback.name})"
        self.needs_target_hidden = bool(getattr(fallback, "needs_target_hidden", False))
        self.target_hidden_layers = tuple(getattr(fallback, "target_hidden_layers", (-1,)))
        self.cost_per_token_hint = float(getattr(fallback, "cost_per_token_hint", 0.0))
        self.last_source = ""

    def fork(self) -> HybridDrafter:
        """A fresh drafter over forks of its two (for a concurrent call; see :class:`~specjax.drafters.Drafter`).

        Raises:
          ValueError: one of its drafters has no ``fork()``.
        """
        forks = []
        for part in (self.ngram, self.fallback):
            fork = getattr(part, "fork", None)
            if not callable(fork):
                raise ValueError(
                    f"draft: drafter {self.name!r} is in use by another speculative_generate call and its drafter "
                    f"{getattr(part, 'name', type(part).__name__)!r} has no fork(); pass one drafter object per "
                    "concurrent call"
                )
            forks.append(fork())
        return HybridDrafter(*forks)

    def start(self, setup: DraftSetup) -> None:
        self.ngram.start(setup)
        self.fallback.start(setup)

    def propose(self, request: DraftRequest) -> Proposal:
        ng = self.ngram.propose(request)
        use = ng.num_tokens > 0
        missing = (request.max_tokens > 0) & ~use
        if not missing.any():  # the fallback is not needed (or not wanted) this step
            self.last_source = "ngram"
            return dataclasses.replace(ng, free_rows=use)
        self.last_source = "fallback" if not use.any() else "both"
        fb = self.fallback.propose(request)
        if not use.any():
            return dataclasses.replace(fb, free_rows=use)
        g = max(fb.width, ng.width)
        ng_tokens = np.zeros((len(use), g), np.int32)
        ng_tokens[:, : ng.width] = np.asarray(ng.tokens)
        counts = np.where(use, ng.num_tokens, fb.num_tokens).astype(np.int64)
        confidence = None
        if fb.confidence is not None:  # the fallback's rows only (NaN: none for the n-gram rows)
            confidence = np.full((len(use), g), np.nan)
            fb_conf = np.asarray(fb.confidence, np.float64)[:, :g]
            confidence[:, : fb_conf.shape[1]] = np.where(use[:, None], np.nan, fb_conf)
        # Each row takes its drafter's tokens, merged on the host: the loop reads drawn draft tokens there
        # anyway (check_proposal), and JAX ops here would compile anew for each width and batch size.
        fb_host = np.zeros((len(use), g), np.int32)  # positions past fb.width: only n-gram rows test them
        fb_host[:, : fb.width] = to_host(fb.tokens)[:, : fb.width]
        tokens = np.where(use[:, None], ng_tokens, fb_host)
        logits: tuple[Any, ...] | None = None
        if fb.logits is not None:  # one logits array per position; the n-gram rows' (point masses) are never read
            logits = tuple(fb.logits) + (fb.logits[-1],) * (g - fb.width)
        return Proposal(
            tokens,
            counts,
            logits,
            paid_tokens=fb.width,
            free_rows=use,
            hindsight=fb.hindsight,
            confidence=confidence,
            point_mass_rows=None if logits is None else use,
        )

    def commit(self, info: CommitInfo) -> None:
        self.ngram.commit(info)
        self.fallback.commit(info)

    def select_rows(self, rows: list[int]) -> None:
        self.ngram.select_rows(rows)
        self.fallback.select_rows(rows)
