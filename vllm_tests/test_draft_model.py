"""specjax's kernel inside vLLM's draft-model speculative decoding, with the draft's probabilities.

``draft_sample_method="probabilistic"`` makes vLLM's draft model sample its
tokens and pass their distributions to the acceptance step (``draft_probs``),
so sampled requests run specjax's given-probabilities path; greedy requests get
greedy (point-mass) drafts. (vLLM samples probabilistic drafts from its global
RNG, not from the request's generator, so a seeded request's tokens are not
reproducible in this mode, with vLLM's step or specjax's; the n-gram module
tests seeds.)
"""

from __future__ import annotations

import pytest
from conftest import GREEDY_PROMPTS, chi_square_p, prompts, running_llm, sampled_columns, token_ids

import specjax.plugin.vllm as plugin

LAW_PROMPT = [1, 2, 3, 4, 5] * 3
LAW_REQUESTS = 2000
LAW_POSITIONS = (1, 2)
ALPHA = 1e-3


def law_params(temperature: float = 0.7) -> list:
    from vllm import SamplingParams

    return [
        SamplingParams(max_tokens=3, temperature=temperature, top_k=50, top_p=0.95, seed=i, ignore_eos=True)
        for i in range(LAW_REQUESTS)
    ]


def greedy(max_tokens: int = 16):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(checkpoints):
    with running_llm(checkpoints["target"]) as llm:
        return {
            "greedy": token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy())),
            "law": sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params()), LAW_POSITIONS),
        }


@pytest.fixture(scope="module")
def llm(reference, checkpoints):
    spec = {
        "method": "draft_model",
        "model": str(checkpoints["draft"]),
        "num_speculative_tokens": 3,
        "draft_sample_method": "probabilistic",
    }
    with running_llm(checkpoints["target"], speculative_config=spec) as engine:
        yield engine


def test_greedy_outputs_identical_to_no_speculation(llm, reference):
    calls = plugin.calls("point_mass")
    assert token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy())) == reference["greedy"]
    assert plugin.calls("point_mass") > calls


def test_sampled_tokens_follow_the_law_of_vllm_without_speculation(llm, reference):
    """Chi-square with the draft's probabilities given; the negative control applies the temperature twice."""
    calls, fallbacks = plugin.calls("draft_probs"), plugin.fallbacks()
    law = sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params()), LAW_POSITIONS)
    assert plugin.calls("draft_probs") > calls, "no step had the draft's probabilities"
    assert plugin.fallbacks() == fallbacks, "some steps fell back to vLLM's function"
    control = sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params(0.7 * 0.7)), LAW_POSITIONS)
    p_values = {i: chi_square_p(reference["law"][i], law[i]) for i in LAW_POSITIONS}
    control_p = {i: chi_square_p(reference["law"][i], control[i]) for i in LAW_POSITIONS}
    print("draft model: p-values", p_values, "control", control_p)
    assert all(p > ALPHA for p in p_values.values()), p_values
    assert all(p < ALPHA for p in control_p.values()), f"the test cannot see a doubled temperature: {control_p}"
