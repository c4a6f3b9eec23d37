"""``StopRule.cut`` against plain decoding's rule, asked one token and one row at a time.

The reference asks a criterion what ``generate`` would: after each token, for the row alone,
with the prompt as passed (padding included) followed by every token so far. The rule under test
asks all of a step's (row, prefix) pairs in as few batched calls as the criterion allows; both
must cut every run at the same token. Property-tested over random prompts, histories and runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from specjax.generate.checks import PluginOutputError
from specjax.generate.stopping import StopRule, check_stopping_criteria


class Counting:
    """A criterion that counts its calls; ``rule(ids i64[R, L]) -> bool[R]``, reading the last ``window`` ids."""

    def __init__(self, rule, window: int | None = None) -> None:
        self.rule, self.calls = rule, 0
        if window is not None:
            self.stop_window = window

    def __call__(self, input_ids, scores, **kwargs):
        assert scores is None
        self.calls += 1
        return self.rule(input_ids)


RULES = {
    "whole-row sum": (lambda ids: ids.sum(-1) % 5 == 0, None),
    "length and first id": (lambda ids: (ids[:, 0] + ids.shape[1]) % 4 == 0, None),
    "last two equal mod 3": (lambda ids: ids[:, -1] % 3 == ids[:, -2] % 3, 2),
    "last id": (lambda ids: ids[:, -1] == 7, 1),
}


def reference_cut(criteria, eos, prompts, rows, generated, runs):
    """Plain decoding's stop index per row: one call per token and row."""
    out = []
    for row, gen, run in zip(rows, generated, runs, strict=True):
        stop = None
        for i, tkn in enumerate(run):
            seq = torch.as_tensor(np.concatenate([prompts[row], gen + run[: i + 1]]))[None]
            if tkn in eos or any(bool(c(seq, None)[0]) for c in criteria):
                stop = i
                break
        out.append(stop)
    return out


@st.composite
def steps(draw):
    batch = draw(st.integers(1, 4))
    width = draw(st.integers(1, 5))
    prompts = np.array(
        draw(st.lists(st.lists(st.integers(0, 9), min_size=width, max_size=width), min_size=batch, max_size=batch))
    )
    rows = sorted(draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=batch, unique=True)))
    generated = [draw(st.lists(st.integers(0, 9), max_size=6)) for _ in rows]
    runs = [draw(st.lists(st.integers(0, 9), min_size=1, max_size=6)) for _ in rows]
    eos = set(draw(st.lists(st.integers(0, 9), max_size=1)))
    return prompts, rows, generated, runs, eos


@pytest.mark.parametrize("names", [[n] for n in RULES] + [list(RULES)])
@settings(max_examples=60, deadline=None)
@given(step=steps())
def test_cut_is_plain_decodings_cut(names, step):
    prompts, rows, generated, runs, eos = step
    criteria = [Counting(*RULES[n]) for n in names]
    rule = StopRule(eos, criteria, torch.as_tensor(prompts))
    got = rule.cut(rows, generated, runs)
    assert got == reference_cut([Counting(*RULES[n]) for n in names], eos, prompts, rows, generated, runs)


def test_a_criterion_that_reads_a_short_tail_is_asked_once_per_step():
    prompts = torch.tensor([[0, 0, 3, 4], [1, 2, 3, 4]])
    windowed, whole = Counting(lambda ids: ids[:, -1] == 99, 2), Counting(lambda ids: ids[:, -1] == 99)
    StopRule(set(), [windowed, whole], prompts).cut([0, 1], [[5], [6, 7, 8]], [[1, 2, 3], [4, 5]])
    assert windowed.calls == 1  # all five (row, prefix) pairs in one call
    assert whole.calls == 4  # lengths 6, 7, 8 (row 0) and 8, 9 (row 1): one call per distinct length


def test_transformers_criteria():
    prompts = torch.tensor([[0, 3, 4]])
    rule = StopRule(set(), [EosTokenCriteria(8), MaxLengthCriteria(7)], prompts)
    assert rule.cut([0], [[1]], [[2, 8, 9]]) == [1]  # EOS id through the criterion: kept, then stop
    assert rule.cut([0], [[1]], [[2, 5, 6, 9]]) == [2]  # length 3 + 1 + 3 = 7 reached at the third token


def test_a_bad_answer_names_the_criterion():
    def ragged(input_ids, scores):
        return torch.ones(input_ids.shape[0] + 1, dtype=torch.bool)

    rule = StopRule(set(), [ragged], torch.tensor([[1, 2]]))
    with pytest.raises(PluginOutputError, match=r"stopping criterion .*ragged returned Tensor of shape \(2,\)"):
        rule.cut([0], [[]], [[3]])


@pytest.mark.parametrize(
    ("value", "message"),
    [(42, r"got int"), ([lambda i, s: None, "x"], r"got an item of type str"), ("stop", r"got str")],
)
def test_check_stopping_criteria_refuses(value, message):
    with pytest.raises(TypeError, match=rf"stopping_criteria: expected .*{message}"):
        check_stopping_criteria(value)


def test_check_stopping_criteria_flattens():
    a, b, c = (Counting(lambda ids: ids[:, -1] == 0) for _ in range(3))
    assert check_stopping_criteria([a, [b, (c,)]]) == [a, b, c]
    assert check_stopping_criteria(a) == [a]
    assert check_stopping_criteria(None) == []
