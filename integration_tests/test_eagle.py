"""The ``eagle`` drafter on a tiny random target: greedy identity, a trained head drafts, errors.

A head is trained for a few seconds on the target's own greedy continuations
(:mod:`recipes.eagle.torch_backend`), so its proposals are accepted often
enough that the identity tests exercise accepted draft tokens, not only
corrections. The distribution test at T = 0.7 is in test_generate_stats.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specjax
from recipes.eagle.core import LossWeights, frequent_tokens, token_counts
from recipes.eagle.torch_backend import head_loss, target_features, teacher_agreement
from specjax.drafters import load_drafter
from specjax.drafters.eagle import EagleDrafter
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

V = 48


PROMPT = [5, 9, 2, 30, 7]
RAGGED = ([6, 1, 3, 8], 4)  # the ragged batch: lengths, seed of make_left_padded


def train_tiny_head(
    target, prompts, *, num_tokens: int, steps: int = 100, seed: int = 0, feature_layers=(), num_layers: int = 1
):
    """A head for ``target`` trained on its greedy continuations of ``prompts``; agreement before/after.

    A random target's next token is an arbitrary function of its context, which
    a few thousand pairs cannot teach in general: the head learns the
    continuations of these prompts, which the tests then use, so that its
    proposals are often accepted.
    """
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        seqs = target.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0
        )
    seqs = seqs.clone()  # a normal tensor (not an inference one) for the training graph
    mask = torch.cat([mask, torch.ones((len(prompts), 24), dtype=torch.long)], dim=1)
    valid = mask.bool()
    d = target.config.hidden_size
    head = EagleHead(EagleConfig(d, 4, 2, 2 * d, V, num_tokens, feature_layers=feature_layers, num_layers=num_layers))
    z = target_features(target, seqs, mask, head.target_hidden_layers).clone()
    init_weights(head, seed)
    counts = token_counts([s[m].tolist() for s, m in zip(seqs, valid, strict=True)], V)
    head.token_ids.copy_(torch.from_numpy(frequent_tokens(counts, num_tokens)))
    embed, w = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    before = teacher_agreement(head, embed, w, z, seqs, valid)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = head_loss(head, embed, w, z, seqs, valid, LossWeights(distill=1.0, unroll=0.5))
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval()
    return head, before, teacher_agreement(head, embed, w, z, seqs, valid)


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm("llama", vocab_size=V, layers=2, hidden=32, seed=3, init_range=0.3)


@pytest.fixture(scope="module")
def trained(target, left_padded):
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ragged = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    gen = torch.Generator().manual_seed(0)
    others = torch.randint(1, V, (16, 5), generator=gen).tolist()
    return train_tiny_head(target, [PROMPT, *ragged, *others], num_tokens=40)


@pytest.fixture(scope="module")
def trained_deep(target, left_padded):
    """The same data, a head of two decoder layers (each with its own cache, cut back after every
    verification and row-selected with the batch)."""
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ragged = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    others = torch.randint(1, V, (16, 5), generator=torch.Generator().manual_seed(0)).tolist()
    head, before, after = train_tiny_head(target, [PROMPT, *ragged, *others], num_tokens=40, num_layers=2)
    assert len(head.deeper) == 1
    return head, before, after


@pytest.fixture(params=["trained", "trained_deep"], ids=["one-layer", "two-layers"])
def any_trained(request):
    return request.getfixturevalue(request.param)


def test_training_raises_agreement(any_trained):
    _, before, after = any_trained
    assert after > before + 0.2 and after > 0.5, (before, after)


@pytest.fixture(scope="module")
def trained_fused(target, left_padded):
    """An EAGLE-3-style head: it reads the target's state after its first layer beside z."""
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ragged = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    others = torch.randint(1, V, (16, 5), generator=torch.Generator().manual_seed(0)).tolist()
    return train_tiny_head(target, [PROMPT, *ragged, *others], num_tokens=40, feature_layers=(1,))


def test_a_head_reading_several_layers_is_greedy_identical(target, trained_fused, left_padded):
    """The loop hands such a head the states it names (the fused input takes 2d here) from the prefill
    and every verification; drafts are accepted and the output is the target's."""
    head, before, after = trained_fused
    assert after > before + 0.2 and after > 0.5, (before, after)
    drafter = EagleDrafter(head)
    assert drafter.target_hidden_layers == (1, -1)
    ids = torch.tensor([PROMPT])
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    out = specjax.speculative_generate(
        target, drafter, ids, max_new_tokens=24, num_draft_tokens=4, adaptive=False, pad_token_id=0
    )
    assert torch.equal(out.sequences, ref) and out.stats.draft_tokens_accepted > 0, out.stats
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=17, pad_token_id=0)
    out = specjax.speculative_generate(
        target, EagleDrafter(head), ids, attention_mask=mask, max_new_tokens=17, num_draft_tokens=3, pad_token_id=0
    )
    assert torch.equal(out.sequences, ref)


def test_a_head_reading_layers_the_target_lacks_is_refused(target):
    head = EagleHead(EagleConfig(32, 4, 2, 64, V, V, feature_layers=(1, 2)))  # the target has 2 layers
    with pytest.raises(ValueError, match=r"after layers \[1, 2\], the target has 2 layers"):
        specjax.speculative_generate(target, EagleDrafter(head), torch.tensor([PROMPT]), max_new_tokens=4)


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_identity_batch_of_one(target, any_trained, adaptive):
    head, _, _ = any_trained
    ids = torch.tensor([PROMPT])
    ref = target.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=0)
    out = specjax.speculative_generate(
        target, EagleDrafter(head), ids, max_new_tokens=24, num_draft_tokens=4, adaptive=adaptive, pad_token_id=0
    )
    assert torch.equal(out.sequences, ref)
    if not adaptive:
        assert out.stats.draft_tokens_accepted > 0, out.stats  # accepted proposals carried the identity too


def test_greedy_identity_ragged_left_padded_batch(target, any_trained, left_padded):
    head, _, _ = any_trained
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=17, pad_token_id=0)
    out = specjax.speculative_generate(
        target,
        EagleDrafter(head),
        ids,
        attention_mask=mask,
        max_new_tokens=17,
        num_draft_tokens=3,
        adaptive=False,
        pad_token_id=0,
    )
    assert torch.equal(out.sequences, ref)
    assert out.stats.draft_tokens_accepted > 0


def test_never_drafts_past_max_new_tokens(target, trained):
    head, _, _ = trained
    ids = torch.tensor([PROMPT])
    for n in (1, 2, 5):
        out = specjax.speculative_generate(
            target, EagleDrafter(head), ids, max_new_tokens=n, num_draft_tokens=4, adaptive=False, pad_token_id=0
        )
        assert out.sequences.shape[1] == ids.shape[1] + n


def _sampling(batch: int, temperature: float = 0.0):
    import jax
    import jax.numpy as jnp

    from specjax.drafters.base import SamplingState
    from specjax.kernels.types import SamplingParams

    return SamplingState(
        SamplingParams(jnp.full(batch, temperature, jnp.float32)), jax.random.split(jax.random.key(0), batch)
    )


def test_commits_are_read_when_the_head_drafts_and_all_at_once_as_one_by_one(target, trained, left_padded):
    """A commit costs the head nothing; its next proposal reads every pending commit (and the prompt) in one
    forward, with the features (hence proposals) of reading them one by one."""
    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup

    head, _, _ = trained
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    batch, d = ids.shape[0], target.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    hidden_prompt = torch.randn(batch, ids.shape[1] - 1, d, generator=gen)
    commits = [[[3], [4, 5], [], [6]], [[7, 8, 9], [1], [2], []], [[4], [4], [4], [4]]]
    hiddens = [torch.randn(batch, 3, d, generator=gen) for _ in commits]

    def setup():
        return DraftSetup(target, ids, mask, [[] for _ in range(batch)], V, 4, _sampling(batch), hidden_prompt)

    def commit(drafter, emitted, hidden):
        counts = np.array([len(e) for e in emitted])
        drafter.commit(CommitInfo(emitted, np.maximum(counts - 1, 0), np.zeros(batch, np.int64), hidden))

    calls = []
    lazy, eager = EagleDrafter(head), EagleDrafter(head)
    original = head.forward
    head.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        lazy.start(setup())
        eager.start(setup())
        eager._read_commits()
        for emitted, hidden in zip(commits, hiddens, strict=True):
            commit(lazy, emitted, hidden)
            commit(eager, emitted, hidden)
            eager._read_commits()  # one forward per commit, as before the commits were deferred
        assert len(calls) == 1 + len(commits)  # the eager one's: the lazy drafter has not run its head
        request = DraftRequest(0, [[] for _ in range(batch)], np.full(batch, 2), np.ones(batch, bool), _sampling(batch))
        lazy_out, eager_out = lazy.propose(request), eager.propose(request)
    finally:
        head.forward = original
    # the lazy drafter read the prompt and the three commits in one forward, then drafted (one more)
    assert len(calls) == (1 + len(commits)) + 2 + 1
    torch.testing.assert_close(lazy._feature, eager._feature, rtol=1e-4, atol=1e-5)
    assert lazy.cache.num_valid.tolist() == eager.cache.num_valid.tolist()
    np.testing.assert_array_equal(lazy_out.tokens, eager_out.tokens)
    np.testing.assert_array_equal(lazy_out.num_tokens, eager_out.num_tokens)


def test_dropping_rows_keeps_their_commits_unread_and_drafts_the_same(target, trained, left_padded):
    """Rows that finish leave without a head forward (a call that never drafts never runs the head); the
    rows kept propose what they would have after reading their commits before the drop."""
    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup

    head, _, _ = trained
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    batch, d = ids.shape[0], target.config.hidden_size
    assert batch >= 3
    gen = torch.Generator().manual_seed(11)
    hidden_prompt = torch.randn(batch, ids.shape[1] - 1, d, generator=gen)
    emitted = [[3, 4][: 1 + b % 2] for b in range(batch)]
    hidden = torch.randn(batch, 2, d, generator=gen)
    keep = [batch - 1, 0]  # reordered, and at least one row dropped

    def prepared():
        drafter = EagleDrafter(head)
        drafter.start(DraftSetup(target, ids, mask, [[] for _ in range(batch)], V, 4, _sampling(batch), hidden_prompt))
        counts = np.array([len(e) for e in emitted])
        drafter.commit(CommitInfo(emitted, counts - 1, np.zeros(batch, np.int64), hidden))
        return drafter

    calls = []
    lazy, eager = prepared(), prepared()
    eager._read_commits()
    original = head.forward
    head.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        lazy.select_rows(keep)
        eager.select_rows(keep)
        assert calls == []  # neither ran the head to drop rows
        request = DraftRequest(0, [[] for _ in keep], np.full(len(keep), 2), np.ones(len(keep), bool), _sampling(2))
        lazy_out, eager_out = lazy.propose(request), eager.propose(request)
    finally:
        head.forward = original
    assert len(calls) == 1 + 1 + 1  # the lazy one read its kept rows' commits; each drafted one more
    torch.testing.assert_close(lazy._feature, eager._feature, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(lazy_out.tokens, eager_out.tokens)
    assert lazy.cache.num_valid.tolist() == eager.cache.num_valid.tolist()


def test_saved_head_loads_and_drafts_the_same(target, trained, tmp_path):
    from specjax.drafters.eagle_head import load_head, save_head

    head, _, _ = trained
    save_head(head, tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    assert torch.equal(loaded.token_ids, head.token_ids)
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=12, num_draft_tokens=3, adaptive=False, pad_token_id=0)
    a = specjax.speculative_generate(target, load_drafter("eagle", head=tmp_path / "head"), ids, **kw)
    b = specjax.speculative_generate(target, EagleDrafter(head), ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert a.stats.drafter == "eagle"


def test_a_head_for_another_target_is_refused(target):
    head = EagleHead(EagleConfig(64, 4, 2, 64, V, V))
    with pytest.raises(ValueError, match="hidden size 64"):
        specjax.speculative_generate(target, EagleDrafter(head), torch.tensor([[1, 2, 3]]), max_new_tokens=2)
    head = EagleHead(EagleConfig(32, 4, 2, 64, V + 1, V))
    with pytest.raises(ValueError, match=f"vocabulary of {V + 1}"):
        specjax.speculative_generate(target, EagleDrafter(head), torch.tensor([[1, 2, 3]]), max_new_tokens=2)


def test_sampled_proposals_come_with_their_logits(target, trained):
    """At T > 0 the head returns full-vocabulary logits, -inf outside the tokens it scores (q = 0 there):
    its N and the row's context."""
    head, _, _ = trained
    seen = []

    class Spy(EagleDrafter):
        def propose(self, request):
            proposal = super().propose(request)
            seen.append((proposal, self.scored_token_ids.numpy().copy(), list(request.contexts[0])))
            return proposal

    ids = torch.tensor([PROMPT])
    out = specjax.speculative_generate(
        target,
        Spy(head),
        ids,
        max_new_tokens=8,
        num_draft_tokens=3,
        temperature=0.8,
        seed=0,
        pad_token_id=0,
        adaptive=False,  # the adaptive length may not draft at all on a loaded machine: this test needs drafts
    )
    assert out.sequences.shape == (1, 13)
    drafted = [s for s in seen if int(s[0].num_tokens.max()) > 0]
    assert drafted and all(p.logits is not None for p, _, _ in drafted)
    for p, scored, context in drafted:
        assert sorted(scored.tolist()) == sorted(set(head.token_ids.tolist()) | set(context))
        outside = np.setdiff1d(np.arange(V), scored)
        tokens = np.asarray(p.tokens)
        assert np.isin(tokens[:, : int(p.num_tokens[0])], scored).all()
        for lg in p.logits:
            lg = np.asarray(lg)
            assert np.isneginf(lg[:, outside]).all() and np.isfinite(lg[:, scored]).all()


def _few_tokens(head, keep: int):
    """``head`` scoring only its ``keep`` first tokens (the same weights)."""
    import dataclasses

    small = EagleHead(dataclasses.replace(head.config, num_tokens=keep))
    state = {k: v for k, v in head.state_dict().items() if k != "token_ids"}
    small.load_state_dict({**state, "token_ids": head.token_ids[:keep].clone()}, strict=True)
    return small.eval()


def test_context_tokens_are_scored_beside_the_heads_own(target, trained, left_padded):
    """A head scoring 6 tokens proposes the rows' context tokens too (greedy identity holds); with
    ``context_tokens=0`` only its own 6; the room bounds how many are added."""
    head, _, _ = trained
    small = _few_tokens(head, 6)
    own = set(small.token_ids.tolist())
    ids, mask = left_padded(RAGGED[0], vocab_size=V, seed=RAGGED[1])
    ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    prompt = set(ids[mask.bool()].tolist())
    context = prompt | set(ref[:, ids.shape[1] :].flatten().tolist())
    assert len(prompt - own) > 3
    proposed = {}
    for room in (2048, 0, 3):
        seen: list = []

        class Spy(EagleDrafter):
            def propose(self, request, seen=seen):
                proposal = super().propose(request)
                seen.append((proposal, set(self.scored_token_ids.tolist())))
                return proposal

        out = specjax.speculative_generate(
            target,
            Spy(small, context_tokens=room),
            ids,
            attention_mask=mask,
            max_new_tokens=16,
            num_draft_tokens=3,
            adaptive=False,
            pad_token_id=0,
        )
        assert torch.equal(out.sequences, ref)
        proposed[room] = {
            int(t) for p, _ in seen for row, n in zip(p.tokens, p.num_tokens, strict=True) for t in row[:n]
        }
        extra = [scored - own for _, scored in seen]
        assert all(e <= context for e in extra)
        if room == 2048:
            assert prompt - own <= extra[0]  # the prompt's tokens from the start
        else:
            assert all(len(e) == room for e in extra)  # filled at the start, then no more
    assert proposed[0] <= own
    assert proposed[2048] - own and proposed[2048] <= own | context  # context tokens proposed


def test_context_tokens_must_be_a_count(trained):
    head, _, _ = trained
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="context_tokens: expected an int >= 0"):
            EagleDrafter(head, context_tokens=bad)


def test_unknown_head_directory_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        load_drafter("eagle", head=tmp_path / "missing")


# --------------------------------------------------------------------------- #
# The command line: --drafter DIR (an EAGLE head's directory)
# --------------------------------------------------------------------------- #


def test_cli_drafts_with_a_head_directory(tmp_path, capsys):
    import json

    from test_cli import _model_dir
    from transformers import AutoModelForCausalLM

    from specjax.cli import main
    from specjax.drafters.eagle_head import save_head

    target_dir = _model_dir(tmp_path / "target", layers=2, seed=0, words=None)
    cfg = AutoModelForCausalLM.from_pretrained(target_dir).config
    head = EagleHead(EagleConfig(cfg.hidden_size, 4, 2, 64, cfg.vocab_size, cfg.vocab_size))
    init_weights(head, 0)
    save_head(head, tmp_path / "head")
    argv = ["generate", "--target", str(target_dir), "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--json"]
    assert main([*argv, "--drafter", str(tmp_path / "head")]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["stats"]["drafter"] == "eagle" and len(record["token_ids"]) == 6
    assert main([*argv, "--drafter", "ngram"]) == 0  # the same greedy tokens, whatever drafts
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == record["token_ids"]


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (None, "--drafter eagle: with --target, give the head's directory"),
        (lambda p: (p / "model.safetensors").unlink(), "model.safetensors: missing"),
        (lambda p: (p / "model.safetensors").write_bytes(b"junk"), "not a readable safetensors"),
    ],
)
def test_cli_head_errors_are_one_line_exit_2(tmp_path, capsys, setup, match):
    from specjax.cli import main
    from specjax.drafters.eagle_head import save_head

    drafter = "eagle"
    if setup is not None:
        head = EagleHead(EagleConfig(32, 4, 2, 64, V, V))
        save_head(head, tmp_path / "head")
        setup(tmp_path / "head")
        drafter = str(tmp_path / "head")
    code = main(["generate", "--target", str(tmp_path / "no-model"), "--prompt", "hi", "--drafter", drafter])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert match in err[0]


def test_plain_steps_are_scored_in_hindsight(target, trained):
    """Greedy: the next proposal reports, per row, how many tokens committed in plain steps were the
    head's first choice just before them (a reference drafter reads every commit as it comes)."""
    from specjax.drafters.base import CommitInfo, DraftRequest, DraftSetup

    head, _, _ = trained
    ids = torch.tensor([PROMPT, PROMPT[::-1], PROMPT[1:] + PROMPT[:1]])
    batch, d = ids.shape[0], target.config.hidden_size
    gen = torch.Generator().manual_seed(3)
    hidden_prompt = torch.randn(batch, ids.shape[1] - 1, d, generator=gen)
    setup = DraftSetup(
        target, ids, torch.ones_like(ids), [[] for _ in range(batch)], V, 4, _sampling(batch), hidden_prompt
    )
    lazy, eager = EagleDrafter(head), EagleDrafter(head)
    lazy.start(setup)
    eager.start(setup)
    eager._read_commits()
    hits = np.zeros(batch, np.int64)
    for step in range(4):
        with torch.inference_mode():
            choice = head.token_ids[eager._scores(eager._feature).max(dim=-1).indices].tolist()
        # row 0 always commits the head's choice, row 1 never, row 2 every other step
        take = [True, False, step % 2 == 0]
        emitted = [[c if t else (c + 1) % V] for c, t in zip(choice, take, strict=True)]
        hits += np.array(take)
        hidden = torch.randn(batch, 1, d, generator=gen)
        for drafter in (lazy, eager):
            drafter.commit(CommitInfo(emitted, np.zeros(batch, np.int64), np.zeros(batch, np.int64), hidden))
        eager._read_commits()
    request = DraftRequest(4, [[] for _ in range(batch)], np.full(batch, 2), np.ones(batch, bool), _sampling(batch))
    p = lazy.propose(request)
    assert p.hindsight is not None
    assert p.hindsight[1].tolist() == [4, 4, 4]
    assert p.hindsight[0].tolist() == hits.tolist() == [4, 0, 2]
    # reported once; a tested step (num_proposed > 0) adds nothing
    tokens = np.asarray(p.tokens)[:, 0].tolist()
    hidden = torch.randn(batch, 2, d, generator=gen)
    lazy.commit(CommitInfo([[t, 1] for t in tokens], np.ones(batch, np.int64), np.ones(batch, np.int64), hidden))
    again = lazy.propose(request)
    assert again.hindsight is not None and again.hindsight[1].tolist() == [0, 0, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_proposals_carry_the_heads_confidence_and_stop_where_told(target, trained, temperature):
    """Each drafted position comes with the head's confidence, its distribution's largest
    probability (softmax over its N tokens; sampled: at the row's temperature, known before the
    draw; greedy: of its choice), and a row stops drafting once ``worth_drafting`` says no (the
    loop then tests all it proposed when sampling)."""
    from specjax.drafters.base import DraftRequest, DraftSetup

    head, _, _ = trained
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    batch = ids.shape[0]
    hidden = torch.randn(batch, ids.shape[1] - 1, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    sampling = _sampling(batch, temperature)
    setup = DraftSetup(target, ids, torch.ones_like(ids), [list(r) for r in ids.tolist()], V, 4, sampling, hidden)

    def request(worth=None):
        return DraftRequest(
            0, [[] for _ in range(batch)], np.full(batch, 4), np.ones(batch, bool), sampling, None, worth
        )

    full = EagleDrafter(head)
    full.start(setup)
    p = full.propose(request())
    assert p.num_tokens.tolist() == [4, 4] and p.confidence is not None and p.confidence.shape == (batch, 4)
    assert (p.logits is None) == (temperature == 0)
    with torch.inference_mode():  # the kept feature is the first position's
        probs = torch.softmax(full._scores(full._feature).double() / (temperature or 1.0), dim=-1).numpy()
    assert p.confidence[:, 0] == pytest.approx(probs.max(axis=-1), rel=1e-4)
    assert ((p.confidence > 0) & (p.confidence <= 1)).all()

    calls = []

    def worth(confidence):  # row 0: one token more after the first; row 1: none
        calls.append(confidence.shape)
        return np.array([confidence.shape[1] < 2, False])

    stopped = EagleDrafter(head)
    stopped.start(setup)
    q = stopped.propose(request(worth))
    assert q.num_tokens.tolist() == [2, 1]
    assert calls == [(batch, 1), (batch, 2)]  # asked after each token while a row went on
    assert np.asarray(q.tokens)[:, :2].tolist() == np.asarray(p.tokens)[:, :2].tolist()  # the same tokens (keys)
    assert q.paid_tokens == 2 and q.confidence.shape == (batch, 2)
    assert q.logits is None if temperature == 0 else len(q.logits) == 2


@pytest.mark.parametrize("layers", [(9,), (), ("1",)])
def test_a_drafter_asking_for_states_the_target_lacks_gets_a_clear_error(target, trained, layers):
    class Asking(EagleDrafter):
        pass

    drafter = Asking(trained[0])
    drafter.target_hidden_layers = layers
    expected = r"drafter .eagle.: target_hidden_layers: expected one or more integers in \[-3, 2\]"
    with pytest.raises(ValueError, match=expected):
        specjax.speculative_generate(target, drafter, torch.tensor([PROMPT]), max_new_tokens=4)
