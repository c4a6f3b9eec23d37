"""Logits processors inside the loop (``speculative_generate(..., logits_processor=..., repetition_penalty=...)``).

What is checked, each against transformers itself:

* greedy output equals ``target.generate`` with the same options, token for
  token, at B = 1 and on a ragged left-padded batch, with a model drafter, the
  n-gram drafter (point masses: the target's side only), the hybrid and an EAGLE
  head; each option is chosen so that it changes the plain greedy output
  (asserted), so a loop that ignored it would fail;
* the same through the drop-in (``generate(custom_generate=speculative_decoding)``),
  which now passes transformers' prepared processors to the loop;
* the chain :func:`build_processors` builds is, processor for processor, the one
  ``GenerationMixin._get_logits_processor`` builds for the same options;
* bad input raises errors naming the argument (or the processor).

The sampling law with processors is tested in ``test_processors_stats.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import logits_process as lp

import specjax
from specjax.generate.checks import PluginOutputError
from specjax.generate.processors import build_processors, split_prepared
from specjax.plugin.hf import speculative_decoding

V = 96  # shared with the other integration tests (the loop's JAX compilations are shared)
NEW = 16
LENGTHS = (5, 1, 7, 3)


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, hidden=32, seed=0)
    return target, perturbed_copy(target, noise=0.05, seed=3)


def eagle(target) -> Any:
    from specjax.drafters import EagleDrafter
    from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

    head = EagleHead(EagleConfig(target.config.hidden_size, 4, 2, 64, V, 48))
    init_weights(head, 0)
    return EagleDrafter(head.eval())


def drafter(kind: str, target, draft) -> Any:
    from specjax.drafters import HybridDrafter, ModelDrafter, NgramDrafter

    return {
        "model": lambda: draft,
        "ngram": lambda: NgramDrafter(min_n=1),
        "hybrid": lambda: HybridDrafter(NgramDrafter(min_n=1), ModelDrafter(draft)),
        "eagle": lambda: eagle(target),
    }[kind]()


class BanLast:
    """A prefix-dependent processor of the caller's: bans repeating the last token."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.scatter(1, input_ids[:, -1:], -float("inf"))


def options_for(case: str, plain_new: torch.Tensor) -> dict[str, Any]:
    """generate options for ``case``, picked from the plain greedy continuation ``plain_new`` i64[B, NEW] so that
    each changes it."""
    first = plain_new[:, 0].tolist()
    later = plain_new[:, 3].tolist()
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[t] for t in sorted(set(later))] + [[3, 4]]),
        "suppress_tokens": dict(suppress_tokens=sorted(set(later)), begin_suppress_tokens=sorted(set(first))),
        # the plain continuation's 3rd token as EOS ends it there; min_new_tokens keeps it going
        "min_new_tokens": dict(eos_token_id=int(plain_new[0, 2]), min_new_tokens=10),
        "forced_eos_token_id": dict(eos_token_id=7, forced_eos_token_id=7),
        "custom": dict(logits_processor=LogitsProcessorList([BanLast()])),
        # a user's penalty processor without the built one's padding rule: it penalises the pad id too
        "custom_penalty": dict(logits_processor=LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(1.5)])),
        "mixed": dict(repetition_penalty=1.2, no_repeat_ngram_size=3, logits_processor=[BanLast()]),
    }[case]


def hf_generate(target, ids, mask, **options) -> torch.Tensor:
    return target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=0, **options)


CASES = [
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "suppress_tokens",
    "min_new_tokens",
    "forced_eos_token_id",
    "custom",
    "custom_penalty",
    "mixed",
]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("case", CASES)
def test_greedy_matches_generate_with_the_same_options(case, batch, pair, left_padded):
    target, draft = pair
    ids, mask = left_padded(LENGTHS if batch > 1 else (6,), vocab_size=V, seed=11)
    plain = hf_generate(target, ids, mask)
    options = options_for(case, plain[:, ids.shape[1] :])
    ref = hf_generate(target, ids, mask, **options)
    assert not torch.equal(ref, plain), f"{case} does not change the greedy output: the case tests nothing"
    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, num_draft_tokens=4, adaptive=False, **options
    )
    assert torch.equal(out.sequences, ref), f"\n{out.sequences[:, ids.shape[1] :]}\n{ref[:, ids.shape[1] :]}"
    assert out.stats.draft_tokens_proposed > 0 and out.stats.processor_time_s > 0


@pytest.mark.parametrize("kind", ["ngram", "hybrid", "eagle"])
@pytest.mark.parametrize("case", ["repetition_penalty", "custom"])
def test_greedy_matches_generate_with_other_drafters(kind, case, pair, left_padded):
    target, draft = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)
    plain = hf_generate(target, ids, mask)
    options = options_for(case, plain[:, ids.shape[1] :])
    ref = hf_generate(target, ids, mask, **options)
    assert not torch.equal(ref, plain)
    out = specjax.speculative_generate(
        target, drafter(kind, target, draft), ids, mask, max_new_tokens=NEW, num_draft_tokens=4, **options
    )
    assert torch.equal(out.sequences, ref), f"\n{out.sequences[:, ids.shape[1] :]}\n{ref[:, ids.shape[1] :]}"


def test_greedy_rows_of_a_mixed_batch_match_generate(pair, left_padded):
    """Per-row temperatures: the greedy rows of a sampled batch (the fused JAX step, not the greedy shortcut) equal
    greedy ``generate`` with the same processors."""
    target, draft = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)
    options = dict(repetition_penalty=1.5, logits_processor=[BanLast()])
    ref = hf_generate(target, ids, mask, **options)
    assert not torch.equal(ref, hf_generate(target, ids, mask))
    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, temperature=[0.0, 0.7, 0.0, 1.0], adaptive=False, **options
    )
    for row in (0, 2):
        assert torch.equal(out.sequences[row], ref[row])


def test_a_ragged_batch_of_8_calls_each_built_in_once_a_batch(pair, left_padded):
    """B = 8 ragged rows sampled with a repetition penalty and min-p (the chain: the penalty, temperature, min-p,
    transformers' classes): each is called once per draft position and once for the target's positions of a step,
    at most 3 (G + 1) calls a step. The per-length path calls each once per distinct prefix length, which the
    target's positions alone (G + 1 lengths a row, rows apart) exceed."""
    target, draft = pair
    g = 4
    ids, mask = left_padded((5, 1, 7, 3, 6, 2, 4, 8), vocab_size=V, seed=11)
    out = specjax.speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=NEW,
        num_draft_tokens=g,
        adaptive=False,
        temperature=0.7,
        repetition_penalty=1.1,
        min_p=0.05,
        seed=0,
    )
    s = out.stats
    assert s.draft_tokens_proposed > 0 and 0 < s.acceptance_rate < 1  # rows accept different counts
    assert 3 * s.steps <= s.processor_calls <= 3 * (g + 1) * s.steps


def test_forced_bos_on_a_one_token_prompt(pair):
    target, draft = pair
    ids, mask = torch.tensor([[9]]), torch.ones((1, 1), dtype=torch.long)
    ref = hf_generate(target, ids, mask, forced_bos_token_id=5)
    assert int(ref[0, 1]) == 5 and not torch.equal(ref, hf_generate(target, ids, mask))
    out = specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=NEW, forced_bos_token_id=5)
    assert torch.equal(out.sequences, ref)


def test_the_drafter_sees_processed_logits(pair, left_padded):
    """A ban on every token but a few: the model drafter proposes only allowed tokens, so all it proposes is
    tested against a target that allows the same ones (a drafter that drew from raw logits would be rejected
    almost always)."""
    target, _ = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)
    allowed = [2, 3, 5, 7]
    suppress = [t for t in range(V) if t not in allowed]
    out = specjax.speculative_generate(
        target, target, ids, mask, max_new_tokens=NEW, adaptive=False, suppress_tokens=suppress
    )
    assert set(out.sequences[:, ids.shape[1] :].flatten().tolist()) <= set(allowed)
    assert out.stats.acceptance_rate == 1.0  # the target as its own drafter: same processed distributions


# --------------------------------------------------------------------------- the drop-in


@pytest.mark.parametrize("batch", [1, 4])
def test_the_drop_in_passes_transformers_processors_to_the_loop(batch, pair, left_padded):
    target, draft = pair
    ids, mask = left_padded(LENGTHS if batch > 1 else (6,), vocab_size=V, seed=11)
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, logits_processor=LogitsProcessorList([BanLast()]))
    ref = hf_generate(target, ids, mask, **options)
    assert not torch.equal(ref, hf_generate(target, ids, mask))
    got = hf_generate(target, ids, mask, custom_generate=speculative_decoding, draft_model=draft, **options)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("extra", [{}, dict(min_p=0.1), dict(typical_p=0.9)], ids=["top_k", "min_p", "typical_p"])
def test_the_drop_in_sampling_with_top_k_1_is_greedy_with_the_penalty(extra, pair):
    """Sampling at top-k 1 is deterministic: with the penalty it must equal greedy ``generate`` with the penalty,
    also when min-p or typical-p put transformers' warpers into the loop's chain (the acceptance step then samples
    at temperature 1)."""
    target, draft = pair
    prompt = torch.tensor([[5, 17, 42, 8, 23]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=NEW, repetition_penalty=1.5, pad_token_id=0)
    got = target.generate(
        prompt,
        do_sample=True,
        top_k=1,
        max_new_tokens=NEW,
        repetition_penalty=1.5,
        pad_token_id=0,
        custom_generate=speculative_decoding,
        draft_model=draft,
        **extra,
    )
    assert torch.equal(got, ref)


def test_a_prefix_functions_batch_ids_stay_right(pair, left_padded):
    """``PrefixConstrainedLogitsProcessor`` passes ``prefix_allowed_tokens_fn`` the row's index: the loop calls
    processors with the whole batch in its order, so each row keeps its own rule while the rows sit at different
    lengths (a call on the rows of one length only would hand them other rows' indices)."""
    target, draft = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)

    def allowed(batch_id: int, sent: torch.Tensor) -> list[int]:
        return [t for t in range(V) if (t + batch_id + int(sent[-1])) % 3 == 0]

    ref = hf_generate(target, ids, mask, prefix_allowed_tokens_fn=allowed)
    processor = lp.PrefixConstrainedLogitsProcessor(allowed, 1)
    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, adaptive=False, logits_processor=[processor]
    )
    assert torch.equal(out.sequences, ref)
    assert 0 < out.stats.acceptance_rate < 1  # rows accept different counts: they sit at different lengths


def test_the_drop_in_refuses_classifier_free_guidance(pair):
    target, draft = pair
    with pytest.raises(ValueError, match=r"UnbatchedClassifierFreeGuidanceLogitsProcessor \(guidance_scale\)"):
        target.generate(
            torch.tensor([[5, 6, 7]]),
            custom_generate=speculative_decoding,
            draft_model=draft,
            max_new_tokens=3,
            guidance_scale=1.5,
        )


SPLITS = [
    # (the tail transformers prepares after its processors, do_sample) -> (tail left in the chain, parameters)
    ([], False, 0, (0.0, None, None)),
    ([lp.TemperatureLogitsWarper(0.7), lp.TopKLogitsWarper(5)], True, 0, (0.7, 5, None)),
    ([lp.TopPLogitsWarper(0.9)], True, 0, (1.0, None, 0.9)),
    ([lp.TemperatureLogitsWarper(0.7), lp.MinPLogitsWarper(0.1)], True, 2, (1.0, None, None)),
    ([lp.TopKLogitsWarper(5, filter_value=-1e4)], True, 1, (1.0, None, None)),
    ([lp.TopPLogitsWarper(0.9, min_tokens_to_keep=2)], True, 1, (1.0, None, None)),
    ([lp.TopKLogitsWarper(5), lp.TemperatureLogitsWarper(0.7)], True, 2, (1.0, None, None)),
    ([lp.LogitNormalization()], False, 1, (0.0, None, None)),
]


@pytest.mark.parametrize(("tail", "sample", "kept", "params"), SPLITS)
def test_split_prepared(tail, sample, kept, params):
    """The acceptance step takes temperature / top-k / top-p only when it implements them exactly as prepared."""
    head = [lp.RepetitionPenaltyLogitsProcessor(1.2)]
    chain, got = split_prepared(head + tail, sample)
    assert chain == head + tail[len(tail) - kept :] and got == params


# --------------------------------------------------------------------------- the chain is transformers'


OPTION_SETS = [
    dict(repetition_penalty=1.2, no_repeat_ngram_size=2, bad_words_ids=[[4]], suppress_tokens=[3]),
    dict(min_new_tokens=3, forced_bos_token_id=1, forced_eos_token_id=2, begin_suppress_tokens=[5]),
    dict(repetition_penalty=1.1, min_p=0.05, typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.01),
]


@pytest.mark.parametrize("options", OPTION_SETS)
def test_the_chain_is_the_one_generate_builds(options, pair, left_padded):
    target, _ = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)
    custom = [BanLast()]
    chain, params = build_processors(
        custom,
        options,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        eos_ids={2},
        temperature=0.7,
        top_k=20,
        top_p=0.9,
    )
    config = GenerationConfig(
        do_sample=True, temperature=0.7, top_k=20, top_p=0.9, max_length=ids.shape[1] + NEW, **options
    )
    target._prepare_special_tokens(config, True, device=ids.device)
    config.eos_token_id = 2
    config._eos_token_tensor = torch.tensor([2])
    ref = target._get_logits_processor(
        config, ids.shape[1], None, None, LogitsProcessorList(custom), ids.device, {"attention_mask": mask}
    )
    warpers = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper)
    post = any(k in options for k in ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"))
    expected = ref if post else [p for p in ref if not isinstance(p, warpers)]
    assert [type(p) for p in chain] == [type(p) for p in expected]
    assert params == ((1.0, None, None) if post else (0.7, 20, 0.9))
    # and they process alike (two rows, one scores row each)
    scores = torch.randn(len(LENGTHS), V)
    prefix = torch.cat([ids, ids[:, :2]], dim=1)
    want, got = scores.clone(), scores.clone()
    for p in expected:
        want = p(prefix, want)
    for p in chain:
        got = p(prefix, got)
    assert torch.equal(got, want)


# --------------------------------------------------------------------------- bad input


def test_the_processors_run_only_when_asked(pair, monkeypatch):
    """Without processors the loop takes its plain path: the module's classes are never built."""
    from specjax.generate import processors

    def boom(*args, **kwargs):
        raise AssertionError("built without processors")

    monkeypatch.setattr(processors.LoopProcessors, "__init__", boom)
    target, draft = pair
    specjax.speculative_generate(target, draft, torch.tensor([[5, 6, 7]]), max_new_tokens=4)


class WrongShape:
    def __call__(self, input_ids, scores):
        return scores[:, :-1]


ERRORS = [
    (
        dict(logits_processor=BanLast()),
        TypeError,
        r"logits_processor: expected a transformers LogitsProcessorList",
    ),
    (dict(logits_processor=[3]), TypeError, r"logits_processor: item 0 is a int"),
    (
        dict(logits_processor=[lp.SynthIDTextWatermarkLogitsProcessor(2, [1, 2], 8, 0, 8, torch.device("cpu"))]),
        ValueError,
        r"logits_processor: item 0, SynthIDTextWatermarkLogitsProcessor, keeps state from call to call",
    ),
    (
        dict(logits_processor=[lp.RepetitionPenaltyLogitsProcessor(1.2, torch.tensor([0, 0, 0]))]),
        ValueError,
        r"logits_processor RepetitionPenaltyLogitsProcessor: prompt_ignore_length has 3 entries, expected one per "
        r"batch row \(2\)",
    ),
    (dict(repetition_penalty=-1.0), ValueError, r"repetition_penalty: .*strictly positive"),
    (dict(repetition_penalty="high"), ValueError, r"repetition_penalty: expected a number, got 'high'"),
    (dict(no_repeat_ngram_size=2.5), ValueError, r"no_repeat_ngram_size: expected an integer"),
    (dict(bad_words_ids=[7]), ValueError, r"bad_words_ids: "),
    (dict(temperature=0.7, min_p=1.5), ValueError, r"min_p: "),
    (dict(temperature=[0.7, 0.9], min_p=0.1), ValueError, r"temperature: min_p, typical_p, .* per-row values"),
    (dict(logits_processor=[WrongShape()]), PluginOutputError, r"logits_processor WrongShape returned \(2, 95\)"),
]


@pytest.mark.parametrize(("options", "error", "message"), ERRORS, ids=[m[:30] for _, _, m in ERRORS])
def test_bad_processor_input_is_refused(options, error, message, pair):
    target, draft = pair
    with pytest.raises(error, match=message):
        specjax.speculative_generate(target, draft, torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=4, **options)


def test_a_row_processor_sees_every_positions_prefix(pair, left_padded):
    """The row-processor hook (grammars plug in here): each scores row comes with its batch row, its exact
    prefix and how much of it is committed; the outputs are generate's with the same rule."""
    target, draft = pair
    ids, mask = left_padded(LENGTHS, vocab_size=V, seed=11)
    seen: list[tuple[int, tuple[int, ...], int]] = []

    class BanLastRows:
        def start(self, batch, prompt_length):
            assert (batch, prompt_length) == ids.shape

        def process_rows(self, prefixes, scores):
            for n in range(len(prefixes.rows)):
                seen.append((int(prefixes.rows[n]), tuple(prefixes.prefix(n).tolist()), int(prefixes.committed[n])))
            return scores.scatter(1, torch.as_tensor(prefixes.ids[:, -1:]), -float("inf"))

    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=NEW, adaptive=False, logits_processor=[BanLastRows()]
    )
    ref = hf_generate(target, ids, mask, logits_processor=LogitsProcessorList([BanLast()]))
    assert torch.equal(out.sequences, ref)
    final = {b: out.sequences[b].tolist() for b in range(len(LENGTHS))}
    p = ids.shape[1]
    for row, prefix, committed in seen:
        assert p <= committed <= len(prefix)
        assert list(prefix[:committed]) == final[row][:committed]  # the committed part is what the row kept
    assert any(committed < len(prefix) for _, prefix, committed in seen)  # draft positions were processed
    assert np.unique([len(prefix) for _, prefix, _ in seen]).size > 1
