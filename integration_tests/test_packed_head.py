"""specjax.packed_head: the loop's forwards through a prepacked LM head give the dense head's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import specjax
from specjax.packed_head import ENV, PackedLinear, lm_head_packed, packed_lm_head
from specjax.slots import SlotCache

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def model(tiny_lm):
    return tiny_lm("llama", vocab_size=300, layers=2, hidden=32, seed=4)


def test_packed_linear_is_the_dense_product():
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        dense = torch.nn.Linear(24, 300, bias=bias)
        x = torch.randn(2, 5, 24, generator=g)
        torch.testing.assert_close(PackedLinear(dense)(x), dense(x), rtol=1e-5, atol=1e-5)


def test_a_forward_uses_the_packed_head_and_puts_the_models_back(model, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    head = model.get_output_embeddings()
    seen = []
    original = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: seen.append(x.shape) or original(self, x))
    ids = torch.tensor([[5, 9, 2, 30, 7]])
    dense = model(ids).logits
    cache = SlotCache(model, 1, torch.device("cpu"))
    packed = cache.forward(ids, np.ones((1, 5), bool))
    assert seen and model.get_output_embeddings() is head  # taken, then put back
    torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="inside"), lm_head_packed(model):
        assert model.get_output_embeddings() is not head
        raise RuntimeError("inside")
    assert model.get_output_embeddings() is head  # back after an error too


def test_the_copy_is_kept_and_made_afresh_when_the_weight_changes(model, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    first = packed_lm_head(model)
    assert first is not None and packed_lm_head(model) is first
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(2.0)  # in place: a new version
    second = packed_lm_head(model)
    assert second is not first
    x = torch.randn(3, 32)
    torch.testing.assert_close(second(x), model.get_output_embeddings()(x), rtol=1e-5, atol=1e-5)


def test_not_taken_where_it_does_not_apply(model, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert packed_lm_head(model) is None
    monkeypatch.setenv(ENV, "1")
    assert packed_lm_head(model.to(torch.float64)) is None  # float32 weights only


@pytest.mark.parametrize("value", ["yes", "2", ""])
def test_a_bad_setting_is_one_clear_error(model, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}: expected 0 or 1"):
        packed_lm_head(model)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_is_the_same_with_either_head(model, monkeypatch, temperature):
    """Greedy: identical to ``generate``; sampled: the same tokens with either head (same keys, a fixed
    draft length: the adaptive one follows measured times)."""
    ids = torch.tensor([[5, 9, 2, 30, 7], [1, 4, 4, 8, 3]])
    out = {}
    for value in ("0", "1"):
        monkeypatch.setenv(ENV, value)
        out[value] = specjax.speculative_generate(
            model,
            model,
            ids,
            max_new_tokens=12,
            num_draft_tokens=3,
            temperature=temperature,
            seed=3,
            pad_token_id=0,
            adaptive=False,
        ).sequences
    assert torch.equal(out["0"], out["1"])
    if temperature == 0.0:
        assert torch.equal(out["1"], model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0))


def test_the_schedule_keeps_timings_apart_for_either_head(model, monkeypatch):
    """Timings taken with the packed head must not price forwards with the dense one (and back)."""
    from specjax.generate.schedule import DraftSchedule

    def table(value):
        monkeypatch.setenv(ENV, value)
        return DraftSchedule(1, 4, adaptive=True, draft_cost_hint=0.0, model=model).times

    packed, dense = table("1"), table("0")
    assert packed is not dense
    assert table("1") is packed and table("0") is dense  # each shared between calls
