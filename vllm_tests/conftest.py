"""Shared set-up for the tests against a running vLLM (run by .venv-vllm's pytest: `make test-vllm`).

vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
``specjax.plugin.vllm.calls()`` sees the steps it ran. The checkpoints are tiny
random Llama models written by the tests; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
os.environ.setdefault("VLLM_PLUGINS", "specjax")  # only specjax's general plugin
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest

VOCAB = 64
# No chunked prefill: vLLM 0.32 on CPU crashes when it discards the token of a partly prefilled
# seeded request (a CPU torch.Generator has no offset to rewind).
LLM_ARGS = dict(
    skip_tokenizer_init=True,
    dtype="float32",
    max_model_len=256,
    enforce_eager=True,
    seed=0,
    enable_chunked_prefill=False,
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def write_llama(path: Path, layers: int, seed: int) -> Path:
    """A tiny random Llama checkpoint (V = 64, head size 32, which vLLM's CPU attention supports)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=VOCAB + 10,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "target": write_llama(root / "target", layers=2, seed=0),
        "draft": write_llama(root / "draft", layers=1, seed=1),
    }


@contextlib.contextmanager
def running_llm(model: Path, **kwargs) -> Iterator:
    """An in-process vLLM engine, shut down on exit."""
    from vllm import LLM

    llm = LLM(model=str(model), **LLM_ARGS, **kwargs)
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def prompts(*token_lists: list[int]) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(t)) for t in token_lists]


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


# Prompts of different lengths and repetitiveness: the n-gram proposer finds drafts
# of different lengths in them, and none in the last one at first (ragged batches,
# rows without drafts).
GREEDY_PROMPTS = (
    [1, 2, 3, 4, 5] * 3 + [1, 2],
    list(range(40)) * 2,
    [50, 51, 52, 50, 51, 52, 50],
    [7, 9, 11, 13, 17, 19, 23],
)


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of equal laws over token ids (rare ids pooled); returns the p-value."""
    import numpy as np
    from scipy.stats import chi2_contingency

    ca = np.bincount(a, minlength=VOCAB)
    cb = np.bincount(b, minlength=VOCAB)
    expected = (ca + cb) / 2
    common = expected >= 10
    table = np.stack([np.append(ca[common], ca[~common].sum()), np.append(cb[common], cb[~common].sum())])
    table = table[:, table.sum(axis=0) > 0]
    return float(chi2_contingency(table)[1])


def sampled_columns(outputs, positions: tuple[int, ...]) -> dict[int, list[int]]:
    return {i: [list(o.outputs[0].token_ids)[i] for o in outputs] for i in positions}
