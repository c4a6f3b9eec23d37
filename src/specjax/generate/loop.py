"""Speculative generation over Hugging Face draft and target models.

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
   first and the first step is a plain step on its last logits.
3. **Verify.** Draft and target logits cross to JAX zero-copy
   (:func:`specjax.adapters.jit_input`: DLPack on GPU, a NumPy view that XLA:CPU
   reads in place on a CPU-only JAX); the sampler decides ``n`` and draws the
   correction/bonus token; the int32 tokens come back to torch.
4. **Commit.** Each row appends its ``n`` accepted tokens and the emitted token,
   stops at EOS or ``max_new_tokens``; both caches mark the rejected slots
   invalid (see :mod:`specjax.slots`).

Host synchronisation: once per sampled draft draw (the drawn token ids are the next
draft input, and torch's CPU/CUDA forward needs them; on GPU this is a device
round trip only for the tiny (B,) token tensor, which stays on the device;
greedy drafts are torch argmaxes, read on the host once per step) and
once per step after verification (the per-row accepted counts decide the
bookkeeping: EOS, lengths, cache masks). Logits never leave the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, Proposal, SamplingState
from specjax.generate import checks
from specjax.generate.checks import check_step_output
from specjax.generate.compile_time import measure_compiles
from specjax.generate.schedule import DraftSchedule
from specjax.kernels.greedy import accept_greedy
from specjax.slots import SlotCache, to_host


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
    """

    sequences: torch.Tensor
    stats: SpeculativeStats
    num_new_tokens: torch.Tensor
    state: LoopState | None = None


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


def run_loop(
    target: Any,
    drafter: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    sampling: SamplingState,
    eos_ids: set[int],
    pad_token_id: int,
    target_vocab: int,
    sampler: Any,
    on_tokens: Any = None,
    return_state: bool = False,
    adaptive: bool = True,
    started: tuple[float, float] | None = None,
) -> SpeculativeOutput:
    """The loop proper; arguments are already validated by :func:`speculative_generate`.

    ``drafter`` follows :class:`specjax.drafters.Drafter`; ``sampling`` holds the
    per-row parameters and keys; ``sampler`` is None for the fused JAX path,
    else a callable with the :func:`specjax.rejection_sample` contract.
    ``adaptive`` chooses the draft length per step from measured costs
    (:mod:`specjax.generate.schedule`); False drafts ``num_draft_tokens`` every
    step (fewer only where ``max_new_tokens`` allows fewer). Finished rows stay
    in the caches until they are dropped, but append no valid slots.
    ``started``: ``(time.perf_counter() at the caller's start, seconds it spent
    compiling)``, so that the statistics' times cover the caller's setup too
    (default: from this call's start).
    """
    import jax
    import jax.numpy as jnp

    from specjax.adapters import count_copies, jit_input
    from specjax.kernels import steps

    t_start, setup_compile_s = started if started is not None else (time.perf_counter(), 0.0)
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    rows = [_Row(i) for i in range(batch)]
    cache_rows = list(range(batch))  # original row index of each cache row
    stats = SpeculativeStats(drafter=str(getattr(drafter, "name", type(drafter).__name__)))
    who = checks.plugin_name("drafter", drafter, getattr(drafter, "name", None))
    trusted = type(drafter).__module__.startswith("specjax.drafters")
    tested = np.zeros(num_draft_tokens, np.int64)
    passed = np.zeros(num_draft_tokens, np.int64)
    gained_total = 0
    row_steps = 0

    with count_copies() as copies, measure_compiles() as compiles:
        t_cache = SlotCache(target, batch, device)
        hidden_kw = bool(getattr(drafter, "needs_target_hidden", False))
        hidden_layers = checks.hidden_layers(drafter, who, target) if hidden_kw else None
        prompt_hidden = None
        mask_h = attention_mask.bool().cpu().numpy()
        # No prefill forward of its own (one target forward fewer per call, as transformers'
        # assisted generation): all but the last prompt token go into the first verification
        # forward, which scores the last one with the first proposals. A drafter that reads the
        # target's hidden states needs the prompt's before it drafts: then the whole prompt is
        # scored at once, and the first step is a plain step on its last logits.
        prefix: tuple[torch.Tensor, np.ndarray, bool] | None = None
        first_scored: tuple[torch.Tensor, torch.Tensor] | None = None  # logits f[B, 1, V], hidden f[B, 1, d]
        if prompt_len > 1:
            if hidden_kw:
                logits0, hidden_all = t_cache.forward(input_ids, mask_h, last_only=True, hidden=hidden_layers)
                prompt_hidden = hidden_all[:, :-1]
                first_scored = (logits0, hidden_all[:, -1:])
            else:
                prefix = (input_ids[:, :-1], mask_h[:, :-1], bool(mask_h[:, :-1].all()))
        ids_h = input_ids.cpu().numpy()
        contexts = [ids_h[b][mask_h[b]].tolist() for b in range(batch)]
        drafter.start(
            DraftSetup(
                target,
                input_ids,
                attention_mask,
                [list(c) for c in contexts],
                target_vocab,
                num_draft_tokens,
                sampling,
                prompt_hidden,
            )
        )
        del prompt_hidden
        schedule = DraftSchedule(
            batch,
            num_draft_tokens,
            adaptive=adaptive,
            draft_cost_hint=float(getattr(drafter, "cost_per_token_hint", 0.003)),
            model=target,
            drafter_key=stats.drafter,
            greedy=bool(np.all(np.asarray(sampling.temperature) == 0)),
        )
        last_h = ids_h[:, -1].astype(np.int64).copy()  # i64[B']: last committed token, not in the target cache

        # Drafters whose proposals cost nothing (lookups) are asked every step.
        free_proposals = bool(
            getattr(drafter, "asks_every_step", float(getattr(drafter, "cost_per_token_hint", 1.0)) == 0.0)
        )
        # Every row greedy, with the built-in sampler: the step's result does not depend on the
        # draft's distribution or the keys (see greedy_verify), and torch's argmax decides it.
        greedy = sampler is None and bool(np.all(np.asarray(sampling.temperature) == 0))
        # A drafter's confidence in its tokens (Proposal.confidence) prices each one: greedy, the
        # schedule tests what pays (the output is the target's argmax whatever is tested); with
        # sampling, it only stops the drafting token by token, and the count is chosen
        # sequentially (DraftSchedule.trim's ``asked``), since a count chosen from the drawn
        # tokens would bias the output.
        use_confidence = adaptive
        step = 0
        while not all(r.done for r in rows):
            t_step = time.perf_counter()
            compiled_before = compiles.seconds  # a step that compiles is not timed for the schedule
            state = [rows[i] for i in cache_rows]
            b_now = len(state)
            remaining = np.array([0 if r.done else max_new_tokens - len(r.generated) for r in state])
            active_h = remaining > 0
            all_active = bool(active_h.all())  # host copies of the validity: no device sync
            # A row may draft at most G tokens and never past max_new_tokens (the
            # emitted token comes on top of the accepted ones).
            caps = np.where(active_h, np.minimum(num_draft_tokens, np.maximum(remaining - 1, 0)), 0)

            # 1. Draft: the schedule asks for `want` tokens per row (what a drafter that pays
            # per token drafts); free proposals (lookups) may go up to the row's cap.
            want = schedule.plan(caps, active_h, remaining) if first_scored is None else np.zeros_like(caps)
            draft_s = 0.0
            if first_scored is None and caps.max(initial=0) > 0 and (want.max(initial=0) > 0 or free_proposals):
                t_draft = time.perf_counter()
                proposal = drafter.propose(
                    DraftRequest(
                        step,
                        [contexts[i] for i in cache_rows],
                        want,
                        active_h,
                        sampling,
                        caps,
                        schedule.worth_drafting if use_confidence else None,
                    )
                )
                draft_s = time.perf_counter() - t_draft
                _check_proposal(
                    who, proposal, caps, b_now, target_vocab, check_ids=not trusted, check_logits=not greedy
                )
                paid = int(want.max()) if proposal.paid_tokens is None else int(proposal.paid_tokens)
                if compiles.seconds == compiled_before:
                    schedule.record_draft(paid, draft_s)
                if proposal.hindsight is not None:
                    schedule.record_hindsight(*proposal.hindsight)
                # (kept once seen: a hybrid drafter's steps where only lookups answer have none)
                schedule.confident |= use_confidence and proposal.confidence is not None
            else:
                proposal = Proposal(np.zeros((b_now, 0), np.int32), np.zeros(b_now, np.int64), None)
            free_rows = proposal.free_rows
            confidence = proposal.confidence if use_confidence else None
            # drawn tokens (see trim): what the row could propose whatever it drew
            asked = None if greedy or proposal.logits is None else (caps if free_proposals else want)
            k_rows = np.minimum(
                schedule.trim(
                    np.asarray(proposal.num_tokens, np.int64), active_h, free_rows, remaining, confidence, asked
                ),
                caps,
            )
            stats.draft_steps += int(k_rows.max(initial=0) > 0)
            g = int(k_rows.max(initial=0))
            width = schedule.padded_width(g + 1) - 1 if g else 0  # >= g: filler columns are never tested
            x_t, x_j = _draft_columns(proposal.tokens, k_rows, g, width, last_h, device, jnp)

            # 2. Score [last, x_0 .. x_{width-1}] in one target forward (after the prompt's
            # prefix at the first step).
            t_in = torch.cat([torch.as_tensor(last_h, device=device)[:, None], x_t], dim=1)
            t_valid, all_valid = np.broadcast_to(active_h[:, None], t_in.shape), all_active
            if prefix is not None:
                t_in, t_valid = torch.cat([prefix[0], t_in], dim=1), np.concatenate([prefix[1], t_valid], axis=1)
                all_valid = all_valid and prefix[2]
            hidden: torch.Tensor | None
            if first_scored is not None:  # the prompt's forward scored this plain step
                (target_logits, hidden), first_scored = first_scored, None
                t_start_slot, forward_s = t_cache.length - 1, 0.0
            else:
                t_start_slot = t_cache.length + t_in.shape[1] - (width + 1)
                t_fwd = time.perf_counter()
                out_fwd = t_cache.forward(t_in, t_valid, keep_last=width + 1, all_valid=all_valid, hidden=hidden_layers)
                target_logits, hidden = out_fwd if hidden_kw else (out_fwd, None)
                forward_s = time.perf_counter() - t_fwd
                if prefix is None:  # a merged prefill would price verification far too high
                    schedule.record_verify(width + 1, forward_s)
                prefix = None

            # 3. Verify.
            s = sampling
            if greedy:
                n_host, tok_host = greedy_verify(x_t, target_logits, k_rows)
            else:
                tj = jit_input(target_logits)
                d_logits = None
                if proposal.logits is not None and g:
                    d_logits = tuple(jit_input(x) if isinstance(x, torch.Tensor) else x for x in proposal.logits[:g])
                    d_logits += (d_logits[-1],) * (width - g)
                if sampler is None:
                    # shapes from a few buckets: each new (B', width) compiles the step anew
                    xb, db, tb, kb, pb, nb = _bucketed(
                        x_j, d_logits, target_logits, s.keys, s.params, k_rows, batch, num_draft_tokens + 2, jnp
                    )
                    tb = tj if tb is target_logits else jit_input(tb)
                    result = steps.verify_step(xb, db, tb, kb, step, pb, nb)
                    n_j, tok_j = result.num_accepted[:b_now], result.tokens[:b_now, : width + 1]
                    del tb
                else:
                    n_j, tok_j = _run_sampler(sampler, x_j, d_logits, tj, s, step, k_rows)
                tok_host = np.asarray(jax.block_until_ready(tok_j))  # i32[B', width+1]: the one host sync per step
                n_host = np.asarray(n_j).astype(np.int64)
                del d_logits, tj  # JAX has finished reading the torch buffers
            check_step_output("the verification step", n_host, tok_host, k_rows, target_vocab)
            del target_logits

            # 4. Commit.
            stats.steps += 1
            kept = np.zeros(b_now, np.int64)  # accepted draft tokens each row keeps (EOS may cut them)
            emitted_rows: list[list[int]] = []
            for j, row in enumerate(state):
                if row.done:
                    emitted_rows.append([])
                    continue
                n, k = int(n_host[j]), int(k_rows[j])
                stats.draft_tokens_proposed += k
                stats.draft_tokens_accepted += n
                tested[: min(n + 1, k)] += 1
                passed[:n] += 1
                emitted = tok_host[j, : n + 1].tolist()
                if eos_ids:
                    for e_i, tkn in enumerate(emitted):
                        if tkn in eos_ids:
                            emitted = emitted[: e_i + 1]
                            row.done = True
                            break
                row.generated.extend(emitted)
                contexts[row.index].extend(emitted)
                if len(row.generated) >= max_new_tokens:
                    row.done = True
                gained_total += len(emitted)
                row_steps += 1
                if on_tokens is not None:
                    on_tokens(row.index, emitted)
                kept[j] = len(emitted) - 1
                last_h[j] = emitted[-1]
                emitted_rows.append(emitted)
            # the target fed [last, x_0 .. x_{width-1}]: last and the kept draft tokens stay
            t_cache.invalidate(t_start_slot, 1 + kept)
            drafter.commit(CommitInfo(emitted_rows, n_host, k_rows, hidden))
            schedule.record_outcome(k_rows, n_host, free_rows, confidence)
            step += 1
            # the step's time besides drafting and the target forward (verification, bookkeeping,
            # the drafter's commit), apart for steps that verified drafts and plain ones
            if compiles.seconds == compiled_before:
                schedule.record_overhead(time.perf_counter() - t_step - draft_s - forward_s, drafted=g > 0)

            # Drop finished rows from the caches once at least half of them are done, halving
            # the batch (B, B/2, B/4, ... rows, finished ones filling in). With sampling, every
            # batch size compiles the jitted steps again, for each draft width: there the rows
            # are dropped only while the live ones have _DROP_MIN_LEFT tokens to go (rows that
            # end within a few tokens of each other otherwise met a new batch size in each of
            # the last steps, at a fraction of a second of compilation each).
            live = [j for j, i in enumerate(cache_rows) if not rows[i].done]
            if (
                live
                and len(live) <= b_now // 2
                and (greedy or max(max_new_tokens - len(state[j].generated) for j in live) >= _DROP_MIN_LEFT)
            ):
                size = b_now // 2
                while size // 2 >= len(live):
                    size //= 2
                finished = [j for j, i in enumerate(cache_rows) if rows[i].done]
                keep = sorted(live + finished[: size - len(live)])
                t_cache.select_rows(np.asarray(keep, np.int64))
                drafter.select_rows(keep)
                schedule.select_rows(keep)
                cache_rows = [cache_rows[j] for j in keep]
                last_h = last_h[keep]
                # per-row parameters and keys follow their rows (gathered once per change)
                sampling = sampling.select(jnp.asarray(np.asarray(keep, np.int32)))

    stats.target_forwards = t_cache.forwards
    d_cache = getattr(drafter, "cache", None)
    stats.draft_forwards = d_cache.forwards if isinstance(d_cache, SlotCache) else 0
    stats.adapter_copies = copies.copies
    stats.compile_time_s = setup_compile_s + compiles.seconds
    _finish_stats(stats, tested, passed, gained_total, row_steps, rows, t_start)
    out = _build_output(input_ids, rows, pad_token_id, stats)
    if return_state:
        pending = getattr(drafter, "pending", None)
        out.state = LoopState(
            t_cache,
            d_cache,
            cache_rows,
            torch.as_tensor(last_h, device=device),
            [list(p) for p in pending] if pending is not None else [],
        )
    return out


def _check_proposal(
    who: str, proposal: Any, want: np.ndarray, batch: int, vocab: int, *, check_ids: bool, check_logits: bool
) -> None:
    """A drafter's proposal: shapes, ``0 <= k_b <= max_tokens[b]``, (third-party drafters) ids in [0, V),
    and, with ``check_logits`` (sampled steps), draft logits that are distributions the tokens came from."""
    if not isinstance(proposal, Proposal):
        raise checks.PluginOutputError(
            f"{who} returned {type(proposal).__name__}, expected a specjax.drafters.Proposal"
        )
    k = np.asarray(proposal.num_tokens)
    if k.shape != (batch,) or not np.issubdtype(k.dtype, np.integer):
        raise checks.PluginOutputError(
            f"{who} returned num_tokens of shape {k.shape} and dtype {k.dtype}, expected integers of shape ({batch},)"
        )
    over = np.nonzero((k < 0) | (k > want))[0]
    if over.size:
        r = int(over[0])
        raise checks.PluginOutputError(
            f"{who} proposed {int(k[r])} tokens for row {r}, expected at most {int(want[r])} (and at least 0)"
        )
    shape = tuple(getattr(proposal.tokens, "shape", ()))
    if len(shape) != 2 or shape[0] != batch or shape[1] < int(k.max(initial=0)):
        raise checks.PluginOutputError(
            f"{who} returned tokens of shape {shape}, expected ({batch}, G) with G >= {int(k.max(initial=0))}"
        )
    if proposal.logits is not None:
        if not isinstance(proposal.logits, tuple | list) or len(proposal.logits) < int(k.max(initial=0)):
            count = len(proposal.logits) if isinstance(proposal.logits, tuple | list) else type(proposal.logits)
            raise checks.PluginOutputError(
                f"{who} returned {count} logits arrays for {int(k.max(initial=0))} draft positions, expected a "
                "tuple with one f[B, V] array per position"
            )
    if proposal.free_rows is not None:
        free = np.asarray(proposal.free_rows)
        if free.shape != (batch,) or free.dtype != np.bool_:
            raise checks.PluginOutputError(
                f"{who} returned free_rows of shape {free.shape} and dtype {free.dtype}, expected bool of shape "
                f"({batch},)"
            )
    if proposal.confidence is not None:
        conf = np.asarray(proposal.confidence)
        if (
            conf.ndim != 2
            or conf.shape[0] != batch
            or conf.shape[1] < int(k.max(initial=0))
            or not np.issubdtype(conf.dtype, np.floating)
            or bool(((conf < 0) | (conf > 1)).any())
        ):
            raise checks.PluginOutputError(
                f"{who} returned confidence of shape {conf.shape} and dtype {conf.dtype}, expected floats in "
                f"[0, 1] (or NaN) of shape ({batch}, G) with G >= {int(k.max(initial=0))}"
            )
    if proposal.hindsight is not None:
        hits, tests = (np.asarray(a) for a in proposal.hindsight)
        if (
            hits.shape != (batch,)
            or tests.shape != (batch,)
            or not all(np.issubdtype(a.dtype, np.integer) for a in (hits, tests))
            or bool(((hits < 0) | (hits > tests)).any())
        ):
            raise checks.PluginOutputError(
                f"{who} returned hindsight of shapes {hits.shape} and {tests.shape}, expected two integer arrays "
                f"of shape ({batch},) with 0 <= hits <= tests"
            )
    host = checks.check_draft_output(who, proposal.tokens, batch, shape[1], vocab, k) if check_ids else None
    if proposal.logits is not None:
        if check_logits and host is None:
            host = to_host(proposal.tokens)
        checks.check_draft_logits(
            who, proposal.logits, host if host is not None else np.zeros((batch, 0)), k, batch, values=check_logits
        )


def _buckets(limit: int) -> list[int]:
    """Sizes 1, 2, 3, 5, 9, 17, ... (one more than powers of two) up to ``limit``, and ``limit``."""
    sizes, n = [1, 2], 1
    while sizes[-1] < limit:
        n *= 2
        sizes.append(min(n + 1, limit))
    return sizes


def _bucketed(
    x_j: Any,
    d_logits: tuple[Any, ...] | None,
    target_logits: torch.Tensor,
    keys: Any,
    params: Any,
    k_rows: np.ndarray,
    batch: int,
    max_width: int,
    jnp: Any,
) -> tuple[Any, tuple[Any, ...] | None, torch.Tensor, Any, Any, np.ndarray]:
    """The sampled verification's inputs padded to a bucketed (rows, positions) shape.

    ``verify_step`` compiles once per shape, and the adaptive length and rows
    that finish meet many (B' rows x width + 1 positions): the drafters report's
    B = 8 sampled rows on input-grounded prompts paid seconds of compilation in
    their timed calls (``compile_s``). Rows are padded to a power of two (at most
    ``batch``), positions to one of :func:`_buckets` (at most ``max_width``),
    with copies of row 0 and of the last position that test nothing (``k`` = 0
    for the added rows); a row's draws depend on its own key and ``k_b`` only
    (:func:`specjax.kernels.steps.sampling_uniform`), so the padding changes no
    token. Returns ``(draft tokens, draft logits, target logits (torch),
    keys, params, k i32[B''])``; the target logits are the input itself when
    no padding is needed.
    """
    b, w1 = target_logits.shape[:2]
    rows = min(batch, 1 << max(b - 1, 0).bit_length())
    cols = next(size for size in _buckets(max_width) if size >= w1)
    k = np.zeros(rows, np.int32)
    k[:b] = k_rows
    if rows == b and cols == w1:
        return x_j, d_logits, target_logits, keys, params, k
    row_idx = np.concatenate([np.arange(b), np.zeros(rows - b, np.int64)])
    pos_idx = np.minimum(np.arange(cols), w1 - 1)
    t = target_logits[torch.as_tensor(row_idx)[:, None], torch.as_tensor(pos_idx)[None, :]]
    x = np.zeros((rows, cols - 1), np.int32)  # token 0 where nothing is tested
    x[:b, : w1 - 1] = np.asarray(x_j)
    d = None
    if d_logits is not None:
        d = tuple(jnp.asarray(a)[row_idx] for a in d_logits)
        d += (d[-1],) * (cols - 1 - len(d))
    return x, d, t, keys[row_idx], _take_rows(params, row_idx), k


def _take_rows(params: Any, rows: Any) -> Any:
    """The per-row fields of a :class:`SamplingParams` at ``rows`` (its static fields stay)."""
    import jax

    return jax.tree.map(lambda a: a[rows], params)


def _draft_columns(
    tokens: Any, k_rows: np.ndarray, g: int, width: int, last_h: np.ndarray, device: torch.device, jnp: Any
) -> tuple[torch.Tensor, Any]:
    """The draft columns as torch i64[B', width] (target input) and i32[B', width] (verify input: JAX or NumPy).

    Row b's entries at positions >= k_b (and the filler columns past g) are its
    last token (``last_h``, i64[B']): a valid id that is never tested. Tokens
    held in host memory (NumPy, or a torch or JAX array on the CPU) are
    assembled with NumPy; device arrays stay on their device.
    """
    from specjax.adapters import host_array, to_torch

    b = len(last_h)
    if width == 0:
        return torch.zeros((b, 0), dtype=torch.long, device=device), np.zeros((b, 0), np.int32)
    used = np.arange(width)[None, :] < k_rows[:, None]
    host = host_array(tokens)
    if host is not None:
        cols = np.empty((b, width), np.int64)
        cols[:, :g] = host[:, :g]
        cols = np.where(used, cols, last_h[:, None])
        # NumPy for the verification: the jitted call takes it in its fast path (jnp.asarray: ~0.3 ms here)
        return torch.as_tensor(cols, device=device), cols.astype(np.int32)
    fill = torch.as_tensor(last_h, device=device)[:, None]
    if isinstance(tokens, torch.Tensor):
        x = tokens[:, :g].to(device=device, dtype=torch.long)
        x = torch.cat([x, fill.expand(b, width - g)], dim=1)
        x_t = torch.where(torch.as_tensor(used, device=device), x, fill)
        return x_t, jnp.asarray(x_t.cpu().numpy().astype(np.int32))
    x = jnp.asarray(tokens)[:, :g].astype(jnp.int32)
    fill_j = jnp.asarray(last_h.astype(np.int32))[:, None]
    if width > g:
        x = jnp.concatenate([x, jnp.broadcast_to(fill_j, (b, width - g))], axis=1)
    x = jnp.where(jnp.asarray(used), x, fill_j)
    return to_torch(x).to(torch.long), x


def greedy_verify(
    draft: torch.Tensor, target_logits: torch.Tensor, k_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The acceptance step when every row is greedy (temperature 0), from torch's argmax.

    :func:`specjax.kernels.greedy.accept_greedy` on the first argmax of the
    target's logits: :func:`specjax.kernels.steps.verify_step`'s result for any
    draft distribution and any keys (``tests/test_greedy_verify.py`` compares
    them), at the cost of one max over the logits, where the JAX step
    summarises every row and syncs (docs/design.md, "Host synchronisation").

    Args:
      draft: i64[B', W] draft tokens (torch, any device).
      target_logits: f[B', W+1, V] (torch, same device).
      k_rows: i64[B'] host array, ``k_b`` in [0, W].

    Returns:
      ``(n, tokens)``: i64[B'] accepted counts and i32[B', W+1] tokens, -1 after
      each row's ``n_b + 1`` tokens (the kernel's output contract).
    """
    # the first maximum (torch's max over a dim returns the first index on ties, as
    # argmax does, and runs 2.5 times faster here over V = 49152)
    best = target_logits.max(dim=-1).indices.cpu().numpy()
    return accept_greedy(draft.cpu().numpy(), best, k_rows)


def _run_sampler(sampler, xj, draft_logits, tj, s: SamplingState, step, k_rows):
    """A probabilities-contract sampler, called once per distinct draft length in the batch."""
    import jax.numpy as jnp

    from specjax.kernels import steps

    q, p, u = steps.probs_step(draft_logits, tj, s.keys, step, s.params)
    xj = jnp.asarray(xj)
    b, g = xj.shape
    n_out = np.zeros((b,), np.int32)
    tok_out = np.full((b, g + 1), -1, np.int32)
    for k in sorted(set(int(v) for v in k_rows)):
        idx = np.nonzero(k_rows == k)[0]
        ji = jnp.asarray(idx)
        # row b's sampling uniform is u[b, k_b] (steps.sampling_uniform), not u[b, g]
        q_k = None if q is None else q[ji, :k]
        res = sampler(xj[ji, :k], q_k, p[ji, : k + 1], u[ji, :k], u[ji, k], validate=False)
        n_out[idx] = to_host(res.num_accepted)
        tok_out[idx, : k + 1] = to_host(res.tokens)
    return jnp.asarray(n_out), jnp.asarray(tok_out)


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
