"""Speculative generation over Hugging Face draft and target models: the loop.

:func:`run_loop` is a short sequence of named steps over one :class:`_Run`
(the call's state): plan (how many tokens each row may and should draft),
draft (the drafter's proposal as one :class:`~specjax.generate.draft_batch.DraftBatch`),
score (one target forward), verify (the strategy chosen once per call,
:mod:`specjax.generate.verify`), commit (tokens, EOS, caches, the drafter),
shrink (drop finished rows). The steps in detail:

One step, for every active row at once (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318):

1. **Draft.** The draft model feeds its pending tokens (the tokens committed last
   step that it has not seen: one or two per row) and then proposes G tokens
   autoregressively; each draw goes through :func:`steps.draft_draw`, the
   front end's processing (temperature / top-k / top-p / greedy), so the draft
   tokens come from exactly the ``q`` the acceptance test will use.
2. **Score.** The target model scores ``[last committed token, x_0 .. x_{G-1}]``
   in one forward pass: G+1 distributions ``p_0 .. p_G``. The first step's
   forward also carries the rest of the prompt (no separate prefill); for a
   drafter that reads the target's hidden states, the whole prompt is scored
   first and the first step is a plain step on its last logits. With logits
   processors, position ``j`` is processed on the prefix ending at ``x_{j-1}``
   (:mod:`specjax.generate.processors`; the drafter's draws too).
3. **Verify.** Draft and target logits cross to JAX zero-copy
   (:func:`specjax.adapters.jit_input`: DLPack on GPU, a NumPy view that XLA:CPU
   reads in place on a CPU-only JAX); the sampler decides ``n`` and draws the
   correction/bonus token; the int32 tokens come back to torch.
4. **Commit.** Each row appends its ``n`` accepted tokens and the emitted token,
   cut after the first of them where EOS, a stop string or a stopping criterion
   ends the row (:mod:`specjax.generate.stopping`: as plain decoding would), and
   stops at ``max_new_tokens``; both caches mark the rejected slots invalid (see
   :mod:`specjax.slots`). Asked for, the emitted tokens' scores and logits are
   kept (:mod:`specjax.generate.outputs`).

Host synchronisation: once per sampled draft draw (the drawn token ids are the next
draft input, and torch's CPU/CUDA forward needs them; on GPU this is a device
round trip only for the tiny (B,) token tensor, which stays on the device;
greedy drafts are torch argmaxes, read on the host once per step) and
once per step after verification (the per-row accepted counts decide the
bookkeeping: EOS, lengths, cache masks). Logits never leave the device.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, Proposal, SamplingState
from specjax.generate import checks
from specjax.generate.checks import check_step_output
from specjax.generate.compile_time import CompileClock, Spent, measure_compiles, timed_block
from specjax.generate.draft_batch import DraftBatch, check_proposal, draft_batch, no_proposal
from specjax.generate.grammar import GrammarRows
from specjax.generate.outputs import OutputRecorder, Outputs
from specjax.generate.processors import LoopProcessors
from specjax.generate.schedule import DraftSchedule
from specjax.generate.stopping import Criterion, StopRule
from specjax.generate.verify import Verifier, choose_verifier
from specjax.slots import SlotCache, to_host

__all__ = ["LoopConfig", "LoopState", "SpeculativeOutput", "SpeculativeStats", "run_loop"]


@dataclass(frozen=True)
class LoopConfig:
    """One call's settings, checked by :func:`speculative_generate` and fixed for the call.

    Read by :func:`run_loop` and by the JAX path (:func:`specjax.generate.jax_loop.run_jax_loop`).
    What changes during the call (logits processors, grammar matchers) is passed beside it.

    Attributes:
      max_new_tokens: the most tokens a row generates.
      num_draft_tokens: G, the most draft tokens a row proposes per step.
      eos_ids: the token ids that end a row (empty: none).
      pad_token_id: what fills a row's output after it ends.
      target_vocab: V, the width of the target's logits.
      sampler: None for the built-in JAX step, else a callable with the
        :func:`specjax.rejection_sample` contract (its output checked).
      adaptive: choose the draft length per step and row from measured costs
        (:mod:`specjax.generate.schedule`); False drafts G every step (fewer only
        where ``max_new_tokens`` allows fewer).
      on_tokens: None, or ``on_tokens(row, tokens)`` called with each row's new tokens.
      return_state: keep the caches after the last step in the output (:class:`LoopState`).
      stopping_criteria: callables ``(input_ids, scores) -> bool[R]`` asked after every
        token besides EOS (:mod:`specjax.generate.stopping`; stop strings among them).
      outputs: the per-token outputs to return (:mod:`specjax.generate.outputs`).
    """

    max_new_tokens: int
    num_draft_tokens: int
    eos_ids: frozenset[int]
    pad_token_id: int
    target_vocab: int
    sampler: Callable[..., Any] | None = None
    adaptive: bool = True
    on_tokens: Callable[[int, list[int]], Any] | None = None
    return_state: bool = False
    stopping_criteria: tuple[Criterion, ...] = ()
    outputs: Outputs = field(default_factory=Outputs)


@dataclass
class SpeculativeStats:
    """What one :func:`speculative_generate` call did.

    Attributes:
      steps: draft-verify steps run.
      target_forwards / draft_forwards: forward passes of each model (prefill included).
      draft_tokens_proposed: draft tokens tested (sum of the per-row draft lengths).
      draft_tokens_accepted: draft tokens accepted.
      acceptance_rate: accepted / proposed.
      mean_accepted_length: mean tokens a row gains per step (accepted draft
        tokens plus the correction/bonus token; Spec-Bench's τ).
      tokens_per_target_forward: new tokens (all rows) per target forward pass.
      acceptance_rate_per_position: for draft position i, the fraction of the
        tests run at position i that passed.
      tests_per_position: how many tests ran at each draft position (the
        denominators of ``acceptance_rate_per_position``).
      adapter_copies: copies the torch→JAX adapters had to make.
      new_tokens: tokens generated (all rows).
      wall_time_s: wall-clock time of the call, from its start (checks and
        setup included).
      compile_time_s: the part of it spent compiling JAX functions (one-time work
        for shapes not seen before; 0 when every shape was seen).
      tokens_per_s: new_tokens / (wall_time_s - compile_time_s): decoding
        speed without one-time compilation.
      drafter: the drafter's name.
      draft_steps: steps that verified at least one proposed token (the others
        were plain decoding steps: no proposal, or the adaptive draft length
        chose none).
      draft_time_s / target_time_s / loop_time_s: where the steps' time went:
        the drafter's proposals, the target's forwards, and the rest (the
        loop's own work: verification, bookkeeping, the drafter's commit);
        JAX compilation left out (it is in ``compile_time_s``: one-time work
        per shape, left out of ``tokens_per_s`` too). ``loop_time_s / steps``
        is the loop's cost per step beside the two models.
      processor_time_s: the part of draft and loop time spent in the logits
        processors (``logits_processor`` and the options built into processors;
        a grammar's cut and merge of the proposals included; 0 without them).
      processor_calls: how many times a logits processor was called (0 without
        them): transformers' built-in processors once each per draft position
        and once each for the target's positions of a step; a callable of the
        caller's once per distinct prefix length among those positions.
      forced_tokens_proposed / forced_tokens_accepted: the part of
        ``draft_tokens_proposed`` / ``draft_tokens_accepted`` that the grammar
        forced (``json_schema`` / ``regex``: keys, punctuation, EOS after a
        complete output), merged into point-mass proposals at no draft cost
        (:meth:`specjax.generate.grammar.GrammarRows.forced_extension`).
    """

    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    acceptance_rate: float = 0.0
    mean_accepted_length: float = 0.0
    tokens_per_target_forward: float = 0.0
    acceptance_rate_per_position: list[float] = field(default_factory=list)
    tests_per_position: list[int] = field(default_factory=list)
    adapter_copies: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    compile_time_s: float = 0.0
    tokens_per_s: float = 0.0
    drafter: str = ""
    draft_steps: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    loop_time_s: float = 0.0
    processor_time_s: float = 0.0
    processor_calls: int = 0
    forced_tokens_proposed: int = 0
    forced_tokens_accepted: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class SpeculativeOutput:
    """Result of :func:`speculative_generate`.

    Attributes:
      sequences: i64[B, prompt + new], the prompts followed by the generated
        tokens, padded with ``pad_token_id`` after a row ends.
      stats: :class:`SpeculativeStats`.
      num_new_tokens: i64[B], tokens generated per row.
      state: the caches after the last step (:class:`LoopState`), only with
        ``return_state=True``; else None.
      scores: with ``output_scores=True``, one f32[B, V] tensor per generated
        position (``new`` of them): the processed scores of each row's token
        there, as ``generate`` returns them (:mod:`specjax.generate.outputs`;
        zeros where a row had ended); else None.
      logits: with ``output_logits=True``, the same layout with the target's raw
        logits; else None.
      logprobs: with ``output_logprobs=True``, f32[B, new]: each generated
        token's log-probability under its row's processed scores (NaN after the
        row ends); else None.
    """

    sequences: torch.Tensor
    stats: SpeculativeStats
    num_new_tokens: torch.Tensor
    state: LoopState | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    logprobs: torch.Tensor | None = None


@dataclass
class LoopState:
    """The loop's state after its last step (``speculative_generate(..., return_state=True)``).

    For tests and debugging. Cache row ``j`` belongs to batch row ``rows[j]``
    (finished rows may have been dropped). With ``seq`` that row's prompt
    (without padding) followed by its generated tokens:

    * ``target_cache`` holds ``seq[:-1]`` in its valid slots and ``last[j] == seq[-1]``;
    * with the ``model`` drafter, ``draft_cache`` holds ``seq`` minus its last
      few tokens, which are ``draft_pending[j]`` (at least one: the tokens the
      draft has not fed yet; more after steps that did not draft). For other
      drafters ``draft_cache`` is None and ``draft_pending`` empty.

    Attributes:
      target_cache, draft_cache: :class:`SlotCache` (draft_cache may be None).
      rows: list of B' ints.
      last: i64[B'].
      draft_pending: B' lists of token ids.
    """

    target_cache: SlotCache
    draft_cache: SlotCache | None
    rows: list[int]
    last: torch.Tensor
    draft_pending: list[list[int]]


_DROP_MIN_LEFT = 16  # sampled calls drop finished rows only while live ones have this many tokens to go


class _Row:
    """Host-side state of one request."""

    __slots__ = ("done", "generated", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self.generated: list[int] = []
        self.done = False


@dataclass
class _Scored:
    """A step's target forward: logits f[B', W+1, V] at ``[last, x_0 .. x_{W-1}]`` (torch), the hidden
    states the drafter reads (or None), where the scored positions start in the target cache, the forward's
    time (none for the plain step the prompt's forward scored).

    ``logits`` are what the verifier reads; ``raw_logits`` the target's before any logits
    processor (None: the same tensor as ``logits``).
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None
    start_slot: int
    forward: Spent
    raw_logits: torch.Tensor | None = None


class _Run:
    """One call's state and its steps (see the module docstring); arguments as :func:`run_loop`'s.

    ``greedy``: every row greedy with the built-in sampler (the greedy verifier's case);
    ``all_greedy``: every row greedy (what the schedule prices); ``compiles``: the call's
    :func:`~specjax.generate.compile_time.measure_compiles` clock (the steps' parts are timed without it).
    """

    def __init__(
        self,
        target: Any,
        drafter: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        sampling: SamplingState,
        config: LoopConfig,
        *,
        greedy: bool,
        all_greedy: bool,
        compiles: CompileClock,
        processors: LoopProcessors | None = None,
        grammar: GrammarRows | None = None,
    ) -> None:
        self.drafter, self.sampling, self.config = drafter, sampling, config
        self.compiles = compiles
        self.processors, self.grammar = processors, grammar
        self.grammar_s = 0.0  # the grammar's cut and merge of proposals (its masks are the processors')
        num_draft_tokens = config.num_draft_tokens
        self.device = input_ids.device
        batch, prompt_len = input_ids.shape
        self.stop = StopRule(config.eos_ids, config.stopping_criteria, input_ids)
        self.outputs = OutputRecorder(batch, config.outputs, greedy=greedy) if config.outputs else None
        self.rows = [_Row(i) for i in range(batch)]
        self.cache_rows = list(range(batch))  # original row index of each cache row
        self.stats = SpeculativeStats(drafter=str(getattr(drafter, "name", type(drafter).__name__)))
        self.who = checks.plugin_name("drafter", drafter, getattr(drafter, "name", None))
        self.trusted = type(drafter).__module__.startswith("specjax.drafters")
        self.tested = np.zeros(num_draft_tokens, np.int64)
        self.passed = np.zeros(num_draft_tokens, np.int64)
        self.gained_total = self.row_steps = self.step = 0
        # Every row greedy, with the built-in sampler: the step's result does not depend on the
        # draft's distribution or the keys (see verify.greedy_verify), and torch's argmax decides it.
        self.greedy = greedy
        # A drafter's confidence in its tokens (Proposal.confidence) prices each one: greedy, the
        # schedule tests what pays (the output is the target's argmax whatever is tested); with
        # sampling, it only stops the drafting token by token, and the count is chosen
        # sequentially (DraftSchedule.trim's ``asked``), since a count chosen from the drawn
        # tokens would bias the output.
        self.use_confidence = config.adaptive
        # Drafters whose proposals cost nothing (lookups) are asked every step.
        self.free_proposals = bool(
            getattr(drafter, "asks_every_step", float(getattr(drafter, "cost_per_token_hint", 1.0)) == 0.0)
        )

        self.t_cache = SlotCache(target, batch, self.device)
        self.hidden_layers = checks.hidden_layers(drafter, self.who, target) if self.needs_hidden else None
        prompt_hidden = None
        mask_h = attention_mask.bool().cpu().numpy()
        # No prefill forward of its own (one target forward fewer per call, as transformers'
        # assisted generation): all but the last prompt token go into the first verification
        # forward, which scores the last one with the first proposals. A drafter that reads the
        # target's hidden states needs the prompt's before it drafts: then the whole prompt is
        # scored at once, and the first step is a plain step on its last logits.
        self.prefix: tuple[torch.Tensor, np.ndarray, bool] | None = None
        self.first_scored: tuple[torch.Tensor, torch.Tensor] | None = None  # logits f[B, 1, V], hidden f[B, 1, d]
        if prompt_len > 1:
            if self.needs_hidden:
                logits0, hidden_all = self.t_cache.forward(input_ids, mask_h, last_only=True, hidden=self.hidden_layers)
                prompt_hidden = hidden_all[:, :-1]
                self.first_scored = (logits0, hidden_all[:, -1:])
            else:
                self.prefix = (input_ids[:, :-1], mask_h[:, :-1], bool(mask_h[:, :-1].all()))
        ids_h = input_ids.cpu().numpy()
        self.contexts = [ids_h[b][mask_h[b]].tolist() for b in range(batch)]
        drafter.start(
            DraftSetup(
                target,
                input_ids,
                attention_mask,
                [list(c) for c in self.contexts],
                config.target_vocab,
                num_draft_tokens,
                sampling,
                prompt_hidden,
            )
        )
        del prompt_hidden
        self.schedule = DraftSchedule(
            batch,
            num_draft_tokens,
            adaptive=config.adaptive,
            draft_cost_hint=float(getattr(drafter, "cost_per_token_hint", 0.003)),
            model=target,
            drafter_key=self.stats.drafter,
            greedy=all_greedy,
        )
        self.last = ids_h[:, -1].astype(np.int64).copy()  # i64[B']: last committed token, not in the target cache

    @property
    def needs_hidden(self) -> bool:
        return bool(getattr(self.drafter, "needs_target_hidden", False))

    def active(self) -> bool:
        return not all(r.done for r in self.rows)

    # 1. Plan ------------------------------------------------------------------------------------

    def plan(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(remaining, active, caps, want)``, i64/bool[B'] host arrays.

        A row may draft at most G tokens and never past ``max_new_tokens`` (the emitted
        token comes on top of the accepted ones): ``caps``. The schedule asks for ``want``
        tokens per row (what a drafter that pays per token drafts); free proposals (lookups)
        may go up to the cap.
        """
        state = [self.rows[i] for i in self.cache_rows]
        remaining = np.array([0 if r.done else self.config.max_new_tokens - len(r.generated) for r in state])
        active = remaining > 0
        caps = np.where(active, np.minimum(self.config.num_draft_tokens, np.maximum(remaining - 1, 0)), 0)
        plain = self.first_scored is not None  # the prompt's forward already scored a plain step
        want = np.zeros_like(caps) if plain else self.schedule.plan(caps, active, remaining)
        return remaining, active, caps, want

    # 2. Draft -----------------------------------------------------------------------------------

    def draft(
        self, remaining: np.ndarray, active: np.ndarray, caps: np.ndarray, want: np.ndarray, timed: Any
    ) -> tuple[DraftBatch, Spent]:
        """Ask the drafter (unless nothing is to be drafted), check its proposal, trim it to what is
        tested: the step's :class:`DraftBatch` and the drafter's time. ``timed()``: whether the step has
        compiled nothing so far (only such times are recorded)."""
        b_now = len(caps)
        if self.grammar is not None:  # the rows' committed tokens, for the grammar's cut of this step
            self.grammar.begin_step(self.cache_rows, [self.rows[i].generated for i in self.cache_rows])
        ask = self.first_scored is None and caps.max(initial=0) > 0 and (want.max(initial=0) > 0 or self.free_proposals)
        drafting = Spent()
        proposal: Proposal
        if ask:
            with timed_block(self.compiles) as drafting:
                proposal = self.drafter.propose(
                    DraftRequest(
                        self.step,
                        [self.contexts[i] for i in self.cache_rows],
                        want,
                        active,
                        self.sampling,
                        caps,
                        self.schedule.worth_drafting if self.use_confidence else None,
                        None if self.processors is None else self.processors.draft_hook(self.cache_rows, active),
                    )
                )
            check_proposal(
                self.who,
                proposal,
                caps,
                b_now,
                self.config.target_vocab,
                check_ids=not self.trusted,
                check_logits=not self.greedy,
            )
            paid = int(want.max()) if proposal.paid_tokens is None else int(proposal.paid_tokens)
            if timed():
                self.schedule.record_draft(paid, drafting.seconds)
            if proposal.hindsight is not None:
                self.schedule.record_hindsight(*proposal.hindsight)
            # (kept once seen: a hybrid drafter's steps where only lookups answer have none)
            self.schedule.confident |= self.use_confidence and proposal.confidence is not None
            if self.grammar is not None:
                t_cut = time.perf_counter()
                proposal = self.grammar_cut(proposal)
                self.grammar_s += time.perf_counter() - t_cut
        else:
            proposal = no_proposal(b_now)
        confidence = proposal.confidence if self.use_confidence else None
        # drawn tokens (see trim): what the row could propose whatever it drew
        asked = None if self.greedy or proposal.logits is None else (caps if self.free_proposals else want)
        k = np.minimum(
            self.schedule.trim(
                np.asarray(proposal.num_tokens, np.int64), active, proposal.free_rows, remaining, confidence, asked
            ),
            caps,
        )
        own = k
        if self.grammar is not None and self.first_scored is None:
            t_merge = time.perf_counter()
            proposal, k, own = self.grammar_extend(proposal, k, caps, active)
            self.grammar_s += time.perf_counter() - t_merge
            confidence = proposal.confidence if self.use_confidence else None
        g = int(k.max(initial=0))
        self.stats.draft_steps += int(g > 0)
        width = self.schedule.padded_width(g + 1) - 1 if g else 0  # >= g: filler columns are never tested
        batch = draft_batch(proposal, k, width, self.last, self.device, confidence)
        return dataclasses.replace(batch, own=own), drafting

    def grammar_cut(self, proposal: Proposal) -> Proposal:
        """The proposal with its point-mass rows cut at their first grammar-refused token (see
        :mod:`specjax.generate.grammar`; sampled rows are left to the masked verification)."""
        assert self.grammar is not None
        k = np.asarray(proposal.num_tokens, np.int64)
        if self.greedy or proposal.logits is None:
            point = np.ones(len(k), bool)
        elif proposal.point_mass_rows is not None:
            point = np.asarray(proposal.point_mass_rows, bool)
        else:
            return proposal
        if not (point & (k > 0)).any():
            return proposal
        cut = self.grammar.valid_prefix(to_host(proposal.tokens), k, point)
        return dataclasses.replace(proposal, num_tokens=cut)

    def grammar_extend(
        self, proposal: Proposal, k: np.ndarray, caps: np.ndarray, active: np.ndarray
    ) -> tuple[Proposal, np.ndarray, np.ndarray]:
        """The proposal with the tokens the grammar forces merged into its point-mass rows
        (:meth:`GrammarRows.forced_extension`), up to each row's cap: ``(proposal, k, own)``, the new
        counts and how many of them lead as the drafter proposed them (i64[B'] each).

        Rows verified as point masses (every row of a greedy call or of a proposal without draft
        logits; rows marked ``point_mass_rows``) and rows that test nothing are merged; a row with
        tokens drawn from draft logits is not (it draws the forced tokens anyway: its logits are
        masked too). Exact: a point-mass proposal may be any tokens fixed by the committed prefix
        (a row that tests nothing becomes one), and a forced token has masked target probability 1
        where the grammar forces it alone.
        """
        assert self.grammar is not None
        if self.greedy or proposal.logits is None:
            point = np.ones(len(k), bool)
        else:
            marked = proposal.point_mass_rows
            point = (np.zeros(len(k), bool) if marked is None else np.asarray(marked, bool)) | (k == 0)
        rows = point & active & (caps > 0)
        if not rows.any():
            return proposal, k, k
        g = int(k.max(initial=0))
        host = np.asarray(to_host(proposal.tokens), np.int64)[:, :g] if g else np.zeros((len(k), 0), np.int64)
        tokens, k2, own = self.grammar.forced_extension(host, k, rows, caps)
        if ((k2 == k) & (own == k)).all():
            return proposal, k, k
        g2, logits, conf = int(k2.max(initial=0)), proposal.logits, proposal.confidence
        masses = proposal.point_mass_rows
        if logits is not None:
            masses = (np.zeros(len(k), bool) if masses is None else np.asarray(masses, bool)) | (k2 > own)
            if masses[k2 > 0].all():  # no row tests a drawn token: every row a point mass
                logits, masses = None, None
            elif len(logits) < g2:  # positions only point-mass rows reach: never read
                logits = tuple(logits) + (logits[-1],) * (g2 - len(logits))
        if conf is not None:  # the drafter's confidence holds for its own tokens only
            wide = np.full((len(k), max(g2, conf.shape[1])), np.nan)
            wide[:, : conf.shape[1]] = conf
            conf = np.where(np.arange(wide.shape[1])[None, :] < own[:, None], wide, np.nan)
        extended = dataclasses.replace(proposal, tokens=tokens, logits=logits, point_mass_rows=masses, confidence=conf)
        return extended, k2, own

    # 3. Score -----------------------------------------------------------------------------------

    def score(self, batch: DraftBatch, active: np.ndarray) -> _Scored:
        """Score ``[last, x_0 .. x_{W-1}]`` in one target forward (after the prompt's prefix at the first step),
        its logits processed with each position's prefix when the call has logits processors."""
        scored = self._forward(batch, active)
        if self.processors is not None:
            scored.raw_logits = scored.logits  # output_logits returns the target's own logits
            scored.logits = self.processors.target(scored.logits, batch.tokens_t, batch.k, active, self.cache_rows)
        return scored

    def _forward(self, batch: DraftBatch, active: np.ndarray) -> _Scored:
        if self.first_scored is not None:  # the prompt's forward scored this plain step
            first, self.first_scored = self.first_scored, None
            return _Scored(first[0], first[1], self.t_cache.length - 1, Spent())
        width = batch.width
        t_in = torch.cat([torch.as_tensor(self.last, device=self.device)[:, None], batch.tokens_t], dim=1)
        t_valid, all_valid = np.broadcast_to(active[:, None], t_in.shape), bool(active.all())
        if self.prefix is not None:
            t_in = torch.cat([self.prefix[0], t_in], dim=1)
            t_valid = np.concatenate([self.prefix[1], t_valid], axis=1)
            all_valid = all_valid and self.prefix[2]
        start_slot = self.t_cache.length + t_in.shape[1] - (width + 1)
        with timed_block(self.compiles) as forward:
            out = self.t_cache.forward(
                t_in, t_valid, keep_last=width + 1, all_valid=all_valid, hidden=self.hidden_layers
            )
        hidden: torch.Tensor | None
        logits, hidden = out if self.needs_hidden else (out, None)
        if self.prefix is None:  # a merged prefill would price verification far too high
            self.schedule.record_verify(width + 1, forward.seconds)
        self.prefix = None
        return _Scored(logits, hidden, start_slot, forward)

    # 5. Commit ----------------------------------------------------------------------------------

    def commit(self, batch: DraftBatch, scored: _Scored, n: np.ndarray, tokens: np.ndarray) -> None:
        """Each row appends its ``n_b`` accepted tokens and the emitted one, cut where the stopping
        rule (EOS, stop strings, criteria: :mod:`specjax.generate.stopping`) ends the row, and stops at
        ``max_new_tokens``; the target cache drops the rejected slots; the drafter and the schedule
        learn the outcome."""
        stats, on_tokens = self.stats, self.config.on_tokens
        stats.steps += 1
        b_now = len(batch.k)
        kept = np.zeros(b_now, np.int64)  # accepted draft tokens each row keeps (a stop may cut them)
        runs = [[] if self.rows[i].done else tokens[j, : int(n[j]) + 1].tolist() for j, i in enumerate(self.cache_rows)]
        stops = self.stop.cut(self.cache_rows, [self.rows[i].generated for i in self.cache_rows], runs)
        emitted_rows: list[list[int]] = []
        for j, i in enumerate(self.cache_rows):
            row = self.rows[i]
            if row.done:
                emitted_rows.append([])
                continue
            n_j, k_j, own_j = int(n[j]), int(batch.k[j]), int(batch.own_k[j])
            stats.draft_tokens_proposed += k_j
            stats.draft_tokens_accepted += n_j
            stats.forced_tokens_proposed += k_j - own_j
            stats.forced_tokens_accepted += max(n_j - own_j, 0)
            self.tested[: min(n_j + 1, k_j)] += 1
            self.passed[:n_j] += 1
            emitted, at = runs[j], stops[j]
            if at is not None:
                emitted = emitted[: at + 1]
                row.done = True
            row.generated.extend(emitted)
            self.contexts[row.index].extend(emitted)
            if len(row.generated) >= self.config.max_new_tokens:
                row.done = True
            self.gained_total += len(emitted)
            self.row_steps += 1
            if on_tokens is not None:
                on_tokens(row.index, emitted)
            kept[j] = len(emitted) - 1
            self.last[j] = emitted[-1]
            emitted_rows.append(emitted)
        if self.processors is not None:
            self.processors.commit(self.cache_rows, emitted_rows)
        if self.outputs is not None:
            raw = scored.logits if scored.raw_logits is None else scored.raw_logits
            self.outputs.record(self.cache_rows, emitted_rows, raw, scored.logits, self.sampling.params)
        scored.logits = scored.raw_logits = None  # type: ignore[assignment]  # the torch buffers are free again
        # the target fed [last, x_0 .. x_{width-1}]: last and the kept draft tokens stay
        self.t_cache.invalidate(scored.start_slot, 1 + kept)
        # the drafter and the schedule learn from the drafter's own tokens (the forced ones follow them)
        own_n = np.minimum(n, batch.own_k)
        self.drafter.commit(CommitInfo(emitted_rows, own_n, batch.own_k, scored.hidden))
        self.schedule.record_outcome(batch.own_k, own_n, batch.free_rows, batch.confidence)
        self.step += 1

    # 6. Shrink ----------------------------------------------------------------------------------

    def shrink(self) -> None:
        """Drop finished rows from the caches once at least half of them are done, halving the batch.

        B, B/2, B/4, ... rows, finished ones filling in. With sampling, every batch size
        compiles the jitted steps again, for each draft width: there the rows are dropped
        only while the live ones have ``_DROP_MIN_LEFT`` tokens to go (rows that end within a
        few tokens of each other otherwise met a new batch size in each of the last steps, at
        a fraction of a second of compilation each).
        """
        b_now = len(self.cache_rows)
        live = [j for j, i in enumerate(self.cache_rows) if not self.rows[i].done]
        if not live or len(live) > b_now // 2:
            return
        to_go = max(self.config.max_new_tokens - len(self.rows[self.cache_rows[j]].generated) for j in live)
        if not self.greedy and to_go < _DROP_MIN_LEFT:
            return
        size = b_now // 2
        while size // 2 >= len(live):
            size //= 2
        finished = [j for j, i in enumerate(self.cache_rows) if self.rows[i].done]
        keep = sorted(live + finished[: size - len(live)])
        self.t_cache.select_rows(np.asarray(keep, np.int64))
        self.drafter.select_rows(keep)
        self.schedule.select_rows(keep)
        self.cache_rows = [self.cache_rows[j] for j in keep]
        self.last = self.last[keep]
        # per-row parameters and keys follow their rows (gathered once per change)
        import jax.numpy as jnp

        self.sampling = self.sampling.select(jnp.asarray(np.asarray(keep, np.int32)))


def _compiled_nothing(compiles: Any, before: float) -> bool:
    """Whether no JAX compilation happened since ``before`` (a step that compiles is not timed for the schedule)."""
    return bool(compiles.seconds == before)


def run_loop(
    target: Any,
    drafter: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: SamplingState,
    config: LoopConfig,
    *,
    started: tuple[float, float] | None = None,
    processors: LoopProcessors | None = None,
    grammar: GrammarRows | None = None,
) -> SpeculativeOutput:
    """The loop proper; arguments are already validated by :func:`speculative_generate`.

    ``drafter`` follows :class:`specjax.drafters.Drafter`; ``sampling`` holds the
    per-row parameters and keys; ``config`` the call's settings. Finished rows
    stay in the caches until they are dropped, but append no valid slots.
    ``started``: ``(time.perf_counter() at the caller's start, seconds it spent
    compiling)``, so that the statistics' times cover the caller's setup too
    (default: from this call's start). ``processors``: the call's logits
    processors (:mod:`specjax.generate.processors`), or None; ``grammar``: the grammar among them
    (:class:`~specjax.generate.grammar.GrammarRows`), whose matchers cut point-mass proposals, or None.
    Both hold state that changes with every step (prefixes, matchers, timings), so they are
    arguments beside the frozen ``config``, not fields of it.
    """
    from specjax.adapters import count_copies

    t_start, setup_compile_s = started if started is not None else (time.perf_counter(), 0.0)
    all_greedy = bool(np.all(np.asarray(sampling.temperature) == 0))
    greedy = config.sampler is None and all_greedy
    verify: Verifier = choose_verifier(config.sampler, greedy, int(input_ids.shape[0]), config.num_draft_tokens)
    with count_copies() as copies, measure_compiles() as compiles:
        run = _Run(
            target,
            drafter,
            input_ids,
            attention_mask,
            sampling,
            config,
            greedy=greedy,
            all_greedy=all_greedy,
            compiles=compiles,
            processors=processors,
            grammar=grammar,
        )
        while run.active():
            with timed_block(compiles) as step:
                timed = functools.partial(_compiled_nothing, compiles, compiles.seconds)
                remaining, active, caps, want = run.plan()  # 1.
                batch, drafting = run.draft(remaining, active, caps, want, timed)  # 2.
                scored = run.score(batch, active)  # 3.
                n, tokens = verify(batch, scored.logits, run.sampling, run.step)  # 4.
                check_step_output("the verification step", n, tokens, batch.k, config.target_vocab)
                run.commit(batch, scored, n, tokens)  # 5.
            # the step's time besides drafting and the target forward (verification, bookkeeping,
            # the drafter's commit), apart for steps that verified drafts and plain ones; each part
            # counts in the stats without its compilation (one-time work, in compile_time_s)
            rest = step.minus(drafting, scored.forward)
            run.stats.draft_time_s += drafting.net
            run.stats.target_time_s += scored.forward.net
            run.stats.loop_time_s += rest.net
            if timed():
                run.schedule.record_overhead(rest.seconds, drafted=batch.g > 0)
            run.shrink()  # 6.

    stats = run.stats
    stats.target_forwards = run.t_cache.forwards
    d_cache = getattr(drafter, "cache", None)
    stats.draft_forwards = d_cache.forwards if isinstance(d_cache, SlotCache) else 0
    stats.adapter_copies = copies.copies
    stats.processor_time_s = (processors.seconds if processors is not None else 0.0) + run.grammar_s
    stats.processor_calls = processors.calls if processors is not None else 0
    stats.compile_time_s = setup_compile_s + compiles.seconds
    _finish_stats(stats, run.tested, run.passed, run.gained_total, run.row_steps, run.rows, t_start)
    out = _build_output(input_ids, run.rows, config.pad_token_id, stats)
    if run.outputs is not None:
        out.scores, out.logits, out.logprobs = run.outputs.finish(out.sequences.shape[1] - input_ids.shape[1])
    if config.return_state:
        pending = getattr(drafter, "pending", None)
        out.state = LoopState(
            run.t_cache,
            d_cache,
            run.cache_rows,
            torch.as_tensor(run.last, device=run.device),
            [list(p) for p in pending] if pending is not None else [],
        )
    return out


def _finish_stats(stats, tested, passed, gained_total, row_steps, rows, t_start) -> None:
    stats.new_tokens = sum(len(r.generated) for r in rows)
    proposed = stats.draft_tokens_proposed
    stats.acceptance_rate = stats.draft_tokens_accepted / proposed if proposed else 0.0
    stats.mean_accepted_length = gained_total / row_steps if row_steps else 0.0
    stats.tokens_per_target_forward = stats.new_tokens / stats.target_forwards if stats.target_forwards else 0.0
    stats.acceptance_rate_per_position = [float(p / t) if t else 0.0 for p, t in zip(passed, tested, strict=True)]
    stats.tests_per_position = [int(t) for t in tested]
    stats.wall_time_s = time.perf_counter() - t_start
    decoding_s = stats.wall_time_s - stats.compile_time_s
    stats.tokens_per_s = stats.new_tokens / decoding_s if decoding_s > 0 else 0.0


def _build_output(input_ids: torch.Tensor, rows: list[_Row], pad_token_id: int, stats) -> SpeculativeOutput:
    width = max((len(r.generated) for r in rows), default=0)
    out = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=input_ids.device)
    for r in rows:
        if r.generated:
            out[r.index, : len(r.generated)] = torch.as_tensor(r.generated, dtype=torch.long)
    counts = torch.as_tensor([len(r.generated) for r in rows], dtype=torch.long)
    return SpeculativeOutput(torch.cat([input_ids.long(), out], dim=1), stats, counts)
