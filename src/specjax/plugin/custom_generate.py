"""The ``generate(custom_generate=speculative_decoding)`` drop-in: specjax's loop inside transformers' ``generate``.

``target.generate(input_ids, assistant_model=draft,
custom_generate=speculative_decoding, ...)`` runs this project's loop
(:func:`specjax.speculative_generate`; Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318) inside ``generate``, after transformers
has prepared the generation config, the logits processors and the stopping
criteria. Batches of any size work (left-padded with an attention mask);
transformers' own assisted generation is limited to batch size 1.

How transformers 5.x calls a callable ``custom_generate`` (``GenerationMixin.
generate``, step 9): ``custom_generate(model, input_ids, logits_processor=...,
stopping_criteria=..., generation_config=..., **custom_kwargs, **model_kwargs)``,
after the config, processors, stopping criteria, attention mask and length are
prepared. ``custom_kwargs`` are the ``generate`` keyword arguments named in the
callable's signature but not in ``GenerationMixin._sample``'s: here
``draft_model``, ``num_draft_tokens``, ``seed`` and ``sampler``. The named
``generate`` arguments ``assistant_model`` and ``streamer`` are *not* passed
on (``_extract_generation_mode_kwargs`` replaces them by the custom keywords,
transformers 5.24), and no argument or hook carries them: so
:func:`speculative_decoding` reads them from the calling ``generate`` frame,
after checking that frame runs ``GenerationMixin.generate``'s own code object
(otherwise pass the draft as ``draft_model=``). That one read is
:func:`_from_generate_frame`; ``draft_model=`` needs no frame.

Options that would change the output distribution and that this loop does not
implement (repetition penalties, min-p, typical-p, bad words, n-gram bans,
beams, contrastive search, DoLa, custom logits processors or stopping
criteria, ``assistant_ensemble_weight``, ...) raise ``ValueError``; they are
never silently ignored. Options that do not change it and are not used:
``num_assistant_tokens`` and its schedule (use ``num_draft_tokens``),
``assistant_confidence_threshold``, ``use_cache``, ``cache_implementation``.

Importing this module imports neither torch, JAX nor transformers.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, cast

__all__ = ["speculative_decoding"]

# Logits processors whose names say which generate option produced them (for messages).
_PROCESSOR_OPTIONS = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "MinPLogitsWarper": "min_p",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "TopHLogitsWarper": "top_h",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "LogitNormalization": "renormalize_logits",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
_STOPPING_OPTIONS = {
    "StopStringCriteria": "stop_strings",
    "MaxTimeCriteria": "max_time",
}
# model_kwargs that transformers prepares and that the loop derives itself.
_IGNORED_MODEL_KWARGS = ("position_ids", "logits_to_keep", "use_cache", "cache_position")


def _generate_code() -> Any:
    from transformers.generation.utils import GenerationMixin

    return inspect.unwrap(GenerationMixin.generate).__code__


def _from_generate_frame(frame: Any) -> dict[str, Any]:
    """``assistant_model`` and ``streamer`` of the calling ``generate``, if it is one."""
    if frame is None or frame.f_code is not _generate_code():
        return {}
    return {k: frame.f_locals.get(k) for k in ("assistant_model", "streamer")}


def _describe(obj: Any, options: dict[str, str]) -> str:
    name = type(obj).__name__
    return f"{name} ({options[name]})" if name in options else name


def _sampling_settings(generation_config: Any, logits_processor: Any) -> tuple[float, int | None, float | None]:
    """(temperature, top_k, top_p) from the processors transformers prepared; 0.0 = greedy."""
    import math

    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    order = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    processors = list(logits_processor or [])
    unsupported = [p for p in processors if type(p) not in order]
    if unsupported:
        raise ValueError(
            "speculative_decoding: unsupported generation options that change the output distribution: "
            + ", ".join(_describe(p, _PROCESSOR_OPTIONS) for p in unsupported)
            + "; specjax implements temperature, top_k and top_p only (remove these options, or use "
            "transformers' own generate)"
        )
    kinds = [type(p) for p in processors]
    if len(set(kinds)) != len(kinds) or kinds != sorted(kinds, key=order.index):
        raise ValueError(
            "speculative_decoding: expected at most one each of TemperatureLogitsWarper, TopKLogitsWarper, "
            f"TopPLogitsWarper in that order, got {[k.__name__ for k in kinds]} (a logits_processor= argument "
            "duplicating temperature/top_k/top_p?)"
        )
    if not generation_config.do_sample:
        if processors:
            raise ValueError(
                f"speculative_decoding: greedy decoding got logits processors {[k.__name__ for k in kinds]}"
            )
        return 0.0, None, None
    temperature, top_k, top_p = 1.0, None, None
    for p in processors:
        if hasattr(p, "filter_value") and not (isinstance(p.filter_value, float) and p.filter_value == -math.inf):
            raise ValueError(
                f"speculative_decoding: {type(p).__name__} with filter_value={p.filter_value!r} is not "
                "supported (only -inf)"
            )
        if isinstance(p, TemperatureLogitsWarper):
            temperature = float(p.temperature)
        elif isinstance(p, TopKLogitsWarper):
            top_k = int(p.top_k)
        else:
            if int(getattr(p, "min_tokens_to_keep", 1)) != 1:
                raise ValueError(
                    f"speculative_decoding: top_p with min_tokens_to_keep={p.min_tokens_to_keep} is not "
                    "supported (only 1)"
                )
            top_p = float(p.top_p)
    return temperature, top_k, top_p


def _stopping_settings(generation_config: Any, stopping_criteria: Any, prompt_len: int) -> tuple[int, list[int]]:
    """(max_new_tokens, eos ids) from the stopping criteria transformers prepared."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    criteria = list(stopping_criteria or [])
    unsupported = [c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)]
    if unsupported:
        raise ValueError(
            "speculative_decoding: unsupported stopping criteria: "
            + ", ".join(_describe(c, _STOPPING_OPTIONS) for c in unsupported)
            + "; specjax stops at max_new_tokens / max_length and at the EOS ids only"
        )
    lengths = [int(c.max_length) for c in criteria if isinstance(c, MaxLengthCriteria)]
    if generation_config.max_length is not None:
        lengths.append(int(generation_config.max_length))
    if not lengths:
        raise ValueError("speculative_decoding: no max_length / max_new_tokens in the generation config")
    max_new_tokens = min(lengths) - prompt_len
    if max_new_tokens < 1:
        raise ValueError(
            f"speculative_decoding: max_length {min(lengths)} leaves no room for new tokens after a "
            f"prompt of {prompt_len}; set max_new_tokens"
        )
    eos: list[int] = []
    for c in criteria:
        if isinstance(c, EosTokenCriteria):
            eos.extend(int(t) for t in c.eos_token_id.flatten().tolist())
    return max_new_tokens, sorted(set(eos))


def _check_generation_config(model: Any, generation_config: Any) -> None:
    problems = []
    if getattr(model.config, "is_encoder_decoder", False):
        problems.append("encoder-decoder models")
    if (generation_config.num_beams or 1) > 1:
        problems.append(f"num_beams={generation_config.num_beams}")
    if (getattr(generation_config, "num_beam_groups", 1) or 1) > 1:
        problems.append(f"num_beam_groups={generation_config.num_beam_groups}")
    for option in ("penalty_alpha", "dola_layers", "assistant_ensemble_weight"):
        if getattr(generation_config, option, None) is not None:
            problems.append(f"{option}={getattr(generation_config, option)!r}")
    if generation_config.return_dict_in_generate:
        for option in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            if getattr(generation_config, option, False):
                problems.append(f"{option}=True")
    if problems:
        raise ValueError("speculative_decoding: unsupported generation options: " + ", ".join(problems))


def _check_model_kwargs(model_kwargs: dict[str, Any]) -> None:
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and int(cache.get_seq_length() if hasattr(cache, "get_seq_length") else 1) > 0:
            raise ValueError(
                f"speculative_decoding: {name}: continuing from a filled cache is not supported "
                "(specjax keeps its own caches); pass the whole prompt instead"
            )
    unknown = sorted(
        k
        for k, v in model_kwargs.items()
        if k not in (*_IGNORED_MODEL_KWARGS, "attention_mask", "cache", "past_key_values") and v is not None
    )
    if unknown:
        raise ValueError(
            f"speculative_decoding: unsupported model inputs {unknown}; specjax takes input_ids and attention_mask only"
        )


def speculative_decoding(
    model: Any,
    input_ids: Any,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    synced_gpus: bool = False,
    streamer: Any = None,
    *,
    draft_model: Any = None,
    num_draft_tokens: int = 4,
    seed: int | None = None,
    sampler: Any = "jax",
    **model_kwargs: Any,
) -> Any:
    """A transformers ``custom_generate`` callable running specjax's speculative loop.

    Use as ``target.generate(input_ids, assistant_model=draft,
    custom_generate=speculative_decoding, max_new_tokens=..., do_sample=...,
    temperature=..., top_k=..., top_p=...)``; ``draft_model=draft`` works too
    (and is the only way when calling this function directly).

    Args (as transformers passes them):
      model: the target model (``self`` of ``generate``).
      input_ids: i64[B, P], prompts, left-padded when their lengths differ.
      logits_processor, stopping_criteria, generation_config: prepared by
        ``generate``. Honoured: ``do_sample`` (False = greedy), ``temperature``,
        ``top_k``, ``top_p``, ``max_new_tokens`` / ``max_length``, the EOS and
        pad ids, ``return_dict_in_generate``, ``num_return_sequences`` (with
        ``draft_model=``; with ``assistant_model=`` transformers refuses
        ``num_return_sequences > 1`` before this function runs).
      streamer: a transformers streamer (batch size 1).
      draft_model: the draft model (defaults to ``generate``'s ``assistant_model``).
      num_draft_tokens: G, draft tokens per step.
      seed: seeds the JAX keys; by default drawn from torch's global generator
        (only when sampling), so ``torch.manual_seed`` reproduces a call.
      sampler: ``"jax"``, an installed sampler name, or a sampler callable.
      **model_kwargs: ``attention_mask`` (used), ``position_ids``,
        ``logits_to_keep``, ``use_cache`` and an empty ``cache`` (ignored:
        the loop builds its own).

    Returns:
      i64[B, P + new] sequences like ``generate`` (rows that end early are
      padded with the pad id), or a ``GenerateDecoderOnlyOutput`` with only
      ``sequences`` set when ``return_dict_in_generate=True``.

    Raises:
      ValueError: no draft model, or an option that would change the output
        distribution (see the module docstring), or what
        :func:`specjax.speculative_generate` refuses.
    """
    import torch

    from specjax.generate import speculative_generate

    found = _from_generate_frame(sys._getframe(1))
    assistant = found.get("assistant_model")
    if draft_model is not None and assistant is not None and draft_model is not assistant:
        raise ValueError("speculative_decoding: got both draft_model= and a different assistant_model=")
    draft = draft_model if draft_model is not None else assistant
    if draft is None:
        raise ValueError(
            "speculative_decoding: no draft model; pass assistant_model=draft (to generate) or draft_model=draft"
        )
    streamer = streamer if streamer is not None else found.get("streamer")
    if generation_config is None:
        generation_config = model.generation_config

    _check_generation_config(model, generation_config)
    temperature, top_k, top_p = _sampling_settings(generation_config, logits_processor)
    max_new_tokens, eos = _stopping_settings(generation_config, stopping_criteria, int(input_ids.shape[1]))
    _check_model_kwargs(model_kwargs)
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:  # transformers drops an all-ones mask
        attention_mask = torch.ones_like(input_ids)
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    pad_id = None if pad is None else int(torch.as_tensor(pad).flatten()[0])
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if temperature > 0 else 0

    on_tokens = None
    if streamer is not None:
        if input_ids.shape[0] != 1:
            raise ValueError(f"speculative_decoding: streamer needs batch size 1, got {input_ids.shape[0]}")

        def on_tokens(row: int, token_ids: list[int]) -> None:
            streamer.put(torch.as_tensor(token_ids, dtype=torch.long))

    out = speculative_generate(
        model,
        draft,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        num_draft_tokens=num_draft_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=eos,
        pad_token_id=pad_id,
        sampler=sampler,
        on_tokens=on_tokens,
        # Sampling keeps generate's contract that a torch seed reproduces the output:
        # the adaptive draft length decides from measured times, which would change
        # which draws a run makes. Greedy output is the same either way.
        adaptive=not temperature > 0,
    )
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=cast("torch.LongTensor", out.sequences))
    return out.sequences
