"""specjax.set_jax_cpu_threads: the XLA:CPU pool's size, fixed when JAX starts (fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from specjax import runtime
from specjax.runtime import set_jax_cpu_threads

LINUX_2_CPUS = pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least 2 usable CPUs (with 1 CPU XLA's default pool already has 1 thread)",
)

# Starts JAX (with or without set_jax_cpu_threads), runs a small verify step and reports
# the pool, every thread's affinity and the tokens, as JSON.
_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from specjax.runtime import set_jax_cpu_threads, xla_cpu_pool_threads
    threads = int(sys.argv[1])
    before = sorted(os.sched_getaffinity(0))
    returned = set_jax_cpu_threads(threads) if threads else None
    import jax
    import specjax
    jax.devices()
    rng = np.random.default_rng(0)
    target = rng.standard_normal((4, 4, 300)).astype(np.float32)
    draft = (target[:, :3] + 0.5 * rng.standard_normal((4, 3, 300))).astype(np.float32)
    tokens = rng.integers(0, 300, (4, 3)).astype(np.int32)
    out = specjax.verify_from_logits(tokens, draft, target, key=jax.random.key(1), temperature=0.8)
    affinities = {sorted(os.sched_getaffinity(int(t))).__repr__() for t in os.listdir("/proc/self/task")}
    print(json.dumps({"returned": returned, "pool": xla_cpu_pool_threads(), "before": before,
                      "affinities": sorted(affinities), "tokens": np.asarray(out.tokens).tolist()}))
    """
)


def _probe(threads: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(threads)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter starting JAX
@LINUX_2_CPUS
def test_the_pool_gets_n_threads_and_every_thread_keeps_its_affinity():
    default, one = _probe(0), _probe(1)
    # Negative control: without the call XLA starts one pool thread per usable CPU.
    assert default["pool"] == len(default["before"]) >= 2, default
    assert one["returned"] == one["pool"] == 1, one
    # No thread (the caller, the pool, torch's, ...) is left narrowed to one CPU.
    assert one["affinities"] == [repr(one["before"])], one
    # The pool's size changes no result.
    assert one["tokens"] == default["tokens"]


def test_too_late_once_jax_has_started():
    import jax

    jax.devices()
    with pytest.raises(RuntimeError, match=r"set_jax_cpu_threads: JAX has already started its backends"):
        set_jax_cpu_threads(1)


@pytest.mark.parametrize(
    ("n", "pattern"),
    [
        (0, r"n: expected an integer in \[1, \d+\] \(the CPUs this process may use\), got 0"),
        (10_000, r"n: expected an integer in \[1, \d+\] \(the CPUs this process may use\), got 10000"),
        (1.5, r"n: expected an integer >= 1, got 1.5"),
        (True, r"n: expected an integer >= 1, got True"),
        ("2", r"n: expected an integer >= 1, got '2'"),
    ],
)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
def test_bad_n(n, pattern):
    with pytest.raises(ValueError, match=pattern):
        set_jax_cpu_threads(n)


# --- specjax's cache ----------------------------------------------------------------------------


def test_cpu_kernels_build_in_a_directory_of_the_process_with_the_cache_off(monkeypatch, tmp_path):
    """SPECJAX_CACHE_DIR=off: the C++ kernels build in a temporary directory, never in ./off."""
    import tempfile
    from pathlib import Path

    from specjax.kernels import cpu_kernels

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cpu_kernels, "_scratch", None)
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels._cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("SPECJAX_CACHE_DIR", "off")
    scratch = cpu_kernels._cache_dir()
    try:
        assert scratch.is_dir() and scratch.parent == Path(tempfile.gettempdir())
        assert cpu_kernels._cache_dir() == scratch  # one per process
        assert not (tmp_path / "off").exists()
    finally:
        scratch.rmdir()


def test_compilation_cache_leaves_the_users_choice_and_the_cache_off_alone(monkeypatch, tmp_path):
    import jax

    saved = {
        name: getattr(jax.config, name)
        for name in (
            "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs",
            "jax_compilation_cache_max_size",
        )
    }
    try:
        monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "specjax"))
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
        assert runtime.enable_compilation_cache() is None  # the user's directory stands
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "set in code"))
        assert runtime.enable_compilation_cache() is None
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "set in code")
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("SPECJAX_CACHE_DIR", "off")
        assert runtime.enable_compilation_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
        monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "specjax"))
        monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
        assert runtime.enable_compilation_cache() == tmp_path / "specjax" / "jax"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "specjax" / "jax")
        assert jax.config.jax_persistent_cache_min_compile_time_secs == runtime._MIN_COMPILE_SECONDS
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
