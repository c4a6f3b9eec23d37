"""What a step's KV-cache writes cost on an accelerator, by the form of the write (docs/tpu.md §6).

Usage (on a TPU host with JAX and torch, as docs/tpu.md §1 sets one up: the rule
it compares with, ``jax_model.write_slots``, lives beside the torchax model code,
which imports torch; the project need not be installed)::

    PYTHONPATH=src:benchmarks:$PYTHONPATH python3 benchmarks/bench_tpu_cache_writes.py \\
        [--out benchmarks/results] [--batches 8 32] [--slots 128 512] [--widths 1 5] [--quick]

On the chip the device loop's cache writes (``jax_model.write_slots``: W selects
against the slot index, one pass over a layer's whole cache) took 12.1 µs a
layer at B = 32, 0.36 ms of a 1.20 ms step, where the target alone's one-token
writes took 3.3 µs on caches XLA staged through VMEM
(benchmarks/results/tpu-loop/run-68e7f9c.log). This measures the forms a
per-row write can take, each in the setting that decides its cost: a jitted
``fori_loop`` of steps over a model-shaped cache (``--layers`` layers of keys and
values f[B, H_kv, S, D], the default target's H_kv = 3, D = 64, bfloat16), each
step writing W new slots per row at the row's own position (rows apart) into
every layer and then reading the layer as attention does (W queries' scores
against all S slots, their weighted sum), so a form's layout costs show in the
read too. Forms:

* ``select``: ``jax_model.write_slots`` (what the loop does);
* ``dma``: a Pallas kernel issuing one DMA per row into the cache, which it
  aliases (in place; :func:`dma_write_slots`);
* ``rows``: a ``vmap`` of ``dynamic_update_slice`` (XLA's per-row slice update);
* ``shared``: one ``dynamic_update_slice`` at a slot common to all rows (the
  target alone's form; a reference, not a per-row write);
* ``none``: no write (the reads alone).

Each row: the form's µs a step (median of ``--reps`` blocking calls of the
whole loop, over its steps), µs a layer's write (less ``none``'s step, over the
layers' keys and values), its write time over ``select``'s (the peer to beat)
and over ``shared``'s (the floor a write in place reaches); whether its final
cache equals ``select``'s bit for bit. Off a TPU (``JAX_PLATFORMS=cpu --quick``, a dry run)
the Pallas kernel runs in its TPU interpreter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from results_io import append_jsonl

from specjax.generate.jax_model import write_slots

FORMS = ("none", "shared", "select", "dma", "rows")


def dma_write_slots(cache: jax.Array, new: jax.Array, first: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``cache`` (f[B, H, S, D]) with row b's ``new`` (f[B, H, W, D]) at slots ``first[b] ..`` (i32[B], in range),
    written in place: one DMA per row from ``new`` into the aliased cache (the rest of the cache is not moved)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, _, _, _ = cache.shape
    w = new.shape[2]
    new = new.astype(cache.dtype)

    def kernel(first_ref: Any, new_ref: Any, cache_ref: Any, out_ref: Any, sem: Any) -> None:
        del cache_ref  # aliased to out_ref

        def copy(row: Any) -> Any:
            return pltpu.make_async_copy(new_ref.at[row], out_ref.at[row, :, pl.ds(first_ref[row], w), :], sem)

        def start(row: Any, carry: Any) -> Any:
            copy(row).start()
            return carry

        def wait(row: Any, carry: Any) -> Any:
            copy(row).wait()
            return carry

        lax.fori_loop(0, b, start, 0)
        lax.fori_loop(0, b, wait, 0)

    any_space = pl.BlockSpec(memory_space=pltpu.MemorySpace.HBM)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(1,),
            in_specs=[any_space, any_space],
            out_specs=any_space,
            scratch_shapes=[pltpu.SemaphoreType.DMA],
        ),
        input_output_aliases={2: 0},
        interpret=pltpu.InterpretParams() if interpret else False,
    )(first, new, cache)


def writer(form: str, interpret: bool) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The write of ``form``: (cache f[B, H, S, D], new f[B, H, W, D], first i32[B]) -> cache."""
    if form == "select":
        return write_slots
    if form == "dma":
        return lambda c, n, f: dma_write_slots(c, n, f, interpret=interpret)
    if form == "rows":
        return jax.vmap(lambda c, n, f: lax.dynamic_update_slice(c, n.astype(c.dtype), (0, f, 0)))
    if form == "shared":
        return lambda c, n, f: lax.dynamic_update_slice(c, n.astype(c.dtype), (0, 0, f[0], 0))
    return lambda c, n, f: c


def step_loop(form: str, layers: int, steps: int, interpret: bool) -> Callable[..., Any]:
    """A jitted loop of ``steps`` steps: per step and layer, the write of ``form`` into keys and values, then
    an attention-like read of the layer (f32 sums out, so nothing is optimised away)."""
    write = writer(form, interpret)

    def run(caches: tuple[jax.Array, ...], new: jax.Array, query: jax.Array, first: jax.Array) -> Any:
        def one(t: Any, carry: Any) -> Any:
            caches, acc = carry
            pos = first + t * new.shape[2]  # every row advances by W a step, from its own start
            out = []
            for i in range(layers):
                k, v = caches[2 * i], caches[2 * i + 1]
                k, v = write(k, new, pos), write(v, new, pos)
                s = jnp.einsum("bhqd,bhsd->bhqs", query, k, preferred_element_type=jnp.float32)
                o = jnp.einsum("bhqs,bhsd->bhqd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)
                acc = acc + jnp.sum(o.astype(jnp.float32))
                out += [k, v]
            return tuple(out), acc

        return lax.fori_loop(0, steps, one, (caches, jnp.float32(0)))

    return jax.jit(run, donate_argnums=0)


HEADS, DIM = 3, 64  # the default target's key/value heads and head size


def measure(b: int, slots: int, w: int, args: argparse.Namespace, interpret: bool) -> list[dict[str, Any]]:
    """Every form of ``args.forms`` at B = ``b``, S = ``slots``, W = ``w``: one row each, printed as it is made."""
    device = jax.devices()[0]
    rng = np.random.default_rng(b * slots + w)
    new = jnp.asarray(rng.normal(size=(b, HEADS, w, DIM)), jnp.bfloat16)
    query = jnp.asarray(rng.normal(size=(b, HEADS, w, DIM)), jnp.bfloat16)
    spread = max(slots - 1 - args.steps * w, 1)  # rows apart, every write in range
    first = jnp.asarray(rng.integers(0, spread, b), jnp.int32)
    shape = (b, HEADS, slots, DIM)
    times: dict[str, float] = {}
    finals: dict[str, np.ndarray] = {}
    for form in args.forms:
        fn = step_loop(form, args.layers, args.steps, interpret)
        f = jnp.full((b,), int(first[0]), jnp.int32) if form == "shared" else first
        out = fn(zeros(shape, 2 * args.layers), new, query, f)  # compile
        jax.block_until_ready(out)
        finals[form] = np.asarray(out[0][0].astype(jnp.float32))
        samples = []
        for _ in range(args.reps):
            caches = jax.block_until_ready(zeros(shape, 2 * args.layers))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(caches, new, query, f))
            samples.append(time.perf_counter() - t0)
        times[form] = 1e6 * statistics.median(samples) / args.steps
    rows = []
    for form in args.forms:
        write_us = (times[form] - times["none"]) / (2 * args.layers) if "none" in times else None
        vs_select, vs_shared = over(times, form, "select"), over(times, form, "shared")
        same = None if form in ("none", "shared") or "select" not in finals else bool(
            np.array_equal(finals[form], finals["select"]))  # fmt: skip
        rows.append({"B": b, "S": slots, "W": w, "form": form, "step_us": round(times[form], 1),
                     "write_us": None if write_us is None else round(write_us, 2),
                     "per_select_write": None if vs_select is None else round(vs_select, 2),
                     "per_shared_write": None if vs_shared is None else round(vs_shared, 2),
                     "same_as_select": same, "layers": args.layers, "steps": args.steps, "reps": args.reps,
                     "device": f"{device.platform}:{device.device_kind}"})  # fmt: skip
        cells = [f"{x:9.2f}" if x is not None else f"{'-':>9}" for x in (write_us, vs_select, vs_shared)]
        print(f"{b:>3} {slots:>4} {w:>2} {form:>7} {times[form]:>9.1f} {' '.join(cells)}  "
              f"{'' if same is None else same}", flush=True)  # fmt: skip
    return rows


def zeros(shape: tuple[int, ...], n: int) -> tuple[jax.Array, ...]:
    """``n`` fresh bfloat16 zero caches of ``shape`` (the loop donates its caches)."""
    return tuple(jnp.zeros(shape, jnp.bfloat16) for _ in range(n))


def over(times: dict[str, float], form: str, ref: str) -> float | None:
    """``form``'s write time over ``ref``'s (each less the reads alone, ``none``); None where undefined."""
    if "none" not in times or ref not in times or times[ref] <= times["none"]:
        return None
    return (times[form] - times["none"]) / (times[ref] - times["none"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="append rows to OUT/tpu-cache-writes.jsonl")
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--slots", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    parser.add_argument("--quick", action="store_true", help="small sizes (a dry run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.slots, args.widths, args.layers, args.steps, args.reps = [4], [128], [5], 2, 3, 2
    device = jax.devices()[0]
    interpret = device.platform != "tpu"
    load = os.getloadavg()
    print(f"device: {device.platform}:{device.device_kind}; JAX {jax.__version__}; load {load[0]:.2f}", flush=True)
    print(
        f"{'B':>3} {'S':>4} {'W':>2} {'form':>7} {'step_us':>9} {'write_us':>9} {'x_select':>9} {'x_shared':>9}  same"
    )
    for b in args.batches:
        for slots in args.slots:
            for w in args.widths:
                rows = measure(b, slots, w, args, interpret)
                if args.out:  # each case's rows as they come (a device call may end at its time limit)
                    append_jsonl(os.path.join(args.out, "tpu-cache-writes.jsonl"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
