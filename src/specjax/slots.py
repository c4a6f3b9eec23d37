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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


class SlotCache:
    """A transformers ``Cache`` plus a validity mask and per-row valid counts.

    Attributes:
      cache: the model's KV cache (``DynamicCache``).
      mask: i64[B, S], 1 where slot s of row b holds a real token.
      num_valid: i64[B], valid slots per row (= the next position id).
      full: True while every slot of every row is valid. Forwards then pass
        neither the mask nor the positions (they are all-ones and the defaults),
        so the model takes its causal fast path, as ``generate`` does for an
        unpadded batch.
      input_vocab: when set, token ids >= it (which the model cannot embed: a
        draft whose vocabulary is the target's minus padding) are fed as id 0.
    """

    def __init__(self, model: Any, batch: int, device: torch.device, input_vocab: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:  # older signature
            self.cache = DynamicCache()
        self.mask = torch.zeros((batch, 0), dtype=torch.long, device=device)
        self.num_valid = torch.zeros((batch,), dtype=torch.long, device=device)
        self.full = True
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.input_vocab = input_vocab
        self.forwards = 0

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor,
        *,
        last_only: bool,
        all_valid: bool | None = None,
        hidden: bool = False,
    ) -> Any:
        """Append W slots and run the model on them.

        Args:
          tokens: i64[B, W], the tokens of the new slots (filler where invalid).
          valid: bool[B, W], which new slots hold real tokens.
          last_only: return logits for the last slot only.
          all_valid: whether every entry of ``valid`` is True, when the caller
            knows it on the host; None reads it from ``valid`` (on a GPU, one
            device→host sync).
          hidden: also return the model's final hidden states (the last entry of
            ``output_hidden_states``, f[B, W, d]) from the same forward.

        Returns:
          f32[B, W, V] logits (or f32[B, 1, V] with ``last_only``), as the model
          produced them (a fresh tensor each call); with ``hidden``, the pair
          ``(logits, hidden_states)``.
        """
        if self.input_vocab is not None:
            tokens = torch.where(tokens < self.input_vocab, tokens, torch.zeros_like(tokens))
        v = valid.long()
        positions = self.num_valid[:, None] + torch.cumsum(v, dim=1) - v
        self.mask = torch.cat([self.mask, v], dim=1)
        self.num_valid = self.num_valid + v.sum(dim=1)
        self.full = self.full and (bool(valid.all()) if all_valid is None else all_valid)
        kwargs: dict[str, Any] = {
            "input_ids": tokens,
            self._cache_kw: self.cache,
            "use_cache": True,
        }
        if not self.full:
            kwargs["attention_mask"] = self.mask
            kwargs["position_ids"] = positions
        if last_only and self._keep_kw:
            kwargs[self._keep_kw] = 1
        if hidden:
            kwargs["output_hidden_states"] = True
        with torch.inference_mode():
            out = self.model(**kwargs)
        self.forwards += 1
        logits = out.logits[:, -1:] if last_only else out.logits
        return (logits, out.hidden_states[-1]) if hidden else logits

    def invalidate(self, start: int, keep: torch.Tensor) -> None:
        """Mark slots ``start + j`` invalid for every ``j >= keep[b]`` in row b, then crop.

        Args:
          start: first slot of the span written by the last step.
          keep: i64[B], how many slots of that span stay valid per row.
        """
        span = self.length - start
        if span <= 0:
            return
        j = torch.arange(span, device=self.mask.device)[None, :]
        drop = (j >= keep[:, None]) & (self.mask[:, start:] == 1)
        self.num_valid = self.num_valid - drop.sum(dim=1)
        self.mask[:, start:] = torch.where(drop, torch.zeros_like(self.mask[:, start:]), self.mask[:, start:])
        self.crop_trailing()
        self.full = bool(self.mask.all())

    def crop_trailing(self) -> None:
        """Remove slots at the end of the cache that are invalid in every row."""
        any_valid = self.mask.any(dim=0)
        nonzero = torch.nonzero(any_valid)
        new_len = int(nonzero[-1]) + 1 if nonzero.numel() else 0
        remove = self.length - new_len
        if remove > 0:
            crop_cache(self.cache, remove)
            self.mask = self.mask[:, :new_len]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (i64[B']) of the batch."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        self.num_valid = self.num_valid[rows]
        self.crop_leading()
        self.full = bool(self.mask.all())

    def crop_leading(self) -> None:
        """Drop leading slots that are invalid in every row (e.g. after rows left)."""
        any_valid = self.mask.any(dim=0)
        nonzero = torch.nonzero(any_valid)
        first = int(nonzero[0]) if nonzero.numel() else self.length
        if first == 0:
            return
        for layer in getattr(self.cache, "layers", []):
            keys = getattr(layer, "keys", None)
            if keys is None or not torch.is_tensor(keys) or keys.numel() == 0:
                return  # unknown layer layout: keep the slots (still exact, only slower)
            seen = getattr(layer, "cumulative_length", None)
            if seen is not None and seen != keys.shape[-2]:
                return  # a sliding-window layer that dropped slots itself: keep ours
        for layer in getattr(self.cache, "layers", []):  # checked above: tensors in every layer
            layer.keys = layer.keys[:, :, first:].contiguous()
            layer.values = layer.values[:, :, first:].contiguous()
            if getattr(layer, "cumulative_length", None) is not None:
                # DynamicSlidingWindowLayer reports this as its length (the mask sizes
                # and cache positions follow it): it must drop the slots too.
                layer.cumulative_length = layer.keys.shape[-2]
        self.mask = self.mask[:, first:]


def crop_cache(cache: Any, remove: int) -> None:
    """Remove the last ``remove`` slots, across transformers' two ``crop`` conventions."""
    params = inspect.signature(cache.crop).parameters
    if "tokens_to_remove" in params:
        cache.crop(-remove)
    else:
        cache.crop(cache.get_seq_length() - remove)
