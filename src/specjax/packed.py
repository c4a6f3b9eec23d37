"""The loop's forwards through copies of a CPU model's linear layers packed once for oneDNN.

On CPU, torch's dense ``linear`` repacks its weight on every call. For the few
rows a generation step scores, that repacking costs as much as the product or
more: SmolLM2-135M's LM head (49,152 × 576) takes 9.2 ms for one row, 22 ms for
two and 16-17 ms for four to eight on the project's 2-core machines, where
oneDNN's product over a weight packed once takes 4.4, 5.4 and 6.0-7.1 ms; the
model's other 210 linear layers pay the same per-call tax, and the whole
forward over two new tokens takes 94 ms dense, 60 ms packed
(``benchmarks/bench_packed.py``). :func:`model_packed` swaps such copies in for
the duration of one forward and puts the model's own layers back after it;
each copy is made at first use and kept while its layer is alive and
unchanged (a weight updated in place is packed afresh).

Which layers: ``SPECJAX_PACKED_LINEARS`` (environment, read at each forward)
is ``all`` (the default: every ``nn.Linear`` of the model, at the size of
their weights in memory), ``head`` (the LM head only) or ``0`` (none). Only
``nn.Linear`` modules with float32 weights on the CPU, where torch has oneDNN,
are taken; others run as they are. The outputs are the same products summed
in another order: they differ from the dense ones by float32 rounding (about
1e-6 relative), as a forward over several rows already differs from one over a
single row.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ENV", "MODES", "PackedLinear", "model_packed", "packed_layers", "packed_mode"]

ENV = "SPECJAX_PACKED_LINEARS"
MODES = ("all", "head", "0")

# (parent module, child name, the model's layer there, its packed copy)
Layers = list[tuple[nn.Module, str, nn.Linear, "PackedLinear"]]
# layer -> (its weight's and bias's (data pointer, version) when packed, the packed copy)
_COPIES: weakref.WeakKeyDictionary[nn.Linear, tuple[tuple[Any, ...], PackedLinear]] = weakref.WeakKeyDictionary()
# model -> {mode: (the layers' state when planned, [(parent, name, layer) as weak references, copy])}:
# what a forward swaps in; weak, since a model is its own layers' parent (the value would keep the key alive)
_Plan = tuple[tuple[Any, ...] | None, list[tuple[Any, str, Any, "PackedLinear"]]]
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[str, _Plan]] = weakref.WeakKeyDictionary()


class PackedLinear(nn.Module):
    """``linear`` over a weight packed once in oneDNN's layout: f32[..., in] -> f32[..., out]."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            self.weight_packed = dense.weight.detach().to_mkldnn()
            self.bias_packed = None if dense.bias is None else dense.bias.detach().to_mkldnn()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.dense = weakref.ref(dense)  # the layer it copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).contiguous().to_mkldnn()
        y = torch._C._nn.mkldnn_linear(flat, self.weight_packed, self.bias_packed).to_dense()
        return y.reshape(*lead, self.out_features)


def packed_mode() -> str:
    """The setting of ``SPECJAX_PACKED_LINEARS``: ``all`` (default), ``head`` or ``0``."""
    value = os.environ.get(ENV, "all").strip()
    if value not in MODES:
        raise ValueError(f"{ENV}: expected one of {', '.join(MODES)}, got {value!r}")
    return value


def _packable(layer: Any) -> bool:
    if type(layer) is not nn.Linear:
        return False
    params = [layer.weight] + ([] if layer.bias is None else [layer.bias])
    return all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)


def _state(layer: nn.Linear) -> tuple[Any, ...]:
    """The weight's and bias's (data pointer, version): a new one when either is replaced or changed in place."""
    return tuple((p.data_ptr(), p._version) for p in layer._parameters.values() if p is not None)


def _find_sites(model: nn.Module, mode: str) -> list[tuple[nn.Module, str, nn.Linear]]:
    head = None
    if mode == "head":
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if isinstance(head, PackedLinear):
            head = head.dense()
        if head is None:
            return []
    sites = []
    for parent in model.modules():
        for name, child in parent._modules.items():
            if isinstance(child, PackedLinear):  # a forward of the same model running: its layer
                child = child.dense()
            if isinstance(child, nn.Linear) and _packable(child) and (head is None or child is head):
                sites.append((parent, name, child))
    return sites


def _fingerprint(layers: Layers) -> tuple[Any, ...] | None:
    """The layers' weights' (data pointer, version), or None if a layer is no longer where it was."""
    state: list[Any] = []
    for parent, name, dense, _ in layers:
        if parent is None or dense is None:
            return None
        current = parent._modules.get(name)
        # a copy in place is a forward of the same model running (nested, or another thread): not moved
        if current is not dense and not isinstance(current, PackedLinear):
            return None
        state.append(_state(dense))
    return tuple(state)


def _copy(layer: nn.Linear) -> PackedLinear:
    state = _state(layer)
    hit = _COPIES.get(layer)
    if hit is not None and hit[0] == state:
        return hit[1]
    packed = PackedLinear(layer)
    _COPIES[layer] = (state, packed)
    return packed


def packed_layers(model: Any) -> tuple[str, Layers]:
    """What the setting packs in ``model``: ``(mode, [(parent, name, dense layer, packed copy)])``.

    Copies are made here (or refreshed for a weight changed since). The mode
    is ``all`` or ``head``, or ``0`` with no layers where nothing applies
    (setting ``0``, no oneDNN, no float32 CPU ``nn.Linear``): the key by
    which the loop keeps its timings apart. Raises ``ValueError`` for a bad
    setting.
    """
    mode = packed_mode()
    if mode == "0" or not isinstance(model, nn.Module) or not torch.backends.mkldnn.is_available():
        return "0", []
    plans = _PLANS.setdefault(model, {})
    plan = plans.get(mode)
    if plan is not None:
        layers = [(parent(), name, dense(), copy) for parent, name, dense, copy in plan[1]]
        if plan[0] is not None and _fingerprint(layers) == plan[0]:
            return (mode if layers else "0"), layers
    layers = [(parent, name, dense, _copy(dense)) for parent, name, dense in _find_sites(model, mode)]
    refs = [(weakref.ref(parent), name, weakref.ref(dense), copy) for parent, name, dense, copy in layers]
    plans[mode] = (_fingerprint(layers), refs)
    return (mode if layers else "0"), layers


@contextlib.contextmanager
def model_packed(model: Any) -> Iterator[str]:
    """Run the forwards inside with ``model``'s layers packed (:func:`packed_layers`), then put them back.

    Yields the mode that applied (``all``, ``head`` or ``0``).
    """
    mode, layers = packed_layers(model)
    for parent, name, _, packed in layers:
        parent._modules[name] = packed
    try:
        yield mode
    finally:
        for parent, name, dense, _ in layers:
            parent._modules[name] = dense
