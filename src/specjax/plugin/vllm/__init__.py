"""specjax as a vLLM plugin: vLLM's speculative-decoding acceptance step runs in specjax's kernel.

Installed beside vLLM, specjax registers :func:`register` under vLLM's entry-point
group ``vllm.general_plugins`` (name ``specjax``). vLLM calls it in every process
it starts (``VLLM_PLUGINS`` filters by name), and it replaces the module-level
function ``vllm.v1.sample.rejection_sampler.rejection_sample``, which
``RejectionSampler.forward`` looks up at each call, by :func:`rejection_sample`.

What stays vLLM's: the proposers (n-gram, draft model, EAGLE, ...), the target
forward, ``RejectionSampler.forward``'s processing of the target logits
(penalties, bad words, allowed ids, temperature, top-k, top-p: applied once, by
vLLM, before the step), the bonus token (sampled by vLLM's sampler from the
position after the last draft token) and the logprobs. What specjax does: given
the processed target logits of the draft positions, decide how many draft
tokens each request keeps and draw the correction token (Leviathan et al. 2023,
arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318). A step whose requests
are all greedy needs no draw: its result is the target's first argmax at each
draft position compared with the draft (:mod:`specjax.kernels.greedy`, the
kernel's result for a greedy target, checked against it in the tests), from
one torch reduction over the logits; on a CPU a JAX dispatch right after the
engine's torch forward costs more than that whole step (docs/vllm.md). Steps
with a sampled request run in jitted JAX calls:

* ``draft_probs=None`` (n-gram, EAGLE, suffix and greedy draft-model proposals):
  each ``q_i`` is the point mass at the draft token; the step is
  :mod:`specjax.kernels.flat`, the front end's primitives composed on vLLM's
  flattened layout (T = Σ k_b rows of ``target_logits``): the rows are read in
  place, in zero-copy slices of power-of-two lengths (so JAX compiles once per
  length, not per T), and only the sampled rows that reject a token are
  gathered for the residual draw.
* given ``draft_probs`` (``draft_sample_method="probabilistic"``): the target's
  probabilities come from the front end's :func:`~specjax.kernels.frontend.row_stats`
  and the step is :func:`specjax.rejection_sample` with those ``q``, on the
  kernel's (B', G+1, V) layout: the step copies the rows once, on their device,
  into a reused buffer with B' the batch size rounded up to a power of two,
  and that buffer crosses to JAX without a copy
  (:func:`specjax.adapters.jit_input`).

Rows whose temperature is 0 are greedy (accept iff the draft token is the
argmax, emit the argmax); the other rows' logits are already processed, so
the kernel runs them at temperature 1: processing is applied exactly once.
The tokens come back as vLLM expects them: i32[B, max_spec_len + 1], -1 after
the emitted token, vLLM's bonus token where every draft token was accepted.

Randomness: one JAX key per row. A request with a seed
(``SamplingParams(seed=...)``) takes its key from its own ``torch.Generator``
(vLLM keeps one per seeded request), so its tokens do not depend on the other
requests in the batch; other rows take theirs from torch's default generator,
as vLLM's own step does.

Safety: :func:`register` leaves vLLM alone (one warning) unless vLLM's version
is one this module was tested with (:data:`SUPPORTED_VLLM_VERSIONS`) and the
function it replaces has the expected parameters. A step the plugin does not
handle (vLLM's synthetic acceptance mode) and a step whose kernel raises go to
vLLM's own function; a failure is logged once per process.

:func:`calls` counts the steps the kernel ran in this process (with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM's engine runs in the calling process).
Importing this module imports neither vLLM, torch nor JAX.

The package: this module holds the registration (its gates, the replacement
and its counters); :mod:`~specjax.plugin.vllm.repair` the repairs of vLLM's
own processing; :mod:`~specjax.plugin.vllm.step` the step itself (vLLM's
flattened layout to the kernels' and back, and the jitted functions).
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from specjax.plugin.vllm.repair import install_constraints_guard, repairs
from specjax.plugin.vllm.step import all_greedy, run_step

__all__ = [
    "SUPPORTED_VLLM_VERSIONS",
    "calls",
    "fallbacks",
    "greedy_calls",
    "is_registered",
    "register",
    "rejection_sample",
    "repairs",
    "unregister",
]

# A child of vLLM's logger: messages appear in vLLM's log, at its level (VLLM_LOGGING_LEVEL).
logger = logging.getLogger("vllm.specjax")

#: vLLM release series (major.minor) whose ``rejection_sample`` this module was tested against.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32",)

_TARGET_MODULE = "vllm.v1.sample.rejection_sampler"
_TARGET_NAME = "rejection_sample"
# The leading parameters of the replaced function, in order.
_EXPECTED_PARAMETERS = (
    "draft_token_ids",
    "num_draft_tokens",
    "max_spec_len",
    "cu_num_draft_tokens",
    "draft_probs",
    "target_logits",
    "bonus_token_ids",
    "sampling_metadata",
)

_lock = threading.Lock()
_original: Callable[..., Any] | None = None
_calls = {"point_mass": 0, "draft_probs": 0}
_greedy_calls = [0]
_fallbacks = 0
_failure_logged = False


def calls(mode: str | None = None) -> int:
    """How many acceptance steps specjax decided in this process (not vLLM's function).

    ``mode``: None (all), ``"point_mass"`` (``draft_probs=None``) or
    ``"draft_probs"`` (given draft probabilities). Steps without any draft
    token (every row emits vLLM's bonus token) are counted too. The steps with
    a sampled request ran the JAX kernel: ``calls() - greedy_calls()``.
    """
    if mode is None:
        return sum(_calls.values())
    if mode not in _calls:
        raise ValueError(f"mode: expected None, 'point_mass' or 'draft_probs', got {mode!r}")
    return _calls[mode]


def greedy_calls() -> int:
    """How many of :func:`calls`'s steps had only greedy requests.

    Those are decided from torch's argmax of the target logits
    (:func:`specjax.kernels.greedy.accept_greedy`, the kernel's result for a
    greedy target), without a JAX call; the others run the jitted kernel.
    """
    return _greedy_calls[0]


def fallbacks() -> int:
    """How many steps went to vLLM's own function because the kernel raised."""
    return _fallbacks


def is_registered() -> bool:
    """Whether vLLM's ``rejection_sample`` is specjax's in this process."""
    import sys

    module = sys.modules.get(_TARGET_MODULE)
    return module is not None and getattr(module, _TARGET_NAME, None) is rejection_sample


def _version_supported(version: str) -> bool:
    parts = version.split(".")
    return ".".join(parts[:2]) in SUPPORTED_VLLM_VERSIONS


def _signature_problem(fn: Any) -> str | None:
    """Why ``fn`` is not the function this module replaces, or None."""
    if not callable(fn):
        return f"{_TARGET_MODULE}.{_TARGET_NAME} is missing"
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError) as e:
        return f"{_TARGET_MODULE}.{_TARGET_NAME} has no readable signature ({e})"
    if names[: len(_EXPECTED_PARAMETERS)] != _EXPECTED_PARAMETERS:
        return (
            f"{_TARGET_MODULE}.{_TARGET_NAME} has parameters {names}, expected them to start with "
            f"{_EXPECTED_PARAMETERS}"
        )
    return None


def register() -> bool:
    """vLLM's ``vllm.general_plugins`` entry point: put specjax's kernel in vLLM's acceptance step.

    Idempotent (vLLM may call it more than once per process). Returns whether
    the replacement is in place. On an unsupported vLLM version, or when the
    replaced function's parameters are not the expected ones, logs one warning
    and leaves vLLM's sampler in place; never raises for those.
    """
    global _original
    try:
        import vllm
    except ImportError as e:  # specjax installed without vLLM: nothing to do
        logger.warning("specjax vLLM plugin: vLLM is not importable (%s); vLLM's sampler is unchanged", e)
        return False
    version = str(getattr(vllm, "__version__", "unknown"))
    if not _version_supported(version):
        logger.warning(
            "specjax vLLM plugin: vLLM %s is not a supported version (supported: %s.x); "
            "vLLM's own rejection sampler stays in place",
            version,
            ".x, ".join(SUPPORTED_VLLM_VERSIONS),
        )
        return False
    import importlib
    import os

    # JAX starts in this process at the first step; on a GPU it must not take 75% of
    # the memory vLLM planned for itself (specjax.adapters.configure_jax_memory).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    module = importlib.import_module(_TARGET_MODULE)
    with _lock:
        current = getattr(module, _TARGET_NAME, None)
        if current is rejection_sample:
            return True
        problem = _signature_problem(current)
        if problem is not None:
            logger.warning("specjax vLLM plugin: %s; vLLM's own rejection sampler stays in place", problem)
            return False
        _original = current
        setattr(module, _TARGET_NAME, rejection_sample)
        install_constraints_guard(module)
    logger.info("specjax vLLM plugin: vLLM %s's rejection step now runs specjax's kernel", version)
    return True


def unregister() -> bool:
    """Put vLLM's own ``rejection_sample`` back in this process; returns whether it was replaced.

    The repairs of vLLM's processing (:func:`repairs`) stay: they fix vLLM's
    inputs to either step.
    """
    import sys

    module = sys.modules.get(_TARGET_MODULE)
    with _lock:
        if module is None or _original is None or getattr(module, _TARGET_NAME, None) is not rejection_sample:
            return False
        setattr(module, _TARGET_NAME, _original)
    return True


def _vllm_rejection_sample() -> Callable[..., Any]:
    if _original is not None:
        return _original
    import importlib

    fn = getattr(importlib.import_module(_TARGET_MODULE), _TARGET_NAME)
    if fn is rejection_sample:  # registered, then the module state was lost: cannot happen
        raise RuntimeError("specjax vLLM plugin: vLLM's own rejection_sample is unknown")
    return fn


def rejection_sample(
    draft_token_ids: Any,
    num_draft_tokens: Sequence[int],
    max_spec_len: int,
    cu_num_draft_tokens: Any,
    draft_probs: Any,
    target_logits: Any,
    bonus_token_ids: Any,
    sampling_metadata: Any,
    synthetic_mode: bool = False,
    synthetic_conditional_rates: Any = None,
    use_fp64_gumbel: bool = False,
    **kwargs: Any,
) -> Any:
    """vLLM's ``rejection_sample`` contract, decided by specjax's kernel.

    Args:
      draft_token_ids: i32[T], the draft tokens of all requests, flattened
        (T = Σ num_draft_tokens).
      num_draft_tokens: B host integers ``k_b``, the drafts per request (may be 0).
      max_spec_len: G = max ``k_b``: the output has G + 1 columns.
      cu_num_draft_tokens: i32[B], the cumulative sums of ``num_draft_tokens``
        (vLLM's; the host list is what the step reads).
      draft_probs: None (each ``q_i`` is the point mass at ``x_i``) or f32[T, V],
        the distributions the draft tokens were sampled from.
      target_logits: f32[T, V], the target's logits at the draft positions,
        already processed by vLLM (temperature, top-k, top-p for non-greedy rows).
      bonus_token_ids: i32/i64[B, 1], vLLM's draw at the position after the
        last draft token: emitted when every draft token is accepted.
      sampling_metadata: vLLM's ``SamplingMetadata`` (``temperature`` f32[B] or
        None when every row is greedy; ``generators``: row -> torch.Generator).
      synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel, kwargs:
        vLLM's options; a synthetic-mode step, or one with options this module
        does not know, runs vLLM's own function.

    Returns:
      i32[B, max_spec_len + 1] on the logits' device: row b holds the accepted
      draft tokens, then the correction or bonus token, then -1.
    """
    global _fallbacks, _failure_logged
    args = (
        draft_token_ids,
        num_draft_tokens,
        max_spec_len,
        cu_num_draft_tokens,
        draft_probs,
        target_logits,
        bonus_token_ids,
        sampling_metadata,
    )
    options = dict(
        synthetic_mode=synthetic_mode,
        synthetic_conditional_rates=synthetic_conditional_rates,
        use_fp64_gumbel=use_fp64_gumbel,
        **kwargs,
    )
    if synthetic_mode or kwargs:
        return _vllm_rejection_sample()(*args, **options)
    try:
        out = run_step(
            draft_token_ids,
            list(num_draft_tokens),
            int(max_spec_len),
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
        )
    except Exception:
        with _lock:
            _fallbacks += 1
            first = not _failure_logged
            _failure_logged = True
        if first:
            logger.exception(
                "specjax vLLM plugin: the kernel raised; this step and any later failing step "
                "run vLLM's own rejection sampler (logged once per process)"
            )
        return _vllm_rejection_sample()(*args, **options)
    mode = "point_mass" if draft_probs is None else "draft_probs"
    greedy = all_greedy(sampling_metadata)
    with _lock:
        first = _calls[mode] == 0
        _calls[mode] += 1
        _greedy_calls[0] += greedy
    if first:
        logger.info(
            "specjax vLLM plugin: first acceptance step (%s drafts) ran in specjax's kernel", mode.replace("_", " ")
        )
    return out
