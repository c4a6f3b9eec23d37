"""specjax.packed: the loop's forwards through oneDNN's linear layers give the dense layers' outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import specjax
from specjax.packed import ENV, ROWS_BUCKETS, ROWS_EXACT, PackedLinear, model_packed, packed_layers, rows_bucket
from specjax.slots import SlotCache

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@pytest.fixture
def model(tiny_lm):
    return tiny_lm("llama", vocab_size=300, layers=2, hidden=32, seed=4)


def _linears(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, PackedLinear))}


# (leading shape, the rows oneDNN runs: None = torch's dense linear)
ROWS = [((1,), 1), ((2, 5), 10), ((1, 16), 16), ((17,), 24), ((3, 11), 48), ((4, 16), 64), ((5, 13), None)]


@pytest.mark.parametrize(("lead", "rows"), ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_the_dense_product(monkeypatch, lead, rows, bias):
    g = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(24, 300, bias=bias)
    x = torch.randn(*lead, 24, generator=g)
    ran = []
    onednn = torch._C._nn.mkldnn_linear
    monkeypatch.setattr(torch._C._nn, "mkldnn_linear", lambda x, *a: ran.append(x.shape[0]) or onednn(x, *a))
    with torch.no_grad():
        torch.testing.assert_close(PackedLinear(dense)(x), dense(x), rtol=1e-5, atol=1e-5)
    assert ran == ([] if rows is None else [rows])


def test_rows_given_to_onednn_are_a_bounded_set():
    """oneDNN keeps a primitive per shape for the process's life: the row counts it sees are bounded."""
    seen = {rows_bucket(n) for n in range(1, 20_000)}
    assert seen - {None} == set(range(1, ROWS_EXACT + 1)) | set(ROWS_BUCKETS)
    assert all(rows_bucket(n) is None or rows_bucket(n) >= n for n in range(1, 200))
    assert all(rows_bucket(n) == n for n in range(1, ROWS_EXACT + 1))  # a step's rows are not padded


def test_a_forward_over_any_prompt_length_gives_onednn_bucketed_rows(model, monkeypatch):
    monkeypatch.setenv(ENV, "all")
    ran = set()
    onednn = torch._C._nn.mkldnn_linear
    monkeypatch.setattr(torch._C._nn, "mkldnn_linear", lambda x, *a: ran.add(x.shape[0]) or onednn(x, *a))
    for length in range(1, 80, 3):
        ids = torch.arange(1, length + 1).remainder(290).unsqueeze(0) + 1
        with torch.no_grad(), model_packed(model):
            packed = model(ids).logits
        torch.testing.assert_close(packed, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert ran and ran <= set(range(1, ROWS_EXACT + 1)) | set(ROWS_BUCKETS)


def test_a_forward_that_records_gradients_gets_torchs_gradients(model, monkeypatch):
    monkeypatch.setenv(ENV, "all")
    ids = torch.tensor([[5, 9, 2, 30, 7]])
    head = model.get_output_embeddings()
    model(ids).logits.square().mean().backward()
    dense = head.weight.grad.clone()
    head.weight.grad = None
    with model_packed(model):
        model(ids).logits.square().mean().backward()
    torch.testing.assert_close(head.weight.grad, dense)
    model.zero_grad(set_to_none=True)


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


def test_the_stand_ins_are_kept_and_read_the_weights_as_they_are(model, monkeypatch):
    monkeypatch.setenv(ENV, "all")
    first = {id(d): s for _, _, d, s in packed_layers(model)[1]}
    changed = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        changed.weight.mul_(2.0)
    assert {id(d): s for _, _, d, s in packed_layers(model)[1]} == first  # kept: nothing to refresh
    x = torch.randn(3, changed.in_features)
    with torch.no_grad():
        torch.testing.assert_close(first[id(changed)](x), changed(x), rtol=1e-5, atol=1e-5)


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


def test_a_packed_model_is_freed_with_its_stand_ins(tiny_lm, monkeypatch):
    """The plans hold the model weakly: dropping the last reference frees it and its stand-ins."""
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
    with pytest.raises(ValueError, match=f"{ENV}: expected one of auto, all, head, 0"):
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


# A weight written through ``.data`` (PEFT's LoRA merge and unmerge write ``weight.data += delta``):
# neither the parameter's version nor its storage changes, and the next generation must see it.
WRITES = {
    "head copy_": ("head", lambda w, new: w.data.copy_(new)),
    "head +=": ("head", lambda w, new: w.data.__iadd__(new - w.data)),
    "body copy_": ("body", lambda w, new: w.data.copy_(new)),
    "body +=": ("body", lambda w, new: w.data.__iadd__(new - w.data)),
}


def _generate(model, ids, entry):
    if entry == "speculative_generate":
        return specjax.speculative_generate(
            model, model, ids, max_new_tokens=10, num_draft_tokens=3, pad_token_id=0
        ).sequences
    with model_packed(model) as applied:
        assert applied == "all"
        return model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)


@pytest.mark.parametrize("entry", ["speculative_generate", "model_packed"])
@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_weight_written_through_data_is_used_by_the_next_call(model, monkeypatch, entry, write):
    monkeypatch.setenv(ENV, "all")
    where, apply = WRITES[write]
    layer = model.get_output_embeddings() if where == "head" else model.model.layers[0].mlp.down_proj
    ids = torch.tensor([[5, 9, 2, 30, 7], [1, 4, 4, 8, 3]])
    before = _generate(model, ids, entry)  # the layers planned (and, before, their copies made)
    new = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(1)) * 3 * layer.weight.std()
    version, pointer = layer.weight._version, layer.weight.data_ptr()
    apply(layer.weight, new)
    assert (layer.weight._version, layer.weight.data_ptr()) == (version, pointer)  # invisible to both
    expected = model.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert not torch.equal(expected, before)  # the write changes the greedy output
    assert torch.equal(_generate(model, ids, entry), expected)


@pytest.mark.parametrize(("vendor", "mode"), [("AuthenticAMD", "all"), ("GenuineIntel", "0"), ("", "0")])
def test_auto_runs_onednn_on_amd_cpus_only(monkeypatch, vendor, mode):
    """The default, ``auto``: oneDNN where torch's dense small-row products were measured slow (AMD x86-64:
    0.63-0.87x the forward's time), torch's own product where oneDNN was slower (Intel: 1.21-1.83x) or
    nothing was measured (docs/benchmarks.md)."""
    from specjax import packed

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(packed, "cpu_vendor", lambda: vendor)
    assert packed.packed_mode() == mode
    monkeypatch.setenv(ENV, "all")  # an explicit setting wins
    assert packed.packed_mode() == "all"


def test_cpu_vendor_reads_this_machine():
    from specjax import packed

    vendor = packed.cpu_vendor()
    with open("/proc/cpuinfo", encoding="utf-8") as fh:
        assert f"vendor_id\t: {vendor}" in fh.read() or vendor == ""
