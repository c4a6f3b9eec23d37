"""The patched acceptance step: transformers' ``_speculative_sampling`` computed by specjax's kernel.

``with patch_speculative_sampling(): target.generate(..., assistant_model=draft,
do_sample=True)`` keeps transformers' assisted loop and replaces only its
acceptance step, ``transformers.generation.utils._speculative_sampling``, by
:func:`jax_speculative_sampling` (:func:`specjax.rejection_sample`; Leviathan
et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318), uniforms
drawn with ``torch.rand`` so ``torch.manual_seed`` reproduces runs.

Importing this module imports neither torch, JAX nor transformers and changes nothing.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["PatchStats", "check_transformers_compatibility", "jax_speculative_sampling", "patch_speculative_sampling"]

logger = logging.getLogger("specjax.plugin")

# Parameter names of transformers.generation.utils._speculative_sampling that the
# replacement reproduces (the second without DIVERSE ensemble verification).
_KNOWN_SIGNATURES = (
    ("candidate_input_ids", "candidate_logits", "candidate_length", "new_logits", "assistant_ensemble_weight"),
    ("candidate_input_ids", "candidate_logits", "candidate_length", "new_logits"),
)


def check_transformers_compatibility() -> None:
    """Refuse a transformers whose ``_speculative_sampling`` the patch cannot replace.

    Checks that ``transformers.generation.utils._speculative_sampling`` has one
    of the known parameter lists and that ``GenerationMixin._assisted_decoding``
    looks it up as a module global at call time (so replacing the global takes
    effect).

    Raises:
      RuntimeError: naming the transformers version, what was expected and what was found.
    """
    import transformers
    from transformers.generation import utils as gu

    fn = getattr(gu, "_speculative_sampling", None)
    if fn is None:
        raise RuntimeError(
            f"transformers {transformers.__version__}: transformers.generation.utils has no "
            "_speculative_sampling; patch_speculative_sampling supports transformers 5.x"
        )
    names = tuple(inspect.signature(fn).parameters)
    if names not in _KNOWN_SIGNATURES:
        raise RuntimeError(
            f"transformers {transformers.__version__}: _speculative_sampling has parameters {names}, expected "
            f"{_KNOWN_SIGNATURES[0]}; patch_speculative_sampling refuses to replace a function it does not know"
        )
    assisted = inspect.unwrap(gu.GenerationMixin._assisted_decoding)
    if "_speculative_sampling" not in assisted.__code__.co_names:
        raise RuntimeError(
            f"transformers {transformers.__version__}: GenerationMixin._assisted_decoding does not call the module "
            "global _speculative_sampling, so patching it would have no effect"
        )


def jax_speculative_sampling(
    candidate_input_ids: Any,
    candidate_logits: Any,
    candidate_length: int,
    new_logits: Any,
    assistant_ensemble_weight: float | None = None,
    *,
    validate: bool = True,
) -> tuple[Any, Any]:
    """transformers' ``_speculative_sampling``, computed by :func:`specjax.rejection_sample`.

    Args:
      candidate_input_ids: i64[1, L], the sequence ending with the G candidate
        (draft) tokens ``x_0 .. x_{G-1}``.
      candidate_logits: f[1, G, V], the draft's processed logits the candidates
        were sampled from (``None`` allowed when G = 0).
      candidate_length: G.
      new_logits: f[1, G+1, V], the target's processed logits at the G+1 positions.
      assistant_ensemble_weight: must be None (ensemble verification is not exact).
      validate: let the kernel check values (NaN probabilities, ...).

    Probabilities are ``softmax`` in float32, as transformers computes them;
    the uniforms ``u`` (G of them) and ``s`` come from ``torch.rand`` on the
    logits' device, so ``torch.manual_seed`` reproduces a run.

    Returns:
      ``(valid_tokens i64[1, n+1], n_matches i64[])``: the n accepted candidates
      and the correction or bonus token, and n.

    Raises:
      ValueError: ``assistant_ensemble_weight`` set, batch size other than 1, or
        shapes that do not fit together.
    """
    import torch

    from specjax.adapters import to_torch
    from specjax.boundary.api import rejection_sample

    if assistant_ensemble_weight is not None:
        raise ValueError(
            f"assistant_ensemble_weight={assistant_ensemble_weight!r}: ensemble verification (DIVERSE) does not "
            "sample from the target distribution; specjax's patched _speculative_sampling is exact only"
        )
    g = int(candidate_length)
    if candidate_input_ids.ndim != 2 or candidate_input_ids.shape[0] != 1 or candidate_input_ids.shape[1] < g:
        raise ValueError(
            f"candidate_input_ids: expected shape (1, L) with L >= candidate_length = {g}, got "
            f"{tuple(candidate_input_ids.shape)}"
        )
    vocab = int(new_logits.shape[-1])
    if tuple(new_logits.shape) != (1, g + 1, vocab):
        raise ValueError(f"new_logits: expected shape (1, G+1, V) = {(1, g + 1, vocab)}, got {tuple(new_logits.shape)}")
    device = new_logits.device
    p = new_logits.to(torch.float32).softmax(dim=-1)
    if g > 0:
        if candidate_logits is None or tuple(candidate_logits.shape) != (1, g, vocab):
            got = None if candidate_logits is None else tuple(candidate_logits.shape)
            raise ValueError(f"candidate_logits: expected shape (1, G, V) = {(1, g, vocab)}, got {got}")
        q = candidate_logits.to(device=device, dtype=torch.float32).softmax(dim=-1)
        x = candidate_input_ids[:, -g:].to(device=device, dtype=torch.int32).contiguous()
    else:
        q = torch.zeros((1, 0, vocab), dtype=torch.float32, device=device)
        x = torch.zeros((1, 0), dtype=torch.int32, device=device)
    u = torch.rand((1, g), device=device)  # float32 in [0, 1)
    s = torch.rand((1,), device=device)
    # rejection_sample takes the tensors zero-copy (DLPack on GPU, NumPy views on a
    # CPU-only JAX); they stay referenced until the result has been read (aliasing rule).
    out = rejection_sample(x, q, p, u, s, validate=validate)
    tokens = to_torch(out.tokens).to(device=candidate_input_ids.device, dtype=torch.long)
    n = int(out.num_accepted[0])
    del x, q, p, u, s
    return tokens[:, : n + 1].clone(), torch.tensor(n, dtype=torch.long, device=candidate_input_ids.device)


@dataclass
class PatchStats:
    """What the patched ``_speculative_sampling`` did inside one ``with`` block.

    Attributes:
      calls: times transformers called it.
      draft_tokens_proposed: candidate tokens it tested (sum of G).
      draft_tokens_accepted: candidates it accepted (sum of n).
    """

    calls: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0


_patch_lock = threading.Lock()
# The open patch blocks' replacements, oldest first, and what was installed before the
# first of them: blocks may exit in any order (nested, interleaved, from several
# threads), and the original returns only when the last one exits.
_patches: list[Any] = []
_unpatched: list[Any] = []


@contextlib.contextmanager
def patch_speculative_sampling(*, validate: bool = True) -> Iterator[PatchStats]:
    """Replace transformers' ``_speculative_sampling`` by :func:`jax_speculative_sampling` inside the block.

    ``generate(..., assistant_model=draft, do_sample=True)`` calls inside the
    block accept draft tokens with the JAX kernel (greedy assisted generation
    never calls ``_speculative_sampling`` and is unaffected). The original is
    restored on exit, also when the block raises. The patch is process-wide
    (it replaces a module global): other threads calling ``generate`` meanwhile
    are patched too. Blocks may overlap in any order (nested, interleaved, or
    in several threads): while several are open, the most recently entered
    one still open is installed, and transformers' original returns when the
    last one exits.

    Args:
      validate: passed to :func:`jax_speculative_sampling`.

    Yields:
      a :class:`PatchStats` counting the calls.

    Raises:
      RuntimeError: an incompatible transformers (:func:`check_transformers_compatibility`).
    """
    from transformers.generation import utils as gu

    check_transformers_compatibility()
    stats = PatchStats()

    def _speculative_sampling(
        candidate_input_ids, candidate_logits, candidate_length, new_logits, assistant_ensemble_weight=None
    ):
        valid_tokens, n_matches = jax_speculative_sampling(
            candidate_input_ids,
            candidate_logits,
            candidate_length,
            new_logits,
            assistant_ensemble_weight,
            validate=validate,
        )
        stats.calls += 1
        stats.draft_tokens_proposed += int(candidate_length)
        stats.draft_tokens_accepted += int(n_matches)
        return valid_tokens, n_matches

    _speculative_sampling.__doc__ = jax_speculative_sampling.__doc__
    with _patch_lock:
        if not _patches:
            _unpatched[:] = [gu._speculative_sampling]
        _patches.append(_speculative_sampling)
        gu._speculative_sampling = _speculative_sampling
    try:
        yield stats
    finally:
        with _patch_lock:
            installed = gu._speculative_sampling
            ours = any(f is installed for f in _patches)
            _patches[:] = [f for f in _patches if f is not _speculative_sampling]
            if ours:
                gu._speculative_sampling = _patches[-1] if _patches else _unpatched[0]
            else:
                logger.warning(
                    "patch_speculative_sampling: _speculative_sampling was replaced again inside the "
                    "block; leaving the newer replacement in place"
                )
            if not _patches:
                _unpatched.clear()
