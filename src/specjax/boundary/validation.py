"""Conversion and validation of user inputs at the public boundary (outside jit).

Above :mod:`specjax.kernels` (which take and return JAX arrays only) and
:mod:`specjax.adapters` (torch ↔ JAX): lists, NumPy and JAX arrays and torch
tensors come in here and leave as arrays the jitted kernels take.

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

from specjax.adapters.host import host_view, int32_range_error, jax_on_cpu
from specjax.adapters.jax_view import torchax_array
from specjax.boundary.byte_order import native_byte_order
from specjax.kernels import cpu_kernels
from specjax.kernels.frontend import TEMPERATURE_RANGE
from specjax.kernels.types import SamplingParams

if TYPE_CHECKING:  # torch is not imported here; a tensor is recognised by its module
    import torch

# What the public functions take as an array argument: JAX and NumPy arrays,
# torch tensors (crossed without a copy where possible), nested sequences of numbers.
ArrayInput: TypeAlias = "jax.Array | np.ndarray | torch.Tensor | Sequence[Any]"
# A per-row parameter: one Python number for every row, or one value per row.
FloatOrRows: TypeAlias = "float | ArrayInput"
IntOrRows: TypeAlias = "int | ArrayInput"

_INT32_MAX = int(np.iinfo(np.int32).max)
_INT32_MIN = np.iinfo(np.int32).min

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def as_array(name: str, x: Any) -> Any:
    """Convert a list, NumPy array, JAX array or torch tensor without changing its dtype.

    Returns a NumPy array or a JAX array. torch tensors cross zero-copy: CUDA
    tensors through :func:`specjax.adapters.to_jax` (DLPack; it also turns
    int64 ids into int32 with a range check), CPU tensors as NumPy views where
    :func:`host_view` allows, else through ``to_jax`` too; a torchax tensor is
    the ``jax.Array`` it holds (:mod:`specjax.adapters.jax_view`).
    """
    if x is None:
        raise ValueError(f"{name}: expected an array, got None")
    if _is_torch(x):  # first: jax.Array is an ABC, whose isinstance test is slow for other types
        view = host_view(x)
        if view is not None:
            return view
        from specjax.adapters.dlpack import to_jax  # lazy: torch is loaded only for torch inputs

        try:
            return to_jax(x)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from err
    held = torchax_array(x)  # before the __array__ fallback below, which would copy it to the host
    if held is not None:
        return held
    if isinstance(x, np.ndarray):
        return native_byte_order(x)
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, list | tuple | int | float | np.generic):
        try:
            return native_byte_order(np.asarray(x))
        except ValueError as err:  # ragged nested lists
            raise ValueError(f"{name}: expected a rectangular array, got a ragged nested list") from err
    if hasattr(x, "__array__"):
        return native_byte_order(np.asarray(x))
    raise ValueError(f"{name}: expected a list, NumPy array, JAX array or torch tensor, got {type(x).__name__}")


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


_INT32 = np.dtype(np.int32)


def as_token_ids(name: str, x: Any) -> Any:
    """Integer token ids as int32; int64 values are range-checked before narrowing."""
    dt = x.dtype
    if dt is _INT32:  # the common case, first: NumPy's and JAX's native int32 are this one object
        return x
    if isinstance(x, np.ndarray) and x.size == 0 and dt == np.float64:
        return x.astype(np.int32)  # an empty Python list (G = 0): NumPy makes it float64
    if not _is_integer(dt):
        raise ValueError(f"{name}: expected integer token ids (int32 or int64), got {dtype_name(x)}")
    if isinstance(x, np.ndarray) and x.dtype != np.int32:
        if x.size and (x.max() > _INT32_MAX or x.min() < _INT32_MIN):
            raise ValueError(f"{name}: {int32_range_error(int(x.min()), int(x.max()))}")
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


# --------------------------------------------------------------------------- #
# Keys and per-row sampling parameters (the logits front end's boundary)
# --------------------------------------------------------------------------- #


def as_key(key: Any, batch: int) -> jax.Array:
    """A typed JAX PRNG key of shape () or (B,); raw uint32 keys are wrapped."""
    if type(key) is _key_array_type() and key.shape in ((), (batch,)):  # the common case, first
        return key
    if key is None:
        raise ValueError("key: expected a JAX PRNG key (jax.random.key(seed)), or one per row of shape (B,), got None")
    if not isinstance(key, jax.Array):
        raise ValueError(f"key: expected a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__}")
    if _is_key_dtype(key.dtype):
        typed = key
    elif key.dtype == jnp.uint32 and key.ndim >= 1:
        try:
            typed = jax.random.wrap_key_data(key)
        except (TypeError, ValueError) as err:  # raw key data of the wrong trailing shape
            raise ValueError(
                f"key: expected a JAX PRNG key (jax.random.key(seed)), or raw uint32 key data of the default "
                f"implementation's shape, got a uint32 array of shape {tuple(key.shape)} ({_first_line(err)})"
            ) from None
    else:
        raise ValueError(f"key: expected a JAX PRNG key (jax.random.key(seed)), got an array of dtype {key.dtype}")
    if typed.shape not in ((), (batch,)):
        raise ValueError(f"key: expected one key (shape ()) or one per row (shape ({batch},)), got shape {typed.shape}")
    return typed


@functools.cache
def _key_array_type() -> Any:
    """The class of typed PRNG keys (``jax.random.key``'s), looked up at the first call, not at import."""
    return type(jax.random.key(0))


@functools.lru_cache(maxsize=64)
def _is_key_dtype(dt: Any) -> bool:
    return bool(jax.dtypes.issubdtype(dt, jax.dtypes.prng_key))


@functools.lru_cache(maxsize=256)
def _scalar_row(value: float, batch: int, dtype: type) -> np.ndarray:
    """A Python scalar parameter as a (B,) array, made once per value and batch size."""
    return _constant_row(value, batch, dtype)


def row_param(name: str, value: Any, batch: int, kind: str) -> np.ndarray:
    """A per-row parameter as a host NumPy array of shape (B,).

    Parameters are B numbers: they live on the host, where validation reads
    them and from where every jitted call takes them the same way (a JAX array
    argument would be read back once here).
    """
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        value = min(max(value, -(2**63)), 2**63 - 1)  # a Python int past int64 (top_k=2**70) means its extreme
    if isinstance(value, jax.Array):
        arr = np.asarray(jax.device_get(value))
    elif type(value).__module__.split(".")[0] == "torch":
        arr = np.asarray(jax.device_get(as_array(name, value)))
    else:
        arr = native_byte_order(np.asarray(value))
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (batch,))
    if arr.shape != (batch,):
        raise ValueError(f"{name}: expected a scalar or shape (B,) = ({batch},), got shape {tuple(arr.shape)}")
    dt = arr.dtype
    if kind == "int":
        if dt == np.bool_ or not np.issubdtype(dt, np.integer):
            raise ValueError(f"{name}: expected integers, got dtype {dt}")
    elif dt == np.bool_ or not (np.issubdtype(dt, np.floating) or np.issubdtype(dt, np.integer) or dt == jnp.bfloat16):
        raise ValueError(f"{name}: expected real numbers, got dtype {dt}")
    return arr


def host_copy(x: Any) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def _scalar_float(name: str, value: int | float) -> float:
    """A Python number as a float; an integer too large for one is a ValueError naming ``name``."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name}: expected a number that fits in a float, got an integer of {int(value).bit_length()} bits"
        ) from None


def _check_params(temperature, top_k, top_p, validate: bool) -> None:
    if not validate:
        return
    t = host_copy(temperature).astype(np.float64)
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature: expected finite values >= 0 (0 = greedy), got {t.tolist()}")
    lo, hi = TEMPERATURE_RANGE
    if not np.all((t == 0) | ((t >= lo) & (t <= hi))):
        raise ValueError(
            f"temperature: expected 0 (greedy) or a value in [2**-126, 2**126] = [{lo:.7g}, {hi:.7g}], the range "
            f"where the processed distribution is computed faithfully in float32, got {t.tolist()}"
        )
    if top_k is not None:
        k = host_copy(top_k)
        if np.any(k < 0):
            raise ValueError(f"top_k: expected integers >= 0 (0 = no top-k), got {k.tolist()}")
    if top_p is not None:
        p = host_copy(top_p).astype(np.float64)
        if not np.all((p > 0) & (p <= 1)):
            raise ValueError(f"top_p: expected values in (0, 1], got {p.tolist()}")


def prepare_params(temperature, top_k, top_p, batch: int, validate: bool, impl: str = "auto") -> SamplingParams:
    """The per-row parameters as a :class:`SamplingParams` of f32/i32/f32 (B,) arrays.

    ``top_k`` / ``top_p`` None set ``use_top_k`` / ``use_top_p`` False and leave a
    shared zero placeholder in the field. ``impl`` (``"auto"``, ``"xla"`` or
    ``"cpu"``) is resolved here, in eager code
    (:func:`specjax.kernels.cpu_kernels.resolve`: builds the C++ kernels on
    first use), into the static ``params.impl``. The arrays are NumPy arrays on the
    host: the jitted call takes them as arguments, and no eager JAX operation
    (each costs a dispatch, a good part of a B = 1 step on a CPU) runs at the
    boundary.
    """
    if temperature is None:
        raise ValueError("temperature: expected a number >= 0 or an array of shape (B,), got None")
    scalars = (
        type(temperature) in (float, int)
        and (top_k is None or type(top_k) is int)
        and (top_p is None or type(top_p) in (float, int))
    )
    impl = cpu_kernels.resolve(impl)
    if scalars:  # the common case: Python numbers, prepared once per value and batch size
        return _scalar_params(temperature, top_k, top_p, batch, validate, impl)
    temperature = row_param("temperature", temperature, batch, "float")
    top_k = None if top_k is None else row_param("top_k", top_k, batch, "int")
    top_p = None if top_p is None else row_param("top_p", top_p, batch, "float")
    _check_params(temperature, top_k, top_p, validate)
    temperature = np.ascontiguousarray(temperature, np.float32)
    if top_k is not None:
        top_k = np.ascontiguousarray(np.clip(top_k, 0, np.iinfo(np.int32).max), np.int32)
    if top_p is not None:
        top_p = np.ascontiguousarray(1.0 - top_p.astype(np.float64), np.float32)  # in float64, as transformers does
    return _sampling_params(temperature, top_k, top_p, batch, impl)


@functools.lru_cache(maxsize=256)
def _scalar_params(
    temperature: float | int, top_k: int | None, top_p: float | int | None, batch: int, validate: bool, impl: str
) -> SamplingParams:
    """:func:`prepare_params` for Python numbers, once per distinct call (the result is immutable).

    At B = 1 on a CPU the boundary's Python is a good part of a call, and most
    callers pass the same numbers every step. A call that raises is not cached.
    (1 and 1.0 share an entry, as they give the same arrays.) ``impl`` comes
    resolved (:func:`specjax.kernels.cpu_kernels.resolve`), so a cached entry
    never outlives a change of what ``"auto"`` means.
    """
    temperature = _scalar_float("temperature", temperature)
    top_p = None if top_p is None else _scalar_float("top_p", top_p)
    if validate:  # as the array path reports them: one value per row (a scalar is checked also at B = 0)
        rows = max(batch, 1)
        if top_k is not None and top_k < 0:  # before int64 arithmetic: -2**70 is an int too
            raise ValueError(f"top_k: expected integers >= 0 (0 = no top-k), got {[top_k] * rows}")
        _check_params(
            np.full(rows, temperature, np.float64),
            None if top_k is None else np.full(rows, min(top_k, _INT32_MAX), np.int64),
            None if top_p is None else np.full(rows, top_p, np.float64),
            validate,
        )
    return _sampling_params(
        _scalar_row(temperature, batch, np.float32),
        None if top_k is None else _scalar_row(min(max(top_k, 0), _INT32_MAX), batch, np.int32),
        None if top_p is None else _scalar_row(1.0 - top_p, batch, np.float32),
        batch,
        impl,
    )


def _sampling_params(temperature, top_k, one_minus_top_p, batch: int, impl: str) -> SamplingParams:
    """The (B,) arrays as one pytree; an unused field holds the shared placeholder (:func:`_dummy`)."""
    return SamplingParams(
        temperature,
        _dummy(batch, np.int32) if top_k is None else top_k,
        _dummy(batch, np.float32) if one_minus_top_p is None else one_minus_top_p,
        use_top_k=top_k is not None,
        use_top_p=one_minus_top_p is not None,
        impl=impl,
    )


@functools.cache
def _dummy(batch: int, dtype: Any) -> np.ndarray:
    """A placeholder (B,) argument for an unused top_k/top_p (read-only, shared)."""
    return _constant_row(0, batch, dtype)


def _constant_row(value: float, batch: int, dtype: Any) -> np.ndarray:
    """A read-only (B,) array of one value, for the boundary's caches.

    NumPy like every other per-row parameter: a JAX array here would give the
    jitted call another argument signature, so a call with a scalar temperature
    and one with an array would compile twice.
    """
    out = np.full((batch,), value, dtype)
    out.flags.writeable = False
    return out


@jax.jit
def _logit_summary(logits):
    """i32[3]: NaN count, +inf count, rows with no finite logit (the error message's details)."""
    x = logits.astype(jnp.float32)
    return jnp.stack([jnp.sum(jnp.isnan(x)), jnp.sum(x == jnp.inf), jnp.sum(jnp.all(x == -jnp.inf, axis=-1))])


def _all_rows_finite(x: jax.Array) -> jax.Array:
    """bool[]: no NaN, no +inf and a finite logit in every row.

    One reduction per row (XLA's max propagates NaN, and a row's max is +inf or
    -inf exactly in the other bad cases), folded to one scalar: a replicated
    result that every process of a multi-process mesh can read. The counts for
    the message are computed only when it fails.
    """
    return jnp.all(jnp.isfinite(jnp.max(x.astype(jnp.float32), axis=-1)))


_all_rows_finite_jit = jax.jit(_all_rows_finite)


@jax.jit
def verify_summary(draft_tokens, k, target_logits, draft_logits):
    """Smallest and largest tested draft token (i32[2]), and whether each logits array is all finite (bool[])."""
    g = draft_tokens.shape[1]
    valid = jnp.arange(g)[None, :] < k[:, None]
    ids = jnp.where(valid, draft_tokens, 0)
    lo_hi = jnp.stack([jnp.min(ids), jnp.max(ids)]).astype(jnp.int32) if g else jnp.zeros(2, jnp.int32)
    d_finite = jnp.bool_(True) if draft_logits is None else _all_rows_finite(draft_logits)
    return lo_hi, _all_rows_finite(target_logits), d_finite


def check_logits(name: str, logits: jax.Array, finite: bool | None = None) -> None:
    """Raise for NaN, +inf or all -inf rows; ``finite`` (from :func:`_all_rows_finite`) if already known."""
    if finite is None:
        finite = bool(jax.device_get(_all_rows_finite_jit(logits)))
    if finite:
        return
    nan, pinf, empty_rows = (int(v) for v in np.asarray(jax.device_get(_logit_summary(logits))))
    if nan or pinf:
        raise ValueError(f"{name}: expected no NaN or +inf logits, got {nan} NaN and {pinf} +inf values")
    if empty_rows:
        raise ValueError(f"{name}: expected every row to have a finite logit, got {empty_rows} rows of all -inf")


@functools.cache
def full_k(batch: int, g: int) -> np.ndarray:
    """k_b = G for every row (read-only, shared)."""
    return _constant_row(g, batch, np.int32)
