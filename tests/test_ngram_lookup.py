"""The device-resident loop's n-gram lookup (:func:`specjax.drafters.ngram.jax_lookup`) against the host's
:meth:`NgramIndex.lookup`: the same proposal for every row.

The host index finds matches through hashes of n-grams: it agrees with the exact rule unless two n-grams'
hashes collide, which small-int tuples here do not. This test is what ties the two rules together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters.ngram import NgramIndex, jax_lookup

WIDTH = 48  # the buffer's width: contexts of up to WIDTH tokens, stale tokens past each row's length


@functools.cache
def _lookup(min_n: int, max_n: int, g: int):
    return jax.jit(functools.partial(jax_lookup, min_n=min_n, max_n=max_n, g=g))


def _check(contexts: list[list[int]], ks: list[int], min_n: int, max_n: int, g: int, rng) -> np.ndarray:
    """Every row's device proposal equals the host index's (k capped at G: the device returns G columns);
    returns the rows' proposal lengths."""
    ctx = rng.integers(0, 4, (len(contexts), WIDTH)).astype(np.int32)  # stale tokens past each length
    for b, c in enumerate(contexts):
        ctx[b, : len(c)] = c
    lengths = np.array([len(c) for c in contexts], np.int32)
    tokens, found = jax.device_get(
        _lookup(min_n, max_n, g)(jnp.asarray(ctx), jnp.asarray(lengths), jnp.asarray(np.array(ks, np.int32)))
    )
    for b, (c, k) in enumerate(zip(contexts, ks, strict=True)):
        want = NgramIndex(c, min_n, max_n).lookup(min(k, g))
        got = tokens[b, : found[b]].tolist()
        assert got == want, f"row {b}: context {c}, k {k}, n in [{min_n}, {max_n}]: got {got}, want {want}"
        assert (tokens[b, found[b] :] == 0).all()
    return found


ADVERSARIAL = [
    [],
    [5],
    [5, 5],
    [1, 2],
    [1, 2, 1, 2],  # a match with one token following
    [1, 2, 3, 1, 2],
    [7] * 20,  # a run: the latest earlier end is L - 2
    [1, 2, 3] * 7,  # periodic
    [1, 2, 3] * 7 + [9],  # the suffix never occurred
    [1, 2, 1, 2, 3, 1, 2],  # the longest match is not the latest short one
    [3, 1, 2, 9, 1, 2, 3, 1, 2],  # n = 3 matches at 2 (earlier) over n = 2's latest at 5
    [4, 4, 4, 1, 4, 4],
    [0, 0, 1, 0, 0, 1, 0, 0],
    list(range(10)) + list(range(8)),  # a long match far back
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7, 8],  # n up to 8
]


@pytest.mark.parametrize(
    "min_n, max_n, g",
    [(2, 5, 4), (1, 1, 3), (1, 8, 6), (3, 3, 2), (2, 8, 1), (4, 6, 5)],
)
def test_adversarial_contexts_propose_what_the_host_index_does(min_n, max_n, g):
    rng = np.random.default_rng(0)
    for k in (0, 1, 2, g, g + 3, -1):  # k = 0 (and below): nothing; k > what follows: what follows
        _check(ADVERSARIAL, [k] * len(ADVERSARIAL), min_n, max_n, g, rng)


@pytest.mark.parametrize("min_n, max_n, g", [(2, 5, 4), (1, 3, 7), (1, 8, 5), (5, 8, 3)])
@pytest.mark.parametrize("alphabet", [2, 3, 6])
def test_random_contexts_propose_what_the_host_index_does(min_n, max_n, g, alphabet):
    """Small alphabets and repeated chunks with a token changed here and there: many matches of every
    length, most rows with several candidates per n."""
    rng = np.random.default_rng(alphabet * 100 + min_n * 10 + max_n)
    found = []
    for _ in range(4):
        lengths = rng.integers(0, WIDTH + 1, 32)
        contexts = [rng.integers(0, alphabet, n).tolist() for n in lengths[:16]]
        for n in lengths[16:]:  # a chunk repeated, one token in five changed
            row = np.resize(rng.integers(0, alphabet, rng.integers(1, 9)), n)
            changed = rng.random(n) < 0.2
            contexts.append(np.where(changed, rng.integers(0, alphabet, n), row).tolist())
        ks = rng.integers(0, g + 2, 32).tolist()
        found.extend(_check(contexts, ks, min_n, max_n, g, rng).tolist())
    assert 0 in found and max(found) > 0  # not vacuous: rows with and without a proposal
