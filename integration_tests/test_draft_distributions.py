"""Draft distributions the loop must refuse rather than verify into a silent wrong answer (issue 58).

The loop runs the acceptance step without value checks, so it checks what a
drafter hands it on sampled steps (where ``q`` enters the test): draft logits
with a NaN or +inf (their softmax is NaN: a third-party drafter's with a +inf
logit had every token accepted, acceptance 1.00 and the target's law lost), a
row of only -inf, a token outside the logits' width or at -inf (``q(x) = 0``
passes any token the target allows: a width-7 logits row let token 7 pass
every time), logits given as nested lists, and NaN hindsight counts. Each is
a :class:`PluginOutputError` naming the drafter; the same drafter without the
fault runs (negative control). A draft *model* whose logits hold +inf is
refused the same way.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax
from specjax.drafters import Proposal
from specjax.generate.checks import PluginOutputError

V = 96
PROMPT = torch.tensor([[5, 17, 42, 8, 23], [7, 7, 3, 9, 11]])


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm("llama", vocab_size=V, layers=2, seed=0)


class Sampled:
    """Proposes token 3 then 7 with logits that put mass on them; ``fault`` breaks one thing."""

    name = "sampled-drafter"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self, fault: str = "ok", array: str = "torch") -> None:
        self.fault, self.array = fault, array

    def start(self, setup) -> None:
        pass

    def propose(self, request) -> Proposal:
        b = len(request.contexts)
        k = np.minimum(request.max_tokens, 2).astype(np.int64)
        tokens = np.tile(np.array([3, 7], np.int64), (b, 1))
        logits = np.zeros((2, b, V), np.float32)
        hindsight = None
        if self.fault == "nan":
            logits[0, b - 1, 11] = np.nan
        elif self.fault == "+inf":
            logits[1, 0, 50] = np.inf
        elif self.fault == "all -inf":
            logits[0, 0, :] = -np.inf
        elif self.fault == "narrow":
            logits = logits[:, :, :7]  # width 7: token 7 lies outside
        elif self.fault == "-inf at token":
            logits[1, 0, 7] = -np.inf
        elif self.fault == "nan hindsight":
            hindsight = (np.full(b, np.nan), np.ones(b))
        convert = {"torch": lambda a: torch.from_numpy(a.copy()), "numpy": np.copy, "jax": jnp.asarray}[self.array]
        arrays = [convert(a) for a in logits]
        if self.fault == "nested lists":
            arrays = [a.tolist() for a in logits]
        return Proposal(tokens, k, tuple(arrays), hindsight=hindsight)

    def commit(self, info) -> None:
        pass

    def select_rows(self, rows) -> None:
        pass


FAULTS = [
    ("nan", r"drafter 'sampled-drafter' returned draft logits holding NaN at position 0, row 1"),
    ("+inf", r"drafter 'sampled-drafter' returned draft logits holding \+inf at position 1, row 0"),
    ("all -inf", r"drafter 'sampled-drafter' returned draft logits holding only -inf at position 0, row 0"),
    ("narrow", r"drafter 'sampled-drafter' proposed token 7 at row 0, position 1, outside the logits' width 7"),
    ("-inf at token", r"drafter 'sampled-drafter' proposed token 7 at row 0, position 1, whose logit is -inf"),
    ("nested lists", r"drafter 'sampled-drafter' returned draft logits at position 0 as list, expected an array"),
    (
        "nan hindsight",
        r"drafter 'sampled-drafter' returned hindsight of shapes \(2,\) and \(2,\), expected two integer",
    ),
]


@pytest.mark.parametrize("array", ["torch", "numpy", "jax"])
@pytest.mark.parametrize(("fault", "message"), FAULTS, ids=[f for f, _ in FAULTS])
def test_broken_draft_distribution_is_refused_naming_the_drafter(target, fault, message, array):
    if fault == "nested lists" and array != "torch":
        pytest.skip("one case is enough")
    kw = dict(max_new_tokens=6, num_draft_tokens=2, adaptive=False, temperature=1.0, seed=0)
    with pytest.raises(PluginOutputError, match=message):
        specjax.speculative_generate(target, Sampled(fault, array), PROMPT, **kw)
    # negative control: the same drafter without the fault runs to the end
    out = specjax.speculative_generate(target, Sampled("ok", array), PROMPT, **kw)
    assert out.num_new_tokens.tolist() == [6, 6]


def test_greedy_steps_do_not_read_draft_logits(target):
    """Greedy verification ignores q (the output is the target's argmax whatever q): no refusal there."""
    out = specjax.speculative_generate(
        target, Sampled("nan"), PROMPT, max_new_tokens=6, num_draft_tokens=2, adaptive=False, temperature=0.0
    )
    ref = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=6)
    assert torch.equal(out.sequences, ref)


def test_draft_model_with_inf_logits_is_refused_naming_the_drafter(target, perturbed_copy):
    draft = perturbed_copy(target, noise=0.3, seed=1)
    kw = dict(max_new_tokens=6, num_draft_tokens=2, adaptive=False, temperature=1.0, seed=0)
    specjax.speculative_generate(target, draft, PROMPT, **kw)  # negative control

    def plus_inf(module, args, output):
        output.logits[..., 13] = float("inf")
        return output

    handle = draft.register_forward_hook(plus_inf)
    try:
        # refused by the drafter itself, before it draws from them (ValueError naming the draft model)
        with pytest.raises(ValueError, match=r"draft model LlamaForCausalLM \(drafter 'model:LlamaForCausalLM'\)"):
            specjax.speculative_generate(target, draft, PROMPT, **kw)
    finally:
        handle.remove()
