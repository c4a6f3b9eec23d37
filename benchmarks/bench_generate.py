r"""End-to-end generation: target-only ``generate``, transformers' assisted generation, and specjax.

Usage::

    python benchmarks/bench_generate.py              # full run
    python benchmarks/bench_generate.py --quick      # fewer prompts, tokens and repetitions
    python benchmarks/bench_generate.py --jsonl bench-results/generate.jsonl
    python benchmarks/bench_generate.py --target DIR --draft DIR     # any local pair
    python benchmarks/bench_generate.py --synthetic  # skip the embedded pair
    python benchmarks/bench_generate.py --drafter ngram,hybrid,model --categories open,grounded
    python benchmarks/bench_generate.py --options penalty-minp     # logits processors on both sides

Issue 56's runs (speculation under logits processors; the report's section
``benchmarks/report/38-processors.md`` reads these two files)::

    python benchmarks/bench_generate.py --options penalty-minp --categories open \
        --drafter model,ngram,eagle,hybrid --num-draft-tokens 8 --temperatures 0,0.7 --batch-sizes 1,8 \
        --reps 2 --jsonl benchmarks/results/generate-penalty-minp.jsonl
    python benchmarks/bench_generate.py --options json --drafter model,ngram,eagle,hybrid \
        --num-draft-tokens 8 --temperatures 0 --batch-sizes 1 --prompts 8 --max-new-tokens 128 \
        --reps 2 --jsonl benchmarks/results/generate-json.jsonl

Methods, all on the same models, prompts and machine in one run:

* ``target``: ``target.generate`` alone, at B=1 (prompt by prompt) and B=8 (one
  left-padded batch);
* ``assisted``: transformers' assisted generation, ``generate(assistant_model=draft)``,
  B=1 only (transformers supports no more), greedy, with transformers' default
  draft-length schedule; ``assisted-G`` fixes its draft length to G;
* ``specjax``: :func:`specjax.speculative_generate` at B=1 and B=8, with G and
  (greedy, full run) 2G draft tokens per step, once per drafter of
  ``--drafter`` (``model``: the pair's draft model; ``ngram``: prompt lookup;
  ``eagle``: the pair's EAGLE head; ``hybrid``: n-gram where it matches, else
  the EAGLE head, or the draft model if the pair has no head;
  ``hybrid-model``: n-gram, else the draft model), with the
  adaptive draft length (``--fixed`` drafts G every step); beside transformers'
  ``assisted-G`` (its assisted generation with G fixed), ``specjax-G``: the
  ``model`` drafter with the same fixed G, the loops compared with no schedule
  in either. Below the table,
  the acceptance rate per draft position and the fraction of steps that
  drafted.

Prompt categories (``--categories``): ``open`` (open chat), ``grounded``
(input-grounded tasks: summaries, rewrites, extraction, code edits, answers
quoting a document, chats quoting earlier turns) and ``extraction`` ("extract
these fields as JSON" over short documents), from :mod:`specjax.prompts`;
the synthetic pair has only random prompts (category ``synthetic``).

Logits processors (``--options``, see :data:`OPTIONS`), the same on every
side: ``penalty-minp`` passes ``repetition_penalty=1.1`` and ``min_p=0.05``
(``min_p`` at T > 0 only: greedy decoding ignores it) to ``generate``, to
assisted generation and to :func:`specjax.speculative_generate`; ``json``
constrains each ``extraction`` prompt's answer to its JSON schema
(:data:`specjax.prompts.EXTRACTION_SCHEMAS`): ``json_schema=`` for specjax,
xgrammar's own transformers logits processor (plain constrained decoding,
compiled from the same grammar) for ``generate``; B = 1 only (one schema a
call), and no assisted generation (xgrammar's processor keeps a matcher state
that assisted generation's rejected candidates would corrupt). specjax's rows
then also give the processors' own time per step (``processor_step_ms``:
:attr:`specjax.SpeculativeStats.processor_time_s` over the steps, part of the
drafting and loop times beside it) and their calls per step
(``processor_step_calls``, :attr:`specjax.SpeculativeStats.processor_calls`
over the steps).

Every method is warmed up with exactly the calls it is then timed on, each
call again (up to ``WARMUP_CALLS`` times) while it still compiles: JAX
compiles the loop's steps for the shapes they meet, and the adaptive length
meets new ones (a batch size and draft width) for a few calls. The schedule's
choices depend on measured times, so a timed call can still meet a shape the
warm-up did not: that compilation is one-time work per shape and process, like
loading the models, and is left out of the call's time (wall time and CPU
time alike; :attr:`specjax.SpeculativeStats.compile_time_s`); ``compile_s`` in
the JSON rows says how much there was. Timing goes call by call: for each
prompt (B=1) or the batch (B=8), every method of the group runs back to back,
in rotating order, and this is repeated ``reps`` times, so that the shared machine's changing load hits the
methods compared alike. tokens/s is total tokens over total wall time; the
speed-up is the median over calls of the ratio of a method's tokens/s to that of
target-only ``generate`` on the same call, run seconds apart ("by CPU time":
the same with this process's CPU time, which other processes' load inflates
less). Tokens are counted up to and including EOS. ``same output`` says whether
the greedy sequences equal target-only ``generate``'s.

Models. The embedded default pair (:func:`specjax.pair.load_default_pair`) when
it loads; otherwise (or with ``--synthetic``) a synthetic pair, see
:func:`synthetic_pair`: a random 8-layer Llama target (d=512, V=8192) and a
1-layer, d=64 Llama draft *built*, not trained, to imitate it. A random
transformer's next token depends on all of its layers, so nothing small agrees
with it; the target's embedding is therefore drawn with standard deviation 4
(instead of 0.02), so that the current token dominates its residual stream, and
the draft maps each token to the target's 0-layer early-exit choice (embedding,
final norm, head). The draft then agrees with the target's greedy choice about
90% of the time (acceptance rate, accepted / proposed at G=4, about 0.77) at
about 1/30 of its FLOPs; at temperature 0.7 it accepts about half its tokens.
It stands in for a trained small draft; the text is meaningless.

Rows appended to ``--jsonl`` have the fields ``model_pair``, ``method``,
``num_draft_tokens``, ``temperature``, ``batch_size``, ``tokens_per_s``,
``mean_accepted_length``, ``acceptance_rate``, ``speedup``, ``options`` (and a few more).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax_threads
from results_io import append_jsonl

PROMPTS = (
    "What is the capital of France, and what is it famous for?",
    "Write a short poem about the sea.",
    "Explain in simple terms what a computer program is.",
    "Give three tips for staying healthy.",
    "Describe how a bicycle works.",
    "What are the planets of the solar system?",
    "Summarize the plot of a fairy tale you like.",
    "Why is the sky blue?",
)
SYNTHETIC_NAME = "synthetic Llama 8L-d512-V8192 + built 1L-d64 draft"
WARMUP_CALLS = 4  # warm-up calls per timed call, at most (see the module doc)


@dataclass(frozen=True)
class Options:
    """Logits processors applied alike to target-only ``generate``, assisted generation and specjax."""

    name: str
    kwargs: tuple[tuple[str, float], ...] = ()  # generate's / speculative_generate's options
    json: bool = False  # each prompt's JSON schema (specjax.prompts.EXTRACTION_SCHEMAS)

    def at(self, temperature: float) -> dict[str, float]:
        """The options for a call at ``temperature``: without the sampling filters when greedy (ignored there)."""
        from specjax.generate.processors import WARPER_OPTIONS

        return {k: v for k, v in self.kwargs if temperature > 0 or k not in WARPER_OPTIONS}


#: ``--options``: the processor sets (issue 56: a repetition penalty with min-p on open chat, a JSON schema on
#: extraction prompts).
OPTIONS = {
    o.name: o
    for o in (
        Options("none"),
        Options("penalty-minp", (("repetition_penalty", 1.1), ("min_p", 0.05))),
        Options("json", json=True),
    )
}


def options_problem(options: Options, categories: Sequence[str] | None, batch_sizes: Sequence[int]) -> str | None:
    """Why ``options`` cannot run on these categories and batch sizes (None: it can)."""
    if not options.json:
        return None
    if categories is not None and set(categories) != {"extraction"}:
        return f"--options json: needs --categories extraction (its prompts carry their schemas), got {categories}"
    if set(batch_sizes) != {1}:
        return f"--options json: needs --batch-sizes 1 (one JSON schema a call), got {list(batch_sizes)}"
    return None


# --------------------------------------------------------------------------- #
# Models and prompts
# --------------------------------------------------------------------------- #


def synthetic_pair(
    *,
    seed: int = 0,
    layers: int = 8,
    hidden: int = 512,
    vocab_size: int = 8192,
    embedding_std: float = 4.0,
    head_std: float = 0.2,
    draft_hidden: int = 64,
    draft_logit_scale: float = 1.5,
) -> tuple[Any, Any]:
    """A random Llama target and a tiny draft built to imitate it (see the module docstring).

    Target: Llama, ``layers`` x ``hidden``, V = ``vocab_size``, random weights,
    except the embedding (std ``embedding_std``: the current token dominates the
    residual stream) and the head (std ``head_std``: peaked distributions, like a
    trained model's). Draft: a 1-layer Llama of width ``draft_hidden`` whose layer
    adds nothing (zero output projections); token x's embedding is the head row
    of ``f(x)``, the token the target's embedding -> final norm -> head path
    (its 0-layer early exit) ranks first after x. Head rows are random unit
    vectors times ``draft_logit_scale``, so the draft's argmax is f(x).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=1376 * hidden // 512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        **common,
    )
    torch.manual_seed(seed)
    target = LlamaForCausalLM(cfg).eval()
    dcfg = LlamaConfig(
        hidden_size=draft_hidden,
        intermediate_size=2 * draft_hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        **common,
    )
    draft = LlamaForCausalLM(dcfg).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.normal_(0.0, embedding_std)
        target.lm_head.weight.normal_(0.0, head_std)
        exit_h = target.model.norm(target.model.embed_tokens.weight)
        f = torch.cat([(exit_h[i : i + 1024] @ target.lm_head.weight.T).argmax(-1) for i in range(0, vocab_size, 1024)])
        codes = torch.randn(vocab_size, draft_hidden, generator=torch.Generator().manual_seed(seed + 1))
        codes /= codes.norm(dim=1, keepdim=True)
        draft.lm_head.weight.copy_(codes * draft_logit_scale)
        draft.model.embed_tokens.weight.copy_(codes[f])
        draft.model.layers[0].self_attn.o_proj.weight.zero_()
        draft.model.layers[0].mlp.down_proj.weight.zero_()
    for m in (target, draft):
        m.generation_config.pad_token_id = 0
        m.generation_config.eos_token_id = None
        m.generation_config.bos_token_id = None
    return target, draft


@dataclass
class Pair:
    target: Any
    draft: Any
    name: str
    tokenizer: Any = None
    eos: list[int] = field(default_factory=list)
    pad: int = 0
    head: Any = None  # the EAGLE head of the embedded pair (drafters eagle, hybrid)
    heads: dict[str, Any] = field(default_factory=dict)  # --heads: directory -> EagleHead


def load_pair(target_dir: str | None, draft_dir: str | None, synthetic: bool) -> Pair:
    if target_dir:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
        draft = AutoModelForCausalLM.from_pretrained(draft_dir or target_dir).eval()
        return _with_ids(Pair(target, draft, f"{target_dir} + {draft_dir}", AutoTokenizer.from_pretrained(target_dir)))
    if not synthetic:
        try:
            from specjax.pair import load_default_pair

            p = load_default_pair()
            return _with_ids(Pair(p.target, p.draft, "SmolLM2-135M-Instruct + specjax draft", p.tokenizer, head=p.head))
        except Exception as err:  # the pair is optional here: fall back, and say why
            print(f"default pair unavailable ({type(err).__name__}: {err}); using the synthetic pair", file=sys.stderr)
    target, draft = synthetic_pair()
    return Pair(target, draft, SYNTHETIC_NAME)


def _with_ids(pair: Pair) -> Pair:
    eos = pair.target.generation_config.eos_token_id
    pair.eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = pair.tokenizer.pad_token_id if pair.tokenizer is not None else None
    pair.pad = pad if pad is not None else (pair.eos[0] if pair.eos else 0)
    return pair


def make_prompts(pair: Pair, count: int, seed: int = 0) -> list[Any]:
    """``count`` prompts as i64[1, P] tensors: chat prompts, or random ids for the synthetic pair."""
    import torch

    if pair.tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        vocab = pair.target.config.vocab_size
        return [torch.randint(1, vocab, (1, 16 + 6 * i), generator=gen) for i in range(count)]
    out = []
    tok = pair.tokenizer
    for text in (PROMPTS * (count // len(PROMPTS) + 1))[:count]:
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        else:
            ids = tok(text, return_tensors="pt")["input_ids"]
        out.append(ids)
    return out


def batches_of_eight(prompts: list[Any], batches: int) -> list[list[Any]]:
    """The B = 8 calls' prompts: ``batches`` batches of 8, batch i the prompts from the i-th on, cyclically
    (batch 0 is the first 8, the list repeated as needed). More batches: more paired calls per row, at B = 8
    a call's time varies by several percent on a shared machine."""
    return [[prompts[(i + j) % len(prompts)] for j in range(8)] for i in range(batches)]


def left_pad(prompts: list[Any], pad: int) -> tuple[Any, Any]:
    import torch

    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - p.shape[1] :] = p[0]
        mask[b, width - p.shape[1] :] = 1
    return ids, mask


def count_new(new_tokens: Any, eos: list[int]) -> list[int]:
    """Tokens per row up to and including the first EOS (all of them without one)."""
    counts = []
    for row in new_tokens.tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos:
                n = i + 1
                break
        counts.append(n)
    return counts


# --------------------------------------------------------------------------- #
# Methods
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Variant:
    """One setting of specjax's side (``--heads``, ``--context-tokens``: the EAGLE head of the ``eagle`` and
    ``hybrid`` drafters; ``--packed``: every drafter): a method each, timed call by call against the others."""

    head: str | None = None  # a head directory; None: the pair's
    context_tokens: int | None = None  # None: the drafter's default
    packed: str | None = None  # SPECJAX_PACKED_LINEARS: "all", "head" or "0"; None: as the environment

    @property
    def label(self) -> str:
        parts = [f"head={self.head}"] if self.head is not None else []
        parts += [f"context={self.context_tokens}"] if self.context_tokens is not None else []
        parts += [f"packed={self.packed}"] if self.packed is not None else []
        return ",".join(parts)


def make_drafter(pair: Pair, name: str, variant: Variant | None = None) -> Any:
    """What ``speculative_generate(draft=...)`` gets for a drafter name: a fresh drafter per call."""
    from specjax.pair import make_pair_drafter

    variant = variant or Variant()
    head = pair.head if variant.head is None else pair.heads[variant.head]
    return make_pair_drafter(name, draft=pair.draft, head=head, context_tokens=variant.context_tokens)


def category_prompts(pair: Pair, category: str) -> list[Any]:
    """The prompts of ``category`` as i64[1, P] tensors (chat template applied)."""
    from specjax.prompts import all_prompts

    if category == "synthetic" or pair.tokenizer is None:
        return make_prompts(pair, 8)
    tok = pair.tokenizer
    out = []
    for messages in all_prompts()[category].values():
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
                "input_ids"
            ]
        else:
            ids = tok("\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]
        out.append(ids)
    return out


def category_schemas(category: str) -> list[dict]:
    """The JSON schema of each prompt of ``category``, in :func:`category_prompts`' order (``extraction`` only)."""
    from specjax.prompts import EXTRACTION_SCHEMAS, all_prompts

    return [EXTRACTION_SCHEMAS[name] for name in all_prompts()[category]]


@dataclass
class Result:
    """One call: tokens generated (all rows, up to EOS) and the time it took."""

    tokens: int
    seconds: float  # wall clock, without the call's JAX compilation
    cpu_seconds: float  # this process's CPU time (all threads), without the call's JAX compilation
    sequences: list[list[int]]  # per row: generated tokens up to EOS
    accepted: int = 0
    proposed: int = 0
    row_steps: float = 0.0
    first_position: float | None = None  # acceptance rate of the first draft position
    per_position: list[float] | None = None  # acceptance rate per draft position
    steps: int = 0
    draft_steps: int = 0
    compile_seconds: float = 0.0  # JAX compilation inside the call (specjax's stats)
    # per step: drafting, target forwards, the loop's own work (without compilation, as ``seconds``)
    step_ms: tuple[float, float, float] | None = None
    processor_ms: float | None = None  # per step: the logits processors (part of drafting and the loop's work)
    processor_calls: float | None = None  # per step: the logits processors' calls


@dataclass
class Method:
    name: str
    batch_size: int
    temperature: float
    num_draft_tokens: int
    units: list[tuple[Any, Any]]  # the calls: (input_ids, attention_mask)
    call: Callable[[Any, Any, int], Any]  # (ids, mask, unit: index and seed) -> (new i64[B, N], counts, stats)
    results: list[Result] = field(default_factory=list)
    category: str = ""
    drafter: str = ""
    impl: str = ""
    variant: Variant | None = None

    @property
    def key(self) -> tuple:
        return (
            self.category,
            self.name,
            self.drafter,
            self.impl,
            self.variant,
            self.batch_size,
            self.temperature,
            self.num_draft_tokens,
        )

    def run(self, unit: int) -> Result:
        ids, mask = self.units[unit]
        t0, c0 = time.perf_counter(), time.process_time()
        new, counts, stats = self.call(ids, mask, unit)
        res = Result(
            sum(counts),
            time.perf_counter() - t0,
            time.process_time() - c0,
            [row[:n] for row, n in zip(new.tolist(), counts, strict=True)],
        )
        if stats is not None:
            res.accepted, res.proposed = stats.draft_tokens_accepted, stats.draft_tokens_proposed
            res.row_steps = stats.new_tokens / stats.mean_accepted_length if stats.mean_accepted_length else 0.0
            if stats.acceptance_rate_per_position:
                res.first_position = stats.acceptance_rate_per_position[0]
                res.per_position = list(stats.acceptance_rate_per_position)
            res.steps, res.draft_steps = stats.steps, stats.draft_steps
            res.compile_seconds = stats.compile_time_s
            if stats.steps:
                parts = (stats.draft_time_s, stats.target_time_s, stats.loop_time_s)
                res.step_ms = tuple(1e3 * t / stats.steps for t in parts)  # type: ignore[assignment]
                res.processor_ms = 1e3 * stats.processor_time_s / stats.steps
                res.processor_calls = stats.processor_calls / stats.steps
            # one-time work per shape and process (see the module doc)
            res.seconds = max(res.seconds - res.compile_seconds, 1e-9)
            res.cpu_seconds = max(res.cpu_seconds - res.compile_seconds, 1e-9)
        return res


@contextlib.contextmanager
def _packed_setting(value: str | None) -> Iterator[None]:
    """``SPECJAX_PACKED_LINEARS`` set to ``value`` inside (None: as it is), as it was after."""
    from specjax.packed import ENV

    before = os.environ.get(ENV)
    if value is not None:
        os.environ[ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def _hf_call(
    pair: Pair,
    max_new: int,
    temperature: float,
    assistant: Any = None,
    packed: bool = False,
    options: Options = OPTIONS["none"],
    schemas: Sequence[dict] | None = None,
) -> Callable:
    """``target.generate``; with ``packed``, with the target's linear layers packed as specjax's forwards run
    them (:mod:`specjax.packed`, ``SPECJAX_PACKED_LINEARS=all``): what of a speed-up is the packing. With
    ``options``, its processors; with ``schemas`` (one per unit), unit u's output constrained to ``schemas[u]``
    by xgrammar's transformers processor over the grammar specjax compiles (a fresh one a call: it keeps state)."""
    import torch

    from specjax.packed import model_packed

    kwargs: dict[str, Any] = (
        {"do_sample": False}
        if temperature == 0
        else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    kwargs.update(options.at(temperature))
    if assistant is not None:
        kwargs["assistant_model"] = assistant

    def call(ids: Any, mask: Any, unit: int) -> tuple[Any, list[int], None]:
        torch.manual_seed(unit)
        extra = {} if schemas is None else {"logits_processor": [_json_processor(pair, schemas[unit])]}
        packing = model_packed(pair.target) if packed else contextlib.nullcontext()
        with torch.inference_mode(), _packed_setting("all" if packed else None), packing:
            out = pair.target.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                pad_token_id=pair.pad,
                eos_token_id=pair.eos or None,
                **kwargs,
                **extra,
            )
        new = out[:, ids.shape[1] :]
        return new, count_new(new, pair.eos), None

    return call


def _json_processor(pair: Pair, schema: dict) -> Any:
    """xgrammar's transformers logits processor for ``schema``, compiled as ``speculative_generate`` compiles it."""
    from xgrammar.contrib.hf import LogitsProcessor

    from specjax.generate.grammar import compile_grammar, grammar_spec

    spec = grammar_spec(json_schema=schema)
    assert spec is not None
    return LogitsProcessor(compile_grammar(spec, pair.tokenizer, pair.target.config.vocab_size))


def _specjax_call(
    pair: Pair,
    max_new: int,
    temperature: float,
    num_draft_tokens: int,
    drafter: str = "model",
    adaptive: bool = True,
    impl: str = "auto",
    variant: Variant | None = None,
    options: Options = OPTIONS["none"],
    schemas: Sequence[dict] | None = None,
) -> Callable:
    """:func:`specjax.speculative_generate` with ``drafter``; ``options`` and ``schemas`` as in :func:`_hf_call`."""
    from specjax import speculative_generate

    kwargs: dict[str, Any] = dict(options.at(temperature))

    def call(ids: Any, mask: Any, unit: int) -> tuple[Any, list[int], Any]:
        extra = {} if schemas is None else {"json_schema": schemas[unit], "target_tokenizer": pair.tokenizer}
        with _packed_setting(variant.packed if variant is not None else None):
            out = speculative_generate(
                pair.target,
                make_drafter(pair, drafter, variant),
                ids,
                mask,
                max_new_tokens=max_new,
                num_draft_tokens=num_draft_tokens,
                temperature=temperature,
                seed=unit,
                eos_token_id=pair.eos or None,
                pad_token_id=pair.pad,
                adaptive=adaptive,
                impl=impl,
                **kwargs,
                **extra,
            )
        return out.sequences[:, ids.shape[1] :], out.num_new_tokens.tolist(), out.stats

    return call


def _assistant(draft: Any, num_draft_tokens: int | None) -> Any:
    """The draft as transformers' assistant: its defaults, or a fixed draft length."""
    if num_draft_tokens is None:
        return draft
    fixed = copy.copy(draft)  # shares the weights; only the generation config differs
    fixed.generation_config = copy.deepcopy(draft.generation_config)
    fixed.generation_config.num_assistant_tokens = num_draft_tokens
    fixed.generation_config.num_assistant_tokens_schedule = "constant"
    fixed.generation_config.assistant_confidence_threshold = 0.0
    return fixed


# --------------------------------------------------------------------------- #
# The benchmark
# --------------------------------------------------------------------------- #


def _paired_ratio(runs: list[Result], base: list[Result], cpu: bool = False) -> float:
    """Median over calls of (tokens/s of the run) / (tokens/s of the baseline's run of the same call)."""

    def rate(r: Result) -> float:
        return r.tokens / (r.cpu_seconds if cpu else r.seconds)

    return statistics.median(rate(a) / rate(b) for a, b in zip(runs, base, strict=True))


def bench_generate(
    quick: bool,
    *,
    pair: Pair | None = None,
    num_draft_tokens: int = 4,
    max_new_tokens: int | None = None,
    reps: int | None = None,
    target_dir: str | None = None,
    draft_dir: str | None = None,
    synthetic: bool = False,
    log: Callable[[str], None] | None = None,
    drafters: Sequence[str] = ("model",),
    categories: Sequence[str] | None = None,
    temperatures: Sequence[float] | None = None,
    adaptive: bool = True,
    batch_sizes: Sequence[int] = (1, 8),
    impls: Sequence[str] = ("auto",),
    num_prompts: int | None = None,
    variants: Sequence[Variant] = (Variant(),),
    packed_target: bool = False,
    options: str = "none",
    batches: int = 1,
) -> list[dict]:
    """Run every method; one row per method (see the module docstring). ``options``: a key of :data:`OPTIONS`.

    Raises:
      ValueError: ``options`` is unknown, or cannot run on ``categories`` / ``batch_sizes`` or without a
        tokenizer (``json``).
    """
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    if options not in OPTIONS:
        raise ValueError(f"options: expected one of {', '.join(OPTIONS)}, got {options!r}")
    opts = OPTIONS[options]
    problem = options_problem(opts, categories, batch_sizes)
    if problem:
        raise ValueError(problem)
    pair = pair or load_pair(target_dir, draft_dir, synthetic)
    if opts.json and pair.tokenizer is None:
        raise ValueError("--options json: needs a pair with a tokenizer (the JSON schemas compile onto its ids)")
    g = num_draft_tokens
    max_new = max_new_tokens or (32 if quick else 64)
    reps = reps or (2 if quick else 4)
    n_single = num_prompts or (2 if quick else 4)
    temperatures = tuple(temperatures) if temperatures else ((0.0,) if quick else (0.0, 0.7))
    if categories is None:
        categories = ("synthetic",) if pair.tokenizer is None else ("extraction",) if opts.json else ("open",)
    elif pair.tokenizer is None:
        categories = ("synthetic",)

    for v in variants:
        if v.head is not None and v.head not in pair.heads:
            from specjax.drafters.eagle_head import load_head

            pair.heads[v.head] = load_head(v.head)
    # (drafter, kernel code, variant) of each specjax method; the head's settings only for the head's drafters
    specjax_methods = [
        (d, impl, v)
        for d in drafters
        for impl in impls
        for v in (variants if d in ("eagle", "hybrid") else dict.fromkeys(Variant(packed=v.packed) for v in variants))
    ]

    def specjax_group(batch: int, units: list, temp: float, category: str, schemas: list[dict] | None) -> list[Method]:
        """One ``specjax`` method per (drafter, kernel code, variant), on ``units``."""
        return [
            Method(
                "specjax",
                batch,
                temp,
                g,
                units,
                _specjax_call(pair, max_new, temp, g, d, adaptive, impl, v, opts, schemas),
                category=category,
                drafter=d,
                impl=impl,
                variant=v,
            )
            for d, impl, v in specjax_methods
        ]

    def packed_target_method(batch: int, units: list, temp: float, category: str, schemas: list | None) -> Method:
        call = _hf_call(pair, max_new, temp, packed=True, options=opts, schemas=schemas)
        return Method("target-packed", batch, temp, 0, units, call, category=category)

    groups: list[list[Method]] = []  # methods timed against each other on the same calls
    for category in categories:
        prompts = category_prompts(pair, category)
        singles = [(p, None) for p in prompts[:n_single]]
        schemas = category_schemas(category)[:n_single] if opts.json else None  # per unit of singles
        batch8 = [left_pad(rows, pair.pad) for rows in batches_of_eight(prompts, batches)]

        def hf(temp: float, assistant: Any = None, units_schemas: list | None = schemas) -> Callable:
            return _hf_call(pair, max_new, temp, assistant, options=opts, schemas=units_schemas)

        for temp in temperatures:
            if 1 in batch_sizes:
                one = [Method("target", 1, temp, 0, singles, hf(temp), category=category)]
                if packed_target:
                    one.append(packed_target_method(1, singles, temp, category, schemas))
                # (not under a JSON schema: xgrammar's processor keeps state that rejected candidates corrupt)
                if temp == 0.0 and "model" in drafters and not opts.json:
                    one.append(
                        Method(
                            "assisted",
                            1,
                            temp,
                            0,
                            singles,
                            hf(temp, _assistant(pair.draft, None)),
                            category=category,
                        )
                    )
                    if not quick:
                        one.append(
                            Method(
                                "assisted-G",
                                1,
                                temp,
                                g,
                                singles,
                                hf(temp, _assistant(pair.draft, g)),
                                category=category,
                            )
                        )
                        # the same fixed G on specjax's side: loop against loop, no schedule in either
                        one.append(
                            Method(
                                "specjax-G",
                                1,
                                temp,
                                g,
                                singles,
                                _specjax_call(
                                    pair, max_new, temp, g, "model", adaptive=False, options=opts, schemas=schemas
                                ),
                                category=category,
                                drafter="model",
                            )
                        )
                one += specjax_group(1, singles, temp, category, schemas)
                if temp == 0.0 and not quick and "model" in drafters:  # transformers' default drafts up to 20
                    one.append(
                        Method(
                            "specjax",
                            1,
                            temp,
                            2 * g,
                            singles,
                            _specjax_call(pair, max_new, temp, 2 * g, "model", adaptive, options=opts, schemas=schemas),
                            category=category,
                            drafter="model",
                        )
                    )
                groups.append(one)
            if 8 in batch_sizes:
                eight = [Method("target", 8, temp, 0, batch8, hf(temp, units_schemas=None), category=category)]
                if packed_target:
                    eight.append(packed_target_method(8, batch8, temp, category, None))
                eight += specjax_group(8, batch8, temp, category, None)
                groups.append(eight)

    say(
        f"pair: {pair.name}; options {opts.name}; G={g}, max_new_tokens={max_new}, {n_single} prompts at B=1, "
        f"8 at B=8 ({batches} batch{'es' if batches > 1 else ''}), "
        f"{reps} repetitions; load average {os.getloadavg()[0]:.1f}"
    )
    t0 = time.perf_counter()
    for group in groups:  # warm-up: the same calls as timed below, again while they compile
        for m in group:
            for u in range(len(m.units)):
                for _ in range(WARMUP_CALLS):
                    if m.run(u).compile_seconds == 0.0:
                        break
    say(f"warm-up done in {time.perf_counter() - t0:.0f} s")
    # Call by call, every method of a group back to back (rotating the order), so
    # that the shared machine's changing load hits the methods of a pair alike.
    for rep in range(reps):
        for group in groups:
            for u in range(len(group[0].units)):
                shift = (rep + u) % len(group)
                for m in group[shift:] + group[:shift]:
                    m.results.append(m.run(u))
        say(f"repetition {rep + 1}/{reps} done; load average {os.getloadavg()[0]:.1f}")

    rows = []
    for group in groups:
        base = group[0]
        assisted = next((m for m in group if m.name == "assisted"), None)
        target_packed = next((m for m in group if m.name == "target-packed"), None)
        for m in group:
            runs = m.results
            tokens = sum(r.tokens for r in runs)
            row_steps = sum(r.row_steps for r in runs)
            proposed = sum(r.proposed for r in runs)
            processor_ms = [r.processor_ms for r in runs if r.processor_ms is not None]
            processor_calls = [r.processor_calls for r in runs if r.processor_calls is not None]
            same = None
            if m.temperature == 0.0 and m is not base:
                same = all(a.sequences == b.sequences for a, b in zip(runs, base.results, strict=True))
            row = {
                "section": "generate",
                "model_pair": pair.name,
                "method": m.name,
                "num_draft_tokens": m.num_draft_tokens,
                "temperature": m.temperature,
                "batch_size": m.batch_size,
                "tokens_per_s": tokens / sum(r.seconds for r in runs),
                "mean_accepted_length": tokens / row_steps if row_steps else None,
                "acceptance_rate": sum(r.accepted for r in runs) / proposed if proposed else None,
                "acceptance_first_position": (
                    statistics.mean(r.first_position for r in runs)
                    if runs and all(r.first_position is not None for r in runs)
                    else None
                ),
                "acceptance_per_position": (
                    [round(statistics.mean(v), 3) for v in zip(*(r.per_position for r in runs), strict=True)]
                    if runs and all(r.per_position for r in runs)
                    else None
                ),
                "step_ms": (
                    [round(statistics.median(v), 2) for v in zip(*(r.step_ms for r in runs), strict=True)]
                    if runs and all(r.step_ms for r in runs)
                    else None
                ),
                "processor_step_ms": (
                    round(statistics.median(processor_ms), 3) if runs and len(processor_ms) == len(runs) else None
                ),
                "processor_step_calls": (
                    round(statistics.median(processor_calls), 1) if runs and len(processor_calls) == len(runs) else None
                ),
                "options": opts.name,
                "draft_step_fraction": (
                    sum(r.draft_steps for r in runs) / sum(r.steps for r in runs)
                    if m.name.startswith("specjax") and sum(r.steps for r in runs)
                    else None
                ),
                "category": m.category,
                "drafter": m.drafter or None,
                "adaptive": {"specjax": adaptive, "specjax-G": False}.get(m.name),
                "impl": m.impl or None,
                "variant": (m.variant.label or None) if m.variant else None,
                "compile_s": sum(r.compile_seconds for r in runs),
                "times_exclude_compile": True,
                "speedup": _paired_ratio(runs, base.results),
                "speedup_cpu_time": _paired_ratio(runs, base.results, cpu=True),
                "same_as_target": same,
                "new_tokens": tokens // reps,
                "max_new_tokens": max_new,
                "reps": reps,
                "calls": len(runs),
            }
            if m.name.startswith("specjax") and assisted is not None:
                row["speedup_vs_assisted"] = _paired_ratio(runs, assisted.results)
            if m.name.startswith("specjax") and target_packed is not None:
                row["speedup_vs_target_packed"] = _paired_ratio(runs, target_packed.results)
            rows.append(row)
    return rows


def _drafter_label(row: dict) -> str:
    """The row's drafter, with its variant (``--heads``, ``--context-tokens``, ``--packed``) where set."""
    variant = f" [{row['variant']}]" if row.get("variant") else ""
    return f"{row.get('drafter') or ''}{variant}"


def format_table(rows: list[dict]) -> str:
    lines = [
        "| prompts | method | drafter | B | T | G | tokens/s | speed-up vs target | (by CPU time) | acceptance "
        "| mean accepted length | steps drafting | same output |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        acc = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mal = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        same = "" if r["same_as_target"] is None else ("yes" if r["same_as_target"] else "NO")
        frac = "" if r.get("draft_step_fraction") is None else f"{r['draft_step_fraction']:.2f}"
        g = r["num_draft_tokens"] or ""
        impl = f" impl={r['impl']}" if r.get("impl") not in (None, "auto") else ""
        options = f", {r['options']}" if r.get("options") not in (None, "none") else ""
        lines.append(
            f"| {r.get('category', '')}{options} | {r['method']}{impl} "
            f"| {_drafter_label(r)} | {r['batch_size']} | "
            f"{r['temperature']} | {g} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
            f"{r['speedup_cpu_time']:.2f}x | {acc} | {mal} | {frac} | {same} |"
        )
    extra = [
        f"{r['method']} B=1 T={r['temperature']} G={r['num_draft_tokens']}: {r['speedup_vs_assisted']:.2f}x "
        "transformers' assisted generation (median of the per-call ratios)"
        for r in rows
        if "speedup_vs_assisted" in r
    ]
    extra += [
        f"{r.get('category', '')} specjax[{_drafter_label(r)}] B={r['batch_size']} T={r['temperature']}: "
        f"{r['speedup_vs_target_packed']:.2f}x target-packed (generate with the layers packed as specjax runs them)"
        for r in rows
        if "speedup_vs_target_packed" in r
    ]
    extra += [
        f"{r.get('category', '')} {r['method']}[{_drafter_label(r)}] B={r['batch_size']} T={r['temperature']} "
        f"G={r['num_draft_tokens']}: per step (medians of calls) drafting {r['step_ms'][0]:.2f} ms, target "
        f"{r['step_ms'][1]:.2f} ms, the loop's own work {r['step_ms'][2]:.2f} ms"
        + (
            f"; the processors ({r['options']}) {r['processor_step_ms']:.2f} ms of drafting and the loop's work"
            + (f" in {r['processor_step_calls']:.1f} calls" if r.get("processor_step_calls") is not None else "")
            if r.get("options") not in (None, "none") and r.get("processor_step_ms") is not None
            else ""
        )
        for r in rows
        if r.get("step_ms") is not None
    ]
    extra += [
        f"{r.get('category', '')} specjax[{_drafter_label(r)}] B={r['batch_size']} T={r['temperature']} "
        f"G={r['num_draft_tokens']}: acceptance per draft position {r['acceptance_per_position']}"
        for r in rows
        if r.get("acceptance_per_position") is not None
    ]
    return "\n".join([*lines, "", *extra])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repetitions")
    parser.add_argument(
        "--prompts",
        type=int,
        metavar="N",
        help="prompts per category timed at B = 1 (default 4, --quick 2; a category has 6: more takes them all)",
    )
    parser.add_argument("--jsonl", metavar="PATH", help="append one JSON row per method to PATH")
    parser.add_argument("--target", help="target model directory (default: the embedded pair, else synthetic)")
    parser.add_argument("--draft", help="draft model directory (with --target)")
    parser.add_argument("--synthetic", action="store_true", help="use the synthetic pair")
    parser.add_argument("--num-draft-tokens", type=int, default=4, metavar="G")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument(
        "--drafter",
        default="model",
        help="comma-separated drafters: model, ngram, eagle, hybrid (n-gram, else the EAGLE head), hybrid-model",
    )
    parser.add_argument(
        "--categories",
        help="comma-separated prompt sets: open, grounded, extraction (default: open; --options json: extraction)",
    )
    parser.add_argument(
        "--options",
        default="none",
        choices=list(OPTIONS),
        help="logits processors on every side: penalty-minp (repetition_penalty=1.1, min_p=0.05 at T > 0), "
        "json (each extraction prompt's JSON schema; B = 1) (default: none)",
    )
    parser.add_argument("--temperatures", help="comma-separated temperatures (default: 0 and 0.7; --quick: 0)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes among 1 and 8")
    parser.add_argument(
        "--batches",
        type=int,
        default=1,
        metavar="N",
        help="B = 8 calls per repetition: N batches, batch i the category's prompts from its i-th on (default 1)",
    )
    parser.add_argument("--fixed", action="store_true", help="draft G tokens every step (no adaptive length)")
    parser.add_argument(
        "--impls", default="auto", help="comma-separated kernel code for specjax: auto, xla, cpu (each a method)"
    )
    parser.add_argument(
        "--heads",
        help="comma-separated EAGLE head directories for the eagle and hybrid drafters, a method each "
        "(default: the pair's head)",
    )
    parser.add_argument(
        "--context-tokens",
        help="comma-separated counts of context tokens the EAGLE head scores beside its own "
        "(EagleDrafter's context_tokens), a method each (default: the drafter's default)",
    )
    parser.add_argument(
        "--packed",
        help="comma-separated settings of SPECJAX_PACKED_LINEARS (all, head, 0: which of the models' linear "
        "layers specjax's forwards run packed for oneDNN), a method each (default: as the environment says)",
    )
    parser.add_argument(
        "--packed-target",
        action="store_true",
        help="also time target.generate with the target's linear layers packed as specjax's forwards run them "
        "(method target-packed; specjax's ratio to it is printed): the part of a speed-up that is the packing",
    )
    jax_threads.add_argument(parser)
    args = parser.parse_args(argv)
    pool = jax_threads.apply(args)
    if args.draft and not args.target:
        parser.error("--draft needs --target")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    print(
        f"torch threads: {torch.get_num_threads()}, cpus: {os.cpu_count()}, "
        f"load average: {os.getloadavg()[0]:.1f}; {pool}",
        file=sys.stderr,
    )
    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    from specjax.pair import PAIR_DRAFTERS as DRAFTERS

    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or not drafters:
        parser.error(f"--drafter: expected names among {', '.join(DRAFTERS)}, got {args.drafter!r}")
    from specjax.prompts import all_prompts

    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    if categories and any(c not in all_prompts() for c in categories):
        parser.error(f"--categories: expected names among {', '.join(all_prompts())}, got {args.categories!r}")
    if args.prompts is not None and args.prompts < 1:
        parser.error(f"--prompts: expected an integer >= 1, got {args.prompts}")
    try:
        temps = [float(t) for t in args.temperatures.split(",")] if args.temperatures else None
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error("--temperatures / --batch-sizes: expected comma-separated numbers")
    if any(b not in (1, 8) for b in sizes):
        parser.error(f"--batch-sizes: expected 1 and/or 8, got {args.batch_sizes!r}")
    if args.batches < 1:
        parser.error(f"--batches: expected an integer >= 1, got {args.batches}")
    problem = options_problem(OPTIONS[args.options], categories, sizes)
    if problem:
        parser.error(problem)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if not impls or any(i not in ("auto", "xla", "cpu") for i in impls):
        parser.error(f"--impls: expected names among auto, xla, cpu, got {args.impls!r}")
    heads: list[str | None] = [None]
    if args.heads:
        heads = [h.strip() for h in args.heads.split(",") if h.strip()]
        missing = [h for h in heads if not os.path.isdir(h)]
        if not heads or missing:
            parser.error(f"--heads: expected head directories, got {args.heads!r} (not a directory: {missing})")
    packings: list[str | None] = [None]
    if args.packed:
        from specjax.packed import MODES

        packings = [p.strip() for p in args.packed.split(",")]
        if any(p not in MODES for p in packings):
            parser.error(f"--packed: expected comma-separated settings among {', '.join(MODES)}, got {args.packed!r}")
    contexts: list[int | None] = [None]
    if args.context_tokens:
        try:
            contexts = [int(c) for c in args.context_tokens.split(",")]
        except ValueError:
            contexts = [-1]
        if any(c < 0 for c in contexts):
            parser.error(f"--context-tokens: expected comma-separated integers >= 0, got {args.context_tokens!r}")
    if (args.heads or args.context_tokens) and not {"eagle", "hybrid"} & set(drafters):
        parser.error("--heads / --context-tokens: they set the eagle and hybrid drafters; --drafter names neither")
    rows = bench_generate(
        args.quick,
        num_draft_tokens=args.num_draft_tokens,
        max_new_tokens=args.max_new_tokens,
        reps=args.reps,
        target_dir=args.target,
        draft_dir=args.draft,
        synthetic=args.synthetic,
        drafters=drafters,
        categories=categories,
        temperatures=temps,
        adaptive=not args.fixed,
        batch_sizes=sizes,
        impls=impls,
        num_prompts=args.prompts,
        variants=[Variant(h, c, m) for h in heads for c in contexts for m in packings],
        packed_target=args.packed_target,
        options=args.options,
        batches=args.batches,
    )
    print(f"model pair: {rows[0]['model_pair']}")
    print(format_table(rows))
    if args.jsonl:
        append_jsonl(args.jsonl, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
