"""The speculative loop on JAX's devices (a TPU through torchax): each step one jitted program.

:func:`speculative_generate` takes this path when the target's weights live on
torchax's ``jax`` device (``model.to("jax")`` under torchax; docs/torchax.md).
Both models run as pure JAX functions (:mod:`specjax.generate.jax_model`) with
static-shape KV caches, and one step is one ``jax.jit`` program:

1. **Draft** (the ``model`` drafter): the draft model feeds the row's previous
   and last committed tokens, then draws G tokens autoregressively (a
   ``lax.scan``), each through :func:`specjax.kernels.steps.draft_draw`, so
   ``q`` is exactly what the acceptance step recomputes. A lookup drafter
   (``ngram``, or any drafter proposing point masses without the target's
   hidden states) proposes from the committed tokens (``ngram`` on the device,
   :func:`~specjax.drafters.ngram.jax_lookup`; others on the host), and its
   tokens are the program's input. The ``hybrid`` drafter does both: rows
   with an n-gram match propose their lookups (point masses, fed to the draft
   model too), the draft model draws for the others, in the same program.
2. **Score**: the target's forward over ``[last, x_0 .. x_{G-1}]``.
3. **Verify**: :func:`specjax.kernels.steps.verify_step` on the target's
   logits as they are (the same ``jax.Array``, never leaving the device).

With a host drafter (a lookup drafter other than the built-in ``ngram``, alone
or in a hybrid) the host reads the int32 ``(num_accepted, tokens)`` of each
step, nothing else, and does the bookkeeping: EOS, ``max_new_tokens``, each
row's position (the next step starts right after its last committed token,
overwriting the slots of rejected drafts: :mod:`specjax.generate.jax_model`).
With the ``model``, ``ngram`` and ``hybrid(ngram, model)`` drafters nothing
needs the host between steps, so the steps run **device-resident**
(:func:`resident_steps`): a ``lax.while_loop`` over the same step program with
the same bookkeeping on the device (per-row positions, emitted lengths, EOS,
``max_new_tokens``, an i32[B, max_new_tokens] output buffer, per-step counts,
and for the n-gram lookups each row's prompt and emitted tokens) until every
row is done; the host then reads the int32 tokens and per-step counts once and
accounts for the steps' stats at once, or with ``on_tokens`` replays each step's
stats and calls (reading every :data:`STREAM_STEPS` steps, so the callback
streams). The two paths give the
same outputs and stats; :func:`per_step_loop` selects the per-step path for
those drafters. The eagle head runs device-resident only
(:func:`eagle_and_verify`, :func:`eagle_commit`; docs/torchax.md says how it
differs from the CPU drafter). The rules both use are written once:
:func:`emitted_lengths`, :func:`next_positions` (numpy or jax.numpy).

Shapes are fixed for a call: a drafted step drafts G tokens for every row (a
row tests only its ``k_b = min(G, tokens left - 1)``; finished rows ride along,
their outputs ignored), so a call compiles its step once, and rows are not
dropped. With ``adaptive`` (the default) the device-resident loop chooses, step
by step and for the whole batch, between a drafted step and a plain one (a step
testing no draft token, its drafting cut to the first token: :func:`drafts_next`,
in the one program), from the acceptance so far and a drafted step's measured
cost in plain steps (:func:`_calibrated`, once per program); ``adaptive=False``,
the per-step path and the first call of a program draft every step. Randomness
is the CPU path's: row keys folded with the step number and the draft position
(:mod:`specjax.kernels.steps`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from specjax.adapters.jax_view import torchax_array
from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter
from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, SamplingState
from specjax.drafters.eagle import EagleDrafter, check_head
from specjax.drafters.ngram import jax_lookup
from specjax.generate import checks
from specjax.generate.compile_time import measure_compiles
from specjax.generate.draft_batch import check_proposal
from specjax.generate.jax_eagle import HeadCache, JaxHead, jax_head, scored_ids
from specjax.generate.jax_model import JaxModel, KVCache, jax_model
from specjax.generate.loop import (
    LoopConfig,
    SpeculativeOutput,
    SpeculativeStats,
    _build_output,
    _finish_stats,
    _Row,
)
from specjax.generate.schedule import call_gains
from specjax.kernels import steps
from specjax.kernels.types import SamplingParams

__all__ = [
    "STREAM_STEPS",
    "EagleState",
    "Resident",
    "check_jax_call",
    "draft_and_verify",
    "eagle_and_verify",
    "eagle_commit",
    "emitted_lengths",
    "greedy_decode",
    "host_ids",
    "lookup_and_verify",
    "lookup_inputs",
    "next_positions",
    "per_step_loop",
    "prefill",
    "resident_steps",
    "run_jax_loop",
]

_POSITION_BLOCK = 128  # caches are sized in blocks of positions, so that nearby lengths share a compilation


# Recompiles when the model, B or the prompt's width change.
@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",))
def prefill(model: JaxModel, weights: dict[str, jax.Array], cache: KVCache, tokens: jax.Array) -> KVCache:
    """Write ``tokens`` (i32[B, P']) at positions ``0 .. P'-1`` of every row; returns the cache."""
    _, cache = model.forward(weights, cache, tokens, jnp.zeros(tokens.shape[0], jnp.int32), 1)
    return cache


def _unless_plain(go: jax.Array | None, drafted: Any, cache: Any, last: jax.Array) -> tuple[Any, jax.Array, jax.Array]:
    """``drafted(cache)`` -> ``(cache, tokens i32[B, G], logits f[G, B, V])``: a drafter's G tokens. With ``go``
    False (bool[]; the schedule's plain step) none of it runs: the cache as it was, the tokens ``last``
    (i32[B]; filler, no row tests them), the logits zeros. The skip is a loop of 0 or 1 trips, not a
    ``lax.cond``: XLA updates a loop's carry in place, where a cond copied the caches it carries (three
    copies a step)."""
    if go is None:
        return drafted(cache)
    shapes = jax.eval_shape(drafted, cache)
    init = (cache, jnp.broadcast_to(last[:, None], shapes[1].shape).astype(shapes[1].dtype),
            jnp.zeros(shapes[2].shape, shapes[2].dtype))  # fmt: skip
    return lax.fori_loop(0, go.astype(jnp.int32), lambda _, c: drafted(c[0]), init)


def _catch_up(draft: JaxModel, d_weights, d_cache, context: jax.Array, start: jax.Array) -> KVCache:
    """The draft cache with each row's committed tokens at positions ``start - C + 1 .. start`` (C =
    :data:`_CATCH_UP`; from 0 for a row with fewer), read from ``context`` (i32[B, W], the row's prompt and
    emitted tokens, token p at position p): one forward of C positions, its logits unused. What the plain
    steps since the last drafted one did not write (a plain step does not run the draft model); positions
    past ``start`` get filler, which the next forward overwrites before any query sees it."""
    first = jnp.maximum(start - (_CATCH_UP - 1), 0)
    pos = first[:, None] + jnp.arange(_CATCH_UP, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(context, jnp.minimum(pos, context.shape[1] - 1), axis=1)
    tokens = jnp.where(pos <= start[:, None], tokens, 0).astype(jnp.int32)
    _, d_cache = draft.forward(d_weights, d_cache, tokens, first, 1)
    return d_cache


def _draft(
    draft: JaxModel, d_weights, d_cache, prev, last, start, row_keys, step, params, forced, use, g, vocab, go=None,
    context=None, behind=None,
):  # fmt: skip
    """G draft tokens i32[B, G] and their logits (a tuple of G f[B, V]); the draft cache after.

    Rows with ``use[b]`` take ``forced[b]`` (lookups) instead of drawing and feed those tokens, so the
    draft's cache holds what the row proposed either way; their logits are the draft model's, never read
    (the acceptance step verifies those rows as point masses: ``point_mass_rows``). ``go`` False (bool[]; the
    schedule's plain step): the draft model does not run; the tokens are ``last`` (filler: no row tests
    them), the logits zeros. ``behind`` (bool[], with ``context``, see :func:`_catch_up`): plain steps came
    before this one, so the draft cache first catches up on the tokens they committed.
    """

    def pick(q, i):  # the drawn token, or the row's forced one; purpose i + 1
        drawn = steps.draft_draw(q, row_keys, step, i + 1, params, vocab=vocab)
        return (drawn if use is None else jnp.where(use, forced[:, i], drawn)), q

    def one(carry, i):  # feed x_{i-1} at position start + i, then x_i
        cache, x = carry
        out, cache = draft.forward(d_weights, cache, x[:, None], start + i, 1)
        nxt, q = pick(out[:, -1], i)
        return (cache, nxt), (nxt, q)

    def drafted(cache: Any) -> tuple[Any, jax.Array, jax.Array]:
        if behind is not None:  # a loop of 0 or 1 trips (XLA updates a loop's carry in place; a cond copies)
            cache = lax.fori_loop(
                0, behind.astype(jnp.int32), lambda _, c: _catch_up(draft, d_weights, c, context, start), cache
            )
        logits, cache = draft.forward(d_weights, cache, jnp.stack([prev, last], axis=1), start - 1, 1)
        x0, q0 = pick(logits[:, -1], 0)
        (cache, _), (xs, qs) = lax.scan(one, (cache, x0), jnp.arange(1, g, dtype=jnp.int32))
        return cache, jnp.concatenate([x0[:, None], xs.T], axis=1), jnp.concatenate([q0[None], qs], axis=0)

    d_cache, tokens, q = _unless_plain(go, drafted, d_cache, last)
    return tokens, tuple(q[i] for i in range(g)), d_cache


# Recompiles when a model, B, G, the cache's length or params' static fields change; never per step.
@functools.partial(jax.jit, static_argnames=("target", "draft", "g", "vocab"), donate_argnames=("t_cache", "d_cache"))
def draft_and_verify(
    target: JaxModel,
    draft: JaxModel,
    t_weights: dict[str, jax.Array],
    d_weights: dict[str, jax.Array],
    t_cache: KVCache,
    d_cache: KVCache,
    prev: jax.Array,
    last: jax.Array,
    start: jax.Array,
    row_keys: jax.Array,
    step: jax.Array,
    params: SamplingParams,
    k: jax.Array,
    forced: jax.Array | None,
    use: jax.Array | None,
    go: jax.Array | None = None,
    context: jax.Array | None = None,
    behind: jax.Array | None = None,
    *,
    g: int,
    vocab: int,
) -> tuple[jax.Array, jax.Array, KVCache, KVCache]:
    """One step with the ``model`` (or ``hybrid``) drafter: draft G tokens, the target's forward, the acceptance
    step.

    Args:
      prev, last: i32[B], each row's last two committed tokens (``prev`` at position ``start - 1``,
        re-fed so that the draft's cache holds every committed token; any id when ``start`` is 0).
      start: i32[B], the position of ``last``.
      row_keys: key[B]; step: i32[]; params: :class:`SamplingParams` of B rows.
      k: i32[B], ``k_b`` in [0, G]: the draft tokens row b tests.
      forced: i32[B, G], use: bool[B]: rows with ``use`` propose ``forced`` (the hybrid drafter's lookups)
        as point masses instead of the draft model's draws; the acceptance step takes ``use`` as its
        ``point_mass_rows``, the CPU hybrid's rule. Both None for the model drafter (every row drawn; a
        separate compilation, and the acceptance step's paths for draft logits alone).
      go: bool[] or None: False runs no draft (the schedule's plain step; ``k`` is then 0 for every row).
        None: always drafts (the per-step path).
      context, behind: i32[B, W] and bool[] (the device-resident loop): each row's committed tokens, and
        whether plain steps came before this one (the draft cache then catches up first: :func:`_catch_up`).
      g: G; vocab: the target's vocabulary size V.

    Returns:
      ``(num_accepted i32[B], tokens i32[B, G+1], t_cache, d_cache)`` (tokens as the kernel's:
      accepted draft tokens, the emitted one, then -1).
    """
    x, q, d_cache = _draft(
        draft,
        d_weights,
        d_cache,
        prev,
        last,
        start,
        row_keys,
        step,
        params,
        forced,
        use,
        g,
        vocab,
        go,
        context,
        behind,
    )
    logits, t_cache = target.forward(t_weights, t_cache, jnp.concatenate([last[:, None], x], axis=1), start, None)
    out = steps.verify_step(x, q, logits, row_keys, step, params, k, use)
    return out.num_accepted, out.tokens, t_cache, d_cache


# Recompiles when the target, B, G, the cache's length or params' static fields change.
@functools.partial(jax.jit, static_argnames=("target",), donate_argnames=("t_cache",))
def lookup_and_verify(
    target: JaxModel,
    t_weights: dict[str, jax.Array],
    t_cache: KVCache,
    x: jax.Array,
    last: jax.Array,
    start: jax.Array,
    row_keys: jax.Array,
    step: jax.Array,
    params: SamplingParams,
    k: jax.Array,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One step with host proposals ``x`` (i32[B, G], point masses): the target's forward and the acceptance
    step; arguments and results as :func:`draft_and_verify`'s."""
    logits, t_cache = target.forward(t_weights, t_cache, jnp.concatenate([last[:, None], x], axis=1), start, None)
    out = steps.verify_step(x, None, logits, row_keys, step, params, k)
    return out.num_accepted, out.tokens, t_cache


class EagleState(NamedTuple):
    """The eagle head's state in the device-resident loop.

    Attributes:
      cache: the head's :data:`~specjax.generate.jax_eagle.HeadCache`.
      feature: f[B, d], the head's prediction at each row's last committed pair (z of its last token).
      pairs: i32[B], the pairs each row has in the cache (the next pair's number).
      has_feature: bool[B], rows that draft: from the second step on (every active row emits in the first).
    """

    cache: HeadCache
    feature: jax.Array
    pairs: jax.Array
    has_feature: jax.Array


def eagle_and_verify(
    target: JaxModel,
    head: JaxHead,
    t_weights: dict[str, jax.Array],
    h_weights: dict[str, jax.Array],
    t_cache: KVCache,
    state: EagleState,
    last: jax.Array,
    start: jax.Array,
    row_keys: jax.Array,
    step: jax.Array,
    params: SamplingParams,
    k: jax.Array,
    go: jax.Array | None = None,
    *,
    g: int,
    vocab: int,
) -> tuple[jax.Array, jax.Array, KVCache, EagleState, jax.Array]:
    """One step with the eagle head (pure; traced in :func:`resident_steps`): G tokens from the head, each
    drawn by :func:`specjax.kernels.steps.draft_draw` from its logits over the scored tokens (the CPU
    drafter's; greedy: their argmax), the drafted pairs ``(predicted feature, E x_i)`` at the row's next pair
    numbers; the target's forward with its hidden states; the acceptance step.

    ``go`` (bool[] or None) as :func:`draft_and_verify`'s: False (a plain step) drafts nothing.

    Returns ``(num_accepted i32[B], tokens i32[B, G+1], t_cache, state, hidden f[B, G+1, k·d])``, hidden the
    target's states at ``[last, x_0 .. x_{G-1}]`` (for :func:`eagle_commit`).
    """

    def pick(logits: jax.Array, i: Any) -> jax.Array:
        return steps.draft_draw(logits, row_keys, step, i + 1, params, vocab=vocab)

    def one(carry, i):  # the head on (feature_{i-1}, E x_{i-1}) at pair pairs + i - 1, then x_i
        cache, f, x = carry
        out, cache = head.forward(h_weights, cache, f[:, None], head.embed(h_weights, x)[:, None], state.pairs + i - 1)
        q = head.logits(h_weights, out[:, 0])
        nxt = pick(q, i)
        return (cache, out[:, 0], nxt), (nxt, q)

    def drafted(cache):
        q0 = head.logits(h_weights, state.feature)
        x0 = pick(q0, 0)
        (cache, _, _), (xs, qs) = lax.scan(one, (cache, state.feature, x0), jnp.arange(1, g, dtype=jnp.int32))
        return cache, jnp.concatenate([x0[:, None], xs.T], axis=1), jnp.concatenate([q0[None], qs], axis=0)

    cache, x, q = _unless_plain(go, drafted, state.cache, last)  # a plain step drafts nothing
    tokens_in = jnp.concatenate([last[:, None], x], axis=1)
    logits, t_cache, hidden = target.forward_hidden(t_weights, t_cache, tokens_in, start, None, head.layers)
    out = steps.verify_step(x, tuple(q[i] for i in range(g)), logits, row_keys, step, params, k)
    return out.num_accepted, out.tokens, t_cache, state._replace(cache=cache), hidden


def eagle_commit(
    head: JaxHead, h_weights: dict[str, jax.Array], state: EagleState, hidden: jax.Array, tokens: jax.Array, e: Any
) -> EagleState:
    """The head over a step's committed pairs ``(z_j, E tokens[j])``, j < ``e[b]`` (i[B], the emitted
    counts), at each row's next pair numbers (over its drafted pairs); each row's feature becomes the
    head's output at its last one (rows that emitted nothing keep theirs)."""
    feats, embeds = head.fuse(h_weights, hidden), head.embed(h_weights, jnp.maximum(tokens, 0))
    out, cache = head.forward(h_weights, state.cache, feats, embeds, state.pairs)
    picked = jnp.take_along_axis(out, jnp.maximum(e - 1, 0)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
    emitted = e > 0
    return EagleState(
        cache, jnp.where(emitted[:, None], picked, state.feature), state.pairs + e, state.has_feature | emitted
    )


def emitted_lengths(xp: Any, tokens: Any, n: Any, active: Any, count: Any, max_new: Any, eos: Any) -> tuple[Any, Any]:
    """What each row emits from a verification: the rule of both loops (``xp``: numpy on the host, jax.numpy
    in the device-resident loop).

    Row b's step gave ``tokens[b, : n[b] + 1]`` (accepted draft tokens, then the emitted one); it keeps them
    up to and including the first EOS, and no more than ``max_new - count[b]``.

    Args:
      tokens: i[B, G+1]; n: i[B]; active: bool[B] (rows still generating this step); count: i[B], the
        tokens each row has; max_new: ``max_new_tokens`` (an int, or i32[]); eos: i[E], the EOS ids (E may be 0).

    Returns:
      ``(e i[B], ends bool[B])``: tokens emitted (0 for inactive rows), and the rows this step ends (EOS
      among the row's tokens, or ``max_new`` reached).
    """
    j = xp.arange(tokens.shape[1])[None, :]
    hit = (tokens[:, :, None] == eos[None, None, :]).any(axis=-1) & (j <= n[:, None])
    has_eos = hit.any(axis=1)
    upto = xp.where(has_eos, xp.argmax(hit, axis=1) + 1, n + 1)
    e = xp.where(active, xp.minimum(upto, max_new - count), 0)
    return e, active & (has_eos | (count + e >= max_new))


def next_positions(xp: Any, tokens: Any, n: Any, active: Any, prev: Any, last: Any, start: Any) -> tuple[Any, ...]:
    """Each active row's ``(prev, last, start)`` (i[B] each) after its step (``tokens`` i[B, G+1], ``n`` i[B]):
    its last two committed tokens and the position of the last (all ``n + 1`` tokens count, those past an
    EOS too: a finished row is never read again); inactive rows keep theirs."""
    at = lambda i: xp.take_along_axis(tokens, i[:, None], axis=1)[:, 0]  # noqa: E731
    new_prev = xp.where(n > 0, at(xp.maximum(n - 1, 0)), last)
    return (
        xp.where(active, new_prev, prev).astype(prev.dtype),
        xp.where(active, at(n), last).astype(last.dtype),
        xp.where(active, start + n + 1, start).astype(start.dtype),
    )


def lookup_inputs(xp: Any, found_x: Any, found: Any, last: Any, caps: Any, fused: bool) -> tuple[Any, Any, Any]:
    """A step's inputs from its lookups: the rule of both loops (``xp``: numpy on the host, jax.numpy in the
    device-resident loop).

    Args:
      found_x: i[B, G], each row's lookup (any ids past ``found``); found: i[B], its length (0: no match),
        at most ``caps``; last: i[B], each row's last committed token; caps: i[B], the most tokens each
        row may test; fused: whether a draft model drafts the rows without a match (the hybrid).

    Returns:
      ``(x i[B, G], k i[B], use bool[B])``: the proposals, the lookups' tokens with ``last`` as filler (a
      valid id, never tested); the tokens each row tests, ``found`` (the hybrid's model rows: ``caps``);
      the rows that propose their lookup.
    """
    tested = xp.arange(found_x.shape[1])[None, :] < found[:, None]
    use = found > 0
    x = xp.where(tested, found_x, last[:, None]).astype(last.dtype)
    return x, (xp.where(use, found, caps) if fused else found), use


class Resident(NamedTuple):
    """The device-resident loop's carry (:func:`resident_steps`); M = ``max_new_tokens``.

    Attributes:
      t_cache: the target's cache; draft: the drafter's state (the draft model's cache; for the eagle
        head, :data:`EagleState`).
      prev, last, start: i32[B], as :func:`draft_and_verify` takes them.
      length: i32[B], tokens each row has emitted; done: bool[B], rows that ended (EOS or M tokens).
      out: i32[B, M'], each row's tokens (``out[b, :length[b]]``; the rest is not read), M' >= M rounded up
        to a block of positions.
      context, context_len: with a lookup drafter (``ngram``, ``hybrid``) or a draft model, i32[B, W] and
        i32[B]: each row's prompt and emitted tokens (``context[b, :context_len[b]]``, what the host's n-gram
        index holds; token p at position p, what a draft model catches up from), W >= the longest prompt + M
        rounded up to a block; None otherwise.
      rec_n, rec_k, rec_e: i32[M', B], per step s (a call runs at most M steps: every active row emits at
        least one token a step): the accepted, tested and emitted counts of each row (all 0 for a row
        inactive at that step).
      step: i32[], the next step's number (the keys' step).
      tested, passed: f32[], the draft tokens tested and accepted in the drafted steps so far (each drafted
        step decays the earlier counts by :data:`_DECAY`): the schedule's acceptance estimate.
      idle: i32[], plain steps since the last drafted step; drafted: i32[], the drafted steps so far;
      caught: i32[], the drafted steps whose draft model first caught up on plain steps (:func:`_catch_up`).
    """

    t_cache: KVCache
    draft: Any
    prev: jax.Array
    last: jax.Array
    start: jax.Array
    length: jax.Array
    done: jax.Array
    out: jax.Array
    context: Any
    context_len: Any
    rec_n: jax.Array
    rec_k: jax.Array
    rec_e: jax.Array
    step: jax.Array
    tested: jax.Array
    passed: jax.Array
    idle: jax.Array
    drafted: jax.Array
    caught: jax.Array


_EXPLORE = 15  # plain steps after which a step drafts again whatever the estimate (it refreshes the estimate)
_DECAY = 0.9  # each drafted step weighs the earlier counts of tested and accepted tokens by this
# positions a catch-up forward rewrites (:func:`_catch_up`): the plain steps' (at most _EXPLORE) and two more
_CATCH_UP = _EXPLORE + 2


def drafts_next(
    tested: Any, passed: Any, idle: Any, ratio: Any, g: int, caps: Any = None, remaining: Any = None
) -> Any:
    """Whether the next step drafts: the schedule of the device-resident loop (bool[]).

    A drafted step costs ``ratio`` plain steps (measured: :func:`_calibrated`; 0 or less: every step drafts).
    With acceptance a = (passed + 1) / (tested + 2) (the counts of :class:`Resident`; a uniform prior) for
    every draft token, a drafted step is worth what the CPU schedule prices it at
    (:func:`specjax.generate.schedule.expected_call_gain`, the one rule): at B = 1 the tokens it makes,
    (1 - a^(G+1)) / (1 - a) (Leviathan et al.'s expectation), where a plain step makes one; in a batch
    (``caps``, i[B]: the tokens each row would test, 0 for a finished row; ``remaining``, i[B]: the tokens each
    still needs) how much sooner the call's last row ends, R / E[max_b N_b]. It drafts when that is more than
    ``ratio``, and after :data:`_EXPLORE` plain steps in a row. Any schedule that looks only at past steps
    keeps the output's law (each step is exact).
    """
    a = (passed + 1.0) / (tested + 2.0)
    if caps is None or caps.shape[0] == 1:
        worth = (1.0 - a ** (g + 1)) / (1.0 - a)
    else:
        probs = jnp.broadcast_to(jnp.asarray(a, jnp.float32), (caps.shape[0], g))
        worth = call_gains(probs, caps[None, :], remaining, xp=jnp)[0]
    return (worth > ratio) | (idle >= _EXPLORE)


def _append(buffer: jax.Array, length: jax.Array, tokens: jax.Array, e: jax.Array) -> jax.Array:
    """``buffer`` (i32[B, W]) with each row's first ``e[b]`` of ``tokens`` (i32[B, G+1]) written from
    ``length[b]`` on (slots past W dropped). G + 1 selects against the column, one pass over the buffer: a
    TPU runs a scatter (B·(G+1) indices) as a loop over its indices."""
    col = jnp.arange(buffer.shape[1], dtype=jnp.int32)[None, :] - length[:, None]
    out = buffer
    for j in range(tokens.shape[1]):
        out = jnp.where((col == j) & (j < e[:, None]), tokens[:, j : j + 1], out)
    return out


# Recompiles when a model, B, G, E, the cache's length, M' (M in blocks), the context buffer's width, the
# lookup's n-gram lengths or params' static fields change; never per chunk (``limit`` is an argument) nor
# per max_new_tokens within a block.
@functools.partial(jax.jit, static_argnames=("target", "draft", "g", "vocab", "lookup"), donate_argnames=("state",))
def resident_steps(
    target: JaxModel,
    draft: JaxModel | JaxHead | None,
    t_weights: dict[str, jax.Array],
    d_weights: dict[str, jax.Array] | None,
    state: Resident,
    row_keys: jax.Array,
    params: SamplingParams,
    eos: jax.Array,
    max_new: jax.Array,
    limit: jax.Array,
    ratio: jax.Array,
    *,
    g: int,
    vocab: int,
    lookup: tuple[int, int] | None = None,
) -> Resident:
    """The drafter's steps in one program: a ``lax.while_loop`` of the step program with the host's
    bookkeeping (:func:`emitted_lengths`, :func:`next_positions`) on the device.

    Runs steps ``state.step ..`` until every row is done or the step number reaches ``limit`` (i32[]);
    ``max_new`` (i32[]): ``max_new_tokens``, an argument (the buffers are sized in blocks: nearby values
    share a compilation).
    Each step is exactly the per-step path's (the same program, keys, draft lengths and rules), so the
    outputs and stats are identical to it. ``eos``: i32[E]. Returns the carry after the last step.

    ``draft``: the draft model (:func:`draft_and_verify`), the eagle head (:func:`eagle_and_verify`, then
    :func:`eagle_commit` of the emitted pairs) or None (``lookup`` alone: :func:`lookup_and_verify`).
    ``lookup``: ``(min_n, max_n)`` of an :class:`~specjax.drafters.NgramDrafter` (alone, or the hybrid's
    with the draft model): each step looks up every row's context (``state.context``, appended as ``out``
    is) with :func:`~specjax.drafters.ngram.jax_lookup` and feeds what the per-step path feeds
    (:meth:`_JaxRun.propose`): the n-gram alone tests what it found; the hybrid's rows with a match propose
    it as point masses, the others the draft model's draws. Other drafters that need the host between
    steps (custom lookups, processors) cannot run here.

    ``ratio`` (f32[]): a drafted step's cost in plain steps; each step drafts or not by :func:`drafts_next`.
    A plain step is a drafted step with ``k_b = 0`` for every row and no drafting: the draft model does not
    run (the next drafted step first catches its cache up on the tokens the plain steps committed, one
    forward: :func:`_catch_up`); the eagle head drafts nothing and commits the step's pair as ever. The
    target's forward covers the same G + 1 positions (on an accelerator a forward over G + 1 positions costs
    what one costs), and the token emitted is the one a plain decoding step draws.
    """

    def go_on(s: Resident) -> jax.Array:
        return (s.step < limit) & ~jnp.all(s.done)

    def one(s: Resident) -> Resident:
        active = ~s.done
        caps = jnp.where(active, jnp.minimum(g, jnp.maximum(max_new - s.length - 1, 0)), 0).astype(jnp.int32)
        # a drafted step, or a plain one (k = 0)
        now = drafts_next(s.tested, s.passed, s.idle, ratio, g, caps, jnp.where(active, max_new - s.length, 0))
        k, x, use, hidden = jnp.where(now, caps, 0), None, None, None
        if lookup is not None:  # the per-step path's propose() on the device
            found_x, found = jax_lookup(s.context, s.context_len, k, min_n=lookup[0], max_n=lookup[1], g=g)
            x, k, use = lookup_inputs(jnp, found_x, found, s.last, k, draft is not None)
        if draft is None:
            n, tokens, t_cache = lookup_and_verify(
                target, t_weights, s.t_cache, x, s.last, s.start, row_keys, s.step, params, k
            )
            d_state = s.draft
        elif isinstance(draft, JaxHead):
            assert d_weights is not None
            k = jnp.where(s.draft.has_feature, k, 0)  # a row drafts once the head has a feature (a pair)
            n, tokens, t_cache, d_state, hidden = eagle_and_verify(
                target, draft, t_weights, d_weights, s.t_cache, s.draft, s.last, s.start, row_keys, s.step, params,
                k, now, g=g, vocab=vocab,
            )  # fmt: skip
        else:
            n, tokens, t_cache, d_state = draft_and_verify(
                target, draft, t_weights, d_weights, s.t_cache, s.draft, s.prev, s.last, s.start, row_keys,
                s.step, params, k, x, use, now, s.context, s.idle > 0, g=g, vocab=vocab,
            )  # fmt: skip
        k = k.astype(jnp.int32)
        e, ends = emitted_lengths(jnp, tokens, n, active, s.length, max_new, eos)
        e = e.astype(jnp.int32)
        if isinstance(draft, JaxHead):
            assert d_weights is not None and hidden is not None
            d_state = eagle_commit(draft, d_weights, d_state, hidden, tokens, e)
        context, context_len = s.context, s.context_len
        if context is not None:
            context, context_len = _append(s.context, s.context_len, tokens, e), s.context_len + e
        prev, last, start = next_positions(jnp, tokens, n, active, s.prev, s.last, s.start)
        n_active = jnp.where(active, n, 0)
        tested = jnp.sum(jnp.where(active, jnp.minimum(n + 1, k), 0)).astype(jnp.float32)
        return Resident(
            t_cache, d_state, prev, last, start,
            length=s.length + e,
            done=s.done | ends,
            out=_append(s.out, s.length, tokens, e),
            context=context,
            context_len=context_len,
            # row s.step of each record (s.step < M: a step emits a token a row), a slice update, not the scatter
            # .at[step].set makes (a TPU loops over a scatter's indices)
            rec_n=lax.dynamic_update_index_in_dim(s.rec_n, n_active.astype(s.rec_n.dtype), s.step, 0),
            rec_k=lax.dynamic_update_index_in_dim(s.rec_k, k.astype(s.rec_k.dtype), s.step, 0),
            rec_e=lax.dynamic_update_index_in_dim(s.rec_e, e.astype(s.rec_e.dtype), s.step, 0),
            step=s.step + 1,
            tested=jnp.where(now, _DECAY * s.tested + tested, s.tested),
            passed=jnp.where(now, _DECAY * s.passed + jnp.sum(n_active).astype(jnp.float32), s.passed),
            idle=jnp.where(now, 0, s.idle + 1).astype(jnp.int32),
            drafted=s.drafted + now.astype(jnp.int32),
            caught=s.caught + (now & (s.idle > 0) & isinstance(draft, JaxModel)).astype(jnp.int32),
        )  # fmt: skip

    return lax.while_loop(go_on, one, state)


def _counts_above(lengths: np.ndarray, g: int) -> np.ndarray:
    """i64[g]: entry j counts the ``lengths`` (i[N], each in [0, g]) greater than j, what ``a[:length] += 1``
    over them adds to ``a``."""
    return np.bincount(lengths.astype(np.int64), minlength=g + 1)[::-1].cumsum()[::-1][1:]


def _check_resident(out: np.ndarray, count: np.ndarray, rec_n: np.ndarray, rec_k: np.ndarray, vocab: int) -> None:
    """Raise :class:`~specjax.generate.checks.PluginOutputError` unless the device-resident loop's counts are
    in range (0 <= n <= k per step and row) and its tokens are ids in [0, V)."""
    bad = np.argwhere((rec_n < 0) | (rec_n > rec_k))
    if bad.size:
        s, b = (int(v) for v in bad[0])
        raise checks.PluginOutputError(
            f"the device-resident loop returned num_accepted = {int(rec_n[s, b])} for row {b} at step {s}, "
            f"expected a value in [0, {int(rec_k[s, b])}]"
        )
    held = np.arange(out.shape[1])[None, :] < count[:, None]
    wrong = np.argwhere(held & ((out < 0) | (out >= vocab)))
    if wrong.size:
        b, i = (int(v) for v in wrong[0])
        raise checks.PluginOutputError(
            f"the device-resident loop returned token {int(out[b, i])} at row {b}, position {i}, expected an id "
            f"in [0, V) = [0, {vocab})"
        )


#: With ``on_tokens``, the device-resident loop returns to the host every this many steps, so that the
#: callback streams (each step's tokens, in order, when its chunk is back).
STREAM_STEPS = 8

_PER_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("specjax_jax_per_step", default=False)


@contextlib.contextmanager
def per_step_loop() -> Iterator[None]:
    """Within it, the JAX path runs the ``model``, ``ngram`` and ``hybrid`` drafters step by step (one program
    per step, the host reading each step's tokens and looking up n-grams in its index) instead of the
    device-resident loop: the same outputs and stats; for
    comparing the two (scripts/tpu_loop.py) and debugging. The eagle head has no per-step path: it stays
    device-resident."""
    token = _PER_STEP.set(True)
    try:
        yield
    finally:
        _PER_STEP.reset(token)


_RATIO: contextvars.ContextVar[float | None] = contextvars.ContextVar("specjax_jax_draft_ratio", default=None)


@contextlib.contextmanager
def draft_cost_ratio(ratio: float) -> Iterator[None]:
    """Within it, the device-resident loop's schedule (:func:`drafts_next`) takes ``ratio`` as a drafted step's
    cost in plain steps instead of measuring it: 0 or less, every step drafts; ``float("inf")``, plain steps
    with a drafted one after every :data:`_EXPLORE`. For tests and comparisons (scripts/tpu_loop.py)."""
    token = _RATIO.set(float(ratio))
    try:
        yield
    finally:
        _RATIO.reset(token)


_CALIBRATE_STEPS = 8  # steps a timed chunk of a program's first measured call runs (two of each kind)
# per target: (drafter, lookup, B, G, cache and output sizes) -> a drafted step's cost in plain steps
_RATIOS: weakref.WeakKeyDictionary[JaxModel, dict[tuple[Any, ...], float]] = weakref.WeakKeyDictionary()


def known_greedy(sampling: SamplingState) -> SamplingState:
    """``sampling`` with ``params.all_greedy`` set when every row's temperature is 0 (B numbers read once a
    call; a call compiles its own programs anyway). Off the CPU the steps then trace the argmax rule alone,
    with no branch for sampled rows: on a TPU the loop's target logits were otherwise made in float32 for
    that branch and read again by its argmax, where the target alone's argmax fuses into the output
    projection (benchmarks/results/tpu-loop/run-4fa2176.log). The public entry points leave it unset: a
    new temperature never recompiles them."""
    t = np.asarray(jax.device_get(sampling.params.temperature))
    if sampling.params.all_greedy or not t.size or not bool(np.all(t <= 0)):
        return sampling
    return dataclasses.replace(sampling, params=dataclasses.replace(sampling.params, all_greedy=True))


def _calibrated(run: _JaxRun, state: Resident) -> tuple[Resident, float | None]:
    """The ratio of a drafted step's cost to a plain step's for ``run``'s program: measured once (the first
    call that neither traces nor compiles it: twice a chunk of no steps, :data:`_CALIBRATE_STEPS` drafted steps
    and as many plain ones, each chunk timed to its host read; :func:`step_cost_ratio`), then served from a
    cache. Returns the state after the steps it ran, and the ratio (None when this call could not measure it)."""
    key = (run.d, run.lookup, run.batch, run.g, state.t_cache[0][0].shape, state.out.shape)
    known = _RATIOS.setdefault(run.t, {})
    if key in known:
        return state, known[key]
    # ratio 0: drafted steps; inf: plain ones; None: a chunk of no steps (the dispatch and host read alone)
    chunks: dict[float | None, list[tuple[float, int]]] = {None: [], 0.0: [], float("inf"): []}
    with measure_compiles() as compiles:
        for ratio in (None, 0.0, float("inf")) * 2:
            if not run.active():
                break
            first, t0 = run.step, time.perf_counter()
            state = run.run_resident(state, run.step + (0 if ratio is None else _CALIBRATE_STEPS), ratio or 0.0)
            if ratio is None or run.step > first:
                chunks[ratio].append((time.perf_counter() - t0, run.step - first))
    measured = step_cost_ratio(chunks[0.0], chunks[float("inf")], [t for t, _ in chunks[None]])
    if compiles.seconds > 0 or measured is None:
        return state, None  # the times include tracing or compilation (or too few steps): measure on a later call
    known[key] = measured
    return state, measured


def step_cost_ratio(
    drafted: list[tuple[float, int]], plain: list[tuple[float, int]], fixed: list[float]
) -> float | None:
    """A drafted step's cost in plain steps from timed chunks of each kind (``(seconds, steps)``) and of none
    (``fixed``: seconds of a chunk that runs no step: its dispatch and host read). Each kind's cost a step is
    its fastest chunk's time less the fastest fixed time, over its steps: a chunk's fixed cost (milliseconds,
    where a step at small B on an accelerator takes about one) would otherwise pull the ratio towards 1. None
    when a kind has no chunk or no time beyond the fixed cost (measure again later)."""
    if not drafted or not plain or not fixed:
        return None
    base = min(fixed)
    per_step = [min((t - base) / n for t, n in chunks) for chunks in (drafted, plain)]
    if min(per_step) <= 0:
        return None
    return per_step[0] / per_step[1]


def host_ids(name: str, x: torch.Tensor) -> torch.Tensor:
    """Token ids (or a mask) for the JAX path as a host tensor: a CPU tensor as it is, a torchax tensor read
    to the host (a few integers, once per call)."""
    held = torchax_array(x)
    if held is not None:
        return torch.from_numpy(np.asarray(jax.device_get(held)).copy())
    if x.device.type != "cpu":
        raise ValueError(
            f"{name}: expected a CPU tensor (or a torchax tensor) with models on torchax's jax device, got one "
            f"on {x.device}"
        )
    return x


def check_jax_call(sampler: Any, return_state: bool, **unsupported: Any) -> None:
    """Raise ``ValueError`` for options the JAX path does not have yet.

    A sampler plugin, the loop's state, and (``unsupported``: name -> value,
    refused when truthy) logits processors, stop strings, stopping criteria and
    per-token outputs: they run on the CPU path only, never silently dropped.
    """
    for name, value in unsupported.items():
        if value:
            raise ValueError(
                f"{name}: not supported yet on the JAX path (models on torchax's jax device); "
                "run the models on the CPU path for it"
            )
    if sampler is not None:
        raise ValueError(
            "sampler: the JAX path (models on torchax's jax device) runs the built-in sampler, sampler='jax'; "
            "plugin samplers run on the CPU path"
        )
    if return_state:
        raise ValueError("return_state: the JAX path keeps its caches on the device; pass return_state=False")


def _draft_model(drafter: Any) -> Any:
    """The draft model the step runs itself (model drafter, or a hybrid's model fallback), else None."""
    if isinstance(drafter, ModelDrafter):
        return drafter.model
    if isinstance(drafter, HybridDrafter) and isinstance(drafter.fallback, ModelDrafter):
        return drafter.fallback.model
    return None


def _check_drafter(drafter: Any) -> None:
    """Raise ``ValueError`` for drafters the JAX path cannot run (their torch code would run eagerly)."""
    if _draft_model(drafter) is not None or isinstance(drafter, EagleDrafter):
        return
    if getattr(drafter, "needs_target_hidden", False) or isinstance(drafter, HybridDrafter):
        raise ValueError(
            f"draft: the JAX path (torchax) runs the model drafter, the eagle head, lookup drafters such as "
            f"'ngram' and a hybrid of the two, got "
            f"{getattr(drafter, 'name', type(drafter).__name__)!r} (it runs torch code of its own); use one of "
            "those, or run on the CPU path"
        )


class _JaxRun:
    """One call's state on JAX's device and its steps: plan, propose (host lookups), verify (one program),
    commit; arguments as :func:`run_jax_loop`'s."""

    def __init__(self, target, drafter, input_ids, attention_mask, sampling: SamplingState, config: LoopConfig) -> None:
        self.drafter, self.sampling, self.on_tokens = drafter, known_greedy(sampling), config.on_tokens
        self.eos = np.array(sorted(config.eos_ids), np.int32)  # i32[E]
        self.max_new_tokens, self.g, self.vocab = config.max_new_tokens, config.num_draft_tokens, config.target_vocab
        self.contexts = _contexts(input_ids, attention_mask)
        self.batch = len(self.contexts)
        self.prefilled = int(max(len(c) for c in self.contexts) > 1)  # one forward over the prompts first
        self.rows = [_Row(i) for i in range(self.batch)]
        self.stats = SpeculativeStats(drafter=str(getattr(drafter, "name", type(drafter).__name__)))
        self.who = checks.plugin_name("drafter", drafter, getattr(drafter, "name", None))
        self.tested, self.passed = np.zeros(self.g, np.int64), np.zeros(self.g, np.int64)
        self.gained = self.row_steps = self.step = 0
        self.drafted = 0  # steps that drafted G tokens (the others: the schedule's plain steps)
        self.caught = 0  # drafted steps whose draft model first caught up on plain steps (one forward each)
        draft_model = _draft_model(drafter)
        eagle = isinstance(drafter, EagleDrafter)
        self.fused = draft_model is not None or eagle  # the step program drafts itself
        # the host's proposals: a lookup drafter's, or the hybrid's lookups (its model drafts the other rows)
        self.asked = drafter.ngram if isinstance(drafter, HybridDrafter) else (None if self.fused else drafter)
        # the built-in n-gram rule has a device twin (jax_lookup); other lookup drafters run on the host
        self.lookup = (self.asked.min_n, self.asked.max_n) if type(self.asked) is NgramDrafter else None
        # every step in one program when nothing needs the host between steps
        self.resident = eagle or (not _PER_STEP.get() and (self.asked is None or self.lookup is not None))
        positions = _positions(self.contexts, self.max_new_tokens + self.g + 1)
        self.t = jax_model("target", target)
        self.d: JaxModel | JaxHead | None = jax_model("draft", draft_model) if draft_model is not None else None
        self.d_weights: dict[str, jax.Array] | None = None
        self.d_cache: Any = None
        if eagle:
            check_head(drafter.head, target, self.vocab)
            head = jax_head(drafter.head, target, self.vocab)
            self.d, self.d_weights = head, head.with_scored(scored_ids(drafter, self.contexts, self.vocab))
            self.t_cache, self.start, self.last, hidden = _prefilled(self.t, self.contexts, positions, head.layers)
            self.d_cache = _head_prefilled(head, self.d_weights, hidden, self.contexts, positions)
        else:
            self.t_cache, self.start, self.last, _ = _prefilled(self.t, self.contexts, positions)
        if isinstance(self.d, JaxModel):
            self.d_weights = self.d.weights
            self.d_cache = _prefilled(self.d, self.contexts, positions)[0]
        self.prev = np.array([c[-2] if len(c) > 1 else 0 for c in self.contexts], np.int32)
        if self.asked is not None and not self.resident:
            contexts = [list(c) for c in self.contexts]
            self.asked.start(DraftSetup(target, input_ids, attention_mask, contexts, self.vocab, self.g, sampling))

    def active(self) -> bool:
        return not all(r.done for r in self.rows)

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        """``(active bool[B], caps i64[B])``: rows still generating, and the most tokens each may test
        (G, and never past ``max_new_tokens``: the emitted token comes on top)."""
        remaining = np.array([0 if r.done else self.max_new_tokens - len(r.generated) for r in self.rows])
        active = remaining > 0
        return active, np.where(active, np.minimum(self.g, np.maximum(remaining - 1, 0)), 0)

    def propose(self, active: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The host's proposals ``(x i32[B, G], k i64[B], use bool[B])``: lookups where the drafter has them
        (``use``), the last token as filler elsewhere (a valid id, never tested); the model drafter's rows
        test ``caps``."""
        x, k, use = np.repeat(self.last[:, None], self.g, axis=1), caps, np.zeros(self.batch, bool)
        if self.asked is None:
            return x, k, use
        contexts = [list(c) for c in self.contexts]
        proposal = self.asked.propose(DraftRequest(self.step, contexts, caps, active, self.sampling, caps, None))
        check_proposal(self.who, proposal, caps, self.batch, self.vocab, check_ids=True, check_logits=False)
        if proposal.logits is not None:
            raise checks.PluginOutputError(
                f"{self.who} proposed tokens with draft logits; the JAX path takes point-mass proposals "
                "(logits=None) from drafters other than the model drafter"
            )
        found = np.minimum(np.asarray(proposal.num_tokens, np.int64), caps)
        found_x = np.zeros((self.batch, self.g), np.int32)
        cols = min(self.g, np.asarray(proposal.tokens).shape[1])
        found_x[:, :cols] = np.asarray(proposal.tokens)[:, :cols]
        return lookup_inputs(np, found_x, found, self.last, caps, self.fused)

    def verify(self, x: np.ndarray, k: np.ndarray, use: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step's program (draft, the target's forward, the acceptance step); the host reads its int32
        ``(n i32[B], tokens i32[B, G+1])``, nothing else."""
        # host arrays go into the jitted step as they are (transferred with the call, no eager op each)
        step, keys, params = np.int32(self.step), self.sampling.keys, self.sampling.params
        last, start, k_j = self.last.astype(np.int32), self.start.astype(np.int32), np.asarray(k, np.int32)
        if self.d is not None:
            assert isinstance(self.d, JaxModel) and self.d_cache is not None
            # the hybrid's lookups and its point-mass rows; None for the model drafter
            forced = (np.asarray(x, np.int32), np.asarray(use, bool)) if self.asked is not None else (None, None)
            n, tokens, self.t_cache, self.d_cache = draft_and_verify(
                self.t, self.d, self.t.weights, self.d.weights, self.t_cache, self.d_cache,
                self.prev.astype(np.int32), last, start, keys, step, params, k_j, *forced, g=self.g, vocab=self.vocab,
            )  # fmt: skip
        else:
            n, tokens, self.t_cache = lookup_and_verify(
                self.t, self.t.weights, self.t_cache, np.asarray(x, np.int32), last, start, keys, step, params, k_j
            )
        n_h, tokens_h = jax.device_get((n, tokens))
        self.drafted += 1  # the per-step path drafts every step
        checks.check_step_output("the verification step", n_h, tokens_h, k, self.vocab)
        return n_h, tokens_h

    def commit(self, active: np.ndarray, k: np.ndarray, n: np.ndarray, tokens: np.ndarray) -> None:
        """Each active row appends its accepted tokens and the emitted one (up to EOS and ``max_new_tokens``:
        :func:`emitted_lengths`) and moves on (:func:`next_positions`): its next forward starts right after
        them, overwriting the rejected drafts' slots."""
        count = np.array([len(r.generated) for r in self.rows])
        e, ends = emitted_lengths(np, tokens, n, active, count, self.max_new_tokens, self.eos)
        emitted_rows: list[list[int]] = []
        for b, row in enumerate(self.rows):
            emitted = tokens[b, : e[b]].tolist() if active[b] else []
            if active[b]:
                self.account(b, int(k[b]), int(n[b]), emitted)
                self.contexts[b].extend(emitted)
                row.done = bool(ends[b])
            emitted_rows.append(emitted)
        self.prev, self.last, self.start = next_positions(np, tokens, n, active, self.prev, self.last, self.start)
        if self.asked is not None:
            self.asked.commit(CommitInfo(emitted_rows, n.astype(np.int64), k, None))
        self.end_step(k)

    def account(self, b: int, k_b: int, n_b: int, emitted: list[int]) -> None:
        """Row b's step in the stats and its output: ``k_b`` tested, ``n_b`` accepted, ``emitted`` appended
        (and streamed)."""
        self.stats.draft_tokens_proposed += k_b
        self.stats.draft_tokens_accepted += n_b
        self.tested[: min(n_b + 1, k_b)] += 1
        self.passed[:n_b] += 1
        self.rows[b].generated.extend(emitted)
        self.gained += len(emitted)
        self.row_steps += 1
        if self.on_tokens is not None:
            self.on_tokens(b, emitted)

    def account_steps(self, out: np.ndarray, offset: np.ndarray, k: np.ndarray, n: np.ndarray, e: np.ndarray) -> None:
        """:meth:`account` and :meth:`end_step` for S steps at once, with no callback to stream to: the same
        stats and outputs, in NumPy (at B = 32 the per-row replay was Python work of every row and step).

        Args:
          out: i32[B, M], the rows' emitted tokens; offset: i[B], each row's tokens before these steps;
          k, n, e: i[S, B], each step's tested, accepted and emitted counts per row (``e > 0``: the row was
            active in that step, as :meth:`run_resident` reads it).
        """
        active = e > 0
        k_a, n_a = k[active], n[active]
        self.stats.draft_tokens_proposed += int(k_a.sum())
        self.stats.draft_tokens_accepted += int(n_a.sum())
        self.tested += _counts_above(np.minimum(n_a + 1, k_a), self.g)  # account's tested[: min(n + 1, k)] += 1
        self.passed += _counts_above(n_a, self.g)
        total = e.sum(axis=0)
        for b in np.nonzero(total)[0]:
            emitted = out[b, offset[b] : offset[b] + total[b]].tolist()
            self.rows[b].generated.extend(emitted)
            self.gained += len(emitted)
        self.row_steps += int(active.sum())
        self.stats.steps += len(k)
        self.stats.draft_steps += int((k.max(axis=1, initial=0) > 0).sum())
        self.step += len(k)

    def end_step(self, k: np.ndarray) -> None:
        """The step's count in the stats (``k``: i[B], each row's tested draft tokens, 0 for idle rows)."""
        self.stats.steps += 1
        self.stats.draft_steps += int(k.max(initial=0) > 0)
        self.step += 1

    def resident_state(self) -> Resident:
        """The call's state as the device-resident loop's carry (:func:`resident_steps`), before step 0."""
        m, b = _blocks(self.max_new_tokens), self.batch
        context = context_len = None
        if self.lookup is not None or isinstance(self.d, JaxModel):  # the prompts, then the emitted tokens
            context = np.zeros((b, _positions(self.contexts, self.max_new_tokens)), np.int32)
            for row, c in enumerate(self.contexts):
                context[row, : len(c)] = c
            context_len = np.array([len(c) for c in self.contexts], np.int32)
        i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
        zeros = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        # the host's part in one transfer (each array made eagerly would be a dispatch of its own)
        f32 = np.float32(0.0)
        (prev, last, start, length, done, out, context, context_len, rec_n, rec_k, rec_e, step, tested, passed, idle,
         drafted, caught) = jax.device_put(
            (i32(self.prev), i32(self.last), i32(self.start), zeros(b), np.zeros(b, bool), zeros(b, m), context,
             context_len, zeros(m, b), zeros(m, b), zeros(m, b), zeros(), f32, f32, zeros(), zeros(), zeros())
        )  # fmt: skip
        return Resident(
            t_cache=self.t_cache, draft=self.d_cache, prev=prev, last=last, start=start, length=length, done=done,
            out=out, context=context, context_len=context_len, rec_n=rec_n, rec_k=rec_k, rec_e=rec_e, step=step,
            tested=tested, passed=passed, idle=idle, drafted=drafted, caught=caught,
        )  # fmt: skip

    def run_resident(self, state: Resident, limit: int, ratio: float) -> Resident:
        """Steps on the device until every row is done or step ``limit`` (one program, no host read inside), each
        drafting or not as ``ratio`` says (:func:`drafts_next`); then the host reads the int32 tokens and per-step
        counts and replays each step's bookkeeping (stats, ``on_tokens``), exactly as :meth:`commit` would have
        done it (with no ``on_tokens``, all the steps at once: :meth:`account_steps`)."""
        state = resident_steps(
            self.t, self.d, self.t.weights, self.d_weights, state, self.sampling.keys, self.sampling.params,
            np.asarray(self.eos, np.int32), np.int32(self.max_new_tokens), np.int32(limit), np.float32(ratio),
            g=self.g, vocab=self.vocab, lookup=self.lookup,
        )  # fmt: skip
        out, count, done, rec_n, rec_k, rec_e, step, drafted, caught = (
            np.asarray(a)
            for a in jax.device_get(
                (state.out, state.length, state.done, state.rec_n, state.rec_k, state.rec_e, state.step,
                 state.drafted, state.caught)
            )
        )  # fmt: skip
        _check_resident(out, count, rec_n, rec_k, self.vocab)
        self.drafted, self.caught = int(drafted), int(caught)
        offset = np.array([len(r.generated) for r in self.rows])
        if self.on_tokens is None:  # nothing to stream: the steps' bookkeeping at once
            span = slice(self.step, int(step))
            self.account_steps(out, offset, rec_k[span], rec_n[span], rec_e[span])
        else:
            for s in range(self.step, int(step)):
                for b in (int(i) for i in np.nonzero(rec_e[s] > 0)[0]):  # the step's active rows (each emits)
                    emitted = out[b, offset[b] : offset[b] + rec_e[s, b]].tolist()
                    offset[b] += rec_e[s, b]
                    self.account(b, int(rec_k[s, b]), int(rec_n[s, b]), emitted)
                self.end_step(rec_k[s])
        for b, row in enumerate(self.rows):
            row.done = bool(done[b])
        return state


def run_jax_loop(
    target: Any,
    drafter: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sampling: SamplingState,
    config: LoopConfig,
    *,
    started: tuple[float, float] | None = None,
) -> SpeculativeOutput:
    """The loop on JAX's devices; arguments as :func:`specjax.generate.loop.run_loop`'s, already validated.

    ``input_ids`` / ``attention_mask``: i64[B, P] host (CPU) tensors, left-padded. Of ``config`` this
    path reads G, ``max_new_tokens``, the EOS and pad ids, V, ``on_tokens`` and ``adaptive`` (the
    device-resident steps' schedule, :func:`drafts_next`; False: every step drafts G), and
    :func:`check_jax_call` has refused the settings it does not run.
    The model, ``ngram`` and ``hybrid(ngram, model)`` drafters' steps run device-resident
    (:func:`resident_steps`) unless :func:`per_step_loop` is active; other lookup drafters step by step.
    """
    from specjax.adapters import count_copies

    _check_drafter(drafter)
    t_start, setup_compile_s = started if started is not None else (time.perf_counter(), 0.0)
    with count_copies() as copies, measure_compiles() as compiles:
        run = _JaxRun(target, drafter, input_ids, attention_mask, sampling, config)
        if run.resident:
            state = run.resident_state()
            chunk = config.max_new_tokens if config.on_tokens is None else STREAM_STEPS
            ratio = _RATIO.get()
            if ratio is None:
                ratio = 0.0  # every step drafts: adaptive=False, and until the costs are measured
                if config.adaptive:
                    state, measured = _calibrated(run, state)
                    ratio = measured if measured is not None else 0.0
            while run.active():
                state = run.run_resident(state, run.step + chunk, ratio)
        while run.active():
            active, caps = run.plan()  # 1.
            x, k, use = run.propose(active, caps)  # 2. (host lookups; the draft model runs in 3.)
            n, tokens = run.verify(x, k, use)  # 3. draft, score, verify: one program
            run.commit(active, k, n, tokens)  # 4.

    stats = run.stats
    stats.target_forwards = stats.steps + run.prefilled
    # a drafted step runs the drafter G times (and once more when the draft model catches up on plain steps);
    # a plain step runs the draft model not at all, the eagle head once (it commits the step's pair)
    if isinstance(run.d, JaxModel):
        stats.draft_forwards = run.g * run.drafted + run.caught + run.prefilled
    else:
        stats.draft_forwards = (stats.steps + (run.g - 1) * run.drafted + run.prefilled) if run.fused else 0
    stats.adapter_copies = copies.copies
    stats.compile_time_s = setup_compile_s + compiles.seconds
    _finish_stats(stats, run.tested, run.passed, run.gained, run.row_steps, run.rows, t_start)
    stats.loop_time_s = stats.wall_time_s
    return _build_output(input_ids, run.rows, config.pad_token_id, stats)


def _contexts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt without its padding (host lists)."""
    mask_h = attention_mask.bool().numpy()
    ids_h = input_ids.numpy()
    return [ids_h[b][mask_h[b]].tolist() for b in range(ids_h.shape[0])]


def _positions(contexts: list[list[int]], more: int) -> int:
    """The cache's positions: at least the longest prompt plus ``more``, with the ``positions + 1`` slots
    (the scratch slot first) a whole number of blocks. A TPU lays a cache's slot axis along its 128 lanes:
    129 slots (128 positions and the scratch slot) took the bytes of 256 in every pass over the cache
    (benchmarks/results/tpu-loop/run-64265a3.log: ``f32[32,3,129,64]{2,3,1,0:T(8,128)}``)."""
    return _blocks(max(len(c) for c in contexts) + more + 1) - 1


def _blocks(n: int) -> int:
    """``n`` rounded up to a whole number of position blocks (nearby sizes share a compilation)."""
    return -(-n // _POSITION_BLOCK) * _POSITION_BLOCK


def _prefilled(
    model: JaxModel, contexts: list[list[int]], positions: int, layers: tuple[int, ...] | None = None
) -> tuple[KVCache, np.ndarray, np.ndarray, jax.Array | None]:
    """A cache holding every prompt but its last token, the last token's position i32[B] and the token i32[B];
    with ``layers``, the hidden states of that forward (f[B, P'-1, k·d], row b's first ``len - 1`` real;
    None when every prompt is one token)."""
    batch = len(contexts)
    cache = model.init_cache(batch, positions)
    width = max(len(c) for c in contexts) - 1  # the last token is scored by the first step
    hidden = None
    if width > 0:
        pre = np.zeros((batch, width), np.int32)  # filler past a shorter row's prompt: overwritten, never seen
        for b, c in enumerate(contexts):
            pre[b, : len(c) - 1] = c[:-1]
        if layers is None:
            cache = prefill(model, model.weights, cache, pre)
        else:
            cache, hidden = _prefill_hidden(model, model.weights, cache, pre, layers=layers)
    start = np.array([len(c) - 1 for c in contexts], np.int32)
    return cache, start, np.array([c[-1] for c in contexts], np.int32), hidden


@functools.partial(jax.jit, static_argnames=("model", "layers"), donate_argnames=("cache",))
def _prefill_hidden(model: JaxModel, weights, cache: KVCache, tokens: jax.Array, *, layers: tuple[int, ...]):
    """:func:`prefill`, and the hidden states ``layers`` of every token (f[B, P', k·d])."""
    _, cache, hidden = model.forward_hidden(weights, cache, tokens, jnp.zeros(tokens.shape[0], jnp.int32), 1, layers)
    return cache, hidden


@functools.partial(jax.jit, static_argnames=("head",))
def _head_over_prompts(head: JaxHead, weights, cache, hidden: jax.Array, tokens: jax.Array):
    out, cache = head.forward(weights, cache, head.fuse(weights, hidden), head.embed(weights, tokens),
                              jnp.zeros(tokens.shape[0], jnp.int32))  # fmt: skip
    return out, cache


def _head_prefilled(
    head: JaxHead, weights: dict[str, jax.Array], hidden: jax.Array | None, contexts: list[list[int]], positions: int
) -> EagleState:
    """The head's state after the prompts' pairs ``(z_t, E x_{t+1})``, t < len - 1 (the CPU drafter's
    prompt pairs; none for a one-token prompt)."""
    batch, d = len(contexts), head.config.hidden_size
    cache = head.init_cache(batch, positions)
    pairs = np.array([len(c) - 1 for c in contexts], np.int32)
    dtype = np.dtype(head.weights["fc.weight"].dtype)
    feature: Any = np.zeros((batch, d), dtype)
    if hidden is not None:
        nxt = np.zeros((batch, hidden.shape[1]), np.int32)
        for b, c in enumerate(contexts):
            nxt[b, : len(c) - 1] = c[1:]
        out, cache = _head_over_prompts(head, weights, cache, hidden, nxt)
        feature = _at_pairs(out, np.maximum(pairs - 1, 0))
    # no row drafts in the first step: a plain step, as on the CPU path (whose forward over the prompts
    # scores it), so that the same keys meet the same distributions there and here
    feature, pairs_j, has_feature = jax.device_put((feature, pairs, np.zeros(batch, bool)))
    return EagleState(cache, feature, pairs_j, has_feature)


@jax.jit
def _at_pairs(out: jax.Array, at: jax.Array) -> jax.Array:
    """f[B, d]: each row's ``out[b, at[b]]`` (``out`` f[B, P, d], ``at`` i32[B]), in one dispatch."""
    return jnp.take_along_axis(out, at[:, None, None], axis=1)[:, 0]


# Recompiles when the target, B, the cache's length, the number of steps or the mode change.
@functools.partial(jax.jit, static_argnames=("target", "steps", "sample"))
def _decode_steps(
    target: JaxModel,
    weights: dict[str, jax.Array],
    cache: KVCache,
    last: jax.Array,
    start: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    *,
    steps: int,
    sample: bool,
) -> jax.Array:
    """``steps`` tokens per row in one program (a ``fori_loop``): each the argmax of the target's logits, or
    (``sample``) a draw from softmax(logits / ``temperature``) with ``keys[i]`` at step i. i32[B, steps]."""

    def one(i: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        cache, last, start, out = carry
        logits, cache = target.forward(weights, cache, last[:, None], start, 1)
        scores = logits[:, -1].astype(jnp.float32)
        if sample:
            token = jax.random.categorical(keys[i], scores / temperature, axis=-1).astype(jnp.int32)
        else:
            token = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        return cache, token, start + 1, lax.dynamic_update_index_in_dim(out, token, i, 1)  # not a scatter

    out = jnp.zeros((last.shape[0], steps), jnp.int32)
    return jax.lax.fori_loop(0, steps, one, (cache, last, start, out))[3]


def greedy_decode(
    target: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_new_tokens: int
) -> np.ndarray:
    """The target alone, greedy, on JAX's device: the reference the speculative loop must equal.

    The same forward and cache as :func:`run_jax_loop`, one token per step, every step in one program
    (as the loop's device-resident steps; the tokens are read once at the end), no EOS.

    Args:
      target: a transformers causal LM (on the CPU or torchax's jax device).
      input_ids, attention_mask: i64[B, P] host tensors, left-padded (mask None: no padding).

    Returns:
      i64[B, max_new_tokens] host array, the argmax tokens (the first maximum on ties).
    """
    return target_decode(target, input_ids, attention_mask, max_new_tokens)


def target_decode(
    target: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """The target alone on JAX's device, greedy (``temperature`` 0, :func:`greedy_decode`) or sampled from
    softmax(logits / ``temperature``) with keys from ``seed``: the reference speculative timings compare with.

    Arguments and result as :func:`greedy_decode`'s; sampled tokens follow the target's law but are not the
    speculative loop's draws (its keys are per row and step).
    """
    if not temperature >= 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    contexts = _contexts(input_ids, mask)
    t = jax_model("target", target)
    cache, start_h, last_h, _ = _prefilled(t, contexts, _positions(contexts, max_new_tokens + 1))
    keys = jax.random.split(jax.random.key(seed), max_new_tokens)
    out = _decode_steps(
        t, t.weights, cache, np.asarray(last_h, np.int32), np.asarray(start_h, np.int32), keys,
        np.float32(temperature if temperature > 0 else 1.0), steps=max_new_tokens,
        sample=temperature > 0,
    )  # fmt: skip
    return np.asarray(jax.device_get(out)).astype(np.int64)
