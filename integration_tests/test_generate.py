"""``speculative_generate`` on real transformers models (tiny configs, fixed seeds, offline).

What is checked, each against something independent of the loop:

* greedy output equals ``target.generate(do_sample=False)`` token for token, on
  Llama, GPT-2, Qwen2 and Mistral, at B=1 and B=4 (left padding, prompt lengths
  1..7), with a draft of another size and seed, with a perturbed copy of the
  target (rows accept different numbers of tokens in one step: asserted), and
  with the target itself (everything accepted);
* EOS inside an accepted draft ends that row exactly there; ``max_new_tokens``
  is never exceeded;
* the caches after the loop give the logits of a fresh forward pass over each
  row's whole sequence;
* bad input raises ``ValueError`` with a plain message;
* vocabularies that differ by padding only (136 vs 128, both ways);
* the statistics agree with counts rebuilt from the streamed tokens; the
  steps' times leave JAX compilation out (it is in ``compile_time_s``).

The sampling distribution is tested in ``test_generate_stats.py``. Every model
here has vocabulary 96 (except the padding tests), so the runs share the loop's
JAX compilations; set ``JAX_COMPILATION_CACHE_DIR`` to keep them across runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import specjax
from specjax.drafters import NgramDrafter

ARCHS = ("llama", "gpt2", "qwen2", "mistral")
VOCAB = 96
G = 4


def generate(*args, **kwargs):
    """``speculative_generate`` on the fixed schedule (G draft tokens every step) unless a test says otherwise.

    These tests check the loop's mechanics step by step (caches, counts,
    statistics); the adaptive draft length is tested in test_drafters.py.
    """
    kwargs.setdefault("adaptive", False)
    return specjax.speculative_generate(*args, **kwargs)


LENGTHS = (5, 1, 7, 3)  # B=4, left-padded to 7


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def pairs(tiny_lm, perturbed_copy) -> Callable[[str], dict[str, Any]]:
    """``pairs(arch)``: the target and three drafts of that architecture (built once)."""
    built: dict[str, dict[str, Any]] = {}

    def get(arch: str) -> dict[str, Any]:
        if arch not in built:
            target = tiny_lm(arch, layers=2, hidden=32, seed=0)
            built[arch] = {
                "target": target,
                "other": tiny_lm(arch, layers=1, hidden=16, seed=1),  # other size, other init
                "perturbed": perturbed_copy(target, noise=0.05, seed=3),  # agrees ~75% of the time
                "same": target,
            }
        return built[arch]

    return get


class StepRecorder:
    """``on_tokens`` callback that regroups the streamed tokens into steps.

    The loop calls ``on_tokens(row, tokens)`` once per active row per step, rows
    in increasing order; a row index that does not increase starts a new step.
    ``steps`` is a list of ``{row: tokens}``.
    """

    def __init__(self) -> None:
        self.steps: list[dict[int, list[int]]] = []
        self._prev = math.inf

    def __call__(self, row: int, tokens: list[int]) -> None:
        if row <= self._prev:
            self.steps.append({})
        self.steps[-1][row] = list(tokens)
        self._prev = row


def hf_greedy(target, ids, mask, max_new_tokens, eos_token_id=None) -> torch.Tensor:
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    return target.generate(
        ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs
    )


def row_sequence(ids, mask, out, row) -> list[int]:
    """Row ``row``'s prompt without padding followed by its generated tokens."""
    prompt = ids[row][mask[row].bool()].tolist()
    new = out.sequences[row, ids.shape[1] : ids.shape[1] + int(out.num_new_tokens[row])].tolist()
    return prompt + new


# --------------------------------------------------------------------------- #
# Greedy equals target.generate
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("draft_kind", ["other", "perturbed", "same"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_target_generate(arch, draft_kind, batch, pairs, left_padded):
    models = pairs(arch)
    target, draft = models["target"], models[draft_kind]
    ids, mask = left_padded(LENGTHS[:batch] if batch > 1 else (6,), vocab_size=VOCAB, seed=11)
    rec = StepRecorder()
    out = generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=G, on_tokens=rec)
    ref = hf_greedy(target, ids, mask, 12)
    assert out.sequences.dtype == torch.long
    assert out.sequences.shape == ref.shape
    assert torch.equal(out.sequences, ref), f"\n{out.sequences[:, ids.shape[1] :]}\n{ref[:, ids.shape[1] :]}"
    assert out.num_new_tokens.tolist() == [12] * batch
    stats = out.stats
    if draft_kind == "same":
        assert stats.acceptance_rate == 1.0
        assert stats.acceptance_rate_per_position == [1.0] * G
        assert stats.draft_tokens_accepted == stats.draft_tokens_proposed > 0
    if draft_kind == "perturbed" and batch > 1:
        assert 0.0 < stats.acceptance_rate < 1.0, stats
        assert ragged_steps(rec, batch, 12) >= 1, rec.steps


def ragged_steps(rec: StepRecorder, batch: int, max_new_tokens: int) -> int:
    """Steps in which all ``batch`` rows had a full draft of G tokens and gained different counts."""
    budget = dict.fromkeys(range(batch), max_new_tokens)
    ragged = 0
    for step in rec.steps:
        full = len(step) == batch and all(budget[r] > G for r in step)
        if full and len({len(t) for t in step.values()}) > 1:
            ragged += 1
        for r, t in step.items():
            budget[r] -= len(t)
    return ragged


# --------------------------------------------------------------------------- #
# EOS and max_new_tokens
# --------------------------------------------------------------------------- #


def _eos_mid_draft(ref_new: torch.Tensor, index: int) -> int | None:
    """A token at ``ref_new[0, index]`` that occurs neither earlier in row 0 nor anywhere in row 1."""
    tok = int(ref_new[0, index])
    if tok in ref_new[0, :index].tolist() or tok in ref_new[1].tolist() or tok == 0:
        return None
    return tok


def test_eos_inside_accepted_draft_ends_that_row_there(pairs, left_padded):
    target = pairs("llama")["target"]
    n_new = 12
    for seed in range(20):
        ids, mask = left_padded((4, 6), vocab_size=VOCAB, seed=seed)
        plain = hf_greedy(target, ids, mask, n_new)[:, ids.shape[1] :]
        eos = _eos_mid_draft(plain, 2)
        if eos is not None:
            break
    else:
        pytest.fail("no prompt pair gives a usable EOS token")
    rec = StepRecorder()
    out = generate(
        target,
        target,
        ids,
        mask,
        max_new_tokens=n_new,
        num_draft_tokens=G,
        eos_token_id=eos,
        pad_token_id=0,
        on_tokens=rec,
    )
    new = out.sequences[:, ids.shape[1] :]
    # row 0: the first step accepts the whole draft x_0..x_3; EOS is x_2, the row ends right after it
    assert rec.steps[0][0] == plain[0, :3].tolist()
    assert new[0, :3].tolist() == plain[0, :3].tolist()
    assert (new[0, 3:] == 0).all()
    assert out.num_new_tokens.tolist() == [3, n_new]
    # row 1 goes on, unaffected
    assert new[1].tolist() == plain[1].tolist()
    assert len(rec.steps) > 1 and all(0 not in s for s in rec.steps[1:])
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, n_new, eos_token_id=eos))


@pytest.mark.parametrize("draft_kind", ["perturbed", "other"])
def test_eos_matches_target_generate(draft_kind, pairs, left_padded):
    """With EOS ids that occur in the greedy continuations, output equals target.generate."""
    models = pairs("qwen2")
    target, draft = models["target"], models[draft_kind]
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=5)
    plain = hf_greedy(target, ids, mask, 14)[:, ids.shape[1] :]
    eos = [int(plain[0, 5]), int(plain[2, 9])]
    out = generate(target, draft, ids, mask, max_new_tokens=14, num_draft_tokens=G, eos_token_id=eos, pad_token_id=0)
    ref = hf_greedy(target, ids, mask, 14, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert int(out.num_new_tokens[0]) <= 6 and int(out.num_new_tokens[2]) <= 10


@pytest.mark.parametrize("draft_kind", ["perturbed", "other"])
def test_the_loop_tells_the_caches_whether_every_new_slot_is_valid(draft_kind, pairs, left_padded, monkeypatch):
    """The host-side flag the loop passes (no device sync) equals the validity mask, call by call.

    EOS ends two rows early (their slots turn invalid while the others go on),
    and rejections leave a second pending draft token, so both values occur.
    """
    from specjax.slots import SlotCache

    models = pairs("qwen2")
    target, draft = models["target"], models[draft_kind]
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=5)
    plain = hf_greedy(target, ids, mask, 14)[:, ids.shape[1] :]
    eos = [int(plain[0, 5]), int(plain[2, 9])]
    seen: list[tuple[bool | None, bool]] = []
    original = SlotCache.forward

    def checked(self, tokens, valid, *, all_valid=None, **kw):
        seen.append((all_valid, bool(valid.all())))
        return original(self, tokens, valid, all_valid=all_valid, **kw)

    monkeypatch.setattr(SlotCache, "forward", checked)
    out = generate(target, draft, ids, mask, max_new_tokens=14, num_draft_tokens=G, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 14, eos_token_id=eos))
    given = [(flag, truth) for flag, truth in seen if flag is not None]
    # only the draft's prefill reads the mask (the target's goes into its first verification)
    assert len(given) == len(seen) - 1
    assert all(flag == truth for flag, truth in given), given
    assert {truth for _, truth in given} == {True, False}


@pytest.mark.parametrize("max_new_tokens", range(1, 10))
@pytest.mark.parametrize("draft_kind", ["same", "perturbed"])
def test_max_new_tokens_is_never_exceeded(draft_kind, max_new_tokens, pairs, left_padded):
    models = pairs("llama")
    target, draft = models["target"], models[draft_kind]
    ids, mask = left_padded((3, 5), vocab_size=VOCAB, seed=2)
    rec = StepRecorder()
    out = generate(target, draft, ids, mask, max_new_tokens=max_new_tokens, num_draft_tokens=G, on_tokens=rec)
    assert out.sequences.shape == (2, ids.shape[1] + max_new_tokens)
    assert out.num_new_tokens.tolist() == [max_new_tokens] * 2
    assert sum(len(s.get(0, [])) for s in rec.steps) == max_new_tokens
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, max_new_tokens))
    if draft_kind == "same":
        # every step accepts as much as the limit allows: G+1 tokens, then the rest
        assert out.stats.steps == math.ceil(max_new_tokens / (G + 1))


# --------------------------------------------------------------------------- #
# The caches after the loop
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("arch", "draft_kind", "max_new_tokens", "with_eos"),
    [
        ("llama", "perturbed", 15, False),
        ("llama", "perturbed", 15, True),
        ("gpt2", "perturbed", 15, False),
        ("gpt2", "perturbed", 15, True),
        ("llama", "same", 6, False),  # the last step has one token left per row: it does not draft
        ("llama", "same", 1, False),
    ],
)
def test_caches_match_a_fresh_forward(arch, draft_kind, max_new_tokens, with_eos, pairs, left_padded):
    models = pairs(arch)
    target, draft = models["target"], models[draft_kind]
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=7)
    eos = None
    if with_eos:
        plain = hf_greedy(target, ids, mask, max_new_tokens)[:, ids.shape[1] :]
        eos = int(plain[1, 6])
    out = generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=G,
        eos_token_id=eos,
        pad_token_id=0,
        return_state=True,
    )
    assert out.stats.steps >= (3 if draft_kind == "perturbed" else math.ceil(max_new_tokens / (G + 1)))
    state = out.state
    seqs = [row_sequence(ids, mask, out, i) for i in state.rows]
    b = len(seqs)
    t_cache, d_cache = state.target_cache, state.draft_cache
    assert t_cache.num_valid.tolist() == [len(s) - 1 for s in seqs]
    assert state.last.tolist() == [s[-1] for s in seqs]
    assert int(t_cache.mask.sum()) == sum(len(s) - 1 for s in seqs)
    # target: one more slot with `last` gives the next-token logits
    cached = t_cache.forward(state.last[:, None], torch.ones((b, 1), dtype=torch.bool), last_only=True)[:, 0]
    # draft: its pending tokens (the ones it has not fed yet) complete the sequence
    pend = state.draft_pending
    assert all(1 <= len(p) <= 3 for p in pend)
    assert [len(s) - len(p) for s, p in zip(seqs, pend, strict=True)] == d_cache.num_valid.tolist()
    assert [s[len(s) - len(p) :] for s, p in zip(seqs, pend, strict=True)] == pend
    width = max(len(p) for p in pend)
    feed = torch.tensor([[0] * (width - len(p)) + p for p in pend])
    feed_valid = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in pend])
    d_cached = d_cache.forward(feed, feed_valid, last_only=True)[:, 0]
    with torch.inference_mode():
        for j, seq in enumerate(seqs):
            x = torch.tensor([seq])
            fresh_t = target(x).logits[0, -1]
            fresh_d = draft(x).logits[0, -1]
            torch.testing.assert_close(cached[j], fresh_t, atol=1e-4, rtol=0)
            torch.testing.assert_close(d_cached[j], fresh_d, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_slot_cache_skips_the_mask_only_while_every_slot_is_valid(arch, tiny_lm):
    """All slots valid: no mask/positions passed (the causal fast path); a hole: both passed; exact either way."""
    from specjax.slots import SlotCache

    model = tiny_lm(arch, vocab_size=VOCAB)
    cache = SlotCache(model, 2, torch.device("cpu"))  # reads the forward's signature: before the wrapper
    seen: list[bool] = []
    original = model.forward

    def recording(*args, **kwargs):
        seen.append("attention_mask" in kwargs)
        return original(*args, **kwargs)

    model.forward = recording
    rng = np.random.default_rng(3)
    rows = [list(map(int, rng.integers(1, VOCAB, 6))) for _ in range(2)]
    cache.forward(torch.tensor([r[:4] for r in rows]), torch.ones((2, 4), dtype=torch.bool), last_only=True)
    assert cache.full and seen == [False]
    # Row 0 keeps 1 of 2 new slots, row 1 both: a hole in row 0, not cropped.
    cache.forward(torch.tensor([[rows[0][4], 0], rows[1][4:6]]), torch.ones((2, 2), dtype=torch.bool), last_only=True)
    cache.invalidate(4, torch.tensor([1, 2]))
    assert not cache.full
    nxt = torch.tensor([[7], [8]])
    logits = cache.forward(nxt, torch.ones((2, 1), dtype=torch.bool), last_only=True)[:, 0]
    assert seen[-1] is True
    # Only row 1 stays: its slots are all valid again, so the mask is dropped again.
    cache.select_rows(torch.tensor([1]))
    assert cache.full
    last = cache.forward(torch.tensor([[9]]), torch.ones((1, 1), dtype=torch.bool), last_only=True)[0, 0]
    assert seen[-1] is False
    model.forward = original
    with torch.inference_mode():
        fresh0 = model(torch.tensor([[*rows[0][:5], 7]])).logits[0, -1]
        fresh1 = model(torch.tensor([[*rows[1], 8]])).logits[0, -1]
        fresh1b = model(torch.tensor([[*rows[1], 8, 9]])).logits[0, -1]
    torch.testing.assert_close(logits[0], fresh0, atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], fresh1, atol=1e-4, rtol=0)
    torch.testing.assert_close(last, fresh1b, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #


def _word_tokenizer(words: list[str]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def test_tokenizers_that_do_not_match_are_refused(pairs):
    models = pairs("llama")
    words = ["[PAD]", "[UNK]", *[f"w{i}" for i in range(VOCAB - 2)]]
    shuffled = words[:2] + sorted(words[2:], key=lambda w: int(w[1:]) * 7 % (VOCAB - 2))
    ids = torch.tensor([[5, 6, 7]])
    same = _word_tokenizer(words)
    out = generate(
        models["target"],
        models["same"],
        ids,
        max_new_tokens=2,
        target_tokenizer=same,
        draft_tokenizer=_word_tokenizer(list(words)),
    )
    assert out.sequences.shape == (1, 5)
    with pytest.raises(ValueError, match=r"draft_tokenizer: \d+ of the first 96 token ids map to different"):
        generate(
            models["target"],
            models["same"],
            ids,
            max_new_tokens=2,
            target_tokenizer=same,
            draft_tokenizer=_word_tokenizer(shuffled),
        )


def test_vocabularies_of_different_sizes_are_refused(pairs, tiny_lm):
    big = tiny_lm("llama", vocab_size=1024, layers=1, hidden=16, seed=1)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(
        ValueError, match="vocabulary has 96 entries and the draft's 1024; they differ by more than padding"
    ):
        generate(pairs("llama")["target"], big, ids, max_new_tokens=2)


def test_models_on_different_devices_are_refused(pairs, tiny_lm):
    with torch.device("meta"):
        meta_draft = tiny_lm("llama", layers=1, hidden=16, seed=1)
    assert next(meta_draft.parameters()).device.type == "meta"
    ids = torch.tensor([[5, 6, 7]])
    # the only other device here is "meta": weights never loaded, refused as such before the device check
    with pytest.raises(ValueError, match=r"draft: its weights are not loaded \(parameter '.*' is on the 'meta' device"):
        generate(pairs("llama")["target"], meta_draft, ids, max_new_tokens=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, r"max_new_tokens: expected an integer >= 1, got 0"),
        ({"max_new_tokens": -3}, r"max_new_tokens: expected an integer >= 1, got -3"),
        ({"max_new_tokens": 2.0}, r"max_new_tokens: expected an integer >= 1, got 2.0"),
        ({"max_new_tokens": 4, "num_draft_tokens": 0}, r"num_draft_tokens: expected an integer in \[1, 128\].*got 0"),
        ({"max_new_tokens": 4, "num_draft_tokens": -1}, r"num_draft_tokens: expected an integer in \[1, 128\].*got -1"),
        ({"max_new_tokens": 4, "seed": 2**70}, r"seed: expected an integer in \[-2\*\*63, 2\*\*63 - 1\], got 1180591"),
        ({"max_new_tokens": 4, "seed": 1.5}, r"seed: expected an integer .*, got 1.5"),
        ({"max_new_tokens": 4, "pad_token_id": 1.5}, r"pad_token_id: expected token ids \(integers >= 0\), got 1.5"),
        ({"max_new_tokens": 4, "pad_token_id": -1}, r"pad_token_id: expected token ids \(integers >= 0\), got -1"),
        ({"max_new_tokens": 4, "eos_token_id": "2"}, r"eos_token_id: expected token ids \(integers >= 0\), got '2'"),
        ({"max_new_tokens": 4, "eos_token_id": [2, True]}, r"eos_token_id: expected token ids .*, got True"),
    ],
    ids=[
        "max_new_0",
        "max_new_negative",
        "max_new_float",
        "draft_0",
        "draft_negative",
        "seed_huge",
        "seed_float",
        "pad_float",
        "pad_negative",
        "eos_string",
        "eos_bool",
    ],
)
def test_bad_lengths_are_refused(kwargs, message, pairs):
    models = pairs("llama")
    with pytest.raises(ValueError, match=message):
        generate(models["target"], models["other"], torch.tensor([[5, 6, 7]]), **kwargs)


@pytest.mark.parametrize("bad", [VOCAB, 10**6, -1])
def test_prompt_ids_outside_the_vocabulary_are_refused(bad, pairs):
    """Refused up front with the range, not an IndexError from inside the embedding."""
    models = pairs("llama")
    with pytest.raises(ValueError, match=rf"input_ids: expected token ids in \[0, {VOCAB}\) .*got values in "):
        generate(models["target"], models["other"], torch.tensor([[5, bad, 7]]), max_new_tokens=2)


def test_padded_batch_without_attention_mask_is_refused(pairs, left_padded):
    models = pairs("llama")
    ids, mask = left_padded((2, 5), vocab_size=VOCAB, seed=1)
    with pytest.raises(ValueError, match="attention_mask: the batch looks left-padded"):
        generate(models["target"], models["other"], ids, max_new_tokens=2)
    right = torch.flip(mask, dims=[1])
    with pytest.raises(ValueError, match="attention_mask: expected left padding"):
        generate(models["target"], models["other"], ids, right, max_new_tokens=2)


def test_unknown_sampler_name_is_refused(pairs):
    models = pairs("llama")
    with pytest.raises(ValueError, match="unknown sampler 'no-such-sampler'"):
        generate(
            models["target"], models["other"], torch.tensor([[5, 6, 7]]), max_new_tokens=2, sampler="no-such-sampler"
        )


def test_sliding_window_layers_within_the_window_are_exact(tiny_lm, perturbed_copy, left_padded):
    """Mistral with a (large) sliding window, rows dropped mid-run (past the window: test_sliding_window.py)."""
    target = tiny_lm("mistral", sliding_window=4096)
    draft = perturbed_copy(target, noise=0.05, seed=3)
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=11)
    out = generate(target, draft, ids, mask, max_new_tokens=16, num_draft_tokens=G)
    assert 0 < out.stats.acceptance_rate < 1
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))


# --------------------------------------------------------------------------- #
# Vocabularies that differ by padding
# --------------------------------------------------------------------------- #


class RecordingSampler:
    """A probabilities-contract sampler (``specjax.rejection_sample``) that records the draft tokens."""

    def __init__(self) -> None:
        self.max_draft_token = -1
        self.calls = 0

    def __call__(self, draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, *, validate=True):
        x = np.asarray(draft_tokens)
        self.calls += 1
        if x.size:
            self.max_draft_token = max(self.max_draft_token, int(x.max()))
            # the draft distribution gives the padding ids no mass (greedy drafts are point masses)
            if draft_probs is not None:
                assert float(np.asarray(draft_probs)[..., 128:].max(initial=0.0)) == 0.0
        return specjax.rejection_sample(
            draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, validate=validate
        )


def _boost_padding_rows(model, vocab: int) -> None:
    """Make ids >= 128 likely by giving them copies of (scaled) real output rows."""
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[128:vocab] = head[8 : 8 + vocab - 128] * 1.3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_vocabulary_padded_beyond_the_drafts(temperature, tiny_lm, perturbed_copy, left_padded):
    target = tiny_lm("llama", vocab_size=136, seed=0)
    _boost_padding_rows(target, 136)
    draft = tiny_lm("llama", vocab_size=128, seed=0)
    with torch.no_grad():  # the draft is the target without the padding ids: it accepts often
        for p, q in zip(draft.parameters(), target.parameters(), strict=True):
            p.copy_(q[: p.shape[0]] if p.shape != q.shape else q)
    ids, mask = left_padded(LENGTHS, vocab_size=128, seed=3)
    sampler = RecordingSampler()
    out = generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=16,
        num_draft_tokens=G,
        temperature=temperature,
        sampler=sampler,
        seed=1,
    )
    new = out.sequences[:, ids.shape[1] :]
    assert int(new.max()) >= 128, "the target never emitted a padding id: the test does not test"
    assert sampler.calls > 0 and 0 <= sampler.max_draft_token < 128
    assert out.stats.draft_tokens_accepted > 0
    if temperature == 0.0:
        assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))
    fused = generate(target, draft, ids, mask, max_new_tokens=16, num_draft_tokens=G, temperature=temperature, seed=1)
    assert torch.equal(fused.sequences, out.sequences)


def test_draft_vocabulary_padded_beyond_the_targets(tiny_lm, left_padded):
    target = tiny_lm("llama", vocab_size=128, seed=0)
    draft = tiny_lm("llama", vocab_size=136, layers=1, hidden=16, seed=1)
    _boost_padding_rows(draft, 136)
    ids, mask = left_padded(LENGTHS, vocab_size=128, seed=3)
    with torch.inference_mode():  # the draft alone would pick padding ids
        assert int(draft(ids, attention_mask=mask).logits.argmax(-1).max()) >= 128
    sampler = RecordingSampler()
    out = generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=G, sampler=sampler)
    assert sampler.calls > 0 and 0 <= sampler.max_draft_token < 128
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 12))
    fused = generate(target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=G)
    assert torch.equal(fused.sequences, out.sequences)


# --------------------------------------------------------------------------- #
# Statistics
# --------------------------------------------------------------------------- #


def _expected_stats(rec: StepRecorder, batch: int, max_new_tokens: int, g: int, prompt_len: int) -> dict:
    """Rebuild the statistics from the streamed tokens (no EOS: each row gains n + 1 per step)."""
    generated = dict.fromkeys(range(batch), 0)
    proposed = accepted = draft_forwards = row_steps = 0
    tested = np.zeros(g, np.int64)
    passed = np.zeros(g, np.int64)
    for step in rec.steps:
        ks = []
        for row, tokens in step.items():
            k = min(g, max_new_tokens - generated[row] - 1)
            n = len(tokens) - 1
            assert 0 <= n <= k
            ks.append(k)
            proposed += k
            accepted += n
            tested[: min(n + 1, k)] += 1
            passed[:n] += 1
            generated[row] += len(tokens)
            row_steps += 1
        draft_forwards += max(ks)
    prefill = int(prompt_len > 1)  # the draft's (the target's is its first verification)
    return {
        "steps": len(rec.steps),
        "target_forwards": len(rec.steps),
        "draft_forwards": draft_forwards + prefill,
        "draft_tokens_proposed": proposed,
        "draft_tokens_accepted": accepted,
        "new_tokens": batch * max_new_tokens,
        "tested": tested,
        "passed": passed,
        "row_steps": row_steps,
    }


@pytest.mark.parametrize(
    ("draft_kind", "batch", "max_new_tokens", "g", "temperature"),
    [
        ("perturbed", 4, 11, 3, 0.0),
        ("perturbed", 4, 13, 4, 1.0),
        ("other", 1, 9, 2, 0.0),
        ("same", 1, 11, 4, 0.0),
    ],
)
def test_stats_are_consistent(draft_kind, batch, max_new_tokens, g, temperature, pairs, left_padded):
    models = pairs("llama")
    ids, mask = left_padded(LENGTHS[:batch] if batch > 1 else (4,), vocab_size=VOCAB, seed=9)
    rec = StepRecorder()
    out = generate(
        models["target"],
        models[draft_kind],
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=g,
        temperature=temperature,
        on_tokens=rec,
    )
    s = out.stats
    want = _expected_stats(rec, batch, max_new_tokens, g, ids.shape[1])
    for name in (
        "steps",
        "target_forwards",
        "draft_forwards",
        "draft_tokens_proposed",
        "draft_tokens_accepted",
        "new_tokens",
    ):
        assert getattr(s, name) == want[name], name
    assert s.acceptance_rate == pytest.approx(want["draft_tokens_accepted"] / want["draft_tokens_proposed"])
    assert s.mean_accepted_length == pytest.approx(want["new_tokens"] / want["row_steps"])
    assert s.tokens_per_target_forward == pytest.approx(want["new_tokens"] / want["target_forwards"])
    rates = [p / t if t else 0.0 for p, t in zip(want["passed"], want["tested"], strict=True)]
    assert s.acceptance_rate_per_position == pytest.approx(rates)
    assert len(s.acceptance_rate_per_position) == g
    assert s.tokens_per_s == pytest.approx(s.new_tokens / (s.wall_time_s - s.compile_time_s))
    assert s.adapter_copies == 0  # fresh contiguous logits cross to JAX without a copy
    assert set(s.as_dict()) >= {"steps", "acceptance_rate", "tokens_per_s", "acceptance_rate_per_position"}
    # where the steps' time went: each part measured, together within the call's wall time
    assert s.target_time_s > 0 and s.loop_time_s > 0 and s.draft_time_s > 0
    assert s.draft_time_s + s.target_time_s + s.loop_time_s <= s.wall_time_s
    if draft_kind == "same":
        assert s.steps == math.ceil(max_new_tokens / (g + 1))
        assert s.mean_accepted_length == pytest.approx(max_new_tokens / s.steps)


class CompilingLookup(NgramDrafter):
    """Prompt lookup that also runs a newly defined jitted function at each proposal (traced and compiled
    anew, as a drafter's JAX code meeting a new shape is), timing its proposals and their compilation."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = self.compiling = 0.0

    def propose(self, request: Any) -> Any:
        import jax

        from specjax.generate.compile_time import measure_compiles

        start = time.perf_counter()
        with measure_compiles() as clock:
            jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(np.arange(3, dtype=np.float32)))
        proposal = super().propose(request)
        self.compiling += clock.seconds
        self.seconds += time.perf_counter() - start
        return proposal


def test_step_times_leave_compilation_out(pairs, left_padded):
    """``draft_time_s`` (and the target's and the loop's times) count a step's work without the JAX
    compilation in it, which ``compile_time_s`` holds (one-time work, left out of ``tokens_per_s`` too):
    the drafting time is the drafter's proposals' own time less their compilation, give or take the
    loop's call around them."""
    models = pairs("llama")
    ids, mask = left_padded((4,), vocab_size=VOCAB, seed=9)
    drafter = CompilingLookup()
    s = generate(models["target"], drafter, ids, mask, max_new_tokens=8, num_draft_tokens=G).stats
    assert drafter.compiling > 0  # the premise: the steps compiled
    assert drafter.seconds - drafter.compiling <= s.draft_time_s < drafter.seconds
    assert s.compile_time_s >= drafter.compiling
    assert s.draft_time_s + s.target_time_s + s.loop_time_s + s.compile_time_s <= s.wall_time_s


def test_sampler_callable_matches_the_fused_path(pairs, left_padded):
    """``rejection_sample`` passed as a callable (probabilities path) draws the same tokens as the fused kernel."""
    models = pairs("llama")
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=4)
    kwargs = dict(max_new_tokens=10, num_draft_tokens=G, temperature=0.8, top_k=20, seed=3)
    fused = generate(models["target"], models["perturbed"], ids, mask, **kwargs)
    called = generate(models["target"], models["perturbed"], ids, mask, sampler=specjax.rejection_sample, **kwargs)
    assert torch.equal(fused.sequences, called.sequences)
    assert fused.stats.draft_tokens_accepted == called.stats.draft_tokens_accepted


@pytest.mark.parametrize("drop", [False, True])
@pytest.mark.parametrize("seed", [3, 4])
def test_a_sampled_row_does_not_depend_on_the_other_rows(seed, drop, pairs, monkeypatch):
    """api.md: row b's draws depend only on ``seed`` and b. Row 0 alone and row 0
    beside other rows give the same tokens, with sampling, although the rows
    accept different numbers of tokens and so reach their last steps (where a
    row's draft length is cut to its remaining budget) at different times.

    ``drop``: the row that ends first leaves the caches (its keys and
    parameters with it) although the other has fewer than ``_DROP_MIN_LEFT``
    tokens to go; by default a sampled call keeps it there."""
    from specjax.generate import loop

    if drop:
        monkeypatch.setattr(loop, "_DROP_MIN_LEFT", 0)
    models = pairs("llama")
    kwargs = dict(max_new_tokens=20, num_draft_tokens=G, temperature=0.8, seed=seed, eos_token_id=[])
    prompt = torch.tensor([[5, 9, 12, 7, 3]])
    alone = generate(models["target"], models["perturbed"], prompt, **kwargs)
    steps_differ = False
    rows_left = []
    for other in ([1, 2, 3, 4, 5], [40, 41, 42, 43, 44], [90, 3, 77, 5, 61]):
        recorder = StepRecorder()
        batch = generate(
            models["target"],
            models["perturbed"],
            torch.tensor([prompt[0].tolist(), other]),
            on_tokens=recorder,
            return_state=True,
            **kwargs,
        )
        assert torch.equal(batch.sequences[0], alone.sequences[0]), other
        steps_differ |= any(len(s.get(0, [])) != len(s.get(1, [])) for s in recorder.steps)
        rows_left.append(len(batch.state.rows))
    # The case is not degenerate: somewhere the rows advanced by different amounts.
    assert steps_differ
    # 20 new tokens: the live row has fewer than 16 to go when the other ends, so by default it stays
    assert (min(rows_left) == 1) if drop else (rows_left == [2, 2, 2]), rows_left


@pytest.mark.parametrize("asks", [True, False])
def test_asks_every_step_makes_the_loop_ask_every_step(tiny_lm, asks):
    """A drafter that sets ``asks_every_step`` is asked even when the schedule wants no tokens; one that
    does not (and whose hint says tokens are expensive) is not."""
    from specjax.drafters import NgramDrafter

    calls = []

    class Counting(NgramDrafter):
        asks_every_step = asks
        cost_per_token_hint = 10.0  # seconds: the adaptive schedule never pays for that

        def propose(self, request):
            calls.append(request.step)
            return super().propose(request)

    target = tiny_lm("llama", vocab_size=64, seed=0)
    ids = torch.tensor([[5, 9, 2, 7, 5, 9, 2, 7, 5, 9]])
    out = specjax.speculative_generate(target, Counting(), ids, max_new_tokens=8, pad_token_id=0)
    # every step but the last (one token left: nothing to draft) asks
    assert len(calls) == (out.stats.steps - 1 if asks else 0), (calls, out.stats.steps)


@pytest.mark.parametrize("impl", ["xla", "cpu"])
def test_impl_chooses_the_kernels_code_and_greedy_output_is_the_same(impl, pairs, left_padded):
    """``impl`` reaches the loop's kernels (the draft's draw and the acceptance step):
    greedy output is the target's either way; "cpu" where the C++ kernels are
    unavailable, or an unknown name, is a ValueError naming ``impl``."""
    from specjax.kernels import cpu_kernels

    models = pairs("llama")
    ids, mask = left_padded(LENGTHS, vocab_size=VOCAB, seed=5)
    kwargs = dict(max_new_tokens=9, num_draft_tokens=G, temperature=0.0)
    if impl == "cpu" and not cpu_kernels.available():
        with pytest.raises(ValueError, match="impl: 'cpu' asks for the C\\+\\+ CPU kernels"):
            generate(models["target"], models["perturbed"], ids, mask, impl=impl, **kwargs)
        return
    ours = generate(models["target"], models["perturbed"], ids, mask, impl=impl, **kwargs)
    auto = generate(models["target"], models["perturbed"], ids, mask, **kwargs)
    assert torch.equal(ours.sequences, auto.sequences)
    assert ours.stats.draft_tokens_proposed > 0
    with pytest.raises(ValueError, match="impl: expected one of 'auto', 'xla', 'cpu', got 'tpu'"):
        generate(models["target"], models["perturbed"], ids, mask, impl="tpu", **kwargs)
