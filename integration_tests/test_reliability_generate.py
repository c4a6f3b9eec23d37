"""Reliability of ``speculative_generate`` (issue 22), on tiny models built from configs.

Each test failed before its fix:

* bad arguments are ``TypeError``/``ValueError`` naming the argument: ``target=None``, an
  all-padding row, a prompt plus ``max_new_tokens`` beyond a model's position limit
  (refused before any forward pass; GPT-2 used to fail with an ``IndexError`` inside);
* a sampler plugin whose output breaks the contract (``num_accepted = 99``, a token outside
  [0, V), a wrong shape or dtype, not a dict) is refused with an error naming it, where it
  used to run to completion with garbage tokens;
* ``stats.tokens_per_s`` excludes one-time JAX compilation, reported as ``compile_time_s``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specjax
from specjax import registry
from specjax.generate.checks import PluginOutputError

V = 96  # shared with the other integration tests: the loop's compilations are shared


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, seed=0)
    return target, perturbed_copy(target, noise=0.3, seed=1)


PROMPT = torch.tensor([[5, 17, 42, 8, 23]])


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("which", "value", "match"),
    [
        ("target", None, r"target: expected a transformers causal LM \(a torch.nn.Module\), got NoneType"),
        (
            "draft",
            None,
            r"draft: expected a transformers causal LM, a drafter object or a drafter name \(.*\), "
            r"got NoneType",
        ),
        ("target", "gpt2", r"target: expected a transformers causal LM \(a torch.nn.Module\), got str"),
        ("draft", torch.nn.Sequential(), r"draft: expected a transformers causal LM with parameters, got a Sequential"),
        (
            "target",
            torch.nn.Linear(2, 2),
            r"target: expected a transformers causal LM \(with a config and input "
            r"embeddings\), got Linear",
        ),
    ],
)
def test_models_that_are_not_models_are_type_errors(pair, which, value, match):
    target, draft = pair
    args = {"target": target, "draft": draft, which: value}
    with pytest.raises(TypeError, match=match):
        specjax.speculative_generate(args["target"], args["draft"], PROMPT, max_new_tokens=2)


def test_an_all_padding_row_is_named(pair):
    target, draft = pair
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()
    with pytest.raises(ValueError, match=r"attention_mask: row 1 of the batch is all padding \(no real token\)"):
        specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=2)


class _ForwardCounter:
    def __init__(self, *models):
        self.calls = 0
        self.handles = [m.register_forward_pre_hook(self._hook) for m in models]

    def _hook(self, *_):
        self.calls += 1

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prompt_plus_max_new_tokens_beyond_the_position_limit_is_refused_before_any_forward(tiny_lm, arch):
    limit = 16
    extra = {"n_positions": limit} if arch == "gpt2" else {"max_position_embeddings": limit}
    target = tiny_lm(arch, vocab_size=V, layers=1, seed=0, **extra)
    draft = tiny_lm(arch, vocab_size=V, layers=1, seed=1, **extra)
    ids = torch.tensor([[0, 0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])  # 10 real tokens, padded to 12
    mask = (ids != 0).long()
    counter = _ForwardCounter(target, draft)
    try:
        with pytest.raises(
            ValueError,
            match=r"max_new_tokens: the longest prompt \(10 tokens\) plus max_new_tokens "
            r"= 7 needs 17 positions, more than the target's limit of 16",
        ):
            specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=7, num_draft_tokens=3)
        assert counter.calls == 0
        # exactly at the limit it runs (positions count real tokens, not padding)
        out = specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=6, num_draft_tokens=3)
        assert int(out.num_new_tokens[0]) == 6
        want = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(out.sequences, want)
    finally:
        counter.remove()


def test_the_draft_position_limit_is_checked_too(tiny_lm):
    target = tiny_lm("gpt2", vocab_size=V, layers=1, seed=0)
    draft = tiny_lm("gpt2", vocab_size=V, layers=1, seed=1, n_positions=8)
    with pytest.raises(ValueError, match=r"more than the draft's limit of 8"):
        specjax.speculative_generate(target, draft, PROMPT, max_new_tokens=4)


# --------------------------------------------------------------------------- sampler outputs


def _good(*args, validate=True):
    return specjax.load_sampler("numpy")(*args, validate=validate)


def returns_99(*args, validate=True):
    out = _good(*args, validate=validate)
    return {"num_accepted": np.full_like(out.num_accepted, 99), "tokens": out.tokens}


def returns_out_of_vocabulary(*args, validate=True):
    out = _good(*args, validate=validate)
    tokens = out.tokens.copy()
    tokens[:, 0] = V + 5
    return {"num_accepted": np.zeros_like(out.num_accepted), "tokens": tokens}


def returns_minus_one(*args, validate=True):
    out = _good(*args, validate=validate)
    tokens = out.tokens.copy()
    tokens[:, 0] = -1
    return {"num_accepted": np.zeros_like(out.num_accepted), "tokens": tokens}


def returns_float_tokens(*args, validate=True):
    out = _good(*args, validate=validate)
    return {"num_accepted": out.num_accepted, "tokens": out.tokens.astype(np.float32)}


def returns_short_tokens(*args, validate=True):
    out = _good(*args, validate=validate)
    return {"num_accepted": out.num_accepted, "tokens": out.tokens[:, :1]}


def returns_a_tuple(*args, validate=True):
    out = _good(*args, validate=validate)
    return out.num_accepted, out.tokens


def returns_negative_count(*args, validate=True):
    out = _good(*args, validate=validate)
    return {"num_accepted": np.full_like(out.num_accepted, -1), "tokens": out.tokens}


NAME = __name__


@pytest.mark.parametrize(
    ("sampler", "match"),
    [
        (returns_99, rf"sampler {NAME}.returns_99 returned num_accepted = 99 for row 0, expected a value in \[0, 4\]"),
        (returns_negative_count, r"returns_negative_count returned num_accepted = -1 for row 0, expected a value in"),
        (
            returns_out_of_vocabulary,
            rf"returns_out_of_vocabulary returned token {V + 5} at row 0, position 0, expected "
            rf"an id in \[0, V\) = \[0, {V}\)",
        ),
        (returns_minus_one, r"returns_minus_one returned token -1 at row 0, position 0"),
        (returns_float_tokens, r"returns_float_tokens returned tokens of dtype float32, expected integers"),
        (returns_short_tokens, r"returns_short_tokens returned tokens of shape \(1, 1\), expected \(1, 5\)"),
        (returns_a_tuple, r"returns_a_tuple returned tuple, expected a dict with 'num_accepted' and 'tokens'"),
    ],
)
def test_a_sampler_breaking_its_contract_is_named(pair, sampler, match):
    target, draft = pair
    with pytest.raises(PluginOutputError, match=match):
        # the fixed schedule: every step drafts 4 tokens (the messages name k_b = 4)
        specjax.speculative_generate(
            target,
            draft,
            PROMPT,
            max_new_tokens=12,
            num_draft_tokens=4,
            temperature=1.0,
            sampler=sampler,
            adaptive=False,
        )


def test_a_registered_sampler_is_named_by_its_name(pair):
    target, draft = pair
    registry.register_sampler("reliability_returns_99", returns_99)
    try:
        with pytest.raises(PluginOutputError, match=r"sampler 'reliability_returns_99' returned num_accepted = 99"):
            specjax.speculative_generate(
                target, draft, PROMPT, max_new_tokens=12, temperature=1.0, sampler="reliability_returns_99"
            )
    finally:
        registry._samplers.registered.pop("reliability_returns_99", None)


def test_the_checked_samplers_still_give_the_target_greedy_output(pair):
    target, draft = pair
    want = target.generate(PROMPT, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for sampler in ("numpy", "torch", _good):
        out = specjax.speculative_generate(target, draft, PROMPT, max_new_tokens=10, sampler=sampler)
        assert torch.equal(out.sequences, want)


# --------------------------------------------------------------------------- one-time compilation


def test_tokens_per_s_excludes_one_time_compilation(tiny_lm):
    vocab = 83  # a vocabulary no other test uses: this process has not compiled these shapes
    target = tiny_lm("llama", vocab_size=vocab, layers=1, seed=0)
    draft = tiny_lm("llama", vocab_size=vocab, layers=1, seed=1)
    # a fixed draft length: the same shapes in both calls (the adaptive one picks by measured costs)
    kwargs = dict(max_new_tokens=6, num_draft_tokens=2, temperature=0.7, seed=3, adaptive=False)
    first = specjax.speculative_generate(target, draft, PROMPT, **kwargs).stats
    again = specjax.speculative_generate(target, draft, PROMPT, **kwargs).stats
    assert 0 < first.compile_time_s < first.wall_time_s
    # tokens/s is over the wall time without (at least) the compile time
    assert first.tokens_per_s >= first.new_tokens / (first.wall_time_s - first.compile_time_s) * (1 - 1e-9)
    assert again.compile_time_s == 0  # every shape seen: nothing compiles
    assert "compile_time_s" in first.as_dict()
