"""Input conversion and validation at the kernels' public boundary (outside jit).

Messages have the form ``draft_probs: expected shape (B, G, V) = (2, 3, 50), got
(2, 4, 50)`` so that a user sees which argument is wrong and what was expected.
Shape and dtype checks are free (no device sync); value checks need one
device→host transfer and are skipped with ``validate=False``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:  # the kernels never import torch; a tensor is recognised by its module
    import torch

# What the public functions take as an array argument: JAX and NumPy arrays,
# torch tensors (crossed without a copy where possible), nested sequences of numbers.
ArrayInput: TypeAlias = "jax.Array | np.ndarray | torch.Tensor | Sequence[Any]"
# A per-row parameter: one Python number for every row, or one value per row.
FloatOrRows: TypeAlias = "float | ArrayInput"
IntOrRows: TypeAlias = "int | ArrayInput"

_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def as_array(name: str, x: Any) -> Any:
    """Convert a list, NumPy array, JAX array or torch tensor without changing its dtype.

    Returns a NumPy array or a JAX array. torch tensors cross zero-copy: CUDA
    tensors through :func:`specjax.adapters.to_jax` (DLPack; it also turns
    int64 ids into int32 with a range check), CPU tensors as NumPy views where
    :func:`host_view` allows, else through ``to_jax`` too.
    """
    if x is None:
        raise ValueError(f"{name}: expected an array, got None")
    if isinstance(x, jax.Array | np.ndarray):
        return x
    if _is_torch(x):
        view = host_view(x)
        if view is not None:
            return view
        from specjax.adapters import to_jax  # lazy: kernels do not depend on torch

        try:
            return to_jax(x)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from err
    if isinstance(x, list | tuple | int | float | np.generic):
        try:
            return np.asarray(x)
        except ValueError as err:  # ragged nested lists
            raise ValueError(f"{name}: expected a rectangular array, got a ragged nested list") from err
    if hasattr(x, "__array__"):
        return np.asarray(x)
    raise ValueError(f"{name}: expected a list, NumPy array, JAX array or torch tensor, got {type(x).__name__}")


@functools.cache
def jax_on_cpu() -> bool:
    """Whether JAX's default backend is the CPU (then NumPy arguments of a jitted call are aliased)."""
    return jax.default_backend() == "cpu"


_VIEW_ALIGNMENT = 64  # XLA:CPU aliases host buffers aligned to this; others it copies


def host_view(x: Any) -> np.ndarray | None:
    """A CPU torch tensor as a NumPy view of its memory, when the jitted kernels can alias it; else None.

    On a CPU-only JAX, a NumPy argument of a jitted function whose buffer is
    64-byte aligned is used in place (no copy), and it is far cheaper than a
    DLPack import first (``benchmarks/bench_overheads.py``, docs/benchmarks.md).
    So CPU tensors take this route when nothing would be lost: integer tensors
    (token ids or per-row parameters, a few numbers, which the callers check
    and narrow on the host), and contiguous, aligned float16/float32 tensors.
    Everything else, including any tensor when JAX has a GPU (the kernel must
    run where the tensor is), goes through :func:`specjax.adapters.to_jax`,
    which copies explicitly and counts the copy when one is needed.
    """
    import torch  # only called with torch tensors

    if not x.is_cpu or not jax_on_cpu() or x.layout != torch.strided:
        return None
    if x.is_floating_point():
        if x.dtype not in (torch.float16, torch.float32) or not x.is_contiguous():
            return None
        if x.numel() and x.data_ptr() % _VIEW_ALIGNMENT:
            return None
    elif x.is_complex() or x.dtype == torch.bool:
        return None
    try:
        return (x.detach() if x.requires_grad else x).numpy()
    except (RuntimeError, TypeError):  # e.g. a negative-bit view, or a dtype NumPy lacks
        return None


def token_ids_unchecked(x: Any, validate: bool) -> Any:
    """With ``validate=False``, a CPU torch int64 tensor of ids narrowed to int32 by torch.

    ``validate=False`` skips the value checks, among them that ids lie in [0, V);
    the int32 range check that :func:`as_token_ids` makes before narrowing is a
    weaker one, and costs more at the boundary than narrowing in torch does.
    Ids are clamped to [-1, 2**31 - 1] first: narrowing alone would wrap an id
    >= 2**31 into [0, V), where it could be accepted; clamped, it stays outside
    [0, V) and has probability 0. Anything else is returned as it is.
    """
    if (
        not validate
        and _is_torch(x)
        and x.is_cpu
        and x.element_size() == 8
        and not (x.is_floating_point() or x.is_complex())
    ):
        return x.long().clamp(-1, _INT32_MAX).int()
    return x


def dtype_name(x: Any) -> str:
    """The name of ``x.dtype`` ("float32", "bfloat16", ...)."""
    return _dtype_name(x.dtype)


@functools.lru_cache(maxsize=128)
def _dtype_name(dt: Any) -> str:
    # NumPy computes .name in Python; the boundary asks for it several times a call.
    return dt.name if hasattr(dt, "name") else np.dtype(dt).name


def check_float(name: str, x: Any) -> None:
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), got {dt}")


@functools.lru_cache(maxsize=128)
def _is_integer(dt: Any) -> bool:
    return _dtype_name(dt) != "bool" and bool(jnp.issubdtype(dt, jnp.integer))


def as_token_ids(name: str, x: Any) -> Any:
    """Integer token ids as int32; int64 values are range-checked before narrowing."""
    dt = x.dtype
    if isinstance(x, np.ndarray) and x.size == 0 and dt == np.float64:
        return x.astype(np.int32)  # an empty Python list (G = 0): NumPy makes it float64
    if not _is_integer(dt):
        raise ValueError(f"{name}: expected integer token ids (int32 or int64), got {dtype_name(x)}")
    if isinstance(x, np.ndarray) and x.dtype != np.int32:
        if x.size and (x.max() > _INT32_MAX or x.min() < _INT32_MIN):
            raise ValueError(f"{name}: token ids must fit in int32, got values in [{x.min()}, {x.max()}]")
        return x.astype(np.int32)
    if x.dtype != jnp.int32:
        return x.astype(jnp.int32)
    return x


def check_rank(name: str, x: Any, rank: int, letters: Sequence[str]) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name}: expected rank {rank} with shape ({', '.join(letters)}), got shape {tuple(x.shape)}")


def check_shape(name: str, x: Any, expected: tuple[int, ...], letters: Sequence[str]) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape ({', '.join(letters)}) = {tuple(expected)}, got {tuple(x.shape)}")


@jax.jit
def _kernel_value_summary(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms):
    def bad(x):
        x32 = x.astype(jnp.float32)
        return jnp.sum(~jnp.isfinite(x32)), jnp.sum(x32 < 0)

    dp_nonfinite, dp_neg = bad(draft_probs) if draft_probs is not None else (0, 0)
    tp_nonfinite, tp_neg = bad(target_probs)
    u = accept_uniforms
    s = sample_uniforms
    big = jnp.asarray(jnp.iinfo(jnp.int32).max, jnp.int32)
    return {
        "tok_min": jnp.min(draft_tokens, initial=big),
        "tok_max": jnp.max(draft_tokens, initial=-1),
        "draft_probs_nonfinite": dp_nonfinite,
        "draft_probs_negative": dp_neg,
        "target_probs_nonfinite": tp_nonfinite,
        "target_probs_negative": tp_neg,
        "target_row_sum_min": jnp.min(jnp.sum(target_probs.astype(jnp.float32), axis=-1), initial=jnp.inf),
        "u_bad": jnp.sum(~((u >= 0) & (u < 1))),
        "u_min": jnp.min(u.astype(jnp.float32), initial=jnp.inf),
        "u_max": jnp.max(u.astype(jnp.float32), initial=-jnp.inf),
        "s_bad": jnp.sum(~((s >= 0) & (s < 1))),
        "s_min": jnp.min(s.astype(jnp.float32), initial=jnp.inf),
        "s_max": jnp.max(s.astype(jnp.float32), initial=-jnp.inf),
    }


def check_uniform_values_host(name: str, x: np.ndarray) -> None:
    """Range check of uniforms done on the host in their own precision (before any narrowing)."""
    if x.size == 0:
        return
    bad = ~((x >= 0) & (x < 1))
    if np.any(bad):
        raise ValueError(
            f"{name}: expected values in [0, 1), got values in [{np.nanmin(x)}, {np.nanmax(x)}]"
            + (" including NaN" if np.any(np.isnan(x)) else "")
        )


def convert_kernel_inputs(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    validate: bool,
) -> tuple[Any, Any, Any, Any, Any]:
    """Convert and check the five inputs of :func:`specjax.rejection_sample`."""
    # float64 torch uniforms reach JAX as float32 (0.99999999 rounds to 1.0): with
    # validate, keep a float64 host copy to range-check in their own precision, as
    # NumPy float64 uniforms are below.
    wide = {}
    if validate:
        for name, x in (("accept_uniforms", accept_uniforms), ("sample_uniforms", sample_uniforms)):
            if _is_torch(x) and x.dtype.is_floating_point and x.element_size() == 8:
                wide[name] = x.detach().cpu().numpy()
    draft_tokens = as_array("draft_tokens", token_ids_unchecked(draft_tokens, validate))
    point_mass = draft_probs is None  # q_i is the point mass at x_i
    if not point_mass:
        draft_probs = as_array("draft_probs", draft_probs)
    target_probs = as_array("target_probs", target_probs)
    accept_uniforms = as_array("accept_uniforms", accept_uniforms)
    sample_uniforms = as_array("sample_uniforms", sample_uniforms)

    check_rank("draft_tokens", draft_tokens, 2, "BG")
    if not point_mass:
        check_rank("draft_probs", draft_probs, 3, "BGV")
    check_rank("target_probs", target_probs, 3, ("B", "G+1", "V"))
    check_rank("accept_uniforms", accept_uniforms, 2, "BG")
    check_rank("sample_uniforms", sample_uniforms, 1, "B")
    b, g = draft_tokens.shape
    vocab = target_probs.shape[2]
    check_shape("target_probs", target_probs, (b, g + 1, vocab), ("B", "G+1", "V"))
    if not point_mass:
        check_shape("draft_probs", draft_probs, (b, g, vocab), "BGV")
    check_shape("accept_uniforms", accept_uniforms, (b, g), "BG")
    check_shape("sample_uniforms", sample_uniforms, (b,), "B")
    if vocab == 0:
        raise ValueError("target_probs: expected a vocabulary size V >= 1, got V = 0")

    for name, x in (
        ("draft_probs", draft_probs),
        ("target_probs", target_probs),
        ("accept_uniforms", accept_uniforms),
        ("sample_uniforms", sample_uniforms),
    ):
        if x is not None:
            check_float(name, x)
    host_checked = set()
    if validate:
        # NumPy uniforms are range-checked in their own precision, before JAX may
        # narrow float64 to float32 (where 0.99999999 rounds to 1.0).
        for name, x in (("accept_uniforms", accept_uniforms), ("sample_uniforms", sample_uniforms)):
            host = wide.get(name, x)
            if isinstance(host, np.ndarray):
                check_uniform_values_host(name, host)
                host_checked.add(name)
    draft_tokens = as_token_ids("draft_tokens", draft_tokens)

    if validate and b > 0:
        summary = jax.device_get(
            _kernel_value_summary(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
        )
        if g > 0 and (summary["tok_min"] < 0 or summary["tok_max"] >= vocab):
            raise ValueError(
                f"draft_tokens: expected token ids in [0, V) = [0, {vocab}), "
                f"got values in [{summary['tok_min']}, {summary['tok_max']}]"
            )
        for name in ("target_probs",) if point_mass else ("draft_probs", "target_probs"):
            if summary[f"{name}_nonfinite"]:
                raise ValueError(
                    f"{name}: expected finite probabilities, got {summary[f'{name}_nonfinite']} NaN or infinite values"
                )
            if summary[f"{name}_negative"]:
                raise ValueError(
                    f"{name}: expected non-negative probabilities, got {summary[f'{name}_negative']} negative values"
                )
        if summary["target_row_sum_min"] <= 0:
            raise ValueError(
                "target_probs: expected every distribution p_i to have a positive sum, got a row summing to 0"
            )
        if summary["u_bad"] and "accept_uniforms" not in host_checked:
            raise ValueError(
                f"accept_uniforms: expected values in [0, 1), got values in [{summary['u_min']}, {summary['u_max']}]"
            )
        if summary["s_bad"] and "sample_uniforms" not in host_checked:
            raise ValueError(
                f"sample_uniforms: expected values in [0, 1), got values in [{summary['s_min']}, {summary['s_max']}]"
            )

    return tuple(  # type: ignore[return-value]
        None if x is None else for_jit(x)
        for x in (draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)
    )


def for_jit(x: Any) -> Any:
    """A converted input (NumPy or JAX) as the jitted kernels take it, read by one or more calls.

    JAX arrays as they are; NumPy arrays too on a CPU-only JAX, where every
    jitted call uses an aligned host buffer in place (``jnp.asarray`` would cost
    a Python-level conversion per input, and a fresh array that the call then
    reads more slowly); elsewhere moved to the device once, so that a value
    check and the step do not each transfer it.
    """
    if isinstance(x, jax.Array) or jax_on_cpu():
        return x
    return jnp.asarray(x)
