"""Sampling under a grammar with forced-token drafts stays exact: a chi-square test of a joint law.

The pair and the pattern of ``test_generate_stats.py`` (V = 8, N = 20,000
identical rows with independent keys, the fixed schedule), with a regular
expression, ``[ab]xy[az][abc]+``, over a tokenizer of seven one-character
tokens and ``xy``: after the first token the grammar forces the text ``xy``,
which the loop proposes (as the tokenizer encodes it, ``x`` then ``y``) after
each point-mass row's draft
(:meth:`specjax.generate.grammar.GrammarRows.forced_extension`), and which the
target may also spell as the one token ``xy``: ``x`` is not certain there. The empirical
joint law of the first four tokens at T = 0.7 is compared with the target's
exact law under the grammar, enumerated with a fresh xgrammar matcher per
prefix (the allowed tokens keep their logits, then the temperature),
independently of the loop. Drafters: n-gram lookups (point masses), and a
model that drafts for some rows only (the rows that draw nothing become point-mass rows of
forced tokens beside the drawn rows).

The negative control verifies those last rows against the model's draft
logits instead of as point masses (a forced string's first token is not
certain where another token spells it too): the test must reject it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from test_generate_stats import N, V, chi_square_p

import specjax
from specjax.drafters import ModelDrafter, NgramDrafter
from specjax.generate import loop

pytestmark = pytest.mark.slow

REGEX = r"[ab]xy[az][abc]+"
CHARS = ["<e>", "a", "b", "c", "x", "y", "z", "xy"]  # id = index; 0 ends a row
PROMPT = [1, 4, 5, 1, 3, 2, 7, 6, 3, 3]  # "axyac bxyzcc": n-gram lookups propose grammar-like continuations
LENGTH, G, T = 4, 3, 0.7


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, hidden=16, seed=0, init_range=0.3)
    return target, perturbed_copy(target, noise=0.5, seed=5)


@pytest.fixture(scope="module")
def tok():
    """A fast tokenizer of CHARS that encodes text character by character (xgrammar reads its vocabulary raw)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="<e>"))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<e>")


def exact_joint(target, tok) -> np.ndarray:
    """f64[V] * LENGTH: the target's law of every continuation under the grammar, each position's logits
    masked with a fresh matcher's allowed tokens after its prefix, then divided by T."""
    import xgrammar as xgr

    from specjax.generate.grammar import compile_grammar, grammar_spec

    grammar = compile_grammar(grammar_spec(regex=REGEX), tok, V)
    joint = np.zeros((V,) * LENGTH)
    level: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    with torch.inference_mode():
        for _ in range(LENGTH):
            logits = target(torch.tensor([PROMPT + list(p) for p, _ in level])).logits[:, -1].double()
            nxt = []
            for (prefix, mass), row in zip(level, logits, strict=True):
                m = xgr.GrammarMatcher(grammar, override_stop_tokens=[0])
                assert all(m.accept_token(t) for t in prefix)
                bits = xgr.allocate_token_bitmask(1, V).numpy()
                m.fill_next_token_bitmask(bits)
                allowed = torch.as_tensor(np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool))
                probs = torch.softmax(torch.where(allowed, row, float("-inf")) / T, dim=-1).numpy()
                nxt += [((*prefix, v), mass * float(probs[v])) for v in range(V) if probs[v] > 0]
            level = nxt
    for prefix, mass in level:
        joint[prefix] = mass
    return joint


class SomeRows:
    """A model drafter that drafts for the rows whose last token is ``a`` and proposes nothing for the
    others (a choice fixed by the committed tokens: exact): after the first token, where the grammar forces
    ``xy``, rows of drawn tokens and rows of forced ones share the step."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.name = inner, "some-rows"
        self.needs_target_hidden, self.cost_per_token_hint = False, inner.cost_per_token_hint
        self.skipped_steps = 0

    def start(self, setup) -> None:
        self.inner.start(setup)

    def propose(self, request):
        drafts = np.array([c[-1] == 1 for c in request.contexts]) & (request.max_tokens > 0)
        self.skipped_steps += bool((~drafts & (request.max_tokens > 0)).any() and drafts.any())
        fewer = np.where(drafts, request.max_tokens, 0)
        proposal = self.inner.propose(dataclasses.replace(request, max_tokens=fewer, limit=fewer))
        return dataclasses.replace(proposal, num_tokens=np.minimum(proposal.num_tokens, fewer))

    def commit(self, info) -> None:
        self.inner.commit(info)

    def select_rows(self, rows) -> None:
        self.inner.select_rows(rows)


def counts_of(target, drafter, tok) -> tuple[np.ndarray, Any]:
    out = specjax.speculative_generate(
        target,
        drafter,
        torch.tensor([PROMPT] * N),
        max_new_tokens=LENGTH,
        num_draft_tokens=G,
        temperature=T,
        seed=1234,
        adaptive=False,
        eos_token_id=0,
        pad_token_id=0,
        target_tokenizer=tok,
        regex=REGEX,
    )
    new = out.sequences[:, len(PROMPT) :].numpy()
    assert new.shape == (N, LENGTH) and out.num_new_tokens.tolist() == [LENGTH] * N
    counts = np.zeros((V,) * LENGTH, np.int64)
    np.add.at(counts, tuple(new.T), 1)
    return counts, out.stats


def drafter_of(kind: str, draft) -> Any:
    if kind == "ngram":
        return NgramDrafter(min_n=1)
    return SomeRows(ModelDrafter(draft))


@pytest.mark.parametrize("kind", ["ngram", "some-rows"])
def test_joint_law_with_forced_drafts_matches_the_target(kind, pair, tok):
    target, draft = pair
    drafter = drafter_of(kind, draft)
    counts, stats = counts_of(target, drafter, tok)
    assert stats.forced_tokens_accepted > 0  # forced tokens were proposed and tested
    assert 0 < stats.draft_tokens_accepted - stats.forced_tokens_accepted  # and the drafter's own
    if kind == "some-rows":
        assert drafter.skipped_steps > 0, "no step mixed drawn rows and rows of forced tokens"
    p = chi_square_p(counts, exact_joint(target, tok))
    print(f"chi-square p = {p:.3g}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


def test_negative_control_forced_rows_verified_against_draft_logits(pair, tok, monkeypatch):
    """Rows of forced tokens left unmarked beside drawn rows (tested against the model's draft logits
    as if drawn from them): the test must reject it."""
    real = loop._Run.grammar_extend

    def unmarked(self, proposal, k, caps, active):
        extended, k2, own = real(self, proposal, k, caps, active)
        if extended.logits is None:
            return extended, k2, own
        return dataclasses.replace(extended, point_mass_rows=proposal.point_mass_rows), k2, own

    monkeypatch.setattr(loop._Run, "grammar_extend", unmarked)
    target, draft = pair
    counts, _ = counts_of(target, drafter_of("some-rows", draft), tok)
    expected = exact_joint(target, tok)
    outside = counts.reshape(-1)[expected.reshape(-1) <= 0].any()
    p = 0.0 if outside else chi_square_p(counts, expected)
    print(f"chi-square p = {p:.3g}")
    assert p < 1e-6, f"the wrong verification was not caught: p = {p:.2e}"
