"""The loop's forwards through oneDNN's product for a CPU model's linear layers, on their own weights.

On the project's CPUs (AMD EPYC), torch's dense ``linear`` repacks the weight
on every call. For the few rows a generation step scores, that repacking costs
as much as the product or more: SmolLM2-135M's LM head (49,152 × 576) takes
9.2 ms for one row, 22 ms for two and 16-17 ms for four to eight on the
project's 2-core machines, where oneDNN's inner product (``mkldnn_linear``)
takes 4.4, 5.4 and 6.0-7.1 ms; the model's other 210 linear layers pay the
same per-call tax, and the whole forward over two new tokens takes 94 ms
dense, 60 ms through oneDNN (``benchmarks/bench_packed.py``).
:func:`model_packed` swaps a :class:`PackedLinear` in for each such layer for
the duration of one forward and puts the model's own layers back after it.

The product reads the layer's own weight and bias tensors, not a copy: it sees
the weights as they are when it runs, however they were written (through the
parameter, through ``.data`` as PEFT's merges do, or by a replaced parameter
or layer), from the next product on and at no cost per call; a write racing a
forward from another thread is as undefined as it is for torch's own forward.
(oneDNN's product over a copy made by ``to_mkldnn`` is the same computation,
bit for bit, on a plain-layout buffer; a copy only cost memory and could go
stale.)

Shapes: oneDNN keeps a compiled primitive per shape it has run, about a
megabyte each, for the life of the process. So that a process's set of shapes
stays bounded however varied its inputs, the rows given to oneDNN are
:func:`rows_bucket` of the input's rows: exact up to ``ROWS_EXACT`` (a step's
rows, batch × draft width, at small batches), padded with zero rows up to the
next of ``ROWS_BUCKETS`` above it; inputs of more than ``ROWS_BUCKETS[-1]``
rows (a prompt's prefill, large batches) take torch's dense ``linear``, where
the repacking is spread over the rows.

Which layers: ``SPECJAX_PACKED_LINEARS`` (environment, read at each forward)
is ``auto`` (the default), ``all`` (every ``nn.Linear`` of the model), ``head``
(the LM head only) or ``0`` (none). ``auto`` is ``all`` on AMD x86-64 CPUs and
``0`` elsewhere: torch's dense product is MKL's, whose small-row products on
AMD CPUs repack the weight (there oneDNN made the default target's forward
0.63-0.87× as long), and which on Intel CPUs is faster than oneDNN's (there
``all`` made it 1.23-1.83× as long; ``benchmarks/bench_packed.py``, both in
docs/benchmarks.md); other CPUs were not measured and keep torch's own path.
Only ``nn.Linear`` modules with float32 weights on the CPU, where torch has
oneDNN enabled, are taken, and only for float32 inputs outside autocast; the
others run as they are. The outputs are the same products summed in another
order: they differ from the dense ones by float32 rounding (about 1e-6
relative), as a forward over several rows already differs from one over a single
row.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "ENV",
    "MODES",
    "ROWS_BUCKETS",
    "ROWS_EXACT",
    "PackedLinear",
    "auto_mode",
    "cpu_vendor",
    "model_packed",
    "packed_layers",
    "packed_mode",
    "rows_bucket",
]

ENV = "SPECJAX_PACKED_LINEARS"
MODES = ("auto", "all", "head", "0")
ROWS_EXACT = 16  # rows given to oneDNN as they are: a step's batch × width at small batches
ROWS_BUCKETS = (24, 32, 48, 64)  # above that, padded up to the next of these; more rows run dense

# (parent module, child name, the model's layer there, its stand-in)
Layers = list[tuple[nn.Module, str, nn.Linear, "PackedLinear"]]
# model -> {mode: (the sites' places when planned, [(parent, name, layer) as weak references, stand-in])}:
# what a forward swaps in; weak, since a model is its own layers' parent (the value would keep the key alive)
_Plan = tuple[tuple[Any, ...] | None, list[tuple[Any, str, Any, "PackedLinear"]]]
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[str, _Plan]] = weakref.WeakKeyDictionary()


def rows_bucket(rows: int) -> int | None:
    """The rows oneDNN runs for an input of ``rows`` rows: ``rows`` itself up to ``ROWS_EXACT``, the
    next of ``ROWS_BUCKETS`` above it, None (torch's dense ``linear``) beyond the last bucket.

    ``ROWS_EXACT + len(ROWS_BUCKETS)`` row counts at most, so oneDNN's primitives (one per shape,
    kept for the process's life) are bounded by that times the model's distinct weight shapes.
    """
    if rows <= ROWS_EXACT:
        return rows
    return next((b for b in ROWS_BUCKETS if b >= rows), None)


class PackedLinear(nn.Module):
    """A layer's ``linear`` through oneDNN's inner product on its own weight: f32[..., in] -> f32[..., out].

    Holds the layer weakly and reads its ``weight`` and ``bias`` at each call
    (no copy). Inputs whose rows (the product of the leading dimensions) are
    beyond the last of ``ROWS_BUCKETS``, and calls that oneDNN does not serve
    (not float32 on the CPU, autocast), run the layer's dense product.
    Gradients flow through either (``mkldnn_linear`` has torch's backward).
    """

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.dense = weakref.ref(dense)  # the layer it stands in for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.dense()
        if layer is None:
            raise RuntimeError("PackedLinear: its layer no longer exists")
        weight, bias = layer.weight, layer.bias
        n = x.numel() // self.in_features if x.ndim and x.shape[-1] == self.in_features else 0
        rows = rows_bucket(n) if n > 0 else None
        if rows is None or not _onednn_serves(x, weight, bias):
            return F.linear(x, weight, bias)  # torch's product (and torch's error for a wrong shape)
        lead = x.shape[:-1]
        flat = x.reshape(n, self.in_features)
        if rows > n:  # zero rows up to the bucket: a bounded set of shapes (their outputs are dropped)
            flat = torch.cat([flat, flat.new_zeros(rows - n, self.in_features)])
        y = torch._C._nn.mkldnn_linear(flat.contiguous().to_mkldnn(), weight, bias).to_dense()
        return y[:n].reshape(*lead, self.out_features)


def _onednn_serves(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether oneDNN's product gives this call's result: float32 CPU tensors, no autocast."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or t.layout != torch.strided for t in tensors):
        return False
    return not torch.is_autocast_enabled("cpu")


def packed_mode() -> str:
    """The setting of ``SPECJAX_PACKED_LINEARS`` as it applies here: ``all``, ``head`` or ``0``.

    ``auto`` (the default) is :func:`auto_mode`.
    """
    value = os.environ.get(ENV, "auto").strip()
    if value not in MODES:
        raise ValueError(f"{ENV}: expected one of {', '.join(MODES)}, got {value!r}")
    return auto_mode() if value == "auto" else value


def auto_mode() -> str:
    """``all`` on an AMD x86-64 CPU, where torch's dense small-row products are slow; else ``0``."""
    return "all" if cpu_vendor() == "AuthenticAMD" else "0"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...) from /proc/cpuinfo; "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _packable(layer: nn.Linear) -> bool:
    params = [layer.weight] + ([] if layer.bias is None else [layer.bias])
    return all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)


def _find_sites(model: nn.Module, mode: str) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every ``nn.Linear`` of ``model`` (``head``: the output embeddings only), wherever its weights are."""
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
            if type(child) is nn.Linear and (head is None or child is head):
                sites.append((parent, name, child))
    return sites


def _places(layers: Layers) -> tuple[Any, ...] | None:
    """The layers' identities, or None if a layer is no longer where it was."""
    for parent, name, dense, _ in layers:
        if parent is None or dense is None:
            return None
        current = parent._modules.get(name)
        # a stand-in in place is a forward of the same model running (nested, or another thread): not moved
        if current is not dense and not isinstance(current, PackedLinear):
            return None
    return tuple(id(dense) for _, _, dense, _ in layers)


def packed_layers(model: Any) -> tuple[str, Layers]:
    """What the setting runs through oneDNN in ``model``: ``(mode, [(parent, name, layer, stand-in)])``.

    Where the layers sit is found once per model and setting and checked at
    each call (a layer the user replaced is found in its turn); which of them
    are taken (float32 weights on the CPU) is read at each call. The mode is
    ``all`` or ``head``, or ``0`` with no layers where nothing applies
    (setting ``0``, no oneDNN, no float32 CPU ``nn.Linear``): the key by which
    the loop keeps its timings apart. Raises ``ValueError`` for a bad setting.
    """
    mode = packed_mode()
    if (
        mode == "0"
        or not isinstance(model, nn.Module)
        or not torch.backends.mkldnn.is_available()
        or not torch.backends.mkldnn.enabled
    ):
        return "0", []
    plans = _PLANS.setdefault(model, {})
    plan = plans.get(mode)
    layers = None
    if plan is not None:
        layers = [(parent(), name, dense(), stand_in) for parent, name, dense, stand_in in plan[1]]
        if plan[0] is None or _places(layers) != plan[0]:
            layers = None
    if layers is None:
        layers = [(parent, name, dense, PackedLinear(dense)) for parent, name, dense in _find_sites(model, mode)]
        refs = [(weakref.ref(parent), name, weakref.ref(dense), s) for parent, name, dense, s in layers]
        plans[mode] = (_places(layers), refs)
    layers = [site for site in layers if _packable(site[2])]
    return (mode if layers else "0"), layers


@contextlib.contextmanager
def model_packed(model: Any) -> Iterator[str]:
    """Run the forwards inside with ``model``'s layers through oneDNN (:func:`packed_layers`), then put
    them back.

    Yields the mode that applied (``all``, ``head`` or ``0``).
    """
    mode, layers = packed_layers(model)
    for parent, name, _, stand_in in layers:
        parent._modules[name] = stand_in
    try:
        yield mode
    finally:
        for parent, name, dense, _ in layers:
            parent._modules[name] = dense
