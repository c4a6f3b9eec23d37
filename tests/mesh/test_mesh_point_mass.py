"""Point-mass drafts (``draft_probs=None`` / ``draft_logits=None``) on a 2x2 mesh equal one device.

Moved from tests/test_point_mass.py, where it ran as a subprocess with 4
simulated devices; here it uses 4 of the session's 8.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from specjax import rejection_sample, verify_from_logits
from specjax.boundary.api import rejection_sample_sharded, verify_from_logits_sharded


def test_point_masses_on_a_mesh_equal_one_device() -> None:
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("b", "v"))
    rng = np.random.default_rng(0)
    b, g, vocab = 6, 3, 1001
    t = (rng.normal(size=(b, g + 1, vocab)) * 3).astype(np.float32)
    am = np.argmax(t, axis=-1)
    x = np.where(rng.random((b, g)) < 0.6, am[:, :g], rng.integers(0, vocab, (b, g))).astype(np.int32)
    k = np.array([3, 2, 0, 1, 3, 3], np.int32)
    keys = jax.random.split(jax.random.key(4), b)
    kw = dict(
        key=keys,
        temperature=np.array([0.0, 0.7, 1.0, 0.7, 1.3, 0.0], np.float32),
        top_k=[0, 20, 0, 5, 0, 0],
        top_p=[1.0, 0.9, 1.0, 1.0, 0.8, 1.0],
        draft_lengths=k,
    )
    one = verify_from_logits(x, None, t, **kw)
    for axes in (("b", None), (None, "v"), ("b", "v")):
        many = verify_from_logits_sharded(x, None, t, mesh=mesh, batch_axis=axes[0], vocab_axis=axes[1], **kw)
        assert np.array_equal(np.asarray(one.tokens), np.asarray(many.tokens)), axes
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    u, s = rng.random((b, g)).astype(np.float32), rng.random(b).astype(np.float32)
    one = rejection_sample(x, None, p, u, s)
    for axes in (("b", None), (None, "v"), ("b", "v")):
        many = rejection_sample_sharded(x, None, p, u, s, mesh=mesh, batch_axis=axes[0], vocab_axis=axes[1])
        assert np.array_equal(np.asarray(one.tokens), np.asarray(many.tokens)), axes
