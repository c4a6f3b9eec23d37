"""The verification strategies, one chosen per call: the acceptance step of a :class:`DraftBatch`.

* :class:`GreedyVerifier` (every row greedy, the built-in sampler): the
  target's first argmax decides, from one torch reduction
  (:func:`greedy_verify`; the JAX step's result for any draft distribution and
  keys, ``tests/test_greedy_verify.py``).
* :class:`FusedVerifier` (the built-in sampler): the front end and the kernel
  in one jitted step (:func:`specjax.kernels.steps.verify_step`), on inputs
  padded to a few bucketed shapes (:func:`bucketed`).
* :class:`SamplerVerifier`: a sampler plugin with the
  :func:`specjax.rejection_sample` contract, on the processed probabilities.

Each returns ``(n i64[B'], tokens i32[B', W+1])`` host arrays: the one host
synchronisation of a step.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from specjax.drafters.base import SamplingState
from specjax.generate.draft_batch import DraftBatch
from specjax.kernels.greedy import accept_greedy
from specjax.slots import to_host

__all__ = ["FusedVerifier", "GreedyVerifier", "SamplerVerifier", "Verifier", "choose_verifier", "greedy_verify"]


class Verifier(Protocol):
    def __call__(
        self, batch: DraftBatch, target_logits: torch.Tensor, sampling: SamplingState, step: int
    ) -> tuple[np.ndarray, np.ndarray]: ...


def choose_verifier(sampler: Any, greedy: bool, batch_size: int, num_draft_tokens: int) -> Verifier:
    """The strategy for a call: greedy (every row greedy, built-in sampler), fused, or the plugin ``sampler``."""
    if sampler is not None:
        return SamplerVerifier(sampler)
    if greedy:
        return GreedyVerifier()
    return FusedVerifier(batch_size, num_draft_tokens + 2)


class GreedyVerifier:
    """Every row greedy: :func:`greedy_verify` (the draft distributions and keys do not matter)."""

    def __call__(
        self, batch: DraftBatch, target_logits: torch.Tensor, sampling: SamplingState, step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        return greedy_verify(batch.tokens_t, target_logits, batch.k)


def _jax_draft_logits(batch: DraftBatch) -> tuple[Any, ...] | None:
    """The draft logits as jitted inputs (torch crosses zero-copy), repeated up to the padded width."""
    from specjax.adapters import jit_input

    if batch.logits is None:
        return None
    d = tuple(jit_input(x) if isinstance(x, torch.Tensor) else x for x in batch.logits)
    return d + (d[-1],) * (batch.width - batch.g)


class FusedVerifier:
    """The built-in sampler: one jitted step (:func:`specjax.kernels.steps.verify_step`) on bucketed shapes.

    ``batch_size``: the call's B (rows are padded to a power of two up to it);
    ``max_width``: the widest W + 1 a step can have (positions are padded to
    one of :func:`buckets` up to it).
    """

    def __init__(self, batch_size: int, max_width: int) -> None:
        self.batch_size, self.max_width = batch_size, max_width

    def __call__(
        self, batch: DraftBatch, target_logits: torch.Tensor, sampling: SamplingState, step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        import jax
        import jax.numpy as jnp

        from specjax.adapters import jit_input
        from specjax.kernels import steps

        tj = jit_input(target_logits)
        d_logits = _jax_draft_logits(batch)
        # shapes from a few buckets: each new (B', width) compiles the step anew
        xb, db, tb, kb, pb, nb, mb = bucketed(
            batch.tokens_v,
            d_logits,
            target_logits,
            sampling.keys,
            sampling.params,
            batch.k,
            self.batch_size,
            self.max_width,
            jnp,
            batch.mixed_point_masses,
        )
        tb = tj if tb is target_logits else jit_input(tb)
        result = steps.verify_step(xb, db, tb, kb, step, pb, nb, mb)
        b_now = len(batch.k)
        tok = np.asarray(jax.block_until_ready(result.tokens[:b_now, : batch.width + 1]))
        n = np.asarray(result.num_accepted[:b_now]).astype(np.int64)
        del d_logits, tj, tb  # JAX has finished reading the torch buffers
        return n, tok


class SamplerVerifier:
    """A sampler plugin (the :func:`specjax.rejection_sample` contract), once per distinct draft length."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __call__(
        self, batch: DraftBatch, target_logits: torch.Tensor, sampling: SamplingState, step: int
    ) -> tuple[np.ndarray, np.ndarray]:
        import jax

        from specjax.adapters import jit_input

        tj = jit_input(target_logits)
        d_logits = _jax_draft_logits(batch)
        n_j, tok_j = _run_sampler(
            self.sampler, batch.tokens_v, d_logits, tj, sampling, step, batch.k, batch.mixed_point_masses
        )
        tok = np.asarray(jax.block_until_ready(tok_j))
        n = np.asarray(n_j).astype(np.int64)
        del d_logits, tj
        return n, tok


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


def buckets(limit: int) -> list[int]:
    """Sizes 1, 2, 3, 5, 9, 17, ... (one more than powers of two) up to ``limit``, and ``limit``."""
    sizes, n = [1, 2], 1
    while sizes[-1] < limit:
        n *= 2
        sizes.append(min(n + 1, limit))
    return sizes


def bucketed(
    x_j: Any,
    d_logits: tuple[Any, ...] | None,
    target_logits: torch.Tensor,
    keys: Any,
    params: Any,
    k_rows: np.ndarray,
    batch: int,
    max_width: int,
    jnp: Any,
    point_mass_rows: np.ndarray | None = None,
) -> tuple[Any, tuple[Any, ...] | None, torch.Tensor, Any, Any, np.ndarray, np.ndarray | None]:
    """The sampled verification's inputs padded to a bucketed (rows, positions) shape.

    ``verify_step`` compiles once per shape, and the adaptive length and rows
    that finish meet many (B' rows x width + 1 positions): the drafters report's
    B = 8 sampled rows on input-grounded prompts paid seconds of compilation in
    their timed calls (``compile_s``). Rows are padded to a power of two (at most
    ``batch``), positions to one of :func:`buckets` (at most ``max_width``),
    with copies of row 0 and of the last position that test nothing (``k`` = 0
    for the added rows); a row's draws depend on its own key and ``k_b`` only
    (:func:`specjax.kernels.steps.sampling_uniform`), so the padding changes no
    token. Returns ``(draft tokens, draft logits, target logits (torch),
    keys, params, k i32[B''], point_mass_rows bool[B''] or None)``; the target
    logits are the input itself when no padding is needed.
    """
    b, w1 = target_logits.shape[:2]
    rows = min(batch, 1 << max(b - 1, 0).bit_length())
    cols = next(size for size in buckets(max_width) if size >= w1)
    k = np.zeros(rows, np.int32)
    k[:b] = k_rows
    masses = None
    if point_mass_rows is not None:  # the added rows test nothing: either kind will do
        masses = np.zeros(rows, bool)
        masses[:b] = point_mass_rows
    if rows == b and cols == w1:
        return x_j, d_logits, target_logits, keys, params, k, masses
    row_idx = np.concatenate([np.arange(b), np.zeros(rows - b, np.int64)])
    pos_idx = np.minimum(np.arange(cols), w1 - 1)
    t = target_logits[torch.as_tensor(row_idx)[:, None], torch.as_tensor(pos_idx)[None, :]]
    x = np.zeros((rows, cols - 1), np.int32)  # token 0 where nothing is tested
    x[:b, : w1 - 1] = np.asarray(x_j)
    d = None
    if d_logits is not None:
        d = tuple(jnp.asarray(a)[row_idx] for a in d_logits)
        d += (d[-1],) * (cols - 1 - len(d))
    return x, d, t, keys[row_idx], _take_rows(params, row_idx), k, masses


def _take_rows(params: Any, rows: Any) -> Any:
    """The per-row fields of a :class:`SamplingParams` at ``rows`` (its static fields stay)."""
    import jax

    return jax.tree.map(lambda a: a[rows], params)


def _run_sampler(sampler, xj, draft_logits, tj, s: SamplingState, step, k_rows, point_mass_rows=None):
    """A probabilities-contract sampler, called once per distinct draft length in the batch."""
    import jax.numpy as jnp

    from specjax.kernels import steps

    xj = jnp.asarray(xj)
    q, p, u = steps.probs_step(draft_logits, tj, s.keys, step, s.params, xj, point_mass_rows)
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
