"""The EAGLE recipe in JAX, end to end on one accelerator (the shipped head's: a TPU v5e).

The target (SmolLM2, a Llama) is re-written here in JAX: a forward that gives
its hidden states (:func:`features`) and a KV-cache generation loop
(:func:`generate`); so are the head (:func:`head_forward`) and its loss
(:func:`head_loss`, :func:`recipes.eagle.torch_backend.head_loss`'s). Each is
held against the original in ``recipes/tests/test_jax_backend.py``.

Steps of ``train``, all timed:

1. the target's weights from the parts of its GGUF file
   (:mod:`recipes.gguf_parts`: a remote device may take about 30 MB per upload)
   and the tokenized prompts (``prepare``, run where transformers is); the
   chip's target is checked against the CPU's (:func:`check_target`) before
   any data is made;
2. self-generated prompts (the "Magpie" trick, Xu et al. 2024, arXiv
   2406.08464): the target, given its chat template up to the start of a user
   turn, samples the user's message itself, beside the draft recipe's
   template x topic prompts (:func:`recipes.draft.build_prompts`);
3. greedy, then sampled (``--temperature``) continuations of every prompt,
   within ``--gen-minutes`` or ``--max-positions``;
4. the target's states at every position (one teacher-forced forward): z and,
   for a fused variant, the states after ``FEATURE_LAYERS``, kept on the host
   (z in bfloat16, the others in int8: :func:`quantise`) and fed to the chip
   batch by batch (:class:`Batches`);
5. for each ``--variant`` (:data:`recipes.eagle.core.VARIANTS`), a head scoring
   the ``--num-tokens`` most frequent tokens of the data, trained by AdamW with
   a cosine schedule for its share of ``--train-minutes``;
6. its teacher-forced agreement with the target's greedy token on the held-out
   prompts' greedy answers and on the CPU's reference features, and its
   weights (float16, torch's names) in ``OUT/<variant>.npz``
   (:func:`recipes.eagle.core.save_head_npz`).

``python -m recipes.eagle import`` turns such a file into a head directory and
``python -m recipes.eagle evaluate`` measures it on the CPU (recipes/README.md).
A call on a lent device may be limited in time: ``--save-data D
--train-minutes 0`` in one call and ``--load-data D`` in the next give the data
and the training a call each; ``--init-from OUT/<variant>.npz`` trains a saved
head on (a fresh optimiser and schedule). ``train`` needs only numpy and JAX.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from recipes.eagle.core import (
    EOS_ID,
    FEATURE_LAYERS,
    LAYER_KEYS,
    VARIANTS,
    LossWeights,
    cosine_lr,
    frequent_tokens,
    head_config,
    log,
    resumed_head,
    save_head_npz,
)

# ----------------------------------------------------------------------------- prepare (local, transformers)


def prepare(args: argparse.Namespace) -> int:
    """Tokenize the template prompts and the self-prompting template into ``--out`` (npz)."""
    from transformers import AutoTokenizer

    from recipes import draft, gguf_parts

    gguf = args.gguf or Path(gguf_parts.default_gguf())
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    train, held = draft.build_prompts(100_000, 40, 0)
    marker = draft.chat_ids(tok, "Hello")
    # the template around the user's message: everything before it, everything after
    user = tok.encode("Hello", add_special_tokens=False)
    cut = next(i for i in range(len(marker)) if marker[i : i + len(user)] == user)
    prefix, suffix = marker[:cut], marker[cut + len(user) :]

    def pack(prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = [draft.chat_ids(tok, p) for p in prompts]
        return np.concatenate([np.asarray(i, np.int32) for i in ids]), np.cumsum([0] + [len(i) for i in ids])

    tr_ids, tr_off = pack(train)
    ho_ids, ho_off = pack(held)
    ref_ids, ref_valid, ref_feats = reference(gguf, [draft.chat_ids(tok, p) for p in held[:REF_ROWS]])
    np.savez(
        args.out,
        train_ids=tr_ids,
        train_offsets=tr_off,
        held_ids=ho_ids,
        held_offsets=ho_off,
        prefix=np.asarray(prefix, np.int32),
        suffix=np.asarray(suffix, np.int32),
        ref_ids=ref_ids,
        ref_valid=ref_valid,
        ref_feats=ref_feats,
    )
    print(f"{len(train)} training and {len(held)} held-out prompts; template {prefix} ... {suffix} -> {args.out}")
    return 0


REF_ROWS, REF_NEW = 4, 48


def reference(gguf: Path, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The CPU target's own greedy continuations (``REF_NEW`` tokens) of ``prompts`` and its float32 features
    over prompt + continuation: (ids i32[R, W] right-padded, valid bool[R, W], feats f32[R, W, (k+1)d], as
    :func:`features` gives them), for :func:`check_target` to hold the chip's numbers against."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.eagle.torch_backend import target_features

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    seqs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=REF_NEW, do_sample=False, pad_token_id=EOS_ID)
            seqs.append(out[0].tolist())
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), EOS_ID, np.int32)
        valid = np.zeros((len(seqs), width), bool)
        for j, s in enumerate(seqs):
            ids[j, : len(s)], valid[j, : len(s)] = s, True
    mask = torch.from_numpy(valid).long()
    feats = target_features(model, torch.from_numpy(ids).long(), mask, (*FEATURE_LAYERS, -1))
    return ids, valid, feats.numpy().astype(np.float32)


def checked_features(params: Any, cfg: dict[str, Any], pr: Any, args: argparse.Namespace) -> Any:
    """(feature function, generation function, check figures) whose numbers match the CPU's
    (:func:`check_target`): at each matrix-product precision that ``--precision`` allows (``auto``: the
    chip's default, then ``highest``), the direct path, else through a KV cache; SystemExit if none does.
    The precision found stays set for the rest of the run."""
    import jax

    errors = []
    for precision in ("default", "highest") if args.precision == "auto" else (args.precision,):
        jax.config.update("jax_default_matmul_precision", None if precision == "default" else precision)
        gen_fn = jax.jit(lambda p, i, v, k, t: generate(p, cfg, i, v, k, t, args.max_new_tokens))
        for via_cache in (False, True):
            fn = jax.jit(lambda p, i, v, c=via_cache: features(p, cfg, i, v, c))
            try:
                res = check_target(params, pr, fn, gen_fn, args)
            except SystemExit as err:
                errors.append(f"{precision}, via cache {via_cache}: {err}")
                continue
            return fn, gen_fn, {**res, "features_via_cache": via_cache, "precision": precision}
    raise SystemExit("; ".join(errors))


def check_target(params: Any, pr: Any, feat_fn: Any, gen_fn: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Hold the chip's target against the CPU's (``prepare``'s reference): features and greedy tokens.

    Raises SystemExit when the features differ by more than 2 % (relative RMS) or
    fewer than half the greedy tokens agree before each row's first difference: a head trained on such features
    would learn another model (it happened once: 0.86 agreement on the chip,
    0.27 on the CPU).
    """
    import jax

    ids, valid, want = pr["ref_ids"], pr["ref_valid"], pr["ref_feats"]
    lens = valid.sum(1).astype(int)
    ch = channel_scale(want, valid, params["embed"].shape[1])
    # the very path the training data takes, stored as it is (z in bfloat16, the other states in int8), at
    # every width the data may have (the reference rows padded to each bucket: a chip may compute a long row
    # otherwise than a short one)
    errs = {}
    for w in [s for s in args.seq_buckets if s >= lens.max()]:
        store = Store((w,))
        store.add([ids[j, : lens[j]].tolist() for j in range(len(lens))], [[] for _ in lens])
        got = np.asarray(hidden_of(store.build(feat_fn, params, args.feature_rows, ch)[w]))
        sq = sum(float(np.sum((got[j, : lens[j]] - want[j, : lens[j]]) ** 2)) for j in range(len(lens)))
        total = sum(float(np.sum(want[j, : lens[j]] ** 2)) for j in range(len(lens)))
        errs[w] = math.sqrt(sq / total)
    err = max(errs.values())
    # greedy tokens through the generation's own batching, at every prompt width: a full batch of the
    # reference prompts, then the prompts alone among filler rows (on the TPU the held-out answers once
    # came back as <|endoftext|> from the first token on, among filler rows, while a full batch passed)
    prompts = [ids[j, : lens[j] - REF_NEW].tolist() for j in range(len(lens))]
    same = mism = 0
    by_width = {}
    for pw in args.prompt_buckets:
        for batch in ([prompts[i % len(prompts)] for i in range(args.gen_batch)], prompts):
            s0, m0 = same, mism
            for i, out in enumerate(run_generation(gen_fn, params, batch, 0.0, 0, args, width=pw)):
                j = i % len(prompts)
                k = min(REF_NEW, len(out))
                first = next((t for t in range(k) if out[t] != ids[j, len(prompts[j]) + t]), k)
                same += first
                mism += k - first
            by_width[f"{pw}x{len(batch)}"] = (same - s0) / max(same - s0 + mism - m0, 1)
    res = {
        "feature_rms_error": err,
        "feature_rms_error_by_width": errs,
        "greedy_tokens_agreeing_before_first_difference": same / max(same + mism, 1),
        "greedy_agreement_by_prompt_width_x_rows": by_width,
    }
    log(f"the chip's target against the CPU's: {res}")
    # (bfloat16 rounding may flip a near-tie and end a greedy run early: half is the bar there)
    if err > 0.02 or min(by_width.values()) < 0.5:
        raise SystemExit(f"the target on {jax.devices()[0].device_kind} does not match the CPU's: {res}")
    return res


# ----------------------------------------------------------------------------- the target in JAX


def target_params(parts: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params with layers stacked, float32 numpy, matrices as [in, out]; config) from the GGUF parts."""
    from recipes import gguf_parts

    paths = sorted(parts.glob("part*.npz"))
    return params_from_state_dict(gguf_parts.load_state_dict(paths), gguf_parts.load_config(paths))


def params_from_state_dict(sd: dict[str, Any], hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, config) for :func:`features` and :func:`generate` from a Llama state dict (transformers'
    names, float32 numpy) and its config's fields (``num_hidden_layers``, ``hidden_size``, ...)."""
    cfg = {
        "n_layers": hf["num_hidden_layers"],
        "hidden": hf["hidden_size"],
        "heads": hf["num_attention_heads"],
        "kv_heads": hf["num_key_value_heads"],
        "intermediate": hf["intermediate_size"],
        "vocab": hf["vocab_size"],
        "rope_theta": hf["rope_theta"],
        "rms_eps": hf["rms_norm_eps"],
    }
    n = cfg["n_layers"]

    def stack(name: str, transpose: bool = True) -> np.ndarray:
        ws = [sd[f"model.layers.{i}.{name}.weight"] for i in range(n)]
        return np.stack([w.T if transpose else w for w in ws])

    params = {
        "embed": sd["model.embed_tokens.weight"],
        "norm": sd["model.norm.weight"],
        "layers": {
            "ln1": stack("input_layernorm", False),
            "ln2": stack("post_attention_layernorm", False),
            "wq": stack("self_attn.q_proj"),
            "wk": stack("self_attn.k_proj"),
            "wv": stack("self_attn.v_proj"),
            "wo": stack("self_attn.o_proj"),
            "wg": stack("mlp.gate_proj"),
            "wu": stack("mlp.up_proj"),
            "wd": stack("mlp.down_proj"),
        },
    }
    return params, cfg


def rms_norm(x: Any, w: Any, eps: float) -> Any:
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 / jnp.sqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype) * w


def rope(x: Any, pos: Any, theta: float) -> Any:
    """Llama's half-split rotary embedding of x: f[B, W, H, hd] at i32[B, W] positions."""
    import jax.numpy as jnp

    hd = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = pos[:, :, None, None].astype(jnp.float32) * inv
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def attend(q: Any, k: Any, v: Any, mask: Any) -> Any:
    """q f[B, W, H, hd], k/v f[B, S, Hkv, hd], mask bool[B, W, S] -> f[B, W, H*hd] (grouped-query)."""
    import jax
    import jax.numpy as jnp

    b, w, h, hd = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, w, hkv, h // hkv, hd)
    s = jnp.einsum("bwgrd,bsgd->bgrws", q, k).astype(jnp.float32) / math.sqrt(hd)
    s = jnp.where(mask[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, -1).astype(v.dtype)
    # values no query may read are zeroed: a non-finite one would otherwise reach every query as 0 * inf
    v = jnp.where(mask.any(1)[:, :, None, None], v, 0)
    return jnp.einsum("bgrws,bsgd->bwgrd", p, v).reshape(b, w, h * hd)


def _layers(
    params: dict[str, Any],
    cfg: dict[str, Any],
    x: Any,
    pos: Any,
    mask: Any,
    caches: Any,
    slot: Any,
    taps: tuple[int, ...] = (),
) -> Any:
    """Run every layer over the W new tokens x f32[B, W, d]; with ``caches`` (k, v: bf16[L, B, S, Hkv, hd]),
    their keys and values are written at ``slot`` and the attention reads the whole cache under ``mask``
    (bool[B, W, S]); without, it attends over the W tokens under ``mask`` (bool[B, W, W]).

    Returns (z f32[B, W, d] after the final norm, (k, v) caches); with ``taps``, also the hidden states
    after those layers (transformers' ``output_hidden_states[i]``), f32[len(taps), B, W, d]."""
    import jax
    import jax.numpy as jnp

    nh, nkv, eps, theta = cfg["heads"], cfg["kv_heads"], cfg["rms_eps"], cfg["rope_theta"]
    b, w, d = x.shape
    hd = d // nh

    def body(i: Any, carry: Any) -> Any:
        x, ck, cv, tapped = carry
        lp = jax.tree.map(lambda a: a[i], params["layers"])
        h = rms_norm(x, lp["ln1"], eps)
        q = rope((h @ lp["wq"]).reshape(b, w, nh, hd), pos, theta)
        k = rope((h @ lp["wk"]).reshape(b, w, nkv, hd), pos, theta)
        v = (h @ lp["wv"]).reshape(b, w, nkv, hd)
        if ck is not None:
            ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], (i, 0, slot, 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], (i, 0, slot, 0, 0))
            k, v = ck[i].astype(x.dtype), cv[i].astype(x.dtype)
        x = x + attend(q, k, v, mask) @ lp["wo"]
        h = rms_norm(x, lp["ln2"], eps)
        x = x + (jax.nn.silu(h @ lp["wg"]) * (h @ lp["wu"])) @ lp["wd"]
        for j, layer in enumerate(taps):  # the state after layer i is output_hidden_states[i + 1]
            tapped = tapped.at[j].set(jnp.where(i + 1 == layer, x, tapped[j]))
        return x, ck, cv, tapped

    ck, cv = caches if caches is not None else (None, None)
    tapped = jnp.zeros((len(taps), *x.shape), x.dtype) if taps else None
    x, ck, cv, tapped = jax.lax.fori_loop(0, params["layers"]["wq"].shape[0], body, (x, ck, cv, tapped))
    z = rms_norm(x, params["norm"], eps)
    return (z, (ck, cv), tapped) if taps else (z, (ck, cv))


def features(
    params: dict[str, Any],
    cfg: dict[str, Any],
    ids: Any,
    valid: Any,
    via_cache: bool = False,
    taps: tuple[int, ...] = FEATURE_LAYERS,
) -> Any:
    """f32[B, W, (k+1)d]: the target's hidden states after the layers ``taps`` (k of them) and its final
    normed state z (last) at every position of right-padded ``ids``, as the head's ``target_hidden_layers``.

    ``via_cache``: through a KV cache as the generation's prefill does (the same
    numbers on a CPU; a second path to fall back on where a chip disagrees)."""
    import jax.numpy as jnp

    b, w = ids.shape
    pos = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), ids.shape)
    mask = jnp.tril(jnp.ones((w, w), bool))[None] & valid[:, None, :]
    caches = None
    if via_cache:
        shape = (params["layers"]["wq"].shape[0], b, w, cfg["kv_heads"], cfg["hidden"] // cfg["heads"])
        caches = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
    z, _, tapped = _layers(params, cfg, params["embed"][ids], pos, mask, caches, 0, taps)
    return jnp.concatenate([*tapped, z], -1)


def generate(
    params: dict[str, Any], cfg: dict[str, Any], ids: Any, valid: Any, key: Any, temperature: Any, new: int
) -> Any:
    """i32[B, new]: continuations of left-padded prompts ``ids`` i32[B, P] (``valid`` marks real tokens),
    greedy where ``temperature`` is 0, else sampled at it (no top-k/top-p); EOS_ID after a row's end."""
    import jax
    import jax.numpy as jnp

    b, p = ids.shape
    s = p + new
    nkv, hd, n = cfg["kv_heads"], cfg["hidden"] // cfg["heads"], params["layers"]["wq"].shape[0]
    ck = jnp.zeros((n, b, s, nkv, hd), jnp.bfloat16)
    cv = jnp.zeros_like(ck)
    key_valid = jnp.concatenate([valid, jnp.ones((b, new), bool)], 1)
    lens = valid.sum(1).astype(jnp.int32)
    pos = jnp.maximum(jnp.cumsum(valid, 1) - 1, 0).astype(jnp.int32)
    mask = (jnp.arange(s)[None, :] <= jnp.arange(p)[:, None])[None] & key_valid[:, None, :]
    z, (ck, cv) = _layers(params, cfg, params["embed"][ids], pos, mask, (ck, cv), 0)

    def pick(z: Any, k: Any) -> Any:
        logits = (z @ params["embed"].T).astype(jnp.float32)
        drawn = jax.random.categorical(k, logits / jnp.maximum(temperature, 1e-6))
        return jnp.where(temperature > 0, drawn, jnp.argmax(logits, -1)).astype(jnp.int32)

    key, k0 = jax.random.split(key)
    tok = pick(z[:, -1], k0)
    out = jnp.full((b, new), EOS_ID, jnp.int32).at[:, 0].set(tok)
    done = tok == EOS_ID

    def cond(c: Any) -> Any:
        t, _, _, _, _, done, _ = c
        return (t < new) & ~jnp.all(done)

    def step(c: Any) -> Any:
        t, tok, ck, cv, out, done, key = c
        key, kt = jax.random.split(key)
        m = (jnp.arange(s)[None, None, :] <= p + t - 1) & key_valid[:, None, :]
        z, (ck, cv) = _layers(
            params, cfg, params["embed"][tok][:, None], (lens + t - 1)[:, None], m, (ck, cv), p + t - 1
        )
        nxt = jnp.where(done, EOS_ID, pick(z[:, 0], kt))
        return t + 1, nxt, ck, cv, out.at[:, t].set(nxt), done | (nxt == EOS_ID), key

    c = jax.lax.while_loop(cond, step, (jnp.int32(1), tok, ck, cv, out, done, key))
    return c[4]


# ----------------------------------------------------------------------------- the head in JAX


def init_head(hc: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Weights in torch's layout ([out, in]) and names, as ``eagle_head.init_weights`` sets them up."""
    rng = np.random.default_rng(seed)
    d, i = hc["hidden_size"], hc["intermediate_size"]
    hd = d // hc["num_attention_heads"]
    kv = hc["num_key_value_heads"] * hd

    def rnd(o: int, n: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((o, n)) / math.sqrt(n) * 0.5 * scale).astype(np.float32)

    fc = np.zeros((d, 2 * d), np.float32)
    fc[:, :d] = np.eye(d)
    fuse = {}
    if hc["feature_layers"]:  # [0, ..., 0, I]: z alone at the start
        fuse["fuse.weight"] = np.zeros((d, (len(hc["feature_layers"]) + 1) * d), np.float32)
        fuse["fuse.weight"][:, -d:] = np.eye(d)

    def layer(prefix: str) -> dict[str, np.ndarray]:
        return {
            f"{prefix}input_norm.weight": np.ones(d, np.float32),
            f"{prefix}q_proj.weight": rnd(d, d),
            f"{prefix}k_proj.weight": rnd(kv, d),
            f"{prefix}v_proj.weight": rnd(kv, d),
            f"{prefix}o_proj.weight": rnd(d, d, 0.1),
            f"{prefix}post_norm.weight": np.ones(d, np.float32),
            f"{prefix}gate_proj.weight": rnd(i, d),
            f"{prefix}up_proj.weight": rnd(i, d),
            f"{prefix}down_proj.weight": rnd(d, i, 0.1),
        }

    deeper = [layer(f"deeper.{j}.") for j in range(hc.get("num_layers", 1) - 1)]
    return {
        **fuse,
        "fc.weight": fc,
        "fc.bias": np.zeros(d, np.float32),
        **layer(""),
        **{k: v for p in deeper for k, v in p.items()},
        "out_norm.weight": np.ones(d, np.float32),
    }


def fuse_features(hp: dict[str, Any], hc: dict[str, Any], hidden: Any) -> Any:
    """:meth:`specjax.drafters.eagle_head.EagleHead.fuse_features`: f32[..., d] from the data's
    f32[..., (k+1)d] (z alone, the last d columns, for a head that fuses nothing)."""
    import jax
    import jax.numpy as jnp

    d = hc["hidden_size"]
    if not hc["feature_layers"]:
        return hidden[..., -d:]
    parts = hidden.reshape(*hidden.shape[:-1], -1, d)
    low = parts[..., :-1, :]
    low = low * jax.lax.rsqrt(jnp.mean(low * low, -1, keepdims=True) + hc["rms_norm_eps"])
    return jnp.concatenate([low.reshape(*hidden.shape[:-1], -1), parts[..., -1, :]], -1) @ hp["fuse.weight"].T


def head_forward(hp: dict[str, Any], hc: dict[str, Any], feats: Any, emb: Any, valid: Any) -> Any:
    """:class:`specjax.drafters.eagle_head.EagleHead`'s forward without a cache: f32[B, W, d] predictions."""
    import jax
    import jax.numpy as jnp

    b, w, d = feats.shape
    nh, nkv, eps = hc["num_attention_heads"], hc["num_key_value_heads"], hc["rms_norm_eps"]
    hd = d // nh
    vl = valid.astype(jnp.int32)
    pos = jnp.cumsum(vl, 1) - vl
    x = jnp.concatenate([feats, emb], -1) @ hp["fc.weight"].T + hp["fc.bias"]
    mask = (jnp.tril(jnp.ones((w, w), bool))[None] & valid[:, None, :]) | jnp.eye(w, dtype=bool)[None]
    for prefix in ["", *(f"deeper.{i}." for i in range(hc.get("num_layers", 1) - 1))]:
        lp = {k: hp[prefix + k] for k in LAYER_KEYS}
        h = rms_norm(x, lp["input_norm.weight"], eps)
        q = rope((h @ lp["q_proj.weight"].T).reshape(b, w, nh, hd), pos, hc["rope_theta"])
        k = rope((h @ lp["k_proj.weight"].T).reshape(b, w, nkv, hd), pos, hc["rope_theta"])
        v = (h @ lp["v_proj.weight"].T).reshape(b, w, nkv, hd)
        x = x + attend(q, k, v, mask) @ lp["o_proj.weight"].T
        h = rms_norm(x, lp["post_norm.weight"], eps)
        x = x + (jax.nn.silu(h @ lp["gate_proj.weight"].T) * (h @ lp["up_proj.weight"].T)) @ lp["down_proj.weight"].T
    return rms_norm(x, hp["out_norm.weight"], eps)


def head_loss(
    hp: dict[str, Any],
    hc: dict[str, Any],
    embed: Any,
    w_sub: Any,
    z: Any,
    tokens: Any,
    valid: Any,
    weights: LossWeights,
    key: Any,
) -> tuple[Any, Any]:
    """:func:`recipes.eagle.torch_backend.head_loss` in JAX: (loss, (regression, distill))."""
    import jax
    import jax.numpy as jnp

    reg_w, distill_w, unroll_w, noise = weights.regression, weights.distill, weights.unroll, weights.noise
    feats_in, target_out = fuse_features(hp, hc, z[:, :-1]), z[:, 1:, -hc["hidden_size"] :]
    pair_valid = valid[:, :-1] & valid[:, 1:]
    emb = embed[tokens[:, 1:]]
    if noise > 0:
        rms = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(feats_in * feats_in, -1, keepdims=True)))
        feats_in = feats_in + jax.random.normal(key, feats_in.shape) * noise * rms
    teacher = jax.lax.stop_gradient(jax.nn.softmax(target_out @ w_sub.T, -1))
    m = pair_valid.astype(jnp.float32)
    count = jnp.maximum(m.sum(), 1.0)

    def terms(pred: Any) -> tuple[Any, Any]:
        diff = jnp.abs(pred - target_out)
        reg = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
        ce = -(teacher * jax.nn.log_softmax(pred @ w_sub.T, -1)).sum(-1)
        return (reg * m).sum() / count, (ce * m).sum() / count

    pred = head_forward(hp, hc, feats_in, emb, pair_valid)
    reg, ce = terms(pred)
    loss = reg_w * reg + distill_w * ce
    if unroll_w > 0:
        fed = jnp.concatenate([feats_in[:, :1], pred[:, :-1]], 1)
        reg2, ce2 = terms(head_forward(hp, hc, fed, emb, pair_valid))
        loss = loss + unroll_w * (reg_w * reg2 + distill_w * ce2)
    return loss, (reg, ce)


def agreement(hp: Any, hc: dict[str, Any], embed: Any, token_ids: Any, z: Any, ids: Any, valid: Any, plen: Any) -> Any:
    """i32[4]: (hits, n) at the first draft position and (hits, n) at the second, own feature
    (:func:`recipes.eagle.torch_backend.agreement_counts` over the generated positions)."""
    import jax.numpy as jnp

    pair_valid = valid[:, :-1] & valid[:, 1:]
    scored = pair_valid & (jnp.arange(ids.shape[1] - 1)[None, :] >= plen[:, None] - 1)
    emb = embed[ids[:, 1:]]
    w_sub = embed[token_ids]
    theirs = jnp.argmax(z[:, 1:, -hc["hidden_size"] :] @ embed.T, -1)
    fed = fuse_features(hp, hc, z[:, :-1])
    pred = head_forward(hp, hc, fed, emb, pair_valid)
    hit1 = token_ids[jnp.argmax(pred @ w_sub.T, -1)] == theirs
    pred2 = head_forward(hp, hc, jnp.concatenate([fed[:, :1], pred[:, :-1]], 1), emb, pair_valid)
    hit2 = token_ids[jnp.argmax(pred2 @ w_sub.T, -1)] == theirs
    scored2 = scored.at[:, 0].set(False)
    return jnp.stack([(hit1 & scored).sum(), scored.sum(), (hit2 & scored2).sum(), scored2.sum()])


# ----------------------------------------------------------------------------- the run


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if n <= s), sizes[-1])


def run_generation(
    gen_fn: Any,
    params: Any,
    prompts: list[list[int]],
    temperature: float,
    seed: int,
    args: argparse.Namespace,
    width: int | None = None,
) -> list[list[int]]:
    """Continuations (ending with EOS where the answer ended), batched by bucketed prompt length
    (``width``: every batch left-padded to that many tokens instead)."""
    import jax
    import jax.numpy as jnp

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(0, len(order), args.gen_batch):
        chunk = order[k : k + args.gen_batch]
        width = width or bucket(max(len(prompts[i]) for i in chunk), args.prompt_buckets)
        ids = np.full((args.gen_batch, width), EOS_ID, np.int32)
        valid = np.zeros((args.gen_batch, width), bool)
        for j, i in enumerate(chunk):
            p = prompts[i][-width:]
            ids[j, width - len(p) :] = p
            valid[j, width - len(p) :] = True
        # filler rows: copies of the chunk's first prompt (their answers are dropped), so that no row of the
        # batch is all padding: each reads real keys, as the check's full batches do
        ids[len(chunk) :], valid[len(chunk) :] = ids[0], valid[0]
        res = np.asarray(
            gen_fn(params, jnp.asarray(ids), jnp.asarray(valid), jax.random.key(seed + k), jnp.float32(temperature))
        )
        for j, i in enumerate(chunk):
            row = res[j].tolist()
            out[i] = row[: row.index(EOS_ID) + 1] if EOS_ID in row else row
    return out


def channel_scale(feats: np.ndarray, valid: np.ndarray, d: int) -> np.ndarray:
    """f32[k, d]: per low/mid state (the first k of ``feats``' (k+1) d-wide parts) and channel, the largest
    magnitude of the RMS-normalised state over the ``valid`` positions: :func:`quantise` divides by it first, so
    the few channels that run an order of magnitude above the rest (median max/RMS 12 at layers 3 and 15)
    do not take the int8 range from the others (0.5 % RMS error instead of 5 % with a per-position scale alone,
    on the CPU's reference features)."""
    x = feats[valid].reshape(-1, feats.shape[-1] // d, d)[:, :-1].astype(np.float32)
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-12)
    return (np.abs(x).max(0) + 1e-6).astype(np.float32)


def quantise(hidden: Any, ch: Any) -> tuple[Any, Any, Any]:
    """(z bf16[..., d], taps i8[..., k, d], scales f32[..., k]) from f32[..., (k+1)d] :func:`features`:
    z in bfloat16 as before; the k low/mid states divided by ``ch`` f32[k, d] (:func:`channel_scale`) and
    stored in int8 with one scale per position and state (never clipped)."""
    import jax.numpy as jnp

    k, d = ch.shape
    taps = hidden[..., : k * d].reshape(*hidden.shape[:-1], k, d) / ch
    top = jnp.maximum(jnp.max(jnp.abs(taps), -1), 1e-30)
    q = jnp.round(taps / top[..., None] * 127).astype(jnp.int8)
    return hidden[..., k * d :].astype(jnp.bfloat16), q, top / 127


def dequantise(z: Any, taps: Any, scales: Any, ch: Any) -> Any:
    """f32[..., (k+1)d]: :func:`quantise`'s inverse (up to its rounding), the layout :func:`features` gives."""
    import jax.numpy as jnp

    low = taps.astype(jnp.float32) * scales[..., None] * ch
    return jnp.concatenate([low.reshape(*low.shape[:-2], -1), z.astype(jnp.float32)], -1)


class Store:
    """Sequences, and their features on the host (a TPU v5e's 15.75 GB holds a quarter of what three
    states per position take for the default data), one set of arrays per length bucket."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.sizes = sizes
        self.seqs: dict[int, list[list[int]]] = {s: [] for s in sizes}
        self.plen: dict[int, list[int]] = {s: [] for s in sizes}
        self.positions = 0  # tokens held

    def add(self, prompts: list[list[int]], conts: list[list[int]]) -> int:
        n = 0
        for p, c in zip(prompts, conts, strict=True):
            s = (p + c)[: self.sizes[-1]]
            self.seqs[bucket(len(s), self.sizes)].append(s)
            self.plen[bucket(len(s), self.sizes)].append(len(p))
            n += len(s)
        self.positions += n
        return n

    def build(self, feat_fn: Any, params: Any, rows: int, ch: np.ndarray) -> dict[int, dict[str, Any]]:
        """Per bucket width, numpy arrays: ids i32[R, W], valid bool[R, W], plen i32[R], the features as
        :func:`quantise` stores them (z, taps, scales) and ``ch``; and ``tokens``, the real positions."""
        import jax
        import jax.numpy as jnp

        quant = jax.jit(quantise)
        chj = jnp.asarray(ch)
        k, d = ch.shape
        out = {}
        for w, seqs in self.seqs.items():
            if not seqs:
                continue
            n = len(seqs)
            ids = np.full((n, w), EOS_ID, np.int32)
            for j, s in enumerate(seqs):
                ids[j, : len(s)] = s
            lens = np.asarray([len(s) for s in seqs])
            valid = np.arange(w)[None, :] < lens[:, None]
            entry: dict[str, Any] = {
                "ids": ids,
                "valid": valid,
                "plen": np.asarray(self.plen[w], np.int32),
                "tokens": int(lens.sum()),
                "z": np.empty((n, w, d), jnp.bfloat16),
                "taps": np.empty((n, w, k, d), np.int8),
                "scales": np.empty((n, w, k), np.float32),
                "ch": ch,
            }
            for lo in range(0, n, rows):
                a, v = ids[lo : lo + rows], valid[lo : lo + rows]
                pad = rows - len(a)
                a, v = np.pad(a, ((0, pad), (0, 0))), np.pad(v, ((0, pad), (0, 0)))
                if pad:
                    v[rows - pad :, 0] = True  # filler rows
                parts = quant(feat_fn(params, jnp.asarray(a), jnp.asarray(v)), chj)
                for name, part in zip(("z", "taps", "scales"), parts, strict=True):
                    entry[name][lo : lo + rows] = np.asarray(part)[: rows - pad]
            out[w] = entry
        return out


def hidden_of(d: dict[str, Any], rows: Any = slice(None)) -> Any:
    """f32[r, W, (k+1)d] on the default device: the dequantised features of ``d``'s rows ``rows``."""
    import jax.numpy as jnp

    return dequantise(*(jnp.asarray(d[n][rows]) for n in ("z", "taps", "scales")), jnp.asarray(d["ch"]))


class Batches:
    """Training batches gathered from :meth:`Store.build`'s host arrays by worker threads, ``depth``
    ahead of the chip, in the order the caller's ``rng`` draws them: a width with probability ``share``
    (by positions), then ``batch_tokens // width`` rows at random. Each batch: device arrays
    (z, taps, scales, ids, valid)."""

    def __init__(self, data: dict[int, Any], batch_tokens: int, rng: Any, workers: int = 4, depth: int = 8):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self.data, self.rng, self.batch_tokens = data, rng, batch_tokens
        self.widths = sorted(data)
        share = np.asarray([data[w]["tokens"] for w in self.widths], float)
        self.share = share / share.sum()
        self.pool = ThreadPoolExecutor(workers)
        self.ahead: Any = deque()
        self.waited = 0.0  # seconds next() waited for a batch
        for _ in range(depth):
            self._submit()

    def _submit(self) -> None:
        w = self.widths[self.rng.choice(len(self.widths), p=self.share)]
        idx = np.sort(self.rng.integers(0, self.data[w]["ids"].shape[0], max(1, self.batch_tokens // w)))
        self.ahead.append(self.pool.submit(self._gather, w, idx))

    def _gather(self, w: int, idx: np.ndarray) -> Any:
        import jax

        d = self.data[w]
        return jax.device_put(tuple(d[n][idx] for n in ("z", "taps", "scales", "ids", "valid")))

    def next(self) -> Any:
        t = time.perf_counter()
        batch = self.ahead.popleft().result()
        self.waited += time.perf_counter() - t  # the chip idle for want of data, at most
        self._submit()
        return batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


ARRAYS = ("ids", "valid", "plen", "z", "taps", "scales", "ch")


def save_data(path: Path, data: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write :func:`make_data`'s arrays (``data[split][width]``, as :meth:`Store.build` gives them) and
    ``meta`` to ``path``, for ``--load-data`` in a later call (a call on the lent device runs at most
    10 minutes; its machine keeps local files while warm). z goes as its bfloat16 bits (uint16)."""
    path.mkdir(parents=True, exist_ok=True)
    for split_name, by_width in data.items():
        for w, d in by_width.items():
            arrays = {n: np.asarray(d[n]) for n in ARRAYS}
            arrays["z"] = arrays["z"].view(np.uint16)
            np.savez(path / f"{split_name}-{w}.npz", tokens=np.int64(d["tokens"]), **arrays)
    (path / "meta.json").write_text(json.dumps(meta) + "\n")


def load_data(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read what :func:`save_data` wrote: ``(data, meta)``, the arrays on the host."""
    import jax.numpy as jnp

    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise SystemExit(f"--load-data: {path} holds no meta.json (expected a directory written by --save-data)")
    data: dict[str, Any] = {"train": {}, "held": {}}
    for f in sorted(path.glob("*-*.npz")):
        split_name, w = f.stem.split("-")
        z = np.load(f)
        missing = [n for n in ARRAYS if n not in z.files]
        if missing:
            raise SystemExit(f"--load-data: {f} lacks {missing} (written by an older --save-data?)")
        entry = {n: z[n] for n in ARRAYS}
        entry["z"] = entry["z"].view(jnp.bfloat16)
        data[split_name][int(w)] = {**entry, "tokens": int(z["tokens"])}
    if not data["train"] or not data["held"]:
        raise SystemExit(f"--load-data: {path} lacks train-*.npz or held-*.npz files")
    return data, json.loads(meta_file.read_text())


def train(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    args.out.mkdir(parents=True, exist_ok=True)
    log(f"devices {jax.devices()}, matrix products at {args.precision!r} precision")
    params_np, cfg = target_params(args.parts)
    params = jax.tree.map(jnp.asarray, params_np)
    pr = np.load(args.parts / "prompts.npz")
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "target": cfg, "variants": {}}
    if args.load_data:
        t = time.perf_counter()
        both, meta = load_data(args.load_data)
        precision = meta["target_check"]["precision"]
        jax.config.update("jax_default_matmul_precision", None if precision == "default" else precision)
        summary.update({k: v for k, v in meta.items() if k != "args"}, data_args=meta["args"])
        log(f"data loaded from {args.load_data} in {time.perf_counter() - t:.0f} s; precision {precision!r}")
    else:
        both, meta = make_data(args, params, cfg, pr)
        summary.update({k: v for k, v in meta.items() if k != "args"})
        if args.save_data:
            t = time.perf_counter()
            save_data(args.save_data, both, meta)
            log(f"data saved to {args.save_data} in {time.perf_counter() - t:.0f} s")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if args.train_minutes <= 0:
        log("done (no training: --train-minutes 0)")
        return 0
    train_heads(args, params, cfg, pr, both["train"], both["held"], summary)
    log("done")
    return 0


def make_data(args: argparse.Namespace, params: Any, cfg: dict[str, Any], pr: Any) -> tuple[dict[str, Any], Any]:
    """Steps (2)-(4) of the module docstring: ``({"train": data, "held": hdata}, meta)``, the data by
    bucket width (ids, valid, features on the chip, prompt lengths, token count) and what the summary
    records about it."""
    import jax

    split = lambda ids, off: [ids[off[i] : off[i + 1]].tolist() for i in range(len(off) - 1)]  # noqa: E731
    train_prompts = split(pr["train_ids"], pr["train_offsets"])[: args.train_prompts]
    held_prompts = split(pr["held_ids"], pr["held_offsets"])[: args.heldout_prompts]
    prefix, suffix = pr["prefix"].tolist(), pr["suffix"].tolist()
    log(f"target {cfg}; {len(train_prompts)} template prompts, {len(held_prompts)} held-out")
    feat_fn, gen_fn, summary_check = checked_features(params, cfg, pr, args)
    gen_user = jax.jit(lambda p, i, v, k, t: generate(p, cfg, i, v, k, t, args.user_tokens))
    summary: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "target_check": summary_check}

    # self-generated prompts
    t = time.perf_counter()
    magpie: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    rounds = 0
    while len(magpie) < args.self_prompts and time.perf_counter() - t < args.prompt_minutes * 60:
        users = run_generation(gen_user, params, [prefix] * args.gen_batch, args.user_temperature, 7919 * rounds, args)
        rounds += 1
        for u in users:
            if u and u[-1] == EOS_ID and 3 <= len(u) - 1 and tuple(u) not in seen:
                seen.add(tuple(u))
                magpie.append(prefix + u[:-1] + suffix)
        log(f"self-prompting round {rounds}: {len(magpie)} prompts")
    magpie = magpie[: args.self_prompts]
    np.savez(
        args.out / "self_prompts.npz",
        ids=np.concatenate([np.asarray(m, np.int32) for m in magpie]),
        offsets=np.cumsum([0] + [len(m) for m in magpie]),
    )
    summary["self_prompts"] = len(magpie)
    summary["self_prompt_minutes"] = (time.perf_counter() - t) / 60

    # continuations
    t = time.perf_counter()
    held = Store(args.seq_buckets)
    held_conts = run_generation(gen_fn, params, held_prompts, 0.0, 0, args)
    held.add(held_prompts, held_conts)
    np.savez(  # the chip's greedy answers, to read and to hold against the CPU's
        args.out / "heldout_answers.npz",
        ids=np.concatenate([np.asarray(c, np.int32) for c in held_conts]),
        offsets=np.cumsum([0] + [len(c) for c in held_conts]),
    )
    summary["heldout_answers_ending_in_eos"] = float(np.mean([bool(c) and c[-1] == EOS_ID for c in held_conts]))
    store = Store(args.seq_buckets)
    pool = magpie + train_prompts
    rng = np.random.default_rng(args.seed)
    r = 0

    def more() -> bool:
        return time.perf_counter() - t < args.gen_minutes * 60 and store.positions < args.max_positions

    while r == 0 or more():
        temp = 0.0 if r == 0 else args.temperature
        order = rng.permutation(len(pool))
        for k in range(0, len(order), args.gen_batch * 4):
            if k and not more():
                break
            part = [pool[i] for i in order[k : k + args.gen_batch * 4]]
            store.add(part, run_generation(gen_fn, params, part, temp, 1000 * r + k, args))
        log(f"round {r} (T = {temp}): {store.positions} positions, {time.perf_counter() - t:.0f} s")
        r += 1
    gen_s = time.perf_counter() - t
    ch = channel_scale(pr["ref_feats"], pr["ref_valid"], cfg["hidden"])
    data = store.build(feat_fn, params, args.feature_rows, ch)
    hdata = held.build(feat_fn, params, args.feature_rows, ch)
    positions = sum(d["tokens"] for d in data.values())
    log(
        f"data: {positions} positions in buckets { {w: d['ids'].shape for w, d in data.items()} }, "
        f"{gen_s:.0f} s + features"
    )
    summary.update(generation_s=gen_s, training_positions=positions, rounds_begun=r)
    return {"train": data, "held": hdata}, summary


def train_heads(
    args: argparse.Namespace,
    params: Any,
    cfg: dict[str, Any],
    pr: Any,
    data: dict[int, Any],
    hdata: dict[int, Any],
    summary: dict[str, Any],
) -> None:
    """Step (5)-(6): train each ``--variant`` on ``data``, measure it on ``hdata`` and on the CPU's
    reference features, write ``OUT/<variant>.npz`` and ``OUT/summary.json``."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(args.seed)
    positions = sum(d["tokens"] for d in data.values())
    vocab = cfg["vocab"]
    counts = np.zeros(vocab, np.int64)
    for d in data.values():
        counts += np.bincount(np.asarray(d["ids"])[np.asarray(d["valid"])], minlength=vocab)[:vocab]
    token_ids = frequent_tokens(counts, args.num_tokens).astype(np.int32)
    embed = params["embed"]
    w_sub = embed[jnp.asarray(token_ids)]
    ch = jnp.asarray(next(iter(data.values()))["ch"])

    for name in args.variant:
        weights = VARIANTS[name].weights
        hc = head_config(cfg, args.num_tokens, VARIANTS[name])

        def loss_fn(hp: Any, z: Any, x: Any, v: Any, key: Any, weights: Any = weights, hc: Any = hc) -> Any:
            return head_loss(hp, hc, embed, w_sub, z, x, v, weights, key)

        @jax.jit
        def step(hp: Any, opt: Any, batch: Any, key: Any, lr: Any) -> Any:
            z, taps, scales, x, v = batch
            hidden = dequantise(z, taps, scales, ch)
            (loss, parts), g = jax.value_and_grad(loss_fn, has_aux=True)(hp, hidden, x, v, key)
            norm = jnp.sqrt(sum(jnp.sum(a * a) for a in jax.tree.leaves(g)))
            g = jax.tree.map(lambda a: a * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), g)
            m, s, n = opt
            n = n + 1
            m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
            s = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, s, g)
            hp = jax.tree.map(
                lambda p, a, b: p - lr * (a / (1 - 0.9**n)) / (jnp.sqrt(b / (1 - 0.999**n)) + 1e-8), hp, m, s
            )
            return hp, (m, s, n), loss, parts

        start_from = resumed_head(args.init_from, hc, token_ids) if args.init_from else init_head(hc, args.seed)
        hp = jax.tree.map(jnp.asarray, start_from)
        opt = (jax.tree.map(jnp.zeros_like, hp), jax.tree.map(jnp.zeros_like, hp), jnp.float32(0))
        key = jax.random.key(args.seed)
        batches = Batches(data, args.batch_tokens, rng)
        start, n_step = time.perf_counter(), 0
        budget = args.train_minutes * 60 / len(args.variant)
        while True:
            progress = (time.perf_counter() - start) / budget
            if progress >= 1:
                break
            lr = cosine_lr(args.lr, n_step, progress, warmup=100)
            key, k = jax.random.split(key)
            hp, opt, loss, parts = step(hp, opt, batches.next(), k, jnp.float32(lr))
            n_step += 1
            if n_step % 50 == 0:
                loss.block_until_ready()  # keep the time budget honest: dispatch runs ahead of the chip
            if n_step % 500 == 0:
                log(
                    f"{name}: step {n_step} lr {lr:.2e} loss {float(loss):.4f} reg {float(parts[0]):.4f} "
                    f"ce {float(parts[1]):.4f}"
                )
        train_s = time.perf_counter() - start
        batches.close()
        agree = jax.jit(partial(agreement, hc=hc))
        tot = np.zeros(4, np.int64)
        for d in hdata.values():
            for k in range(0, d["ids"].shape[0], 16):
                tot += np.asarray(
                    agree(
                        hp,
                        embed=embed,
                        token_ids=jnp.asarray(token_ids),
                        z=hidden_of(d, slice(k, k + 16)),
                        ids=jnp.asarray(d["ids"][k : k + 16]),
                        valid=jnp.asarray(d["valid"][k : k + 16]),
                        plen=jnp.asarray(d["plen"][k : k + 16]),
                    )
                )
        a1, a2 = tot[0] / max(tot[1], 1), tot[2] / max(tot[3], 1)
        # the same on the CPU target's own features (prepare's reference rows): what the head will meet
        n_ref = pr["ref_valid"].sum(1).astype(np.int32)
        ref = np.asarray(
            agree(
                hp,
                embed=embed,
                token_ids=jnp.asarray(token_ids),
                z=jnp.asarray(pr["ref_feats"]),
                ids=jnp.asarray(pr["ref_ids"]),
                valid=jnp.asarray(pr["ref_valid"]),
                plen=jnp.asarray(n_ref - REF_NEW),
            )
        )
        c1 = ref[0] / max(ref[1], 1)
        report = {
            "heldout_agreement_first_position": float(a1),
            "heldout_agreement_second_position_own_feature": float(a2),
            "cpu_reference_agreement_first_position": float(c1),
            "loss_weights": {k: getattr(weights, k) for k in ("regression", "distill", "unroll", "noise")},
            "intermediate_size": hc["intermediate_size"],
            "train_steps": n_step,
            "seconds_waiting_for_batches": batches.waited,
            "train_minutes": train_s / 60,
            "training_positions": positions,
            "self_prompts": summary["self_prompts"],
            "generation_minutes": summary["generation_s"] / 60,
            "device": str(jax.devices()[0].device_kind),
            "args": summary["args"],
        }
        summary["variants"][name] = report
        log(f"{name}: waited {batches.waited:.1f} s of {train_s:.0f} s for the host's batches")
        log(
            f"{name}: {n_step} steps in {train_s:.0f} s, held-out agreement {a1:.3f} / {a2:.3f}, "
            f"on the CPU's reference features {c1:.3f}"
        )
        save_head_npz(args.out / f"{name}.npz", hp, hc, token_ids, report)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
