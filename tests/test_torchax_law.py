"""The JAX path's law at T = 0.7 (models on torchax's jax device; here JAX's CPU backend).

8192 copies of one prompt through ``speculative_generate``: the first three new
tokens (G = 2, so the first step tests two drafted tokens) must follow the
target's exact law, enumerated on the CPU from its processed distributions
(chi-square, p > 1e-3; tests/torchax_law.py, shared with scripts/tpu_loop.py).

Negative controls, on the same number of rows (each must give p < 1e-6):

* the same counts against the draft's law: the test tells the two laws apart;
* one step of the JAX path's pieces with the draft's q mis-stated (the draft
  token drawn at T = 1, the acceptance step told T = 0.7): its first tokens
  against the target's law. The same step told the truth passes, so the
  control fails for the mis-statement alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from torchax_law import (
    ALPHA,
    DRAFT_TOKENS,
    LENGTH,
    POWER,
    PROMPT,
    TEMPERATURE,
    VOCAB,
    chi_square_p,
    exact_law,
    law_pair,
    misstated_first_tokens,
    sample_law,
)
from torchax_models import on_jax

# statistical: ~10 s of draws and compilations on a loaded 2-core machine; torchax: its own session
pytestmark = [pytest.mark.slow, pytest.mark.torchax]

ROWS = 8192


@pytest.fixture(scope="module")
def pair():
    """CPU target and draft, and their jax copies."""
    target, draft = law_pair()
    return target, draft, on_jax(target), on_jax(draft)


def test_three_tokens_follow_the_targets_law_and_not_the_drafts(pair):
    target, draft, target_j, draft_j = pair
    counts, stats = sample_law(target_j, draft_j, ROWS, LENGTH, DRAFT_TOKENS, adaptive=False)  # drafted steps
    assert stats.adapter_copies == 0
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # both the acceptance and the residual branch carry weight
    p_target = chi_square_p(counts, exact_law(target, LENGTH))
    p_draft = chi_square_p(counts, exact_law(draft, LENGTH))
    assert p_target > ALPHA, f"against the target's law: p = {p_target:.2e}"
    assert p_draft < POWER, f"the negative control (the draft's law) was not rejected: p = {p_draft:.2e}"


def test_plain_steps_follow_the_targets_law(pair):
    """The device-resident schedule's plain steps (``draft_cost_ratio(inf)``: the three tokens from three plain
    steps) sample the target's law; negative control: the draft's law."""
    from specjax.generate.jax_loop import draft_cost_ratio

    target, draft, target_j, draft_j = pair
    with draft_cost_ratio(float("inf")):
        counts, stats = sample_law(target_j, draft_j, ROWS, LENGTH, DRAFT_TOKENS, seed=6)
    assert stats.draft_steps == 0
    p_target = chi_square_p(counts, exact_law(target, LENGTH))
    p_draft = chi_square_p(counts, exact_law(draft, LENGTH))
    assert p_target > ALPHA, f"against the target's law: p = {p_target:.2e}"
    assert p_draft < POWER, f"the negative control (the draft's law) was not rejected: p = {p_draft:.2e}"


def test_a_misstated_draft_q_is_caught(pair):
    target, _, target_j, draft_j = pair
    first = exact_law(target, 1)
    p_true = chi_square_p(misstated_first_tokens(target_j, draft_j, ROWS, drawn_at=TEMPERATURE), first)
    p_wrong = chi_square_p(misstated_first_tokens(target_j, draft_j, ROWS, drawn_at=1.0), first)
    assert p_true > ALPHA, f"the step told the truth: p = {p_true:.2e}"
    assert p_wrong < POWER, f"the mis-stated q was not caught: p = {p_wrong:.2e}"


def test_the_target_only_reference_samples_the_targets_law(pair):
    """``jax_loop.target_decode`` at T = 0.7 (the reference of scripts/tpu_loop.py's sampled timings): two
    tokens of N copies of the prompt follow the target's law; negative control: the same counts against the
    target's law at T = 1 (a reference sampling at the wrong temperature would pass that one instead)."""
    import torch

    from specjax.generate.jax_loop import target_decode

    target, _, target_j, _ = pair
    ids = torch.tensor([PROMPT] * ROWS)
    new = target_decode(target_j, ids, None, 2, temperature=TEMPERATURE, seed=3)
    counts = np.bincount(np.ravel_multi_index(tuple(new.T), (VOCAB, VOCAB)), minlength=VOCAB**2)
    p_target = chi_square_p(counts, exact_law(target, 2))
    p_hot = chi_square_p(counts, exact_law(target, 2, temperature=1.0))
    assert p_target > ALPHA, f"against the target's law: p = {p_target:.2e}"
    assert p_hot < POWER, f"the negative control (T = 1) was not rejected: p = {p_hot:.2e}"
    with pytest.raises(ValueError, match="temperature"):
        target_decode(target_j, ids[:1], None, 1, temperature=float("nan"))


def test_chi_square_p_agrees_with_scipy():
    """The survival function from JAX's gammaincc (no scipy on an accelerator host) against scipy's."""
    from scipy import stats

    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.full(20, 20.0))
    for counts in (rng.multinomial(4000, probs), rng.multinomial(4000, np.roll(probs, 1))):
        assert (probs * 4000).min() >= 5  # no pooling: the plain test
        want = stats.chisquare(counts, probs * 4000).pvalue
        assert chi_square_p(counts, probs) == pytest.approx(want, rel=1e-3, abs=1e-12)
