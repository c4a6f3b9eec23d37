"""The EAGLE-style draft head: a decoder layer (or a few) over the target's own features.

EAGLE (Li et al. 2024, arXiv 2401.15077) drafts at the feature level. At a
committed position t the target's final normed hidden state ``z_t`` (its LM head
gives the logits of token t+1: ``logits = W z_t``) and the embedding of the
token that followed, ``E x_{t+1}``, are fused, ``fc([z_t, E x_{t+1}])``, and one
decoder layer (``num_layers`` of them), attending over the fused inputs of the
earlier positions, predicts ``z_{t+1}``; the target's LM head on that prediction gives the draft
distribution of ``x_{t+2}``. Drafting further feeds the predicted feature back
with the embedding of the drafted token.

The head stores only its fusion layer, its decoder layers and its norms, and the
ids of the N target tokens its output scores (the most frequent ones, or all
V); the embedding and the LM head are the target's (passed in, never copied).
A token outside those N gets draft probability 0, which keeps the acceptance
step exact (the target may still emit it).

Files: a directory with ``config.json`` (:class:`EagleConfig`'s fields and
``"model_type": "specjax-eagle"``) and ``model.safetensors``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["EagleConfig", "EagleHead", "FeatureCache", "init_weights", "load_head", "save_head"]

MODEL_TYPE = "specjax-eagle"


@dataclass(frozen=True)
class EagleConfig:
    """The head's shape (the target's hidden size ``hidden_size``; N = ``num_tokens``)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    target_vocab_size: int
    num_tokens: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # EAGLE-3-style input (arXiv 2503.01840): also the target's hidden states after these layers
    # (indices into transformers' ``output_hidden_states``: 1 .. num_hidden_layers - 1), fused with
    # z_t by ``fuse`` into the head's input feature at committed positions; () reads z_t alone
    feature_layers: tuple[int, ...] = ()
    # decoder layers; the first one's weights are named as in a one-layer head (``q_proj.weight``, ...),
    # the later ones' ``deeper.<i>.q_proj.weight`` (i = 0 for the second layer)
    num_layers: int = 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        for f in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "num_layers",
            "target_vocab_size",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f}: expected a positive integer, got {v!r}")
        for f in ("rms_norm_eps", "rope_theta"):  # a JSON number; a string or -1 would load and draft garbage
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{f}: expected a finite number > 0, got {v!r}")
            object.__setattr__(self, f, float(v))
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size: expected a multiple of num_attention_heads={self.num_attention_heads}, "
                f"got {self.hidden_size}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads={self.num_attention_heads}, "
                f"got {self.num_key_value_heads}"
            )
        layers = tuple(self.feature_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or i <= 0 for i in layers) or len(set(layers)) < len(
            layers
        ):
            raise ValueError(f"feature_layers: expected distinct positive layer indices, got {self.feature_layers!r}")
        object.__setattr__(self, "feature_layers", layers)  # a JSON list arrives as a list
        n = self.num_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= self.target_vocab_size:
            raise ValueError(
                f"num_tokens: expected 1..target_vocab_size={self.target_vocab_size}, got {self.num_tokens}"
            )


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Llama's half-split layout) of x: f[B, H, W, hd] at i64[B, W] positions."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = positions[:, None, :, None].float() * inv  # [B, 1, W, hd/2]
    cos, sin = torch.cos(ang).to(x.dtype), torch.sin(ang).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class FeatureCache:
    """The head's keys and values, slot by slot, for B rows that advance raggedly.

    ``keys[l]``, ``values[l]``: f[B, kv_heads, L, head_dim] of decoder layer l.
    Slot s of row b is valid or not (``valid``: bool[B, L]); a row's position
    for RoPE is the number of its valid slots before it, so invalid slots
    (padding, rows that committed fewer pairs) leave no gap.
    """

    def __init__(self, batch: int, config: EagleConfig, device: Any, dtype: torch.dtype) -> None:
        h, hd = config.num_key_value_heads, config.head_dim
        empty = torch.zeros((batch, h, 0, hd), device=device, dtype=dtype)
        self.keys = [empty] * config.num_layers
        self.values = [empty] * config.num_layers
        self.valid = torch.zeros((batch, 0), device=device, dtype=torch.bool)
        self.num_valid = torch.zeros(batch, device=device, dtype=torch.long)

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def truncate(self, length: int) -> None:
        """Drop slots ``length`` and after (the drafted pairs of the last proposal)."""
        if length >= self.length:
            return
        self.num_valid = self.num_valid - self.valid[:, length:].sum(dim=1)
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.valid = self.valid[:, :length]

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys, self.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        self.valid, self.num_valid = self.valid[rows], self.num_valid[rows]


def _add_decoder_layer(module: nn.Module, config: EagleConfig) -> None:
    """Give ``module`` a Llama-style decoder layer's weights, under the names a one-layer head gives them."""
    d, hd = config.hidden_size, config.head_dim
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    module.input_norm = _RMSNorm(d, config.rms_norm_eps)
    module.q_proj = nn.Linear(d, nh * hd, bias=False)
    module.k_proj = nn.Linear(d, nkv * hd, bias=False)
    module.v_proj = nn.Linear(d, nkv * hd, bias=False)
    module.o_proj = nn.Linear(nh * hd, d, bias=False)
    module.post_norm = _RMSNorm(d, config.rms_norm_eps)
    module.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
    module.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
    module.down_proj = nn.Linear(config.intermediate_size, d, bias=False)


class _DecoderLayer(nn.Module):
    """A decoder layer after the head's first (``EagleHead.deeper``)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        _add_decoder_layer(self, config)


def _decoder_layer(
    layer: Any,
    config: EagleConfig,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer: (f[B, W, d] out, keys and values f[B, kv_heads, L + W, head_dim]).

    x: f[B, W, d]; positions: i64[B, W] (RoPE); mask: bool[B, W, L + W], the
    keys each query reads; past: the layer's cached keys and values (L slots)
    or None (L = 0).
    """
    b, w, _ = x.shape
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    h = layer.input_norm(x)
    q = _rope(layer.q_proj(h).view(b, w, nh, hd).transpose(1, 2), positions, config.rope_theta)
    k = _rope(layer.k_proj(h).view(b, w, nkv, hd).transpose(1, 2), positions, config.rope_theta)
    v = layer.v_proj(h).view(b, w, nkv, hd).transpose(1, 2)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    # grouped-query attention without materialising repeated keys and values
    att = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=nkv != nh)
    x = x + layer.o_proj(att.transpose(1, 2).reshape(b, w, nh * hd))
    h = layer.post_norm(x)
    return x + layer.down_proj(nn.functional.silu(layer.gate_proj(h)) * layer.up_proj(h)), k, v


class EagleHead(nn.Module):
    """fc(2d -> d) over ``[z_t, E x_{t+1}]``, Llama-style decoder layers (one by default), a final RMSNorm.

    With ``feature_layers`` (k of them), the input feature at a committed
    position is ``fuse([n(h_1), ..., n(h_k), z_t])`` (:meth:`fuse_features`; n:
    RMS normalisation without weights, h_j the target's hidden state after
    layer ``feature_layers[j]``), a linear map (k+1)d -> d; drafted positions
    still feed back the head's own prediction.

    ``token_ids`` (i64[N] buffer): the target tokens the head scores, in the
    order of its output columns.
    """

    token_ids: torch.Tensor

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=True)
        self.fuse = nn.Linear((len(config.feature_layers) + 1) * d, d, bias=False) if config.feature_layers else None
        _add_decoder_layer(self, config)  # the first decoder layer
        self.deeper = nn.ModuleList(_DecoderLayer(config) for _ in range(config.num_layers - 1))
        self.out_norm = _RMSNorm(d, config.rms_norm_eps)
        self.register_buffer("token_ids", torch.arange(config.num_tokens, dtype=torch.long))

    @property
    def target_hidden_layers(self) -> tuple[int, ...]:
        """What the head reads of the target's forward, as indices into ``output_hidden_states``:
        ``feature_layers`` then -1 (the final normed state, z)."""
        return (*self.config.feature_layers, -1)

    def fuse_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """f[..., d]: the head's input feature from the target's ``hidden`` (f[..., (k+1)d]: the states of
        :attr:`target_hidden_layers`, concatenated in that order); z itself when the head fuses nothing."""
        if self.fuse is None:
            return hidden
        d = self.config.hidden_size
        parts = hidden.unflatten(-1, (-1, d))  # [..., k+1, d]
        low = parts[..., :-1, :].float()
        low = (low * torch.rsqrt(low.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)).to(hidden.dtype)
        return self.fuse(torch.cat([low.flatten(-2), parts[..., -1, :]], dim=-1))

    def forward(
        self,
        features: torch.Tensor,
        token_embeds: torch.Tensor,
        valid: torch.Tensor,
        cache: FeatureCache | None = None,
    ) -> torch.Tensor:
        """Predict the next feature at each new slot.

        Args:
          features: f[B, W, d], ``z_t`` (the target's, or the head's own prediction).
          token_embeds: f[B, W, d], ``E x_{t+1}``.
          valid: bool[B, W], the slots that hold real pairs.
          cache: the earlier slots (appended to); None: the W slots alone,
            causal (training).

        Returns:
          f[B, W, d]: the predicted ``z_{t+1}`` (after the head's final norm,
          like the target's features).
        """
        cfg = self.config
        b, w, _ = features.shape
        v_long = valid.long()
        start = cache.num_valid if cache is not None else torch.zeros(b, dtype=torch.long, device=features.device)
        positions = start[:, None] + torch.cumsum(v_long, dim=1) - v_long
        x = self.fc(torch.cat([features, token_embeds], dim=-1))
        causal = torch.ones((w, w), dtype=torch.bool, device=x.device).tril()
        mask = causal[None] & valid[:, None, :]  # [B, W(query), W(key)]
        mask = mask | torch.eye(w, dtype=torch.bool, device=x.device)[None]  # never an empty row
        if cache is not None:
            mask = torch.cat([cache.valid[:, None, :].expand(b, w, cache.length), mask], dim=2)
        for i, layer in enumerate([self, *self.deeper]):
            past = (cache.keys[i], cache.values[i]) if cache is not None else None
            x, k, v = _decoder_layer(layer, cfg, x, positions, mask, past)
            if cache is not None:
                cache.keys[i], cache.values[i] = k, v
        if cache is not None:
            cache.valid = torch.cat([cache.valid, valid], dim=1)
            cache.num_valid = cache.num_valid + v_long.sum(dim=1)
        return self.out_norm(x)

    def scores(self, features: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """f[..., N]: the target's LM head on ``features``, for the head's N tokens only."""
        return features @ lm_head_weight[self.token_ids].T


def _stored(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """How :func:`save_head` stores one tensor: float16, or float32 where float16 cannot hold its values.

    Raises:
      ValueError: the tensor holds NaN or inf (a broken head is not saved).
    """
    t = tensor.detach().cpu()
    if not t.is_floating_point():
        return t.contiguous()
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"eagle head: weight {name} holds NaN or inf; not saving a broken head")
    half = t.to(torch.float16)
    # beyond float16's range (|w| > 65504) a weight would become inf: that tensor stays float32
    return (half if bool(torch.isfinite(half).all()) else t.float()).contiguous()


def save_head(head: EagleHead, directory: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``.

    Weights are stored as float16, except a tensor with values beyond float16's
    range (kept float32, so no weight becomes inf).

    Raises:
      ValueError: a weight holds NaN or inf (nothing is written).
    """
    from safetensors.torch import save_file

    tensors = {k: _stored(k, v) for k, v in head.state_dict().items()}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": MODEL_TYPE, **asdict(head.config), **(extra or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"))


def load_head(directory: str | os.PathLike[str]) -> EagleHead:
    """The head saved in ``directory`` (float32), or ``ValueError`` naming the file and what is wrong."""
    path = Path(directory)
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    if not path.is_dir():
        raise ValueError(f"eagle head: {path}: no such directory (expected config.json and model.safetensors)")
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"eagle head: {config_file}: missing") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"eagle head: {config_file}: not readable JSON ({err})") from None
    if not isinstance(raw, dict) or raw.get("model_type") != MODEL_TYPE:
        got = raw.get("model_type") if isinstance(raw, dict) else type(raw).__name__
        raise ValueError(f"eagle head: {config_file}: expected model_type {MODEL_TYPE!r}, got {got!r}")
    names = {f.name for f in fields(EagleConfig)}
    try:
        config = EagleConfig(**{k: v for k, v in raw.items() if k in names})
    except (TypeError, ValueError) as err:
        raise ValueError(f"eagle head: {config_file}: {err}") from None
    if not weights_file.is_file():
        raise ValueError(f"eagle head: {weights_file}: missing")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise ValueError(f"eagle head: {weights_file}: not a readable safetensors file ({err})") from None
    head = EagleHead(config)
    want = head.state_dict()
    problems = sorted(set(want) ^ set(tensors))
    if problems:
        raise ValueError(f"eagle head: {weights_file}: missing or unexpected tensors {problems[:5]}")
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(want[k].shape):
            raise ValueError(
                f"eagle head: {weights_file}: tensor {k} has shape {tuple(v.shape)}, expected {tuple(want[k].shape)}"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(
                f"eagle head: {weights_file}: tensor {k} holds NaN or inf (a weight beyond float16's range saved "
                "as float16 becomes inf); save the head again with this version's save_head"
            )
    ids = tensors["token_ids"]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.target_vocab_size):
        raise ValueError(f"eagle head: {weights_file}: token_ids outside [0, {config.target_vocab_size})")
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()})
    return head.eval()


def init_weights(head: EagleHead, seed: int = 0) -> None:
    """A starting point for training: small random weights, the decoder layer's norms at 1.

    The fusion layer starts as ``[I, 0]`` (the predicted feature starts near
    ``z_t``: a head that repeats the current distribution); ``fuse``, if any, as
    ``[0, ..., 0, I]`` (z_t alone).
    """
    g = torch.Generator().manual_seed(seed)
    d = head.config.hidden_size
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]) * 0.5)
            else:
                p.zero_()
        head.fc.weight.zero_()
        head.fc.weight[:, :d].copy_(torch.eye(d))
        if head.fuse is not None:
            head.fuse.weight.zero_()
            head.fuse.weight[:, -d:].copy_(torch.eye(d))
        for layer in [head, *head.deeper]:
            layer.o_proj.weight.mul_(0.1)
            layer.down_proj.weight.mul_(0.1)
