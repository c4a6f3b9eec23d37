"""Sampling with logits processors stays exact: a chi-square test of the joint law of three tokens.

The pattern of ``test_generate_stats.py`` (its pair, V = 8, N = 20,000 identical
rows with independent keys, the fixed schedule): the empirical joint law of the
first three generated tokens at T = 0.7 with a processor active is compared
with the target's exact law, enumerated with the target model and
transformers' own processor classes applied in ``generate``'s order to each
prefix (``prompt + t1 + ...``), independently of the loop. With G = 2 the
first step drafts two tokens, so the target's and the drafter's second
positions are processed on a prefix holding a draft token.

The negative control runs the same sampling with the processors given the
wrong prefix (each position processed as if its prefix were the committed
tokens only, the draft tokens before it left out, on both sides): the test
must reject it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_generate_stats import V, chi_square_p, eagle_head_for, sample_counts
from transformers.generation import logits_process as lp

import specjax

pytestmark = pytest.mark.slow

PROMPT = [3, 1, 3, 1, 3]  # few distinct tokens: a penalty on the generated ones shows
LENGTH = 3


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    # as test_generate_stats.py: peaked distributions, a draft accepted about 60% of the time
    target = tiny_lm("llama", vocab_size=V, layers=2, hidden=16, seed=0, init_range=0.3)
    return target, perturbed_copy(target, noise=0.5, seed=5)


def exact_joint(target, processors: list[Any], warpers: list[Any], prompt=PROMPT) -> np.ndarray:
    """f64[V] * LENGTH: the law of every continuation, each prefix processed as generate processes it."""
    joint = np.ones((1,), np.float64)
    prefixes: list[tuple[int, ...]] = [()]
    with torch.inference_mode():
        for _ in range(LENGTH):
            ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
            scores = target(ids).logits[:, -1].float()
            for p in processors + warpers:
                scores = p(ids, scores)
            probs = torch.softmax(scores.double(), dim=-1).numpy()
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = [(*p, v) for p in prefixes for v in range(V)]
    return joint.reshape((V,) * LENGTH)


def quoting_prompt(target) -> list[int]:
    """PROMPT, its greedy continuation, then PROMPT again: the n-gram drafter then proposes that continuation."""
    with torch.inference_mode():
        cont = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=4, pad_token_id=0)
    return cont[0].tolist() + PROMPT


T, TOP_K = 0.7, 6
WARPERS = [lp.TemperatureLogitsWarper(T), lp.TopKLogitsWarper(TOP_K)]

CASES = [
    # (options, transformers' processors before the warpers, after them, drafter)
    pytest.param(dict(repetition_penalty=2.0), [lp.RepetitionPenaltyLogitsProcessor(2.0)], [], "model", id="penalty"),
    pytest.param(
        dict(no_repeat_ngram_size=2, bad_words_ids=[[0, 2]]),
        [lp.NoRepeatNGramLogitsProcessor(2), lp.NoBadWordsLogitsProcessor([[0, 2]])],
        [],
        "model",
        id="ngram-bans",
    ),
    pytest.param(dict(min_p=0.2), [], [lp.MinPLogitsWarper(0.2)], "model", id="min_p-after-top-k"),
    pytest.param(
        dict(repetition_penalty=2.0), [lp.RepetitionPenaltyLogitsProcessor(2.0)], [], "ngram", id="penalty-ngram"
    ),
    pytest.param(
        dict(repetition_penalty=2.0), [lp.RepetitionPenaltyLogitsProcessor(2.0)], [], "eagle", id="penalty-eagle"
    ),
    pytest.param(
        dict(repetition_penalty=2.0, sampler=specjax.rejection_sample),
        [lp.RepetitionPenaltyLogitsProcessor(2.0)],
        [],
        "model",
        id="penalty-rejection_sample-callable",
    ),
]


def drafter_for(kind: str, target, draft) -> Any:
    from specjax.drafters import EagleDrafter, NgramDrafter

    if kind == "eagle":
        return EagleDrafter(eagle_head_for(target))
    return draft if kind == "model" else NgramDrafter(min_n=1)


@pytest.mark.parametrize(("options", "processors", "post", "kind"), CASES)
def test_joint_law_with_processors_matches_the_target(options, processors, post, kind, pair):
    target, draft = pair
    prompt = quoting_prompt(target) if kind == "ngram" else PROMPT
    counts = sample_counts(
        target,
        drafter_for(kind, target, draft),
        length=LENGTH,
        num_draft_tokens=2,
        temperature=T,
        top_k=TOP_K,
        prompt=prompt,
        **options,
    )
    expected = exact_joint(target, processors, WARPERS + post, prompt)
    plain = exact_joint(target, [], WARPERS, prompt)
    assert np.abs(expected - plain).sum() > 0.1, "the processor barely changes the law: the case tests nothing"
    p = chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_processors_on_the_committed_prefix_only(pair, monkeypatch):
    """Each position processed with the committed tokens only (the draft tokens before it left out, on both
    sides): caught. Without top-k, so every continuation stays possible and the chi-square test itself, not an
    impossible token, must catch it."""
    from specjax.generate.processors import LoopProcessors

    apply = LoopProcessors._apply

    def wrong_prefix(self, scores, rows, lengths, committed):
        return apply(self, scores, rows, committed, committed)

    monkeypatch.setattr(LoopProcessors, "_apply", wrong_prefix)
    target, draft = pair
    counts = sample_counts(
        target, draft, length=LENGTH, num_draft_tokens=2, temperature=T, prompt=PROMPT, repetition_penalty=2.0
    )
    expected = exact_joint(target, [lp.RepetitionPenaltyLogitsProcessor(2.0)], [lp.TemperatureLogitsWarper(T)])
    assert expected.min() > 0
    p = chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p < 1e-6, f"the wrong prefix was not caught: p = {p:.2e}"
