"""Process-level settings: specjax's cache directory, JAX's compilation cache, XLA:CPU's pool.

:func:`cache_root` is where specjax keeps what it computes once per machine
(the C++ kernels' builds, the dequantized default target, compiled JAX
programs); :func:`enable_compilation_cache` puts JAX's persistent compilation
cache there (the ``specjax`` command does).

XLA:CPU runs each jitted call on a pool of intra-op threads, one per CPU the
process may use when JAX starts its CPU backend. A sampling step is
latency-bound: dozens of small operations over one or a few vocabulary rows,
each handed to the pool's threads and waited for. On a 2-vCPU machine the
hand-offs cost more than the second thread gains: with a one-thread pool the
B = 1 front end and the acceptance kernel at every measured size were faster
(docs/benchmarks.md, "XLA:CPU's thread pool"). torch keeps its own threads and
is not affected.

jaxlib offers no setting for the pool's size; XLA sizes it from the process's
CPU affinity when the backend starts. :func:`set_jax_cpu_threads` therefore
narrows the calling thread's affinity to ``n`` CPUs while JAX starts its
backends, then gives the calling thread and every thread created meanwhile
their original affinity back: the pools keep their size, their threads may run
on any CPU. It must run before the first JAX computation of the process.
"""

from __future__ import annotations

import os
import pathlib
import sys

__all__ = ["cache_root", "enable_compilation_cache", "set_jax_cpu_threads", "xla_cpu_pool_threads"]

_CACHE_OFF = ("0", "off", "none", "false")

# Linux truncates thread names to 15 characters; XLA names its CPU pools
# "tf_XLAEigen" (intra-op) and "tf_XLAPjRtCpuClient" (execution).
_INTRA_OP_THREAD_NAME = "tf_XLAEigen"


def cache_root() -> pathlib.Path | None:
    """Where specjax keeps what it computes once per machine, or None when caching is off.

    ``$SPECJAX_CACHE_DIR`` if set (``off``, ``0``, ``none``, ``false`` or empty
    turn caching off), else ``$XDG_CACHE_HOME/specjax``, else ``~/.cache/specjax``.
    Beneath it: ``cpu-kernels/`` (the C++ kernels' builds), ``targets/`` (the
    dequantized default target) and ``jax/`` (the CLI's compiled JAX programs).
    """
    env = os.environ.get("SPECJAX_CACHE_DIR")
    if env is not None:
        if not env.strip() or env.strip().lower() in _CACHE_OFF:
            return None
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "specjax"


# Cached entries: programs that took at least this long to compile (XLA's default is 1 s,
# which leaves out most of specjax's steps: 0.4-1.4 s each on a 2-core CPU).
_MIN_COMPILE_SECONDS = 0.1
_MAX_CACHE_BYTES = 1 << 30  # least recently used entries go beyond this


def enable_compilation_cache() -> pathlib.Path | None:
    """Keep the JAX programs this process compiles in ``cache_root()/jax``, for later processes.

    specjax's CLI calls it: each ``specjax generate`` or ``demo`` would otherwise
    compile its steps again (several seconds at a new shape). A directory the
    user chose stands (``JAX_COMPILATION_CACHE_DIR`` or ``jax_compilation_cache_dir``
    already set: nothing changes); with caching off (:func:`cache_root` None)
    nothing is written. Must run before the first compilation of the process.

    Returns:
      the directory now in use, or None when this call enabled nothing.
    """
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    root = cache_root()
    if root is None:
        return None
    import jax

    if jax.config.values.get("jax_compilation_cache_dir"):  # set in code: the user's choice
        return None
    directory = root / "jax"
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _MIN_COMPILE_SECONDS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", _MAX_CACHE_BYTES)
    return directory


def _thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _backends_started() -> bool:
    """Whether JAX has created its backends (jax has no public API for this)."""
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    if started is not None:
        return bool(started())
    return bool(getattr(xla_bridge, "_backends", None))


def xla_cpu_pool_threads() -> int | None:
    """The number of XLA:CPU intra-op pool threads in this process (Linux), else None.

    Counted by thread name (``tf_XLAEigen``); 0 before JAX starts its CPU backend.
    """
    if not sys.platform.startswith("linux"):
        return None
    count = 0
    for tid in _thread_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(_INTRA_OP_THREAD_NAME):
                    count += 1
        except OSError:  # the thread ended meanwhile
            continue
    return count


def set_jax_cpu_threads(n: int) -> int:
    """Start JAX's backends with an XLA:CPU intra-op pool of ``n`` threads (Linux only).

    Args:
      n: pool size, 1 <= n <= the number of CPUs this thread may use.

    Returns:
      The number of intra-op pool threads after start-up
      (:func:`xla_cpu_pool_threads`). With a forced host device count
      (``--xla_force_host_platform_device_count``) XLA keeps at least one
      thread per device.

    Raises:
      ValueError: ``n`` is not an integer in that range.
      RuntimeError: JAX has already started a backend in this process (the
        pool's size cannot change any more), or the platform is not Linux.

    Only threads created while the backends start are touched; every one of
    them, and the calling thread, ends with the affinity the calling thread had
    before. Results of JAX computations do not depend on the pool's size.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"n: expected an integer >= 1, got {n!r}")
    if not sys.platform.startswith("linux"):
        raise RuntimeError(f"set_jax_cpu_threads: needs Linux (CPU affinity per thread), got {sys.platform}")
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= n <= len(allowed):
        raise ValueError(f"n: expected an integer in [1, {len(allowed)}] (the CPUs this process may use), got {n}")
    if _backends_started():
        raise RuntimeError(
            "set_jax_cpu_threads: JAX has already started its backends in this process, so the XLA:CPU "
            "pool's size is fixed; call it before the first JAX computation (e.g. first thing in main)"
        )
    import jax

    before = _thread_ids()
    os.sched_setaffinity(0, allowed[:n])
    try:
        jax.devices()
    finally:
        os.sched_setaffinity(0, allowed)
        for tid in _thread_ids() - before:
            try:
                os.sched_setaffinity(tid, allowed)
            except OSError:  # the thread ended meanwhile
                continue
    count = xla_cpu_pool_threads()
    return 0 if count is None else count
