"""The vLLM plugin's step on vLLM's input layout, without vLLM (vllm_tests/ run it inside a real vLLM).

``specjax.plugin.vllm._step`` takes vLLM's flattened drafts and returns vLLM's
output layout. Greedy rows are checked against vLLM's greedy rule written out
here; sampled rows against properties every exact step has (the accepted
prefix is the draft's, a point-mass draft's rejected token is never the
correction, the bonus is vLLM's), and seeded rows for independence from the
batch. The metadata is a plain namespace with the fields the step reads.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specjax.plugin.vllm as plugin
from specjax.plugin.vllm import repair as plugin_repairs
from specjax.plugin.vllm import step as plugin_step

V = 50


def metadata(temperature, generators=None):
    t = None if temperature is None else torch.tensor(temperature, dtype=torch.float32)
    return SimpleNamespace(
        temperature=t, all_greedy=temperature is None or all(x == 0 for x in temperature), generators=generators or {}
    )


def flat_inputs(ks, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(ks)
    logits = torch.randn(t, V, generator=g) * 3
    draft = torch.randint(0, V, (t,), generator=g, dtype=torch.int32)
    bonus = torch.randint(0, V, (len(ks), 1), generator=g, dtype=torch.int32)
    return draft, logits, bonus


def greedy_reference(draft, ks, logits, bonus):
    """vLLM's greedy rule: accept while the draft is the argmax, emit the argmax or the bonus."""
    g = max(ks) if ks else 0
    out = np.full((len(ks), g + 1), -1, np.int32)
    start = 0
    for b, k in enumerate(ks):
        pos = 0
        while pos < k:
            top = int(torch.argmax(logits[start + pos]))
            out[b, pos] = top
            if int(draft[start + pos]) != top:
                break
            pos += 1
        if pos == k:
            out[b, k] = int(bonus[b, 0])
        start += k
    return out


@pytest.mark.parametrize("ks", [[4], [2, 0, 3], [0, 0], [1, 4, 4, 0, 2], [3] * 9])
@pytest.mark.parametrize("path", ["host", "kernel"])
def test_greedy_rows_follow_vllms_rule(ks, path):
    """All-greedy steps take the host path (torch argmax); with one sampled request, the JAX kernel."""
    draft, logits, bonus = flat_inputs(ks)
    # ties: a second maximum at a later index in every third row (the first one wins)
    top = logits.argmax(-1)
    for r in range(0, len(top), 3):
        logits[r, min(int(top[r]) + 1, V - 1)] = logits[r, top[r]]
    # make some drafts the argmax, so rows accept a few tokens
    draft[::2] = logits.argmax(-1)[::2].to(torch.int32)
    expected = greedy_reference(draft, ks, logits, bonus)
    ks_in, draft_in, logits_in, bonus_in, meta = ks, draft, logits, bonus, metadata(None)
    if path == "kernel":  # one more request, sampled, with one draft token
        ks_in = [*ks, 1]
        draft_in = torch.cat([draft, torch.tensor([0], dtype=torch.int32)])
        logits_in = torch.cat([logits, torch.zeros(1, V)])
        bonus_in = torch.cat([bonus, torch.tensor([[0]], dtype=torch.int32)])
        meta = metadata([0.0] * len(ks) + [1.0], {len(ks): torch.Generator().manual_seed(0)})
    g = max(ks_in)
    out = plugin_step.run_step(draft_in, ks_in, g, None, logits_in, bonus_in, meta)
    assert out.dtype == torch.int32 and out.shape == (len(ks_in), g + 1)
    np.testing.assert_array_equal(out.numpy()[: len(ks), : expected.shape[1]], expected)
    assert (out.numpy()[: len(ks), expected.shape[1] :] == -1).all()


def test_all_greedy_steps_are_counted_apart():
    ks = [3, 1]
    draft, logits, bonus = flat_inputs(ks, seed=4)
    calls, greedy = plugin.calls(), plugin.greedy_calls()
    plugin.rejection_sample(draft, ks, 3, None, None, logits, bonus, metadata(None))
    assert (plugin.calls(), plugin.greedy_calls()) == (calls + 1, greedy + 1)
    gens = {0: torch.Generator().manual_seed(1)}
    plugin.rejection_sample(draft, ks, 3, None, None, logits, bonus, metadata([0.0, 0.9], gens))
    assert (plugin.calls(), plugin.greedy_calls()) == (calls + 2, greedy + 1)


@pytest.mark.parametrize("given_probs", [False, True])
def test_sampled_rows_keep_a_draft_prefix_and_splice_the_bonus(given_probs):
    ks = [4, 0, 2, 4, 1]
    draft, logits, bonus = flat_inputs(ks, seed=1)
    # draft the argmax often, so that some rows accept everything
    draft[1::2] = logits.argmax(-1)[1::2].to(torch.int32)
    # point-mass drafts, given either as None or as one-hot probabilities: the same law
    probs = torch.nn.functional.one_hot(draft.long(), V).float() if given_probs else None
    starts = np.cumsum([0, *ks[:-1]])
    saw_bonus = saw_correction = False
    for trial in range(30):
        gens = {b: torch.Generator().manual_seed(100 * trial + b) for b in range(len(ks))}
        out = plugin_step.run_step(
            draft, ks, 4, probs, logits, bonus, metadata([0.8, 1.0, 0.0, 1.3, 0.9], gens)
        ).numpy()
        for b, k in enumerate(ks):
            row = out[b]
            emitted = [int(x) for x in row if x != -1]
            assert 1 <= len(emitted) <= k + 1 and all(x == -1 for x in row[len(emitted) :])
            accepted = emitted[:-1]
            assert accepted == draft[starts[b] : starts[b] + len(accepted)].tolist()
            last = emitted[-1]
            if len(accepted) == k:
                assert last == int(bonus[b, 0])
                saw_bonus = True
            else:  # a point mass leaves the rejected token out of the residual
                assert last != int(draft[starts[b] + len(accepted)])
                saw_correction = True
    assert saw_bonus and saw_correction


def test_seeded_rows_do_not_depend_on_the_batch():
    ks = [3, 2, 4]
    draft, logits, bonus = flat_inputs(ks, seed=2)
    temperature = [0.9, 1.0, 0.7]

    def gens():
        return {b: torch.Generator().manual_seed(7 + b) for b in range(3)}

    batch = plugin_step.run_step(draft, ks, 4, None, logits, bonus, metadata(temperature, gens()))
    for b in range(3):
        s = sum(ks[:b])
        g = torch.Generator().manual_seed(7 + b)
        alone = plugin_step.run_step(
            draft[s : s + ks[b]],
            ks[b : b + 1],
            ks[b],
            None,
            logits[s : s + ks[b]],
            bonus[b : b + 1],
            metadata(temperature[b : b + 1], {0: g}),
        )
        assert alone[0].tolist() == batch[b, : ks[b] + 1].tolist()


def test_calls_names_a_bad_mode():
    with pytest.raises(ValueError, match="mode: expected None, 'point_mass' or 'draft_probs', got 'greedy'"):
        plugin.calls("greedy")


def test_expansion_in_torch():
    got = plugin_repairs._expand_batch_to_tokens_torch(
        torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 2, 5]), 5, replace_from=0, replace_to=1
    )
    assert got.tolist() == [0.5, 0.5, 2.0, 2.0, 2.0]
    assert plugin_repairs._expansion_is_wrong(plugin_repairs._expand_batch_to_tokens_torch) is False


def test_import_is_light_and_register_without_vllm_warns(caplog):
    code = (
        "import sys, specjax.plugin.vllm; "
        "print(sorted(m for m in ('torch', 'jax', 'vllm', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    try:
        import vllm  # noqa: F401
    except ImportError:
        with caplog.at_level(logging.WARNING, logger="vllm.specjax"):
            assert plugin.register() is False
        assert [r.getMessage() for r in caplog.records if r.name == "vllm.specjax"] == [caplog.records[0].getMessage()]
        assert "vLLM is not importable" in caplog.records[0].getMessage()
