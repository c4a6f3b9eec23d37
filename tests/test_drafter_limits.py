"""Drafters' bounds and checks that need no target model (issue 58); each test failed before its fix.

* ``NgramDrafter(max_n)`` is capped (``(2, 10**7)`` allocated 10 million dictionaries), and
  its index keys n-grams by hash: the same proposals as a brute-force search, with the
  memory of one entry per token and ``n`` (``(2, 1000)`` held every n-gram's tuple);
* ``HybridDrafter`` with something that is not a drafter is a ``TypeError`` naming the argument;
* an EAGLE ``config.json`` whose ``rms_norm_eps`` / ``rope_theta`` is not a positive finite
  number is refused by name;
* ``save_head`` keeps a weight beyond float16's range (it became ``inf``), refuses NaN/inf
  weights, and ``load_head`` refuses a file holding ``inf``.
"""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specjax.drafters import HybridDrafter, NgramDrafter
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights, load_head, save_head
from specjax.drafters.ngram import MAX_NGRAM, NgramIndex

# --------------------------------------------------------------------------- n-gram bounds


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_n=10**7), r"max_n: expected an integer in \[1, 32\] .*got 10000000"),
        (dict(min_n=2, max_n=1000), r"max_n: expected an integer in \[1, 32\] .*got 1000"),
        (dict(min_n=33, max_n=40), r"min_n: expected an integer in \[1, 32\] .*got 33"),
        (dict(max_n=np.int64(33)), r"max_n: expected an integer in \[1, 32\]"),
    ],
)
def test_ngram_lengths_beyond_the_cap_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NgramDrafter(**kwargs)


def test_the_longest_allowed_ngram_is_accepted():
    assert NgramDrafter(2, MAX_NGRAM).max_n == MAX_NGRAM == 32


def _brute_force(ctx: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest suffix n-gram (n in [min_n, max_n])."""
    for n in range(min(max_n, len(ctx)), min_n - 1, -1):
        suffix = ctx[len(ctx) - n :]
        ends = [e for e in range(n - 1, len(ctx) - 1) if ctx[e - n + 1 : e + 1] == suffix]
        if ends:
            return ctx[ends[-1] + 1 : ends[-1] + 1 + k]
    return []


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 3), (2, 12), (4, 32)])
def test_hashed_index_matches_a_brute_force_search_while_it_grows(min_n, max_n):
    rng = np.random.default_rng(min_n * 100 + max_n)
    for _ in range(40):
        # few distinct tokens and repeated phrases: long matches occur
        phrase = rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist()
        ctx = (phrase * 4 + rng.integers(0, 3, size=8).tolist())[: int(rng.integers(1, 60))]
        idx = NgramIndex(ctx[:1], min_n, max_n)
        for t in range(1, len(ctx)):
            idx.extend([ctx[t]])
            k = int(rng.integers(1, 6))
            assert idx.lookup(k) == _brute_force(ctx[: t + 1], k, min_n, max_n), (ctx[: t + 1], k)


def test_a_hash_collision_costs_a_proposal_not_a_wrong_one():
    idx = NgramIndex([1, 2, 9, 3, 4, 7, 1, 2], min_n=2, max_n=2)
    # make the n-gram (3, 4) claim the hash of (1, 2): the lookup of suffix (1, 2) finds it and
    # must see that the n-grams differ
    table = idx.tables[0]
    table[hash((1, 2))] = table[hash((3, 4))]
    assert idx.lookup(3) == []


def test_index_memory_grows_with_the_number_of_lengths_not_their_square():
    tokens = np.random.default_rng(0).integers(0, 50, 1000).tolist()

    def peak(max_n: int) -> int:
        tracemalloc.start()
        try:
            NgramIndex(tokens, 2, max_n)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # 31 lengths against 4: about 31/4 times the memory; n-gram tuples as keys made it about 25 times
    assert peak(32) / peak(5) < 12


# --------------------------------------------------------------------------- hybrid arguments


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (
            (NgramDrafter(), None),
            r"fallback: HybridDrafter expects a drafter \(with start, propose, commit, "
            r"select_rows\), got NoneType",
        ),
        ((None, NgramDrafter()), r"ngram: HybridDrafter expects a drafter .*got NoneType"),
        ((NgramDrafter(), torch.nn.Linear(2, 2)), r"fallback: .*got Linear \(wrap a draft model as ModelDrafter"),
        ((NgramDrafter(), "model"), r"fallback: .*got str"),
    ],
)
def test_hybrid_parts_that_are_not_drafters_are_type_errors(args, match):
    with pytest.raises(TypeError, match=match):
        HybridDrafter(*args)


# --------------------------------------------------------------------------- EAGLE config and files

D = 16
CFG = EagleConfig(D, 4, 2, 32, 50, 20)


def _head() -> EagleHead:
    head = EagleHead(CFG)
    init_weights(head, 0)
    return head.eval()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("rms_norm_eps", "x", r"rms_norm_eps: expected a finite number > 0, got 'x'"),
        ("rms_norm_eps", 0, r"rms_norm_eps: expected a finite number > 0, got 0"),
        ("rms_norm_eps", None, r"rms_norm_eps: expected a finite number > 0, got None"),
        ("rope_theta", -1, r"rope_theta: expected a finite number > 0, got -1"),
        ("rope_theta", True, r"rope_theta: expected a finite number > 0, got True"),
        ("rope_theta", float("inf"), r"rope_theta: expected a finite number > 0, got inf"),
        ("target_vocab_size", "50", r"target_vocab_size: expected a positive integer, got '50'"),
        ("num_tokens", 2.5, r"num_tokens: expected 1..target_vocab_size=50, got 2.5"),
    ],
)
def test_bad_config_numbers_are_refused_by_name(tmp_path, field, value, match):
    path = tmp_path / "h"
    save_head(_head(), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"eagle head: .*config.json: {match}"):
        load_head(path)


def test_integer_rope_theta_and_eps_load_as_floats(tmp_path):
    path = tmp_path / "h"
    save_head(_head(), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rope_theta": 500000, "rms_norm_eps": 1}))
    loaded = load_head(path).config
    assert (loaded.rope_theta, loaded.rms_norm_eps) == (500000.0, 1.0)
    assert isinstance(loaded.rope_theta, float)


def test_a_weight_beyond_float16_range_is_saved_exactly(tmp_path):
    head = _head()
    with torch.no_grad():
        head.fc.weight[0, 0] = 1e5  # float16's largest finite value is 65504
        head.fc.weight[0, 1] = -3e5
    path = tmp_path / "h"
    save_head(head, path)
    stored = load_file(str(path / "model.safetensors"))
    assert stored["fc.weight"].dtype == torch.float32  # that tensor stays float32
    assert stored["q_proj.weight"].dtype == torch.float16  # the others are still halved
    loaded = load_head(path)
    assert loaded.fc.weight[0, 0].item() == 1e5 and loaded.fc.weight[0, 1].item() == -3e5
    assert all(bool(torch.isfinite(p).all()) for p in loaded.parameters())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_not_saved(tmp_path, bad):
    head = _head()
    with torch.no_grad():
        head.q_proj.weight[1, 2] = bad
    with pytest.raises(ValueError, match=r"eagle head: weight q_proj.weight holds NaN or inf"):
        save_head(head, tmp_path / "h")
    assert not (tmp_path / "h").exists()  # nothing written


def test_a_file_holding_inf_is_refused_on_load(tmp_path):
    path = tmp_path / "h"
    save_head(_head(), path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["fc.weight"][0, 0] = float("inf")  # what a float16 save of 1e5 held
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor fc.weight holds NaN or inf"):
        load_head(path)
