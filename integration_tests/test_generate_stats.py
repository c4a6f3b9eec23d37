"""Sampling through ``speculative_generate`` is lossless: a chi-square test against enumeration.

A tiny-vocabulary pair (Llama, V=8; the draft is a heavily perturbed copy of
the target) generates the first few tokens of one prompt 20,000 times — as one batch
of 20,000 identical rows, whose per-row keys (``seed`` + row index) make them
independent draws. The empirical joint distribution of the generated tokens is
compared with the target's exact distribution, enumerated with the target
model and transformers' own warpers (``TemperatureLogitsWarper``,
``TopKLogitsWarper``, ``TopPLogitsWarper``, then softmax), independently of
specjax's front end:

    P(t1, t2, ...) = p(t1 | prompt) · p(t2 | prompt, t1) · ...

A negative control shows the test has power: two broken samplers (one accepts
every draft token, one draws corrections from p instead of the residual) are
passed as ``sampler=`` callables and must be caught with p < 1e-6.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

import specjax

pytestmark = pytest.mark.slow

V = 8
N = 20_000
PROMPT = [3, 1, 4, 1, 5]
MAX_SECONDS = 90  # per generate call; ~60 s expected on a loaded 2-core machine


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    # init_range 0.3 gives peaked distributions. The draft is the target with heavy
    # noise: it accepts about 60% of its first tokens (an independent random model
    # would almost never be accepted at temperature 0.7), so both the acceptance
    # path and the residual path carry weight.
    target = tiny_lm("llama", vocab_size=V, layers=2, hidden=16, seed=0, init_range=0.3)
    draft = perturbed_copy(target, noise=0.5, seed=5)
    return target, draft


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """Transformers' warpers in transformers' order, then softmax (float64 result)."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores.double(), dim=-1)


def exact_joint(target, length: int, temperature: float, top_k, top_p, prompt=PROMPT) -> np.ndarray:
    """f64[V] * length: the target's probability of every continuation of ``prompt``."""
    joint = np.ones((1,), np.float64)
    prefixes: list[tuple[int, ...]] = [()]
    with torch.inference_mode():
        for _ in range(length):
            ids = torch.tensor([list(prompt) + list(p) for p in prefixes])
            probs = processed_probs(target(ids).logits[:, -1], temperature, top_k, top_p).numpy()
            joint = (joint[:, None] * probs).reshape(-1)
            prefixes = [(*p, v) for p in prefixes for v in range(V)]
    return joint.reshape((V,) * length)


def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test; cells with expected count < 5 are pooled.

    Zero-probability cells must be empty (asserted): pooling them would hide that.
    """
    from scipy import stats

    obs = observed.reshape(-1).astype(np.float64)
    prob = expected_probs.reshape(-1)
    zero = prob <= 0
    assert obs[zero].sum() == 0, f"{int(obs[zero].sum())} draws of zero-probability continuations"
    n = obs.sum()
    exp = prob[~zero] * n
    obs = obs[~zero]
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    exp *= obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


def sample_counts(
    target, draft, *, length, num_draft_tokens, sampler="jax", mixed=True, prompt=PROMPT, **params
) -> np.ndarray:
    """Counts i64[V] * length of the first ``length`` tokens over N rows of ``prompt``."""
    ids = torch.tensor([list(prompt)] * N)
    t0 = time.perf_counter()
    # The fixed schedule: every step drafts, so both branches of the test carry weight.
    out = specjax.speculative_generate(
        target,
        draft,
        ids,
        max_new_tokens=length,
        num_draft_tokens=num_draft_tokens,
        seed=1234,
        sampler=sampler,
        adaptive=False,
        **params,
    )
    elapsed = time.perf_counter() - t0
    assert elapsed < MAX_SECONDS, f"{N} rows took {elapsed:.0f} s"
    new = out.sequences[:, len(prompt) :].numpy()
    assert new.shape == (N, length) and out.num_new_tokens.tolist() == [length] * N
    if mixed:  # both the acceptance and the residual branch carry weight
        assert 0.05 < out.stats.acceptance_rate < 0.95, out.stats
    counts = np.zeros((V,) * length, np.int64)
    np.add.at(counts, tuple(new.T), 1)
    return counts


CASES = [
    # (length, G, temperature, top_k, top_p, sampler). With length 2 the first step
    # drafts one token (the second is the bonus or the next step's); with length 3
    # and G=2 it drafts two, so the second test runs on a drafted token too.
    pytest.param(2, 4, 1.0, None, None, "jax", id="T1-G4"),
    pytest.param(2, 4, 0.7, 4, None, "jax", id="T0.7-topk4-G4"),
    pytest.param(3, 2, 1.0, None, None, "jax", id="T1-G2-three-tokens"),
    pytest.param(2, 3, 0.8, 6, 0.9, "jax", id="T0.8-topk6-topp0.9-G3"),
    pytest.param(2, 4, 1.0, None, None, "callable", id="T1-G4-rejection_sample-callable"),
]


@pytest.mark.parametrize(("length", "g", "temperature", "top_k", "top_p", "sampler"), CASES)
def test_joint_distribution_matches_the_target(length, g, temperature, top_k, top_p, sampler, pair):
    target, draft = pair
    fn = specjax.rejection_sample if sampler == "callable" else sampler
    counts = sample_counts(
        target, draft, length=length, num_draft_tokens=g, sampler=fn, temperature=temperature, top_k=top_k, top_p=top_p
    )
    expected = exact_joint(target, length, temperature, top_k, top_p)
    assert expected.sum() == pytest.approx(1.0, abs=1e-9)
    p = chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def quoting_prompt(target) -> list[int]:
    """PROMPT, its greedy continuation, then PROMPT again: n-gram lookup then proposes that continuation."""
    with torch.inference_mode():
        cont = target.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=4, pad_token_id=0)
    return cont[0].tolist() + PROMPT


@pytest.mark.parametrize(("kind", "sampler"), [("ngram", "jax"), ("hybrid", "jax"), ("hybrid", "numpy")])
def test_point_mass_drafters_keep_the_joint_distribution(kind, sampler, pair):
    """Deterministic proposals (n-gram lookup) verified as point masses, alone and mixed with the model's
    sampled proposals in one batch (the fused step, and a sampler plugin on the processed probabilities)."""
    from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter

    class CountingHybrid(HybridDrafter):
        mixed_steps = 0

        def propose(self, request):
            proposal = super().propose(request)
            rows = proposal.point_mass_rows
            self.mixed_steps += rows is not None and 0 < int(rows.sum()) < len(rows)
            return proposal

    target, draft = pair
    prompt = quoting_prompt(target)
    drafter = NgramDrafter(min_n=1) if kind == "ngram" else CountingHybrid(NgramDrafter(min_n=1), ModelDrafter(draft))
    counts = sample_counts(
        target, drafter, length=3, num_draft_tokens=3, temperature=0.7, top_k=4, prompt=prompt, sampler=sampler
    )
    if kind == "hybrid":
        assert drafter.mixed_steps > 0, "no step mixed point masses and draft logits: the test does not test"
    p = chi_square_p(counts, exact_joint(target, 3, 0.7, 4, None, prompt))
    print(f"chi-square p = {p:.3g}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_with_point_mass_proposals(pair):
    """A sampler that keeps every n-gram proposal must be caught (the point-mass test has power)."""
    from specjax.drafters import NgramDrafter

    target, _ = pair
    prompt = quoting_prompt(target)
    counts = sample_counts(
        target,
        NgramDrafter(min_n=1),
        length=3,
        num_draft_tokens=3,
        sampler=always_accept,
        temperature=0.7,
        top_k=4,
        mixed=False,
        prompt=prompt,
    )
    expected = exact_joint(target, 3, 0.7, 4, None, prompt)
    outside = counts.reshape(-1)[expected.reshape(-1) <= 0].any()  # a broken sampler may emit impossible tokens
    p = 0.0 if outside else chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p < 1e-6, f"the broken sampler was not caught: p = {p:.2e}"


def cut_drafter(draft, sequential: bool):
    """The model drafter, each row's proposal cut by a rule on its drawn tokens (G = 2 here).

    ``sequential``: token ``i + 1`` is proposed only after an even token ``i``
    (decided before it is drawn: what ``worth_drafting`` allows, exact);
    else token ``i`` only if it is even itself (decided from the token:
    biased, the negative control of the contract in ``Proposal``'s doc).
    """
    import dataclasses

    from specjax.drafters import ModelDrafter

    class Cut(ModelDrafter):
        def propose(self, request):
            p = super().propose(request)
            if p.width == 0:
                return p
            even = np.asarray(p.tokens) % 2 == 0
            run = (
                1 + np.cumprod(even[:, :-1], axis=1).sum(axis=1) if sequential else np.cumprod(even, axis=1).sum(axis=1)
            )
            return dataclasses.replace(p, num_tokens=np.minimum(p.num_tokens, run))

    return Cut(draft)


@pytest.mark.parametrize("sequential", [True, False], ids=["sequential", "negative-control-by-its-own-token"])
def test_a_drafters_early_stop_is_exact_only_when_sequential(pair, sequential):
    """Sampled proposals cut early: exact when whether a token is proposed depends only on the tokens
    before it (how ``worth_drafting`` stops a row), biased when it depends on the token itself."""
    target, draft = pair
    counts = sample_counts(target, cut_drafter(draft, sequential), length=3, num_draft_tokens=2, temperature=1.0)
    p = chi_square_p(counts, exact_joint(target, 3, 1.0, None, None))
    print(f"chi-square p = {p:.3g}")
    if sequential:
        assert p > 1e-3, f"chi-square p = {p:.2e}"
    else:
        assert p < 1e-6, f"the biased cut was not caught: p = {p:.2e}"


def eagle_head_for(target, seed: int = 0):
    """An untrained EAGLE head for ``target`` scoring 6 of its V tokens (q = 0 for the other two).

    Exactness holds for any head; its fusion layer starts near the identity, so
    its proposals follow the current distribution and are accepted often enough
    that both branches of the test carry weight.
    """
    from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

    head = EagleHead(EagleConfig(target.config.hidden_size, 4, 2, 32, V, 6))
    init_weights(head, seed)
    head.token_ids.copy_(torch.tensor([0, 1, 2, 3, 5, 6]))
    return head.eval()


def test_eagle_drafter_keeps_the_joint_distribution(pair):
    """The head's sampled proposals (their logits -inf outside its 6 tokens) at T = 0.7 with top-k."""
    from specjax.drafters import EagleDrafter

    target, _ = pair
    counts = sample_counts(
        target, EagleDrafter(eagle_head_for(target)), length=3, num_draft_tokens=3, temperature=0.7, top_k=4
    )
    p = chi_square_p(counts, exact_joint(target, 3, 0.7, 4, None))
    print(f"chi-square p = {p:.3g}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_with_eagle_proposals(pair):
    """A sampler that keeps every proposal of the head must be caught."""
    from specjax.drafters import EagleDrafter

    target, _ = pair
    counts = sample_counts(
        target,
        EagleDrafter(eagle_head_for(target)),
        length=3,
        num_draft_tokens=3,
        sampler=always_accept,
        temperature=0.7,
        top_k=4,
        mixed=False,
    )
    expected = exact_joint(target, 3, 0.7, 4, None)
    outside = counts.reshape(-1)[expected.reshape(-1) <= 0].any()
    p = 0.0 if outside else chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p < 1e-6, f"the broken sampler was not caught: p = {p:.2e}"


# --------------------------------------------------------------------------- #
# Negative controls: broken samplers must be caught
# --------------------------------------------------------------------------- #


def _draw_from(probs, sample_uniforms):
    """i32[B]: a token from each row of ``probs`` f[B, V] (rejection_sample with G = 0)."""
    empty = np.zeros((probs.shape[0], 0), np.int32)
    res = specjax.rejection_sample(
        empty,
        np.zeros((probs.shape[0], 0, V), np.float32),
        probs[:, None],
        np.zeros((probs.shape[0], 0), np.float32),
        sample_uniforms,
        validate=False,
    )
    return np.asarray(res.tokens)[:, 0]


def always_accept(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, validate=True):
    """Broken: keeps every draft token, then a bonus token from p_G."""
    x = np.asarray(draft_tokens).astype(np.int32)
    p = np.asarray(target_probs)
    g = x.shape[1]
    bonus = _draw_from(p[:, g], np.asarray(sample_uniforms))
    return {"num_accepted": np.full(x.shape[0], g, np.int32), "tokens": np.concatenate([x, bonus[:, None]], 1)}


def correction_from_p(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, validate=True):
    """Broken: the right acceptance test, but the correction token drawn from p_n, not the residual."""
    res = specjax.rejection_sample(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, validate=validate
    )
    n = np.asarray(res.num_accepted)
    tokens = np.array(res.tokens)
    p = np.asarray(target_probs)
    y = _draw_from(p[np.arange(len(n)), n], np.asarray(sample_uniforms))
    tokens[np.arange(len(n)), n] = y
    return {"num_accepted": n, "tokens": tokens}


@pytest.mark.parametrize("broken", [always_accept, correction_from_p], ids=lambda f: f.__name__)
def test_negative_control_catches_a_broken_sampler(broken, pair):
    target, draft = pair
    counts = sample_counts(
        target, draft, length=2, num_draft_tokens=4, sampler=broken, temperature=1.0, mixed=broken is not always_accept
    )
    p = chi_square_p(counts, exact_joint(target, 2, 1.0, None, None))
    print(f"chi-square p = {p:.3g}")
    assert p < 1e-6, f"the broken sampler was not caught: p = {p:.2e}"


def test_enumeration_is_a_distribution(pair):
    """The reference itself: marginals of the 3-token joint equal the 2-token joint."""
    target, _ = pair
    two = exact_joint(target, 2, 0.7, 4, None)
    three = exact_joint(target, 3, 0.7, 4, None)
    np.testing.assert_allclose(three.sum(axis=2), two, atol=1e-12)
    assert (two > 0).sum() <= 4 * 4  # top-k = 4 at each of two positions
    assert all(len(c) == 2 for c in itertools.islice(np.argwhere(two > 0), 3))
