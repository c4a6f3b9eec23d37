"""The transformers drop-ins (issue #6): ``generate(custom_generate=speculative_decoding)`` and
``patch_speculative_sampling()``, on tiny Llama pairs built from configs.

* custom_generate, both ways in (the callable with ``draft_model=``, and the shipped
  repository directory with ``assistant_model=``/``streamer=``): greedy output identical to
  plain ``target.generate`` (B = 1, and B = 3 left-padded with an EOS that ends one row
  early), ``max_length``, the dict output, the streamer, ``num_return_sequences``,
  reproducible sampling, and a ``ValueError`` for every option that would change the
  distribution and for a draft given where transformers drops it.
* patch: the replacement is called, restored on exit and on exceptions, refuses an unknown
  signature, and is lossless: a chi-square test of the first one and two generated tokens
  over ~1000 sampled ``generate`` calls against the target's exact distribution, with a
  negative control (an acceptance step fed the wrong draft distribution) that the same test
  rejects.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation import utils as gu
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from specjax.plugin import hf, sampling_patch
from specjax.plugin.hf import (
    CUSTOM_GENERATE_DIR,
    jax_speculative_sampling,
    patch_speculative_sampling,
    speculative_decoding,
)
from specjax.registry import load_custom_generate

V = 96  # shared with the other integration tests, so the loop's JAX compilations are shared


@pytest.fixture(scope="module")
def pair(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=V, layers=2, seed=0)
    draft = perturbed_copy(target, noise=0.3, seed=1)
    return target, draft


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.tensor([[5, 17, 42, 8, 23]])


# --------------------------------------------------------------------------- custom_generate: greedy identity


def route(name: str, draft) -> dict:
    """generate's keywords for one way into specjax's loop."""
    if name == "callable":
        return dict(custom_generate=speculative_decoding, draft_model=draft)
    assert name == "directory"
    return dict(custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, assistant_model=draft)


ROUTES = ["callable", "directory"]


@pytest.mark.parametrize("way", ROUTES)
def test_greedy_identity_batch_1(pair, prompt, way):
    target, draft = pair
    want = target.generate(prompt, max_new_tokens=12, do_sample=False)
    got = target.generate(prompt, max_new_tokens=12, do_sample=False, **route(way, draft))
    assert got.dtype == torch.long
    assert torch.equal(got, want)


@pytest.mark.parametrize("way", ROUTES)
def test_greedy_identity_batch_3_left_padded_with_eos(pair, left_padded, way):
    target, draft = pair
    ids, mask = left_padded([5, 3, 7], vocab_size=V, seed=3)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    # an EOS id that row 1 emits at its 4th new token: that row ends early and is padded
    eos = int(plain[1, ids.shape[1] + 3])
    want = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert (want[1, ids.shape[1] + 4 :] == 0).all()  # the comparison covers padding after EOS
    got = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=eos,
        return_dict_in_generate=True,
        **route(way, draft),
    )
    assert isinstance(got, GenerateDecoderOnlyOutput)
    assert got.scores is None and got.logits is None
    assert torch.equal(got.sequences, want)


def test_max_length_instead_of_max_new_tokens(pair, prompt):
    target, draft = pair
    want = target.generate(prompt, max_length=prompt.shape[1] + 6, do_sample=False)
    got = target.generate(
        prompt,
        draft_model=draft,
        custom_generate=speculative_decoding,
        max_length=prompt.shape[1] + 6,
        do_sample=False,
    )
    assert got.shape[1] == prompt.shape[1] + 6
    assert torch.equal(got, want)


def test_registered_custom_generate_is_the_same_function(pair, prompt):
    target, draft = pair
    fn = load_custom_generate("specjax")
    assert fn is speculative_decoding
    want = target.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(target.generate(prompt, draft_model=draft, custom_generate=fn, max_new_tokens=5), want)


# --------------------------------------------------------------------------- custom_generate: sampling


SETTINGS = [
    (dict(max_new_tokens=7), dict(temperature=0.0, top_k=None, top_p=None, max_new_tokens=7, seed=0)),
    # transformers' sampling default top_k = 50 is applied as generate itself would
    (dict(max_new_tokens=7, do_sample=True), dict(temperature=1.0, top_k=50, top_p=None)),
    (
        dict(max_new_tokens=7, do_sample=True, temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=0.7, top_k=20, top_p=0.9),
    ),
    (dict(max_new_tokens=7, do_sample=False, temperature=0.7, top_k=20), dict(temperature=0.0, top_k=None)),
    (dict(max_length=9), dict(max_new_tokens=4)),
    (dict(max_new_tokens=7, eos_token_id=[9, 3], pad_token_id=4), dict(eos_token_id=[3, 9], pad_token_id=4)),
    (dict(max_new_tokens=7, eos_token_id=9), dict(eos_token_id=[9], pad_token_id=0)),
    (dict(max_new_tokens=7), dict(eos_token_id=[], pad_token_id=0)),
    (
        dict(max_new_tokens=7, num_draft_tokens=2, sampler="torch", seed=3),
        dict(num_draft_tokens=2, sampler="torch", seed=3),
    ),
]


@pytest.mark.parametrize(("options", "expected"), SETTINGS)
@pytest.mark.parametrize("way", ROUTES)
def test_generation_config_reaches_the_loop(pair, prompt, monkeypatch, options, expected, way):
    """What generate prepared (processors, stopping criteria, special tokens) becomes the loop's arguments."""
    import specjax.generate

    target, draft = pair
    seen = {}

    def fake(model, draft_model, input_ids, attention_mask, **kwargs):
        seen.update(kwargs, model=model, draft=draft_model, input_ids=input_ids, attention_mask=attention_mask)
        return specjax.generate.SpeculativeOutput(input_ids, None, None)

    monkeypatch.setattr(specjax.generate, "speculative_generate", fake)
    target.generate(prompt, **route(way, draft), **options)
    assert seen["model"] is target and seen["draft"] is draft
    assert torch.equal(seen["input_ids"], prompt) and torch.equal(seen["attention_mask"], torch.ones_like(prompt))
    for key, value in expected.items():
        got = seen[key]
        assert (pytest.approx(value) if isinstance(value, float) else value) == got, key


def test_sampling_is_reproducible_with_torch_manual_seed(pair, left_padded):
    target, draft = pair
    ids, mask = left_padded([5, 3, 7], vocab_size=V, seed=4)  # B = 3 like the greedy test: shared compilations
    kwargs = dict(
        attention_mask=mask,
        draft_model=draft,
        custom_generate=speculative_decoding,
        max_new_tokens=10,
        do_sample=True,
        temperature=1.3,
    )
    torch.manual_seed(11)
    a = target.generate(ids, **kwargs)
    torch.manual_seed(11)
    b = target.generate(ids, **kwargs)
    assert torch.equal(a, b)
    assert a.shape == (3, ids.shape[1] + 10) and int(a.min()) >= 0 and int(a.max()) < V
    torch.manual_seed(12)
    d = target.generate(ids, seed=5, **kwargs)
    torch.manual_seed(13)
    e = target.generate(ids, seed=5, **kwargs)
    assert not torch.equal(a, d)  # a different seed gives a different sample (P(equal) is negligible)
    assert torch.equal(d, e)  # an explicit seed ignores torch's generator


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("way", ["token_streamer", "directory"])
def test_streamer_receives_the_prompt_then_the_new_tokens(pair, prompt, way):
    """As ``generate(streamer=...)`` does: the prompt, the new tokens, ``end()``."""
    target, draft = pair
    streamer = Collect()
    if way == "token_streamer":
        kwargs = dict(route("callable", draft), token_streamer=streamer)
    else:
        kwargs = dict(route("directory", draft), streamer=streamer)
    out = target.generate(prompt, max_new_tokens=9, do_sample=False, **kwargs)
    assert streamer.ended
    assert streamer.chunks[0] == prompt[0].tolist()
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == out[0, prompt.shape[1] :].tolist()
    assert len(streamer.chunks) > 2  # streamed step by step, not once at the end


def test_num_return_sequences(pair, prompt):
    """Each copy of the prompt is a row; top_k = 1 sampling is greedy, so each row is generate's greedy row."""
    target, draft = pair
    want = target.generate(prompt, max_new_tokens=6, do_sample=False).repeat(3, 1)
    got = target.generate(
        prompt, max_new_tokens=6, do_sample=True, top_k=1, num_return_sequences=3, **route("directory", draft)
    )
    assert torch.equal(got, want)


UNSUPPORTED = [
    (dict(num_beams=2), r"unsupported generation options: num_beams=2"),
    (
        dict(return_dict_in_generate=True, output_hidden_states=True),
        r"unsupported generation options: output_hidden_states=True",
    ),
    (dict(assistant_ensemble_weight=0.5), r"assistant_ensemble_weight=0.5"),
]


@pytest.mark.parametrize(("options", "message"), UNSUPPORTED, ids=[m.split("\\")[0][:40] for _, m in UNSUPPORTED])
def test_unsupported_options_raise(pair, prompt, options, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        target.generate(prompt, draft_model=draft, custom_generate=speculative_decoding, max_new_tokens=3, **options)


def test_no_draft_model_raises(pair, prompt):
    target, _ = pair
    with pytest.raises(ValueError, match=r"no draft model; pass draft_model=draft"):
        target.generate(prompt, custom_generate=speculative_decoding, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"no draft model; pass assistant_model=draft"):
        target.generate(prompt, custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True, max_new_tokens=3)


def test_assistant_model_given_to_the_callable_raises_not_ignored(pair, prompt):
    """transformers drops assistant_model= before a callable runs: specjax says so and where to go."""
    target, draft = pair
    with pytest.raises(ValueError, match=r"does not pass generate's assistant_model=.*CUSTOM_GENERATE_DIR"):
        target.generate(prompt, assistant_model=draft, custom_generate=speculative_decoding, max_new_tokens=3)


def test_conflicting_drafts_and_streamers_raise(pair, prompt):
    target, draft = pair
    with pytest.raises(ValueError, match=r"both draft_model= and a different assistant_model="):
        target.generate(prompt, draft_model=target, max_new_tokens=3, **route("directory", draft))
    with pytest.raises(ValueError, match=r"both streamer= and token_streamer="):
        target.generate(
            prompt, streamer=Collect(), token_streamer=Collect(), max_new_tokens=3, **route("directory", draft)
        )
    with pytest.raises(ValueError, match=r"both streamer= and token_streamer="):
        speculative_decoding(target, prompt, streamer=Collect(), draft_model=draft, token_streamer=Collect())


def test_the_directory_needs_trust_remote_code(pair, prompt):
    """transformers' gate for running a repository's generate.py holds for specjax's directory too."""
    target, draft = pair
    with pytest.raises(ValueError, match=r"trust_remote_code"):
        target.generate(prompt, assistant_model=draft, custom_generate=CUSTOM_GENERATE_DIR, max_new_tokens=3)


# --------------------------------------------------------------------------- the patch


def test_patch_is_called_and_restored(pair, prompt):
    target, draft = pair
    original = gu._speculative_sampling
    with patch_speculative_sampling() as patched:
        assert gu._speculative_sampling is not original
        target.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=8)
    assert gu._speculative_sampling is original
    assert patched.calls >= 1
    assert 0 <= patched.draft_tokens_accepted <= patched.draft_tokens_proposed
    assert patched.draft_tokens_proposed >= patched.calls


def test_patch_restored_on_exceptions(pair, prompt):
    target, draft = pair
    original = gu._speculative_sampling
    with pytest.raises(ZeroDivisionError), patch_speculative_sampling():
        _ = 1 / 0
    assert gu._speculative_sampling is original
    # an exception from inside generate (here: from the replacement itself)
    with (
        pytest.raises(ValueError, match=r"assistant_ensemble_weight=0.5: ensemble verification"),
        patch_speculative_sampling(),
    ):
        target.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=4, assistant_ensemble_weight=0.5)
    assert gu._speculative_sampling is original


def test_patched_sampling_is_reproducible(pair, prompt):
    target, draft = pair
    with patch_speculative_sampling():
        torch.manual_seed(3)
        a = target.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=10)
        torch.manual_seed(3)
        b = target.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=10)
    assert torch.equal(a, b)


def test_greedy_assisted_generation_does_not_call_the_patch(pair, prompt):
    target, draft = pair
    want = target.generate(prompt, max_new_tokens=8, do_sample=False)
    with patch_speculative_sampling() as patched:
        got = target.generate(prompt, assistant_model=draft, max_new_tokens=8, do_sample=False)
    assert patched.calls == 0
    assert torch.equal(got, want)


def test_patch_refuses_an_unknown_signature(monkeypatch):
    def _speculative_sampling(candidate_input_ids, candidate_logits, new_logits):
        raise AssertionError("must not run")

    monkeypatch.setattr(gu, "_speculative_sampling", _speculative_sampling)
    with pytest.raises(
        RuntimeError,
        match=r"transformers \S+: _speculative_sampling has parameters "
        r"\('candidate_input_ids', 'candidate_logits', 'new_logits'\), expected",
    ):
        with patch_speculative_sampling():
            pass
    assert gu._speculative_sampling is _speculative_sampling  # left alone


def test_compatibility_check_passes_on_this_transformers():
    hf.check_transformers_compatibility()
    assert (
        tuple(__import__("inspect").signature(gu._speculative_sampling).parameters) in sampling_patch._KNOWN_SIGNATURES
    )


def test_jax_speculative_sampling_direct():
    torch.manual_seed(0)
    ids = torch.tensor([[4, 5, 1, 2]])
    cand = torch.full((1, 2, 6), -1e9)
    cand[0, 0, 1] = 0.0  # q_0 one-hot at 1
    cand[0, 1, 2] = 0.0  # q_1 one-hot at 2
    new = torch.full((1, 3, 6), -1e9)
    new[0, 0, 1] = 0.0  # p_0 agrees: accepted
    new[0, 1, 3] = 0.0  # p_1 one-hot at 3: rejected, correction 3
    tokens, n = jax_speculative_sampling(ids, cand, 2, new)
    assert tokens.dtype == torch.long and tokens.tolist() == [[1, 3]]
    assert n.dtype == torch.long and n.ndim == 0 and int(n) == 1
    tokens, n = jax_speculative_sampling(ids, None, 0, new[:, :1])  # G = 0: a draw from p_0
    assert tokens.tolist() == [[1]] and int(n) == 0
    with pytest.raises(ValueError, match=r"new_logits: expected shape \(1, G\+1, V\) = \(1, 3, 6\), got \(1, 2, 6\)"):
        jax_speculative_sampling(ids, cand, 2, new[:, :2])
    with pytest.raises(ValueError, match=r"candidate_input_ids: expected shape \(1, L\)"):
        jax_speculative_sampling(ids.repeat(2, 1), cand, 2, new)


# --------------------------------------------------------------------------- losslessness through the patch


def _first_tokens(target, draft, prompt, runs: int) -> np.ndarray:
    """(runs, 2) first two generated tokens of sampled assisted ``generate`` calls."""
    out = np.zeros((runs, 2), np.int64)
    for r in range(runs):
        seq = target.generate(prompt, assistant_model=draft, do_sample=True, max_new_tokens=2)
        out[r] = seq[0, prompt.shape[1] :].numpy()
    return out


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value, cells with expected count < 5 merged into one."""
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep]).pvalue)


@pytest.mark.slow
def test_patched_path_is_lossless_with_negative_control(tiny_lm, perturbed_copy):
    vocab = 8
    target = tiny_lm("llama", vocab_size=vocab, layers=1, hidden=16, seed=0, init_range=0.5)
    draft = perturbed_copy(target, noise=0.8, seed=2)
    prompt = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # the exact distribution of the first two tokens (no processors: temperature 1)
        p1 = torch.softmax(target(prompt).logits[0, -1].double(), -1).numpy()
        q1 = torch.softmax(draft(prompt).logits[0, -1].double(), -1).numpy()
        nxt = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        p2 = torch.softmax(target(nxt).logits[:, -1].double(), -1).numpy()
    joint = p1[:, None] * p2
    overlap = float(np.minimum(p1, q1).sum())  # the acceptance probability of the first draft token
    assert 0.3 < overlap < 0.9, overlap  # both acceptances and corrections are common

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add overhead
    try:
        runs = 1000
        torch.manual_seed(1234)
        with patch_speculative_sampling(validate=False) as patched:
            got = _first_tokens(target, draft, prompt, runs)
        assert patched.calls == runs and patched.draft_tokens_proposed == runs  # every first token went through it
        accepted = patched.draft_tokens_accepted / runs
        assert abs(accepted - overlap) < 5 * np.sqrt(overlap * (1 - overlap) / runs), (accepted, overlap)
        first = np.bincount(got[:, 0], minlength=vocab)
        pairs = np.bincount(got[:, 0] * vocab + got[:, 1], minlength=vocab * vocab)
        assert _chi2_pvalue(first, p1) > 1e-3
        assert _chi2_pvalue(pairs, joint.ravel()) > 1e-3

        # Negative control: the same harness with an acceptance step that is given the target's
        # distribution as the draft's (the bug class of transformers #32867): every draft token is
        # accepted, so the first token follows the draft. The test must reject it.
        def broken(candidate_input_ids, candidate_logits, candidate_length, new_logits, assistant_ensemble_weight=None):
            return jax_speculative_sampling(
                candidate_input_ids, new_logits[:, :candidate_length], candidate_length, new_logits, validate=False
            )

        control_runs = 250
        power = control_runs * float(np.sum((q1 - p1) ** 2 / p1))  # noncentrality of the chi-square
        assert power > 100, power
        original = gu._speculative_sampling
        gu._speculative_sampling = broken
        try:
            bad = _first_tokens(target, draft, prompt, control_runs)
        finally:
            gu._speculative_sampling = original
        assert _chi2_pvalue(np.bincount(bad[:, 0], minlength=vocab), p1) < 1e-6
    finally:
        torch.set_num_threads(threads)
