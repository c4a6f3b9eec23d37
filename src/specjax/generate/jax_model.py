"""A Hugging Face causal LM as a pure JAX function through torchax: weights, a static KV cache, a forward.

torchax (docs/torchax.md) runs the model's own PyTorch code on JAX arrays: each
weight is a ``torchax`` tensor view of a ``jax.Array``, and every torch
operation becomes a JAX operation. :meth:`JaxModel.forward` is that code as a
*pure* function of ``(weights, cache, tokens, start)``: traced once under a
``jax.jit`` of the caller's (the loop's step, which also runs the acceptance
step in the same program), it is one XLA program per shape, on whatever JAX
device holds the arrays (a TPU; JAX's CPU backend in the tests). No
``torchax.compile`` and no torch eager call is involved (on a TPU, torchax's
compiled path gave wrong logits: issue 55); this is the way tpu-inference runs
PyTorch models, ``torch.func.functional_call`` inside a jit of one's own.

The KV cache: per-row positions, one static shape
--------------------------------------------------------------------------------
``cache`` is one ``(keys, values)`` pair per layer, each ``f[B, H_kv, S, D]``.
Slot ``p + 1`` of row b holds the keys and values of the token at position
``p`` of that row (slot 0 is a scratch slot no query sees). A forward writes
its W tokens at positions ``start[b] .. start[b] + W - 1``, and query j of row
b sees exactly the slots ``1 .. start[b] + j + 1`` (and its own): a causal mask
per row, passed to the model as a 4D additive mask, with each row's own
position ids. So a row's positions never skip: the draft tokens it rejected are
simply overwritten by its next forward (which starts right after its last
committed token), rows that accept different counts need no validity mask, and
nothing ever moves in the cache. Slots past a row's current position hold
stale or filler values; no query sees them. The cache's shape is fixed for a
call (prompt + new tokens + a step's width), so every step runs the same
compiled program.

Models: full causal attention over one KV cache per layer (Llama, Qwen2,
Mistral without a window, SmolLM2, ...). Sliding-window and other layer kinds
are refused (:func:`check_supported`): the mask here is the full causal one.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from specjax.adapters.jax_view import torchax_array
from specjax.generate.module_tensors import named_tensors
from specjax.slots import attention_layout, cache_argument

__all__ = ["JaxModel", "KVCache", "cache_dtype", "check_supported", "is_jax_model", "jax_model", "to_jax_device"]

#: One ``(keys, values)`` pair per layer, each f[B, H_kv, S, D].
KVCache = tuple[tuple[jax.Array, jax.Array], ...]


def is_jax_model(model: Any) -> bool:
    """Whether ``model``'s weights live on JAX's devices (a model moved to torchax's ``jax`` device)."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type == "jax"


def to_jax_device(model: Any) -> Any:
    """``model`` moved to torchax's ``jax`` device (JAX's default device), in place; returns it.

    What selects the JAX path (:func:`is_jax_model`); needs torchax (``pip install 'specjax[tpu]'``).
    """
    import torchax

    with torchax.default_env():
        return model.to("jax")


def check_supported(name: str, model: Any) -> None:
    """Raise ``ValueError`` unless every layer of ``model`` is full causal attention (what the mask here is)."""
    types, window = attention_layout(model)
    other = sorted({t for t in types if t != "full_attention"})
    if window is not None or other:
        raise ValueError(
            f"{name}: the JAX path (torchax) runs models with full causal attention in every layer, got "
            f"layer types {other or ['sliding_attention']}; run this model on the CPU path (a torch model on "
            "cpu or cuda)"
        )


@dataclass(eq=False)  # hashed by identity: the jitted steps take it as a static argument
class JaxModel:
    """A transformers causal LM, its code run by torchax on JAX arrays.

    Attributes:
      module: the torch module (its code and config; its own weights are not read by :meth:`forward`).
      weights: name → ``jax.Array``, every parameter and buffer (tied weights once).
      num_layers, kv_heads, head_dim: the KV cache's layout.
      dtype: the weights' floating dtype (the cache's, but for :func:`cache_dtype`'s one exception).
      input_vocab: ids >= this (which the model cannot embed) are fed as id 0.
    """

    module: Any
    weights: dict[str, jax.Array]
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: Any
    input_vocab: int
    _layer_class: Any = field(default=None, repr=False)

    def init_cache(self, batch: int, positions: int) -> KVCache:
        """A zero cache for ``batch`` rows of ``positions`` positions (``positions + 1`` slots), on the
        weights' device, in :func:`cache_dtype` (read when called: the matmul precision in force then)."""
        shape = (batch, self.kv_heads, positions + 1, self.head_dim)
        device = next(iter(next(iter(self.weights.values())).devices()))
        arrays = zeros(2 * self.num_layers, shape, cache_dtype_on(self.dtype, device), device)
        return tuple((arrays[2 * i], arrays[2 * i + 1]) for i in range(self.num_layers))

    def forward(
        self, weights: dict[str, jax.Array], cache: KVCache, tokens: jax.Array, start: jax.Array, keep: int | None
    ) -> tuple[jax.Array, KVCache]:
        """The model on ``tokens`` at each row's positions ``start[b] ..``: pure, for use under ``jax.jit``.

        Args:
          weights: :attr:`weights` (passed in, so that the jitted caller does not bake them in).
          cache: :data:`KVCache` of B rows and S slots.
          tokens: i32[B, W].
          start: i32[B], the position of each row's first token (>= -1; -1 writes the scratch slot).
          keep: logits of the last ``keep`` positions only; None: all W.

        Returns:
          ``(logits f[B, K, V], cache)`` with K = ``keep`` or W, the cache holding the W new tokens.
        """
        logits, cache, _ = self._run(weights, cache, tokens, start, keep, None)
        return logits, cache

    def forward_hidden(
        self,
        weights: dict[str, jax.Array],
        cache: KVCache,
        tokens: jax.Array,
        start: jax.Array,
        keep: int | None,
        layers: tuple[int, ...],
    ) -> tuple[jax.Array, KVCache, jax.Array]:
        """:meth:`forward`, and the hidden states a drafter reads from the same forward (an EAGLE head).

        Args:
          layers: indices into the model's ``output_hidden_states`` (``num_hidden_layers + 1`` entries;
            -1: the final normed state), as the CPU path's ``SlotCache.forward(hidden=...)`` takes them.

        Returns:
          ``(logits f[B, K, V], cache, hidden f[B, W, len(layers)·d])``: the states of every one of the
          W tokens (whatever ``keep``), concatenated on the last axis in the order of ``layers``.
        """
        logits, cache, hidden = self._run(weights, cache, tokens, start, keep, layers)
        assert hidden is not None
        return logits, cache, hidden

    def _run(
        self,
        weights: dict[str, jax.Array],
        cache: KVCache,
        tokens: jax.Array,
        start: jax.Array,
        keep: int | None,
        layers: tuple[int, ...] | None,
    ) -> tuple[jax.Array, KVCache, jax.Array | None]:
        import torchax
        from torchax.interop import jax_view, torch_view
        from transformers.cache_utils import Cache

        w = tokens.shape[1]
        slots_total = cache[0][0].shape[2]
        slots = start[:, None].astype(jnp.int32) + 1 + jnp.arange(w, dtype=jnp.int32)[None, :]  # i32[B, W]
        s = jnp.arange(slots_total, dtype=jnp.int32)[None, None, :]
        q = slots[:, :, None]
        visible = ((s >= 1) & (s <= q)) | (s == q)  # bool[B, W, S]; a query always sees itself (no empty row)
        mask = jnp.where(visible, 0.0, jnp.finfo(self.dtype).min).astype(self.dtype)[:, None]
        ids = jnp.where(tokens < self.input_vocab, tokens, 0).astype(jnp.int32)
        kwargs: dict[str, Any] = {"use_cache": True}
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        if layers is not None:
            kwargs["output_hidden_states"] = True
        # functional_call swaps the module's parameters in and out: two threads tracing the same module
        # at once would see each other's tracers. One trace at a time (tracing is Python work under the
        # GIL anyway; the programs' compilations, after their traces, still overlap).
        with _TRACE_LOCK, torchax.default_env(), _grouped_attention(self.module):
            slot_t = torch_view(slots)
            cache_layers = [self._layer_class(torch_view(k), torch_view(v), slot_t) for k, v in cache]
            out = torch.func.functional_call(
                self.module,
                torch_view(weights),
                args=(),
                kwargs={
                    "input_ids": torch_view(ids),
                    "position_ids": torch_view(slots - 1),
                    "attention_mask": torch_view(mask),
                    cache_argument(self.module): Cache(layers=cache_layers),
                    **kwargs,
                },
            )
            logits = jax_view(out.logits)
            new_cache = tuple((jax_view(layer.keys), jax_view(layer.values)) for layer in cache_layers)
            hidden = None if layers is None else jnp.concatenate([jax_view(out.hidden_states[i]) for i in layers], -1)
        return logits, new_cache, hidden


_GROUPED = "specjax_grouped"  # the attention function :func:`_grouped_attention` installs while tracing
_STANDARD = ("sdpa", "eager")  # the implementations it stands in for (same arithmetic, no key/value copy)


def grouped_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Softmax attention of H query heads over H_kv key/value heads without repeating the keys and values.

    transformers' ``sdpa`` and ``eager`` attention repeat each key/value head H / H_kv times (``repeat_kv``)
    whenever more than one query comes at once: under JAX that is a copy of the whole cache, per layer and
    per forward, which a loop's G + 1-wide verification (and a draft model's 2-wide catch-up) pays at every
    step while one-token decoding does not (transformers packs a single query instead). Here the queries of
    each group go to their shared head as rows: q (B, H, T, D) read as (B, H_kv, r·T, D) with r = H / H_kv
    (head h = g·r + j is group g), the additive mask (B, 1, T, S) tiled r times along its rows; one
    attention over the cache as it lies, then the output back to (B, T, H, D), as transformers'
    implementations return it. Anything else (a per-head mask, soft-capping, sinks, a window) goes to
    transformers' ``sdpa``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, t, d = query.shape
    kv = key.shape[1]
    extras = any(
        kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias", "sliding_window")
    )
    if attention_mask is None or attention_mask.ndim != 4 or attention_mask.shape[1] != 1 or h % kv or extras:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    r = h // kv
    q = query.reshape(b, kv, r * t, d)
    mask = attention_mask.repeat(1, 1, r, 1) if r > 1 else attention_mask
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(b, h, t, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _grouped_attention(module: Any) -> Iterator[None]:
    """While tracing: every config of ``module`` that names ``sdpa`` or ``eager`` names
    :func:`grouped_attention` instead (registered with transformers' ``AttentionInterface``); restored after.
    Other implementations (flash, flex, a user's own) are left as they are."""
    from transformers import AttentionInterface

    AttentionInterface.register(_GROUPED, grouped_attention)
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    changed = [c for c in configs.values() if getattr(c, "_attn_implementation_internal", None) in _STANDARD]
    before = [c._attn_implementation_internal for c in changed]
    try:
        for c in changed:
            c._attn_implementation_internal = _GROUPED
        yield
    finally:
        for c, name in zip(changed, before, strict=True):
            c._attn_implementation_internal = name


#: JAX's matmul precisions under which a TPU multiplies float32 operands as bfloat16 (one pass).
_BFLOAT16_PASS = (None, "default", "bfloat16", "fastest")


def cache_dtype(weights_dtype: Any, platform: str, precision: str | None) -> np.dtype:
    """The dtype a KV cache is kept in: bfloat16 for float32 weights on a TPU whose matrix products run at
    one bfloat16 pass (``precision``: ``jax.config.jax_default_matmul_precision``, None or ``"default"``
    there), the weights' dtype otherwise.

    Every read of the cache is an attention product, which on a TPU at that precision takes its float32
    operands as bfloat16: keys and values kept so are the same arithmetic at half the bytes. XLA does this
    itself to a cache that lives and dies inside one program (the target alone's decoding: its 30 write
    passes took 22 µs each at B = 32 against 42 µs for the loop's float32 cache, which outlives a chunk's
    program; benchmarks/results/tpu-loop/run-64265a3.log). At ``highest``, on other platforms, and for
    weights already 16-bit, the cache keeps the weights' dtype.
    """
    dtype = np.dtype(weights_dtype)
    if dtype == np.float32 and platform == "tpu" and precision in _BFLOAT16_PASS:
        return np.dtype(jnp.bfloat16)
    return dtype


def cache_dtype_on(weights_dtype: Any, device: Any) -> np.dtype:
    """:func:`cache_dtype` on ``device`` at the matmul precision in force in this thread now."""
    precision = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # the thread's own
    return cache_dtype(weights_dtype, device.platform, precision)


#: Widest write done as selects over the cache (a step's G + 1 tokens, the draft's catch-up of 17); wider ones
#: (a prompt) as one slice update per row.
_SELECT_WIDTH = 32


def write_slots(cache: jax.Array, new: jax.Array, first: jax.Array) -> jax.Array:
    """``cache`` (f[B, H, S, D]) with each row's ``new`` (f[B, H, W, D]) at slots ``first[b] .. first[b] + W - 1``
    (i32[B], in range).

    Up to :data:`_SELECT_WIDTH` tokens: W selects against the slot index, fused into one pass over the cache.
    XLA lowers a per-row slice update (``vmap`` of ``dynamic_update_slice``, a scatter) to a loop over the
    rows on a TPU, each trip a few microseconds: at B = 32 the 60 such loops of the default target (a key and
    a value array a layer) took 6 of its 6.75 ms a token (benchmarks/results/tpu-loop/profile-399f863.log),
    where one pass over a B = 32 cache of 129 slots is about 8 µs. Wider writes (a prompt, once a call) keep
    the slice update.
    """
    new = new.astype(cache.dtype)
    w = new.shape[2]
    if w > _SELECT_WIDTH:
        row = lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (0, s, 0))  # noqa: E731
        return jax.vmap(row)(cache, new, first)
    slot = jnp.arange(cache.shape[2], dtype=jnp.int32)[None, None, :, None] - first[:, None, None, None]
    out = cache
    for j in range(w):
        out = jnp.where(slot == j, new[:, :, j : j + 1], out)
    return out


def _row_layer_class() -> Any:
    """A transformers cache layer that writes each row's new keys/values at its own slots (:func:`write_slots`)."""
    from transformers.cache_utils import CacheLayerMixin

    class RowSlotLayer(CacheLayerMixin):
        is_compileable = False
        is_sliding = False

        def __init__(self, keys: Any, values: Any, slots: Any) -> None:
            super().__init__()
            self.keys, self.values, self.slots = keys, values, slots  # slots: i32[B, W]
            self.is_initialized = True

        def lazy_initialization(self, key_states: Any, value_states: Any) -> None:
            pass

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            from torchax.interop import jax_view, torch_view

            first = jax_view(self.slots)[:, 0]  # a row's W slots are consecutive: first[b] ..

            def put(cache: Any, new: Any) -> Any:
                return torch_view(write_slots(jax_view(cache), jax_view(new), first))

            def read(cache: Any, like: Any) -> Any:  # a narrower cache (cache_dtype) read in the model's dtype
                return cache if cache.dtype == like.dtype else torch_view(jax_view(cache).astype(jax_view(like).dtype))

            self.keys, self.values = put(self.keys, key_states), put(self.values, value_states)
            return read(self.keys, key_states), read(self.values, value_states)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return int(self.keys.shape[2]), 0

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return int(self.keys.shape[2])

    return RowSlotLayer


def _as_device_array(t: torch.Tensor) -> jax.Array:
    """A weight as a ``jax.Array`` on JAX's default device: a torchax tensor's own array (no copy); a CPU
    tensor crosses by DLPack (zero-copy) and is placed once (on a CPU backend, where it already is)."""
    from specjax.adapters.dlpack import to_jax

    a = to_jax(t.detach(), check_range=False)
    device = jax.devices()[0]
    return a if a.devices() == {device} else jax.device_put(a, device)


def zeros(n: int, shape: tuple[int, ...], dtype: Any, device: Any) -> tuple[jax.Array, ...]:
    """``n`` zero arrays of ``shape`` and ``dtype`` on ``device``, made by one jitted program (one dispatch:
    a cache of a 30-layer model is 60 arrays, and each array made eagerly is a dispatch of its own, which on
    a TPU host costs more than the array)."""
    return _zeros_program(n, tuple(shape), np.dtype(dtype), device)()


@functools.lru_cache(maxsize=64)
def _zeros_program(n: int, shape: tuple[int, ...], dtype: np.dtype, device: Any) -> Any:
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n)), out_shardings=sharding)


_TRACE_LOCK = threading.RLock()  # held while a module runs under functional_call (:meth:`JaxModel._run`)

_MODELS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], JaxModel]] = weakref.WeakKeyDictionary()


def _fingerprint(named: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """What identifies the weights' current values: each tensor, its version and (torchax) its array."""
    return tuple((k, id(v), v._version, id(torchax_array(v))) for k, v in named.items())


def jax_model(name: str, model: Any) -> JaxModel:
    """``model`` (a transformers causal LM on ``cpu`` or torchax's ``jax`` device) as a :class:`JaxModel`.

    The same object for the same module while its weights are the same tensors (so the jitted steps,
    which take it as a static argument, compile once per model, not once per call).

    Raises:
      ValueError: a model whose layers are not all full attention (:func:`check_supported`).
    """
    with _TRACE_LOCK:  # one JaxModel per module, also when threads ask for it at once
        return _jax_model(name, model)


def _jax_model(name: str, model: Any) -> JaxModel:
    check_supported(name, model)
    named = named_tensors(model)  # tied weights appear once
    fingerprint = _fingerprint(named)
    known = _MODELS.get(model)
    if known is not None and known[0] == fingerprint:
        return known[1]
    weights = {k: _as_device_array(v) for k, v in named.items()}
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    floats = [a.dtype for a in weights.values() if jnp.issubdtype(a.dtype, jnp.floating)]
    emb = model.get_input_embeddings()
    made = JaxModel(
        module=model,
        weights=weights,
        num_layers=int(text.num_hidden_layers),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        dtype=np.dtype(floats[0]) if floats else np.dtype(np.float32),
        input_vocab=int(emb.weight.shape[0]),
        _layer_class=_row_layer_class(),
    )
    _MODELS[model] = (fingerprint, made)
    return made
