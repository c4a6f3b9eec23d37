"""The EAGLE head on the JAX path (issue 55), on JAX's CPU backend.

Reference: the head's own torch forward (:class:`specjax.drafters.eagle_head.EagleHead` with its
:class:`FeatureCache`); the JAX head (:mod:`specjax.generate.jax_eagle`) runs the same arithmetic
through a static cache with per-row pair numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchax_models import on_jax, ragged_prompts, target_greedy, tiny_llama

from specjax.drafters.eagle import CONTEXT_TOKENS, EagleDrafter
from specjax.drafters.eagle_head import EagleConfig, EagleHead, FeatureCache, init_weights
from specjax.generate import jax_loop, jax_model, speculative_generate
from specjax.generate.jax_eagle import jax_head, scored_ids

pytestmark = pytest.mark.torchax

TOL = 2e-5


def random_head(layers=1, feature_layers=()):
    head = EagleHead(EagleConfig(64, 4, 2, 128, 256, 40, feature_layers=feature_layers, num_layers=layers))
    init_weights(head, 0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))  # away from the identity start
    return head.eval()


@pytest.mark.parametrize("layers, feature_layers", [(1, ()), (2, (1,))], ids=["one-layer", "two-layers-eagle3"])
def test_the_jax_head_matches_the_torch_head_through_its_cache(layers, feature_layers):
    """Two rows committing different numbers of pairs: a first piece of 5 (row 1 keeps 3), then 3 more each
    at the row's own pair numbers; every kept pair's output equals the torch head's."""
    head = random_head(layers, feature_layers)
    target = tiny_llama(seed=4)
    h = jax_head(head, target, 256)
    k = len(feature_layers) + 1
    gen = torch.Generator().manual_seed(6)
    hidden = [torch.randn((2, 5, k * 64), generator=gen), torch.randn((2, 3, k * 64), generator=gen)]
    ids = [torch.randint(0, 256, (2, 5), generator=gen), torch.randint(0, 256, (2, 3), generator=gen)]
    kept = np.array([5, 3])

    cache = FeatureCache(2, head.config, "cpu", torch.float32)
    valid = [torch.as_tensor(np.arange(5)[None] < kept[:, None]), torch.ones((2, 3), dtype=torch.bool)]
    embed = target.get_input_embeddings()
    with torch.no_grad():
        ref = [
            head(head.fuse_features(hd), embed(i), v, cache).numpy()
            for hd, i, v in zip(hidden, ids, valid, strict=True)
        ]

    fwd = jax.jit(lambda w, c, f, e, s: h.forward(w, c, f, e, s))
    w = h.weights
    c = h.init_cache(2, 16)
    got = []
    start = np.zeros(2, np.int32)
    for hd, i in zip(hidden, ids, strict=True):
        feats = h.fuse(w, jnp.asarray(hd.numpy()))
        out, c = fwd(w, c, feats, h.embed(w, jnp.asarray(i.numpy())), jnp.asarray(start))
        got.append(np.asarray(out))
        start = start + (kept if len(got) == 1 else 3)
    for b in range(2):
        np.testing.assert_allclose(got[0][b, : kept[b]], ref[0][b, : kept[b]], atol=TOL, rtol=0)
        np.testing.assert_allclose(got[1][b], ref[1][b], atol=TOL, rtol=0)


# The eagle drafter in the loop (``jax_loop.eagle_and_verify`` in the device-resident loop). References:
# the target's own greedy decoding, and the CPU path of the same call with ``adaptive=False`` and
# ``context_tokens=0`` (the CPU drafter adds committed ids to the tokens it scores as it goes, which the
# JAX path's fixed shape does not): the same keys meet the same distributions, so the same tokens.

MAX_NEW = 20
_SAMPLED = dict(temperature=1.0, top_k=20, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, on_jax(target), {"one": random_head(), "eagle3": random_head(2, (1,))}


@pytest.fixture(scope="module")
def prompts():
    """Three left-padded rows of 7, 1 and 4 tokens (a one-token row has no pair before its first step)."""
    return ragged_prompts()


@pytest.mark.parametrize("head, context, g", [("one", CONTEXT_TOKENS, 3), ("one", 0, 1), ("eagle3", 0, 3)])
def test_eagle_greedy_equals_the_targets_own_greedy_decoding(pair, prompts, head, context, g):
    target, target_j, heads = pair
    ids, mask = prompts
    want = target_greedy(target, ids, mask, MAX_NEW)
    out = speculative_generate(
        target_j, EagleDrafter(heads[head], context), ids, mask, max_new_tokens=MAX_NEW, num_draft_tokens=g,
        adaptive=False,  # every step drafts (the schedule's plain steps: below)
    )  # fmt: skip
    assert out.sequences[:, ids.shape[1] :].tolist() == want
    assert out.stats.adapter_copies == 0
    assert out.stats.draft_tokens_proposed > 0


def test_eagle_greedy_holds_with_the_tpus_bfloat16_caches(pair, prompts, monkeypatch):
    """With the target's and the head's caches in bfloat16 (a TPU's choice at its default precision,
    ``jax_model.cache_dtype``, forced here), greedy output is the target alone's with the same caches."""
    _, target_j, heads = pair
    ids, mask = prompts
    monkeypatch.setattr(jax_model, "cache_dtype", lambda *args: np.dtype(jnp.bfloat16))
    want = jax_loop.greedy_decode(target_j, ids, mask, MAX_NEW).tolist()
    out = speculative_generate(
        target_j, EagleDrafter(heads["eagle3"], 0), ids, mask, max_new_tokens=MAX_NEW, num_draft_tokens=3
    )
    assert out.sequences[:, ids.shape[1] :].tolist() == want
    assert out.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("ratio", [float("inf"), 1.6], ids=["plain", "mixed"])
def test_eagle_greedy_holds_whatever_the_schedule_chooses(pair, prompts, ratio):
    """Plain steps commit their pair to the head (the target's states at the row's last token): greedy output
    is the target's with plain steps alone (a drafted one after 15) and mixed with drafted ones."""
    target, target_j, heads = pair
    ids, mask = prompts
    with jax_loop.draft_cost_ratio(ratio):
        out = speculative_generate(
            target_j, EagleDrafter(heads["eagle3"], 0), ids, mask, max_new_tokens=40, num_draft_tokens=3
        )
    assert out.sequences[:, ids.shape[1] :].tolist() == target_greedy(target, ids, mask, 40)
    assert 0 < out.stats.draft_steps < out.stats.steps


@pytest.mark.parametrize(
    "head, sampling, eos_at",
    [("one", _SAMPLED, None), ("one", _SAMPLED, 4), ("one", {}, 3), ("eagle3", _SAMPLED, None)],
    ids=["sampled", "sampled-eos", "greedy-eos", "eagle3-sampled"],
)
def test_eagle_outputs_equal_the_cpu_paths_draw_for_draw(pair, prompts, head, sampling, eos_at):
    target, target_j, heads = pair
    ids, mask = prompts
    kw = dict(max_new_tokens=MAX_NEW, num_draft_tokens=3, pad_token_id=0, adaptive=False, **sampling)
    if eos_at is not None:  # an EOS id from row 0's own output (None: the model's own EOS, id 2)
        first = speculative_generate(target_j, EagleDrafter(heads[head], 0), ids, mask, **kw)
        kw["eos_token_id"] = int(first.sequences[0, ids.shape[1] + eos_at])
    want = speculative_generate(target, EagleDrafter(heads[head], 0), ids, mask, **kw)
    got = speculative_generate(target_j, EagleDrafter(heads[head], 0), ids, mask, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert got.num_new_tokens.tolist() == want.num_new_tokens.tolist()
    for name in ("steps", "draft_tokens_proposed", "draft_tokens_accepted", "tests_per_position"):
        assert getattr(got.stats, name) == getattr(want.stats, name), name
    assert got.stats.adapter_copies == 0
    if sampling:  # both outcomes of the test happen
        assert 0 < got.stats.draft_tokens_accepted < got.stats.draft_tokens_proposed
    if eos_at is not None:
        assert got.num_new_tokens[0] == eos_at + 1


def test_a_head_for_another_target_is_refused(pair, prompts):
    _, target_j, _ = pair
    ids, mask = prompts
    other = EagleHead(EagleConfig(64, 4, 2, 128, 300, 40))
    with pytest.raises(ValueError, match="draft: the eagle head was made for a vocabulary of 300"):
        speculative_generate(target_j, EagleDrafter(other), ids, mask, max_new_tokens=4)


@pytest.mark.parametrize(
    "context, contexts, tail",
    [
        (3, [[45, 2, 300], [41, 45]], [41, 45, 0]),  # new ids ascending (2 is the head's, 300 >= V), then padding
        (2, [[45, 2, 300], [41, 45]], [41, 45]),  # at most context_tokens of them
        (4, [[1, 2]], [0, 0, 0, 0]),  # none new: the first id repeated (scored twice, the same)
        (0, [[45]], []),
    ],
)
def test_the_scored_tokens_are_the_heads_then_the_prompts_in_one_shape(context, contexts, tail):
    """The head's N = 40 ids (0 .. 39), then the CPU drafter's rule for context ids, padded to
    N + context_tokens: the same shape for every call of a drafter."""
    got = scored_ids(EagleDrafter(random_head(), context), contexts, 256)
    assert got.dtype == np.int32
    assert got.tolist() == list(range(40)) + tail
