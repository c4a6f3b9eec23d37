"""recipes.eagle.core's batching and schedule, recipes.eagle.torch_backend's teacher-forced agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipes.eagle.core import cosine_lr, frequent_tokens, pack_by_length, token_counts
from recipes.eagle.torch_backend import agreement_counts, agreement_hits, head_choice
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights

D = 16
CFG = EagleConfig(D, 4, 2, 32, 50, 20)
DEEP = EagleConfig(D, 4, 2, 32, 50, 20, num_layers=2)


@pytest.fixture(params=[CFG, DEEP], ids=["one-layer", "two-layers"])
def head(request):
    h = EagleHead(request.param)
    init_weights(h, 0)
    with torch.no_grad():  # a head whose attention matters (not the near-identity start)
        for p in h.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return h.eval()


@pytest.mark.parametrize(
    ("sequences", "n", "want"),
    [
        ([[3, 3, 1], [1, 3, 0]], 2, [1, 3]),  # 3 thrice, 1 twice
        ([[4, 2], [2, 4]], 1, [2]),  # a tie goes to the smaller id
        ([[0, 1]], 9, [0, 1, 2, 3, 4]),  # n >= V: every id
    ],
)
def test_frequent_tokens_are_the_most_counted_ids_sorted(sequences, n, want):
    assert frequent_tokens(token_counts(sequences, 5), n).tolist() == want
    assert frequent_tokens(token_counts(sequences, 5), n).dtype == np.int64


def test_pack_by_length_covers_every_sequence_within_the_token_budget():

    lengths = [5, 40, 7, 5, 300, 12, 40, 9]
    batches = pack_by_length(lengths, 64)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 64
    assert [4] in batches  # longer than the budget: a batch of its own
    assert [lengths[i] for b in batches for i in b] == sorted(lengths)  # similar lengths together


def test_cosine_lr_warms_up_then_decays_to_zero():

    assert cosine_lr(1.0, 0, 0.0, warmup=10) == pytest.approx(0.1)
    assert cosine_lr(1.0, 9, 0.0, warmup=10) == pytest.approx(1.0)
    assert cosine_lr(1.0, 500, 0.5, warmup=10) == pytest.approx(0.5)
    assert cosine_lr(1.0, 500, 1.0, warmup=10) == pytest.approx(0.0)


def test_head_choice_with_context_is_the_argmax_over_the_heads_tokens_and_the_rows_context(head):
    """``head_choice`` against a brute force: at pair t, the head's N tokens and the row's present tokens 0..t+1."""

    g = torch.Generator().manual_seed(5)
    b, length, vocab = 3, 9, CFG.target_vocab_size
    with torch.no_grad():
        head.token_ids.copy_(torch.arange(0, 2 * CFG.num_tokens, 2))  # the even tokens below 40
    tokens = torch.randint(0, vocab, (b, length), generator=g)
    present = torch.ones(b, length, dtype=torch.bool)
    present[2, 6:] = False  # a shorter row: its padding is not context
    pred = torch.randn(b, length - 1, D, generator=g)
    w = torch.randn(vocab, D, generator=g)
    got = head_choice(head, pred, w, (tokens, present))
    plain = head_choice(head, pred, w)
    own = set(head.token_ids.tolist())
    for r in range(b):
        for t in range(length - 1):
            pool = own | {int(x) for x, p in zip(tokens[r, : t + 2], present[r, : t + 2], strict=True) if p}
            cand = sorted(pool)
            assert int(got[r, t]) == cand[int((pred[r, t] @ w[cand].T).argmax())]
            assert int(plain[r, t]) == sorted(own)[int((pred[r, t] @ w[sorted(own)].T).argmax())]
    assert (got != plain).any()  # the context changed some choices (odd tokens, ids 40+)


def test_agreement_hits_are_per_pair_and_sum_to_the_counts(head):
    """``agreement_hits`` marks each counted pair where the head's choice is the target's argmax (brute force
    here), only counted pairs; ``agreement_counts`` is their sum."""

    g = torch.Generator().manual_seed(11)
    b, length, vocab = 2, 8, CFG.target_vocab_size
    embed = torch.nn.Embedding.from_pretrained(torch.randn(vocab, D, generator=g))
    w = torch.randn(vocab, D, generator=g)
    w[:2] *= 10.0  # two tokens (among the head's) win most argmaxes: hits and misses both occur
    z = torch.randn(b, length, D, generator=g)
    tokens = torch.randint(0, vocab, (b, length), generator=g)
    valid = torch.ones(b, length, dtype=torch.bool)
    valid[1, 6:] = False
    scored = torch.arange(length - 1)[None, :].expand(b, -1) >= 2
    hit, counted = agreement_hits(head, embed, w, z, tokens, valid, scored)
    with torch.no_grad():
        pair_valid = valid[:, :-1] & valid[:, 1:]
        pred = head(z[:, :-1], embed(tokens[:, 1:]), pair_valid)
        want = (head_choice(head, pred, w) == (z[:, 1:] @ w.T).argmax(-1)) & pair_valid & scored
    assert torch.equal(counted, pair_valid & scored)
    assert torch.equal(hit, want) and 0 < int(hit.sum()) < int(counted.sum())
    assert agreement_counts(head, embed, w, z, tokens, valid, scored) == (int(want.sum()), int(counted.sum()))
    # negative control: a different target changes the hits
    other, _ = agreement_hits(head, embed, w, -z, tokens, valid, scored)
    assert not torch.equal(other, hit)


def test_the_torch_training_loop_trains_a_head_on_a_targets_own_states():
    """``Store`` -> ``train_variant`` -> ``agreement`` on a tiny Llama: the head's weights move from their start
    and its agreement with the target's greedy tokens is a share."""
    import argparse

    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.eagle.torch_backend import Store, agreement, train_variant

    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    ).eval().requires_grad_(False)  # fmt: skip
    g = np.random.default_rng(3)
    seqs = [g.integers(3, 256, int(n)).tolist() for n in g.integers(10, 24, 16)]
    store = Store()
    store.add(target, [s[:4] for s in seqs], [s[4:] for s in seqs])
    data = store.packed()
    shape = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 256}
    token_ids = torch.arange(0, 256, 2)
    args = argparse.Namespace(seed=0, lr=1e-2, device="cpu", train_minutes=0.02, variant=["kd"], batch_tokens=128)
    head, steps, epochs, _ = train_variant("kd", shape, token_ids, target, data, args)
    assert steps >= 1 and epochs >= 1

    start = EagleHead(EagleConfig(64, 4, 2, 128, 256, 128))
    init_weights(start, 0)
    moved = [k for k, v in start.state_dict().items() if k != "token_ids" and not torch.equal(v, head.state_dict()[k])]
    assert moved  # negative control: lr 0 leaves every weight where init_weights put it
    first, second = agreement(head, target, data)
    assert 0.0 <= first <= 1.0 and 0.0 <= second <= 1.0
