"""Speculative generation over Hugging Face draft and target models.

One step, for every active row at once (Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318):

1. **Draft.** The draft model feeds its pending tokens (the tokens committed last
   step that it has not seen: one or two per row) and then proposes G tokens
   autoregressively; each draw goes through :func:`steps.draft_draw`, the
   front end's processing (temperature / top-k / top-p / greedy), so the draft
   tokens come from exactly the ``q`` the acceptance test will use.
2. **Score.** The target model scores ``[last committed token, x_0 .. x_{G-1}]``
   in one forward pass: G+1 distributions ``p_0 .. p_G``.
3. **Verify.** Draft and target logits cross to JAX zero-copy
   (:func:`specjax.adapters.jit_input`: DLPack on GPU, a NumPy view that XLA:CPU
   reads in place on a CPU-only JAX); the sampler decides ``n`` and draws the
   correction/bonus token; the int32 tokens come back to torch.
4. **Commit.** Each row appends its ``n`` accepted tokens and the emitted token,
   stops at EOS or ``max_new_tokens``; both caches mark the rejected slots
   invalid (see :mod:`specjax.generate.slots`).

Host synchronisation: once per draft draw (the drawn token ids are the next
draft input, and torch's CPU/CUDA forward needs them; on GPU this is a device
round trip only for the tiny (B,) token tensor, which stays on the device) and
once per step after verification (the per-row accepted counts decide the
bookkeeping: EOS, lengths, cache masks). Logits never leave the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specjax.generate.checks import check_step_output
from specjax.generate.compile_time import measure_compiles
from specjax.generate.slots import SlotCache


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
      adapter_copies: copies the torch→JAX adapters had to make.
      new_tokens: tokens generated (all rows).
      wall_time_s: wall-clock time of the call.
      compile_time_s: the part of it spent compiling JAX functions (one-time work
        for shapes not seen before; 0 when every shape was seen).
      tokens_per_s: new_tokens / (wall_time_s - compile_time_s): decoding speed
        without one-time compilation.
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
    adapter_copies: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    compile_time_s: float = 0.0
    tokens_per_s: float = 0.0

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
    * ``draft_cache`` holds ``seq`` minus its last few tokens, which are
      ``draft_pending[j]`` (one or two; three after a final step that did not draft).

    Attributes:
      target_cache, draft_cache: :class:`SlotCache`.
      rows: list of B' ints.
      last: i64[B'].
      draft_pending: B' lists of token ids.
    """

    target_cache: SlotCache
    draft_cache: SlotCache
    rows: list[int]
    last: torch.Tensor
    draft_pending: list[list[int]]


class _Row:
    """Host-side state of one request."""

    __slots__ = ("done", "generated", "index")

    def __init__(self, index: int) -> None:
        self.index = index
        self.generated: list[int] = []
        self.done = False


def run_loop(
    target: Any,
    draft: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    num_draft_tokens: int,
    params: tuple[Any, Any, Any, bool, bool],
    row_keys: Any,
    eos_ids: set[int],
    pad_token_id: int,
    target_vocab: int,
    sampler: Any,
    on_tokens: Any = None,
    return_state: bool = False,
) -> SpeculativeOutput:
    """The loop proper; arguments are already validated by :func:`speculative_generate`.

    ``params`` is ``(temperature f32[B], top_k i32[B], one_minus_top_p f32[B],
    use_top_k, use_top_p)``; ``sampler`` is None for the fused JAX path, else a
    callable with the :func:`specjax.rejection_sample` contract. Finished rows
    stay in the caches until they are dropped, but append no valid slots.
    """
    import jax
    import jax.numpy as jnp

    from specjax.adapters import count_copies, jit_input, to_torch
    from specjax.generate import steps

    t_start = time.perf_counter()
    device = input_ids.device
    batch, prompt_len = input_ids.shape
    rows = [_Row(i) for i in range(batch)]
    cache_rows = list(range(batch))  # original row index of each cache row
    stats = SpeculativeStats()
    tested = np.zeros(num_draft_tokens, np.int64)
    passed = np.zeros(num_draft_tokens, np.int64)
    gained_total = 0
    row_steps = 0
    temperature, top_k, one_minus_top_p, use_top_k, use_top_p = params

    with count_copies() as copies, measure_compiles() as compiles:
        t_cache = SlotCache(target, batch, device)
        # The target may emit ids the draft cannot embed (vocabularies that differ by
        # padding); the draft then sees id 0 there, which only affects its proposals.
        d_embed = draft.get_input_embeddings().weight.shape[0]
        d_cache = SlotCache(draft, batch, device, input_vocab=d_embed if d_embed < target_vocab else None)
        if prompt_len > 1:
            # Prefill all but the last prompt token: the target scores that one with
            # the first draft, and the draft feeds it first.
            prompt_valid = attention_mask[:, :-1].bool()
            t_cache.forward(input_ids[:, :-1], prompt_valid, last_only=True)
            d_cache.forward(input_ids[:, :-1], prompt_valid, last_only=True)
        # Host-side bookkeeping (NumPy, rebuilt as tensors once per step):
        last_h = input_ids[:, -1].cpu().numpy().copy()  # i64[B']: last committed token, not in the target cache
        pend0_h = last_h.copy()  # i64[B']: a second pending draft token, where pend0_valid_h
        pend0_valid_h = np.zeros(batch, bool)  # the draft also still has to see last_h (always pending)

        unfed: dict[int, list[int]] = {}  # pending tokens a step without drafting (the last) left unfed
        step = 0
        row_t, row_k, row_p, keys = temperature, top_k, one_minus_top_p, row_keys
        while not all(r.done for r in rows):
            state = [rows[i] for i in cache_rows]
            b_now = len(state)
            remaining = np.array([0 if r.done else max_new_tokens - len(r.generated) for r in state])
            active = torch.as_tensor(remaining > 0, device=device)[:, None]  # bool[B', 1]
            all_active = bool(np.all(remaining > 0))  # host copies of the validity: no device sync
            k_rows = np.minimum(num_draft_tokens, np.maximum(remaining - 1, 0))
            g = int(k_rows.max())
            last = torch.as_tensor(last_h, device=device)

            # 1. Draft: the pending tokens, then g autoregressive draws.
            d_start = d_cache.length
            if pend0_valid_h.any():
                feed = torch.as_tensor(np.stack([pend0_h, last_h], axis=1), device=device)
                feed_valid = torch.as_tensor(np.stack([pend0_valid_h, np.ones(b_now, bool)], axis=1),
                                             device=device) & active
                feed_all_valid = all_active and bool(pend0_valid_h.all())
            else:
                feed, feed_valid, feed_all_valid = last[:, None], active, all_active
            width0 = feed.shape[1] if g else 0  # with g = 0 the draft does not run: its pending tokens stay
            draft_x: list[Any] = []
            draft_logits: list[Any] = []
            x_feeds: list[torch.Tensor] = []
            held: list[torch.Tensor] = []  # torch buffers JAX reads: kept until verify is done
            for i in range(g):
                logits = d_cache.forward(feed, feed_valid, last_only=True, all_valid=feed_all_valid)[:, 0]
                held.append(logits)
                lj = jit_input(logits)
                draft_logits.append(lj)
                x = steps.draft_draw(lj, keys, step, i + 1, row_t, row_k, row_p, vocab=target_vocab,
                                     use_top_k=use_top_k, use_top_p=use_top_p)
                draft_x.append(x)
                feed = to_torch(x).to(torch.long)[:, None]
                feed_valid, feed_all_valid = active, all_active
                x_feeds.append(feed)

            # 2. Score: [last, x_0 .. x_{g-1}] in one target forward.
            t_start_slot = t_cache.length
            t_in = torch.cat([last[:, None], *x_feeds], dim=1)
            target_logits = t_cache.forward(t_in, active.expand(t_in.shape), last_only=False, all_valid=all_active)
            held.append(target_logits)
            tj = jit_input(target_logits)

            # 3. Verify.
            if sampler is None:
                # the draft tokens go in as a tuple and k as host numbers: no eager JAX op here
                result = steps.verify_step(tuple(draft_x), tuple(draft_logits), tj, keys, step, row_t, row_k,
                                           row_p, k_rows.astype(np.int32),
                                           use_top_k=use_top_k, use_top_p=use_top_p)
                n_j, tok_j = result["num_accepted"], result["tokens"]
            else:
                xj = jnp.stack(draft_x, axis=1) if g else jnp.zeros((b_now, 0), jnp.int32)
                n_j, tok_j = _run_sampler(sampler, xj, tuple(draft_logits), tj, keys, step, row_t, row_k, row_p,
                                          k_rows, use_top_k, use_top_p)
            tok_host = np.asarray(jax.block_until_ready(tok_j))  # i32[B', g+1]: the one host sync per step
            n_host = np.asarray(n_j).astype(np.int64)
            check_step_output("the verification step", n_host, tok_host, k_rows, target_vocab)
            del held, draft_logits, tj  # JAX has finished reading the torch buffers

            # 4. Commit.
            stats.steps += 1
            kept = np.zeros(b_now, np.int64)  # accepted draft tokens each row keeps (EOS may cut them)
            for j, row in enumerate(state):
                if row.done:
                    continue
                if not g:
                    unfed[row.index] = [int(pend0_h[j])] * bool(pend0_valid_h[j]) + [int(last_h[j])]
                pend0_valid_h[j] = False
                n, k = int(n_host[j]), int(k_rows[j])
                stats.draft_tokens_proposed += k
                stats.draft_tokens_accepted += n
                reached = min(n + 1, k)
                tested[:reached] += 1
                passed[:n] += 1
                emitted = tok_host[j, : n + 1].tolist()
                if eos_ids:
                    for e_i, tkn in enumerate(emitted):
                        if tkn in eos_ids:
                            emitted = emitted[: e_i + 1]
                            row.done = True
                            break
                row.generated.extend(emitted)
                if len(row.generated) >= max_new_tokens:
                    row.done = True
                gained_total += len(emitted)
                row_steps += 1
                if on_tokens is not None:
                    on_tokens(row.index, emitted)
                kept[j] = m = len(emitted) - 1
                last_h[j] = emitted[-1]
                if g and m == g:  # x_{g-1} was accepted but never fed to the draft
                    pend0_h[j] = tok_host[j, g - 1]
                    pend0_valid_h[j] = True
            n_t = torch.as_tensor(kept, device=device)
            # the target fed [last, x_0 .. x_{g-1}]: last and the kept draft tokens stay
            t_cache.invalidate(t_start_slot, 1 + n_t)
            if g:
                # the draft fed its pending chunk (all of it stays) and x_0 .. x_{g-2}
                d_cache.invalidate(d_start + width0, torch.clamp(n_t, max=g - 1))
            step += 1

            # Drop finished rows from the caches once at least half of them are done
            # (fewer distinct batch sizes, so fewer recompilations).
            live = [j for j, i in enumerate(cache_rows) if not rows[i].done]
            if live and len(live) <= b_now // 2:
                idx = torch.as_tensor(live, device=device)
                t_cache.select_rows(idx)
                d_cache.select_rows(idx)
                cache_rows = [cache_rows[j] for j in live]
                last_h, pend0_h, pend0_valid_h = last_h[live], pend0_h[live], pend0_valid_h[live]
                # per-row parameters and keys follow their rows (gathered once per change)
                select = jnp.asarray(np.asarray(cache_rows, np.int32))
                row_t, row_k, row_p = temperature[select], top_k[select], one_minus_top_p[select]
                keys = row_keys[select]

    stats.target_forwards = t_cache.forwards
    stats.draft_forwards = d_cache.forwards
    stats.adapter_copies = copies.copies
    stats.compile_time_s = compiles.seconds
    _finish_stats(stats, tested, passed, gained_total, row_steps, rows, t_start)
    out = _build_output(input_ids, rows, pad_token_id, stats)
    if return_state:
        draft_pending = [
            [*unfed.get(i, [int(pend0_h[j])] * bool(pend0_valid_h[j])), int(last_h[j])]
            for j, i in enumerate(cache_rows)
        ]
        out.state = LoopState(t_cache, d_cache, cache_rows, torch.as_tensor(last_h, device=device), draft_pending)
    return out


def _run_sampler(sampler, xj, draft_logits, tj, keys, step, row_t, row_k, row_p, k_rows, use_top_k, use_top_p):
    """A probabilities-contract sampler, called once per distinct draft length in the batch."""
    import jax.numpy as jnp

    from specjax.generate import steps

    q, p, u = steps.probs_step(draft_logits, tj, keys, step, row_t, row_k, row_p,
                               use_top_k=use_top_k, use_top_p=use_top_p)
    b, g = xj.shape
    n_out = np.zeros((b,), np.int32)
    tok_out = np.full((b, g + 1), -1, np.int32)
    for k in sorted(set(int(v) for v in k_rows)):
        idx = np.nonzero(k_rows == k)[0]
        ji = jnp.asarray(idx)
        # row b's sampling uniform is u[b, k_b] (steps.sampling_uniform), not u[b, g]
        res = sampler(xj[ji, :k], q[ji, :k], p[ji, : k + 1], u[ji, :k], u[ji, k], validate=False)
        n_out[idx] = np.asarray(_host(res["num_accepted"]))
        tok_out[idx, : k + 1] = np.asarray(_host(res["tokens"]))
    return jnp.asarray(n_out), jnp.asarray(tok_out)


def _host(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _finish_stats(stats, tested, passed, gained_total, row_steps, rows, t_start) -> None:
    stats.new_tokens = sum(len(r.generated) for r in rows)
    stats.acceptance_rate = stats.draft_tokens_accepted / stats.draft_tokens_proposed if stats.draft_tokens_proposed else 0.0
    stats.mean_accepted_length = gained_total / row_steps if row_steps else 0.0
    stats.tokens_per_target_forward = stats.new_tokens / stats.target_forwards if stats.target_forwards else 0.0
    stats.acceptance_rate_per_position = [float(p / t) if t else 0.0 for p, t in zip(passed, tested, strict=True)]
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
