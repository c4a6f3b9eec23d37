"""The ``--jax-cpu-threads`` option shared by the benchmark scripts (see specjax.runtime)."""

from __future__ import annotations

import argparse

from specjax.runtime import set_jax_cpu_threads, xla_cpu_pool_threads


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jax-cpu-threads",
        type=int,
        metavar="N",
        default=None,
        help="start JAX with an XLA:CPU intra-op pool of N threads (specjax.set_jax_cpu_threads; "
        "default: XLA's, one per CPU)",
    )


def apply(args: argparse.Namespace) -> str:
    """Apply ``--jax-cpu-threads`` (before any JAX computation); a line describing the pool."""
    import jax

    if args.jax_cpu_threads is not None:
        set_jax_cpu_threads(args.jax_cpu_threads)
        how = f"set_jax_cpu_threads({args.jax_cpu_threads})"
    else:
        jax.devices()
        how = "XLA's default"
    return f"XLA:CPU intra-op pool: {xla_cpu_pool_threads()} thread(s) ({how})"
