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
:func:`specjax.generate.verify.greedy_verify` (the loop's all-greedy steps) and
the vLLM plugin's all-greedy steps (:mod:`specjax.plugin.vllm`).
``tests/test_greedy_verify.py`` checks both against the JAX steps, token for
token.

No JAX, no torch: NumPy in and out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["accept_greedy", "greedy_row"]


def greedy_row(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """One row's emitted tokens: the accepted draft prefix, then the target's choice there.

    Args:
      draft_tokens: the row's ``k`` draft tokens ``x_0 .. x_{k-1}``.
      target_argmax: ``k + 1`` ids, ``a_0 .. a_k``: the target's first argmax at
        each draft position and after the last (the bonus token).

    Returns:
      ``x_0 .. x_{n-1}, a_n``: ``n`` is the length of the longest prefix with
      ``x_i == a_i``.
    """
    n = 0
    for x, a in zip(draft_tokens, target_argmax, strict=False):  # target_argmax: one id more
        if x != a:
            break
        n += 1
    return [*draft_tokens[:n], target_argmax[n]]


def accept_greedy(
    draft_tokens: np.ndarray, target_argmax: np.ndarray, draft_lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Accepted counts and emitted tokens of a greedy target, on a (B, G) grid (:func:`greedy_row` per row).

    Args:
      draft_tokens: int[B, G], ``x_i`` (any value at positions >= ``k_b``).
      target_argmax: int[B, G+1], ``a_i``: the target's first argmax at each
        position (position ``k_b`` gives the bonus token; positions past it
        are never read).
      draft_lengths: int[B], ``k_b`` in [0, G].

    Returns:
      ``(n, tokens)``: i64[B] accepted counts and i32[B, G+1] tokens: the
      accepted draft tokens, then ``a_n``, then -1 (the kernel's output
      contract).
    """
    b, g = draft_tokens.shape
    tokens = np.full((b, g + 1), -1, np.int32)
    n = np.zeros(b, np.int64)
    drafts, best = draft_tokens.tolist(), target_argmax.tolist()
    for row, k in enumerate(draft_lengths.tolist()):
        emitted = greedy_row(drafts[row][:k], best[row][: k + 1])
        tokens[row, : len(emitted)] = emitted
        n[row] = len(emitted) - 1
    return n, tokens
