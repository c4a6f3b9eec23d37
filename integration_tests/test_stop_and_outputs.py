"""Stop strings, stopping criteria and per-token outputs against transformers' own ``generate``.

* ``stop_strings`` and ``StoppingCriteria``: greedy output equals ``target.generate`` with the same
  options, token for token, at B = 1 and on a ragged batch, with a drafter that proposes perfectly
  (the target itself: every step accepts a run of G + 1 tokens, and the stop is asserted to fall
  inside such a run), one that is often rejected (rows gain different counts per step) and
  prompt lookup (``"ngram"``);
* ``output_scores`` / ``output_logits``: equal to ``generate``'s per-step tensors (greedy) within
  float tolerance, zeros where a row had ended; ``output_logprobs`` is their log-softmax at the
  emitted tokens; sampled scores equal transformers' warpers applied to the returned logits;
* the ``custom_generate`` drop-in passes all of these through;
* bad arguments and a criterion's bad answer raise errors that name them.

The tokenizer is character-level (printable ASCII, id ``i`` = ``chr(31 + i)``), so stop strings
span several tokens as they do with real tokenizers.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import StopStringCriteria

import specjax
from specjax.generate.checks import PluginOutputError
from specjax.plugin.custom_generate import CUSTOM_GENERATE_DIR, speculative_decoding

V = 96  # shared with the other integration tests, so the loop's JAX compilations are shared
G = 4
N_NEW = 16
EOS = 0  # == the pad id: generate pads rows that stopped only when an EOS criterion exists
PROMPTS = {1: (6,), 3: (5, 2, 7)}


@pytest.fixture(scope="module")
def tok(char_tokenizer):
    return char_tokenizer


@pytest.fixture(scope="module")
def models(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, seed=1, init_range=0.3)  # varied greedy output
    return {"same": target, "perturbed": perturbed_copy(target, noise=0.05, seed=3), "target": target}


def plain(target, ids, mask, **options):
    return target.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=N_NEW,
        pad_token_id=0,
        eos_token_id=EOS,
        **options,
    )


def spec(target, draft, ids, mask, **options):
    options.setdefault("adaptive", False)  # G draft tokens every step: runs of G + 1 with the "same" draft
    return specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=N_NEW, num_draft_tokens=G, eos_token_id=EOS, pad_token_id=0, **options
    )


class Chunks:
    """``on_tokens`` callback: each row's tokens as the steps committed them."""

    def __init__(self) -> None:
        self.rows: dict[int, list[list[int]]] = {}

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.rows.setdefault(row, []).append(list(tokens))


def new_lengths(out, prompt_width: int) -> list[int]:
    """Tokens each row generated (``out.num_new_tokens``, checked: only padding after them)."""
    lengths = out.num_new_tokens.tolist()
    for b, n in enumerate(lengths):
        assert not out.sequences[b, prompt_width + n :].any(), (b, n, out.sequences[b])
    return lengths


def assert_cut_inside_a_run(chunks: Chunks, lengths: list[int]) -> None:
    """Some row that stopped early got a last step shorter than the G + 1 tokens the step accepted."""
    cut = [r for r, c in chunks.rows.items() if lengths[r] < N_NEW and len(c[-1]) < G + 1]
    assert cut, chunks.rows
    for r in cut:
        assert all(len(c) == G + 1 for c in chunks.rows[r][:-1]), chunks.rows[r]


# --------------------------------------------------------------------------- #
# Stop strings and criteria: greedy identity
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("draft_kind", ["same", "perturbed", "ngram"])
def test_stop_strings_match_generate(batch, draft_kind, models, tok, left_padded):
    target = models["target"]
    ids, mask = left_padded(PROMPTS[batch], vocab_size=V, seed=11)
    free = plain(target, ids, mask)[:, ids.shape[1] :]
    # row 0: a string completed by its 8th token (inside the second run of G + 1 tokens); others: by their 10th
    stops = [tok.decode(free[0, 5:8])] + [tok.decode(free[b, 8:10]) for b in range(1, batch)]
    ref = plain(target, ids, mask, stop_strings=stops, tokenizer=tok)
    chunks = Chunks()
    draft = "ngram" if draft_kind == "ngram" else models[draft_kind]
    out = spec(target, draft, ids, mask, stop_strings=stops, target_tokenizer=tok, on_tokens=chunks)
    assert torch.equal(out.sequences, ref), f"\n{out.sequences[:, ids.shape[1] :]}\n{ref[:, ids.shape[1] :]}"
    lengths = new_lengths(out, ids.shape[1])
    assert all(n < N_NEW for n in lengths), lengths  # every row stopped at its string
    if draft_kind == "same":
        assert out.stats.acceptance_rate == 1.0
        assert_cut_inside_a_run(chunks, lengths)
    elif draft_kind == "perturbed":
        assert 0 < out.stats.acceptance_rate < 1


class SumStop(StoppingCriteria):
    """Reads the whole row, its left padding included."""

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.sum(dim=-1) % 11 == 0


class LengthStop(StoppingCriteria):
    """Reads the row's length and its first id (the prompts' padding): plain decoding's layout exactly."""

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, 0] + input_ids.shape[1]) % 9 == 0


class RepeatStop(StoppingCriteria):
    """Reads the last two ids, and says so (``stop_window``): asked for all prefixes at once."""

    stop_window = 2

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] % 5 == input_ids[:, -2] % 5


CRITERIA = {
    "whole-row": [SumStop()],
    "length": [LengthStop()],
    "windowed": [RepeatStop()],
    "several": [RepeatStop(), SumStop()],
}


@pytest.mark.parametrize("kind", CRITERIA)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("draft_kind", ["same", "perturbed"])
def test_stopping_criteria_match_generate(kind, batch, draft_kind, models, left_padded):
    target = models["target"]
    ids, mask = left_padded(PROMPTS[batch], vocab_size=V, seed=11)
    ref = plain(target, ids, mask, stopping_criteria=StoppingCriteriaList(CRITERIA[kind]))
    chunks = Chunks()
    out = spec(target, models[draft_kind], ids, mask, stopping_criteria=CRITERIA[kind], on_tokens=chunks)
    assert torch.equal(out.sequences, ref), f"\n{out.sequences[:, ids.shape[1] :]}\n{ref[:, ids.shape[1] :]}"
    lengths = new_lengths(out, ids.shape[1])
    assert min(lengths) < N_NEW, lengths  # the criterion stopped a row
    if draft_kind == "same":
        assert_cut_inside_a_run(chunks, lengths)


def test_a_criterions_bad_answer_names_it(models):
    class Scalar(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros((input_ids.shape[0], 2), dtype=torch.bool)

    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(PluginOutputError, match=r"stopping criterion .*Scalar returned Tensor of shape \(\d+, 2\)"):
        spec(models["target"], models["target"], ids, None, stopping_criteria=[Scalar()])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (dict(stop_strings="ab"), ValueError, r"stop_strings: needs the target's tokenizer"),
        (dict(stop_strings=[], target_tokenizer="tok"), ValueError, r"stop_strings: expected a non-empty string"),
        (dict(stop_strings=["a", ""], target_tokenizer="tok"), ValueError, r"stop_strings: expected a non-empty"),
        (
            dict(stop_strings="ab", target_tokenizer="not a tokenizer"),
            ValueError,
            r"stop_strings: transformers' StopStringCriteria cannot read the vocabulary of target_tokenizer",
        ),
        (dict(stopping_criteria=42), TypeError, r"stopping_criteria: expected a StoppingCriteria.*got int"),
        (dict(stopping_criteria=[SumStop(), 42]), TypeError, r"stopping_criteria: expected callables .*got .*int"),
        (dict(output_scores="yes"), TypeError, r"output_scores: expected True or False, got str"),
        (dict(output_logprobs=1), TypeError, r"output_logprobs: expected True or False, got int"),
    ],
)
def test_bad_arguments_are_refused(options, error, message, models):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(error, match=message):
        spec(models["target"], models["target"], ids, None, **options)


# --------------------------------------------------------------------------- #
# Scores, logits, log-probabilities
# --------------------------------------------------------------------------- #


def assert_per_step(got, want, lengths: list[int]) -> None:
    """``got`` equals ``want`` (generate's per-step tuple) where a row had a token, and is 0 after."""
    assert len(got) == len(want)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == torch.float32
        for b, n in enumerate(lengths):
            if t < n:
                torch.testing.assert_close(g[b], w[b], rtol=1e-5, atol=1e-4)
            else:
                assert not g[b].any()


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("draft_kind", ["same", "perturbed"])
def test_scores_and_logits_match_generate(batch, draft_kind, models, tok, left_padded):
    target = models["target"]
    ids, mask = left_padded(PROMPTS[batch], vocab_size=V, seed=11)
    free = plain(target, ids, mask)[:, ids.shape[1] :]
    stops = [tok.decode(free[b, 9:11]) for b in range(1, batch)]  # rows 1.. end early: zeros there
    options = dict(stop_strings=stops or None, tokenizer=tok)
    ref = plain(target, ids, mask, output_scores=True, output_logits=True, return_dict_in_generate=True, **options)
    out = spec(
        target,
        models[draft_kind],
        ids,
        mask,
        stop_strings=stops or None,
        target_tokenizer=tok,
        output_scores=True,
        output_logits=True,
        output_logprobs=True,
    )
    assert torch.equal(out.sequences, ref.sequences)
    lengths = new_lengths(out, ids.shape[1])
    assert_per_step(out.logits, ref.logits, lengths)
    assert_per_step(out.scores, ref.scores, lengths)
    assert out.logprobs is not None and out.logprobs.shape == (batch, len(ref.scores))
    new = ref.sequences[:, ids.shape[1] :]
    for b, n in enumerate(lengths):
        for t in range(len(ref.scores)):
            if t < n:
                want = torch.log_softmax(ref.scores[t][b], dim=-1)[new[b, t]]
                assert math.isclose(float(out.logprobs[b, t]), float(want), abs_tol=1e-4)
            else:
                assert math.isnan(float(out.logprobs[b, t]))
    if batch > 1:
        assert min(lengths) < N_NEW  # the zero rows were exercised


HAS_PROCESSORS = "repetition_penalty" in inspect.signature(specjax.speculative_generate).parameters


@pytest.mark.skipif(not HAS_PROCESSORS, reason="needs logits processors in the loop (issue 56 item 1)")
@pytest.mark.parametrize("options", [dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2, bad_words_ids=[[5]])])
@pytest.mark.parametrize("batch", [1, 3])
def test_scores_include_the_logits_processors(options, batch, models, left_padded):
    """Scores are the processed logits the verifier read; logits stay the target's raw ones."""
    target = models["target"]
    ids, mask = left_padded(PROMPTS[batch], vocab_size=V, seed=11)
    ref = plain(target, ids, mask, output_scores=True, output_logits=True, return_dict_in_generate=True, **options)
    out = spec(target, models["perturbed"], ids, mask, output_scores=True, output_logits=True, **options)
    assert torch.equal(out.sequences, ref.sequences)
    lengths = new_lengths(out, ids.shape[1])
    assert_per_step(out.scores, ref.scores, lengths)
    assert_per_step(out.logits, ref.logits, lengths)
    assert any(not torch.equal(s, g) for s, g in zip(out.scores, out.logits, strict=True))  # the processors acted


def test_outputs_are_none_unless_asked(models):
    out = spec(models["target"], models["target"], torch.tensor([[5, 6, 7]]), None)
    assert out.scores is None and out.logits is None and out.logprobs is None


@pytest.mark.parametrize("top_k", [None, 12])
def test_sampled_scores_are_the_warped_logits(top_k, models, left_padded):
    """Processed scores = transformers' temperature / top-k / top-p warpers on the returned logits."""
    ids, mask = left_padded(PROMPTS[3], vocab_size=V, seed=11)
    temperature, top_p = [0.7, 1.5, 0.0], 0.9
    out = spec(
        models["target"],
        models["perturbed"],
        ids,
        mask,
        temperature=torch.tensor(temperature),
        top_k=top_k,
        top_p=top_p,
        seed=5,
        output_scores=True,
        output_logits=True,
        output_logprobs=True,
    )
    new = out.sequences[:, ids.shape[1] :]
    filtered = 0
    for b, t_b in enumerate(temperature):
        warp = LogitsProcessorList(
            [TemperatureLogitsWarper(t_b or 1.0)]
            + ([TopKLogitsWarper(top_k)] if top_k else [])
            + [TopPLogitsWarper(top_p)]
        )
        for t in range(int(out.num_new_tokens[b])):
            logits = out.logits[t][b : b + 1]
            want = logits if t_b == 0 else warp(new[b : b + 1, :t], logits)
            got = out.scores[t][b : b + 1]
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)], rtol=1e-5, atol=1e-5)
            assert torch.isfinite(got[0, new[b, t]])  # the token was drawn from these scores
            filtered += int(torch.isinf(got).sum())
            want_lp = torch.log_softmax(want[0], dim=-1)[new[b, t]]
            assert math.isclose(float(out.logprobs[b, t]), float(want_lp), abs_tol=1e-5)
    assert filtered > 0  # top-k / top-p cut something


# --------------------------------------------------------------------------- #
# The drop-in
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("way", ["callable", "directory"])
def test_dropin_passes_stops_and_outputs_through(way, models, tok, left_padded):
    target, draft = models["target"], models["perturbed"]
    ids, mask = left_padded(PROMPTS[3], vocab_size=V, seed=11)
    free = plain(target, ids, mask)[:, ids.shape[1] :]
    stops = [tok.decode(free[0, 5:8]), tok.decode(free[1, 9:11])]
    outputs = dict(output_scores=True, output_logits=True, return_dict_in_generate=True)
    ref = plain(
        target,
        ids,
        mask,
        stop_strings=stops,
        tokenizer=tok,
        stopping_criteria=StoppingCriteriaList([LengthStop()]),
        **outputs,
    )
    if way == "callable":  # transformers hands a callable no tokenizer: the stop strings come as a criterion
        criteria = StoppingCriteriaList([LengthStop(), StopStringCriteria(tok, stops)])
        spec_options = dict(custom_generate=speculative_decoding, draft_model=draft, stopping_criteria=criteria)
    else:
        spec_options = dict(
            custom_generate=CUSTOM_GENERATE_DIR,
            trust_remote_code=True,
            assistant_model=draft,
            stop_strings=stops,
            tokenizer=tok,
            stopping_criteria=StoppingCriteriaList([LengthStop()]),
        )
    got = plain(target, ids, mask, **spec_options, **outputs)
    assert torch.equal(got.sequences, ref.sequences)
    # generated tokens per row (were a row to end with EOS = pad = 0, assert_per_step would see its scores there)
    lengths = [int((row != 0).nonzero().max()) + 1 for row in ref.sequences[:, ids.shape[1] :]]
    assert min(lengths) < N_NEW
    assert_per_step(got.scores, ref.scores, lengths)
    assert_per_step(got.logits, ref.logits, lengths)


def test_dropin_directory_needs_the_tokenizer_for_stop_strings(models):
    with pytest.raises(ValueError, match=r"stop_strings: needs the target's tokenizer .*; pass tokenizer="):
        plain(
            models["target"],
            torch.tensor([[5, 6, 7]]),
            None,
            custom_generate=CUSTOM_GENERATE_DIR,
            trust_remote_code=True,
            assistant_model=models["target"],
            stop_strings=["ab"],
        )


def test_dropin_max_time_passes_through(models):
    ids = torch.tensor([[5, 6, 7]])
    ref = plain(models["target"], ids, None, max_time=600.0)
    got = plain(
        models["target"],
        ids,
        None,
        max_time=600.0,
        custom_generate=speculative_decoding,
        draft_model=models["perturbed"],
    )
    assert torch.equal(got, ref)


def test_dropin_still_refuses_attentions(models):
    with pytest.raises(ValueError, match=r"unsupported generation options: output_attentions=True"):
        plain(
            models["target"],
            torch.tensor([[5, 6, 7]]),
            None,
            custom_generate=speculative_decoding,
            draft_model=models["target"],
            output_attentions=True,
            return_dict_in_generate=True,
        )
