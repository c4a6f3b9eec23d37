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
from torchax_models import tiny_llama

from specjax.drafters.eagle_head import EagleConfig, EagleHead, FeatureCache, init_weights
from specjax.generate.jax_eagle import jax_head

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
