"""Per-model KV-cache bookkeeping for ragged batches: slots, validity masks, positions.

Every forward pass appends the same number of *slots* to every row of a model's
KV cache (transformers caches are rectangular). A slot holds either a real
token of that row or filler. Rejected draft tokens stay in the cache but their
slots are marked invalid, so attention never sees them; each row's position
ids count only its valid slots. This keeps every row exact when rows accept
different numbers of draft tokens in the same step (the design that
transformers' assisted generation, limited to batch size 1, does without).

Slots that are invalid for *every* row at the end of the cache are cropped
(at B=1 that is exactly the usual rollback), and rows that finished are
dropped from the cache when few enough remain.

Sliding-window attention (Mistral, Gemma-3's local layers) is exact too:
transformers draws the window over *slots* (a query at slot s sees slots
s - W + 1 .. s), which equals the window over positions only while a row's
recent tokens sit in consecutive slots. Every layer therefore keeps its whole
history (a plain ``DynamicLayer``: a sliding-window layer's own eviction could
not skip invalid slots), and before a forward whose window could reach an
invalid slot each row's last W - 1 valid slots are moved, in order, to the end
of the cache (:meth:`SlotCache.forward`): the window then holds exactly the
row's last W - 1 tokens, as in ``generate``. A model whose layers all slide
also drops the slots no row can see any more, so its cache stays near 2W slots.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from specjax.packed import model_packed


def attention_layout(model: Any) -> tuple[list[str], int | None]:
    """The model's layer types as transformers' caches see them, and its largest sliding window.

    Returns:
      ``(layer_types, window)``: one type per layer (``"full_attention"``,
      ``"sliding_attention"``, ...; from ``config.layer_types``, else inferred
      from ``sliding_window`` as transformers does) and the largest window of a
      sliding-attention layer in tokens (None when no layer slides).
    """
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(text)
        windows = [kw.get("sliding_window") for t, kw in zip(types, kwargs, strict=False) if t == "sliding_attention"]
    except (ImportError, AttributeError, TypeError):  # a config transformers' helper cannot read
        window = getattr(text, "sliding_window", None)
        if getattr(text, "use_sliding_window", True) is False:
            window = None
        layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        types = list(
            getattr(text, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * layers
        )
        windows = [window] * types.count("sliding_attention")
    sizes = [int(w) for w in windows if isinstance(w, int) and not isinstance(w, bool) and w > 0]
    return list(types), max(sizes) if sizes else None


class SlotCache:
    """A transformers ``Cache`` plus a validity mask and per-row valid counts.

    The mask and counts live in host memory (NumPy): updating them costs
    microseconds and never synchronises with the device; they cross to the
    device only for a forward that needs them (when some slot is invalid).

    Attributes:
      cache: the model's KV cache (``DynamicCache``).
      mask: i64[B, S] (torch, on the cache's device; a fresh copy), 1 where
        slot s of row b holds a real token.
      num_valid: i64[B] (torch, likewise), the tokens each row holds (= the next
        position id), counting those whose slots a sliding window let go.
      full: True while every slot of every row is valid. Forwards then pass
        neither the mask nor the positions (they are all-ones and the defaults),
        so the model takes its causal fast path, as ``generate`` does for an
        unpadded batch; once a sliding window let slots go, they pass both.
      input_vocab: when set, token ids >= it (which the model cannot embed: a
        draft whose vocabulary is the target's minus padding) are fed as id 0.
      window: the model's largest sliding window in tokens (None: no layer slides).
    """

    def __init__(self, model: Any, batch: int, device: torch.device, input_vocab: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:  # older signature
            self.cache = DynamicCache()
        types, self.window = attention_layout(model)
        if self.window is not None:
            _keep_full_history(self.cache)
        # every layer slides: slots out of every row's window can be dropped
        self._all_sliding = self.window is not None and all(t in ("sliding_attention", "dummy") for t in types)
        self._dropped_valid = False  # valid slots were dropped: position ids no longer equal slot counts
        self.device = device
        self._mask = np.zeros((batch, 0), bool)  # bool[B, S], host
        self._num_valid = np.zeros((batch,), np.int64)  # i64[B], host
        self.full = True
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_argument(model)
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.input_vocab = input_vocab
        self.forwards = 0

    @property
    def length(self) -> int:
        return self._mask.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        return torch.as_tensor(self._mask.astype(np.int64), device=self.device)

    @property
    def num_valid(self) -> torch.Tensor:
        return torch.as_tensor(self._num_valid.copy(), device=self.device)

    def forward(
        self,
        tokens: torch.Tensor,
        valid: Any,
        *,
        last_only: bool = False,
        keep_last: int | None = None,
        all_valid: bool | None = None,
        hidden: tuple[int, ...] | None = None,
    ) -> Any:
        """Append W slots and run the model on them.

        Args:
          tokens: i64[B, W], the tokens of the new slots (filler where invalid).
          valid: bool[B, W], which new slots hold real tokens: a NumPy array,
            or a torch tensor (read on the host: on a GPU, one device→host sync).
          last_only: return logits for the last slot only (``keep_last=1``).
          keep_last: return logits for the last ``keep_last`` slots only; None:
            every slot (unless ``last_only``).
          all_valid: whether every entry of ``valid`` is True, when the caller
            knows it (else read from ``valid``).
          hidden: also return these of the model's hidden states from the same
            forward (indices into ``output_hidden_states``; -1: the final normed
            state), concatenated on the last axis in that order: f[B, W, k·d].

        Returns:
          f32[B, K, V] logits of the last K slots (K = ``keep_last``, 1 with
          ``last_only``, else W), as the model produced them (a fresh tensor each
          call); with ``hidden``, the pair ``(logits, hidden_states)``, the
          latter f[B, W, k·d] (every new slot, whatever ``keep_last``).
        """
        keep = 1 if last_only else keep_last
        if self.input_vocab is not None:
            tokens = torch.where(tokens < self.input_vocab, tokens, torch.zeros_like(tokens))
        v = to_host(valid).astype(bool)
        if self.window is not None:
            self._fit_window(v)
        self._mask = np.concatenate([self._mask, v], axis=1)
        self.full = self.full and (bool(v.all()) if all_valid is None else all_valid)
        kwargs: dict[str, Any] = {
            "input_ids": tokens,
            self._cache_kw: self.cache,
            "use_cache": True,
        }
        if not self.full or self._dropped_valid:
            vi = v.astype(np.int64)
            positions = self._num_valid[:, None] + np.cumsum(vi, axis=1) - vi
            kwargs["attention_mask"] = self.mask
            kwargs["position_ids"] = torch.as_tensor(positions, device=self.device)
        self._num_valid = self._num_valid + v.sum(axis=1)
        if keep is not None and self._keep_kw:
            kwargs[self._keep_kw] = keep
        if hidden is not None:
            kwargs["output_hidden_states"] = True
        with torch.inference_mode(), model_packed(self.model):
            out = self.model(**kwargs)
        self.forwards += 1
        logits = out.logits if keep is None else out.logits[:, -keep:]
        if hidden is None:
            return logits
        states = [out.hidden_states[i] for i in hidden]
        return logits, states[0] if len(states) == 1 else torch.cat(states, dim=-1)

    def invalidate(self, start: int, keep: Any) -> None:
        """Mark slots ``start + j`` invalid for every ``j >= keep[b]`` in row b, then crop.

        Cropping removes the trailing slots no row holds and, when every layer
        slides, the leading ones no row's window can reach again: slot indices
        (``start``, :attr:`length`) count from the new first slot afterwards.

        Args:
          start: first slot of the span written by the last step.
          keep: i64[B] (NumPy, or a torch tensor read on the host), how many
            slots of that span stay valid per row.
        """
        span = self.length - start
        if span <= 0:
            return
        keep_h = to_host(keep).astype(np.int64)
        tail = self._mask[:, start:]
        drop = (np.arange(span)[None, :] >= keep_h[:, None]) & tail
        self._num_valid = self._num_valid - drop.sum(axis=1)
        self._mask[:, start:] = tail & ~drop
        self.crop_trailing()
        if self._all_sliding:
            self._drop_unreachable(int(self.window or 0))
        self.full = bool(self._mask.all())

    def crop_trailing(self) -> None:
        """Remove slots at the end of the cache that are invalid in every row."""
        nonzero = np.flatnonzero(self._mask.any(axis=0))
        new_len = int(nonzero[-1]) + 1 if nonzero.size else 0
        remove = self.length - new_len
        if remove > 0:
            crop_cache(self.cache, remove)
            self._mask = self._mask[:, :new_len]

    def select_rows(self, rows: Any) -> None:
        """Keep only ``rows`` (i64[B'], NumPy or torch) of the batch."""
        rows_h = to_host(rows).astype(np.int64)
        self.cache.batch_select_indices(torch.as_tensor(rows_h, device=self.device))
        self._mask = self._mask[rows_h]
        self._num_valid = self._num_valid[rows_h]
        self.crop_leading()
        self.full = bool(self._mask.all())

    def crop_leading(self) -> None:
        """Drop leading slots that are invalid in every row (e.g. after rows left)."""
        nonzero = np.flatnonzero(self._mask.any(axis=0))
        first = int(nonzero[0]) if nonzero.size else self.length
        if first:
            self._drop_leading(first)

    def _fit_window(self, new_valid: np.ndarray) -> None:
        """Before a forward of W' new slots: make the slot window the position window for every querying row.

        A row's first new token needs its last ``W - 1`` valid slots; they must be
        the cache's last ``W - 1`` slots. Rows where they are not get the valid
        slots of the cache's tail ``[s0, S)`` moved, in order, to its end (one
        gather per layer over ``S - s0`` slots, about W; invalid slots move to the
        left of the tail, where no window reaches past them). Slot indices do not
        change (callers hold them across a step's forwards).

        Args:
          new_valid: bool[B, W'], the validity of the forward's new slots.
        """
        window, length = int(self.window or 0), self.length
        if length + new_valid.shape[1] <= window:  # no query can be more than W - 1 slots past a key
            return
        need = np.minimum(window - 1, self._num_valid)  # i64[B]: the cached tokens each row's window holds
        need = np.where(new_valid.any(axis=1), need, 0)
        tail = self._mask[:, max(length - (window - 1), 0) :]
        recent = np.arange(tail.shape[1])[None, :] >= tail.shape[1] - need[:, None]
        misplaced = np.flatnonzero(~(tail | ~recent).all(axis=1))
        if misplaced.size:
            s0 = min(int(np.flatnonzero(self._mask[b])[-need[b]]) for b in misplaced)
            order = np.argsort(self._mask[:, s0:], axis=1, kind="stable")  # i64[B, S - s0]: invalid first, in order
            index = torch.as_tensor(order, device=self.device)[:, None, :, None]
            layers = _tensor_layers(self.cache)
            assert layers is not None, "a sliding-window cache of plain layers (checks.check_cache_layout)"
            with torch.inference_mode():
                for layer in layers:
                    for name in ("keys", "values"):
                        part = getattr(layer, name)[:, :, s0:]
                        getattr(layer, name)[:, :, s0:] = torch.take_along_dim(part, index, dim=2)
            self._mask[:, s0:] = np.take_along_axis(self._mask[:, s0:], order, axis=1)

    def _drop_unreachable(self, window: int) -> None:
        """Drop the leading slots before every row's last ``W - 1`` valid slots, once they number W or more.

        Any later query of a row is at least W positions past them (the slots it
        attends to only move forward); dropping in batches of at least W slots
        copies the cache about once every W tokens.
        """
        keep_from = self.length
        for b in range(self._mask.shape[0]):
            valid = np.flatnonzero(self._mask[b])
            n = min(window - 1, valid.size)  # the row's slots some later query of it can see
            if n:
                keep_from = min(keep_from, int(valid[valid.size - n]))
        if keep_from >= window and self._drop_leading(keep_from):
            self._dropped_valid = True

    def _drop_leading(self, first: int) -> bool:
        """Remove the first ``first`` slots of every row; False (nothing removed) for a layer layout it cannot cut."""
        layers = _tensor_layers(self.cache)
        if layers is None:
            return False  # unknown layer layout: keep the slots (still exact, only slower)
        for layer in layers:
            layer.keys = layer.keys[:, :, first:].contiguous()
            layer.values = layer.values[:, :, first:].contiguous()
        self._mask = self._mask[:, first:]
        return True


def _tensor_layers(cache: Any) -> list[Any] | None:
    """The cache's layers that hold key/value tensors (each ``[B, H, S, D]``); None when some layer holds
    something else (a recurrent state, a sliding-window layer that evicts on its own, quantized blocks)."""
    from transformers.cache_utils import DynamicLayer

    layers = []
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        if keys is None and not getattr(layer, "is_initialized", False):
            continue  # holds nothing (a KV-sharing consumer, or a layer not run yet)
        if type(layer) is not DynamicLayer or not torch.is_tensor(keys) or keys.numel() == 0:
            return None
        layers.append(layer)
    return layers


def _keep_full_history(cache: Any) -> None:
    """Replace transformers' sliding-window layers (which keep only the last W - 1 slots, evicting invalid and
    valid ones alike) by plain layers that keep every slot; :meth:`SlotCache._fit_window` keeps the window exact."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()


def cache_argument(model: Any) -> str:
    """The name of ``model.forward``'s KV-cache argument: ``cache`` in newer transformers, else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def to_host(x: Any) -> np.ndarray:
    """A NumPy array of ``x`` (a torch tensor is read on the host; on a GPU, a device→host copy)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def crop_cache(cache: Any, remove: int) -> None:
    """Remove the last ``remove`` slots, across transformers' two ``crop`` conventions."""
    kind = type(cache)
    takes_count = _CROP_TAKES_COUNT.get(kind)
    if takes_count is None:  # read once per cache class: inspect is slow
        takes_count = _CROP_TAKES_COUNT[kind] = "tokens_to_remove" in inspect.signature(cache.crop).parameters
    if takes_count:
        cache.crop(-remove)
    else:
        cache.crop(cache.get_seq_length() - remove)


_CROP_TAKES_COUNT: dict[type, bool] = {}
