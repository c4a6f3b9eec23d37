"""The ``generate(custom_generate=speculative_decoding)`` drop-in: specjax's loop inside transformers' ``generate``.

``target.generate(input_ids, assistant_model=draft,
custom_generate=speculative_decoding, ...)`` runs this project's loop
(:func:`specjax.speculative_generate`; Leviathan et al. 2023, arXiv:2211.17192;
Chen et al. 2023, arXiv:2302.01318) inside ``generate``, after transformers
has prepared the generation config, the logits processors and the stopping
criteria. Batches of any size work (left-padded with an attention mask);
transformers' own assisted generation is limited to batch size 1.

Two ways in, because of how transformers 5.x calls a ``custom_generate``:

* **The callable** (``custom_generate=speculative_decoding``): transformers
  prepares the generation config, the logits processors, the stopping criteria,
  the attention mask and the length, then calls ``custom_generate(model,
  input_ids, logits_processor=..., stopping_criteria=..., generation_config=...,
  **custom_kwargs, **model_kwargs)``, where ``custom_kwargs`` are the
  ``generate`` keyword arguments named in the callable's signature but not in
  ``GenerationMixin._sample``'s: here ``draft_model``, ``token_streamer``,
  ``num_draft_tokens``, ``seed`` and ``sampler``. ``generate``'s own named
  arguments ``assistant_model`` and ``streamer`` never reach a callable
  (``_extract_generation_mode_kwargs`` replaces them by the custom keywords,
  transformers 5.24), so this form takes the draft as ``draft_model=`` and a
  streamer as ``token_streamer=``. Given neither a draft, it raises.
* **The directory** (``custom_generate=CUSTOM_GENERATE_DIR,
  trust_remote_code=True``): transformers' form for generation methods
  distributed as a repository hands *every* ``generate`` argument to the
  repository's ``generate``, which is :func:`generate_with_all_arguments`:
  it renames ``assistant_model`` and ``streamer`` to ``draft_model`` and
  ``token_streamer`` and calls ``generate`` again with the callable. So
  ``target.generate(ids, assistant_model=draft, streamer=streamer,
  custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True)`` works as
  transformers' assisted generation is called. (``trust_remote_code`` is
  transformers' gate for running a repository's ``generate.py``; the directory
  ships inside this package.)

The logits processors transformers prepared (repetition penalties, n-gram
bans, bad words, ``min_new_tokens``, forced and suppressed tokens, min-p,
typical-p, epsilon/eta cutoffs, a ``logits_processor=`` list) run inside the
loop, each draft position on its own prefix
(:mod:`specjax.generate.processors`). Stop strings, ``max_time`` and custom
stopping criteria are passed to the loop, which asks them after every token as
``generate`` does (:mod:`specjax.generate.stopping`; transformers drops
``generate``'s ``tokenizer=`` before calling a callable, so there
``stop_strings`` needs ``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tokenizer,
strings)])``, while the directory takes ``stop_strings=..., tokenizer=...`` as
``generate`` does); ``output_scores`` and ``output_logits`` (with
``return_dict_in_generate=True``) return ``generate``'s per-step scores and
logits (:mod:`specjax.generate.outputs`). Options that would change the output
distribution and that this loop does not implement (beams, contrastive search,
DoLa, classifier-free guidance, SynthID watermarks,
``assistant_ensemble_weight``, ...) and ``output_attentions`` /
``output_hidden_states`` raise ``ValueError``; they are
never silently ignored. Options that do not change it and are not used:
``num_assistant_tokens`` and its schedule (use ``num_draft_tokens``),
``assistant_confidence_threshold``, ``use_cache``, ``cache_implementation``.

Importing this module imports neither torch, JAX nor transformers.
"""

from __future__ import annotations

import os
from typing import Any, cast

__all__ = ["CUSTOM_GENERATE_DIR", "generate_with_all_arguments", "speculative_decoding"]

#: The repository directory for ``generate(custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True)``:
#: its ``custom_generate/generate.py`` is :func:`generate_with_all_arguments`.
CUSTOM_GENERATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specjax_speculative_decoding")

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
# model_kwargs that transformers prepares and that the loop derives itself.
_IGNORED_MODEL_KWARGS = ("position_ids", "logits_to_keep", "use_cache", "cache_position")


def _check_one_streamer(streamer: Any, token_streamer: Any) -> None:
    if streamer is not None and token_streamer is not None:
        raise ValueError("speculative_decoding: got both streamer= and token_streamer=; pass one")


def _describe(obj: Any, options: dict[str, str]) -> str:
    name = type(obj).__name__
    return f"{name} ({options[name]})" if name in options else name


def _sampling_settings(
    generation_config: Any, logits_processor: Any
) -> tuple[list[Any], tuple[float, int | None, float | None]]:
    """The processors transformers prepared, for the loop: ``(chain, (temperature, top_k, top_p))``; 0.0 = greedy.

    :func:`specjax.generate.processors.split_prepared`: the processors run in
    the loop, each position on its own prefix; temperature / top-k / top-p go
    to the acceptance step, or join the chain with the warpers transformers
    applies after them (min-p, typical, epsilon, eta).
    """
    from specjax.generate.processors import refusal, split_prepared

    processors = list(logits_processor or [])
    refused = [p for p in processors if refusal(p) is not None]
    if refused:
        raise ValueError(
            "speculative_decoding: unsupported generation options: "
            + ", ".join(f"{_describe(p, _PROCESSOR_OPTIONS)}, which {refusal(p)}" for p in refused)
            + " (remove them, or use transformers' own generate)"
        )
    return split_prepared(processors, bool(generation_config.do_sample))


def _stopping_settings(
    generation_config: Any, stopping_criteria: Any, prompt_len: int
) -> tuple[int, list[int], list[Any]]:
    """(max_new_tokens, eos ids, the other criteria) from the stopping criteria transformers prepared.

    The length and EOS criteria become the loop's own limits; the others (stop strings,
    ``max_time``, the caller's) are asked after every token (:mod:`specjax.generate.stopping`).
    """
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    criteria = list(stopping_criteria or [])
    others = [c for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)]
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
    return max_new_tokens, sorted(set(eos)), others


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
        for option in ("output_attentions", "output_hidden_states"):
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
    token_streamer: Any = None,
    num_draft_tokens: int = 4,
    seed: int | None = None,
    sampler: Any = "jax",
    **model_kwargs: Any,
) -> Any:
    """A transformers ``custom_generate`` callable running specjax's speculative loop.

    Use as ``target.generate(input_ids, custom_generate=speculative_decoding,
    draft_model=draft, max_new_tokens=..., do_sample=..., temperature=...,
    top_k=..., top_p=...)``. To keep ``assistant_model=`` and ``streamer=``, use
    ``custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True`` instead
    (module docstring: transformers does not pass those two to a callable).

    Args (as transformers passes them):
      model: the target model (``self`` of ``generate``).
      input_ids: i64[B, P], prompts, left-padded when their lengths differ.
      logits_processor, stopping_criteria, generation_config: prepared by
        ``generate``. Honoured: ``do_sample`` (False = greedy), ``temperature``,
        ``top_k``, ``top_p``, the logits processors (module docstring),
        ``max_new_tokens`` / ``max_length``, the EOS and pad ids,
        ``stop_strings``, ``max_time``, stopping criteria,
        ``return_dict_in_generate`` with ``output_scores`` / ``output_logits``,
        ``num_return_sequences``.
      synced_gpus: accepted for ``GenerationMixin._sample``'s signature; unused.
      streamer: a transformers streamer given the new tokens only (the
        ``_sample`` contract: the caller has put the prompt). Batch size 1.
      draft_model: the draft model (required).
      token_streamer: a transformers streamer given the prompt, then the new
        tokens, then ``end()``, as ``generate(streamer=...)`` does. Batch size 1.
      num_draft_tokens: G, draft tokens per step.
      seed: seeds the JAX keys; by default drawn from torch's global generator
        (only when sampling), so ``torch.manual_seed`` reproduces a call.
      sampler: ``"jax"``, an installed sampler name, or a sampler callable.
      **model_kwargs: ``attention_mask`` (used), ``position_ids``,
        ``logits_to_keep``, ``use_cache`` and an empty ``cache`` (ignored:
        the loop builds its own).

    Returns:
      i64[B, P + new] sequences like ``generate`` (rows that end early are
      padded with the pad id), or, when ``return_dict_in_generate=True``, a
      ``GenerateDecoderOnlyOutput`` with ``sequences`` and, when asked for,
      ``scores`` and ``logits`` (one f32[B, V] tensor per generated position;
      zeros where a row had ended, where ``generate`` holds the scores of the
      pad token it feeds).

    Raises:
      ValueError: no draft model, both streamers, or an option that would
        change the output distribution (see the module docstring), or what
        :func:`specjax.speculative_generate` refuses.
    """
    import torch

    from specjax.generate import speculative_generate

    if draft_model is None:
        raise ValueError(
            "speculative_decoding: no draft model; pass draft_model=draft (transformers does not pass "
            "generate's assistant_model= to a custom_generate callable), or call generate with "
            "custom_generate=specjax.plugin.hf.CUSTOM_GENERATE_DIR, trust_remote_code=True to keep "
            "assistant_model= and streamer="
        )
    draft = draft_model
    _check_one_streamer(streamer, token_streamer)
    if generation_config is None:
        generation_config = model.generation_config

    _check_generation_config(model, generation_config)
    chain, (temperature, top_k, top_p) = _sampling_settings(generation_config, logits_processor)
    max_new_tokens, eos, criteria = _stopping_settings(generation_config, stopping_criteria, int(input_ids.shape[1]))
    as_dict = bool(generation_config.return_dict_in_generate)
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
    sink = streamer if streamer is not None else token_streamer
    if sink is not None:
        name = "streamer" if streamer is not None else "token_streamer"
        if input_ids.shape[0] != 1:
            raise ValueError(f"speculative_decoding: {name} needs batch size 1, got {input_ids.shape[0]}")
        if token_streamer is not None:
            token_streamer.put(input_ids.cpu())  # generate(streamer=...) puts the prompt first

        def on_tokens(row: int, token_ids: list[int]) -> None:
            sink.put(torch.as_tensor(token_ids, dtype=torch.long))

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
        stopping_criteria=criteria,
        output_scores=as_dict and bool(generation_config.output_scores),
        output_logits=as_dict and bool(generation_config.output_logits),
        logits_processor=chain or None,
        # Sampling keeps generate's contract that a torch seed reproduces the output:
        # the adaptive draft length decides from measured times, which would change
        # which draws a run makes. Greedy output is the same either way.
        adaptive=not temperature > 0,
    )
    if sink is not None:
        sink.end()
    if as_dict:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(
            sequences=cast("torch.LongTensor", out.sequences),
            scores=cast("tuple[torch.FloatTensor]", out.scores),
            logits=cast("tuple[torch.FloatTensor]", out.logits),
        )
    return out.sequences


def generate_with_all_arguments(model: Any, **generate_arguments: Any) -> Any:
    """What ``generate(custom_generate=CUSTOM_GENERATE_DIR, trust_remote_code=True)`` runs.

    transformers hands a repository's ``generate`` every argument of
    ``GenerationMixin.generate`` (``inputs``, ``generation_config``,
    ``assistant_model``, ``streamer``, ..., and the extra keywords). This
    function passes ``assistant_model`` on as ``draft_model`` and ``streamer``
    as ``token_streamer`` (so the streamer still gets the prompt first), turns
    ``stop_strings`` (with ``tokenizer``, which transformers would not hand to
    the callable) into a stopping criterion, and calls ``generate`` again with
    :func:`speculative_decoding`, which then sees the config, processors and
    stopping criteria transformers prepared.

    Args:
      model: the target model.
      **generate_arguments: ``generate``'s arguments as transformers collects
        them; ``draft_model=`` may stand for ``assistant_model=``.

    Returns:
      What :func:`speculative_decoding` returns.

    Raises:
      ValueError: both ``assistant_model=`` and a different ``draft_model=``,
        or no draft at all, ``stop_strings`` without ``tokenizer``; and what
        :func:`speculative_decoding` raises.
    """
    args = dict(generate_arguments)
    assistant = args.pop("assistant_model", None)
    draft = args.pop("draft_model", None)
    if draft is not None and assistant is not None and draft is not assistant:
        raise ValueError("speculative_decoding: got both draft_model= and a different assistant_model=")
    draft = draft if draft is not None else assistant
    if draft is None:
        raise ValueError("speculative_decoding: no draft model; pass assistant_model=draft (or draft_model=draft)")
    streamer = args.pop("streamer", None)
    _check_one_streamer(streamer, args.get("token_streamer"))
    if streamer is not None:
        args["token_streamer"] = streamer
    stop_strings = args.pop("stop_strings", None)
    if stop_strings is not None:
        from transformers.generation.stopping_criteria import StoppingCriteriaList

        from specjax.generate.stopping import stop_string_criterion

        criterion = stop_string_criterion(stop_strings, args.pop("tokenizer", None), tokenizer_arg="tokenizer")
        args["stopping_criteria"] = StoppingCriteriaList([*(args.get("stopping_criteria") or []), criterion])
    inputs = args.pop("inputs", None)
    # the class's generate, not an instance attribute a custom_generate repository may have set
    return type(model).generate(model, inputs, custom_generate=speculative_decoding, draft_model=draft, **args)
