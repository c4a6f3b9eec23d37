"""C++ kernels for the logits front end on XLA:CPU (built on first use, called through the XLA FFI).

On a CPU, every vocabulary-wide operation of the JAX front end is a separate
XLA:CPU thunk, and on small machines each costs tens of µs in hand-offs alone
(docs/benchmarks.md, "Acceptance from logits"). The kernels in
``cpu_kernels.cc`` do that work in one call:

* :func:`verify`: the whole acceptance step from logits, per batch row,
  position by position, reading a position's rows only while the tests before
  it pass; then the correction or bonus draw (the draw of
  :func:`specjax.kernels.core.inverse_cdf` of
  :func:`specjax.kernels.core.residual_weights`, with the same fallbacks);
* :func:`row_stats`: per row, the max, the first index of the max and the
  normaliser ``sum_j [s_j >= cut] exp(s_j)`` with ``s_j = (x_j - max)·c``;
* :func:`probs`: the processed probabilities of whole rows (the draft's draw
  in the generation loop, :func:`specjax.sample_from_logits`);
* :func:`draw_probs`: the residual draw from rows of probabilities, for the
  probability kernel (:func:`specjax.rejection_sample`).

:mod:`specjax.kernels.frontend` uses them for every single-device computation
it lowers for CPU (``lax.platform_dependent``: other platforms and the
vocabulary-sharded mesh path keep the JAX code). Maxima and argmaxes equal the
JAX path's exactly; normalisers and probabilities use the kernels' own ``exp``
and can differ from XLA's in the last bits. A token's probability is computed
by the same expression in :func:`probs` and :func:`verify` (explicit FMAs, no
contraction), so the draft's draw and the acceptance test see the same ``q``,
bit for bit.

They are used only in processes with a single CPU device: with several (a
simulated device mesh, several processes) mesh results must equal the same
inputs on one device bit for bit, and the mesh paths run the JAX code, so the
single-device paths do too.

A wheel carries the library prebuilt (``prebuilt/``, made by setup.py at wheel
build, one per target below, with a manifest of the jaxlib version, source and
flags each was built for): it is loaded first when its manifest matches the
installed jaxlib, the shipped source and the flags a build here would use.
Otherwise (a source tree, another jaxlib, a library that does not load) the
library is compiled from the shipped source with the system C++ compiler
(``$CXX``, else ``g++``/``c++``) against jaxlib's FFI headers, once per source,
compiler, jaxlib version and CPU, into specjax's cache
(:func:`specjax.runtime.cache_root`: ``$SPECJAX_CACHE_DIR``, default
``~/.cache/specjax``; with the cache off, a directory of the process, removed
at exit); a build takes a few seconds. Without either, specjax uses the JAX
code on CPU too (slower, same semantics) and warns once, saying why, when the
CPU is JAX's default backend. ``SPECJAX_CPU_KERNELS=0`` turns the kernels off.

Which code a jitted function runs is a static argument, never a process-wide
switch: ``impl`` (:data:`IMPLS`) on the public entry points and
``SamplingParams.impl`` inside the kernels. ``"xla"`` is the JAX code (the
reference, on every platform); ``"cpu"`` the kernels on a CPU (lowered for
another platform, the same function runs the JAX code); ``"auto"``, the
entry points' default, is ``"cpu"`` where the kernels are available, else
``"xla"``. :func:`resolve` turns ``"auto"`` into one of the two, building the
library if needed, in eager code at the boundary: tracing never compiles C++.
Both choices can live in one process (tests and benchmarks compare them), each
with its own compiled functions; nothing clears JAX's caches.

The build targets a portable instruction-set level: the highest x86-64 psABI
level (``x86-64-v2``/``-v3``/``-v4``) this CPU supports, so the cached library
runs on any CPU of that level; ``SPECJAX_CPU_NATIVE=1`` builds with
``-march=native`` instead (opt-in). Elsewhere (arm64...) the compiler's default
target.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

from specjax.runtime import cache_root

__all__ = [
    "IMPLS",
    "available",
    "build_error",
    "draw_probs",
    "draw_rows_index",
    "library_path",
    "probs",
    "require",
    "resolve",
    "row_stats",
    "verify",
]

#: The values of ``impl``: the JAX code, the C++ kernels on CPU, or the kernels where available.
IMPLS = ("auto", "xla", "cpu")

_SOURCE = Path(__file__).with_name("cpu_kernels.cc")
# In a wheel: the libraries setup.py built and their manifest.json (absent in a source tree).
_PREBUILT = Path(__file__).with_name("prebuilt")
_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp-simd",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-exceptions",
    "-ffp-contract=off",
)
_TARGETS = {
    "specjax_row_stats": "SpecjaxRowStats",
    "specjax_probs": "SpecjaxProbs",
    "specjax_draw_probs": "SpecjaxDrawProbs",
    "specjax_verify": "SpecjaxVerify",
}

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# The x86-64 psABI levels by the /proc/cpuinfo flags each adds (highest first).
_X86_LEVELS = (
    ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    ("x86-64-v3", {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    ("x86-64-v2", {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}),
)


def target_flags() -> tuple[str, ...]:
    """The build's target flags: ``-march=native`` if ``SPECJAX_CPU_NATIVE=1``, else a portable level.

    On x86-64, the highest psABI level whose features this CPU has (each level
    includes the ones below it); vectors of 512 bits at ``x86-64-v4``.
    Elsewhere, none (the compiler's default target).
    """
    import platform

    if os.environ.get("SPECJAX_CPU_NATIVE", "0").strip().lower() in ("1", "true", "yes", "on"):
        return ("-march=native",)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    flags, level = _cpu_flags(), "x86-64"
    for name, needs in reversed(_X86_LEVELS):  # v2, v3, v4: each needs the ones below it
        if not needs <= flags:
            break
        level = name
    return (f"-march={level}", "-mprefer-vector-width=512") if level == "x86-64-v4" else (f"-march={level}",)


def _cache_dir() -> Path:
    """specjax's cache (:func:`specjax.runtime.cache_root`); with caching off, a directory of this process."""
    global _scratch
    root = cache_root()
    if root is not None:
        return root
    if _scratch is None:
        _scratch = Path(tempfile.mkdtemp(prefix="specjax-cpu-kernels-"))
        atexit.register(shutil.rmtree, _scratch, ignore_errors=True)  # a loaded library stays mapped
    return _scratch


_scratch: Path | None = None


def _build(compiler: str) -> Path:
    """Compile the library (or reuse a cached build); raises RuntimeError on failure."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    flags = (*_FLAGS, *target_flags())
    native = "-march=native" in flags  # the CPU's own features then matter, not only the level
    key = hashlib.sha256(
        "\0".join(
            [
                _SOURCE.read_text(),
                " ".join(flags),
                version,
                jax.__version__,
                str(sorted(_cpu_flags())) if native else "",
            ]
        ).encode()
    ).hexdigest()[:16]
    out_dir = _cache_dir() / "cpu-kernels" / key
    lib = out_dir / "libspecjax_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes never see a partial file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        os.unlink(tmp)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln][:3] or proc.stderr.splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd)} failed: " + " | ".join(errors))
    os.replace(tmp, lib)
    return lib


def _prebuilt() -> tuple[Path | None, str | None]:
    """The wheel's library for this jaxlib, source and target, or why it has none (``(None, None)``: no manifest)."""
    import platform

    import jaxlib

    try:
        manifest = json.loads((_PREBUILT / "manifest.json").read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"the prebuilt library's manifest is unreadable: {e}"
    flags = " ".join((*_FLAGS, *target_flags()))
    if manifest.get("jaxlib") != jaxlib.__version__:
        why = f"was built for jaxlib {manifest.get('jaxlib')}, this is jaxlib {jaxlib.__version__}"
    elif manifest.get("machine") != platform.machine():
        why = f"was built for {manifest.get('machine')}, this is {platform.machine()}"
    elif manifest.get("source_sha256") != hashlib.sha256(_SOURCE.read_bytes()).hexdigest():
        why = f"was built from another {_SOURCE.name}"
    elif flags not in manifest.get("libraries", {}):
        why = f"has no build for {' '.join(target_flags()) or 'this target'}"
    else:
        return _PREBUILT / manifest["libraries"][flags], None
    return None, f"the prebuilt library {why}"


def _register(path: Path) -> None:
    """Load the library at ``path`` and register its FFI targets (OSError or AttributeError if it can't)."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    handlers = {target: getattr(lib, symbol) for target, symbol in _TARGETS.items()}  # all found before any is used
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")


def _load() -> None:
    """Decide once per process: build and register the kernels, or record why not."""
    if os.environ.get("SPECJAX_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        _state["error"] = "turned off by SPECJAX_CPU_KERNELS"
        return  # asked for: no warning
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        _state["error"] = f"not supported on {sys.platform}"
        return
    # With several CPU devices (--xla_force_host_platform_device_count, several
    # processes) a CPU mesh is possible, and mesh results must equal the same
    # inputs on one device bit for bit (docs/distributed.md): the mesh paths run
    # the JAX code, whose sums and exp round differently from the kernels', so
    # the single-device paths do too. No warning: nothing is missing.
    cpu_devices = jax.device_count("cpu")
    if cpu_devices != 1:
        _state["error"] = (
            f"{cpu_devices} CPU devices: the mesh paths and the single-device paths both run "
            "the JAX code, so that they agree exactly"
        )
        return
    # The wheel's prebuilt library first, then a build here; the error says why neither (both reasons).
    path, unusable = _prebuilt()
    if path is not None:
        try:
            _register(path)
        except (OSError, AttributeError) as e:
            unusable = f"the prebuilt library did not load ({e})"
        else:
            _state["path"] = path
            return
    compiler = _compiler()
    if compiler is None:
        error = "no C++ compiler found ($CXX, g++ or c++)"
    else:
        try:
            path = _build(compiler)
            _register(path)
        except (OSError, RuntimeError, AttributeError) as e:
            error = str(e)
        else:
            _state["path"] = path
            return
    _state["error"] = f"{unusable}; {error}" if unusable else error
    if jax.default_backend() != "cpu":
        return  # the accelerator runs the JAX code anyway: nothing to warn about
    warnings.warn(
        f"specjax: the C++ CPU kernels are not available ({_state['error']}); the logits front end "
        "runs its JAX code on CPU (same results up to float rounding, slower). See "
        "specjax.kernels.cpu_kernels.",
        RuntimeWarning,
        stacklevel=3,
    )


def available() -> bool:
    """Whether the kernels can run here: one CPU device, built, registered, not turned off.

    Decides (and builds them) on the first call; eager code only (see :func:`resolve`).
    """
    if "loaded" not in _state:  # decided once; every later call (one per boundary call) takes no lock
        with _lock:
            if "loaded" not in _state:
                _load()
                _state["loaded"] = True
    return "path" in _state


def resolve(impl: str) -> str:
    """``"xla"`` or ``"cpu"``: what ``impl`` (one of :data:`IMPLS`) means in this process.

    Eager code at the boundary (builds the kernels on first use, never while
    tracing): ``"auto"`` is ``"cpu"`` where :func:`available`, else ``"xla"``.

    Raises:
      ValueError: ``impl`` is not one of :data:`IMPLS`, or is ``"cpu"`` where the
        kernels are not available (the message says why).
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl: expected one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "xla":
        return impl
    if available():
        return "cpu"
    if impl == "cpu":
        raise ValueError(f"impl: 'cpu' asks for the C++ CPU kernels, which are not available here ({build_error()})")
    return "xla"


def require(impl: str) -> bool:
    """Inside a kernel: whether resolved ``impl`` selects the C++ kernels (traced code; builds nothing).

    Raises:
      ValueError: ``impl`` is ``"auto"`` or unknown (the boundary resolves it
        first: :func:`resolve`), or ``"cpu"`` before the kernels were loaded.
    """
    if impl == "xla":
        return False
    if impl == "cpu" and "path" in _state:
        return True
    if impl == "cpu":
        raise ValueError("impl: 'cpu' before the C++ CPU kernels were loaded: call cpu_kernels.resolve('cpu') first")
    raise ValueError(f"impl: a kernel takes 'xla' or 'cpu' (cpu_kernels.resolve chooses), got {impl!r}")


def build_error() -> str | None:
    """Why the kernels are unavailable (None when they are, or before the first use)."""
    return _state.get("error")  # type: ignore[return-value]


def library_path() -> Path | None:
    """The loaded shared library (the wheel's prebuilt one or a build), once :func:`available` returned True."""
    return _state.get("path")  # type: ignore[return-value]


def row_stats(logits: jax.Array, scale: jax.Array, cutoff: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row max, normaliser and first argmax (inside jit; CPU only).

    Args:
      logits: f32[N, V].
      scale: f32[N], ``c = 1 / temperature``; 0 marks a greedy row (its
        normaliser is returned as 1 and never read).
      cutoff: f32[N], the smallest kept ``s_j`` (-inf keeps all).

    Returns:
      ``(max, normaliser, argmax)``: f32[N] (the max of the raw logits),
      f32[N], i32[N].
    """
    n = logits.shape[0]
    f32 = jax.ShapeDtypeStruct((n,), jnp.float32)
    call = jax.ffi.ffi_call("specjax_row_stats", (f32, f32, jax.ShapeDtypeStruct((n,), jnp.int32)))
    row_max, normaliser, argmax = call(logits, scale, cutoff)
    return row_max, normaliser, argmax


def draw_rows_index(n: jax.Array, g: int) -> jax.Array:
    """i32[B, 2]: the flattened target and draft rows each draw of :func:`draw_probs` reads.

    Args:
      n: i32[B], each batch row's accepted count: it draws from target position
        ``n`` (of G + 1) and, when ``n < G``, against draft position ``n``
        (else the draft row is -1: draw from p alone).
      g: the draft's positions per batch row (may be 0).
    """
    batch_rows = jnp.arange(n.shape[0], dtype=jnp.int32)
    d_rows = jnp.where(n < g, batch_rows * max(g, 1) + jnp.minimum(n, max(g - 1, 0)), -1)
    return jnp.stack([batch_rows * (g + 1) + n, d_rows], axis=1).astype(jnp.int32)


def probs(logits: jax.Array, params: jax.Array, argmax: jax.Array) -> jax.Array:
    """The processed probabilities of whole rows (inside jit; CPU only).

    Args:
      logits: f32[N, V].
      params: f32[N, 4], ``(c, max, normaliser, cutoff)`` per row (see
        :func:`row_stats`); ``c = 0`` marks a greedy row.
      argmax: i32[N], the first argmax (a greedy row's one-hot).

    Returns:
      f32[N, V]: ``exp(s_j) / normaliser`` where ``s_j >= cutoff``, else 0; a
      greedy row is one-hot at ``argmax``.
    """
    call = jax.ffi.ffi_call("specjax_probs", jax.ShapeDtypeStruct(logits.shape, jnp.float32))
    return call(logits, params, argmax)


def draw_probs(target: jax.Array, draft: jax.Array, rows: jax.Array, sample_uniforms: jax.Array) -> jax.Array:
    """One residual draw per batch row from rows of probabilities (inside jit; CPU only).

    Args:
      target: f32[Nt, V], target probabilities (flattened rows).
      draft: f32[Nd, V], draft probabilities (flattened rows; Nd may be 0).
      rows: i32[B, 2], the target row and the draft row of each draw; a draft
        row outside [0, Nd) means no draft distribution (draw from p).
      sample_uniforms: f32[B] in [0, 1).

    Returns:
      i32[B], as :func:`specjax.kernels.core.inverse_cdf` of
      :func:`specjax.kernels.core.residual_weights` (the block sums are
      added in another order, so a draw at a CDF step can differ by rounding).
    """
    call = jax.ffi.ffi_call("specjax_draw_probs", jax.ShapeDtypeStruct((rows.shape[0],), jnp.int32))
    return call(target, draft, rows, sample_uniforms)


def verify(
    target: jax.Array,
    draft: jax.Array,
    draft_tokens: jax.Array,
    draft_lengths: jax.Array,
    accept_uniforms: jax.Array,
    sample_uniforms: jax.Array,
    scale: jax.Array,
    target_cutoff: jax.Array,
    draft_cutoff: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The whole acceptance step from logits, one batch row per task (inside jit; CPU only).

    Position ``i`` of a row is summarised (:func:`row_stats`) only if its tests
    before ``i`` passed: after an early rejection most of the 2G + 1 rows are
    never read.

    Args:
      target: f32[B, G+1, V], target logits.
      draft: f32[B, G, V], draft logits.
      draft_tokens: i32[B, G], ``x_i``; an id outside [0, V) has probability 0 and is
        never accepted (as in ``frontend.vocab_gather``).
      draft_lengths: i32[B], ``k_b`` (clamped to [0, G]).
      accept_uniforms: f32[B, G], ``u_i``.
      sample_uniforms: f32[B], ``s``.
      scale: f32[B], ``c = 1 / temperature``; 0 marks a greedy row.
      target_cutoff: f32[B, G+1], the smallest kept ``s_j`` (-inf keeps all).
      draft_cutoff: f32[B, G], the same for the draft rows.

    Returns:
      ``(num_accepted, emitted)``: i32[B] each; ``emitted`` is the correction
      token (residual of rows ``n``) or the bonus token (``p`` at ``k_b``).
    """
    b = target.shape[0]
    i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
    call = jax.ffi.ffi_call("specjax_verify", (i32, i32))
    num_accepted, emitted = call(
        target,
        draft,
        draft_tokens,
        draft_lengths,
        accept_uniforms,
        sample_uniforms,
        scale,
        target_cutoff,
        draft_cutoff,
    )
    return num_accepted, emitted
