"""torch ↔ JAX through DLPack: zero-copy where possible, one explicit, counted copy otherwise.

See the package docstring (:mod:`specjax.adapters`) for the copy policy, the
aliasing rule and stream ordering. Everything here runs outside jit.

Dtype table (torch → JAX; :func:`to_torch` maps the same pairs back)
--------------------------------------------------------------------
==================  ======================  ======================================
torch               JAX                     crossing
==================  ======================  ======================================
float32             float32                 zero-copy
float16             float16                 zero-copy
bfloat16            bfloat16                zero-copy
float64             float64                 zero-copy when ``jax_enable_x64`` is on
float64             float32                 x64 off: one narrowing copy, counted as
                                            ``float64_to_float32``; copy=False raises
int8/int16/int32    int8/int16/int32        zero-copy
uint8/uint16/uint32 uint8/uint16/uint32     zero-copy
bool                bool                    zero-copy
int64               int32                   always one narrowing copy after a range
                                            check (token ids; ``int64_to_int32``);
                                            copy=False raises
==================  ======================  ======================================

Anything else (complex, float8 variants, uint64, quantized, sub-byte ints) is a
``TypeError`` that lists the supported dtypes. In the JAX → torch direction,
int64 and float64 arrays (which exist only under ``jax_enable_x64``) come back
as int64 and float64, zero-copy.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from specjax.adapters.copies import record_copy
from specjax.adapters.host import host_view, int32_range_error
from specjax.adapters.jax_view import torchax_array

__all__ = ["JAX_TO_TORCH", "TORCH_TO_JAX", "jit_input", "to_jax", "to_torch"]

# JAX (XLA's CPU client) imports a DLPack buffer without copying only if its
# data pointer is a multiple of this; otherwise it copies silently. The same
# bound is applied to CUDA tensors, where it is conservative (CUDA allocations
# are 256-byte aligned; only views can start in between).
ALIGNMENT = 64

_INT32 = torch.iinfo(torch.int32)

#: torch dtype → JAX dtype for the zero-copy entries (float64 and int64 have rules).
TORCH_TO_JAX: dict[torch.dtype, jnp.dtype] = {
    torch.float32: jnp.dtype(jnp.float32),
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float64: jnp.dtype(jnp.float64),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int32),  # narrowed, range-checked
    torch.uint8: jnp.dtype(jnp.uint8),
    torch.uint16: jnp.dtype(jnp.uint16),
    torch.uint32: jnp.dtype(jnp.uint32),
    torch.bool: jnp.dtype(jnp.bool_),
}

#: JAX dtype → torch dtype for :func:`to_torch` (all zero-copy).
JAX_TO_TORCH: dict[jnp.dtype, torch.dtype] = {
    jnp.dtype(jnp.float32): torch.float32,
    jnp.dtype(jnp.float16): torch.float16,
    jnp.dtype(jnp.bfloat16): torch.bfloat16,
    jnp.dtype(jnp.float64): torch.float64,
    jnp.dtype(jnp.int8): torch.int8,
    jnp.dtype(jnp.int16): torch.int16,
    jnp.dtype(jnp.int32): torch.int32,
    jnp.dtype(jnp.int64): torch.int64,
    jnp.dtype(jnp.uint8): torch.uint8,
    jnp.dtype(jnp.uint16): torch.uint16,
    jnp.dtype(jnp.uint32): torch.uint32,
    jnp.dtype(jnp.bool_): torch.bool,
}

_TORCH_NAMES = ", ".join(str(d).removeprefix("torch.") for d in TORCH_TO_JAX)
_JAX_NAMES = ", ".join(d.name for d in JAX_TO_TORCH)


def _x64_enabled() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def _describe(t: torch.Tensor) -> str:
    return (
        f"shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
        f"dtype {str(t.dtype).removeprefix('torch.')}, device {t.device}"
    )


def _check_copy_flag(copy: Any) -> None:
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy: expected True, False or None, got {copy!r}")


def _reason_for(t: torch.Tensor) -> tuple[str | None, torch.dtype]:
    """Why ``t`` cannot be imported as it is (None if it can), and the torch dtype to import."""
    if t.dtype == torch.int64:
        return "int64_to_int32", torch.int32
    if t.dtype == torch.float64 and not _x64_enabled():
        return "float64_to_float32", torch.float32
    if not t.is_contiguous():
        return "non_contiguous", t.dtype
    if t.numel() and t.data_ptr() % ALIGNMENT:
        return "misaligned", t.dtype
    return None, t.dtype


def _no_copy_message(reason: str, t: torch.Tensor) -> str:
    if reason == "int64_to_int32":
        why = "int64 token ids must be narrowed to int32, which needs a copy; pass int32 ids"
    elif reason == "float64_to_float32":
        why = (
            "float64 must be narrowed to float32 because jax_enable_x64 is off, which needs "
            "a copy; pass float32 or enable jax_enable_x64"
        )
    elif reason == "non_contiguous":
        why = (
            "a strided (non-contiguous) view cannot be imported as it is, JAX needs a "
            "C-contiguous buffer; call .contiguous() first"
        )
    else:
        ptr = t.data_ptr()
        why = (
            f"the data pointer {ptr:#x} is misaligned ({ptr % ALIGNMENT} bytes past a "
            f"{ALIGNMENT}-byte boundary) and JAX would copy it; slice an aligned buffer "
            "or copy it first"
        )
    return f"tensor: copy=False but {why} (or pass copy=None); got {_describe(t)}"


def _check_int32_range(t: torch.Tensor) -> None:
    if t.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(t)).tolist())  # one device→host sync
    if lo < _INT32.min or hi > _INT32.max:
        raise ValueError(f"tensor: {int32_range_error(lo, hi)}")


def _aligned_empty(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fresh C-contiguous tensor whose data pointer is a multiple of ALIGNMENT."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel() == 0 or out.data_ptr() % ALIGNMENT == 0:
        return out
    itemsize = out.element_size()
    numel = out.numel()
    flat = torch.empty(numel + ALIGNMENT // itemsize, dtype=dtype, device=device)
    offset = (-flat.data_ptr()) % ALIGNMENT // itemsize
    out = flat[offset : offset + numel].view(shape)
    assert out.data_ptr() % ALIGNMENT == 0, "allocator returned a pointer not aligned to the itemsize"
    return out


def _explicit_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One copy on ``t``'s own device (and torch's current stream) into an aligned buffer."""
    out = _aligned_empty(t.shape, dtype, t.device)
    out.copy_(t)
    return out


@functools.cache
def _jax_gpu_device(index: int) -> Any:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as err:
        raise ValueError(
            f"tensor: expected a tensor JAX can reach, got one on cuda:{index} but JAX has no "
            f"GPU backend (jax.devices() = {jax.devices()}); install a CUDA build of JAX, "
            "see docs/gpu.md"
        ) from err
    for dev in gpus:
        if dev.local_hardware_id == index:
            return dev
    raise ValueError(
        f"tensor: expected a CUDA device JAX can see, got cuda:{index}; JAX's GPUs are "
        f"{[(d.id, d.local_hardware_id) for d in gpus]} as (id, CUDA index)"
    )


@functools.cache
def _jax_orders_after_torch(index: int) -> bool:
    """Whether JAX hands torch a stream to order against during the DLPack import.

    ``jax.dlpack.from_dlpack`` calls ``tensor.__dlpack__(stream=s)`` with
    ``s = device.get_stream_for_external_ready_events()``; torch then records
    an event on its current stream and makes ``s`` wait for it, and JAX marks
    the imported buffer ready on ``s``. If the device cannot give such a stream
    (JAX then passes ``stream=None``), torch's current stream is synchronized
    explicitly before every import instead.
    """
    try:
        stream = _jax_gpu_device(index).get_stream_for_external_ready_events()
    except Exception:  # UNIMPLEMENTED on some backends
        return False
    return isinstance(stream, int) and stream != 0


def _import(t: torch.Tensor, *, strict: bool) -> jax.Array:
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        _jax_gpu_device(index)  # a clear error if JAX cannot see this GPU
        # torch's __dlpack__ refuses tensors of another device than the current one,
        # and orders against the *current* device's current stream.
        with torch.cuda.device(index):
            if not _jax_orders_after_torch(index):
                torch.cuda.current_stream().synchronize()
            return jax.dlpack.from_dlpack(t, copy=False if strict else None)
    return jax.dlpack.from_dlpack(t, copy=False if strict else None)


def jit_input(tensor: torch.Tensor) -> jax.Array | np.ndarray:
    """``tensor`` as an argument for a jitted JAX function, on its own device, without a copy.

    On a CPU-only JAX, a contiguous, 64-byte-aligned float16/float32 CPU
    tensor is returned as a NumPy view of its memory: XLA:CPU uses such an
    argument in place, and it is much cheaper than :func:`to_jax` (a DLPack
    import, then a call that reads a freshly imported array:
    ``benchmarks/bench_overheads.py``, docs/benchmarks.md). Anything else goes through
    :func:`to_jax` and its copy policy. The aliasing rule applies either way:
    torch must not write the buffer until the computations reading it finish.

    Returns:
      A NumPy view (CPU) or a ``jax.Array``, of the tensor's shape and dtype
      (``to_jax``'s narrowing rules otherwise).
    """
    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
        view = host_view(tensor)
        if view is not None:
            return view
    return to_jax(tensor)


def to_jax(tensor: torch.Tensor, *, copy: bool | None = None, check_range: bool = True) -> jax.Array:
    """A torch tensor as a JAX array on the same device, sharing memory when possible.

    Args:
      tensor: any shape, a dtype from the table in :mod:`specjax.adapters.dlpack`,
        on ``cpu`` or ``cuda:k`` (which becomes JAX's GPU with CUDA index ``k``).
        ``requires_grad`` tensors are detached (no copy). A torchax tensor
        (device ``jax``; :mod:`specjax.adapters.jax_view`) is the ``jax.Array``
        it holds, returned as it is (dtype and device unchanged; ``copy=True``
        copies it on its device).
      copy: ``None`` (default): zero-copy when JAX can import the tensor as it
        is, else one explicit copy on the tensor's device, counted and logged
        (see :func:`specjax.adapters.copy_stats`). ``True``: always copy.
        ``False``: zero-copy or ``ValueError`` saying why not.
      check_range: for int64 input, check that the values fit in int32 before
        narrowing (one device→host sync); ``False`` skips it for hot loops whose
        ids are known to be in range.

    Returns:
      A ``jax.Array`` of the same shape; int64 becomes int32, and float64 becomes
      float32 unless ``jax_enable_x64`` is on. Without a copy it aliases
      ``tensor``'s memory: see the aliasing rule in :mod:`specjax.adapters`.

    Raises:
      TypeError: not a tensor, unsupported dtype or layout (the message lists the
        supported dtypes).
      ValueError: ``copy=False`` and a copy is needed; int64 values outside the
        int32 range; a device JAX cannot reach.
    """
    _check_copy_flag(copy)
    held = torchax_array(tensor)
    if held is not None:  # a torchax tensor: its own jax.Array, on its own device
        if copy:
            record_copy("requested", held.nbytes, requested=True)
            return jnp.array(held, copy=True)
        return held
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"tensor: expected a dense (torch.strided) tensor, got layout {tensor.layout}")
    if tensor.dtype not in TORCH_TO_JAX:
        raise TypeError(
            f"tensor: expected one of the dtypes {_TORCH_NAMES}, got {str(tensor.dtype).removeprefix('torch.')}"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor: expected a tensor on cpu or cuda, got one on {tensor.device}")
    if tensor.requires_grad:
        tensor = tensor.detach()

    reason, import_dtype = _reason_for(tensor)
    if reason is not None and copy is False:
        raise ValueError(_no_copy_message(reason, tensor))
    if reason == "int64_to_int32" and check_range:
        _check_int32_range(tensor)
    if reason is None and copy:
        reason = "requested"

    src = tensor
    if reason is not None:
        if tensor.device.type == "cuda":
            with torch.cuda.device(tensor.device):
                src = _explicit_copy(tensor, import_dtype)
        else:
            src = _explicit_copy(tensor, import_dtype)
        record_copy(
            reason,
            src.numel() * src.element_size(),
            detail=_describe(tensor),
            requested=reason == "requested",
        )

    try:
        array = _import(src, strict=copy is False)
    except (RuntimeError, BufferError) as err:  # jax.errors.JaxRuntimeError is a RuntimeError
        raise ValueError(f"tensor: the DLPack import failed for {_describe(src)}: {err}") from err

    if src.numel() and array.unsafe_buffer_pointer() != src.data_ptr():
        # JAX copied although the buffer met every condition we know of.
        if copy is False:
            raise ValueError(
                f"tensor: copy=False but JAX copied the buffer during the DLPack import; got {_describe(src)}"
            )
        record_copy("dlpack_copy", src.numel() * src.element_size(), detail=_describe(src))
    return array


def to_torch(array: jax.Array, *, copy: bool | None = None) -> torch.Tensor:
    """A JAX array as a torch tensor on the same device, sharing memory unless ``copy=True``.

    Args:
      array: a concrete ``jax.Array`` on one CPU or CUDA device, with a dtype
        from :data:`JAX_TO_TORCH` (e.g. the kernel's ``tokens: i32[B, G+1]``).
      copy: ``None`` (default) or ``False``: zero-copy (``False`` raises
        ``ValueError`` if the import copied anyway); ``True``: one copy on the
        same device, made by torch.

    Returns:
      A torch tensor of the same shape and dtype on the matching device
      (``cpu`` or ``cuda:k``). Without a copy it aliases the JAX buffer: JAX
      arrays are immutable, so treat it as read-only (``.clone()`` before
      writing). torch's current stream is ordered after the computation that
      produced ``array`` (``torch.from_dlpack`` passes it to ``__dlpack__``).

    Raises:
      TypeError: not a concrete ``jax.Array`` (e.g. a tracer inside jit), or an
        unsupported dtype (the message lists the supported ones).
      ValueError: a deleted or multi-device array; ``copy=False`` and a copy
        happened.
    """
    _check_copy_flag(copy)
    if isinstance(array, jax.core.Tracer):
        raise TypeError("array: expected a concrete jax.Array, got a tracer (to_torch runs outside jit)")
    if not isinstance(array, jax.Array):
        raise TypeError(f"array: expected a jax.Array, got {type(array).__name__}")
    dtype = jnp.dtype(array.dtype)
    if dtype not in JAX_TO_TORCH:
        raise TypeError(f"array: expected one of the dtypes {_JAX_NAMES}, got {dtype.name}")
    if array.is_deleted():
        raise ValueError("array: expected a live jax.Array, got one that was deleted or donated")
    devices = array.devices()
    if len(devices) != 1:
        raise ValueError(f"array: expected an array on one device, got one on {len(devices)} devices")
    (device,) = devices
    if device.platform not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"array: expected an array on a CPU or CUDA device, got one on {device}")

    try:
        tensor = torch.from_dlpack(array)
    except (RuntimeError, BufferError) as err:
        raise ValueError(f"array: the DLPack export failed for {array.shape} {dtype.name}: {err}") from err
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.numel() and tensor.data_ptr() != array.unsafe_buffer_pointer():
        if copy is False:
            raise ValueError(
                f"array: copy=False but the DLPack export copied the buffer; got shape "
                f"{array.shape}, dtype {dtype.name}, device {device}"
            )
        record_copy("dlpack_copy", nbytes, detail=f"shape {array.shape}, dtype {dtype.name}")
    if copy:
        tensor = tensor.clone(memory_format=torch.contiguous_format)
        record_copy("requested", nbytes, requested=True)
    return tensor
