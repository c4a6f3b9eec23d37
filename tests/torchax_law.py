"""The sampled law of the JAX path (torchax): draws, the target's exact law, chi-square.

Shared by tests/test_torchax_law.py (JAX's CPU backend) and scripts/tpu_loop.py
(on the chip; run with ``PYTHONPATH=src:tests``). N copies of one prompt go
through ``speculative_generate`` as one batch (each row its own key: N
independent draws of the first ``length`` new tokens); their joint counts are
compared with the exact law enumerated from the model's processed distributions
on the CPU (torch, float64 softmax of ``logits / T``):

    P(t1, t2, ...) = p(t1 | prompt) · p(t2 | prompt, t1) · ...

The pair is tiny (V = 8) and peaked (initialisation 0.3); the draft is the
target with noise, so that both the acceptance and the residual branch carry
weight while the target's and the draft's laws stay far apart.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
TEMPERATURE = 0.7
LENGTH = 3  # new tokens per row: with G = 2 the first step tests two drafted tokens
DRAFT_TOKENS = 2
ALPHA = 1e-3  # the target's law is rejected below this p-value (the house threshold) ...
POWER = 1e-6  # ... and a negative control must fall below this one


def law_pair() -> tuple[Any, Any]:
    """``(target, draft)`` on the CPU: a tiny random Llama (V = 8, peaked) and a noisy copy of it (accepted
    often, not always: both the acceptance and the residual branch carry weight)."""
    from torchax_models import perturbed
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.3,
        eos_token_id=None,  # every row runs to `length` tokens
    )
    target = LlamaForCausalLM(cfg).eval()
    target.generation_config.eos_token_id = None
    return target, perturbed(target, 0.1, seed=5)


def exact_law(model: Any, length: int, temperature: float = TEMPERATURE, prompt: list[int] = PROMPT) -> np.ndarray:
    """f64[V ** length]: the model's probability of every continuation of ``prompt`` (row-major in the tokens)."""
    vocab = int(model.config.vocab_size)
    joint = np.ones(1, np.float64)
    prefixes: list[list[int]] = [[]]
    with torch.inference_mode():
        for _ in range(length):
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1].float()
            probs = torch.softmax(logits.double() / temperature, dim=-1).numpy()
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = [[*p, v] for p in prefixes for v in range(vocab)]
    return joint


def sample_law(
    target: Any, draft: Any, rows: int, length: int, num_draft_tokens: int, *, seed: int = 5, **kwargs: Any
) -> tuple[np.ndarray, Any]:
    """``(counts i64[V ** length], stats)``: the first ``length`` new tokens of ``rows`` copies of the prompt
    at ``TEMPERATURE``, through ``speculative_generate`` (models on torchax's jax device: the JAX path)."""
    from specjax.generate import speculative_generate

    out = speculative_generate(
        target,
        draft,
        torch.tensor([PROMPT] * rows),
        max_new_tokens=length,
        num_draft_tokens=num_draft_tokens,
        temperature=TEMPERATURE,
        seed=seed,
        **kwargs,
    )
    new = out.sequences[:, len(PROMPT) :].numpy()
    assert new.shape == (rows, length) and out.num_new_tokens.tolist() == [length] * rows
    vocab = int(target.config.vocab_size)
    return np.bincount(np.ravel_multi_index(tuple(new.T), (vocab,) * length), minlength=vocab**length), out.stats


def misstated_first_tokens(target: Any, draft: Any, rows: int, drawn_at: float, seed: int = 5) -> np.ndarray:
    """Counts i64[V] of the first token of ``rows`` copies of the prompt from one step of the JAX path's pieces
    with the draft's q mis-stated: the draft token is drawn at temperature ``drawn_at`` while the acceptance
    step is told it came from the draft's distribution at ``TEMPERATURE`` (the bug class of transformers
    #32867). A negative control: at ``drawn_at != TEMPERATURE`` its law is not the target's.

    The step is the loop's (:func:`specjax.generate.jax_loop.draft_and_verify`) without caches carried over:
    the draft's forward over the prompt, one draw (:func:`specjax.kernels.steps.draft_draw`), the target's
    forward over the prompt and the draft token, :func:`specjax.kernels.steps.verify_step`.
    """
    import jax
    import jax.numpy as jnp

    from specjax.generate.jax_model import jax_model
    from specjax.kernels import steps
    from specjax.kernels.types import SamplingParams

    t, d = jax_model("target", target), jax_model("draft", draft)
    vocab = int(target.config.vocab_size)
    tokens = jnp.asarray([PROMPT] * rows, jnp.int32)
    keys = jax.random.split(jax.random.key(seed), rows)
    drawn = SamplingParams(jnp.full(rows, drawn_at, jnp.float32))
    stated = SamplingParams(jnp.full(rows, TEMPERATURE, jnp.float32))

    @jax.jit
    def step(t_weights: Any, d_weights: Any) -> jax.Array:
        start, width = jnp.zeros(rows, jnp.int32), len(PROMPT) + 1
        q, _ = d.forward(d_weights, d.init_cache(rows, width), tokens, start, 1)
        x = steps.draft_draw(q[:, -1], keys, 0, 1, drawn, vocab=vocab)[:, None]
        logits, _ = t.forward(t_weights, t.init_cache(rows, width), jnp.concatenate([tokens, x], 1), start, 2)
        return steps.verify_step(x, (q[:, -1],), logits, keys, 0, stated, jnp.ones(rows, jnp.int32)).tokens[:, 0]

    first = np.asarray(jax.device_get(step(t.weights, d.weights)))
    return np.bincount(first, minlength=vocab)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's chi-square of ``counts`` against ``probs`` (cells expecting fewer than 5 pooled).

    A draw of a zero-probability cell gives 0 (pooling would hide it). The survival function is JAX's
    ``gammaincc`` (scipy may be missing on an accelerator host): ``chi2.sf(x, k) = Q(k / 2, x / 2)``.
    """
    from jax.scipy.special import gammaincc

    obs, prob = counts.astype(np.float64), np.asarray(probs, np.float64)
    if obs[prob <= 0].any():
        return 0.0
    expected = prob * obs.sum()
    big = expected >= 5
    obs = np.append(obs[big], obs[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    obs, expected = obs[keep], expected[keep]
    stat = float(((obs - expected) ** 2 / expected).sum())
    dof = len(obs) - 1
    return float(gammaincc(dof / 2, stat / 2)) if dof > 0 else float("nan")
