"""Checks the generation loop makes on what it is given and on what plugins give back.

Arguments (before any forward pass): the models are torch modules, no row is all
padding, the longest prompt plus ``max_new_tokens`` fits in each model's
position limit, and each model's attention layers are ones the slot cache keeps
exact (:func:`check_cache_layout`).

Plugin outputs (every step, on the host copies the loop makes anyway): a sampler
or a drafter is third-party code, and a wrong result would otherwise run to
completion with garbage tokens and impossible statistics (an acceptance rate of
33). :func:`checked_sampler` wraps a sampler with the
:func:`specjax.rejection_sample` contract; :func:`check_step_output` checks a
step's accepted counts and tokens; :func:`check_draft_output` a drafter's tokens.
Each raises :class:`PluginOutputError` (a ``ValueError``) naming the plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from specjax.adapters.jax_view import is_torchax
from specjax.drafters.base import logit_row_max
from specjax.generate.module_tensors import named_tensors
from specjax.kernels.results import AcceptanceResult
from specjax.slots import attention_layout

__all__ = [
    "MAX_DRAFT_TOKENS",
    "PluginOutputError",
    "check_all_rows_have_tokens",
    "check_cache_layout",
    "check_draft_logits",
    "check_draft_output",
    "check_model",
    "check_num_draft_tokens",
    "check_position_limit",
    "check_step_output",
    "check_weights_loaded",
    "checked_sampler",
    "plugin_name",
]


class PluginOutputError(ValueError):
    """A sampler or drafter returned something outside its contract."""


# --------------------------------------------------------------------------- arguments


def check_model(name: str, model: Any) -> None:
    """Raise ``TypeError`` unless ``model`` is a torch module with parameters (a transformers causal LM)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}: expected a transformers causal LM (a torch.nn.Module), got {type(model).__name__}")
    if next(model.parameters(), None) is None:
        raise TypeError(
            f"{name}: expected a transformers causal LM with parameters, got a {type(model).__name__} without any"
        )
    if not callable(getattr(model, "get_input_embeddings", None)) or getattr(model, "config", None) is None:
        raise TypeError(
            f"{name}: expected a transformers causal LM (with a config and input embeddings), "
            f"got {type(model).__name__}"
        )
    check_weights_loaded(name, model)


def check_weights_loaded(name: str, model: torch.nn.Module) -> None:
    """Raise ``ValueError`` if some of ``model``'s weights are on the ``meta`` device.

    The loop reads the weights where they live (one device for both models, and
    packed copies of the linear layers on a CPU), so they must be resident: an
    accelerate-offloaded model (``cpu_offload``, a ``device_map`` that offloads)
    keeps them on ``meta`` between forwards, and a model built without weights
    (``init_empty_weights``) has nothing to compute with.
    """
    named = named_tensors(model).items()  # a cached walk: this runs every call
    meta = next((n for n, t in named if t.is_meta and not is_torchax(t)), None)  # torchax tensors say meta too
    if meta is None:
        return
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        raise ValueError(
            f"{name}: its weights are offloaded by accelerate (parameter {meta!r} is on the 'meta' device between "
            "forwards); speculative decoding needs them resident on one device: load the model without offloading "
            "(device_map=None or a single device, enough memory), or use its own generate"
        )
    raise ValueError(
        f"{name}: its weights are not loaded (parameter {meta!r} is on the 'meta' device, as after "
        "init_empty_weights); load them first (from_pretrained, or load_state_dict(..., assign=True))"
    )


def check_all_rows_have_tokens(attention_mask: torch.Tensor) -> None:
    """Raise ``ValueError`` for a row whose attention mask is all zeros."""
    empty = torch.nonzero(~attention_mask.bool().any(dim=1)).flatten().tolist()
    if empty:
        raise ValueError(
            f"attention_mask: row{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
            "of the batch is all padding (no real token); every row needs at least one prompt token"
        )


# The most draft tokens a step may verify (vLLM's rejection sampler allows as many). The
# statistics, the schedule's tables and the verification's widths grow with it.
MAX_DRAFT_TOKENS = 128


def check_num_draft_tokens(num_draft_tokens: Any, max_new_tokens: int) -> int:
    """G for the loop: ``num_draft_tokens`` checked, cut to what a row can use.

    A row drafts at most ``max_new_tokens - 1`` tokens (the step's correction or
    bonus token comes on top), so a larger G changes nothing but the size of the
    per-position statistics: G is cut to ``max(1, max_new_tokens - 1)``.

    Raises:
      ValueError: not an integer in [1, :data:`MAX_DRAFT_TOKENS`].
    """
    if (
        isinstance(num_draft_tokens, bool)
        or not isinstance(num_draft_tokens, int | np.integer)
        or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS
    ):
        raise ValueError(
            f"num_draft_tokens: expected an integer in [1, {MAX_DRAFT_TOKENS}] (the most draft tokens a step "
            f"verifies), got {num_draft_tokens!r}"
        )
    return min(int(num_draft_tokens), max(int(max_new_tokens) - 1, 1))


def position_limit(model: Any) -> int | None:
    """The model's largest sequence length (``config.max_position_embeddings``, GPT-2's ``n_positions``)."""
    cfg = model.config
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(cfg, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_position_limit(name: str, model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise ``ValueError`` if ``prompt_tokens + max_new_tokens`` positions exceed ``model``'s limit.

    ``prompt_tokens`` is the longest row's real (unpadded) length: positions count
    real tokens only. Checked before any forward pass (a model with learned
    position embeddings would otherwise fail deep inside with an ``IndexError``).
    """
    limit = position_limit(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ValueError(
            f"max_new_tokens: the longest prompt ({prompt_tokens} tokens) plus max_new_tokens = {max_new_tokens} "
            f"needs {prompt_tokens + max_new_tokens} positions, more than the {name}'s limit of {limit} "
            "(config.max_position_embeddings); shorten the prompt or lower max_new_tokens"
        )


def check_cache_layout(name: str, model: Any) -> None:
    """Raise ``ValueError`` for attention layers the loop's KV cache cannot keep exact.

    Full and sliding-window attention are exact at any length (a sliding window
    is honoured by position past the window too: :mod:`specjax.slots`).
    Chunked attention (Llama 4's ``attention_chunk_size``) is not: transformers
    starts its chunks at fixed slot offsets, which the rejected draft tokens
    kept as invalid slots would shift.
    """
    types, _ = attention_layout(model)
    if "chunked_attention" in types:
        raise ValueError(
            f"{name}: chunked-attention layers ('chunked_attention' in config.layer_types) are not supported: "
            "speculative decoding keeps rejected draft tokens in the KV cache as masked slots, which these layers "
            "count; use the model's own generate, or a model with full or sliding-window attention"
        )


# --------------------------------------------------------------------------- plugin outputs


def plugin_name(kind: str, obj: Any, name: str | None = None) -> str:
    """How messages name a plugin: ``sampler 'numpy'`` or ``sampler module.function``."""
    if name is not None:
        return f"{kind} {name!r}"
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{kind} {module}.{qualname}" if module else f"{kind} {qualname}"


def hidden_layers(drafter: Any, who: str, target: Any) -> tuple[int, ...]:
    """The target hidden states ``drafter`` reads (its ``target_hidden_layers``, default ``(-1,)``: the
    final normed state), checked against the target's depth: indices into ``output_hidden_states``,
    which holds ``num_hidden_layers + 1`` entries."""
    layers = getattr(drafter, "target_hidden_layers", (-1,))
    depth = getattr(target.config, "num_hidden_layers", None)
    try:
        layers = tuple(layers)
    except TypeError:
        raise ValueError(f"{who}: target_hidden_layers: expected a sequence of layer indices, got {layers!r}") from None
    bad = [
        i
        for i in layers
        if isinstance(i, bool) or not isinstance(i, int) or (depth is not None and not -(depth + 1) <= i <= depth)
    ]
    if not layers or bad:
        where = f" in [-{depth + 1}, {depth}] (the target has {depth} layers)" if depth is not None else ""
        raise ValueError(f"{who}: target_hidden_layers: expected one or more integers{where}, got {layers!r}")
    return layers


def _host(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _int_array(who: str, what: str, x: Any, shape: tuple[int, ...]) -> np.ndarray:
    try:
        arr = _host(x)
    except Exception as err:  # any object a plugin may return
        raise PluginOutputError(f"{who} returned {what} that is not an array ({type(x).__name__}: {err})") from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise PluginOutputError(f"{who} returned {what} of dtype {arr.dtype}, expected integers")
    if tuple(arr.shape) != shape:
        raise PluginOutputError(f"{who} returned {what} of shape {tuple(arr.shape)}, expected {shape}")
    return arr


def check_step_output(who: str, num_accepted: Any, tokens: Any, draft_lengths: Any, vocab: int) -> None:
    """Check one verification's result for rows with ``k_b = draft_lengths[b]``.

    ``num_accepted``: i[B] in [0, k_b]; ``tokens``: i[B, W] with W > max k_b, whose
    first ``n_b + 1`` entries (the accepted tokens and the emitted one) are in [0, V).
    """
    k = np.asarray(draft_lengths).astype(np.int64).reshape(-1)
    b = k.shape[0]
    n = _int_array(who, "num_accepted", num_accepted, (b,)).astype(np.int64)
    tok = _host(tokens)
    if tok.ndim != 2 or tok.shape[0] != b or (b and tok.shape[1] <= int(k.max())):
        raise PluginOutputError(
            f"{who} returned tokens of shape {tuple(tok.shape)}, expected ({b}, G+1) with "
            f"G >= {int(k.max()) if b else 0}"
        )
    tok = _int_array(who, "tokens", tok, tuple(tok.shape)).astype(np.int64)
    bad = np.nonzero((n < 0) | (n > k))[0]
    if bad.size:
        r = int(bad[0])
        raise PluginOutputError(
            f"{who} returned num_accepted = {int(n[r])} for row {r}, expected a value in "
            f"[0, {int(k[r])}] (the row's number of draft tokens)"
        )
    emitted = np.arange(tok.shape[1])[None, :] <= n[:, None]
    out = emitted & ((tok < 0) | (tok >= vocab))
    if out.any():
        r, i = (int(v) for v in np.argwhere(out)[0])
        raise PluginOutputError(
            f"{who} returned token {int(tok[r, i])} at row {r}, position {i}, expected an id in [0, V) = [0, {vocab})"
        )


def checked_sampler(sampler: Callable[..., Any], who: str) -> Callable[..., AcceptanceResult]:
    """``sampler`` with its result checked (:func:`check_step_output`) and returned as host NumPy arrays.

    A sampler returns an :class:`AcceptanceResult` or, as the plugin contract
    has always allowed, a mapping with ``"num_accepted"`` and ``"tokens"``.
    """

    def run(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, validate=True):
        res = sampler(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, validate=validate)
        if isinstance(res, AcceptanceResult):
            n_raw, tokens_raw = res.num_accepted, res.tokens
        elif isinstance(res, Mapping) and "num_accepted" in res and "tokens" in res:
            n_raw, tokens_raw = res["num_accepted"], res["tokens"]
        else:
            raise PluginOutputError(
                f"{who} returned {type(res).__name__}, expected a dict with 'num_accepted' and 'tokens' "
                "or an AcceptanceResult"
            )
        b, g = draft_tokens.shape
        n = _int_array(who, "num_accepted", n_raw, (b,))
        tokens = _int_array(who, "tokens", tokens_raw, (b, g + 1))
        check_step_output(who, n, tokens, np.full(b, g), int(target_probs.shape[-1]))
        return AcceptanceResult(n, tokens)

    run.__name__ = getattr(sampler, "__name__", "sampler")
    run.__qualname__ = getattr(sampler, "__qualname__", run.__name__)
    run.__wrapped__ = sampler  # type: ignore[attr-defined]
    return run


def check_draft_output(
    who: str, tokens: Any, batch: int, max_tokens: int, vocab: int, lengths: Any = None
) -> np.ndarray:
    """Check a drafter's proposal: i[B, G'] with G' <= ``max_tokens``, ids in [0, V) where used.

    ``lengths`` (optional, i[B]): each row's number of proposed tokens, in [0, G'];
    only the first ``lengths[b]`` ids of a row are checked. Returns the host copy.
    """
    tok = _host(tokens)
    if tok.ndim != 2 or tok.shape[0] != batch or tok.shape[1] > max_tokens:
        raise PluginOutputError(
            f"{who} returned draft tokens of shape {tuple(tok.shape)}, expected ({batch}, G) with G <= {max_tokens}"
        )
    tok = _int_array(who, "draft tokens", tok, tuple(tok.shape)).astype(np.int64)
    width = tok.shape[1]
    if lengths is None:
        used = np.ones(tok.shape, bool)
    else:
        k = _int_array(who, "draft lengths", lengths, (batch,)).astype(np.int64)
        bad = np.nonzero((k < 0) | (k > width))[0]
        if bad.size:
            r = int(bad[0])
            raise PluginOutputError(
                f"{who} returned a draft length of {int(k[r])} for row {r}, expected a value in [0, {width}]"
            )
        used = np.arange(width)[None, :] < k[:, None]
    out = used & ((tok < 0) | (tok >= vocab))
    if out.any():
        r, i = (int(v) for v in np.argwhere(out)[0])
        raise PluginOutputError(
            f"{who} returned draft token {int(tok[r, i])} at row {r}, position {i}, expected "
            f"an id in [0, V) = [0, {vocab})"
        )
    return tok


def check_draft_logits(
    who: str, logits: Any, tokens: np.ndarray, lengths: np.ndarray, batch: int, *, values: bool
) -> None:
    """Check a drafter's draft logits: one f[B, V_draft] array per position, each a distribution.

    ``tokens``: i[B, G] host array of the proposed ids; ``lengths``: i[B], ``k_b``
    (row b's ``i``-th logits row matters only while ``i < k_b``). Shapes are
    always checked. With ``values`` (sampled steps, where the acceptance test
    reads ``q``): every used row must hold no NaN and no +inf and not be all
    -inf (its softmax would be NaN: the test would then read garbage), and
    the proposed token must have a finite logit in it (a token outside the
    logits' width, or at -inf, has ``q(x) = 0``: it was not drawn from these
    logits, and ``q(x) = 0`` would pass any token the target allows). One max
    and one gather per position, in the array's own library (no copy of a
    device array to the host but the (B,) results).
    """
    k_max = int(lengths.max(initial=0))
    for i, lg in enumerate(logits):
        shape = getattr(lg, "shape", None)
        if not isinstance(lg, torch.Tensor | np.ndarray) and not hasattr(lg, "__jax_array__") and shape is None:
            raise PluginOutputError(
                f"{who} returned draft logits at position {i} as {type(lg).__name__}, expected an array of shape "
                f"({batch}, V) (a torch tensor, NumPy or JAX array)"
            )
        if shape is None or len(shape) != 2 or int(shape[0]) != batch or int(shape[1]) < 1:
            raise PluginOutputError(
                f"{who} returned draft logits of shape {tuple(shape or ())} at position {i}, expected ({batch}, V)"
            )
        if not values or i >= k_max:
            continue
        dt = str(getattr(lg, "dtype", ""))
        if not any(f in dt for f in ("float16", "float32", "float64")):
            raise PluginOutputError(f"{who} returned draft logits of dtype {dt} at position {i}, expected floats")
        rows = np.nonzero(lengths > i)[0]
        width = int(shape[1])
        x = np.asarray(tokens[rows, i], np.int64)
        inside = x < width
        row_max = logit_row_max(lg, rows)
        at_x = np.where(inside, _logit_at(lg, rows, np.minimum(x, width - 1)), -np.inf)
        bad = np.nonzero(~np.isfinite(row_max))[0]
        if bad.size:
            r, m = int(rows[bad[0]]), float(row_max[bad[0]])
            what = "NaN" if np.isnan(m) else ("+inf" if m > 0 else "only -inf")
            raise PluginOutputError(
                f"{who} returned draft logits holding {what} at position {i}, row {r}: expected finite logits "
                "(-inf only for excluded tokens) whose softmax is the distribution the token was drawn from"
            )
        bad = np.nonzero(~np.isfinite(at_x))[0]
        if bad.size:
            j = int(bad[0])
            where = f"outside the logits' width {width}" if not inside[j] else "whose logit is -inf"
            raise PluginOutputError(
                f"{who} proposed token {int(x[j])} at row {int(rows[j])}, position {i}, {where}: a sampled draft "
                "token must be drawn from the draft logits returned with it (q(x) > 0); return logits over the "
                "whole vocabulary"
            )


def _logit_at(lg: Any, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """f64[R] host array ``lg[rows, ids]`` (torch, NumPy or JAX)."""
    if isinstance(lg, torch.Tensor):
        dev = lg.device
        at = lg.detach()[torch.as_tensor(rows, device=dev), torch.as_tensor(ids, device=dev)]
        return at.double().cpu().numpy()
    if not isinstance(lg, np.ndarray):
        import jax.numpy as jnp

        return np.asarray(jnp.asarray(lg)[rows, ids], np.float64)
    return np.asarray(lg[rows, ids], np.float64)
