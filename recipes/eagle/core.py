"""What both backends of the EAGLE recipe share: variants, head shape, schedule, batching, the head file.

Only numpy and the standard library at import time: the JAX backend runs where
torch is not installed (a TPU machine). The torch functions of the recipe (the
reference loss and the teacher-forced agreement) are in
:mod:`recipes.eagle.torch_backend`; the JAX backend re-writes them and
``recipes/tests/test_jax_backend.py`` holds the two against each other.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EOS_ID",
    "FEATURE_LAYERS",
    "HEAD_KEYS",
    "LAYER_KEYS",
    "VARIANTS",
    "LossWeights",
    "Variant",
    "cosine_lr",
    "frequent_tokens",
    "head_config",
    "head_keys",
    "import_head",
    "log",
    "pack_by_length",
    "resumed_head",
    "save_head_npz",
    "token_counts",
]

T0 = time.perf_counter()
EOS_ID = 2  # <|im_end|>: SmolLM2's end of turn, also its pad token (recipes.draft.EOS_ID)

# EAGLE-3-style input (arXiv 2503.01840): a fused variant reads the target's states after these layers
# (indices of transformers' output_hidden_states; a low and a middle one of SmolLM2's 30) beside z
FEATURE_LAYERS = (3, 15)

# a decoder layer's weights (torch's names: the first layer's at the top level, the later ones' under
# ``deeper.<i>.``), and the head's own
LAYER_KEYS = (
    "input_norm.weight q_proj.weight k_proj.weight v_proj.weight o_proj.weight "
    "post_norm.weight gate_proj.weight up_proj.weight down_proj.weight"
).split()
HEAD_KEYS = ["fc.weight", "fc.bias", *LAYER_KEYS, "out_norm.weight"]


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class LossWeights:
    """The terms of the head's loss (:func:`recipes.eagle.torch_backend.head_loss`)."""

    regression: float = 1.0
    distill: float = 0.1
    unroll: float = 0.0  # weight of the unrolled second pass (0: off)
    noise: float = 0.0  # std of the Gaussian noise on input features, relative to their RMS


@dataclass(frozen=True)
class Variant:
    """A head to train: its loss weights and its shape relative to the default one."""

    weights: LossWeights
    width: int = 1  # the MLP's width as a multiple of the target's
    depth: int = 1  # decoder layers
    fused: bool = False  # reads FEATURE_LAYERS beside z (EAGLE-3-style); the JAX backend only


_KD = LossWeights(regression=1.0, distill=1.0, noise=0.05)
_NOISE = LossWeights(regression=1.0, distill=1.0, noise=0.2)
_BOTH = LossWeights(regression=1.0, distill=1.0, unroll=0.5, noise=0.2)
VARIANTS = {
    "kd": Variant(_KD),
    "kd-unroll": Variant(LossWeights(regression=1.0, distill=1.0, unroll=0.5, noise=0.05)),
    "kd-noise": Variant(_NOISE),  # the head shipped before the fused one (torch backend, on an H200)
    "kd-both": Variant(_BOTH),
    "kd-noise-wide": Variant(_NOISE, width=2),
    "e3-noise": Variant(_NOISE, fused=True),
    "e3-unroll": Variant(_BOTH, fused=True),  # the shipped head (JAX backend, on a TPU v5e)
    "e3-unroll-deep": Variant(_BOTH, depth=2, fused=True),
}


def head_config(target: dict[str, Any], num_tokens: int, variant: Variant) -> dict[str, Any]:
    """The fields of :class:`specjax.drafters.eagle_head.EagleConfig` for ``variant`` over a target of
    shape ``target`` (``hidden``, ``heads``, ``kv_heads``, ``intermediate``, ``vocab``)."""
    return {
        "num_layers": variant.depth,
        "feature_layers": list(FEATURE_LAYERS) if variant.fused else [],
        "hidden_size": target["hidden"],
        "num_attention_heads": target["heads"],
        "num_key_value_heads": target["kv_heads"],
        "intermediate_size": target["intermediate"] * variant.width,
        "target_vocab_size": target["vocab"],
        "num_tokens": num_tokens,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }


def head_keys(feature_layers: Any, num_layers: int = 1) -> list[str]:
    """The names of a head's weights (torch's), with the fusion layer where it reads ``feature_layers``
    and ``num_layers`` decoder layers."""
    deeper = [f"deeper.{i}.{k}" for i in range(num_layers - 1) for k in LAYER_KEYS]
    return [*HEAD_KEYS, *deeper, *(["fuse.weight"] if feature_layers else [])]


def token_counts(sequences: list[list[int]], vocab: int) -> np.ndarray:
    """i64[vocab]: how often each id occurs in ``sequences``."""
    counts = np.zeros(vocab, np.int64)
    for s in sequences:
        counts += np.bincount(np.asarray(s, np.int64), minlength=vocab)[:vocab]
    return counts


def frequent_tokens(counts: np.ndarray, n: int) -> np.ndarray:
    """i64[min(n, V)]: the ids of the n largest ``counts`` (i64[V]; ties to the smaller id), sorted: the
    tokens a head scores."""
    return np.sort(np.argsort(-np.asarray(counts), kind="stable")[:n]).astype(np.int64)


def pack_by_length(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Batches of sequence indices, similar lengths together, at most ``max_tokens`` padded tokens each.

    Sorted by length (stable), then cut greedily; the caller shuffles the
    batches. A sequence longer than ``max_tokens`` is a batch of its own.
    """
    out: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and (len(cur) + 1) * lengths[i] > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def cosine_lr(peak: float, step: int, progress: float, warmup: int) -> float:
    """The learning rate at ``step``: linear warm-up over ``warmup`` steps, then cosine decay to 0 at
    ``progress`` = 1 (the share of the time budget spent)."""
    return peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# ----------------------------------------------------------------------------- the JAX backend's head file


def save_head_npz(path: Path, hp: Any, hc: dict[str, Any], token_ids: np.ndarray, report: dict[str, Any]) -> None:
    """Write a head trained by the JAX backend (weights in float16 under torch's names, its configuration,
    tokens and report) for ``import`` and ``--init-from``."""
    host = {k: np.asarray(v, np.float16) for k, v in hp.items()}
    np.savez(path, token_ids=token_ids, config=json.dumps(hc), report=json.dumps(report), **host)


def resumed_head(path: Path, hc: dict[str, Any], token_ids: np.ndarray) -> dict[str, np.ndarray]:
    """The weights a JAX run saved (``OUT/<variant>.npz``), to train on from (``--init-from``).

    ``hc``: the head configuration this run trains (:func:`head_config`);
    ``token_ids``: i32[N], the tokens it scores (from this run's data). The
    saved head must have the same configuration and score the same tokens
    (a head is not resumed on other data's token set); ``ValueError`` names
    what differs. Returns float32 arrays under :func:`head_keys`' names (the
    file holds float16: resuming starts from the weights as shipped).
    """
    try:
        saved = np.load(path)
        cfg = json.loads(str(saved["config"]))
        ids = np.asarray(saved["token_ids"])
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"--init-from {path}: expected an OUT/<variant>.npz written by train ({e})") from None
    hc = json.loads(json.dumps(hc))  # as saved: tuples as lists
    if cfg != hc:
        diff = sorted(k for k in set(cfg) | set(hc) if cfg.get(k) != hc.get(k))
        raise ValueError(f"--init-from {path}: the saved head's configuration differs from this run's in {diff}")
    if not np.array_equal(ids, token_ids):
        raise ValueError(f"--init-from {path}: the saved head scores other tokens than this run's data gives")
    names = head_keys(hc["feature_layers"], hc.get("num_layers", 1))
    missing = [k for k in names if k not in saved.files]
    if missing:
        raise ValueError(f"--init-from {path}: missing weights {missing}")
    return {k: np.asarray(saved[k], np.float32) for k in names}


def import_head(npz: Path, out: Path) -> None:
    """A head file of the JAX backend (:func:`save_head_npz`) -> a head directory (specjax's ``save_head``,
    with its report as ``training_report.json``). Needs torch and specjax."""
    import torch

    from specjax.drafters.eagle_head import EagleConfig, EagleHead, save_head

    data = np.load(npz)
    cfg = EagleConfig(**json.loads(str(data["config"])))
    head = EagleHead(cfg)
    keys = head_keys(cfg.feature_layers, cfg.num_layers)
    state = {k: torch.from_numpy(data[k].astype(np.float32)) for k in keys}
    state["token_ids"] = torch.from_numpy(data["token_ids"].astype(np.int64))
    head.load_state_dict(state)
    save_head(head, out)
    (Path(out) / "training_report.json").write_text(json.dumps(json.loads(str(data["report"])), indent=2) + "\n")
