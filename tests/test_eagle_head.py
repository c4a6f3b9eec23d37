"""specjax.drafters.eagle_head: the cache gives what one pass over the whole sequence gives; files."""

from __future__ import annotations

import json

import pytest
import torch

from specjax.drafters.eagle_head import EagleConfig, EagleHead, FeatureCache, init_weights, load_head, save_head

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


def pairs(b, w, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, w, D, generator=g), torch.randn(b, w, D, generator=g)


def test_chunks_through_the_cache_equal_one_pass(head):
    f, e = pairs(2, 7)
    full = head(f, e, torch.ones(2, 7, dtype=torch.bool))
    cache = FeatureCache(2, head.config, "cpu", torch.float32)
    parts = [
        head(f[:, a:b], e[:, a:b], torch.ones(2, b - a, dtype=torch.bool), cache) for a, b in ((0, 3), (3, 4), (4, 7))
    ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 7 and cache.num_valid.tolist() == [7, 7]


def test_invalid_slots_are_skipped_without_a_gap(head):
    """Row 0 gets a padding slot in the middle; its outputs equal a pass over its real pairs alone."""
    f, e = pairs(1, 5, seed=1)
    alone = head(f, e, torch.ones(1, 5, dtype=torch.bool))
    cache = FeatureCache(1, head.config, "cpu", torch.float32)
    a = head(f[:, :2], e[:, :2], torch.ones(1, 2, dtype=torch.bool), cache)
    head(torch.zeros(1, 1, D), torch.zeros(1, 1, D), torch.zeros(1, 1, dtype=torch.bool), cache)
    b = head(f[:, 2:], e[:, 2:], torch.ones(1, 3, dtype=torch.bool), cache)
    torch.testing.assert_close(torch.cat([a, b], dim=1), alone, rtol=1e-5, atol=1e-5)


def test_truncate_forgets_the_drafted_pairs(head):
    f, e = pairs(1, 6, seed=2)
    direct = head(f, e, torch.ones(1, 6, dtype=torch.bool))
    cache = FeatureCache(1, head.config, "cpu", torch.float32)
    head(f[:, :4], e[:, :4], torch.ones(1, 4, dtype=torch.bool), cache)
    g, h = pairs(1, 2, seed=9)  # drafted pairs, then dropped
    head(g, h, torch.ones(1, 2, dtype=torch.bool), cache)
    cache.truncate(4)
    again = head(f[:, 4:], e[:, 4:], torch.ones(1, 2, dtype=torch.bool), cache)
    torch.testing.assert_close(again, direct[:, 4:], rtol=1e-5, atol=1e-5)
    # negative control: without the truncation the outputs differ
    cache2 = FeatureCache(1, head.config, "cpu", torch.float32)
    head(f[:, :4], e[:, :4], torch.ones(1, 4, dtype=torch.bool), cache2)
    head(g, h, torch.ones(1, 2, dtype=torch.bool), cache2)
    stale = head(f[:, 4:], e[:, 4:], torch.ones(1, 2, dtype=torch.bool), cache2)
    assert not torch.allclose(stale, direct[:, 4:], atol=1e-3)


def test_save_and_load_round_trip(head, tmp_path):
    head.token_ids.copy_(torch.arange(30, 50))
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert loaded.config == head.config and torch.equal(loaded.token_ids, head.token_ids)
    f, e = pairs(1, 3)
    ones = torch.ones(1, 3, dtype=torch.bool)
    torch.testing.assert_close(loaded(f, e, ones), head(f, e, ones), rtol=2e-2, atol=2e-2)  # float16 weights


FUSED = EagleConfig(D, 4, 2, 32, 50, 20, feature_layers=(1, 3))


def test_a_fused_head_starts_from_z_alone_and_round_trips(tmp_path):
    head = EagleHead(FUSED)
    init_weights(head, 0)
    assert head.target_hidden_layers == (1, 3, -1)
    hidden = torch.randn(2, 5, 3 * D, generator=torch.Generator().manual_seed(4)) * 7.0
    torch.testing.assert_close(head.fuse_features(hidden), hidden[..., -D:])  # [0, 0, I] at the start
    with torch.no_grad():
        head.fuse.weight.add_(0.3)
    fused = head.fuse_features(hidden)
    assert not torch.allclose(fused, hidden[..., -D:], atol=1e-2)  # the other layers count once trained
    # the low layers are RMS-normalised first: scaling them changes nothing, scaling z does
    scaled = hidden.clone()
    scaled[..., : 2 * D] *= 100.0
    torch.testing.assert_close(head.fuse_features(scaled), fused, rtol=1e-4, atol=1e-4)
    scaled[..., -D:] *= 2.0
    assert not torch.allclose(head.fuse_features(scaled), fused, atol=1e-2)
    save_head(head, tmp_path / "f")
    loaded = load_head(tmp_path / "f")
    assert loaded.config == FUSED
    assert json.loads((tmp_path / "f" / "config.json").read_text())["feature_layers"] == [1, 3]
    torch.testing.assert_close(loaded.fuse_features(hidden), fused, rtol=2e-2, atol=5e-2)  # float16 weights
    # a head without feature_layers reads z as it is
    plain = EagleHead(CFG)
    assert plain.fuse is None and plain.target_hidden_layers == (-1,) and plain.fuse_features(hidden) is hidden


def test_a_deeper_head_keeps_the_first_layers_names_and_uses_every_layer(tmp_path):
    """A two-layer head: the first layer's weights under a one-layer head's names, the second's under
    ``deeper.0``; the second layer changes the output (a head that skipped it would pass the cache tests)."""
    one, two = EagleHead(CFG), EagleHead(DEEP)
    extra = set(two.state_dict()) - set(one.state_dict())
    assert set(one.state_dict()) <= set(two.state_dict())
    assert extra and all(k.startswith("deeper.0.") for k in extra)
    init_weights(two, 0)
    with torch.no_grad():
        for p in two.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    f, e = pairs(1, 4, seed=3)
    ones = torch.ones(1, 4, dtype=torch.bool)
    out = two(f, e, ones)
    with torch.no_grad():
        two.deeper[0].down_proj.weight.mul_(3.0)
    assert not torch.allclose(two(f, e, ones), out, atol=1e-3)
    save_head(two, tmp_path / "d")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["num_layers"] == 2
    assert load_head(tmp_path / "d").config == DEEP


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_bad_num_layers_is_refused(value):
    with pytest.raises(ValueError, match="num_layers: expected a positive integer"):
        EagleConfig(D, 4, 2, 32, 50, 20, num_layers=value)


@pytest.mark.parametrize("layers", [(0,), (2, 2), (-1,), (1.5,), (True,)])
def test_bad_feature_layers_are_refused(layers):
    with pytest.raises(ValueError, match="feature_layers: expected distinct positive layer indices"):
        EagleConfig(D, 4, 2, 32, 50, 20, feature_layers=layers)


def _saved(tmp_path, head):
    path = tmp_path / "h"
    save_head(head, path)
    return path


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda p: (p / "config.json").unlink(), "config.json: missing"),
        (lambda p: (p / "config.json").write_text("{nope"), "not readable JSON"),
        (lambda p: (p / "config.json").write_text(json.dumps({"model_type": "llama"})), "expected model_type"),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "num_tokens": 0})
            ),
            "num_tokens: expected 1..target_vocab_size",
        ),
        (lambda p: (p / "model.safetensors").unlink(), "model.safetensors: missing"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00garbage"), "not a readable safetensors"),
        (
            lambda p: (p / "config.json").write_text(
                json.dumps({**json.loads((p / "config.json").read_text()), "intermediate_size": 48})
            ),
            "has shape",
        ),
    ],
)
def test_damaged_files_are_one_clear_error(head, tmp_path, damage, match):
    path = _saved(tmp_path, head)
    damage(path)
    with pytest.raises(ValueError, match=match):
        load_head(path)


def test_token_ids_outside_the_vocabulary_are_refused(head, tmp_path):
    head.token_ids.fill_(50)
    path = _saved(tmp_path, head)
    with pytest.raises(ValueError, match=r"token_ids outside \[0, 50\)"):
        load_head(path)


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        load_head(tmp_path / "nothing")
