"""The front end's independent references (tests/test_frontend*.py): float64 NumPy, transformers' warpers.

:func:`ref_process` and :func:`ref_verify_row` reproduce the contract of
:func:`specjax.rejection_sample` from the processed distributions in float64;
:func:`hf_process` is transformers' own warpers in torch float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Distance to a threshold below which float32 and float64 may disagree.
BOUNDARY_TOL = 1e-5

# --------------------------------------------------------------------------- #
# Independent float64 reference
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Processed:
    probs: np.ndarray  # f64[V]
    margin: float  # distance of the top-p cumulative sums to 1 - top_p (inf: no top-p)


def ref_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> Processed:
    """Temperature, top-k, top-p (transformers semantics, min_tokens_to_keep=1), softmax.

    ``logits``: one row f[V]; ``top_k = 0`` and ``top_p = 1`` switch the step off;
    ``temperature = 0`` is greedy (one-hot at the first maximum).
    """
    x = np.asarray(logits, np.float64)
    vocab = x.shape[0]
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(x))] = 1.0
        return Processed(out, np.inf)
    # The implementation divides in float32; so does the reference, then widens.
    s = (x.astype(np.float32) / np.float32(temperature)).astype(np.float64)
    keep = np.ones(vocab, bool)
    if top_k > 0:
        kth = np.sort(s)[::-1][min(top_k, vocab) - 1]
        keep &= s >= kth
    margin = np.inf
    if top_p < 1:
        masked = np.where(keep, s, -np.inf)
        order = np.argsort(masked, kind="stable")  # ascending
        srt = masked[order]
        e = np.exp(srt - srt[-1])
        cum = np.cumsum(e / e.sum())
        threshold = 1.0 - top_p
        remove = cum <= threshold
        remove[-1] = False
        keep[order[remove]] = False
        finite = np.isfinite(srt)
        if finite.any():
            margin = float(np.min(np.abs(cum[finite] - threshold)))
    e = np.where(keep, np.exp(s - s[keep].max()), 0.0)
    return Processed(e / e.sum(), margin)


@dataclasses.dataclass
class RefResult:
    num_accepted: int
    tokens: np.ndarray  # i64[G+1]
    near_boundary: bool


def ref_verify_row(x, draft_logits, target_logits, u, s, temperature, top_k, top_p, k_b) -> RefResult:
    """The whole verify step for one row, in float64 (the contract of rejection_sample).

    ``x``: i[G]; ``draft_logits``: f[G, V]; ``target_logits``: f[G+1, V];
    ``u``: f[G]; ``s``: float; ``k_b``: the number of draft tokens to test.
    """
    g = len(x)
    P = [ref_process(target_logits[i], temperature, top_k, top_p) for i in range(g + 1)]
    Q = [ref_process(draft_logits[i], temperature, top_k, top_p) for i in range(g)]
    near = any(d.margin < BOUNDARY_TOL for d in P + Q)
    n = 0
    while n < k_b:
        pv, qv = P[n].probs[x[n]], Q[n].probs[x[n]]
        if qv > 0:
            ratio = pv / qv
            near |= abs(u[n] - ratio) < BOUNDARY_TOL * max(1.0, ratio)
            passed = u[n] < ratio
        else:
            passed = pv > 0
        if not passed:
            break
        n += 1
    r = np.maximum(P[n].probs - Q[n].probs, 0) if n < k_b else P[n].probs.copy()
    near |= 0 < r.sum() < BOUNDARY_TOL
    if r.sum() <= 0:
        r = P[n].probs.copy()
    cdf = np.cumsum(r) / r.sum()
    near |= bool(np.any(np.abs(cdf[r > 0] - s) < BOUNDARY_TOL))
    above = np.nonzero(cdf > s)[0]
    y = int(above[0]) if above.size else int(np.nonzero(r > 0)[0][-1])
    tokens = np.full(g + 1, -1, np.int64)
    tokens[:n] = x[:n]
    tokens[n] = y
    return RefResult(n, tokens, near)


def kernel_uniforms(key: jax.Array, batch: int, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The draws verify_from_logits is documented to make: u = [:, :G], s = [:, G]."""
    if key.ndim == 0:
        draws = jax.random.uniform(key, (batch, g + 1), jnp.float32)
    else:
        draws = jax.vmap(lambda k: jax.random.uniform(k, (g + 1,)))(key)
    draws = np.asarray(draws, np.float64)
    return draws[:, :g], draws[:, g]


def hf_process(logits_f32: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """transformers' warpers in torch float32, then softmax (one row f32[V] -> f32[V])."""
    scores = torch.from_numpy(np.array(logits_f32, np.float32))[None, :]
    if temperature == 0:
        out = np.zeros(scores.shape[1], np.float32)
        out[int(torch.argmax(scores[0]))] = 1.0
        return out
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(float(top_p))(None, scores)
    return torch.softmax(scores, dim=-1)[0].numpy()


def hf_top_p_margin(logits_f32: np.ndarray, temperature: float, top_k: int, top_p: float) -> float:
    """How close transformers' own top-p cumulative sums come to 1 - top_p (inf: no top-p)."""
    if temperature == 0 or top_p >= 1:
        return np.inf
    scores = torch.from_numpy(np.array(logits_f32, np.float32))[None, :]
    scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    srt, _ = torch.sort(scores, descending=False)
    cum = srt.softmax(dim=-1).cumsum(dim=-1)[0].double().numpy()
    finite = np.isfinite(srt[0].numpy())
    return float(np.min(np.abs(cum[finite] - (1 - top_p))))


def per_row(value, batch: int) -> np.ndarray:
    return np.broadcast_to(np.asarray(value), (batch,))


# Shapes shared by the tests: every new shape, dtype or static variant (key kind,
# top_k / top_p None or given) is one more XLA compilation (seconds on a busy
# 2-core machine), so the tests reuse a few.
SB, SV = 6, 64  # sample_from_logits
MB, MG, MV = 48, 4, 40  # verify_from_logits


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #


def make_case(rng: np.random.Generator, batch: int, g: int, vocab: int, *, scale: float = 2.0, noise: float = 0.7):
    """Target logits f32[B, G+1, V] and draft logits close to them, f32[B, G, V]."""
    target = (scale * rng.standard_normal((batch, g + 1, vocab))).astype(np.float32)
    draft = (target[:, :g] + noise * rng.standard_normal((batch, g, vocab))).astype(np.float32)
    return draft, target


def sample_draft_tokens(rng, draft_logits, temperature, top_k, top_p) -> np.ndarray:
    """x_i ~ q_i with the reference processing (so tests pass often); i64[B, G]."""
    b, g, vocab = draft_logits.shape
    x = np.zeros((b, g), np.int64)
    for i in range(b):
        for j in range(g):
            q = ref_process(draft_logits[i, j], temperature[i], top_k[i], top_p[i]).probs
            x[i, j] = rng.choice(vocab, p=q)
    return x
