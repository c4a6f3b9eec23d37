"""Row processors: what the hook passes (:class:`Prefixes`), and transformers' built-in processors on it, vectorised.

A row processor (:mod:`specjax.generate.processors`) takes every processed
(row, position) pair of one call at once: scores f32[N, V] and a
:class:`Prefixes` naming each scores row's prefix. transformers' processor
classes take ``(input_ids i64[B, L], scores f32[B, V])``, one length ``L`` for
the batch, so the loop would call each once per distinct prefix length among
the pairs (with ragged rows and G draft positions, many calls a step, each on
the whole batch). :func:`vectorised` turns the built-in ones into row
processors evaluated on all N pairs in one call:

* **prefix-free** (temperature, top-k, top-p, top-h, min-p, typical,
  epsilon, eta, ``suppress_tokens``, log-softmax, inf/NaN removal): they never
  read ``input_ids``; transformers' instance itself runs once on the N rows;
* **length-only** (``min_new_tokens``, forced BOS / EOS,
  ``begin_suppress_tokens``): the instance's rule, applied where each row's
  prefix length says it fires;
* **content** (``repetition_penalty`` with its ``prompt_ignore_length``,
  ``no_repeat_ngram_size``, ``bad_words_ids`` and ``sequence_bias``):
  transformers' arithmetic on the N right-aligned prefixes, the alignment
  padding masked out.

Each reads its transformers instance's attributes at every call and equals
that instance called on the row's exact prefix (``tests/test_row_processors.py``
holds them to it on random ragged, left-padded prefixes). Only instances of
exactly these classes are turned (a subclass may read the prefix its own way
and keeps the per-length path).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Prefixes", "vectorised"]


@dataclass(frozen=True)
class Prefixes:
    """What a row processor is told about the ``N`` scores rows of one call.

    Attributes:
      rows: i64[N], each scores row's batch row (the caller's row index).
      ids: i64[N, L] host array: each prefix, right-aligned and left-padded with
        the pad id to the call's longest, ``L = max(lengths)``.
      lengths: i64[N], each prefix's length (the P prompt columns included).
      committed: i64[N] <= lengths: how many of the prefix's tokens are committed;
        the other ``lengths - committed`` are draft tokens.
      prompt_length: P, the prompt's columns (left padding included).
    """

    rows: np.ndarray
    ids: np.ndarray
    lengths: np.ndarray
    committed: np.ndarray
    prompt_length: int

    def prefix(self, n: int) -> np.ndarray:
        """i64[lengths[n]]: scores row ``n``'s prefix."""
        return self.ids[n, self.ids.shape[1] - int(self.lengths[n]) :]


def _ids(prefixes: Prefixes, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids i64[N, L], lengths i64[N], position i64[N, L])`` on ``device``; ``position``: each column's index in
    its row's prefix (``generate``'s ``input_ids`` column), negative on the alignment padding."""
    ids = torch.as_tensor(prefixes.ids, device=device)
    lengths = torch.as_tensor(prefixes.lengths, device=device)
    width = ids.shape[1]
    position = torch.arange(width, device=device)[None, :] - (width - lengths)[:, None]
    return ids, lengths, position


def _fill_rows(scores: torch.Tensor, fire: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows where ``fire`` (bool[N]) become ``-inf`` but ``tokens`` (0 there): forced BOS / EOS."""
    forced = torch.full_like(scores[:1], -math.inf)
    forced[:, tokens] = 0
    return torch.where(fire[:, None], forced, scores)


def _suppress_rows(scores: torch.Tensor, fire: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` to ``-inf`` in the rows where ``fire`` (bool[N])."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    banned = torch.isin(vocab, tokens.to(scores.device))
    return torch.where(fire[:, None] & banned[None, :], -math.inf, scores)


class _Vectorised:
    """A row processor standing for transformers' instance ``p``: one call on all N scores rows."""

    def __init__(self, p: Any) -> None:
        self.p = p

    def __repr__(self) -> str:
        return f"vectorised({self.p!r})"


class _PrefixFree(_Vectorised):
    """A processor that never reads ``input_ids``: the instance itself, once, on the N rows."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        return self.p(scores.new_zeros((scores.shape[0], 0), dtype=torch.long), scores)


class _MinNewTokens(_Vectorised):
    """``MinNewTokensLengthLogitsProcessor``: EOS ids banned while ``length - prompt_length_to_skip <
    min_new_tokens``."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        lengths = torch.as_tensor(prefixes.lengths, device=scores.device)
        fire = lengths - self.p.prompt_length_to_skip < self.p.min_new_tokens
        return _suppress_rows(scores, fire, self.p.eos_token_id)


class _SuppressAtBegin(_Vectorised):
    """``SuppressTokensAtBeginLogitsProcessor``: its tokens banned where ``length == begin_index``."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        lengths = torch.as_tensor(prefixes.lengths, device=scores.device)
        return _suppress_rows(scores, lengths == self.p.begin_index, self.p.begin_suppress_tokens)


class _ForcedBOS(_Vectorised):
    """``ForcedBOSTokenLogitsProcessor``: only ``bos_token_id`` where ``length == 1``."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        lengths = torch.as_tensor(prefixes.lengths, device=scores.device)
        return _fill_rows(scores, lengths == 1, torch.as_tensor(self.p.bos_token_id, device=scores.device))


class _ForcedEOS(_Vectorised):
    """``ForcedEOSTokenLogitsProcessor``: only the EOS ids where ``length == max_length - 1``."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        lengths = torch.as_tensor(prefixes.lengths, device=scores.device)
        return _fill_rows(scores, lengths == self.p.max_length - 1, self.p.eos_token_id.to(scores.device))


class _RepetitionPenalty(_Vectorised):
    """``RepetitionPenaltyLogitsProcessor`` (2-D scores): each token of the prefix from ``prompt_ignore_length`` on
    (an int, or i64[B] indexed by the batch row) has its score divided by the penalty (multiplied where negative);
    ids past the scores' vocabulary are skipped."""

    def start(self, batch: int, prompt_length: int) -> None:
        ignore = self.p.prompt_ignore_length
        if isinstance(ignore, torch.Tensor) and ignore.shape[0] != batch:  # transformers refuses it at its call
            raise ValueError(
                f"logits_processor {type(self.p).__name__}: prompt_ignore_length has {ignore.shape[0]} entries, "
                f"expected one per batch row ({batch}); pass one per row, or an int for all rows"
            )

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        ids, _, position = _ids(prefixes, scores.device)
        ignore = self.p.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):
            rows = torch.as_tensor(prefixes.rows, device=scores.device)
            start = ignore.to(scores.device)[rows][:, None]
        else:
            start = torch.as_tensor(int(ignore or 0), device=scores.device)
        counted = (position >= start) & (ids < vocab)
        ids = ids.clamp(max=vocab - 1)  # a column that does not count writes its token's own score back
        score = scores.gather(1, ids)
        penalty = self.p.penalty
        penalised = torch.where(score < 0, score * penalty, score / penalty)
        score = torch.where(counted, penalised, score)
        # A token met at counted and uncounted columns gets both values written: the penalised one is the
        # smaller for a penalty above 1 (larger below), so the reduction keeps it; one met only at uncounted
        # columns keeps its score. Same values as transformers' scatter, written in place (the loop's own
        # tensor): no (N, V + 1) copy of the scores.
        return scores.scatter_reduce_(1, ids, score, "amin" if penalty > 1 else "amax")


class _NoRepeatNGram(_Vectorised):
    """``NoRepeatNGramLogitsProcessor``: every window of ``ngram_size`` tokens inside the prefix whose first
    ``ngram_size - 1`` equal the prefix's last ones bans its last token (ids past the vocabulary skipped)."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        size = int(self.p.ngram_size)
        ids, lengths, _ = _ids(prefixes, scores.device)
        width, vocab = ids.shape[1], scores.shape[-1]
        if width < size:
            return scores
        suffix = ids[:, width + 1 - size :]
        windows = ids.unfold(dimension=1, size=size, step=1)  # [N, width - size + 1, size]
        starts = torch.arange(windows.shape[1], device=scores.device)
        inside = starts[None, :] >= (width - lengths)[:, None]  # no window reaches into the alignment padding
        matches = (windows[..., :-1] == suffix.unsqueeze(1)).all(dim=-1) & inside
        banned = scores.new_zeros((scores.shape[0], vocab + 1), dtype=torch.bool)
        banned.scatter_(1, torch.where(matches, windows[..., -1].clamp(max=vocab), vocab), True)
        return scores.masked_fill(banned[:, :vocab], -math.inf)


class _SequenceBias(_Vectorised):
    """``SequenceBiasLogitsProcessor`` / ``NoBadWordsLogitsProcessor``: the one-token biases, plus each longer
    sequence's bias on its last token in the rows whose prefix ends with the rest of it."""

    def process_rows(self, prefixes: Prefixes, scores: torch.Tensor) -> torch.Tensor:
        p = self.p
        if not p.prepared_bias_variables:
            p._prepare_bias_variables(scores)
        ids, lengths, _ = _ids(prefixes, scores.device)
        bias = torch.zeros_like(scores)
        bias += p.length_1_bias
        for heads, last_tokens, biases in p.multi_token_biases:
            size = heads.shape[1]
            if size > ids.shape[1]:
                continue
            matching = (ids[:, None, -size:] == heads).all(dim=-1) & (lengths >= size)[:, None]
            bias.index_add_(1, last_tokens, torch.where(matching, biases, 0.0).to(bias.dtype))
        return scores + bias


@functools.cache
def _table() -> dict[type, Callable[[Any], _Vectorised]]:
    from transformers.generation import logits_process as lp

    free = (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "TopHLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "SuppressTokensLogitsProcessor",
        "LogitNormalization",
        "InfNanRemoveLogitsProcessor",
    )
    table: dict[type, Callable[[Any], _Vectorised]] = {
        getattr(lp, name): _PrefixFree for name in free if hasattr(lp, name)
    }
    table.update(
        {
            lp.MinNewTokensLengthLogitsProcessor: _MinNewTokens,
            lp.SuppressTokensAtBeginLogitsProcessor: _SuppressAtBegin,
            lp.ForcedBOSTokenLogitsProcessor: _ForcedBOS,
            lp.ForcedEOSTokenLogitsProcessor: _ForcedEOS,
            lp.RepetitionPenaltyLogitsProcessor: _RepetitionPenalty,
            lp.NoRepeatNGramLogitsProcessor: _NoRepeatNGram,
            lp.SequenceBiasLogitsProcessor: _SequenceBias,
            lp.NoBadWordsLogitsProcessor: _SequenceBias,
        }
    )
    return table


def vectorised(p: Any) -> Any | None:
    """A row processor computing transformers' built-in processor ``p`` on all of a call's prefixes at once, or
    None where ``p`` is not one of exactly the classes this module covers (it keeps the per-length path)."""
    make = _table().get(type(p))
    if make is _SequenceBias and not hasattr(p, "multi_token_biases"):
        return None  # a transformers release that lays out its biases otherwise
    return None if make is None else make(p)
