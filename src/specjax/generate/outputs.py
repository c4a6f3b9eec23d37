"""Per-token outputs of the emitted tokens: processed scores, raw logits, log-probabilities.

Plain decoding (transformers' ``generate(output_scores=True, output_logits=True,
return_dict_in_generate=True)``) returns, for each generated step, the target's logits at that
step (``logits``, float32) and the same logits after the logits processors and warpers
(``scores``): one f32[B, V] tensor per step. A speculative step scores ``[last, x_0 .. x_{W-1}]``
in one forward, so the logits of every token it emits are already there: position ``i`` of row b
holds the logits that chose the run's token ``i``. :class:`OutputRecorder` keeps those rows only
(the emitted tokens', after the stopping rule cut the run) and lays them out as ``generate`` does.

The processed scores are :func:`processed_scores` of the logits the verifier reads, so they are
the distribution the acceptance step used: the frontend's :func:`~specjax.kernels.frontend.row_stats`
(temperature, top-k, top-p; the rule the acceptance step applies) decides the kept tokens, which
keep ``logit / T`` (``logit · (1/T)``: the frontend scales by a reciprocal) and the others get
``-inf``, as transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
``TopPLogitsWarper`` do. Greedy rows keep their logits (``generate`` adds no warper when
``do_sample=False``).

Rows that ended before the last step (EOS, a stop string, a criterion) have no token there;
``generate`` still scores them (on the pad token it appends, values of no meaning) and keeps the
tensors' shape, so the recorder fills those rows with zeros. ``logprobs`` are
``log_softmax(scores)`` at each emitted token (transformers'
``compute_transition_scores(..., normalize_logits=True)``), NaN after a row ends.

Nothing here runs unless the caller asks for an output: the loop then makes no copy at all.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specjax.kernels.types import SamplingParams

__all__ = ["OutputRecorder", "Outputs", "processed_scores"]


@dataclass(frozen=True)
class Outputs:
    """The per-token outputs a call returns (``speculative_generate``'s ``output_*`` flags)."""

    scores: bool = False
    logits: bool = False
    logprobs: bool = False

    def __bool__(self) -> bool:
        return self.scores or self.logits or self.logprobs


def _processed_scores_jax(logits: Any, params: SamplingParams) -> Any:
    """f32[B', W, V] processed scores of ``logits`` f[B', W, V]; ``params`` per row (B')."""
    import jax.numpy as jnp

    from specjax.kernels.frontend import row_stats

    def per_position(a: Any) -> Any:
        return None if a is None else a[:, None]

    stats = row_stats(
        logits,
        per_position(params.temperature),
        per_position(params.active_top_k),
        per_position(params.active_one_minus_top_p),
    )
    x = logits.astype(jnp.float32)
    inv_t = stats.inv_temperature[..., None]
    kept = (x - stats.max[..., None]) * inv_t >= stats.cutoff[..., None]  # the frontend's relative scaled logit
    return jnp.where(stats.greedy[..., None], x, jnp.where(kept, x * inv_t, -jnp.inf))


@functools.cache
def _processed_scores_jit() -> Any:
    import jax

    # recompiles per logits shape and dtype and per params' static fields (top-k / top-p used)
    return jax.jit(_processed_scores_jax)


def processed_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The scores ``generate`` reports for ``logits``: the logits after temperature, top-k and top-p.

    Args:
      logits: f[B', W, V] torch, the logits the verifier reads (row b's distributions at W positions).
      params: the :class:`SamplingParams` of the B' rows (a row with temperature 0 is greedy: its
        logits are its scores).

    Returns:
      f32[B', W, V] torch on ``logits``' device: ``logit / T`` where the frontend's
      :func:`~specjax.kernels.frontend.row_stats` keeps the token, ``-inf`` elsewhere.
    """
    from specjax.adapters import jit_input, to_torch

    out = _processed_scores_jit()(jit_input(logits), params)
    return to_torch(out).to(logits.device)


class OutputRecorder:
    """Collects the outputs of each step's emitted tokens (module docstring) for B rows.

    ``greedy``: every row is greedy (temperature 0): the scores are the logits and nothing
    crosses to JAX.
    """

    def __init__(self, batch: int, outputs: Outputs, *, greedy: bool) -> None:
        self.outputs, self.greedy = outputs, greedy
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logprobs: list[list[float]] = [[] for _ in range(batch)]

    def record(
        self,
        rows: Sequence[int],
        emitted: Sequence[Sequence[int]],
        raw_logits: torch.Tensor,
        verified_logits: torch.Tensor,
        params: SamplingParams,
    ) -> None:
        """Keep the outputs of one step's emitted tokens.

        Args:
          rows: the batch row of each of the step's B' rows.
          emitted: each row's emitted tokens this step (empty for a finished row); token ``i``
            was chosen at position ``i``.
          raw_logits: f[B', W+1, V], the target's logits at ``[last, x_0 .. x_{W-1}]``.
          verified_logits: the logits the verifier read (``raw_logits`` processed by the logits
            processors; the same tensor when none run).
          params: the B' rows' sampling parameters.
        """
        counts = np.array([len(e) for e in emitted], np.int64)
        if not counts.any():
            return
        j_idx = torch.as_tensor(np.repeat(np.arange(len(counts)), counts), device=raw_logits.device)
        i_idx = torch.as_tensor(np.concatenate([np.arange(c) for c in counts]), device=raw_logits.device)
        splits = counts[counts > 0].tolist()
        owners = [rows[int(j)] for j in np.nonzero(counts)[0]]
        if self.outputs.logits:
            for row, chunk in zip(owners, raw_logits[j_idx, i_idx].float().split(splits), strict=True):
                self.logits[row].append(chunk)
        if not (self.outputs.scores or self.outputs.logprobs):
            return
        if self.greedy:
            scores = verified_logits[j_idx, i_idx].float()
        else:
            scores = processed_scores(verified_logits, params)[j_idx, i_idx]
        if self.outputs.scores:
            for row, chunk in zip(owners, scores.split(splits), strict=True):
                self.scores[row].append(chunk)
        if self.outputs.logprobs:
            chosen = torch.as_tensor([t for e in emitted for t in e], device=scores.device)
            values = torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
            start = 0
            for row, count in zip(owners, splits, strict=True):
                self.logprobs[row].extend(values[start : start + count])
                start += count

    def finish(
        self, width: int
    ) -> tuple[tuple[torch.Tensor, ...] | None, tuple[torch.Tensor, ...] | None, torch.Tensor | None]:
        """``(scores, logits, logprobs)`` for sequences of ``width`` new tokens: ``width`` f32[B, V]
        tensors each (zeros where a row had ended), and f32[B, width] (NaN there); None where not asked."""
        scores = _per_step(self.scores, width) if self.outputs.scores else None
        logits = _per_step(self.logits, width) if self.outputs.logits else None
        logprobs = None
        if self.outputs.logprobs:
            logprobs = torch.full((len(self.logprobs), width), float("nan"), dtype=torch.float32)
            for b, values in enumerate(self.logprobs):
                logprobs[b, : len(values)] = torch.as_tensor(values, dtype=torch.float32)
        return scores, logits, logprobs


def _per_step(chunks: list[list[torch.Tensor]], width: int) -> tuple[torch.Tensor, ...]:
    """Each row's f32[t_b, V] chunks laid out as ``width`` f32[B, V] tensors, zeros past a row's end."""
    rows = [torch.cat(c) if c else None for c in chunks]
    sample = next((r for r in rows if r is not None), None)
    if sample is None:
        return ()
    full = torch.zeros((width, len(rows), sample.shape[-1]), dtype=torch.float32, device=sample.device)
    for b, r in enumerate(rows):
        if r is not None:
            full[: r.shape[0], b] = r
    return tuple(full.unbind(0))
