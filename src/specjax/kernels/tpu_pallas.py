"""Pallas kernels for the TPU branches of :mod:`specjax.kernels.core` (docs/tpu.md, section 4).

A TPU holds an f32 array in HBM in tiles of 8 × 128 over its last two axes; a
reshape that regroups the last axis moves every tile (a relayout that costs
more than a read). The kernels here read the operand in its own tiles.

Each is lowered only for a TPU (the callers choose it with
``lax.platform_dependent``); ``interpret=True`` runs it in Pallas' interpreter
on any backend, which is how the CPU tests check it. Pure functions of their
inputs: no rule of the contract lives here, only the candidates the rule in
:mod:`specjax.kernels.core` then uses.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["LANES", "lane_candidates", "lane_candidates_fit"]

#: The minor-axis width of a TPU tile: the kernels work on 128-wide chunks.
LANES = 128
# The per-step input block is double-buffered in VMEM (128 MiB on a v5e; 16 MiB
# scoped by default): the limit asked for is twice the block plus room for the
# accumulators, and the route is taken only while that fits comfortably.
_VMEM_LIMIT = 96 * 1024 * 1024


def _blocking(shape: tuple[int, ...]) -> tuple[int, int]:
    """(N, P): ``f[..., V]`` viewed as f[N, P, V] without moving a tile.

    The last two axes are the tiled ones: ``P`` is the second-to-last axis
    (8 when it is a multiple of 8, so that a (R, V) operand becomes
    (R / 8, 8, V), the same bytes), the leading axes collapse into ``N``.
    """
    if len(shape) == 1:
        return 1, 1
    p = shape[-2]
    n = math.prod(shape[:-2])
    if p % 8 == 0:
        return n * p // 8, 8
    return n, p


def _vmem_bytes(shape: tuple[int, ...], itemsize: int, depth: int) -> int:
    _, p = _blocking(shape)
    vocab = -(-shape[-1] // LANES) * LANES
    return 2 * p * vocab * itemsize + 2 * p * depth * LANES * 4 + (1 << 20)


def lane_candidates_fit(shape: tuple[int, ...], itemsize: int, depth: int) -> bool:
    """Whether :func:`lane_candidates` of an operand of ``shape`` fits the TPU's VMEM (static)."""
    return _vmem_bytes(shape, itemsize, depth) <= _VMEM_LIMIT


def lane_candidates(x: jax.Array, depth: int, *, interpret: bool = False) -> jax.Array:
    """f[..., V] -> f32[..., depth·128]: per row and lane, the ``depth`` largest values, descending.

    Lane ``l`` of a row is the strided set ``{x[..., c·128 + l] : c}``; entry
    ``i·128 + l`` of the result is its ``(i+1)``-th largest value (with
    multiplicity; -inf where the lane has fewer values). The row is padded with
    -inf to a multiple of 128 (a copy, only for such vocabularies). One pass
    over the operand in its own (8, 128) tiles: per 128-wide chunk, ``depth``
    max/min pairs (an insertion network; a NaN spreads to every slot of its
    lane). The values are converted to float32 exactly.

    What it guarantees (the candidates route of :func:`specjax.kernels.core.cutoff`):
    with ``τ`` the largest of the rows' ``depth``-th largest per lane, every
    value ``> τ`` of the row is in the result, as many times as in the row.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    shape = x.shape
    vocab = shape[-1]
    padded = -(-vocab // LANES) * LANES
    if padded != vocab:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - vocab)], constant_values=-jnp.inf)
    n, p = _blocking(shape)
    chunks = padded // LANES

    def kernel(x_ref: Any, o_ref: Any) -> None:
        def step(c: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            t = x_ref[0, :, pl.ds(pl.multiple_of(c * LANES, LANES), LANES)].astype(jnp.float32)
            out = []
            for a in acc:
                out.append(jnp.maximum(a, t))
                t = jnp.minimum(a, t)
            return tuple(out)

        init = tuple(jnp.full((p, LANES), -jnp.inf, jnp.float32) for _ in range(depth))
        # Unrolled by 8: the loop's overhead otherwise dominates (rolled, 576 rows of
        # 128256 took 2.4x a read of them on a v5e; unrolled by 8, the read's time).
        acc = lax.fori_loop(0, chunks, step, init, unroll=min(8, chunks))
        for i, a in enumerate(acc):
            o_ref[0, :, i * LANES : (i + 1) * LANES] = a

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, p, depth * LANES), jnp.float32),
        grid=(n,),
        in_specs=[pl.BlockSpec((1, p, padded), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((1, p, depth * LANES), lambda i: (i, 0, 0)),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",),
            vmem_limit_bytes=min(_VMEM_LIMIT, max(_vmem_bytes(shape, x.dtype.itemsize, depth), 32 << 20)),
        ),
        interpret=interpret,
    )(x.reshape(n, p, padded))
    return out.reshape(*shape[:-1], depth * LANES)
