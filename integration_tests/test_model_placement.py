"""Models whose weights are not resident: accelerate-offloaded, or never loaded (``meta``).

transformers' ``generate`` runs an offloaded model (accelerate's hooks bring the
weights in for each forward); the loop reads the weights where they live, so it
refuses such a model by name with what to do, where it used to blame the
devices ("move both models to one device") or fail inside torch.
"""

from __future__ import annotations

import copy

import pytest
import torch

import specjax

PROMPT = torch.tensor([[5, 17, 42, 8, 23]])


def offloaded(model):
    from accelerate import cpu_offload

    twin = copy.deepcopy(model)
    cpu_offload(twin, execution_device=torch.device("cpu"))
    return twin


def never_loaded(model):
    from accelerate import init_empty_weights

    with init_empty_weights():
        return type(model)(model.config).eval()


@pytest.fixture(scope="module")
def pair(tiny_lm):
    return tiny_lm("llama", seed=0), tiny_lm("llama", seed=1)


def test_an_offloaded_target_runs_in_transformers_generate(pair):
    """The premise: the offloaded copy is a working model (its weights sit on ``meta`` between forwards)."""
    target, _ = pair
    twin = offloaded(target)
    assert all(p.is_meta for p in twin.parameters())
    plain = target.generate(PROMPT, do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert torch.equal(twin.generate(PROMPT, do_sample=False, max_new_tokens=4, pad_token_id=0), plain)


OFFLOADED = r"its weights are offloaded by accelerate .*load the model without offloading"
NOT_LOADED = r"its weights are not loaded .*'meta' device.*load them first"


@pytest.mark.parametrize(
    ("which", "make", "drafter", "match"),
    [
        ("target", offloaded, "model", "target: " + OFFLOADED),
        ("target", offloaded, "ngram", "target: " + OFFLOADED),
        ("draft", offloaded, "model", "draft: " + OFFLOADED),
        ("target", never_loaded, "model", "target: " + NOT_LOADED),
        ("target", never_loaded, "ngram", "target: " + NOT_LOADED),
        ("draft", never_loaded, "model", "draft: " + NOT_LOADED),
    ],
    ids=[
        "target-offloaded-model",
        "target-offloaded-ngram",
        "draft-offloaded",
        "target-never_loaded-model",
        "target-never_loaded-ngram",
        "draft-never_loaded",
    ],
)
def test_weights_off_the_device_are_refused_by_name(pair, which, make, drafter, match):
    target, draft = pair
    if which == "target":
        target = make(target)
    else:
        draft = make(draft)
    with pytest.raises(ValueError, match=match):
        specjax.speculative_generate(target, draft if drafter == "model" else "ngram", PROMPT, max_new_tokens=4)
