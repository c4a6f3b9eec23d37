"""speculative_generate with models on torchax's jax device (issue 55), on JAX's CPU backend.

Each step is one jitted program (draft, the target's forward, the acceptance
step: :mod:`specjax.generate.jax_loop`). References: the target's own greedy
decoding (transformers' ``generate`` on the torch model) and the CPU path of
the same call (``adaptive=False``: the same draft length every step, so the same
keys meet the same distributions and sampled outputs agree draw for draw).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchax_models import LOOP_G as G
from torchax_models import LOOP_MAX_NEW as MAX_NEW
from torchax_models import loop_models, make_drafter, on_jax, ragged_prompts, target_greedy

from specjax.drafters import NgramDrafter, Proposal
from specjax.generate import speculative_generate
from specjax.generate.checks import PluginOutputError
from specjax.generate.jax_loop import greedy_decode

# torchax registers torch's "jax" device in this process, which breaks accelerate's
# offloading elsewhere: these run in their own pytest session (make test-torchax).
pytestmark = pytest.mark.torchax


@pytest.fixture(scope="module")
def models():
    return loop_models()


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts()


def test_target_only_greedy_on_jax_equals_generate(models, prompts):
    """The reference decoding of scripts/tpu_loop.py: the same jitted forward, one token a step."""
    cpu, jx = models
    ids, mask = prompts
    assert greedy_decode(jx["target"], ids, mask, MAX_NEW).tolist() == target_greedy(cpu["target"], ids, mask, MAX_NEW)


@pytest.mark.parametrize("draft, g", [("close", G), ("far", G), ("ngram", G), ("hybrid", G), ("close", 1)])
def test_greedy_equals_the_targets_own_greedy_decoding(models, prompts, draft, g):
    cpu, jx = models
    ids, mask = prompts
    want = target_greedy(cpu["target"], ids, mask, MAX_NEW)
    drafter = make_drafter(draft, jx)
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=g, adaptive=False)  # every step drafts: the schedule's own
    out = speculative_generate(jx["target"], drafter, ids, mask, **kw)  # steps are tested below
    assert out.sequences[:, ids.shape[1] :].tolist() == want
    assert out.stats.adapter_copies == 0
    assert out.stats.draft_tokens_proposed > 0
    if draft in ("close", "hybrid"):  # both outcomes of the test happen
        assert 0 < out.stats.acceptance_rate < 1


@pytest.mark.parametrize("draft", ["close", "ngram", "hybrid"])
def test_sampled_outputs_equal_the_cpu_paths_draw_for_draw(models, prompts, draft):
    """The same keys, step numbers and draw purposes as the CPU loop: the same tokens (so the same law)."""
    cpu, jx = models
    ids, mask = prompts
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=G, temperature=1.0, top_k=20, top_p=0.9, seed=11)
    d_cpu, d_jax = make_drafter(draft, cpu), make_drafter(draft, jx)
    want = speculative_generate(cpu["target"], d_cpu, ids, mask, adaptive=False, **kw)
    got = speculative_generate(jx["target"], d_jax, ids, mask, adaptive=False, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.stats.draft_tokens_accepted == want.stats.draft_tokens_accepted
    assert got.stats.adapter_copies == 0


def test_eos_ends_a_row_as_on_the_cpu_path(models, prompts):
    cpu, jx = models
    ids, mask = prompts
    greedy = target_greedy(cpu["target"], ids, mask, MAX_NEW)
    eos = greedy[0][5]  # row 0 ends at its 6th token (other rows wherever it appears)
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=G, eos_token_id=eos, pad_token_id=0)
    want = speculative_generate(cpu["target"], cpu["close"], ids, mask, adaptive=False, **kw)
    got = speculative_generate(jx["target"], jx["close"], ids, mask, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.num_new_tokens.tolist() == want.num_new_tokens.tolist()
    assert got.num_new_tokens[0] == 6


def test_streaming_callback_sees_every_token(models, prompts):
    _, jx = models
    ids, mask = prompts
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    out = speculative_generate(
        jx["target"],
        jx["close"],
        ids,
        mask,
        max_new_tokens=MAX_NEW,
        num_draft_tokens=G,
        on_tokens=lambda b, t: seen[b].extend(t),
    )
    assert [seen[b] for b in range(3)] == out.sequences[:, ids.shape[1] :].tolist()


class _HiddenDrafter(NgramDrafter):
    needs_target_hidden = True


class _LogitsDrafter(NgramDrafter):
    """Proposes token 0 with logits: a sampled host proposal, which the JAX path does not take."""

    def propose(self, request):
        b = len(request.contexts)
        logits = (np.zeros((b, 256), np.float32),)
        return Proposal(np.zeros((b, 1), np.int32), np.minimum(request.max_tokens, 1), logits)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(sampler="numpy"), ValueError, "sampler: the JAX path .* built-in sampler"),
        (dict(return_state=True), ValueError, "return_state: the JAX path"),
        (
            dict(draft=_HiddenDrafter()),
            ValueError,
            "draft: the JAX path .* model drafter, the eagle head, lookup drafters",
        ),
        (dict(draft=_LogitsDrafter()), PluginOutputError, "proposed tokens with draft logits; the JAX path takes"),
        (dict(repetition_penalty=1.2), ValueError, "logits_processor: not supported yet on the JAX path"),
        (
            dict(stopping_criteria=[lambda i, s: torch.zeros(i.shape[0], dtype=torch.bool)]),
            ValueError,
            "stopping_criteria: not supported yet on the JAX path",
        ),
        (dict(output_scores=True), ValueError, "output_scores: not supported yet on the JAX path"),
    ],
    ids=["plugin-sampler", "return-state", "hidden-state-drafter", "host-logits", "processors", "criteria", "scores"],
)
def test_what_the_jax_path_does_not_run_is_refused(models, prompts, kwargs, error, match):
    _, jx = models
    ids, mask = prompts
    draft = kwargs.pop("draft", jx["close"])
    with pytest.raises(error, match=match):
        speculative_generate(jx["target"], draft, ids, mask, max_new_tokens=4, **kwargs)


def test_ids_are_read_once_from_a_torchax_tensor(models, prompts):
    """Prompts may come as torchax tensors too (read to the host once: they are a few integers)."""
    _, jx = models
    ids, mask = prompts
    want = speculative_generate(jx["target"], jx["close"], ids, mask, max_new_tokens=8, num_draft_tokens=G)
    got = speculative_generate(
        jx["target"], jx["close"], on_jax(ids), on_jax(mask), max_new_tokens=8, num_draft_tokens=G
    )
    np.testing.assert_array_equal(got.sequences.numpy(), want.sequences.numpy())


# The device-resident loop (``jax_loop.resident_steps``): the model, ngram and hybrid drafters' steps in
# one program, the host reading only the int32 tokens and per-step counts. Reference: the per-step path of
# the same call (``per_step_loop``; for ngram and hybrid, the host's n-gram index), whose steps it must
# repeat exactly: the same tokens, stats and streamed chunks. The prompts' third row (11 12 11 12) has an
# n-gram match from the first step, the other two have none there: the hybrid's first step proposes from
# both of its drafters.
