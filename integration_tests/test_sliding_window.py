"""Sliding-window attention (Mistral, Gemma-3's local layers) within and past the window.

transformers draws a sliding window over cache *slots*; the loop keeps rejected
draft tokens as invalid slots, so without care a row's window would hold fewer
than W tokens once its rejections sit inside it (and transformers' own
sliding-window cache layers, which evict slots, could not be rolled back past
the window at all). Checked here against independent references:

* greedy output equals ``target.generate(do_sample=False)`` on a Mistral-style
  model (every layer slides) and a Gemma-3-style one (sliding and full layers),
  window 16, for lengths within and well past the window, at B = 1 and on a
  ragged left-padded batch, drafting with a model and with n-grams, and for
  prompts longer than the window; a sliding-window draft for a full target;
* the slot cache alone, fed chunks whose tails are rejected by different
  amounts per row, gives each row the logits of a fresh forward over its
  sequence, and an all-sliding model's cache stays near 2W slots;
* chunked attention (Llama 4), whose chunks transformers counts in slots, is
  refused with a message that says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import specjax

VOCAB = 96
WINDOW = 16
LENGTHS = (5, 1, 7, 3)


def gemma3(window: int, seed: int = 0) -> Any:
    """A tiny Gemma-3 text model: layers sliding, full, sliding, full."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"] * 2,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


@pytest.fixture(scope="module")
def models(tiny_lm, perturbed_copy) -> dict[str, tuple[Any, Any]]:
    """arch -> (target, draft): the draft a perturbed copy, so that rows accept different numbers of tokens."""
    out = {}
    for arch in ("mistral", "gemma3"):
        target = tiny_lm("mistral", sliding_window=WINDOW) if arch == "mistral" else gemma3(WINDOW)
        out[arch] = (target, perturbed_copy(target, noise=0.05, seed=3))
    return out


def hf_greedy(target, ids, mask, max_new_tokens) -> torch.Tensor:
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("ragged", [False, True], ids=["B1", "ragged"])
@pytest.mark.parametrize("max_new_tokens", [8, 48], ids=["within", "past"])
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_greedy_matches_target_generate(arch, max_new_tokens, ragged, drafter, models, left_padded):
    target, draft = models[arch]
    ids, mask = left_padded(LENGTHS if ragged else (6,), vocab_size=VOCAB, seed=11)
    out = specjax.speculative_generate(
        target,
        draft if drafter == "model" else drafter,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=4,
        adaptive=False,
    )
    if drafter == "model" and max_new_tokens > WINDOW:  # rows accepted some drafts and rejected others
        assert 0 < out.stats.acceptance_rate < 1
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, max_new_tokens))


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_prompts_longer_than_the_window(arch, models, left_padded):
    """Prompts of 40, 25, 33 and 2 tokens (window 16): the prefill itself slides."""
    target, draft = models[arch]
    ids, mask = left_padded((40, 25, 33, 2), vocab_size=VOCAB, seed=11)
    out = specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=24, adaptive=False)
    assert 0 < out.stats.acceptance_rate < 1
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 24))


def test_a_sliding_window_draft_for_a_full_attention_target(tiny_lm, left_padded):
    target = tiny_lm("llama", seed=0)
    draft = tiny_lm("mistral", sliding_window=8, seed=0)
    ids, mask = left_padded((20, 9, 14), vocab_size=VOCAB, seed=2)
    out = specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=30, adaptive=False)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 30))


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_adaptive_sampled_run_past_the_window_leaves_an_exact_cache(arch, models, left_padded):
    """Sampled, with the adaptive draft length: the target's cache then scores each row's next token as a
    fresh forward over the row's whole sequence does."""
    target, draft = models[arch]
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=5)
    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=40, temperature=1.0, seed=3, return_state=True
    )
    state = out.state
    cache = state.target_cache
    b = len(state.rows)
    cached = cache.forward(state.last[:, None], np.ones((b, 1), bool), last_only=True)[:, 0]
    with torch.inference_mode():
        for j, row in enumerate(state.rows):
            seq = ids[row][mask[row].bool()].tolist()
            seq += out.sequences[row, ids.shape[1] : ids.shape[1] + int(out.num_new_tokens[row])].tolist()
            assert seq[-1] == int(state.last[j])
            fresh = target(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(cached[j], fresh, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_slot_cache_keeps_each_rows_window_by_position(arch, models):
    """Chunks of real tokens plus junk, the junk rejected by a different amount per row (holes inside the
    window): each row's logits equal a fresh forward's over its real tokens, far past the window."""
    from specjax.slots import SlotCache

    target, _ = models[arch]
    rng = np.random.default_rng(0)
    batch, steps = 3, 30
    seqs: list[list[int]] = [[] for _ in range(batch)]
    cache = SlotCache(target, batch, torch.device("cpu"))
    longest = 0
    for _ in range(steps):
        width = int(rng.integers(2, 6))
        chunk = rng.integers(1, VOCAB, (batch, width))
        keep = rng.integers(1, width + 1, batch)  # row b keeps its first keep[b] tokens
        start = cache.length
        logits = cache.forward(torch.as_tensor(chunk), np.ones((batch, width), bool))
        with torch.inference_mode():
            for b in range(batch):
                fresh = target(torch.tensor([seqs[b] + chunk[b, : keep[b]].tolist()])).logits[0, -1]
                torch.testing.assert_close(logits[b, keep[b] - 1], fresh, atol=1e-4, rtol=0)
        cache.invalidate(start, keep)
        for b in range(batch):
            seqs[b] += chunk[b, : keep[b]].tolist()
        longest = max(longest, cache.length)
    assert min(len(s) for s in seqs) > 3 * WINDOW  # well past the window
    if arch == "mistral":  # every layer slides: slots no window reaches are dropped
        assert longest <= 4 * WINDOW
        assert cache.length < min(len(s) for s in seqs) - WINDOW


def test_chunked_attention_is_refused():
    import transformers as tf

    cfg = tf.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_chunk_size=8,
        num_local_experts=1,
        moe_layers=[],
        no_rope_layers=[1, 0],
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    assert "chunked_attention" in cfg.layer_types
    torch.manual_seed(0)
    target = tf.Llama4ForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"target: chunked-attention layers \('chunked_attention' in config"):
        specjax.speculative_generate(target, "ngram", torch.tensor([[5, 6, 7]]), max_new_tokens=4)
