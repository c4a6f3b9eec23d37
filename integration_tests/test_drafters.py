"""Drafters (issue 19): the n-gram and hybrid drafters, a third-party drafter by name, the adaptive length.

* greedy output equals ``target.generate`` for ``ngram`` and ``hybrid`` at B = 1
  and on a ragged left-padded batch whose rows never match, with EOS inside a
  proposed n-gram, and with contexts shorter than n;
* the adaptive draft length never asks for tokens past ``max_new_tokens``;
* a drafter installed as a real distribution (pip, offline) is used by name;
* unknown names and drafters that return garbage get errors naming them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import forkserver
import numpy as np
import pytest
import torch

import specjax
from specjax.drafters import (
    HybridDrafter,
    ModelDrafter,
    NgramDrafter,
    Proposal,
    available_drafters,
    load_drafter,
)
from specjax.drafters.ngram import NgramIndex

VOCAB = 96


def hf_greedy(target, ids, mask, n, eos=None):
    gen = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=0, eos_token_id=eos)
    width = ids.shape[1] + n
    if gen.shape[1] < width:
        gen = torch.nn.functional.pad(gen, (0, width - gen.shape[1]), value=0)
    return gen


@pytest.fixture(scope="module")
def models(tiny_lm, perturbed_copy):
    target = tiny_lm("llama", vocab_size=VOCAB, layers=2, seed=3)
    return {"target": target, "draft": perturbed_copy(target, noise=0.3, seed=1)}


def repetitive_prompt(seed: int, length: int) -> list[int]:
    rng = np.random.default_rng(seed)
    phrase = rng.integers(1, VOCAB, size=6).tolist()
    return (phrase * (length // 6 + 1))[:length]


# --------------------------------------------------------------------------- #
# The n-gram index
# --------------------------------------------------------------------------- #


def test_ngram_index_takes_the_longest_then_most_recent_match():
    idx = NgramIndex([1, 2, 3, 9, 8, 2, 3, 7, 6, 1, 2, 3], min_n=2, max_n=5)
    # suffix [1, 2, 3] occurred at 0..2 (then 9); [2, 3] occurred later, at 5..6 (then 7): the longer wins
    assert idx.lookup(3) == [9, 8, 2]
    idx.extend([5])  # suffix [3, 5]: never seen
    assert idx.lookup(4) == []
    short = NgramIndex([4, 4], min_n=2, max_n=5)  # context shorter than any repeat
    assert short.lookup(3) == []
    one = NgramIndex([7], min_n=2, max_n=5)
    assert one.lookup(3) == []


def test_ngram_index_skips_single_tokens_unless_asked():
    tokens = [5, 6, 1, 7, 5]
    assert NgramIndex(tokens, min_n=2, max_n=5).lookup(2) == []
    assert NgramIndex(tokens, min_n=1, max_n=5).lookup(2) == [6, 1]


def test_ngram_index_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ctx = rng.integers(0, 4, size=rng.integers(1, 40)).tolist()
        k = int(rng.integers(1, 6))
        want: list[int] = []
        for n in range(min(5, len(ctx)), 1, -1):
            suffix = ctx[len(ctx) - n :]
            ends = [e for e in range(n - 1, len(ctx) - 1) if ctx[e - n + 1 : e + 1] == suffix]
            if ends:
                want = ctx[ends[-1] + 1 : ends[-1] + 1 + k]
                break
        assert NgramIndex(ctx, 2, 5).lookup(k) == want, (ctx, k)


def test_ngram_options_are_checked():
    with pytest.raises(ValueError, match=r"min_n: expected an integer in \[1, 32\]"):
        NgramDrafter(min_n=0)
    with pytest.raises(ValueError, match=r"max_n: expected an integer >= min_n = 3"):
        NgramDrafter(min_n=3, max_n=2)


# --------------------------------------------------------------------------- #
# Greedy identity
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_identity_batch_of_one(models, kind, adaptive):
    target = models["target"]
    ids = torch.tensor([repetitive_prompt(1, 20)])
    mask = torch.ones_like(ids)
    draft = "ngram" if kind == "ngram" else HybridDrafter(NgramDrafter(), ModelDrafter(models["draft"]))
    out = specjax.speculative_generate(
        target, draft, ids, mask, max_new_tokens=24, num_draft_tokens=5, adaptive=adaptive
    )
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 24))
    if not adaptive:  # (the adaptive length decides from timings; the fixed one always drafts what matches)
        assert out.stats.draft_tokens_proposed > 0  # the repeated phrase matched
    if kind == "ngram":
        assert out.stats.draft_forwards == 0


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_greedy_identity_ragged_batch_with_rows_that_never_match(models, left_padded, kind):
    target = models["target"]
    rep = repetitive_prompt(2, 14)
    rng = np.random.default_rng(5)
    distinct = rng.permutation(np.arange(1, VOCAB))[:9].tolist()  # no repeated token: no match at first
    rows = [rep, distinct, [distinct[0]]]  # the last: context shorter than any n-gram
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    draft = "ngram" if kind == "ngram" else HybridDrafter(NgramDrafter(), ModelDrafter(models["draft"]))
    out = specjax.speculative_generate(target, draft, ids, mask, max_new_tokens=16, num_draft_tokens=4)
    assert torch.equal(out.sequences, hf_greedy(target, ids, mask, 16))


def test_eos_inside_a_proposed_ngram(models):
    """The prompt repeats a phrase; EOS is a token inside it: generation stops exactly where the target's does."""
    target = models["target"]
    ids = torch.tensor([repetitive_prompt(3, 24)])
    mask = torch.ones_like(ids)
    plain = hf_greedy(target, ids, mask, 20)[0, ids.shape[1] :]
    eos = int(plain[5])  # a token the target emits after a few steps
    out = specjax.speculative_generate(target, "ngram", ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    ref = hf_greedy(target, ids, mask, 20, eos=eos)  # padded with 0 after EOS
    width = out.sequences.shape[1]
    assert torch.equal(out.sequences, ref[:, :width]) and not ref[:, width:].any()
    assert int(out.num_new_tokens[0]) == int(np.flatnonzero(plain.numpy() == eos)[0]) + 1


# --------------------------------------------------------------------------- #
# The adaptive length
# --------------------------------------------------------------------------- #


class Recording:
    """Wraps a drafter and records each request's max_tokens and the rows' generated counts."""

    def __init__(self, inner, prompt_lens):
        self.inner = inner
        self.name = "recording"
        self.needs_target_hidden = False
        self.cost_per_token_hint = inner.cost_per_token_hint
        self.prompt_lens = prompt_lens
        self.requests: list[tuple[np.ndarray, list[int]]] = []

    def start(self, setup):
        self.rows = list(range(len(setup.contexts)))
        self.inner.start(setup)

    def propose(self, request):
        generated = [len(c) - self.prompt_lens[r] for c, r in zip(request.contexts, self.rows, strict=True)]
        self.requests.append((request.max_tokens.copy(), generated))
        return self.inner.propose(request)

    def commit(self, info):
        self.inner.commit(info)

    def select_rows(self, rows):
        self.rows = [self.rows[j] for j in rows]
        self.inner.select_rows(rows)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 9, 13])
@pytest.mark.parametrize("adaptive", [True, False])
def test_never_drafts_past_max_new_tokens(models, max_new_tokens, adaptive):
    target = models["target"]
    ids = torch.tensor([repetitive_prompt(4, 18), repetitive_prompt(5, 18)])
    rec = Recording(ModelDrafter(target), [18, 18])  # the target as its own draft: everything is accepted
    out = specjax.speculative_generate(
        target, rec, ids, max_new_tokens=max_new_tokens, num_draft_tokens=4, adaptive=adaptive
    )
    assert out.num_new_tokens.tolist() == [max_new_tokens] * 2
    for want, generated in rec.requests:
        for k, done in zip(want, generated, strict=True):
            assert k <= max(0, max_new_tokens - done - 1), (want, generated)
    assert torch.equal(out.sequences, hf_greedy(target, ids, torch.ones_like(ids), max_new_tokens))


def test_adaptive_and_fixed_lengths_agree_with_a_useless_drafter(models, tiny_lm):
    """A draft that never agrees: both schedules give the target's greedy output (how often the adaptive one
    drafts depends on measured times; tests/test_schedule.py checks its decisions on given times)."""
    target = models["target"]
    stranger = tiny_lm("llama", vocab_size=VOCAB, layers=1, seed=99, init_range=1.0)
    ids = torch.tensor([repetitive_prompt(6, 10)])
    fixed = specjax.speculative_generate(target, stranger, ids, max_new_tokens=30, adaptive=False)
    adaptive = specjax.speculative_generate(target, stranger, ids, max_new_tokens=30, adaptive=True)
    assert torch.equal(fixed.sequences, adaptive.sequences)
    assert torch.equal(fixed.sequences, hf_greedy(target, ids, torch.ones_like(ids), 30))
    assert fixed.stats.draft_steps == fixed.stats.steps - 1  # all but the last (one token left: no draft)


# --------------------------------------------------------------------------- #
# Names and bad drafters
# --------------------------------------------------------------------------- #


def test_unknown_drafter_name_lists_the_available_ones(models):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"draft: unknown drafter 'nope'; available drafters: .*hybrid.*model.*ngram"):
        specjax.speculative_generate(models["target"], "nope", ids, max_new_tokens=3)
    assert {"model", "ngram", "hybrid"} <= set(available_drafters())
    with pytest.raises(ValueError, match=r"the 'hybrid' drafter needs a fallback"):
        load_drafter("hybrid")
    with pytest.raises(TypeError, match=r"draft: expected a transformers causal LM, a drafter object or a drafter"):
        specjax.speculative_generate(models["target"], 3.5, ids, max_new_tokens=3)


class Broken:
    name = "broken-drafter"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def __init__(self, mode):
        self.mode = mode

    def start(self, setup):
        self.vocab = setup.target_vocab

    def propose(self, request):
        b = len(request.contexts)
        k = np.minimum(request.max_tokens, 2)
        tokens = np.ones((b, 2), np.int64)
        if self.mode == "too-many":
            return Proposal(np.ones((b, 9), np.int64), np.full(b, 9), None)
        if self.mode == "bad-id":
            tokens[:, 0] = self.vocab + 5
        if self.mode == "bad-shape":
            return Proposal(np.ones((b + 1, 2), np.int64), k, None)
        if self.mode == "not-a-proposal":
            return tokens
        if self.mode == "bad-confidence":
            return Proposal(tokens, k, None, confidence=np.full((b, 2), 1.5))
        return Proposal(tokens, k, None, confidence=np.full((b, 2), 0.5))

    def commit(self, info):
        pass

    def select_rows(self, rows):
        pass


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("too-many", r"drafter 'broken-drafter' proposed 9 tokens for row 0, expected at most 4"),
        (
            "bad-id",
            r"drafter 'broken-drafter' returned draft token 101 at row 0, position 0, expected an id in \[0, V\)",
        ),
        ("bad-shape", r"drafter 'broken-drafter' returned tokens of shape \(3, 2\), expected \(2, G\)"),
        ("not-a-proposal", r"drafter 'broken-drafter' returned ndarray, expected a specjax.drafters.Proposal"),
        (
            "bad-confidence",
            r"drafter 'broken-drafter' returned confidence of shape \(2, 2\) and dtype float64, expected floats in "
            r"\[0, 1\] \(or NaN\)",
        ),
    ],
)
def test_bad_drafter_output_is_refused_naming_the_drafter(models, mode, message):
    ids = torch.tensor([repetitive_prompt(7, 8), repetitive_prompt(8, 8)])
    with pytest.raises(ValueError, match=message):
        specjax.speculative_generate(
            models["target"], Broken(mode), ids, max_new_tokens=8, num_draft_tokens=4, adaptive=False
        )
    # negative control: the same drafter without the fault runs and keeps the target's output
    out = specjax.speculative_generate(
        models["target"], Broken("ok"), ids, max_new_tokens=8, num_draft_tokens=4, adaptive=False
    )
    assert torch.equal(out.sequences, hf_greedy(models["target"], ids, torch.ones_like(ids), 8))


# --------------------------------------------------------------------------- #
# A third-party drafter, installed with pip and used by name
# --------------------------------------------------------------------------- #

DIST = "specjax-thirdparty-drafter"
MODULE = "specjax_thirdparty_drafter"
PYPROJECT = f"""
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "0.0.1"

[project.entry-points."specjax.drafters"]
repeat_last = "{MODULE}:make"

[tool.setuptools]
py-modules = ["{MODULE}"]
"""
SOURCE = '''
"""A third-party drafter: proposes the last committed token again, k times."""
import numpy as np
from specjax.drafters import Proposal

CALLS = {"propose": 0}


class RepeatLast:
    name = "repeat_last"
    needs_target_hidden = False
    cost_per_token_hint = 0.0

    def start(self, setup):
        pass

    def propose(self, request):
        CALLS["propose"] += 1
        k = np.asarray(request.max_tokens, np.int64)
        g = int(k.max(initial=0))
        last = np.array([c[-1] for c in request.contexts], np.int64)
        return Proposal(np.repeat(last[:, None], g, axis=1), k, None)

    def commit(self, info):
        pass

    def select_rows(self, rows):
        pass


def make(**options):
    return RepeatLast()
'''
RUN = """
import json, torch, specjax
from transformers import LlamaConfig, LlamaForCausalLM
import specjax_thirdparty_drafter as mod
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None)
torch.manual_seed(0)
target = LlamaForCausalLM(cfg).eval()
target.generation_config.eos_token_id = None
ids = torch.tensor([[3, 7, 11, 5, 5, 5]])
out = specjax.speculative_generate(target, "repeat_last", ids, max_new_tokens=12, adaptive=False)
ref = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
print(json.dumps({"same": bool(torch.equal(out.sequences, ref)), "calls": mod.CALLS["propose"],
                  "drafter": out.stats.drafter, "names": specjax.drafters.available_drafters()}))
"""


def test_thirdparty_drafter_installed_with_pip_is_used_by_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT, encoding="utf-8")
    (src / f"{MODULE}.py").write_text(SOURCE, encoding="utf-8")
    site = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",
            "--no-build-isolation",
            "--no-deps",
            "--disable-pip-version-check",
            "--quiet",
            "--target",
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "SPECJAX_PLUGINS"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["HF_HUB_OFFLINE"] = "1"
    try:
        run = forkserver.run([sys.executable, "-c", textwrap.dedent(RUN)], env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        assert result["same"] and result["calls"] > 0 and result["drafter"] == "repeat_last"
        assert "repeat_last" in result["names"]
        # SPECJAX_PLUGINS filters drafters like samplers: excluded, the name is unknown
        env["SPECJAX_PLUGINS"] = "something_else"
        run = forkserver.run([sys.executable, "-c", textwrap.dedent(RUN)], env=env, timeout=600)
        assert run.returncode != 0 and "unknown drafter 'repeat_last'" in run.stderr
    finally:
        shutil.rmtree(site, ignore_errors=True)


class _Recorded:
    """Wraps a drafter and keeps its proposals."""

    def __init__(self, inner):
        self.inner = inner
        self.proposals: list = []
        for name in ("name", "needs_target_hidden", "cost_per_token_hint"):
            setattr(self, name, getattr(inner, name))

    def start(self, setup):
        self.inner.start(setup)

    def propose(self, request):
        p = self.inner.propose(request)
        self.proposals.append(p)
        return p

    def commit(self, info):
        self.inner.commit(info)

    def select_rows(self, rows):
        self.inner.select_rows(rows)


def test_greedy_hybrid_rows_take_their_own_drafters_tokens(models, left_padded):
    """Every row greedy: the model fallback proposes point masses too, and each row keeps its own drafter's tokens."""
    rep = repetitive_prompt(4, 16)
    distinct = np.random.default_rng(6).permutation(np.arange(1, VOCAB))[:16].tolist()
    ids = torch.tensor([rep, distinct])
    mask = torch.ones_like(ids)
    ngram, fallback = _Recorded(NgramDrafter()), _Recorded(ModelDrafter(models["draft"]))
    hybrid = _Recorded(HybridDrafter(ngram, fallback))
    out = specjax.speculative_generate(
        models["target"], hybrid, ids, mask, max_new_tokens=16, num_draft_tokens=4, adaptive=False
    )
    assert torch.equal(out.sequences, hf_greedy(models["target"], ids, mask, 16))
    mixed = 0
    fb = iter(fallback.proposals)
    for ng, hy in zip(ngram.proposals, hybrid.proposals, strict=True):
        assert hy.logits is None  # point masses
        matched = ng.num_tokens > 0
        # the n-gram rows are marked, for the schedule to learn their acceptance apart
        assert hy.free_rows is not None and hy.free_rows.tolist() == matched.tolist()
        if matched.all():  # the fallback did not run
            continue
        f = next(fb)
        mixed += bool(matched.any())
        for b in range(len(matched)):  # the cache's rows (finished rows leave)
            src = ng if matched[b] else f
            k = int(src.num_tokens[b])
            assert int(hy.num_tokens[b]) == k
            assert np.asarray(hy.tokens)[b, :k].tolist() == np.asarray(src.tokens)[b, :k].tolist()
    assert mixed > 0, "no step mixed n-gram and fallback rows: the test does not test"


def test_sampled_hybrid_passes_the_fallbacks_confidence_on_for_its_rows(models):
    """T = 0.8: the fallback's rows carry its confidence, the n-gram rows none (NaN): the schedule
    then tests all a drawn row proposed and picks the lookups' count from what they proposed. The
    proposal keeps the fallback's draft logits as they are and marks the n-gram rows as point masses."""
    rep = repetitive_prompt(4, 16)
    distinct = np.random.default_rng(6).permutation(np.arange(1, VOCAB))[:16].tolist()
    ids = torch.tensor([rep, distinct])
    ngram, fallback = _Recorded(NgramDrafter()), _Recorded(ModelDrafter(models["draft"]))
    hybrid = _Recorded(HybridDrafter(ngram, fallback))
    specjax.speculative_generate(
        models["target"], hybrid, ids, max_new_tokens=16, num_draft_tokens=4, temperature=0.8, seed=3, adaptive=False
    )
    mixed = 0
    fb = iter(fallback.proposals)
    for ng, hy in zip(ngram.proposals, hybrid.proposals, strict=True):
        matched = ng.num_tokens > 0
        if matched.all():  # the fallback did not run
            continue
        f = next(fb)
        if not matched.any():
            continue
        mixed += 1
        assert hy.logits is not None and hy.confidence is not None and f.confidence is not None
        assert hy.point_mass_rows is not None and hy.point_mass_rows.tolist() == matched.tolist()
        assert all(h is d for h, d in zip(hy.logits, f.logits, strict=False))  # the fallback's own arrays
        assert np.isnan(hy.confidence[matched]).all()
        k = f.confidence.shape[1]
        assert hy.confidence[~matched, :k].tolist() == f.confidence[~matched].tolist()
    assert mixed > 0, "no step mixed n-gram and fallback rows: the test does not test"


def test_model_drafter_scores_plain_steps_in_hindsight(models):
    """Greedy: tokens the target committed without testing a proposal are scored at the next proposal,
    against the draft's own first argmax after each prefix."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, SamplingState
    from specjax.kernels.types import SamplingParams

    draft = models["draft"]
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, VOCAB, size=7).tolist(), rng.integers(1, VOCAB, size=7).tolist()]
    ids = torch.tensor(prompts)
    sampling = SamplingState(SamplingParams(jnp.zeros(2, jnp.float32)), jax.random.split(jax.random.key(0), 2))
    drafter = ModelDrafter(draft)
    setup = DraftSetup(models["target"], ids, torch.ones_like(ids), [list(p) for p in prompts], VOCAB, 4, sampling)
    drafter.start(setup)

    def draft_choice(context):
        with torch.no_grad():
            return int(draft(torch.tensor([context])).logits[0, -1, :VOCAB].argmax())

    contexts = [list(p) for p in prompts]
    expected_hits = [0, 0]
    for _ in range(4):  # plain steps: row 0 commits the draft's choice, row 1 something else
        emitted = []
        for j in range(2):
            choice = draft_choice(contexts[j])
            token = choice if j == 0 else (choice + 1) % VOCAB
            expected_hits[j] += int(token == choice)
            emitted.append([token])
            contexts[j].append(token)
        drafter.commit(CommitInfo(emitted, np.zeros(2, np.int64), np.zeros(2, np.int64)))
    active = np.ones(2, bool)
    p = drafter.propose(DraftRequest(4, contexts, np.array([2, 2]), active, sampling))
    assert p.hindsight is not None
    assert p.hindsight[1].tolist() == [4, 4]
    assert p.hindsight[0].tolist() == expected_hits == [4, 0]
    # a step that drafted and tested (one accepted, then a bonus token): nothing to score in hindsight
    first = np.asarray(p.tokens)[:, 0].tolist()
    drafter.commit(CommitInfo([[first[0], 5], [first[1], 6]], np.array([1, 1]), np.array([1, 1])))
    again = drafter.propose(DraftRequest(5, contexts, np.array([2, 2]), active, sampling))
    assert again.hindsight is not None and again.hindsight[1].tolist() == [0, 0]


class Recorder:
    """Proposes nothing; records what each request offered a confident drafter."""

    name = "recorder"
    needs_target_hidden = False
    cost_per_token_hint = 0.001
    asks_every_step = True

    def __init__(self):
        self.offered = []

    def start(self, setup):
        pass

    def propose(self, request):
        self.offered.append(request.worth_drafting)
        b = len(request.contexts)
        return Proposal(np.zeros((b, 0), np.int64), np.zeros(b, np.int64), None, confidence=np.zeros((b, 0)))

    def commit(self, info):
        pass

    def select_rows(self, rows):
        pass


@pytest.mark.parametrize(
    ("temperature", "adaptive", "offered"),
    [(0.0, True, True), (0.7, True, True), (0.0, False, False), (0.7, False, False)],
)
def test_confidence_is_offered_to_adaptive_calls(models, temperature, adaptive, offered):
    """The loop offers ``worth_drafting`` whenever the draft length is adaptive (with sampling it
    then tests the drawn tokens sequentially: DraftSchedule.trim), never with a fixed length."""
    rec = Recorder()
    ids = torch.tensor([repetitive_prompt(7, 8)])
    specjax.speculative_generate(
        models["target"], rec, ids, max_new_tokens=6, num_draft_tokens=3, temperature=temperature, adaptive=adaptive
    )
    assert rec.offered  # it was asked
    assert all(callable(w) for w in rec.offered) if offered else all(w is None for w in rec.offered)


def _two_then_one(calls):
    """A ``worth_drafting`` for two rows: row 0 goes on to 2 tokens, row 1 stops after 1 (records the
    token count it is asked at)."""

    def worth(confidence):
        calls.append(confidence.shape[1])
        return np.array([confidence.shape[1] < 2, False])

    return worth


def test_model_drafter_reports_confidence_and_stops_where_told(models):
    """Greedy: each proposed token comes with the draft model's probability of it, and a row stops
    drafting once the request's ``worth_drafting`` says no; a later step drafts on from what it kept."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, SamplingState
    from specjax.kernels.types import SamplingParams

    draft = models["draft"]
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, VOCAB, size=7).tolist(), rng.integers(1, VOCAB, size=7).tolist()]
    ids = torch.tensor(prompts)
    sampling = SamplingState(SamplingParams(jnp.zeros(2, jnp.float32)), jax.random.split(jax.random.key(0), 2))
    setup = DraftSetup(models["target"], ids, torch.ones_like(ids), [list(p) for p in prompts], VOCAB, 4, sampling)
    active = np.ones(2, bool)

    def reference(context, n):  # the draft's greedy chain and its probability of each token
        tokens, probs = [], []
        with torch.no_grad():
            for _ in range(n):
                p = torch.softmax(draft(torch.tensor([context + tokens])).logits[0, -1, :VOCAB].double(), -1)
                tokens.append(int(p.argmax()))
                probs.append(float(p.max()))
        return tokens, probs

    full = ModelDrafter(draft)
    full.start(setup)
    p = full.propose(DraftRequest(0, [list(c) for c in prompts], np.array([3, 3]), active, sampling))
    assert p.confidence is not None and p.confidence.shape == (2, 3)
    for j in range(2):
        tokens, probs = reference(prompts[j], 3)
        assert np.asarray(p.tokens)[j].tolist() == tokens
        assert p.confidence[j] == pytest.approx(probs, rel=1e-4)

    calls: list[int] = []
    stopped = ModelDrafter(draft)
    stopped.start(setup)
    q = stopped.propose(
        DraftRequest(0, [list(c) for c in prompts], np.array([3, 3]), active, sampling, None, _two_then_one(calls))
    )
    assert q.num_tokens.tolist() == [2, 1] and calls == [1, 2] and q.paid_tokens == 2
    assert np.asarray(q.tokens)[:, :2].tolist() == np.asarray(p.tokens)[:, :2].tolist()
    # row 0 commits its two tokens and a bonus, row 1 its one and a correction: the next proposal
    # continues each row's committed context (the cache kept exactly the fed tokens committed)
    t = np.asarray(q.tokens)
    emitted = [[int(t[0, 0]), int(t[0, 1]), 7], [int(t[1, 0]), 9]]
    stopped.commit(CommitInfo(emitted, np.array([2, 1]), np.array([2, 1])))
    contexts = [prompts[j] + emitted[j] for j in range(2)]
    nxt = stopped.propose(DraftRequest(1, contexts, np.array([2, 2]), active, sampling))
    for j in range(2):
        assert np.asarray(nxt.tokens)[j].tolist() == reference(contexts[j], 2)[0]


def test_sampled_model_drafter_reports_its_peak_probability_and_stops_where_told(models):
    """T = 0.8: each drawn position comes with the largest probability of the draft model's
    distribution at that temperature, and a row stops drafting once ``worth_drafting`` says no,
    keeping the draws it made."""
    import jax
    import jax.numpy as jnp

    from specjax.drafters.base import DraftRequest, DraftSetup, SamplingState
    from specjax.kernels.types import SamplingParams

    draft = models["draft"]
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, VOCAB, size=7).tolist(), rng.integers(1, VOCAB, size=7).tolist()]
    ids = torch.tensor(prompts)
    sampling = SamplingState(SamplingParams(jnp.full(2, 0.8, jnp.float32)), jax.random.split(jax.random.key(3), 2))
    setup = DraftSetup(models["target"], ids, torch.ones_like(ids), [list(p) for p in prompts], VOCAB, 4, sampling)
    active = np.ones(2, bool)

    full = ModelDrafter(draft)
    full.start(setup)
    p = full.propose(DraftRequest(0, [list(c) for c in prompts], np.array([3, 3]), active, sampling))
    assert p.logits is not None and p.confidence is not None and p.confidence.shape == (2, 3)
    tokens = np.asarray(p.tokens)
    with torch.no_grad():
        for j in range(2):
            for i in range(3):
                logits = draft(torch.tensor([prompts[j] + tokens[j, :i].tolist()])).logits[0, -1, :VOCAB]
                prob = torch.softmax(logits.double() / 0.8, -1).max()
                assert p.confidence[j, i] == pytest.approx(float(prob), rel=1e-3)

    calls: list[int] = []
    stopped = ModelDrafter(draft)
    stopped.start(setup)
    q = stopped.propose(
        DraftRequest(0, [list(c) for c in prompts], np.array([3, 3]), active, sampling, None, _two_then_one(calls))
    )
    assert q.num_tokens.tolist() == [2, 1] and calls == [1, 2] and q.paid_tokens == 2 and len(q.logits) == 2
    assert np.asarray(q.tokens)[:, :2].tolist() == tokens[:, :2].tolist()  # the same keys: the same draws


def test_model_drafter_after_a_step_that_committed_only_fed_tokens(models):
    """The loop tested fewer proposals than the draft fed, and the target's token after them was the next
    fed one: every committed token is already in the draft's cache. Its next proposal must still come
    (it re-feeds the last one) and be the draft's greedy continuation of the context."""
    import jax

    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup, SamplingState
    from specjax.kernels.types import SamplingParams

    draft = models["draft"]
    ids = torch.tensor([repetitive_prompt(4, 12)])
    sampling = SamplingState(SamplingParams(np.zeros(1, np.float32)), jax.random.split(jax.random.key(0), 1))
    drafter = ModelDrafter(draft)
    vocab = draft.config.vocab_size
    drafter.start(DraftSetup(draft, ids, torch.ones_like(ids), [ids[0].tolist()], vocab, 4, sampling))
    first = drafter.propose(DraftRequest(0, [ids[0].tolist()], np.array([4]), np.ones(1, bool), sampling))
    x = [int(t) for t in np.asarray(first.tokens)[0]]
    # the loop tested 2 of the 4, accepted both, and the target's next token was x[2] (fed, not tested)
    drafter.commit(CommitInfo([x[:3]], np.array([2]), np.array([2])))
    context = ids[0].tolist() + x[:3]
    second = drafter.propose(DraftRequest(1, [context], np.array([3]), np.ones(1, bool), sampling))
    want = draft.generate(torch.tensor([context]), do_sample=False, max_new_tokens=3, pad_token_id=0)
    assert np.asarray(second.tokens)[0].tolist() == want[0, len(context) :].tolist()
