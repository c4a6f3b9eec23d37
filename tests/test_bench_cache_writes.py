"""benchmarks/bench_tpu_cache_writes.py: the per-row cache writes it times on a chip write what the loop's rule
(``jax_model.write_slots``) writes, bit for bit; here on the CPU, the Pallas DMA form in its TPU interpreter."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.generate.jax_model import write_slots

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        return importlib.import_module("bench_tpu_cache_writes")


@pytest.mark.parametrize("width", [1, 5])
def test_the_dma_form_writes_each_rows_slots_in_place_as_the_rule_does(bench, width):
    rng = np.random.default_rng(width)
    b, h, s, d = 3, 2, 32, 8
    cache = jnp.asarray(rng.normal(size=(b, h, s, d)), jnp.bfloat16)
    new = jnp.asarray(rng.normal(size=(b, h, width, d)), jnp.float32)
    first = jnp.asarray([0, 7, s - width], jnp.int32)  # both ends of the cache
    want = np.asarray(write_slots(cache, new, first).astype(jnp.float32))
    got = jax.jit(lambda c, n, f: bench.dma_write_slots(c, n, f, interpret=True))(cache, new, first)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    assert not np.array_equal(want, np.asarray(cache.astype(jnp.float32)))  # something was written


def test_a_quick_run_compares_every_form_with_the_rule(bench, capsys):
    rows = bench.measure(4, 128, 5, bench_args(bench), interpret=True)
    same = {r["form"]: r["same_as_select"] for r in rows}
    assert same == {"none": None, "shared": None, "select": True, "dma": True, "rows": True}
    assert "dma" in capsys.readouterr().out


def bench_args(bench: Any) -> Any:
    import argparse

    return argparse.Namespace(forms=list(bench.FORMS), layers=2, steps=3, reps=1)
