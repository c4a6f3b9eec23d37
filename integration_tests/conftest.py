"""Shared fixtures for the integration tests: tiny transformers models built from configs.

Nothing is downloaded: every model is built from a small config with a fixed
seed, so a test run is deterministic and offline. The fixtures return *factories*
(plain functions), so tests can build as many variants as they need:

* ``tiny_lm(arch, *, vocab_size=96, layers=2, hidden=32, seed=0, init_range=0.1, **config)``
  builds an eval-mode causal LM; ``arch`` is one of :data:`ARCHS`.
* ``perturbed_copy(model, *, noise, seed=0)`` returns a copy whose floating
  weights got Gaussian noise of relative size ``noise`` — a draft that agrees
  with the model often but not always.
* ``left_padded(lengths, *, vocab_size, pad_token_id=0, seed=0)`` returns
  ``(input_ids i64[B, max(lengths)], attention_mask i64[B, max(lengths)])``,
  left-padded, with real tokens drawn from ``[1, vocab_size)``.
* ``char_tokenizer``: a character-level tokenizer over
  printable ASCII for models of vocabulary 96 (id 0 = ``<pad>``, id ``i`` =
  ``chr(31 + i)``): stop strings span several tokens, as with real tokenizers.

Every model has ``pad_token_id = 0`` and no BOS/EOS id, so generation runs to
``max_new_tokens`` unless a test passes ``eos_token_id``. Models sharing a
vocabulary size share the JAX compilations of the loop, which keeps runs short.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

ARCHS = ("llama", "gpt2", "qwen2", "mistral")


def _config(arch: str, vocab_size: int, layers: int, hidden: int, init_range: float, **extra: Any) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        initializer_range=init_range,
        tie_word_embeddings=False,
    )
    if arch == "gpt2":
        cfg = dict(
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=512,
            n_inner=2 * hidden,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cfg.update(common, tie_word_embeddings=True)
        cfg.update(extra)
        return tf.GPT2Config(**cfg)
    cfg = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    cfg.update(common)
    if arch == "mistral":
        cfg["sliding_window"] = None
    cfg.update(extra)
    classes = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
    return classes[arch](**cfg)


def build_tiny_lm(
    arch: str,
    *,
    vocab_size: int = 96,
    layers: int = 2,
    hidden: int = 32,
    seed: int = 0,
    init_range: float = 0.1,
    **config: Any,
) -> Any:
    """An eval-mode causal LM of architecture ``arch`` with random weights from ``seed``."""
    import transformers as tf

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    cfg = _config(arch, vocab_size, layers, hidden, init_range, **config)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "qwen2": tf.Qwen2ForCausalLM,
        "mistral": tf.MistralForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model


def perturb(model: Any, *, noise: float, seed: int = 0) -> Any:
    """A deep copy of ``model`` with ``w + noise * std(w) * N(0, 1)`` on every floating weight."""
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            if param.is_floating_point() and param.numel() > 1:
                scale = float(param.std()) if float(param.std()) > 0 else 1.0
                param.add_(noise * scale * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return twin.eval()


def make_left_padded(
    lengths: list[int] | tuple[int, ...], *, vocab_size: int, pad_token_id: int = 0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths; real tokens avoid ``pad_token_id``."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for b, n in enumerate(lengths):
        tokens = torch.randint(1, vocab_size, (n,), generator=gen)
        tokens[tokens == pad_token_id] = 1
        ids[b, width - n :] = tokens
        mask[b, width - n :] = 1
    return ids, mask


def make_char_tokenizer() -> Any:
    """A fast tokenizer with one token per printable ASCII character (module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>"] + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", unk_token="<pad>")


@pytest.fixture(scope="session")
def char_tokenizer() -> Any:
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_lm() -> Callable[..., Any]:
    return build_tiny_lm


@pytest.fixture(scope="session")
def perturbed_copy() -> Callable[..., Any]:
    return perturb


@pytest.fixture(scope="session")
def left_padded() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    return make_left_padded
