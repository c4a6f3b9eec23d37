"""A one-off probe on the TPU: the cost of each candidate formulation of the kernels' reads.

Ran once at commit 545ff49 (``PYTHONPATH=src:$PYTHONPATH python3 benchmarks/tpu_probe.py``;
rows in benchmarks/results/tpu-probe.jsonl, findings in docs/tpu.md): there "kernel
(window read)" was the kernel of that commit; at later commits it is the current kernel.
``--candidates`` runs only the exact top-k candidate probe (docs/tpu.md, "The top-k /
top-p cutoff"); ``--small`` runs tiny sizes (a dry run on the CPU).
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from specjax.kernels import frontend
from specjax.kernels import rejection as R
from specjax.kernels.core import cutoff, inverse_cdf
from specjax.kernels.rejection import _rejection_sample_jit
from specjax.kernels.types import SamplingParams

SMALL = "--small" in sys.argv
print(jax.devices(), flush=True)


def tm(name, fn, *args, reps=20):
    f = jax.jit(fn)
    try:
        jax.block_until_ready(f(*args))
        jax.block_until_ready(f(*args))
    except Exception as e:
        print(f"{name:40s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        return None
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs = [f(*args) for _ in range(reps)]
    jax.block_until_ready(outs)
    q = (time.perf_counter() - t0) / reps
    b = statistics.median(ts)
    print(f"{name:40s} blocking {b * 1e6:10.1f} us   queued {q * 1e6:10.1f} us", flush=True)
    return q


def inputs(b, g, v, dtype):
    k = jax.random.split(jax.random.key(0), 5)
    t = jax.random.uniform(k[0], (b, g + 1, v), jnp.float32) ** 4
    t = (t / jnp.sum(t, -1, keepdims=True)).astype(dtype)
    d = (t[:, :g].astype(jnp.float32) * jax.random.uniform(k[1], (b, g, v), jnp.float32, 0.5, 1.5)).astype(dtype)
    x = jax.random.randint(k[2], (b, g), 0, v, jnp.int32)
    u = jax.random.uniform(k[3], (b, g))
    s = jax.random.uniform(k[4], (b,))
    return jax.block_until_ready((x, d, t, u, s))


def px_masked(x, d, t):
    v = t.shape[-1]
    g = x.shape[1]
    hit = lax.broadcasted_iota(jnp.int32, (1, 1, v), 2) == x[..., None]
    return jnp.sum(jnp.where(hit, t[:, :g], 0), -1), jnp.sum(jnp.where(hit, d, 0), -1)


def px_window(x, d, t, w=128):
    v = t.shape[-1]
    b, g = x.shape
    start = jnp.clip((x // w) * w, 0, v - w)
    bi = jnp.broadcast_to(jnp.arange(b)[:, None], (b, g))
    gi = jnp.broadcast_to(jnp.arange(g)[None, :], (b, g))

    def one(arr, bb, gg, st):
        return lax.dynamic_slice(arr, (bb, gg, st), (1, 1, w))[0, 0]

    f = jax.vmap(jax.vmap(one, (None, 0, 0, 0)), (None, 0, 0, 0))
    wt = f(t, bi, gi, start)
    wd = f(d, bi, gi, start)
    lane = lax.broadcasted_iota(jnp.int32, (1, 1, w), 2) == (x - start)[..., None]
    return jnp.sum(jnp.where(lane, wt, 0), -1), jnp.sum(jnp.where(lane, wd, 0), -1)


def px_tal(x, d, t):
    g = x.shape[1]
    return (
        jnp.take_along_axis(t[:, :g], x[..., None], -1)[..., 0],
        jnp.take_along_axis(d, x[..., None], -1)[..., 0],
    )


def rows_tal(t, n):
    return jnp.take_along_axis(t, n[:, None, None], axis=1)[:, 0]


def rows_vmap(t, n):
    return jax.vmap(lambda a, i: lax.dynamic_index_in_dim(a, i, 0, False))(t, n)


def rows_masked(t, n):
    gg = lax.broadcasted_iota(jnp.int32, (1, t.shape[1], 1), 1)
    return jnp.sum(jnp.where(gg == n[:, None, None], t, 0), 1)


def read_all(x, d, t):
    return jnp.sum(t.astype(jnp.float32)) + jnp.sum(d.astype(jnp.float32))


def rej_probe():
    cases = [(64, 4, 128256), (256, 4, 128256), (256, 4, 32000)] if not SMALL else [(4, 4, 2000)]
    for b, g, v in cases:
        for dtype in (jnp.float32, jnp.bfloat16) if b == 256 and v == 128256 else (jnp.float32,):
            x, d, t, u, s = inputs(b, g, v, dtype)
            n = jax.random.randint(jax.random.key(9), (b,), 0, g + 1)
            print(f"--- rejection B={b} G={g} V={v} {jnp.dtype(dtype).name}", flush=True)
            tm("read_all", read_all, x, d, t)
            tm("kernel (window read)", lambda *a: _rejection_sample_jit(*a), x, d, t, u, s)

            def old(*a):
                keep = R._read_at
                R._read_at = R._read_by_row
                try:
                    return R.rejection_body(*a)
                finally:
                    R._read_at = keep

            tm("kernel (row map read, as at 49a69d9)", old, x, d, t, u, s)
            o1 = jax.jit(old)(x, d, t, u, s)
            o2 = _rejection_sample_jit(x, d, t, u, s)
            print("old==new tokens:", bool(jnp.all(o1.tokens == o2.tokens)), flush=True)
            r1 = jax.jit(px_masked)(x, d, t)
            r2 = jax.jit(px_window)(x, d, t)
            r3 = jax.jit(px_tal)(x, d, t)
            print("px agree", bool(jnp.all(r1[0] == r3[0]) & jnp.all(r2[0] == r3[0]) & jnp.all(r2[1] == r3[1])))
            tm("px_masked", px_masked, x, d, t)
            tm("px_window128", px_window, x, d, t)
            tm("px_window1024", lambda *a: px_window(*a, w=1024), x, d, t)
            tm("px_tal", px_tal, x, d, t)
            tm("rows_tal (t and d)", lambda t, d, n, g=g: (rows_tal(t, n), rows_tal(d, jnp.minimum(n, g - 1))), t, d, n)
            tm(
                "rows_vmap (t and d)",
                lambda t, d, n, g=g: (rows_vmap(t, n), rows_vmap(d, jnp.minimum(n, g - 1))),
                t,
                d,
                n,
            )
            tm(
                "rows_masked (t and d)",
                lambda t, d, n, g=g: (rows_masked(t, n), rows_masked(d, jnp.minimum(n, g - 1))),
                t,
                d,
                n,
            )
            p_n = rows_vmap(t, n).astype(jnp.float32)
            q_n = rows_vmap(d, jnp.minimum(n, g - 1)).astype(jnp.float32)
            tm("inverse_cdf on residual", lambda p, q, s: inverse_cdf(jnp.maximum(p - q, 0), s), p_n, q_n, s)
            del x, d, t


def hier_top(x, k=256):
    """Exact top-k values (descending) of each row of f32[R, V] via block maxima."""
    r, v = x.shape
    nb = -(-v // 128)
    xp = jnp.pad(x, ((0, 0), (0, nb * 128 - v)), constant_values=-jnp.inf).reshape(r, nb, 128)
    m = jnp.max(xp, -1)
    _, bi = lax.top_k(m, k)
    cand = jnp.take_along_axis(xp, bi[:, :, None], axis=1)  # R, k, 128
    cand = cand.reshape(r, k * 16, 8)
    m2 = jnp.max(cand, -1)
    _, bi2 = lax.top_k(m2, k)
    cand2 = jnp.take_along_axis(cand, bi2[:, :, None], axis=1).reshape(r, k * 8)
    return lax.top_k(cand2, k)[0]


def hier_top_vmap(x, k=256):
    r, v = x.shape
    nb = -(-v // 128)
    xp = jnp.pad(x, ((0, 0), (0, nb * 128 - v)), constant_values=-jnp.inf).reshape(r, nb, 128)
    m = jnp.max(xp, -1)
    _, bi = lax.top_k(m, k)
    cand = jax.vmap(lambda a, i: a[i])(xp, bi)  # R, k, 128
    cand = cand.reshape(r, k * 16, 8)
    m2 = jnp.max(cand, -1)
    _, bi2 = lax.top_k(m2, k)
    cand2 = jax.vmap(lambda a, i: a[i])(cand, bi2).reshape(r, k * 8)
    return lax.top_k(cand2, k)[0]


def topk_probe():
    for rows, v in [(40, 128256), (576, 128256)] if not SMALL else [(8, 40000)]:
        x = jax.random.normal(jax.random.key(1), (rows, v), jnp.float32) * 3
        print(f"--- top-k rows={rows} V={v}", flush=True)
        tm("read sum", lambda x: jnp.sum(x), x)
        tm("max", lambda x: jnp.max(x, -1), x)
        tm(
            "max+blockmax",
            lambda x, v=v, rows=rows: (jnp.max(x, -1), jnp.max(x[:, : v // 128 * 128].reshape(rows, -1, 128), -1)),
            x,
        )
        tm("top_k 256", lambda x: lax.top_k(x, 256)[0], x)
        tm("top_k 64", lambda x: lax.top_k(x, 64)[0], x)
        tm("top_k 8", lambda x: lax.top_k(x, 8)[0], x)
        tm("approx_max_k 256", lambda x: lax.approx_max_k(x, 256)[0], x)
        tm("approx_max_k 256 r.99", lambda x: lax.approx_max_k(x, 256, recall_target=0.99)[0], x)
        if not SMALL:
            m = jnp.max(x[:, : v // 128 * 128].reshape(rows, -1, 128), -1)
            tm("top_k (R,1002)->256", lambda m: lax.top_k(m, 256)[0], m)
            y = x[:, :4096]
            tm("top_k (R,4096)->256", lambda m: lax.top_k(m, 256)[0], y)
            tm("top_k (R,2048)->256", lambda m: lax.top_k(m, 256)[0], y[:, :2048])
            tm("sort (R,2048)", lambda m: lax.sort(m, dimension=-1), y[:, :2048])
            tm("sort (R,1024)", lambda m: lax.sort(m, dimension=-1), y[:, :1024])
        h = jax.jit(hier_top)(x)
        ref = lax.top_k(x, 256)[0]
        print("hier exact:", bool(jnp.all(h == ref)), flush=True)
        tm("hier_top", hier_top, x)
        h = jax.jit(hier_top_vmap)(x)
        print("hier_vmap exact:", bool(jnp.all(h == ref)), flush=True)
        tm("hier_top_vmap", hier_top_vmap, x)
        k = jnp.full((rows,), 50, jnp.int32)
        p = jnp.full((rows,), 0.1, jnp.float32)
        xs = (x - jnp.max(x, -1, keepdims=True)) / 0.7
        tm("cutoff k50 p.9 (current)", cutoff, xs, k, p)
        del x


def verify_probe():
    for b, g, v in [(8, 4, 128256), (64, 4, 128256)] if not SMALL else [(2, 4, 1000)]:
        kk = jax.random.split(jax.random.key(3), 3)
        tl = jax.random.normal(kk[0], (b, g + 1, v)) * 3
        dl = tl[:, :g] + jax.random.normal(kk[1], (b, g, v))
        x = jax.random.randint(kk[2], (b, g), 0, v)
        key = jax.random.key(5)
        ones = jnp.ones((b,), jnp.float32)
        sampled = SamplingParams(ones * 0.7, jnp.full((b,), 50, jnp.int32), ones * 0.1, True, True, "xla")
        greedy = SamplingParams(ones * 0, None, None, False, False, "xla")
        nk = jnp.full((b,), g, jnp.int32)
        print(f"--- verify B={b} G={g} V={v}", flush=True)
        tm("read logits", lambda a, c: jnp.sum(a) + jnp.sum(c), tl, dl)
        tm("verify sampled", lambda *a: frontend._verify_jit.__wrapped__(*a), x, dl, tl, key, sampled, nk)
        tm("verify greedy", lambda *a: frontend._verify_jit.__wrapped__(*a), x, dl, tl, key, greedy, nk)
        tm(
            "verify T=1 no filter",
            lambda *a: frontend._verify_jit.__wrapped__(*a),
            x,
            dl,
            tl,
            key,
            SamplingParams(ones, None, None, False, False, "xla"),
            nk,
        )
    tm("trivial", lambda a: a + 1, jnp.ones((8,)))


def top4_per_strided_block(x, s=1024):
    """f32[R, 4, s]: the 4 largest of each strided block ``{x[r, t*s + j] : t}`` (one variadic reduce)."""
    r, v = x.shape
    t = -(-v // s)
    xp = jnp.pad(x, ((0, 0), (0, t * s - v)), constant_values=-jnp.inf).reshape(r, t, s)
    ninf = jnp.full_like(xp, -jnp.inf)

    def merge(a, b):  # two descending 4-lists -> the 4 largest of the 8, descending
        c = [jnp.maximum(a[i], b[3 - i]) for i in range(4)]
        d1, d3 = jnp.maximum(c[0], c[2]), jnp.minimum(c[0], c[2])
        d2, d4 = jnp.maximum(c[1], c[3]), jnp.minimum(c[1], c[3])
        return (jnp.maximum(d1, d2), jnp.minimum(d1, d2), jnp.maximum(d3, d4), jnp.minimum(d3, d4))

    init = tuple(jnp.float32(-jnp.inf) for _ in range(4))
    return jnp.stack(lax.reduce((xp, ninf, ninf, ninf), init, merge, (1,)), axis=1)


def top_r_per_lane(x, r=8, interpret=False):
    """f32[R, r*128]: per row and lane l, the r largest of ``{x[row, c*128 + l] : c}``, descending by blocks.

    A Pallas kernel over the rows' native (8, 128) tiles: 8 rows per grid step,
    a loop over the 128-wide chunks keeping r running maxima per (row, lane)
    (2r elementwise ops per chunk), no reshape of the input (the reshapes above
    relayout it). R must be a multiple of 8 and V of 128 (as 32000, 128256 and
    151936 are). The candidates route's first stage, to be measured on the chip
    before it goes into the kernels.
    """
    from jax.experimental import pallas as pl

    rows, v = x.shape
    assert rows % 8 == 0 and v % 128 == 0, (rows, v)
    chunks = v // 128

    def kernel(x_ref, o_ref):
        def body(c, acc):
            t = x_ref[:, pl.ds(pl.multiple_of(c * 128, 128), 128)]
            out = []
            for a in acc:
                out.append(jnp.maximum(a, t))
                t = jnp.minimum(a, t)
            return tuple(out)

        init = tuple(jnp.full((8, 128), -jnp.inf, jnp.float32) for _ in range(r))
        acc = lax.fori_loop(0, chunks, body, init)
        for i, a in enumerate(acc):
            o_ref[:, i * 128 : (i + 1) * 128] = a

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, r * 128), jnp.float32),
        grid=(rows // 8,),
        in_specs=[pl.BlockSpec((8, v), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, r * 128), lambda i: (i, 0)),
        interpret=interpret,
    )(x)


def candidates_probe():
    """An exact top-k from candidates: the strided blocks' 4 largest hold every value above
    the largest 4th-largest (tau); a bisection over them gives the k-th largest exactly when it is
    above tau. Prints exactness on normal logits and each piece's cost."""
    from specjax.kernels.core import _smallest_float

    def kth(c, k):
        return _smallest_float(lambda t: jnp.sum(c > t[:, None], axis=-1, dtype=jnp.int32) < k, c.shape[:1], False)[0]

    for rows in (8,) if SMALL else (72, 576):
        v = 8064 if SMALL else 128256
        x = jax.random.normal(jax.random.key(0), (rows, v), jnp.float32) * 3
        k = jnp.full((rows,), 50, jnp.int32)
        cands = jax.jit(top4_per_strided_block)(x)
        tau = jnp.max(cands[:, 3], -1)
        flat = cands.reshape(rows, -1)
        exact = jax.jit(kth)(flat, k)
        print(
            f"rows={rows}: k-th largest from candidates equal to lax.top_k's: "
            f"{bool(jnp.all(exact == lax.top_k(x, 50)[0][:, -1]))}; rows above tau: {float(jnp.mean(exact > tau))}"
        )
        tm(f"rows={rows} read", jnp.sum, x)
        p = jnp.full((rows,), 0.1, jnp.float32)
        tm(
            f"rows={rows} strided max (1024 blocks)",
            lambda x: jnp.max(x.reshape(x.shape[0], -1, 1024), 1),
            x[:, : (x.shape[1] // 1024) * 1024],
        )
        tm(f"rows={rows} strided 4 largest (1024 blocks)", top4_per_strided_block, x)
        tm(f"rows={rows} lax.top_k 256", lambda x: lax.top_k(x, 256)[0], x)
        tm(f"rows={rows} cutoff now (k 50, p 0.9)", lambda x, k, p: cutoff(x, k, p, None), x, k, p)
        tm(f"rows={rows} bisection over the 4096 candidates", kth, flat, k)
        tm(f"rows={rows} bisection over the full rows", kth, x, k)
        # The Pallas first stage: 8 largest per (row, lane) over the native tiles.
        lanes = jax.jit(lambda x: top_r_per_lane(x, 8, interpret=SMALL))(x)
        tau8 = jnp.max(lanes[:, 7 * 128 :], -1)
        exact8 = jax.jit(kth)(lanes, k)
        print(
            f"rows={rows}: Pallas lane candidates: k-th largest equal: "
            f"{bool(jnp.all(exact8 == lax.top_k(x, 50)[0][:, -1]))}; rows above tau: {float(jnp.mean(exact8 > tau8))}"
        )
        tm(f"rows={rows} Pallas 8 largest per lane", lambda x: top_r_per_lane(x, 8, interpret=SMALL), x)
        tm(f"rows={rows} bisection over the 1024 lane candidates", kth, lanes, k)


if "--candidates" in sys.argv:
    candidates_probe()
else:
    rej_probe()
    topk_probe()
    verify_probe()
