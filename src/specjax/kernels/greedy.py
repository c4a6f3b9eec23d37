"""The acceptance step of a greedy target, on host arrays (NumPy), from the target's argmax.

With a greedy target (temperature 0), ``p_i`` is the point mass at ``a_i``,
the first argmax of the target's logits at position i. Then ``min(1, p/q)``
is 1 at ``a_i`` and 0 elsewhere, whatever the draft's ``q``: a draft token
passes iff it is ``a_i``, and both the residual at the first failure and the
bonus token are ``a_n``. No uniform, key or probability enters, so the step
is decided by comparing integers once the argmax is known.

This is the point-mass case of the kernel's contract
(:func:`specjax.kernels.steps.verify_step`,
:func:`specjax.kernels.flat.accept`), kept on the host because a caller that
already holds the logits in torch reaches the argmax with one torch
reduction, where the jitted step costs a dispatch, a summary of every row and
a sync (docs/design.md, "Host synchronisation"). Its callers:
:func:`specjax.generate.loop.greedy_verify` (the loop's all-greedy steps) and
the vLLM plugin's all-greedy steps (:mod:`specjax.plugin.vllm`).
``tests/test_greedy_verify.py`` checks both against the JAX steps, token for
token.

No JAX, no torch: NumPy in and out.
"""

from __future__ import annotations

import numpy as np

__all__ = ["accept_greedy"]


def accept_greedy(
    draft_tokens: np.ndarray, target_argmax: np.ndarray, num_draft_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Accepted counts and emitted tokens of a greedy target.

    Args:
      draft_tokens: int[B, G], ``x_i`` (any value at positions >= ``k_b``).
      target_argmax: int[B, G+1], ``a_i``: the target's first argmax at each
        position (position ``k_b`` gives the bonus token; positions past it
        are never read).
      num_draft_tokens: int[B], ``k_b`` in [0, G].

    Returns:
      ``(n, tokens)``: i64[B] accepted counts (the longest prefix of the first
      ``k_b`` positions where ``x_i == a_i``) and i32[B, G+1] tokens: the
      accepted draft tokens, then ``a_n``, then -1 (the kernel's output
      contract).
    """
    b, g = draft_tokens.shape
    cols = np.arange(g + 1)[None, :]
    passed = (draft_tokens == target_argmax[:, :g]) & (cols[:, :g] < num_draft_tokens[:, None])
    n = np.cumprod(passed, axis=1).sum(axis=1).astype(np.int64)
    padded = np.concatenate([draft_tokens, np.zeros((b, 1), draft_tokens.dtype)], axis=1)
    emitted = np.where(cols == n[:, None], target_argmax, -1)
    return n, np.where(cols < n[:, None], padded, emitted).astype(np.int32)
