"""Two more samplers with the :func:`specjax.rejection_sample` contract: NumPy and torch.

* :func:`numpy_rejection_sample` (sampler ``numpy``): a float64 reference written
  as plain loops over rows and draft positions, for checking other samplers.
* :func:`torch_rejection_sample` (sampler ``torch``): a vectorized pure-torch
  implementation, for users without JAX on the path. This module never imports
  JAX: a JAX array given to the torch sampler crosses with ``torch.from_dlpack``.

The contract (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318; vocabulary as in :mod:`specjax.kernels.rejection`), per row:
test ``i`` passes iff ``u_i < p_i(x_i) / q_i(x_i)`` (``q_i(x_i) = 0`` passes iff
``p_i(x_i) > 0``); ``n`` counts the tests passed before the first failure; the
emitted token ``y`` is the smallest ``v`` whose normalised cumulative weight
exceeds ``s``, the weights being ``max(p_n − q_n, 0)`` if ``n < G`` or ``p_G``
if ``n = G``; weights summing to zero are replaced by ``p_n``; if rounding
leaves no cumulative value above ``s``, ``y`` is the largest ``v`` with positive
weight. ``tokens`` holds ``x_0 .. x_{n-1}``, ``y``, then -1. With
``validate=False`` (no value checks), a draft id outside [0, V) (-1, V, or an
int64 id >= 2**31) has probability 0 under both ``p_i`` and ``q_i``, so its
test fails and it is never accepted or emitted: all three samplers agree.

Precision, and when the three samplers agree
--------------------------------------------
``numpy`` computes in float64 on the inputs as given (converted exactly to
float64) and compares ``cumsum(w) / Σw > s``. ``torch`` computes in the wider of
the input dtype and float32, like the JAX kernel (so float16/bfloat16 inputs
are widened to float32, float64 stays float64), and compares
``cumsum(w) <= s · Σw`` as the kernel does; its cumulative sum is sequential
where the kernel's is blocked. On inputs whose arithmetic is exact in float32
(for instance probabilities and uniforms that are multiples of 2^-10 with
row sums at most 1) the three give identical results. On general float32
inputs they can differ only where ``u_i`` is within rounding of
``p_i(x_i)/q_i(x_i)`` or ``s`` within rounding of a cumulative boundary (a
tie; about one draw in 10^6 to 10^7 for float32).

Return types: ``numpy`` returns NumPy int32 arrays, ``torch`` returns torch int32
tensors on the device of ``target_probs``; the generation loop converts either
with ``np.asarray`` / ``.cpu().numpy()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from specjax.boundary.byte_order import native_byte_order
from specjax.kernels.results import AcceptanceResult

__all__ = ["numpy_rejection_sample", "torch_rejection_sample"]

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


# --------------------------------------------------------------------------- #
# Shared checks (shapes and dtypes; values when validate=True)
# --------------------------------------------------------------------------- #


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _is_jax(x: Any) -> bool:
    return type(x).__module__.split(".")[0] in ("jax", "jaxlib")


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _check_rank(name: str, x: Any, rank: int, letters: tuple[str, ...]) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} with shape ({', '.join(letters)}), got shape {tuple(x.shape)}")


def _check_shape(name: str, x: Any, expected: tuple[int, ...], letters: tuple[str, ...]) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name}: expected shape ({', '.join(letters)}) = {expected}, got {tuple(x.shape)}")


def _check_structure(x: Any, q: Any, p: Any, u: Any, s: Any) -> tuple[int, int, int]:
    """Ranks, shapes and dtypes of the five inputs; returns (B, G, V)."""
    _check_rank("draft_tokens", x, 2, ("B", "G"))
    if q is not None:  # None: point masses at the draft tokens
        _check_rank("draft_probs", q, 3, ("B", "G", "V"))
    _check_rank("target_probs", p, 3, ("B", "G+1", "V"))
    _check_rank("accept_uniforms", u, 2, ("B", "G"))
    _check_rank("sample_uniforms", s, 1, ("B",))
    b, g = (int(d) for d in x.shape)
    vocab = int(p.shape[2])
    _check_shape("target_probs", p, (b, g + 1, vocab), ("B", "G+1", "V"))
    if q is not None:
        _check_shape("draft_probs", q, (b, g, vocab), ("B", "G", "V"))
    _check_shape("accept_uniforms", u, (b, g), ("B", "G"))
    _check_shape("sample_uniforms", s, (b,), ("B",))
    if vocab == 0:
        raise ValueError("target_probs: expected a vocabulary size V >= 1, got V = 0")
    dt = _dtype_name(x)
    if not (dt.startswith("int") or dt.startswith("uint")):
        raise ValueError(f"draft_tokens: expected integer token ids (int32 or int64), got {dt}")
    for name, arr in (("draft_probs", q), ("target_probs", p), ("accept_uniforms", u), ("sample_uniforms", s)):
        if arr is not None and _dtype_name(arr) not in _FLOAT_NAMES:
            raise ValueError(
                f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), got {_dtype_name(arr)}"
            )
    return b, g, vocab


def _check_values(vocab: int, x: np.ndarray, q: np.ndarray | None, p: np.ndarray, u: np.ndarray, s: np.ndarray) -> None:
    """Value checks on host arrays (float arrays in float64)."""
    if x.size and (x.min() < 0 or x.max() >= vocab):
        raise ValueError(
            f"draft_tokens: expected token ids in [0, V) = [0, {vocab}), got values in [{x.min()}, {x.max()}]"
        )
    for name, arr in (("draft_probs", q), ("target_probs", p)):
        if arr is None:
            continue
        bad = int(np.sum(~np.isfinite(arr)))
        if bad:
            raise ValueError(f"{name}: expected finite probabilities, got {bad} NaN or infinite values")
        neg = int(np.sum(arr < 0))
        if neg:
            raise ValueError(f"{name}: expected non-negative probabilities, got {neg} negative values")
    if p.size and np.min(p.sum(axis=-1)) <= 0:
        raise ValueError("target_probs: expected every distribution p_i to have a positive sum, got a row summing to 0")
    for name, arr in (("accept_uniforms", u), ("sample_uniforms", s)):
        if arr.size and not np.all((arr >= 0) & (arr < 1)):
            raise ValueError(
                f"{name}: expected values in [0, 1), got values in [{np.nanmin(arr)}, {np.nanmax(arr)}]"
                + (" including NaN" if np.any(np.isnan(arr)) else "")
            )


# --------------------------------------------------------------------------- #
# NumPy, float64
# --------------------------------------------------------------------------- #


def _as_numpy(name: str, x: Any) -> np.ndarray:
    if x is None:
        raise ValueError(f"{name}: expected an array, got None")
    if _is_torch(x):
        t = x.detach().cpu()
        if t.dtype.is_floating_point and t.dtype.itemsize < 4:
            t = t.float()  # float16/bfloat16 -> float32 is exact; NumPy has no bfloat16
        return t.numpy()
    try:
        arr = np.asarray(x)
    except ValueError as err:  # ragged nested lists
        raise ValueError(f"{name}: expected a rectangular array, got a ragged nested list") from err
    if arr.dtype == object:
        raise ValueError(f"{name}: expected a list, NumPy array, JAX array or torch tensor, got {type(x).__name__}")
    return native_byte_order(arr)


def _point_masses(x: np.ndarray, vocab: int, dtype: Any) -> np.ndarray:
    """f[B, G, V]: ``q_i(v) = [v == x_i]`` (the reference samplers' point masses; ids outside [0, V) give 0 rows)."""
    return (x[:, :, None] == np.arange(vocab)[None, None, :]).astype(dtype)


def numpy_rejection_sample(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    validate: bool = True,
) -> AcceptanceResult:
    """The contract in float64, row by row (a reference for checking other samplers).

    Args:
      draft_tokens: i32/i64[B, G], ``x_i`` in [0, V).
      draft_probs: f[B, G, V], ``q_i``; or None for point masses at the draft
        tokens (``q_i(v) = [v == x_i]``, as :func:`specjax.rejection_sample`).
      target_probs: f[B, G+1, V], ``p_i``.
      accept_uniforms: f[B, G], ``u_i`` in [0, 1).
      sample_uniforms: f[B], ``s`` in [0, 1).
      validate: also check values (token range, finite non-negative
        probabilities, uniforms in [0, 1)); shapes and dtypes are always checked.

    Inputs may be lists, NumPy arrays, JAX arrays or torch tensors (copied to
    the host). Probabilities and uniforms are converted to float64 exactly.

    Returns:
      :class:`~specjax.kernels.results.AcceptanceResult` ``(num_accepted: i32[B],
      tokens: i32[B, G+1])`` of NumPy arrays.

    Raises:
      ValueError: naming the argument, with what was expected and what was got.
    """
    x = _as_numpy("draft_tokens", draft_tokens)
    q = None if draft_probs is None else _as_numpy("draft_probs", draft_probs)
    p = _as_numpy("target_probs", target_probs)
    u = _as_numpy("accept_uniforms", accept_uniforms)
    s = _as_numpy("sample_uniforms", sample_uniforms)
    batch, num_draft, vocab = _check_structure(x, q, p, u, s)
    x = x.astype(np.int64)
    p, u, s = (a.astype(np.float64) for a in (p, u, s))
    if q is None:
        q = _point_masses(x, vocab, np.float64)
    else:
        q = q.astype(np.float64)
    if validate:
        _check_values(vocab, x, q, p, u, s)

    num_accepted = np.zeros(batch, np.int32)
    tokens = np.full((batch, num_draft + 1), -1, np.int32)
    for b in range(batch):
        n = 0
        for i in range(num_draft):
            xi = x[b, i]  # an id outside [0, V) has probability 0 on both sides (validate=False)
            p_x, q_x = (p[b, i, xi], q[b, i, xi]) if 0 <= xi < vocab else (0.0, 0.0)
            passed = (u[b, i] < p_x / q_x) if q_x > 0 else (p_x > 0)
            if not passed:
                break
            n += 1
        w = np.maximum(p[b, n] - q[b, n], 0.0) if n < num_draft else p[b, num_draft].copy()
        if not w.sum() > 0:
            w = p[b, n].copy()
        if not w.sum() > 0:
            raise ValueError(
                f"target_probs: expected every distribution p_i to have a positive sum, got row {b}, "
                f"position {n} summing to 0"
            )
        cdf = np.cumsum(w)
        above = np.flatnonzero(cdf / cdf[-1] > s[b])
        y = int(above[0]) if above.size else int(np.flatnonzero(w > 0)[-1])
        num_accepted[b] = n
        tokens[b, :n] = x[b, :n]
        tokens[b, n] = y
    return AcceptanceResult(num_accepted, tokens)


# --------------------------------------------------------------------------- #
# torch, vectorized
# --------------------------------------------------------------------------- #


# DLPack device types torch imports: CPU, CUDA, CUDA host memory, ROCm
_TORCH_DLPACK_DEVICES = frozenset({1, 2, 3, 10})


def _torch_can_import(x: Any) -> bool:
    """Whether ``torch.from_dlpack`` takes ``x``: a TPU array (JAX refuses to export it) is copied to the host."""
    try:
        return int(x.__dlpack_device__()[0]) in _TORCH_DLPACK_DEVICES
    except Exception:  # no __dlpack_device__, or the producer refuses: copy through the host
        return False


def _as_torch(name: str, x: Any) -> Any:
    import torch

    if x is None:
        raise ValueError(f"{name}: expected an array, got None")
    if isinstance(x, torch.Tensor):
        return x
    if (_is_jax(x) or (hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray))) and _torch_can_import(x):
        return torch.from_dlpack(x)  # zero-copy; JAX is not imported here
    arr = _as_numpy(name, x)
    if arr.dtype.name == "bfloat16":  # ml_dtypes
        arr = arr.astype(np.float32)
    if arr.dtype.kind not in "biuf":
        raise ValueError(
            f"{name}: expected numbers (a list, NumPy array, JAX array or torch tensor), "
            f"got {type(x).__name__} of dtype {arr.dtype}"
        )
    return torch.from_numpy(np.ascontiguousarray(arr))


def torch_rejection_sample(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    validate: bool = True,
) -> AcceptanceResult:
    """The contract in vectorized torch (no JAX needed).

    Args:
      draft_tokens: i32/i64[B, G], ``x_i`` in [0, V).
      draft_probs: f[B, G, V], ``q_i``; or None for point masses at the draft
        tokens (``q_i(v) = [v == x_i]``, as :func:`specjax.rejection_sample`).
      target_probs: f[B, G+1, V], ``p_i``.
      accept_uniforms: f[B, G], ``u_i`` in [0, 1).
      sample_uniforms: f[B], ``s`` in [0, 1).
      validate: also check values (one device→host sync); shapes and dtypes
        are always checked.

    Inputs may be torch tensors, NumPy arrays, lists, or JAX arrays (which cross
    zero-copy with ``torch.from_dlpack``; JAX itself is never imported). All are
    moved to ``target_probs``' device. Probabilities and uniforms are compared
    in the wider of the probabilities' dtype and float32.

    Returns:
      :class:`~specjax.kernels.results.AcceptanceResult` ``(num_accepted: i32[B],
      tokens: i32[B, G+1])`` of torch int32 tensors on ``target_probs``' device.

    Raises:
      ValueError: naming the argument, with what was expected and what was got.
    """
    import torch

    x = _as_torch("draft_tokens", draft_tokens)
    q = None if draft_probs is None else _as_torch("draft_probs", draft_probs)
    p = _as_torch("target_probs", target_probs)
    u = _as_torch("accept_uniforms", accept_uniforms)
    s = _as_torch("sample_uniforms", sample_uniforms)
    batch, num_draft, vocab = _check_structure(x, q, p, u, s)
    device = p.device
    x, u, s = (t.to(device) for t in (x, u, s))
    if q is None:  # point masses at the draft tokens
        q = torch.from_numpy(_point_masses(x.cpu().to(torch.int64).numpy(), vocab, np.float32)).to(device, p.dtype)
    else:
        q = q.to(device)
    ct = torch.promote_types(torch.promote_types(q.dtype, p.dtype), torch.float32)
    if validate:
        _check_values(
            vocab,
            x.cpu().to(torch.int64).numpy(),
            q.cpu().double().numpy(),
            p.cpu().double().numpy(),
            u.cpu().double().numpy(),
            s.cpu().double().numpy(),
        )

    x = x.to(torch.int64)
    rows = torch.arange(batch, device=device)
    # Gather p_i(x_i), q_i(x_i) first: B·G scalars. An id outside [0, V) (validate=False)
    # has probability 0 on both sides, so it is never accepted.
    inside = (x >= 0) & (x < vocab)
    xc = torch.where(inside, x, torch.zeros_like(x))[:, :, None]
    p_x = torch.where(inside, torch.gather(p[:, :num_draft], 2, xc)[:, :, 0], 0).to(ct)
    q_x = torch.where(inside, torch.gather(q, 2, xc)[:, :, 0], 0).to(ct)
    u = u.to(ct)
    passes = torch.where(q_x > 0, u < p_x / torch.where(q_x > 0, q_x, torch.ones_like(q_x)), p_x > 0)
    n = torch.cumprod(passes.to(torch.int32), dim=1).sum(dim=1, dtype=torch.int64)

    p_n = p[rows, n].to(ct)  # [B, V]
    if num_draft > 0:
        q_n = q[rows, torch.clamp(n, max=num_draft - 1)].to(ct)
        q_n = torch.where((n < num_draft)[:, None], q_n, torch.zeros_like(q_n))
    else:
        q_n = torch.zeros_like(p_n)
    w = torch.clamp(p_n - q_n, min=0)
    w = torch.where(w.sum(dim=1, keepdim=True) > 0, w, p_n)

    cdf = torch.cumsum(w, dim=1)
    threshold = s.to(ct) * cdf[:, -1]
    y = (cdf <= threshold[:, None]).sum(dim=1)  # smallest v with cdf(v) > s·Σw, or V
    lanes = torch.arange(vocab, device=device)
    last_positive = torch.where(w > 0, lanes, torch.full_like(lanes, -1)).amax(dim=1)
    # no positive weight at all (negative probabilities, validate=False): V - 1 as the JAX kernel, never -1
    y = torch.where(y < vocab, y, torch.where(last_positive >= 0, last_positive, vocab - 1))

    positions = torch.arange(num_draft + 1, device=device)[None, :]
    padded = torch.cat([x, torch.full((batch, 1), -1, dtype=torch.int64, device=device)], dim=1)
    tokens = torch.where(
        positions < n[:, None], padded, torch.where(positions == n[:, None], y[:, None], torch.full_like(padded, -1))
    )
    return AcceptanceResult(n.to(torch.int32), tokens.to(torch.int32))
