"""The EAGLE head (:mod:`specjax.drafters.eagle_head`) as a pure JAX function, for the JAX path's loop.

The head is small and its code is specjax's own, so it is written here in
``jax.numpy`` over its weights (the same arithmetic as
:meth:`~specjax.drafters.eagle_head.EagleHead.forward`; tested against it),
with a static-shape feature cache laid out as the models' caches are
(:mod:`specjax.generate.jax_model`): row b's pair ``p`` (its p-th committed
pair ``(z_t, E x_{t+1})``) lives in slot ``p + 1`` (slot 0: scratch), its RoPE
position is ``p`` (the CPU head's count of valid pairs before it), and a query
at slot ``q`` sees its row's slots ``1 .. q``. A forward writes its W pairs at
each row's own slots; pairs a row did not commit (drafted ones, or a
verification's rejected tail) are overwritten by its next forward.

The tokens the head scores are fixed for a call (a static shape): the head's N,
then up to ``context_tokens`` ids of the prompts (the CPU drafter also adds the
ids committed later, which would change the shape every step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.eagle_head import EagleConfig

__all__ = ["HeadCache", "JaxHead", "jax_head", "scored_ids"]

#: One ``(keys, values)`` pair per decoder layer, each f[B, H_kv, S, hd].
HeadCache = tuple[tuple[jax.Array, jax.Array], ...]


def _rms(x: jax.Array, eps: float) -> jax.Array:
    """RMS normalisation over the last axis in float32, back to ``x``'s dtype (the head's ``_RMSNorm``
    without its weight)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


@dataclass(eq=False)  # hashed by identity: a static argument of the jitted steps
class JaxHead:
    """An :class:`~specjax.drafters.eagle_head.EagleHead` as JAX arrays, with the target's embedding and LM head.

    Attributes:
      config: the head's :class:`EagleConfig`.
      weights: the head's state dict as ``jax.Array`` s, plus ``"embed"`` (the target's input embedding,
        f[V_in, d]) and ``"lm"`` (its LM head, f[V, d]).
      vocab: V, the target's vocabulary size (the width of :meth:`logits`).

    The methods take the weights as an argument ``w`` (so that a jitted caller does not bake them in):
    :attr:`weights` and, for :meth:`logits`, the call's scored tokens (:meth:`with_scored`).
    """

    config: EagleConfig
    weights: dict[str, jax.Array]
    vocab: int

    def with_scored(self, ids: np.ndarray) -> dict[str, jax.Array]:
        """:attr:`weights` with ``"scored_ids"`` (i32[M], :func:`scored_ids`) and ``"scored"`` (their rows
        of the LM head, f[M, d]: gathered once per call, not at every draft token)."""
        ids_j = jax.device_put(np.asarray(ids, np.int32))
        return {**self.weights, "scored_ids": ids_j, "scored": _rows(self.weights["lm"], ids_j)}

    @property
    def layers(self) -> tuple[int, ...]:
        """The target's hidden states the head reads (``EagleHead.target_hidden_layers``)."""
        return (*self.config.feature_layers, -1)

    def init_cache(self, batch: int, positions: int) -> HeadCache:
        """A zero feature cache for ``batch`` rows of ``positions`` pairs (``positions + 1`` slots), in
        ``jax_model.cache_dtype`` (the target's rule: bfloat16 on a TPU at the default precision)."""
        cfg = self.config
        weight = self.weights["fc.weight"]
        shape = (batch, cfg.num_key_value_heads, positions + 1, cfg.head_dim)
        from specjax.generate.jax_model import cache_dtype_on, zeros

        device = next(iter(weight.devices()))
        arrays = zeros(2 * cfg.num_layers, shape, cache_dtype_on(weight.dtype, device), device)
        return tuple((arrays[2 * i], arrays[2 * i + 1]) for i in range(cfg.num_layers))

    def fuse(self, w: dict[str, jax.Array], hidden: jax.Array) -> jax.Array:
        """f[..., d]: the input feature from the target's states (f[..., (k+1)d]), as
        :meth:`~specjax.drafters.eagle_head.EagleHead.fuse_features`."""
        cfg = self.config
        if not cfg.feature_layers:
            return hidden
        d = cfg.hidden_size
        parts = hidden.reshape(*hidden.shape[:-1], -1, d)
        low = _rms(parts[..., :-1, :], cfg.rms_norm_eps)
        fused = jnp.concatenate([low.reshape(*low.shape[:-2], -1), parts[..., -1, :]], axis=-1)
        return fused @ w["fuse.weight"].T

    def embed(self, w: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
        """f[..., d]: the target's embedding of ``tokens`` (ids it cannot embed as id 0)."""
        table = w["embed"]
        return table[jnp.where(tokens < table.shape[0], tokens, 0)]

    def logits(self, w: dict[str, jax.Array], feature: jax.Array) -> jax.Array:
        """f[B, V]: the target's LM head on ``feature`` (f[B, d]) for the scored tokens, -inf elsewhere (the
        CPU drafter's sampled proposals; their argmax is its greedy pick up to ties)."""
        scores = feature @ w["scored"].T
        full = jnp.full((feature.shape[0], self.vocab), -jnp.inf, scores.dtype)
        return full.at[:, w["scored_ids"]].set(scores)

    def forward(
        self, w: dict[str, jax.Array], cache: HeadCache, features: jax.Array, embeds: jax.Array, start: jax.Array
    ) -> tuple[jax.Array, HeadCache]:
        """The head on W pairs at each row's pair numbers ``start[b] ..``: pure, for use under ``jax.jit``.

        Args:
          features: f[B, W, d], ``z_t`` (fused) or the head's own prediction; embeds: f[B, W, d], ``E x_{t+1}``.
          start: i32[B], the pair number of each row's first new pair.

        Returns:
          ``(predicted features f[B, W, d] after the final norm, cache)``.
        """
        from specjax.generate.jax_model import write_slots  # the target's cache writes, one rule

        cfg = self.config
        b, width, _ = features.shape
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        slots = start[:, None].astype(jnp.int32) + 1 + jnp.arange(width, dtype=jnp.int32)[None, :]  # i32[B, W]
        s = jnp.arange(cache[0][0].shape[2], dtype=jnp.int32)[None, None, :]
        q_slot = slots[:, :, None]
        visible = ((s >= 1) & (s <= q_slot)) | (s == q_slot)  # bool[B, W, S]
        positions = (slots - 1).astype(jnp.float32)
        inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
        ang = positions[:, None, :, None] * inv  # [B, 1, W, hd/2]
        cos, sin = jnp.cos(ang), jnp.sin(ang)

        def rope(t: jax.Array) -> jax.Array:
            c, sn = cos.astype(t.dtype), sin.astype(t.dtype)
            t1, t2 = t[..., : hd // 2], t[..., hd // 2 :]
            return jnp.concatenate([t1 * c - t2 * sn, t2 * c + t1 * sn], axis=-1)

        def norm(x: jax.Array, weight: jax.Array) -> jax.Array:
            return _rms(x, cfg.rms_norm_eps) * weight

        x = jnp.concatenate([features, embeds], axis=-1) @ w["fc.weight"].T + w["fc.bias"]
        new_cache = []
        for i, (keys, values) in enumerate(cache):
            p = "" if i == 0 else f"deeper.{i - 1}."
            h = norm(x, w[p + "input_norm.weight"])
            q = rope((h @ w[p + "q_proj.weight"].T).reshape(b, width, nh, hd).transpose(0, 2, 1, 3))
            k = rope((h @ w[p + "k_proj.weight"].T).reshape(b, width, nkv, hd).transpose(0, 2, 1, 3))
            v = (h @ w[p + "v_proj.weight"].T).reshape(b, width, nkv, hd).transpose(0, 2, 1, 3)
            keys, values = write_slots(keys, k, slots[:, 0]), write_slots(values, v, slots[:, 0])
            new_cache.append((keys, values))
            # query head h = g·rep + j reads key/value head g: the groups' queries as rows over the cache as
            # it lies (repeating the heads, jnp.repeat, would copy the head's whole cache every forward)
            qg = q.reshape(b, nkv, nh // nkv, width, hd)
            att = jnp.einsum("bgrwd,bgsd->bgrws", qg, keys.astype(qg.dtype)) / np.sqrt(hd)  # cache_dtype's
            att = jnp.where(visible[:, None, None], att, -jnp.inf)
            probs = jax.nn.softmax(att, axis=-1)
            out = jnp.einsum("bgrws,bgsd->bgrwd", probs, values.astype(qg.dtype)).reshape(b, nh, width, hd)
            x = x + out.transpose(0, 2, 1, 3).reshape(b, width, nh * hd) @ w[p + "o_proj.weight"].T
            h = norm(x, w[p + "post_norm.weight"])
            mlp = jax.nn.silu(h @ w[p + "gate_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)
            x = x + mlp @ w[p + "down_proj.weight"].T
        return norm(x, w["out_norm.weight"]), tuple(new_cache)


_HEADS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], JaxHead]] = weakref.WeakKeyDictionary()


def jax_head(head: Any, target: Any, vocab: int) -> JaxHead:
    """``head`` (an :class:`~specjax.drafters.eagle_head.EagleHead`) for the JAX path, over ``target``'s
    embedding and LM head (a transformers model on the CPU or torchax's ``jax`` device; read without a
    copy there). The same object while the head, the target and their weights are the same (so the
    jitted steps, which take it as a static argument, compile once per pair, not once per call)."""
    from specjax.generate.jax_model import _TRACE_LOCK

    with _TRACE_LOCK:  # one JaxHead per (head, target), also when threads ask for it at once
        return _jax_head(head, target, vocab)


def _jax_head(head: Any, target: Any, vocab: int) -> JaxHead:
    from specjax.generate.jax_model import _as_device_array, _fingerprint

    embed, lm = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    state = head.state_dict(keep_vars=True)
    named = {**{k: v for k, v in state.items() if k != "token_ids"}, "embed": embed, "lm": lm}  # ids: scored_ids
    fingerprint = (id(target), int(vocab), _fingerprint(named))
    known = _HEADS.get(head)
    if known is not None and known[0] == fingerprint:
        return known[1]
    weights = {k: _as_device_array(v) for k, v in named.items()}
    made = JaxHead(config=head.config, weights=weights, vocab=int(vocab))
    _HEADS[head] = (fingerprint, made)
    return made


def scored_ids(drafter: Any, contexts: list[list[int]], vocab: int) -> np.ndarray:
    """i32[M]: the tokens the head scores for a call, M = min(N + ``context_tokens``, V) whatever the
    prompts (one shape per drafter): the head's N, then the prompts' ids by the CPU drafter's rule
    (:func:`~specjax.drafters.eagle.context_ids`), then the first id repeated (scored twice, the same)."""
    from specjax.drafters.eagle import context_ids

    ids = drafter.head.token_ids.cpu().numpy().astype(np.int64)
    scored = np.zeros(vocab, bool)
    scored[ids] = True
    tokens = np.concatenate([np.asarray(c, np.int64) for c in contexts]) if contexts else np.zeros(0, np.int64)
    ids = np.concatenate([ids, context_ids(scored, tokens, drafter.context_tokens)])
    size = min(len(drafter.head.token_ids) + drafter.context_tokens, vocab)
    return np.concatenate([ids, np.full(size - len(ids), ids[0])]).astype(np.int32)


@jax.jit
def _rows(matrix: jax.Array, ids: jax.Array) -> jax.Array:
    """``matrix[ids]`` (f[M, d] of f[V, d] and i32[M]) in one dispatch (an eager gather is several)."""
    return matrix[ids]
