"""specjax.packed: the loop's forwards through prepacked linear layers give the dense layers' outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import specjax
from specjax.packed import ENV, PackedLinear, model_packed, packed_layers
from specjax.slots import SlotCache

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def model(tiny_lm):
    return tiny_lm("llama", vocab_size=300, layers=2, hidden=32, seed=4)


def _linears(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}


def test_packed_linear_is_the_dense_product():
    g = torch.Generator().manual_seed(0)
    for bias in (False, True):
        dense = torch.nn.Linear(24, 300, bias=bias)
        x = torch.randn(2, 5, 24, generator=g)
        torch.testing.assert_close(PackedLinear(dense)(x), dense(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["all", "head"])
def test_a_forward_runs_the_packed_layers_and_puts_the_models_back(model, monkeypatch, mode):
    monkeypatch.setenv(ENV, mode)
    before = _linears(model)
    head = model.get_output_embeddings()
    ran = []
    original = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: ran.append(self) or original(self, x))
    ids = torch.tensor([[5, 9, 2, 30, 7]])
    dense = model(ids).logits
    cache = SlotCache(model, 1, torch.device("cpu"))
    packed = cache.forward(ids, np.ones((1, 5), bool))
    torch.testing.assert_close(packed, dense, rtol=1e-5, atol=1e-5)
    assert _linears(model) == before  # the model's own layers back in place
    copies = {id(copy) for _, _, _, copy in packed_layers(model)[1]}
    assert len(copies) == (len(before) if mode == "all" else 1) and {id(r) for r in ran} == copies
    with pytest.raises(RuntimeError, match="inside"), model_packed(model) as applied:
        assert applied == mode and model.get_output_embeddings() is not head
        raise RuntimeError("inside")
    assert _linears(model) == before  # back after an error too


def test_the_copies_are_kept_and_made_afresh_when_a_weight_changes(model, monkeypatch):
    monkeypatch.setenv(ENV, "all")
    first = {id(d): c for _, _, d, c in packed_layers(model)[1]}
    assert {id(d): c for _, _, d, c in packed_layers(model)[1]} == first  # kept
    changed = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        changed.weight.mul_(2.0)  # in place: a new version
    second = {id(d): c for _, _, d, c in packed_layers(model)[1]}
    assert second[id(changed)] is not first[id(changed)]
    assert all(second[k] is first[k] for k in first if k != id(changed))
    x = torch.randn(3, changed.in_features)
    torch.testing.assert_close(second[id(changed)](x), changed(x), rtol=1e-5, atol=1e-5)


def test_a_layer_replaced_by_the_user_is_packed_and_kept(model, monkeypatch):
    """A module swapped in between forwards is the one packed, and stays in place after the forward."""
    monkeypatch.setenv(ENV, "all")
    packed_layers(model)
    mlp = model.model.layers[1].mlp
    new = nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=True)
    mlp.down_proj = new
    with model_packed(model):
        assert isinstance(mlp.down_proj, PackedLinear)
    assert mlp.down_proj is new
    cache = SlotCache(model, 1, torch.device("cpu"))
    ids = torch.tensor([[5, 9, 2]])
    torch.testing.assert_close(cache.forward(ids, np.ones((1, 3), bool)), model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["all", "head"])
def test_a_nested_forward_of_the_same_model_keeps_the_packing(model, monkeypatch, mode):
    """Packing planned afresh while a forward of the model runs (a weight changed) still finds every layer."""
    monkeypatch.setenv(ENV, mode)
    n = len(packed_layers(model)[1])
    with model_packed(model):
        with torch.no_grad():
            model.get_output_embeddings().dense().weight.mul_(2.0)
        with model_packed(model) as inner:
            assert inner == mode and len(packed_layers(model)[1]) == n
    assert len(packed_layers(model)[1]) == n and all(type(m) is not PackedLinear for m in model.modules())


def test_a_packed_model_is_freed_with_its_copies(tiny_lm, monkeypatch):
    """The caches hold the model weakly: dropping the last reference frees it and its copies."""
    import gc
    import weakref

    monkeypatch.setenv(ENV, "all")
    model = tiny_lm("llama", vocab_size=300, layers=2, hidden=32, seed=5)
    ids = torch.tensor([[5, 9, 2]])
    SlotCache(model, 1, torch.device("cpu")).forward(ids, np.ones((1, 3), bool))
    alive = weakref.ref(model)
    copy = weakref.ref(packed_layers(model)[1][0][3])
    del model
    gc.collect()
    assert alive() is None and copy() is None


def test_not_taken_where_it_does_not_apply(model, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert packed_layers(model) == ("0", [])
    monkeypatch.setenv(ENV, "all")
    assert packed_layers(model.to(torch.float64)) == ("0", [])  # float32 weights only


@pytest.mark.parametrize("value", ["yes", "1", ""])
def test_a_bad_setting_is_one_clear_error(model, monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}: expected one of all, head, 0"):
        packed_layers(model)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_generation_is_the_same_with_every_setting(model, monkeypatch, temperature):
    """Greedy: identical to ``generate``; sampled: the same tokens with every setting (same keys, a
    fixed draft length: the adaptive one follows measured times)."""
    ids = torch.tensor([[5, 9, 2, 30, 7], [1, 4, 4, 8, 3]])
    out = {}
    for value in ("0", "head", "all"):
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
    assert torch.equal(out["0"], out["head"]) and torch.equal(out["0"], out["all"])
    if temperature == 0.0:
        assert torch.equal(out["all"], model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0))


def test_generate_inside_the_context_is_the_dense_generate(model, monkeypatch):
    """The documented use on one's own calls: ``generate`` through the packed copies, the layers back after."""
    monkeypatch.setenv(ENV, "all")
    ids = torch.tensor([[5, 9, 2, 30, 7], [1, 4, 4, 8, 3]])
    dense = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
    before = _linears(model)
    ran = []
    original = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: ran.append(1) or original(self, x))
    with model_packed(model) as applied:
        packed = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert applied == "all" and ran and _linears(model) == before
    assert torch.equal(packed, dense)


def test_the_schedule_keeps_timings_apart_for_each_setting(model, monkeypatch):
    """Timings taken with packed layers must not price forwards with dense ones (and back)."""
    from specjax.generate.schedule import DraftSchedule

    def table(value):
        monkeypatch.setenv(ENV, value)
        return DraftSchedule(1, 4, adaptive=True, draft_cost_hint=0.0, model=model).times

    tables = {value: table(value) for value in ("all", "head", "0")}
    assert len({id(t) for t in tables.values()}) == 3
    assert all(table(value) is t for value, t in tables.items())  # each shared between calls
