"""Where a row stops: EOS ids and stopping criteria, asked after every token of a step's run.

Plain decoding (transformers' ``generate``) appends one token to every row, then asks its stopping
criteria, ``criterion(input_ids, scores) -> bool[B]``, whether each row is done; a row that is done
keeps every token up to and including that one. A speculative step appends a run of ``n_b + 1``
tokens to row b at once, so :class:`StopRule` asks the same questions about every prefix of the
run, in order, and cuts the run after the first token where EOS or a criterion says stop: the
output is plain decoding's, token for token.

What a criterion is shown is what plain decoding would have shown it at that token: for a row with
``t`` generated tokens, the prompt as it was passed (its left padding included, i64[P]) followed by
the ``t`` tokens, one row of an i64[R, P + t] tensor (on the models' device), and ``scores=None``.
Criteria must answer row by row (row r's answer depends on row r's ids only), as transformers' own
do: the rows asked together are the ones at the same length, not the whole batch. A criterion that
reads only the last ``w`` ids is asked once per step for every (row, prefix) pair at once, with the
last ``min(w, P + t)`` ids of each: transformers' ``StopStringCriteria`` (``w`` = its longest stop
string) and ``EosTokenCriteria`` (``w = 1``), and any criterion with an integer attribute
``stop_window`` (a promise that it reads no more than that many trailing ids). Others are asked
once per distinct length ``P + t`` among the step's prefixes.

``stop_strings`` become transformers' ``StopStringCriteria`` (:func:`stop_string_criterion`), so a
stop string matches exactly where ``generate(stop_strings=..., tokenizer=...)`` stops: the token
that completes the string (possibly overhanging it) is the last one kept.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import torch

from specjax.generate.checks import PluginOutputError, plugin_name

__all__ = ["StopRule", "check_stopping_criteria", "stop_string_criterion"]

Criterion = Callable[..., Any]


def check_stopping_criteria(stopping_criteria: Any) -> list[Criterion]:
    """``stopping_criteria`` as a flat list of callables ``(input_ids, scores) -> bool[R]``.

    Accepts None, one callable (a transformers ``StoppingCriteria``), or a list or tuple of them
    (a ``StoppingCriteriaList`` is a list; nested lists are flattened). Raises ``TypeError``
    naming ``stopping_criteria`` otherwise.
    """
    if stopping_criteria is None:
        return []
    if callable(stopping_criteria) and not isinstance(stopping_criteria, list | tuple):
        return [stopping_criteria]
    if not isinstance(stopping_criteria, list | tuple):
        raise TypeError(
            "stopping_criteria: expected a StoppingCriteria, a StoppingCriteriaList or a list of callables "
            f"(input_ids, scores) -> bool tensor, got {type(stopping_criteria).__name__}"
        )
    flat: list[Criterion] = []
    for item in stopping_criteria:
        if isinstance(item, list | tuple):
            flat.extend(check_stopping_criteria(item))
        elif callable(item):
            flat.append(item)
        else:
            raise TypeError(
                "stopping_criteria: expected callables (input_ids, scores) -> bool tensor, got an item of type "
                f"{type(item).__name__}"
            )
    return flat


def stop_string_criterion(
    stop_strings: Any, tokenizer: Any, *, tokenizer_arg: str = "target_tokenizer"
) -> Criterion | None:
    """transformers' ``StopStringCriteria`` for ``stop_strings`` (a string or a list of strings), or None.

    Raises ``ValueError`` naming ``stop_strings`` for an empty string or list, or without a tokenizer
    (the criterion matches strings against the tokenizer's vocabulary; ``tokenizer_arg``: the
    argument that passes it, for the message).
    """
    if stop_strings is None:
        return None
    strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
    if not isinstance(strings, list | tuple) or not strings or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(
            f"stop_strings: expected a non-empty string or a list of non-empty strings, got {stop_strings!r}"
        )
    if tokenizer is None:
        raise ValueError(
            f"stop_strings: needs the target's tokenizer to match strings against its vocabulary; pass {tokenizer_arg}="
        )
    from transformers.generation.stopping_criteria import StopStringCriteria

    try:
        return StopStringCriteria(tokenizer, list(strings))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise ValueError(
            f"stop_strings: transformers' StopStringCriteria cannot read the vocabulary of {tokenizer_arg} "
            f"({type(err).__name__}: {err}); pass a transformers tokenizer of the target"
        ) from err


def _window(criterion: Criterion) -> int | None:
    """How many trailing ids ``criterion`` reads at most (None: it may read all of them)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxTimeCriteria, StopStringCriteria

    declared = getattr(criterion, "stop_window", None)
    if isinstance(declared, int) and not isinstance(declared, bool) and declared >= 1:
        return declared
    if isinstance(criterion, StopStringCriteria) and type(criterion) is StopStringCriteria:
        return int(criterion.maximum_token_len)
    if type(criterion) in (EosTokenCriteria, MaxTimeCriteria):
        return 1
    return None


class StopRule:
    """EOS ids and stopping criteria, asked after every token of each row's run (module docstring).

    ``prompts``: i64[B, P], the prompts as passed (left padding included); ``eos_ids``: the ids
    that end a row; ``criteria``: as :func:`check_stopping_criteria` returns them.
    """

    def __init__(self, eos_ids: AbstractSet[int], criteria: Sequence[Criterion], prompts: torch.Tensor) -> None:
        self.eos_ids = eos_ids
        self.criteria = [(c, _window(c), plugin_name("stopping criterion", c)) for c in criteria]
        self.device = prompts.device
        self.prompts = prompts.cpu().numpy() if self.criteria else np.zeros((0, 0), np.int64)

    def cut(self, rows: Sequence[int], generated: Sequence[list[int]], runs: Sequence[list[int]]) -> list[int | None]:
        """For each row, the index of the run's token it stops at (kept, the rest dropped), or None.

        ``rows``: each row's index in the batch (its prompt); ``generated``: its tokens before this
        step; ``runs``: the step's new tokens (the accepted draft tokens and the emitted one; empty for
        a row that has ended).
        """
        stop: list[int | None] = []
        for run in runs:
            at = next((i for i, t in enumerate(run) if t in self.eos_ids), None) if self.eos_ids else None
            stop.append(at)
        for criterion, window, name in self.criteria:
            # (row, index) pairs still able to stop the row earlier, grouped by what the criterion reads
            groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
            width = self.prompts.shape[1]
            for j, (run, at) in enumerate(zip(runs, stop, strict=True)):
                end = len(run) if at is None else at
                for i in range(end):
                    length = width + len(generated[j]) + i + 1
                    groups[length if window is None else min(window, length)].append((j, i))
            for size, pairs in sorted(groups.items()):
                ids = np.stack([self._tail(rows[j], generated[j], runs[j][: i + 1], size) for j, i in pairs])
                done = _as_row_flags(name, criterion(torch.as_tensor(ids, device=self.device), None), len(pairs))
                for (j, i), d in zip(pairs, done, strict=True):
                    current = stop[j]
                    if d and (current is None or i < current):
                        stop[j] = i
        return stop

    def _tail(self, row: int, generated: list[int], run: list[int], size: int) -> np.ndarray:
        """The last ``size`` ids of ``prompt[row] + generated + run`` (i64[size]), built from the tail only."""
        k_run = min(size, len(run))
        k_gen = min(size - k_run, len(generated))
        k_prompt = size - k_run - k_gen
        parts = [self.prompts[row, self.prompts.shape[1] - k_prompt :]] if k_prompt else []
        parts.append(np.asarray(generated[len(generated) - k_gen :] + run[len(run) - k_run :], np.int64))
        return np.concatenate(parts)


def _as_row_flags(name: str, answer: Any, rows: int) -> np.ndarray:
    """A criterion's answer as bool[rows], or a :class:`PluginOutputError` naming it."""
    flags = answer.detach().cpu().numpy() if isinstance(answer, torch.Tensor) else np.asarray(answer)
    if flags.dtype != np.bool_ or flags.shape not in ((rows,), (rows, 1)):
        raise PluginOutputError(
            f"{name} returned {type(answer).__name__} of shape {flags.shape} and dtype {flags.dtype}, expected a "
            f"bool tensor of shape ({rows},): one flag per row of input_ids"
        )
    return flags.reshape(rows)
