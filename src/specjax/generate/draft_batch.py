"""One step's draft batch: a drafter's proposal checked, trimmed and laid out once for the target and the verifier.

:func:`check_proposal` holds a drafter's answer to its contract
(:class:`specjax.drafters.Proposal`); :func:`draft_batch` turns the kept part
into a :class:`DraftBatch`: the draft columns as the target's input (torch)
and as the verifier's (NumPy on a CPU, else JAX), each row's count, the
draft logits or None, and which rows are point masses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specjax.drafters.base import Proposal
from specjax.generate import checks
from specjax.slots import to_host

__all__ = ["DraftBatch", "check_proposal", "draft_batch", "no_proposal"]


@dataclass(frozen=True)
class DraftBatch:
    """The draft tokens one step verifies.

    Attributes:
      tokens_t: i64[B', W] torch, on the target's device: row b's draft tokens
        at positions < ``k[b]``, its last committed token after them (a valid
        id that is never tested); the target scores ``[last, tokens_t]``.
      tokens_v: i32[B', W], the same ids for the verifier (NumPy when they are
        in host memory, else JAX).
      k: i64[B'] host array, ``k_b`` in [0, g]: the draft tokens row b tests.
      g: ``max(k)``; W >= g is the padded width (a few widths compile).
      logits: None (every row a point mass), or a tuple of g f[B', V_draft]
        arrays: the draft distributions the tokens were drawn from.
      point_mass_rows: bool[B'] host array: the rows whose proposals are
        deterministic (``q`` the point mass at each token); all True when
        ``logits`` is None.
      free_rows, confidence: the proposal's (:class:`specjax.drafters.Proposal`),
        for the schedule.
      own: None (the drafter proposed all ``k``), or i64[B'] host array: how
        many of row b's ``k[b]`` tokens lead as the drafter proposed them; the
        rest, after them, the grammar forced
        (:meth:`specjax.generate.grammar.GrammarRows.forced_extension`).
    """

    tokens_t: torch.Tensor
    tokens_v: Any
    k: np.ndarray
    g: int
    logits: tuple[Any, ...] | None
    point_mass_rows: np.ndarray
    free_rows: np.ndarray | None = None
    confidence: np.ndarray | None = None
    own: np.ndarray | None = None

    @property
    def own_k(self) -> np.ndarray:
        """i64[B']: the drafter's own tokens among each row's ``k`` (``own``, or ``k``)."""
        return self.k if self.own is None else self.own

    @property
    def width(self) -> int:
        return int(self.tokens_t.shape[1])

    @property
    def mixed_point_masses(self) -> np.ndarray | None:
        """``point_mass_rows`` for the verifier where point masses and draft logits share the batch, else None."""
        if self.logits is None or not (self.point_mass_rows & (self.k > 0)).any():
            return None
        return self.point_mass_rows


def draft_batch(
    proposal: Proposal, k: np.ndarray, width: int, last: np.ndarray, device: torch.device, confidence: Any
) -> DraftBatch:
    """The :class:`DraftBatch` of ``proposal`` with row counts ``k`` (i64[B']) padded to ``width`` columns.

    ``last``: i64[B'] each row's last committed token (the filler).
    """
    import jax.numpy as jnp

    g = int(k.max(initial=0))
    tokens_t, tokens_v = _draft_columns(proposal.tokens, k, g, width, last, device, jnp)
    masses = _point_mass_rows(proposal, k)
    logits = None if proposal.logits is None or masses.all() else tuple(proposal.logits[:g])
    return DraftBatch(tokens_t, tokens_v, k, g, logits, masses, proposal.free_rows, confidence)


def _point_mass_rows(proposal: Proposal, k: np.ndarray) -> np.ndarray:
    """bool[B']: the rows verified as point masses; all of them when no row that tests a token has draft logits."""
    if proposal.logits is None:
        return np.ones(len(k), bool)
    masses = np.zeros(len(k), bool) if proposal.point_mass_rows is None else np.array(proposal.point_mass_rows, bool)
    return np.ones(len(k), bool) if masses[k > 0].all() else masses


def no_proposal(batch: int) -> Proposal:
    """What a step that does not ask the drafter verifies: nothing (a plain decoding step)."""
    return Proposal(np.zeros((batch, 0), np.int32), np.zeros(batch, np.int64), None)


def check_proposal(
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
    for name in ("free_rows", "point_mass_rows"):
        rows = getattr(proposal, name)
        if rows is not None and (np.shape(rows) != (batch,) or np.asarray(rows).dtype != np.bool_):
            raise checks.PluginOutputError(
                f"{who} returned {name} of shape {np.shape(rows)} and dtype {np.asarray(rows).dtype}, expected "
                f"bool of shape ({batch},)"
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
        drawn = k if proposal.point_mass_rows is None else np.where(proposal.point_mass_rows, 0, k)  # rows read
        checks.check_draft_logits(
            who, proposal.logits, host if host is not None else np.zeros((batch, 0)), drawn, batch, values=check_logits
        )


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
