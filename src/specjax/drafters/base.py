"""The drafter protocol: whatever proposes draft tokens to the speculative loop.

One step of :func:`specjax.speculative_generate`, seen from a drafter:

1. ``propose(request)``: for each cache row ``b``, propose up to
   ``request.max_tokens[b]`` tokens continuing ``request.contexts[b]`` (ragged:
   any count from 0 up). A row's tokens come either with the logits they were
   sampled from (``Proposal.logits``: the loop processes them exactly as the
   target's, so ``q`` is exactly the distribution the tokens were drawn from)
   or as deterministic proposals (``logits=None``: ``q`` is the point mass at
   each token, see :func:`specjax.rejection_sample`).
2. The loop scores ``[last committed token, proposals…]`` with the target in
   one forward pass and runs the acceptance step.
3. ``commit(result)``: the tokens each row actually committed (accepted
   proposals, then the correction or bonus token), and, for a drafter that
   sets ``needs_target_hidden``, the target's final hidden states from that same
   forward pass (never a second target forward).

Contexts are host lists of token ids (the row's prompt without padding, then
every committed token); ``contexts[b][-1]`` is the last committed token, which
the target has not seen yet. Rows keep their positions between calls until
``select_rows`` drops finished ones.

Randomness: a drafter that samples draws through
:func:`specjax.kernels.steps.draft_draw` with ``request.sampling`` (the
row keys, folded with the step and the draft position), so a row's draws do
not depend on the rest of its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
import torch

from specjax.kernels.types import SamplingParams

__all__ = [
    "CommitInfo",
    "DraftRequest",
    "DraftSetup",
    "Drafter",
    "Proposal",
    "SamplingState",
    "check_sampled_logits",
    "drafted_host",
    "greedy_pick",
    "is_drafter",
    "logit_row_max",
    "stop_rows",
]


@dataclass
class SamplingState:
    """The per-row sampling parameters and keys of the rows in the caches (JAX arrays of B' rows).

    Attributes:
      params: :class:`specjax.kernels.types.SamplingParams` of B' rows
        (temperature, top-k, ``1 - top_p``; ``use_top_k`` / ``use_top_p``
        static), passed as one argument to the jitted steps.
      keys: key[B'], one PRNG key per row.

    ``temperature``, ``top_k``, ``one_minus_top_p``, ``use_top_k`` and
    ``use_top_p`` read the fields of ``params``.
    """

    params: SamplingParams
    keys: Any

    @property
    def temperature(self) -> Any:
        return self.params.temperature

    @property
    def top_k(self) -> Any:
        return self.params.top_k

    @property
    def one_minus_top_p(self) -> Any:
        return self.params.one_minus_top_p

    @property
    def use_top_k(self) -> bool:
        return self.params.use_top_k

    @property
    def use_top_p(self) -> bool:
        return self.params.use_top_p

    def select(self, rows: Any) -> SamplingState:
        """The state of ``rows`` (i32[B''] indices into the current rows)."""
        return SamplingState(jax.tree.map(lambda a: a[rows], self.params), self.keys[rows])


@dataclass
class DraftSetup:
    """What a drafter is told once, before the first step.

    Attributes:
      target: the target model (a transformers causal LM).
      input_ids: i64[B, P], the left-padded prompts (on the target's device).
      attention_mask: i64[B, P], 1 for real tokens.
      contexts: B lists of the prompts' token ids without padding.
      target_vocab: V, the target's vocabulary size (proposals must lie in [0, V)).
      max_draft_tokens: G, the most tokens a row is ever asked for in one step.
      sampling: :class:`SamplingState` of all B rows.
      target_hidden: for drafters with ``needs_target_hidden``: f[B, P-1, k·d],
        the target's hidden states (the k of ``target_hidden_layers``, by
        default the final one) at the prompt's first P-1 positions,
        from the loop's prefill forward (the last prompt token is scored with
        the first proposals); None for prompts of one token or other drafters.
    """

    target: Any
    input_ids: Any
    attention_mask: Any
    contexts: list[list[int]]
    target_vocab: int
    max_draft_tokens: int
    sampling: SamplingState
    target_hidden: Any = None


@dataclass
class DraftRequest:
    """One step's request.

    Attributes:
      step: the step number (0, 1, …), for key folding.
      contexts: B' host lists: each cache row's committed tokens (see module doc).
      max_tokens: i64[B'], how many proposals the loop's schedule asks for per
        row (0: none; finished rows have 0): what a drafter that pays per
        token (a model) should draft.
      active: bool[B'], rows still generating.
      sampling: :class:`SamplingState` of the B' rows.
      limit: i64[B'] >= max_tokens, the most proposals a row may get (G, or
        fewer near ``max_new_tokens``): a drafter whose proposals cost nothing
        (a lookup) may propose up to this; the schedule then decides how many
        to verify. None means ``max_tokens``.
      worth_drafting: None (when the draft length is fixed), or the
        schedule's test for a drafter that reports
        its confidence (:attr:`Proposal.confidence`), drafting token by token:
        called with f64[B', i], its confidence in the ``i`` tokens drafted so
        far, it returns bool[B'], the rows for which one more token is
        expected to pay. A drafter may stop drafting the other rows early
        (proposing fewer than ``max_tokens[b]``); ignoring it is also correct.
      process: None (no logits processors: draw from the logits as they are), or
        the call's logits processors for this step
        (:mod:`specjax.generate.processors`): ``process(logits f[B', V_draft],
        drafted i64[B', i] host array) -> f32[B', V]``, the logits of draft
        position ``i`` processed with each row's prefix (its context followed
        by ``drafted[b]``, the tokens it drew before). A drafter that draws from
        logits should draw from these and propose them as its logits (its
        tokens then follow the processed distribution the target's tokens are
        tested against); exactness only needs ``Proposal.logits`` to be what
        the tokens were drawn from. Point-mass drafters may ignore it (the
        loop processes the target's side).
    """

    step: int
    contexts: list[list[int]]
    max_tokens: np.ndarray
    active: np.ndarray
    sampling: SamplingState
    limit: np.ndarray | None = None
    worth_drafting: Callable[[np.ndarray], np.ndarray] | None = None
    process: Callable[[Any, np.ndarray], torch.Tensor] | None = None

    @property
    def allowed(self) -> np.ndarray:
        """i64[B']: ``limit``, or ``max_tokens`` without one."""
        return self.max_tokens if self.limit is None else self.limit


@dataclass
class Proposal:
    """A drafter's answer.

    Attributes:
      tokens: i32/i64[B', g] (NumPy, torch or JAX): row b's proposals are
        ``tokens[b, :num_tokens[b]]``; later entries are ignored.
      num_tokens: i64[B'] host array, ``k_b`` in [0, max_tokens[b]].
      logits: None (deterministic proposals: point masses), or a tuple of g
        f[B', V_draft] arrays (JAX, or torch that crosses zero-copy): the logits
        ``tokens[:, i]`` were sampled from, processed by the loop with the
        target's sampling parameters. ``V_draft`` may differ from V by padding.
      point_mass_rows: None, or bool[B'] host array with ``logits``: the rows
        whose proposals are deterministic all the same (the ``hybrid``
        drafter's n-gram rows): verified as point masses, their rows of
        ``logits`` never read. None: every row was drawn from ``logits``.
      paid_tokens: how many tokens per row the drafter paid for (a model's
        draft positions), for the schedule's cost per token; None: the
        request's ``max(max_tokens)``; 0 for free proposals.
      free_rows: None, or bool[B'] host array: the rows whose proposals are
        free lookups mixed in by a drafter that otherwise pays (the
        ``hybrid`` drafter's n-gram rows). The schedule keeps their
        acceptance apart from the drafter's own proposals'.
      hindsight: None, or ``(hits, tests)``, two i64[B'] host arrays: tests
        the drafter scored after the fact on tokens the target committed
        without testing a proposal of its own there (plain steps), ``hits``
        of them being what it would have proposed (greedy). The schedule
        counts them with the drafter's acceptance, so it keeps learning
        while it does not pay for drafts.
      confidence: None, or f64[B', g] host array in [0, 1] (NaN: none for
        that token): the drafter's own estimate that each proposed token
        passes the test given that the ones before it did (e.g. the
        probability its distribution gives its greedy choice). The loop's
        adaptive schedule calibrates it against the outcomes of the tests
        (greedy and sampled calls apart). When every row is greedy it
        verifies, per step, the tokens it says pay (EAGLE-2, arXiv
        2406.16858, ranks draft tokens by the same confidence). With sampled
        proposals (``logits`` given) a count chosen from the drawn tokens
        would bias the output, so there it only stops the drafting through
        ``worth_drafting``, token by token, and the loop tests every token
        proposed (:meth:`specjax.generate.schedule.DraftSchedule.trim`); the
        built-in drafters then report how peaked their distribution is
        (:func:`sampled_confidence`).

    With ``logits``, whether row b proposes its token ``i`` (``i <
    num_tokens[b]``) may depend on its tokens before ``i`` but not on token
    ``i`` or later ones (a drafter that draws four tokens and proposes two
    because the third looks unlikely biases the output): stop drawing instead.
    """

    tokens: Any
    num_tokens: np.ndarray
    logits: tuple[Any, ...] | None = None
    paid_tokens: int | None = None
    free_rows: np.ndarray | None = None
    hindsight: tuple[np.ndarray, np.ndarray] | None = None
    confidence: np.ndarray | None = None
    point_mass_rows: np.ndarray | None = None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1]) if self.tokens is not None and self.tokens.ndim == 2 else 0


@dataclass
class CommitInfo:
    """What one step committed.

    Attributes:
      emitted: B' host lists: each row's committed tokens this step (its accepted
        proposals, then the correction or bonus token; cut after EOS; empty for
        rows that had finished).
      num_accepted: i64[B'], accepted proposals per row.
      num_proposed: i64[B'], ``k_b`` the loop tested per row. Under a grammar
        the loop may test tokens the grammar forces besides (or instead of)
        the drafter's (:meth:`specjax.generate.grammar.GrammarRows.forced_extension`):
        both counts then cover the drafter's own leading tokens only, and
        ``emitted`` says what was committed.
      target_hidden: for drafters with ``needs_target_hidden``: f[B', W, k·d], the
        target's hidden states (as in :class:`DraftSetup`) at the slots of this step's verification
        forward (``[last, x_0, …]``); slot ``j`` of row b is the state after
        ``contexts[b][-1]`` followed by ``j`` proposals. Else None.
    """

    emitted: list[list[int]]
    num_accepted: np.ndarray
    num_proposed: np.ndarray
    target_hidden: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


DRAFTER_METHODS = ("start", "propose", "commit", "select_rows")


def is_drafter(obj: Any) -> bool:
    """Whether ``obj`` has the drafter methods (:data:`DRAFTER_METHODS`)."""
    return all(callable(getattr(obj, m, None)) for m in DRAFTER_METHODS)


def drafted_host(tokens: list[Any], batch: int) -> np.ndarray:
    """i64[B', i] host array: the ``i`` draft tokens drawn so far (i32/i64[B'] each: torch, NumPy or JAX), the
    ``drafted`` argument of :attr:`DraftRequest.process`."""
    if not tokens:
        return np.zeros((batch, 0), np.int64)
    host = [t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in tokens]
    return np.stack(host, axis=1).astype(np.int64)


def greedy_pick(scores: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """A greedy drafter's choice and its confidence (:attr:`Proposal.confidence`).

    ``scores``: f[B', N] logits. Returns i64[B'], the first maximum of each row
    (faster than argmax), and f64[B'] host array, the softmax probability of it.
    """
    top = scores.max(dim=-1)
    return top.indices, torch.exp(top.values - torch.logsumexp(scores, dim=-1)).double().cpu().numpy()


def sampled_confidence(scores: torch.Tensor, temperature: np.ndarray) -> np.ndarray:
    """A sampling drafter's confidence (:attr:`Proposal.confidence`) at one position, before it draws.

    ``scores``: f[B', V'] the logits it draws from; ``temperature``: f[B'] host
    array, each row's. Returns f64[B'] host array: the largest probability of
    the row's distribution at its temperature (before top-k / top-p, which the
    schedule's calibration absorbs; T = 0 rows: at 1), as :func:`greedy_pick`'s
    for its choice. How peaked the drafter is predicts the test (both
    distributions peaked alike: little to reject) better than the drawn
    token's own probability, which is low on a flat position even where the
    target is just as flat.
    """
    t = np.where(np.asarray(temperature, np.float64) > 0, temperature, 1.0)
    z = scores / torch.as_tensor(t, dtype=scores.dtype, device=scores.device)[:, None]
    return torch.exp(z.max(dim=-1).values - torch.logsumexp(z, dim=-1)).double().cpu().numpy()


def logit_row_max(logits: Any, rows: np.ndarray | None = None) -> np.ndarray:
    """f64[R] host array: each row's largest logit, the one rule for "these logits are a distribution".

    A row's logits define a distribution (their softmax) iff this is finite: it
    is NaN when the row holds a NaN, +inf when it holds a +inf (the softmax is
    then NaN), -inf when every logit is -inf (nothing has probability). One
    pass per row, in the array's own library (torch, NumPy or JAX; no copy of
    the logits to the host).

    Args:
      logits: f[B, V] (torch, NumPy or JAX).
      rows: optional i64[R] row indices (default: all rows).
    """
    if isinstance(logits, torch.Tensor):
        sel = logits.detach() if rows is None else logits.detach()[torch.as_tensor(rows, device=logits.device)]
        return sel.amax(dim=-1).double().cpu().numpy()  # amax propagates NaN
    if not isinstance(logits, np.ndarray):
        sel_j = jax.numpy.asarray(logits) if rows is None else jax.numpy.asarray(logits)[rows]
        return np.asarray(jax.numpy.max(sel_j, axis=-1), np.float64)
    return np.asarray((logits if rows is None else logits[rows]).max(axis=-1), np.float64)


def check_sampled_logits(
    who: str, logits: torch.Tensor, confidence: np.ndarray, rows: np.ndarray, position: int
) -> None:
    """Before a sampling drafter feeds its draws back: its logits must be distributions.

    A row with a NaN or ``+inf`` logit, or only ``-inf`` ones, has no
    distribution: its draw is not a token (an embedding lookup then fails
    deep inside torch) and ``q`` would be NaN in the acceptance test.

    Args:
      who: the drafter as messages name it (``the draft model LlamaForCausalLM``).
      logits: f[B', V] the logits drawn from at draft position ``position`` (1-based).
      confidence: f64[B'] host array, :func:`sampled_confidence` of them: NaN for
        such rows (and for rows whose scaled logits overflow, told apart here).
        Only a NaN confidence makes this look at the logits: no cost otherwise.
      rows: bool[B'] the rows drafting.

    Raises:
      ValueError: naming the drafter, the row and the position.
    """
    if not np.isnan(confidence[rows]).any():
        return
    bad_rows = np.nonzero(~np.isfinite(logit_row_max(logits)) & rows)[0]
    if bad_rows.size:
        raise ValueError(
            f"draft: {who} gave logits that are not a distribution (a NaN or +inf logit, or all -inf) in row "
            f"{int(bad_rows[0])} at draft position {position}; check its weights for NaN or inf and its dtype "
            "(float16 logits overflow), or draft with another drafter"
        )


def stop_rows(request: DraftRequest, confidence: list[np.ndarray], want: np.ndarray) -> tuple[np.ndarray, bool]:
    """After a drafter drafted ``i = len(confidence)`` tokens per row: whom to draft on for.

    ``confidence``: i f64[B'] arrays, the confidence in each drafted position;
    ``want``: i64[B'], the tokens each row is to propose. Returns ``want`` with
    the rows :attr:`DraftRequest.worth_drafting` says are not worth another
    token cut to ``i``, and whether any row goes on (without ``worth_drafting``:
    ``want`` unchanged, and whether any row wants more than ``i``).
    """
    i = len(confidence)
    more = want > i
    if request.worth_drafting is not None and more.any():
        more &= np.asarray(request.worth_drafting(np.stack(confidence, axis=1)))
        want = np.where((want > i) & ~more, i, want)
    return want, bool(more.any())


@runtime_checkable
class Drafter(Protocol):
    """What :func:`specjax.speculative_generate` accepts as ``draft`` besides a model or a name.

    Attributes:
      name: shown in statistics and error messages.
      needs_target_hidden: ask the loop for the target's final hidden states of
        each verification forward (:attr:`CommitInfo.target_hidden`).
      target_hidden_layers: optional (default ``(-1,)``, the final normed
        state): which hidden states to hand over, as indices into
        transformers' ``output_hidden_states``, concatenated on the last axis
        in that order (f[..., k·d]; EAGLE-3-style heads read several layers).
      cost_per_token_hint: a prior for the seconds one proposed token costs
        (0 for host lookups); the loop measures the real cost and uses that.
      asks_every_step: optional (default: ``cost_per_token_hint == 0``): call
        ``propose`` every step, even when the schedule asks for no tokens, so
        that free proposals (lookups) may come up to ``request.limit``.

    A drafter holds the state of one call (its caches, the rows' contexts)
    from ``start`` to the call's end. A call that is given a drafter another
    call is still using (a server sharing one drafter between threads) runs
    with a fresh drafter from its optional ``fork()`` method: a new drafter of
    the same configuration that shares the read-only parts (models, heads)
    and no call state. Without ``fork()`` that call raises a ``ValueError``
    (:func:`specjax.drafters.claim_drafter`). The built-in drafters have one.
    """

    name: str
    needs_target_hidden: bool
    cost_per_token_hint: float

    def start(self, setup: DraftSetup) -> None:
        """Prepare for a new batch (prefill caches, index prompts)."""

    def propose(self, request: DraftRequest) -> Proposal:
        """Propose up to ``request.max_tokens[b]`` tokens per row."""

    def commit(self, info: CommitInfo) -> None:
        """Learn what the step committed (called after every step, also steps that did not propose)."""

    def select_rows(self, rows: list[int]) -> None:
        """Keep only ``rows`` (indices into the current rows), in that order."""
