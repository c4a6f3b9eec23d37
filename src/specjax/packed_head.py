"""The loop's forwards through a prepacked copy of a CPU model's LM head (oneDNN).

On CPU, torch's dense ``linear`` repacks the weight for every call, and for a
few rows the LM head, the largest matrix of a small model (SmolLM2-135M's is
49,152 × 576, 113 MB), pays that on each forward: on the project's 2-core
machines 9.2 ms for one row, 23 ms for two and 17-19 ms for four to eight,
where oneDNN's product over a weight packed once takes 4.6, 5.8 and
6.4-8.5 ms (``benchmarks/bench_lm_head.py``; the loop's forwards 10-19 %
faster). :func:`lm_head_packed` swaps such a copy
in for the duration of one forward; the copy is made at first use and kept
while the model's head is alive and unchanged (a weight updated in place is
packed afresh).

Taken only for an ``nn.Linear`` head with float32 weights on the CPU, where
torch has oneDNN; ``SPECJAX_PACKED_LM_HEAD=0`` (environment) turns it off.
The logits are the same product summed in another order: they differ from
the dense ones by float32 rounding (about 1e-6 relative), as a forward over
several rows already differs from one over a single row.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ENV", "PackedLinear", "lm_head_packed", "packed_lm_head"]

ENV = "SPECJAX_PACKED_LM_HEAD"

# head module -> (the weight's and bias's (data pointer, version) when packed, the packed copy)
_PACKED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], PackedLinear]] = weakref.WeakKeyDictionary()


class PackedLinear(nn.Module):
    """``linear`` over a weight packed once in oneDNN's layout: f32[..., in] -> f32[..., out]."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            self.weight_packed = dense.weight.detach().to_mkldnn()
            self.bias_packed = None if dense.bias is None else dense.bias.detach().to_mkldnn()
        self.in_features, self.out_features = dense.in_features, dense.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(flat, self.weight_packed, self.bias_packed).to_dense()
        return y.reshape(*lead, self.out_features)


def _enabled() -> bool:
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


def _state(head: nn.Linear) -> tuple[Any, ...]:
    params = [head.weight] + ([] if head.bias is None else [head.bias])
    return tuple((p.data_ptr(), p._version) for p in params)


def packed_lm_head(model: Any) -> PackedLinear | None:
    """The packed copy of ``model``'s LM head (made or refreshed here), or None where it does not apply."""
    if not _enabled() or not torch.backends.mkldnn.is_available():
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or not callable(getattr(model, "set_output_embeddings", None)):
        return None
    if head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
        return None
    if head.bias is not None and head.bias.dtype != torch.float32:
        return None
    state = _state(head)
    hit = _PACKED.get(head)
    if hit is not None and hit[0] == state:
        return hit[1]
    packed = PackedLinear(head)
    _PACKED[head] = (state, packed)
    return packed


@contextlib.contextmanager
def lm_head_packed(model: Any) -> Iterator[None]:
    """Run the forwards inside with ``model``'s LM head packed (:func:`packed_lm_head`), then put it back."""
    packed = packed_lm_head(model)
    if packed is None:
        yield
        return
    original = model.get_output_embeddings()
    model.set_output_embeddings(packed)  # a model whose setter does not set runs its own head
    try:
        yield
    finally:
        model.set_output_embeddings(original)
