"""The speculative generation loop over Hugging Face models (see :mod:`.loop`)."""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
import torch

from specjax.drafters import HybridDrafter, ModelDrafter, claim_drafter, resolve_drafter
from specjax.drafters.base import SamplingState
from specjax.generate import checks
from specjax.generate.compile_time import measure_compiles
from specjax.generate.grammar import GrammarRows, compile_grammar, grammar_spec
from specjax.generate.jax_loop import check_jax_call, host_ids, run_jax_loop
from specjax.generate.loop import LoopConfig, LoopState, SpeculativeOutput, SpeculativeStats, run_loop
from specjax.generate.outputs import Outputs
from specjax.generate.processors import LoopProcessors, build_processors
from specjax.generate.stopping import check_stopping_criteria, stop_string_criterion
from specjax.registry import load_sampler

__all__ = ["LoopState", "SpeculativeOutput", "SpeculativeStats", "check_pair", "check_seed", "speculative_generate"]

# Vocabulary sizes may differ by padding only: the larger may exceed the smaller by at
# most this many ids (padding to a multiple of 128 adds at most 127), or by this fraction
# of the larger when that is more (151936 vs 151665 for Qwen2.5 7B and 0.5B).
_MAX_VOCAB_PADDING_IDS = 127
_MAX_VOCAB_PADDING = 0.01


def _vocab_size(model: Any) -> int:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.vocab_size)


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def check_pair(target: Any, draft: Any, target_tokenizer: Any = None, draft_tokenizer: Any = None) -> None:
    """Raise ``ValueError`` unless target and draft can share token ids.

    Checks the devices, the vocabulary sizes (equal up to padding), the special
    token ids both configs define, and, when tokenizers are given, that the
    vocabularies map the same strings to the same ids.
    """
    dt, dd = _device(target), _device(draft)
    if dt != dd:
        raise ValueError(f"draft: expected the target's device {dt}, got {dd} (move both models to one device)")
    vt, vd = _vocab_size(target), _vocab_size(draft)
    if abs(vt - vd) > max(_MAX_VOCAB_PADDING_IDS, _MAX_VOCAB_PADDING * max(vt, vd)):
        raise ValueError(
            f"draft: the target's vocabulary has {vt} entries and the draft's {vd}; they differ by more than "
            "padding, so the models do not share a tokenizer (use a draft trained with the target's tokenizer)"
        )
    for attr in ("bos_token_id", "eos_token_id"):
        a = _config_ids(getattr(target.config, attr, None))
        b = _config_ids(getattr(draft.config, attr, None))
        if a and b and not (a & b):
            raise ValueError(
                f"draft: target {attr} = {sorted(a)} but draft {attr} = {sorted(b)}: the models do not share a "
                "tokenizer"
            )
    if target_tokenizer is not None and draft_tokenizer is not None:
        tv, dv = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        common = min(len(tv), len(dv))
        t_inv = {i: s for s, i in tv.items() if i < common}
        d_inv = {i: s for s, i in dv.items() if i < common}
        if t_inv != d_inv:
            diff = sum(1 for i in t_inv if t_inv.get(i) != d_inv.get(i))
            raise ValueError(
                f"draft_tokenizer: {diff} of the first {common} token ids map to different strings than in the "
                "target's tokenizer; speculative decoding needs one shared tokenizer"
            )


def _config_ids(v: Any) -> set[int]:
    """Token ids a model config lists (as given; configs are not user input)."""
    if v is None:
        return set()
    return {int(x) for x in (v if isinstance(v, list | tuple | set) else [v])}


def _input_vocab_size(model: Any) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is not None and getattr(emb, "weight", None) is not None:
        return int(emb.weight.shape[0])
    return _vocab_size(model)


def _token_id(name: str, value: Any) -> int:
    """One token id: an integer >= 0 (a bool, a float or a string is refused, not converted).

    A 0-d torch tensor or NumPy array of integers counts as its integer.
    """
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        value = value.item()  # a float or bool tensor gives a float or bool: refused below
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name}: expected token ids (integers >= 0), got {value!r}")
    return int(value)


def _as_id_set(name: str, v: Any) -> set[int]:
    if v is None:
        return set()
    if isinstance(v, torch.Tensor | np.ndarray):
        v = v.flatten().tolist()  # Python numbers: a float or bool id is refused below
    if isinstance(v, list | tuple | set):
        return {_token_id(name, x) for x in v}
    return {_token_id(name, v)}


# jax.random.key takes a signed 64-bit seed.
_SEED_RANGE = (-(2**63), 2**63 - 1)


def check_seed(seed: Any) -> int:
    """The seed as an int, or a ValueError naming ``seed``."""
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not (_SEED_RANGE[0] <= int(seed) <= _SEED_RANGE[1])
    ):
        raise ValueError(f"seed: expected an integer in [-2**63, 2**63 - 1], got {seed!r}")
    return int(seed)


# key[B]: one key per row, ``fold_in(base, b)``; jitted, so that a call makes them in one dispatch
_row_keys = jax.jit(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))


def speculative_generate(
    target: Any,
    draft: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    temperature: float | Any = 0.0,
    top_k: int | Any | None = None,
    top_p: float | Any | None = None,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    sampler: str | Any = "jax",
    target_tokenizer: Any = None,
    draft_tokenizer: Any = None,
    on_tokens: Any = None,
    return_state: bool = False,
    adaptive: bool = True,
    impl: str = "auto",
    stop_strings: str | list[str] | None = None,
    stopping_criteria: Any = None,
    output_scores: bool = False,
    output_logits: bool = False,
    output_logprobs: bool = False,
    logits_processor: Any = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    bad_words_ids: list[list[int]] | None = None,
    min_new_tokens: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | list[int] | None = None,
    suppress_tokens: list[int] | None = None,
    begin_suppress_tokens: list[int] | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    epsilon_cutoff: float | None = None,
    eta_cutoff: float | None = None,
    json_schema: Any = None,
    regex: str | None = None,
) -> SpeculativeOutput:
    """Generate with the target's distribution, drafting with a smaller model or another drafter.

    Args:
      target: a transformers causal LM (``AutoModelForCausalLM``), in eval mode.
      draft: what proposes draft tokens: a causal LM sharing the target's
        tokenizer, on the same device (the ``model`` drafter; vocabulary sizes
        may differ by padding: ids beyond the draft's vocabulary get draft
        probability 0); a drafter object (:mod:`specjax.drafters`, e.g.
        ``HybridDrafter``); or a registered drafter name such as ``"ngram"``
        (:func:`specjax.drafters.available_drafters`).
      input_ids: i64[B, P] prompts, left-padded when their lengths differ.
      attention_mask: i64/bool[B, P], 1 for real tokens; required when padded.
      max_new_tokens: tokens to generate per row at most (>= 1).
      num_draft_tokens: G, the most draft tokens proposed per step (1 to
        :data:`~specjax.generate.checks.MAX_DRAFT_TOKENS` = 128). A row drafts
        at most ``max_new_tokens - 1`` tokens a step, so G is cut to that
        (the per-position statistics then have that many entries).
      temperature: scalar or f32[B]; 0 = greedy (the default).
      top_k: None, scalar or i32[B] (0 = off); top_p: None, scalar or f32[B] in (0, 1].
      seed: seeds the per-row JAX keys (row b's draws depend on seed and b only).
      eos_token_id: an id or several (a list, tuple or set, a torch tensor or a
        NumPy array of integers) that end a row (defaults to the target's
        generation config).
      pad_token_id: fills rows after they end (defaults to the target's, then EOS).
      sampler: "jax" (the fused kernel), or the name of an installed sampler
        (:func:`specjax.load_sampler`), or a callable with the
        :func:`specjax.rejection_sample` contract.
      target_tokenizer, draft_tokenizer: optional; when both are given their
        vocabularies are compared.
      on_tokens: optional callback ``on_tokens(row, token_ids)`` called as tokens
        are committed (for streaming).
      return_state: keep the loop's final caches in ``output.state`` (a
        :class:`LoopState`; for tests and debugging — it holds both KV caches).
      adaptive: choose each step's draft length from measured costs and each
        row's acceptance, down to 0 (a plain decoding step) when drafting does
        not pay (:mod:`specjax.generate.schedule`); False drafts G tokens every
        step (fewer only near ``max_new_tokens``). Outputs follow the target's
        distribution either way; greedy outputs are identical. Sampled outputs
        are reproducible from ``seed`` with ``adaptive=False``; with True the
        schedule's choices come from measured times, so two runs may draw
        differently (each still exactly from the target's distribution).
      impl: the kernels' code on a CPU: ``"auto"`` (the C++ CPU kernels where
        available), ``"xla"`` (the JAX code) or ``"cpu"`` (the kernels, else a
        ValueError); as :func:`specjax.verify_from_logits`. The draft's draw and
        the acceptance test use the same one, so ``q`` is the same bits in both.
      stop_strings: a string or a list of strings that end a row once generated
        (needs ``target_tokenizer``): transformers' ``StopStringCriteria``, so a
        row ends where ``generate(stop_strings=...)`` ends it, the token that
        completes the string included.
      stopping_criteria: a transformers ``StoppingCriteria`` or
        ``StoppingCriteriaList``, or a list of callables ``(input_ids, scores)
        -> bool[R]``, asked after every generated token as ``generate`` asks
        them (:mod:`specjax.generate.stopping`: ``input_ids`` is i64[R, P + t],
        the prompts as passed followed by the t tokens so far, ``scores`` is
        None); a row ends at the first token where one returns True. Criteria
        must answer row by row.
      output_scores: return ``output.scores``, per generated position one
        f32[B, V] tensor of processed scores (temperature, top-k and top-p
        applied, as ``generate(output_scores=True)``).
      output_logits: return ``output.logits``, the same with the raw logits.
      output_logprobs: return ``output.logprobs``, f32[B, new], each token's
        log-probability under its processed scores.
      logits_processor: None, or a transformers ``LogitsProcessorList`` (or a
        list) of processors ``(input_ids, scores) -> scores``, or row
        processors (:mod:`specjax.generate.processors`). They run, as in
        ``generate``, before temperature / top-k / top-p, on the target's
        logits at every draft position (and a model drafter's as it draws),
        each with the prefix that position sees: outputs follow the processed
        target's distribution exactly; greedy outputs equal ``generate``'s
        with the same processors.
      repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_new_tokens,
        forced_bos_token_id, forced_eos_token_id, suppress_tokens,
        begin_suppress_tokens: ``generate``'s options of these names, built
        into transformers' processors as ``generate`` builds them (before
        ``logits_processor``'s, which replace a built one of the same type).
        ``min_new_tokens`` needs an EOS id; without one it does nothing, as in
        ``generate``.
      min_p, typical_p, epsilon_cutoff, eta_cutoff: ``generate``'s sampling
        filters, applied as transformers applies them: after temperature /
        top-k / top-p (which then take one value for the batch), only when
        sampling (greedy ignores them, as ``generate(do_sample=False)``).
      json_schema: constrain every row's output to JSON that the schema
        accepts (a dict, JSON text or a pydantic model class), written compactly
        (``", "`` and ``": "`` between items); regex: to a string the regular
        expression matches whole. At most one of the two; both need
        ``target_tokenizer`` and an EOS id (a row ends when its output is
        complete). The grammar is a row processor after the other processors
        (before the sampling filters), so each draft position is masked with
        the grammar's state after the tokens before it (exact;
        :mod:`specjax.generate.grammar`). Needs xgrammar (``pip install
        'specjax[grammar]'``). A row cut short by ``max_new_tokens`` ends with
        an incomplete (but valid-so-far) output.

    Returns:
      :class:`SpeculativeOutput` with ``sequences`` i64[B, P + new] and ``stats``
      (and ``scores`` / ``logits`` / ``logprobs`` when asked for).

    Raises:
      TypeError: ``target`` or ``draft`` is not a torch module with parameters;
        ``stopping_criteria`` is not a criterion or a list of them; an
        ``output_*`` flag is not a bool.
      ValueError: for models that do not share a tokenizer or a device, a padded
        batch without ``attention_mask``, a row that is all padding,
        ``max_new_tokens < 1``, a longest prompt plus ``max_new_tokens`` beyond a
        model's position limit (refused before any forward pass), a model with
        chunked-attention layers (sliding windows are exact at any length),
        ``num_draft_tokens`` outside [1, 128], an unknown sampler or bad sampling
        parameters, ``stop_strings`` empty or without ``target_tokenizer``.
      specjax.generate.checks.PluginOutputError: a ``ValueError``: a sampler
        returned a result outside its contract (wrong shape or dtype,
        ``num_accepted`` outside [0, k_b], a token outside [0, V)); the message
        names the sampler.
    """
    t_start = time.perf_counter()  # the call's wall time includes its checks and setup
    checks.check_model("target", target)
    drafter = resolve_drafter(draft)
    draft_models = _draft_models(drafter)  # the models inside the drafter (the model and hybrid drafters)
    for m in draft_models:
        checks.check_model("draft", m)
    if _device(target).type == "cuda":
        _share_gpu_with_torch()

    from specjax.boundary.validation import prepare_params

    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        shape = tuple(input_ids.shape) if hasattr(input_ids, "shape") else type(input_ids).__name__
        raise ValueError(f"input_ids: expected a torch tensor of shape (B, P), got {shape}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids: expected integer token ids, got {input_ids.dtype}")
    batch, prompt_len = input_ids.shape
    seed = check_seed(seed)
    if batch < 1 or prompt_len < 1:
        raise ValueError(f"input_ids: expected at least one row and one token, got shape {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    num_draft_tokens = checks.check_num_draft_tokens(num_draft_tokens, int(max_new_tokens))
    for m in draft_models:
        check_pair(target, m, target_tokenizer, draft_tokenizer)
    device = _device(target)
    on_jax = device.type == "jax"  # torchax: the JAX path (specjax.generate.jax_loop), host ids in
    if on_jax:
        input_ids = host_ids("input_ids", input_ids)
        attention_mask = None if attention_mask is None else host_ids("attention_mask", attention_mask)
    elif input_ids.device != device:
        raise ValueError(f"input_ids: expected the models' device {device}, got {input_ids.device}")

    gen_cfg = getattr(target, "generation_config", None)
    if eos_token_id is None and gen_cfg is not None:
        eos_token_id = gen_cfg.eos_token_id
    eos_ids = _as_id_set("eos_token_id", eos_token_id)
    if pad_token_id is None and gen_cfg is not None:
        pad_token_id = gen_cfg.pad_token_id
    if pad_token_id is None:
        pad_token_id = min(eos_ids) if eos_ids else 0
    pad_token_id = _token_id("pad_token_id", pad_token_id)

    if attention_mask is None:
        if (
            batch > 1
            and pad_token_id is not None
            and bool((input_ids[:, 0] == pad_token_id).any())
            and not bool((input_ids == pad_token_id).all())
        ):
            raise ValueError(
                "attention_mask: the batch looks left-padded (pad_token_id in the first column) but no "
                "attention_mask was given; pass the tokenizer's attention_mask"
            )
        attention_mask = torch.ones_like(input_ids)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape):
            shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
            raise ValueError(f"attention_mask: expected shape {tuple(input_ids.shape)} like input_ids, got {shape}")
        attention_mask = attention_mask.to("cpu" if on_jax else device)
        checks.check_all_rows_have_tokens(attention_mask)
        if not bool(attention_mask[:, -1].bool().all()):
            raise ValueError(
                "attention_mask: expected left padding (every row's last token real); got a row whose last "
                "position is padding — tokenize with padding_side='left'"
            )
    input_ids = input_ids.long()

    target_vocab = _vocab_size(target)
    # Ids outside the embeddings would fail deep inside torch (IndexError): check here.
    vocab_limit = min(_input_vocab_size(m) for m in (target, *draft_models))
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_limit:
        raise ValueError(
            f"input_ids: expected token ids in [0, {vocab_limit}) (the models' vocabulary), got values in [{lo}, {hi}]"
        )
    longest = int(attention_mask.bool().sum(dim=1).max())  # positions count real tokens only
    checks.check_position_limit("target", target, longest, int(max_new_tokens))
    for m in draft_models:
        checks.check_position_limit("draft", m, longest, int(max_new_tokens))
    checks.check_cache_layout("target", target)
    for m in draft_models:
        checks.check_cache_layout("draft", m)

    options = dict(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        bad_words_ids=bad_words_ids,
        min_new_tokens=min_new_tokens,
        forced_bos_token_id=forced_bos_token_id,
        forced_eos_token_id=forced_eos_token_id,
        suppress_tokens=suppress_tokens,
        begin_suppress_tokens=begin_suppress_tokens,
        min_p=min_p,
        typical_p=typical_p,
        epsilon_cutoff=epsilon_cutoff,
        eta_cutoff=eta_cutoff,
    )
    grammar = _grammar_rows(json_schema, regex, target_tokenizer, eos_ids, batch, target_vocab)
    processors = None
    if logits_processor is not None or any(v is not None for v in options.values()) or grammar is not None:
        prepare_params(temperature, top_k, top_p, batch, True, impl)  # the caller's values, checked first
        chain, (temperature, top_k, top_p) = build_processors(
            logits_processor,
            options,
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=int(max_new_tokens),
            eos_ids=eos_ids,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            constraint=grammar,
        )
        if chain:
            processors = LoopProcessors(
                chain,
                input_ids,
                max_new_tokens=int(max_new_tokens),
                max_draft=int(num_draft_tokens),
                vocab=target_vocab,
                pad_token_id=pad_token_id,
            )

    sampler_fn = _resolve_sampler(sampler)
    with measure_compiles() as setup_compiles:  # a first call compiles these
        params = prepare_params(temperature, top_k, top_p, batch, True, impl)
        base = jax.random.key(seed)
        sampling = SamplingState(  # on the device once, for every step's jitted calls
            jax.device_put(params),
            _row_keys(base, np.arange(batch, dtype=np.int32)),
        )
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive: expected True or False, got {type(adaptive).__name__}")
    for name, flag in (
        ("output_scores", output_scores),
        ("output_logits", output_logits),
        ("output_logprobs", output_logprobs),
    ):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {type(flag).__name__}")
    criteria = check_stopping_criteria(stopping_criteria)
    stop_string = stop_string_criterion(stop_strings, target_tokenizer)
    if stop_string is not None:
        criteria.append(stop_string)

    target.eval()
    for m in draft_models:
        m.eval()
    if on_jax:
        check_jax_call(
            sampler_fn,
            return_state,
            json_schema=json_schema,
            regex=regex,
            logits_processor=processors,
            stop_strings=stop_strings,
            stopping_criteria=stopping_criteria,
            output_scores=output_scores,
            output_logits=output_logits,
            output_logprobs=output_logprobs,
        )
    config = LoopConfig(
        max_new_tokens=int(max_new_tokens),
        num_draft_tokens=int(num_draft_tokens),
        eos_ids=frozenset(eos_ids),
        pad_token_id=int(pad_token_id),
        target_vocab=target_vocab,
        sampler=sampler_fn,
        adaptive=adaptive,
        on_tokens=on_tokens,
        return_state=return_state,
        stopping_criteria=tuple(criteria),
        outputs=Outputs(output_scores, output_logits, output_logprobs),
    )
    started = (t_start, setup_compiles.seconds)
    # one call's state per drafter object: a drafter another call is using is forked
    with claim_drafter(drafter) as drafter:
        if on_jax:
            return run_jax_loop(target, drafter, input_ids, attention_mask, sampling, config, started=started)
        return run_loop(
            target,
            drafter,
            input_ids,
            attention_mask,
            sampling,
            config,
            started=started,
            processors=processors,
            grammar=grammar,
        )


def _grammar_rows(
    json_schema: Any, regex: Any, tokenizer: Any, eos_ids: set[int], batch: int, vocab: int
) -> GrammarRows | None:
    """The call's grammar matchers (None without ``json_schema`` / ``regex``), or a ValueError."""
    spec = grammar_spec(json_schema, regex)
    if spec is None:
        return None
    if not eos_ids:
        raise ValueError(
            f"eos_token_id: {spec.kind} needs an EOS token id to end a complete output; pass eos_token_id=... "
            "(or set the target's generation_config.eos_token_id)"
        )
    encode = getattr(tokenizer, "encode", None)
    return GrammarRows(
        compile_grammar(spec, tokenizer, vocab),
        batch,
        sorted(eos_ids),
        vocab,
        spec.kind,
        None if encode is None else functools.partial(encode, add_special_tokens=False),
    )


def _draft_models(drafter: Any) -> list[Any]:
    """The transformers models a built-in drafter runs (checked against the target like a draft model)."""
    if isinstance(drafter, ModelDrafter):
        return [drafter.model]
    if isinstance(drafter, HybridDrafter):
        return _draft_models(drafter.fallback)
    return []


def _share_gpu_with_torch() -> None:
    """Keep JAX from preallocating the GPU beside torch (see configure_jax_memory).

    If JAX already started with other settings this can no longer take effect:
    warn once and go on (the caller chose JAX's memory policy then).
    """
    import logging

    from specjax.adapters import configure_jax_memory

    try:
        configure_jax_memory()
    except RuntimeError as err:
        logging.getLogger("specjax.generate").warning("%s", err)


def _resolve_sampler(sampler: str | Any) -> Any:
    """None for the fused JAX path, else a rejection_sample-contract callable whose output is checked."""
    if callable(sampler):
        return checks.checked_sampler(sampler, checks.plugin_name("sampler", sampler))
    if not isinstance(sampler, str):
        raise ValueError(f"sampler: expected a sampler name or a callable, got {type(sampler).__name__}")
    if sampler == "jax":
        return None
    return checks.checked_sampler(load_sampler(sampler), checks.plugin_name("sampler", None, sampler))
