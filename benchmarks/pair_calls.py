"""Target-only generation on the default pair, as the B = 1 benchmarks time it beside theirs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def eos_and_pad(pair: Any) -> tuple[int, int]:
    """The pair's end-of-sequence id (the first, if several) and its pad id (EOS without one)."""
    eos = pair.target.generation_config.eos_token_id
    eos = eos if isinstance(eos, int) else eos[0]
    pad = pair.tokenizer.pad_token_id
    return eos, pad if pad is not None else eos


def greedy_target_only(
    pair: Any, max_new_tokens: int, temperature: float = 0.0
) -> Callable[[torch.Tensor, torch.Tensor], list[int]]:
    """``call(ids i64[1, P], mask i64[1, P]) -> new token ids``: ``target.generate``, greedy
    (``temperature`` > 0: sampled at it, no top-k / top-p, as ``speculative_generate``'s defaults)."""
    eos, pad = eos_and_pad(pair)
    sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    kwargs: dict[str, Any] = sample if temperature > 0 else {"do_sample": False}

    def call(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
        with torch.inference_mode():
            out = pair.target.generate(
                ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **kwargs
            )
        return out[0, ids.shape[1] :].tolist()

    return call
