"""transformers' built-in processors, vectorised (:mod:`specjax.generate.row_processors`), against transformers.

The definition is transformers' own instance, called as ``generate`` calls it:
the whole batch at one length, the row under test holding its exact prefix
(left-padded prompt, committed tokens, draft tokens), the other rows a
stand-in. Each vectorised processor, given every (row, position) pair of a
call at once as :class:`Prefixes` (right-aligned, ragged, their alignment
padding an id that also means a real token), must equal it bit for bit, for
every option value in the table and on random prefixes whose tokens repeat.

Then the loop's side (:class:`LoopProcessors`): a batch of 8 rows at different
lengths is processed with one call per built-in processor (a caller's callable
still once per distinct prefix length, in its place in the chain), and the
result is the reference's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp

from specjax.generate.processors import LoopProcessors, build_processors
from specjax.generate.row_processors import Prefixes, vectorised

V = 40
B = 4
ALIGN = V - 1  # the alignment padding's id: a real token, rare in the prefixes, so reading the padding shows
PAD = 0  # the prompts' left padding id (a real column of generate's input_ids)
T = range(1, 9)  # the prefixes' usual tokens


def reference(p: Any, prefixes: list[list[int]], rows: list[int], scores: torch.Tensor, batch: int) -> torch.Tensor:
    """f32[N, V]: transformers' ``p`` on each scores row, called as ``generate`` calls it (``batch`` rows of the
    prefix's length, the row under test at its batch row, the others a stand-in of other tokens)."""
    out = torch.empty_like(scores)
    for n, (prefix, row) in enumerate(zip(prefixes, rows, strict=True)):
        ids = torch.full((batch, len(prefix)), 5, dtype=torch.long)
        ids[row] = torch.tensor(prefix)
        full = torch.randn(batch, scores.shape[1])
        full[row] = scores[n]
        out[n] = p(ids, full)[row]
    return out


def as_prefixes(prefixes: list[list[int]], rows: list[int], committed: list[int], prompt: int) -> Prefixes:
    width = max(map(len, prefixes))
    ids = np.array([[ALIGN] * (width - len(p)) + p for p in prefixes], np.int64)
    lengths = np.array([len(p) for p in prefixes], np.int64)
    return Prefixes(np.array(rows, np.int64), ids, lengths, np.array(committed, np.int64), prompt)


def random_call(seed: int, prompt: int) -> tuple[list[list[int]], list[int], list[int]]:
    """``(prefixes, rows, committed)``: 14 ragged positions over B left-padded rows, every length from the prompt's
    to 9 tokens past it (the length rules fire for some), tokens from a few ids so that they repeat (row 0 periodic),
    and now and then an id past the scores' vocabulary (transformers skips those) or the alignment padding's."""
    rng = np.random.default_rng(seed)
    rows_tokens = []
    for b in range(B):
        pad = int(rng.integers(0, prompt))
        tokens = rng.choice([*T, V + 3, ALIGN], size=prompt - pad + 12, p=[0.12] * 8 + [0.02] * 2)
        if b == 0:  # a row that repeats itself: long n-grams recur
            tokens = np.resize(tokens[:3], tokens.size)
        rows_tokens.append([PAD] * pad + tokens.tolist())
    rows = [int(r) for r in rng.integers(0, B, size=14)]
    lengths = [prompt + i for i in range(10)] + [int(x) for x in rng.integers(prompt, prompt + 10, size=4)]
    prefixes = [rows_tokens[r][:n] for r, n in zip(rows, lengths, strict=True)]
    committed = [int(rng.integers(min(prompt, n), n + 1)) for n in lengths]
    return prefixes, rows, committed


def random_scores(n: int, seed: int) -> torch.Tensor:
    scores = torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3
    scores[0, 4] = -float("inf")  # a token banned upstream
    return scores


PROCESSORS = [
    # (name, transformers' processor for a prompt of P columns)
    ("penalty 1.5", lambda P: lp.RepetitionPenaltyLogitsProcessor(1.5)),
    ("penalty 0.6", lambda P: lp.RepetitionPenaltyLogitsProcessor(0.6)),
    ("penalty, int prompt_ignore_length", lambda P: lp.RepetitionPenaltyLogitsProcessor(1.3, P)),
    ("penalty, per-row prompt_ignore_length", lambda P: lp.RepetitionPenaltyLogitsProcessor(1.3, torch.arange(B))),
    ("no repeat 1", lambda P: lp.NoRepeatNGramLogitsProcessor(1)),
    ("no repeat 2", lambda P: lp.NoRepeatNGramLogitsProcessor(2)),
    ("no repeat 3", lambda P: lp.NoRepeatNGramLogitsProcessor(3)),
    ("no repeat 6", lambda P: lp.NoRepeatNGramLogitsProcessor(6)),
    ("bad words", lambda P: lp.NoBadWordsLogitsProcessor([[3], [4, 5], [6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8]])),
    # sequences through the alignment padding's id: a one-token prefix must not reach into the padding
    ("bad words with the padding's id", lambda P: lp.NoBadWordsLogitsProcessor([[5]] + [[ALIGN, t, 3] for t in T])),
    ("bad words without EOS", lambda P: lp.NoBadWordsLogitsProcessor([[2], [3, 2]], eos_token_id=[2])),
    ("sequence bias", lambda P: lp.SequenceBiasLogitsProcessor([[[4, 5], -2.0], [[7], 1.5], [[1, 2, 3], 3.0]])),
    ("min new tokens", lambda P: lp.MinNewTokensLengthLogitsProcessor(P, 3, [2, 4])),
    ("forced BOS", lambda P: lp.ForcedBOSTokenLogitsProcessor(5)),
    ("forced EOS", lambda P: lp.ForcedEOSTokenLogitsProcessor(P + 4, [2, 3])),
    ("begin suppress", lambda P: lp.SuppressTokensAtBeginLogitsProcessor([2, 9], P)),
    ("begin suppress after BOS", lambda P: lp.SuppressTokensAtBeginLogitsProcessor([2, 9], P + 1)),
    ("suppress", lambda P: lp.SuppressTokensLogitsProcessor([1, 2, 30])),
    ("temperature", lambda P: lp.TemperatureLogitsWarper(0.7)),
    ("top-k", lambda P: lp.TopKLogitsWarper(5)),
    ("top-p", lambda P: lp.TopPLogitsWarper(0.8)),
    ("top-h", lambda P: lp.TopHLogitsWarper(0.5)),
    ("min-p", lambda P: lp.MinPLogitsWarper(0.05)),
    ("min-p, keep 3", lambda P: lp.MinPLogitsWarper(0.3, min_tokens_to_keep=3)),
    ("typical", lambda P: lp.TypicalLogitsWarper(0.9)),
    ("epsilon", lambda P: lp.EpsilonLogitsWarper(0.05)),
    ("eta", lambda P: lp.EtaLogitsWarper(0.05)),
    ("log-softmax", lambda P: lp.LogitNormalization()),
    ("inf / nan", lambda P: lp.InfNanRemoveLogitsProcessor()),
]


@pytest.mark.parametrize("prompt", [1, 5])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("make", [m for _, m in PROCESSORS], ids=[n for n, _ in PROCESSORS])
def test_vectorised_equals_transformers_on_ragged_prefixes(make, seed, prompt):
    prefixes, rows, committed = random_call(seed, prompt)
    scores = random_scores(len(prefixes), seed)
    want = reference(make(prompt), prefixes, rows, scores.clone(), B)
    fast = vectorised(make(prompt))
    assert fast is not None
    got = fast.process_rows(as_prefixes(prefixes, rows, committed, prompt), scores.clone())
    assert torch.equal(got, want), (got - want).abs().nan_to_num().max()


def test_the_cases_change_the_scores():
    """Each prefix-reading processor changes some scores row in some case (else its case tests nothing)."""
    for name, make in PROCESSORS:
        changed = False
        for prompt in (1, 5):
            for seed in range(4):
                prefixes, rows, _ = random_call(seed, prompt)
                scores = random_scores(len(prefixes), seed)
                changed |= not torch.equal(reference(make(prompt), prefixes, rows, scores.clone(), B), scores)
        assert changed, name


def test_only_transformers_own_classes_are_vectorised():
    class MyPenalty(lp.RepetitionPenaltyLogitsProcessor):
        pass

    assert vectorised(MyPenalty(1.2)) is None  # a subclass may read the prefix its own way
    assert vectorised(lp.PrefixConstrainedLogitsProcessor(lambda b, s: [1], 1)) is None
    assert vectorised(lambda ids, scores: scores) is None


# --------------------------------------------------------------------------- the loop's side


def ban_last(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A caller's prefix-dependent callable: bans repeating the last token."""
    return scores.scatter(1, input_ids[:, -1:], -float("inf"))


def chain_for(ids: torch.Tensor, mask: torch.Tensor, custom: list[Any]) -> list[Any]:
    chain, params = build_processors(
        custom,
        dict(repetition_penalty=1.1, no_repeat_ngram_size=2, min_p=0.05),
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=16,
        eos_ids={2},
        temperature=0.7,
        top_k=None,
        top_p=None,
    )
    assert params == (1.0, None, None)
    return chain


@pytest.mark.parametrize("custom", [[], [ban_last]], ids=["built-ins", "with a callable"])
def test_a_ragged_batch_of_8_takes_one_call_per_built_in(custom):
    """B = 8 rows with different committed counts and draft lengths: one call per built-in processor for the
    target's positions and per draft position (a caller's callable: one per distinct length), and each position's
    scores are the chain's on its exact prefix (transformers' classes, in order)."""
    rng = np.random.default_rng(0)
    batch, prompt, g = 8, 6, 4
    pads = rng.integers(0, 4, size=batch)
    ids = torch.tensor([[PAD] * int(p) + rng.integers(1, 9, size=prompt - int(p)).tolist() for p in pads])
    mask = (ids != PAD).long()
    chain = chain_for(ids, mask, custom)
    loop = LoopProcessors(chain, ids, max_new_tokens=16, max_draft=g, vocab=V, pad_token_id=PAD)
    emitted = [rng.integers(1, 9, size=int(n)).tolist() for n in rng.permutation(batch)]  # 0 .. 7 tokens a row
    loop.commit(list(range(batch)), emitted)
    draft = torch.tensor(rng.integers(1, 9, size=(batch, g)))
    k = np.array([4, 0, 2, 4, 1, 3, 4, 2])
    active = np.ones(batch, bool)
    logits = torch.randn(batch, g + 1, V) * 3

    out = loop.target(logits, draft, k, active, list(range(batch)))

    prefixes = [ids[b].tolist() + emitted[b] + draft[b, :j].tolist() for b in range(batch) for j in range(k[b] + 1)]
    rows = [b for b in range(batch) for _ in range(k[b] + 1)]
    scores = torch.stack([logits[b, j] for b in range(batch) for j in range(k[b] + 1)])
    want = scores.clone()
    for p in chain:
        want = reference(p, prefixes, rows, want, batch)
    got = torch.stack([out[b, j] for b in range(batch) for j in range(k[b] + 1)])
    assert torch.equal(got, want)
    built_in = len(chain) - len(custom)
    lengths = {len(p) for p in prefixes}
    assert len(lengths) > 5  # ragged: the per-length path would call each processor that many times
    assert loop.calls == built_in + len(custom) * len(lengths)

    # a drafter's position 2: one call per built-in again
    before = loop.calls
    loop.draft_hook(list(range(batch)), active)(torch.randn(batch, V), draft[:, :2].numpy())
    drafted_lengths = {len(ids[b]) + len(emitted[b]) + 2 for b in range(batch)}
    assert loop.calls - before == built_in + len(custom) * len(drafted_lengths)
