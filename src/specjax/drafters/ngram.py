"""N-gram prompt lookup: propose what followed the context's suffix the last time it occurred.

Per row: find the longest n-gram (``n`` from ``max_n`` down to ``min_n``) that
ends the row's context (prompt + generated tokens) and occurred earlier in
that context; propose up to ``k`` of the tokens that followed its most recent
earlier occurrence. No match: no proposal for that row (the loop then takes a
plain decoding step for it). Proposals are deterministic, so they go to the
acceptance step as point masses (``q`` = 1 at the token): exact at every
temperature (Leviathan et al. 2023; Saxena 2023, "prompt lookup decoding").

Each row keeps a hash index per ``n`` from an n-gram's hash to the end
position of its latest occurrence that has a continuation, updated as tokens
are committed, so a lookup costs ``max_n - min_n + 1`` dictionary probes
whatever the context length, and the index holds one entry per context token
and ``n`` (about 100 bytes each), not the n-grams themselves. A probe that
finds an entry compares the two n-grams; a hash collision (vanishingly rare)
costs at most a missed proposal, never a wrong token (the target verifies
every proposal). ``max_n`` is at most :data:`MAX_NGRAM`. Single tokens are
not matched by default: on a CPU each wasted verification costs about half a
decoding step, and one-token matches are mostly wrong.

:func:`jax_lookup` is the same rule in JAX over a static-size token buffer
(every row and candidate end position at once), for the device-resident loop
(:mod:`specjax.generate.jax_loop`); tests/test_ngram_lookup.py ties the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, Proposal

__all__ = ["MAX_NGRAM", "NgramDrafter", "NgramIndex", "jax_lookup"]

# The longest n-gram matched: the index's size and the time to index a token grow with
# max_n - min_n + 1 (prompt lookup pays off at n of 2 to 5; longer matches are found by the
# shorter n-grams they end with).
MAX_NGRAM = 32


class NgramIndex:
    """The n-gram index of one row's context (host Python; amortised O(1) per token)."""

    __slots__ = ("context", "max_n", "min_n", "tables")

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # tables[n - min_n]: hash of an n-gram -> the end position of its latest occurrence with a continuation
        self.tables: list[dict[int, int]] = [{} for _ in range(max_n - min_n + 1)]
        self.context: list[int] = []
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens``; index the n-grams that now have a continuation."""
        ctx = self.context
        for t in tokens:
            end = len(ctx) - 1  # the n-grams ending here get their continuation `t`
            ctx.append(int(t))
            if end < 0:
                continue
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.tables[n - self.min_n][hash(tuple(ctx[end - n + 1 : end + 1]))] = end

    def lookup(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the context's suffix."""
        ctx = self.context
        size = len(ctx)
        if k <= 0:
            return []
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            suffix = ctx[size - n :]
            end = self.tables[n - self.min_n].get(hash(tuple(suffix)))
            if end is not None and ctx[end - n + 1 : end + 1] == suffix:
                return ctx[end + 1 : end + 1 + k]
        return []


def jax_lookup(
    ctx: jax.Array, length: jax.Array, k: jax.Array, *, min_n: int, max_n: int, g: int
) -> tuple[jax.Array, jax.Array]:
    """:meth:`NgramIndex.lookup` for every row at once, in JAX (traceable; no host read).

    Row b's context is ``ctx[b, :length[b]]`` (L = its length). For n from min(``max_n``, L) down to
    ``min_n``: the suffix is the last n tokens; the match is the latest earlier end e, n - 1 <= e <= L - 2
    (the n-gram has a continuation), with ``ctx[b, e-n+1 .. e]`` equal to the suffix; the row proposes
    ``ctx[b, e+1 : e+1+k[b]]``. The longest n with a match wins; none: nothing. The host index finds the
    same match unless two n-grams' hashes collide (then it misses it).

    Costs (max_n) compares of the whole buffer: n-grams are matched incrementally, the n-gram ending at e
    matching when the (n-1)-gram does and ``ctx[e-n+1]`` equals the suffix's n-th token from the end.

    Args:
      ctx: i32[B, W], each row's tokens (positions from ``length[b]`` on are not read).
      length: i32[B], the rows' context lengths L (0 <= L <= W).
      k: i32[B], the most tokens each row proposes (0 or less: none; at most G are returned).
      min_n, max_n: the n-gram lengths matched (static; 1 <= min_n <= max_n).
      g: G, the width of the proposals (static).

    Returns:
      ``(tokens i32[B, G], found i32[B])``: row b proposes ``tokens[b, :found[b]]``, found = min(k, G,
      L - 1 - e) at its match, 0 without one; ``tokens`` is 0 past ``found``.
    """
    batch, width = ctx.shape
    pos = jnp.arange(width, dtype=jnp.int32)[None, :]
    length = length.astype(jnp.int32)[:, None]
    matched = jnp.ones((batch, width), bool)  # matched[b, e]: the n-gram ending at e equals the suffix
    best = jnp.full((batch,), -1, jnp.int32)  # the latest match's end for the longest n so far
    for n in range(1, max_n + 1):
        tail = jnp.take_along_axis(ctx, jnp.maximum(length - n, 0), axis=1)  # the suffix's n-th token from the end
        before = jnp.pad(ctx, ((0, 0), (n - 1, 0)))[:, :width]  # before[b, e] = ctx[b, e - n + 1]
        matched &= before == tail
        if n >= min_n:  # e >= n - 1 (a whole n-gram) and e <= L - 2 (a continuation) imply n < L
            ends = jnp.where(matched & (pos >= n - 1) & (pos <= length - 2), pos, -1).max(axis=1)
            best = jnp.where(ends >= 0, ends, best)  # a longer n with a match replaces a shorter one
    found = jnp.where(best >= 0, jnp.clip(jnp.minimum(k, length[:, 0] - 1 - best), 0, g), 0).astype(jnp.int32)
    j = jnp.arange(g, dtype=jnp.int32)[None, :]
    picked = jnp.take_along_axis(ctx, jnp.clip(best[:, None] + 1 + j, 0, width - 1), axis=1)
    return jnp.where(j < found[:, None], picked, 0).astype(jnp.int32), found


class NgramDrafter:
    """Prompt-lookup drafting (the ``ngram`` drafter).

    Args:
      min_n, max_n: the n-gram lengths matched, longest first (default 2..5;
        at most :data:`MAX_NGRAM` = 32). ``min_n = 1`` also matches single tokens.

    Raises:
      ValueError: ``min_n`` or ``max_n`` outside [1, 32], or ``max_n`` < ``min_n``.
    """

    name = "ngram"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        for arg, value in (("min_n", min_n), ("max_n", max_n)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 1 <= value <= MAX_NGRAM:
                raise ValueError(
                    f"{arg}: expected an integer in [1, {MAX_NGRAM}] (an n-gram length; the index grows with "
                    f"max_n - min_n + 1), got {value!r}"
                )
        if max_n < min_n:
            raise ValueError(f"max_n: expected an integer >= min_n = {min_n}, got {max_n}")
        self.min_n, self.max_n = int(min_n), int(max_n)
        self.rows: list[NgramIndex] = []

    def fork(self) -> NgramDrafter:
        """A fresh drafter with the same options (for a concurrent call; see :class:`~specjax.drafters.Drafter`)."""
        return NgramDrafter(self.min_n, self.max_n)

    def start(self, setup: DraftSetup) -> None:
        self.rows = [NgramIndex(ctx, self.min_n, self.max_n) for ctx in setup.contexts]

    def propose(self, request: DraftRequest) -> Proposal:
        # Lookups are free: propose up to the limit and let the schedule choose how many to verify.
        found = [r.lookup(int(k)) for r, k in zip(self.rows, request.allowed, strict=True)]
        counts = np.array([len(f) for f in found], np.int64)
        tokens = np.zeros((len(found), int(counts.max(initial=0))), np.int32)
        for b, f in enumerate(found):
            tokens[b, : len(f)] = f
        return Proposal(tokens, counts, None, paid_tokens=0)

    def commit(self, info: CommitInfo) -> None:
        for r, emitted in zip(self.rows, info.emitted, strict=True):
            if emitted:
                r.extend(emitted)

    def select_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[j] for j in rows]
