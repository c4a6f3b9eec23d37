"""Tiny transformers models for the torchax tests (built from configs; nothing is downloaded)."""

from __future__ import annotations

import copy

import torch
import torchax
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed=0, tie=False, layers=2, hidden=64, vocab=256):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg).eval()


def perturbed(model, scale, seed=1):
    """A copy of ``model`` with Gaussian noise of std ``scale`` on every weight: a draft that agrees often."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return out


def on_jax(model):
    """A copy of ``model`` on torchax's jax device (here JAX's CPU backend)."""
    out = copy.deepcopy(model)
    with torchax.default_env():
        out.to("jax")
    return out


def ragged_prompts():
    """``(ids i64[3, 7], mask)``: three left-padded rows of 7, 1 and 4 tokens, the last a repeating pattern."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 7), generator=gen)
    ids[2, 3:] = torch.tensor([11, 12, 11, 12])
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    mask[2, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def target_greedy(target, ids, mask, max_new):
    """Each row alone, without padding, through transformers' generate: the target-only reference."""
    rows = []
    with torch.no_grad():
        for b in range(ids.shape[0]):
            row = ids[b : b + 1, mask[b].bool()]
            out = target.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=max_new, do_sample=False)
            rows.append(out[0, row.shape[1] :].tolist())
    return rows


LOOP_MAX_NEW = 20  # the loop tests' new tokens a row
LOOP_G = 3  # one draft length for most cases: each (drafter, G, sampling mode) traces and compiles its step once


def loop_models():
    """The loop tests' CPU target and drafts, and their copies on the jax device: a close draft (accepts
    often), a random one (rarely)."""
    target = tiny_llama(seed=0)
    close = perturbed(target, 0.002)
    far = tiny_llama(seed=7, layers=1, hidden=32)
    cpu = {"target": target, "close": close, "far": far}
    return cpu, {k: on_jax(v) for k, v in cpu.items()}


def make_drafter(name, models):
    """``close`` / ``far``: the model drafter; ``ngram``; ``hybrid``: ngram where it matches, else ``close``."""
    from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter

    if name == "ngram":
        return NgramDrafter()
    if name == "hybrid":
        return HybridDrafter(NgramDrafter(), ModelDrafter(models["close"]))
    return models[name]
