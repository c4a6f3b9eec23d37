"""Checks of the sharded kernels on 8 simulated CPU devices, run in their own process.

``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before JAX
starts, so these checks cannot run inside the pytest process (whose other tests
want one device). ``tests/test_sharded.py`` runs this file once as a script and
turns each named check into one test; it also imports :data:`CHECK_NAMES`
(importing this module starts no JAX backend).

Usage::

    python tests/sharded_checks.py                    # run all, print a summary
    python tests/sharded_checks.py --json out.json    # also write {name: {ok, detail}}
    python tests/sharded_checks.py --only probs_2x4_V1000_detect hlo_probs_1x8

Every equality check compares ``num_accepted`` and ``tokens`` exactly with the
single-device public function on the same inputs (computed on device 0 of the
same process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__" and "--worker" not in sys.argv:
    _flag = "--xla_force_host_platform_device_count=8"
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

F32_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))

# --------------------------------------------------------------------------- cases

MESHES = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4)}


@dataclass(frozen=True)
class Case:
    """One equality check: a kernel, a shape, and how the inputs reach the mesh.

    ``path="detect"``: inputs are device_put as NamedSharding (B over "b"; V over
    "v" except on the 8x1 mesh, where only B is split) and the public function
    is called. ``path="explicit"``: NumPy inputs go to
    ``rejection_sample_sharded`` / ``verify_from_logits_sharded``, which pad B
    and V as needed.
    """

    kernel: str  # "probs" or "logits"
    batch: int
    num_draft: int
    vocab: int
    path: str
    filters: bool = False  # logits: per-row top_k and top_p
    row_keys: bool = False  # logits: one key per row
    auto_axes: bool = False  # a Mesh with Auto axes instead of jax.make_mesh's Explicit ones

    def name(self, mesh: str) -> str:
        extra = "_topkp" if self.filters else ""
        extra += "_rowkeys" if self.row_keys else ""
        extra += "_auto" if self.auto_axes else ""
        return f"{self.kernel}_{mesh}_B{self.batch}_G{self.num_draft}_V{self.vocab}_{self.path}{extra}"


# Each mesh runs both kernels through the public functions on NamedSharding
# inputs ("detect") and through the explicit functions on NumPy inputs whose V
# (and, on 8x1, B) the shard counts do not divide ("explicit"). The core set
# covers every feature at least once on every mesh; the full set (opt-in, see
# tests/test_sharded.py) runs the whole matrix.
FULL_MATRIX = (
    Case("probs", 16, 4, 1000, "detect"),
    Case("probs", 12, 3, 50257, "explicit"),
    Case("probs", 8, 0, 1000, "explicit"),
    Case("logits", 16, 4, 1000, "detect", row_keys=True),
    Case("logits", 12, 0, 50257, "explicit"),
    Case("logits", 12, 3, 50257, "explicit", filters=True),
)
CORE_CASES = {
    "8x1": (Case("probs", 12, 3, 50257, "explicit"), Case("logits", 16, 4, 1000, "detect", row_keys=True)),
    "1x8": (Case("probs", 16, 4, 1000, "detect"), Case("logits", 12, 0, 50257, "explicit")),
    "2x4": (Case("probs", 8, 0, 1000, "explicit"), Case("logits", 16, 4, 1000, "detect", row_keys=True)),
}
FULL_EXTRA = (("2x4", Case("probs", 16, 4, 1000, "detect", auto_axes=True)),)

CHECKS: dict[str, Callable[[], str]] = {}
CORE: list[str] = []


def check(name: str, core: bool = True) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        assert name not in CHECKS, name
        CHECKS[name] = fn
        if core:
            CORE.append(name)
        return fn

    return register


# --------------------------------------------------------------------------- inputs


def _normalise(x: np.ndarray) -> np.ndarray:
    return (x / x.sum(-1, keepdims=True)).astype(np.float32)


def _sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One id per row of probs[..., V] by inverse CDF in float64."""
    cdf = np.cumsum(probs.astype(np.float64), axis=-1)
    u = rng.random(probs.shape[:-1])[..., None] * cdf[..., -1:]
    return np.minimum((cdf <= u).sum(-1), probs.shape[-1] - 1).astype(np.int32)


def probs_inputs(batch: int, g: int, vocab: int, seed: int) -> tuple[np.ndarray, ...]:
    """Random distributions plus named edge rows (when the batch is large enough).

    Row 0: p = q (every test passes; bonus from p_G). Row 1: p_0(x_0) = 0 and
    p_0 <= q_0 everywhere (test 0 fails, the residual sums to zero, the draw
    falls back to p_0). Row 2: q_0(x_0) = 0 < p_0(x_0) (test 0 passes whatever
    u). Row 3: draft tokens in the first and the last ids; s just below 1.
    Row 4: one-hot target rows; s = 0. Row 5: u = 0 everywhere. Row 6:
    subnormal p_0(x_0) = 1e-40 and q_0(x_0) = 2e-40 with u = 0.3 (passes). (s within a
    few float32 ulps of 1 is a rounding tie, see :func:`_rounding_edge`.)
    """
    rng = np.random.default_rng(seed)
    q = _normalise(rng.gamma(0.3, size=(batch, g, vocab)) + 1e-12)
    x = _sample(q, rng)
    p = _normalise(rng.gamma(0.3, size=(batch, g + 1, vocab)) + 1e-12)
    p[:, :g] = _normalise(0.7 * q + 0.3 * p[:, :g])
    u = rng.random((batch, g)).astype(np.float32)
    s = rng.random(batch).astype(np.float32)
    if g and batch >= 6:
        p[0, :g] = q[0]
        p[1, 0] = q[1, 0]
        p[1, 0, x[1, 0]] = 0
        q[2, 0, x[2, 0]] = 0
        x[3] = np.resize([0, vocab - 1, vocab // 2], g)
        s[3] = 0.999
        for i in range(g + 1):
            p[4, i] = 0
            p[4, i, (i * 7919) % vocab] = 1
        s[4] = 0
        u[5] = 0
    if g and batch >= 7:
        p[6, 0, x[6, 0]] = 1e-40  # subnormal: XLA:CPU arithmetic would flush it to 0
        q[6, 0, x[6, 0]] = 2e-40
        u[6, 0] = 0.3
    return x, q, p, u, s


def logits_inputs(batch: int, g: int, vocab: int, seed: int, filters: bool, row_keys: bool):
    """Random logits with ties and -inf entries, mixed temperatures (greedy rows), ragged drafts."""
    import jax

    rng = np.random.default_rng(seed)
    target = (3 * rng.standard_normal((batch, g + 1, vocab))).astype(np.float32)
    draft = (target[:, :g] + rng.standard_normal((batch, g, vocab))).astype(np.float32)
    target[:, :, ::97] = np.round(target[:, :, ::97])  # ties
    draft[:, :, 5::101] = -np.inf  # tokens the draft never proposes
    if batch > 2:
        target[2, :, vocab // 2:] = -np.inf  # a target that excludes half the vocabulary
    temperature = np.resize(np.array([0.0, 0.7, 1.0, 1.6], np.float32), batch)
    scaled = draft / np.where(temperature > 0, temperature, 1)[:, None, None]
    gumbel = rng.gumbel(size=draft.shape).astype(np.float32)
    x = np.where(temperature[:, None] > 0, np.argmax(scaled + gumbel, -1), np.argmax(draft, -1))
    x = x.astype(np.int32)
    k = np.minimum(np.resize(np.array([g, 0, max(g - 1, 0), 1, g], np.int32), batch), g)
    kwargs: dict[str, Any] = {"temperature": temperature, "num_draft_tokens": k}
    if filters:
        kwargs["top_k"] = np.resize(np.array([0, 1, 5, 40, 1000], np.int32), batch)
        kwargs["top_p"] = np.resize(np.array([1.0, 0.9, 0.5, 0.95, 0.2], np.float32), batch)
    if row_keys:
        kwargs["key"] = jax.random.split(jax.random.key(seed), batch)
    else:
        kwargs["key"] = jax.random.key(seed)
    return x, draft, target, kwargs


# --------------------------------------------------------------------------- helpers


def make_mesh(name: str, auto: bool = False):
    import jax
    from jax.sharding import AxisType

    shape = MESHES[name]
    if auto:
        return jax.make_mesh(shape, ("b", "v"), axis_types=(AxisType.Auto, AxisType.Auto))
    return jax.make_mesh(shape, ("b", "v"))


def host(out: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in out.items()}


def assert_equal(ref: dict, got: dict, what: str) -> str:
    ref, got = host(ref), host(got)
    for key in ("num_accepted", "tokens"):
        if ref[key].shape != got[key].shape or not np.array_equal(ref[key], got[key]):
            rows = np.nonzero(np.any((ref[key] != got[key]).reshape(len(ref[key]), -1), axis=1))[0]
            raise AssertionError(f"{what}: {key} differs from one device in rows {rows.tolist()}: "
                                 f"{ref[key][rows].tolist()} vs {got[key][rows].tolist()}")
    n = ref["num_accepted"]
    return f"equal; num_accepted histogram {np.bincount(n).tolist()}"


def shards_agree(per_shard: dict) -> list[str]:
    """Names of the outputs on which the vocabulary shards disagree (leading axis = shard)."""
    bad = []
    for key, v in host(per_shard).items():
        if not all(np.array_equal(v[0], v[i]) for i in range(1, v.shape[0])):
            bad.append(key)
    return bad


def place(x: np.ndarray, mesh, spec):
    import jax
    from jax.sharding import NamedSharding

    return jax.device_put(x, NamedSharding(mesh, spec))


def _run_case(case: Case, mesh_name: str) -> str:
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.frontend import verify_from_logits
    from specjax.kernels.rejection import rejection_sample
    from specjax.kernels.sharded import rejection_sample_sharded, verify_from_logits_sharded

    mesh = make_mesh(mesh_name, case.auto_axes)
    vocab_axis = "v" if MESHES[mesh_name][1] > 1 else None
    seed = case.vocab + 31 * case.batch + case.num_draft
    if case.kernel == "probs":
        args = probs_inputs(case.batch, case.num_draft, case.vocab, seed)
        ref = rejection_sample(*args)
        if case.path == "detect":
            x, q, p, u, s = args
            placed = (
                place(x, mesh, P("b", None)),
                place(q, mesh, P("b", None, vocab_axis)),
                place(p, mesh, P("b", None, vocab_axis)),
                place(u, mesh, P("b", None)),
                place(s, mesh, P("b")),
            )
            got = rejection_sample(*placed)
        else:
            got = rejection_sample_sharded(*args, mesh=mesh, batch_axis="b", vocab_axis="v")
    else:
        x, dl, tl, kwargs = logits_inputs(case.batch, case.num_draft, case.vocab, seed, case.filters,
                                          case.row_keys)
        ref = verify_from_logits(x, dl, tl, **kwargs)
        if case.path == "detect":
            got = verify_from_logits(
                place(x, mesh, P("b", None)),
                place(dl, mesh, P("b", None, vocab_axis)),
                place(tl, mesh, P("b", None, vocab_axis)),
                **kwargs,
            )
        else:
            got = verify_from_logits_sharded(x, dl, tl, mesh=mesh, batch_axis="b", vocab_axis="v", **kwargs)
    for key, value in got.items():
        if value.sharding.mesh.shape != mesh.shape or len(value.sharding.device_set) != 8:
            raise AssertionError(f"{key}: expected a result on the 8-device mesh, got {value.sharding}")
    return assert_equal(ref, got, case.name(mesh_name))


for _mesh_name in MESHES:
    for _case in FULL_MATRIX:
        check(_case.name(_mesh_name), core=_case in CORE_CASES[_mesh_name])(
            lambda c=_case, m=_mesh_name: _run_case(c, m))
for _mesh_name, _case in FULL_EXTRA:
    check(_case.name(_mesh_name), core=False)(lambda c=_case, m=_mesh_name: _run_case(c, m))


@check("tuple_vocab_axis_2x4", core=False)
def _tuple_axis() -> str:
    """The vocabulary split over both mesh axes at once (a tuple of axis names, 8 shards)."""
    from specjax.kernels.frontend import verify_from_logits
    from specjax.kernels.rejection import rejection_sample
    from specjax.kernels.sharded import rejection_sample_sharded, verify_from_logits_sharded

    mesh = make_mesh("2x4")
    args = probs_inputs(16, 4, 1000, seed=3)
    assert_equal(rejection_sample(*args), rejection_sample_sharded(*args, mesh=mesh, vocab_axis=("b", "v")),
                 "probs over ('b', 'v')")
    x, dl, tl, kw = logits_inputs(16, 4, 1000, seed=4, filters=True, row_keys=False)
    return assert_equal(verify_from_logits(x, dl, tl, **kw),
                        verify_from_logits_sharded(x, dl, tl, mesh=mesh, vocab_axis=("v", "b"), **kw),
                        "logits over ('v', 'b')")


# --------------------------------------------------------------------------- agreement

AGREE_MESH = "1x8"


def _per_shard_probs(bad: bool) -> dict:
    """Every vocabulary shard's own results; ``bad`` draws the uniforms per shard (the bug class)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.sharded import (
        MeshLayout,
        _out_specs,
        _rejection_body,
        rejection_sample_on_mesh,
    )

    mesh = make_mesh(AGREE_MESH)
    layout = MeshLayout(mesh, "b", "v")
    x, q, p, u, s = probs_inputs(16, 4, 1000, seed=7)
    if not bad:
        return rejection_sample_on_mesh(*(jnp.asarray(a) for a in (x, q, p, u, s)), layout, per_shard=True)

    def body(x, q, p, key):
        # Each shard draws its own uniforms from the key folded with its index: the bug.
        mine = jax.random.fold_in(key, lax.axis_index("v"))
        uu = jax.random.uniform(mine, (x.shape[0], x.shape[1] + 1))
        return _rejection_body(x, q, p, uu[:, :-1], uu[:, -1], vocab_axis="v", per_shard=True)

    specs = (P("b", None), P("b", None, "v"), P("b", None, "v"), P())
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=_out_specs(layout, True),
                               check_vma=False))
    return fn(*(place(a, mesh, spec) for a, spec in zip((x, q, p), specs, strict=False)),
              place(jax.random.key(0), mesh, P()))


def _check_copies(ref: dict, got: dict) -> str:
    bad = shards_agree(got)
    assert not bad, f"vocabulary shards disagree on {bad}"
    got = host(got)
    for i in range(got["tokens"].shape[0]):
        assert_equal(ref, {k: v[i] for k, v in got.items()}, f"shard {i}")
    return f"all {got['tokens'].shape[0]} vocabulary shards agree with each other and with one device"


@check(f"agreement_probs_{AGREE_MESH}")
def _agree_probs() -> str:
    from specjax.kernels.rejection import rejection_sample

    return _check_copies(rejection_sample(*probs_inputs(16, 4, 1000, seed=7)), _per_shard_probs(bad=False))


@check(f"agreement_logits_{AGREE_MESH}", core=False)
def _agree_logits() -> str:
    import jax.numpy as jnp

    from specjax.kernels.frontend import verify_from_logits
    from specjax.kernels.sharded import MeshLayout, verify_on_mesh

    x, dl, tl, kwargs = logits_inputs(16, 4, 1000, seed=11, filters=False, row_keys=False)
    got = verify_on_mesh(
        jnp.asarray(x), jnp.asarray(dl), jnp.asarray(tl), kwargs["key"],
        jnp.asarray(kwargs["temperature"]), jnp.zeros(16, jnp.int32), jnp.zeros(16, jnp.float32),
        jnp.asarray(kwargs["num_draft_tokens"]),
        use_top_k=False, use_top_p=False, layout=MeshLayout(make_mesh(AGREE_MESH), "b", "v"), per_shard=True,
    )
    return _check_copies(verify_from_logits(x, dl, tl, **kwargs), got)


@check("agreement_negative_control_per_shard_uniforms")
def _agree_negative() -> str:
    bad = shards_agree(_per_shard_probs(bad=True))
    assert bad, "per-shard random streams went unnoticed: the agreement check cannot fail"
    return f"per-shard uniforms caught: shards disagree on {bad}"


# --------------------------------------------------------------------------- cutoffs


@check("cutoff_topk_topp_1x8")
def _cutoffs() -> str:
    """sharded_cutoff over 8 shards keeps exactly the tokens the sort-based cutoff keeps."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.frontend import _cutoff
    from specjax.kernels.sharded import sharded_cutoff

    rng = np.random.default_rng(3)
    rows, vocab = 64, 1000
    scaled = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    scaled[::3] = np.round(scaled[::3])  # heavy ties
    scaled[1::4, 500:] = -np.inf
    scaled[2::8, :] = np.float32(1.5)  # all tied
    top_k = rng.choice([0, 1, 2, 7, 50, 999, 1000, 5000], rows).astype(np.int32)
    omp = rng.choice([0.0, 0.1, 0.5, 0.9, 0.99, 1 - 1e-9], rows).astype(np.float32)
    mesh = make_mesh("1x8")
    specs = (P(None, "v"), P(), P())
    fn = jax.jit(jax.shard_map(lambda s, k, o: sharded_cutoff(s, k, o, "v"), mesh=mesh, in_specs=specs,
                               out_specs=P(), check_vma=False))
    got = np.asarray(fn(*(place(a, mesh, spec) for a, spec in zip((scaled, top_k, omp), specs, strict=True))))
    ref = np.asarray(jax.jit(_cutoff)(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(omp)))
    kept_ref = scaled >= ref[:, None]
    kept_got = scaled >= got[:, None]
    bad = np.nonzero(np.any(kept_ref != kept_got, axis=1))[0]
    assert bad.size == 0, f"kept sets differ in rows {bad.tolist()}: cutoffs {ref[bad]} vs {got[bad]}"
    only_k = (omp == 0) & (top_k > 0) & (top_k <= vocab)
    assert np.array_equal(ref[only_k], got[only_k]), "top-k cutoffs are not bit-equal"
    return f"{rows} rows: kept sets identical; top-k-only cutoffs bit-equal ({int(only_k.sum())} rows)"


# --------------------------------------------------------------------------- HLO

# V-sharded inputs of a realistic vocabulary (32000 = 8 x 4000: shards not
# multiples of the 128-wide CDF blocks). The same compiled program is checked
# for collectives and then run against one device.
HLO_BATCH, HLO_DRAFT, HLO_VOCAB = 16, 4, 32000


def hlo_inputs(mesh, kernel: str, filters: bool = False) -> tuple[tuple, dict, Any]:
    """(arguments of the jitted mesh kernel placed on ``mesh``, its static kwargs, the reference)."""
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.frontend import _prepare_params, verify_from_logits
    from specjax.kernels.rejection import rejection_sample
    from specjax.kernels.sharded import MeshLayout

    b, g, v = HLO_BATCH, HLO_DRAFT, HLO_VOCAB
    layout = MeshLayout(mesh, "b", "v")
    big, row, pair = P("b", None, "v"), P("b"), P("b", None)
    if kernel == "probs":
        x, q, p, u, s = probs_inputs(b, g, v, seed=5)
        args = (place(x, mesh, pair), place(q, mesh, big), place(p, mesh, big), place(u, mesh, pair),
                place(s, mesh, row))
        return args, {"layout": layout}, rejection_sample(x, q, p, u, s)
    x, dl, tl, kw = logits_inputs(b, g, v, seed=5, filters=filters, row_keys=False)
    temperature, top_k, omp = _prepare_params(kw["temperature"], kw.get("top_k"), kw.get("top_p"), b, False)
    if top_k is None:
        top_k, omp = np.zeros(b, np.int32), np.zeros(b, np.float32)
    args = (place(x, mesh, pair), place(dl, mesh, big), place(tl, mesh, big), place(kw["key"], mesh, P()),
            *(place(np.asarray(a), mesh, row) for a in (temperature, top_k, omp, kw["num_draft_tokens"])))
    static = {"layout": layout, "use_top_k": filters, "use_top_p": filters}
    return args, static, verify_from_logits(x, dl, tl, **kw)


def naive_rejection_jit(mesh):
    """The obvious sharded version: all-gather the vocabulary, then run the kernel on every device."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.sharded import _rejection_body

    def body(x, q, p, u, s):
        q = lax.all_gather(q, "v", axis=2, tiled=True)
        p = lax.all_gather(p, "v", axis=2, tiled=True)
        return _rejection_body(x, q, p, u, s, vocab_axis=None, per_shard=False)

    return jax.jit(jax.shard_map(
        body, mesh=mesh,
        in_specs=(P("b", None), P("b", None, "v"), P("b", None, "v"), P("b", None), P("b")),
        out_specs={"num_accepted": P("b"), "tokens": P("b", None)}, check_vma=False,
    ))


def vocab_sized(collectives: list[dict], vocab_local: int) -> list[dict]:
    """The collectives with an operand or result dimension of a vocabulary shard's size or more."""
    return [c for c in collectives if c["max_dim"] >= vocab_local]


def _hlo_check(mesh_name: str, kernel: str, filters: bool = False) -> str:
    from specjax.kernels.sharded import (
        _rejection_sample_mesh_jit,
        _verify_mesh_jit,
        hlo_collectives,
    )

    mesh = make_mesh(mesh_name)
    vocab_local = HLO_VOCAB // MESHES[mesh_name][1]
    args, static, ref = hlo_inputs(mesh, kernel, filters)
    jitted = _rejection_sample_mesh_jit if kernel == "probs" else _verify_mesh_jit
    compiled = jitted.lower(*args, **static).compile()
    found = hlo_collectives(compiled.as_text())
    assert found, "no collectives at all: is the vocabulary really split?"
    offenders = vocab_sized(found, vocab_local)
    assert not offenders, "collectives carrying a vocabulary dimension:\n" + "\n".join(
        c["line"][:300] for c in offenders)
    # A collective inside a loop reuses one rendezvous key per iteration on XLA:CPU,
    # and a device running ahead can join the wrong iteration's rendezvous (a crash
    # under load); see sharded._smallest_float.
    in_loops = [c for c in found if c["count"] != 1]
    assert not in_loops, "collectives inside loops:\n" + "\n".join(c["line"][:300] for c in in_loops)
    assert_equal(ref, compiled(*args), f"{kernel} on {mesh_name}")
    total = sum(c["operand_bytes"] * c["count"] for c in found)
    biggest = max(c["max_dim"] for c in found)
    return (f"{len(found)} collectives, largest dimension {biggest} < V/S = {vocab_local}, "
            f"{total} operand bytes per device per call; results equal one device's")


for _mesh_name in ("1x8", "2x4"):
    check(f"hlo_probs_{_mesh_name}_V{HLO_VOCAB}")(lambda m=_mesh_name: _hlo_check(m, "probs"))
check(f"hlo_logits_1x8_V{HLO_VOCAB}_topkp")(lambda: _hlo_check("1x8", "logits", filters=True))
check(f"hlo_logits_2x4_V{HLO_VOCAB}")(lambda: _hlo_check("2x4", "logits"))


@check("hlo_negative_control_naive_all_gather")
def _hlo_negative() -> str:
    from specjax.kernels.sharded import hlo_collectives

    mesh = make_mesh("1x8")
    args, _, _ = hlo_inputs(mesh, "probs")
    found = hlo_collectives(naive_rejection_jit(mesh).lower(*args).compile().as_text())
    offenders = vocab_sized(found, HLO_VOCAB // 8)
    assert offenders, "the HLO check missed a version that all-gathers the vocabulary"
    return f"caught {len(offenders)} vocabulary-sized collectives, e.g. {offenders[0]['results']}"


# --------------------------------------------------------------------------- rounding


def _draw_weights(q: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    """float64 weights the emitted token is drawn from, for a row with n accepted."""
    g = q.shape[0]
    target = p[n].astype(np.float64)
    if n == g:
        return target
    residual = np.maximum(target - q[n].astype(np.float64), 0)
    return residual if residual.sum() > 0 else target


@check(f"rounding_edge_s_below_one_1x8_V{HLO_VOCAB}")
def _rounding_edge() -> str:
    """s = 1 - 2**-24 makes the draw a float32 rounding tie at the end of the vocabulary.

    Shards and one device add the same weights in different orders, so they may
    pick different ids here (each within float32 rounding of the exact answer).
    Checked instead of equality: the acceptance decisions are equal, the sharded
    token has positive weight, and the exact (float64) cumulative distribution
    crosses s within 4 float32 ulps of it. Runs the program of the HLO check.
    """
    import jax

    from specjax.kernels.rejection import rejection_sample
    from specjax.kernels.sharded import _rejection_sample_mesh_jit

    mesh = make_mesh("1x8")
    args, static, _ = hlo_inputs(mesh, "probs")
    x, q, p, u, s = (np.asarray(a) for a in args)
    s = np.full_like(s, F32_BELOW_ONE)
    args = (*args[:4], jax.device_put(s, args[4].sharding))
    got = host(_rejection_sample_mesh_jit.lower(*args, **static).compile()(*args))
    ref = host(rejection_sample(x, q, p, u, s))
    assert np.array_equal(ref["num_accepted"], got["num_accepted"]), "acceptance decisions differ"
    tol = 4 * 2.0**-24
    for b, n in enumerate(got["num_accepted"]):
        y = got["tokens"][b, n]
        w = _draw_weights(q[b], p[b], n)
        cdf = np.cumsum(w) / w.sum()
        below = cdf[y - 1] if y > 0 else 0.0
        assert w[y] > 0, f"row {b}: drew id {y} of zero weight"
        assert below <= s[b] + tol and cdf[y] > s[b] - tol, (
            f"row {b}: id {y} is not within float32 rounding of the exact draw (cdf {below}..{cdf[y]})")
    differ = np.nonzero(np.any(ref["tokens"] != got["tokens"], axis=1))[0].tolist()
    return (f"all {len(s)} draws within float32 rounding of the exact ones; rows differing from one "
            f"device (rounding ties): {differ}")


# --------------------------------------------------------------------------- several processes


def multiprocess_inputs():
    """Inputs of the two-process check (every process builds the same ones)."""
    probs = probs_inputs(8, 4, 4000, seed=21)
    logits = logits_inputs(8, 4, 4000, seed=22, filters=True, row_keys=False)
    return probs, logits


def worker(process_id: int, num_processes: int, port: int, out: str) -> None:
    """One process of a multi-process run: ``jax.distributed.initialize``, global arrays, both kernels."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import specjax

    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("b", "v"))  # the devices of all processes

    def global_array(x, spec):
        # Each process contributes the slices its own devices hold.
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])

    (x, q, p, u, s), (xl, dl, tl, kwargs) = multiprocess_inputs()
    big = P("b", None, "v")
    probs = specjax.rejection_sample(x, global_array(q, big), global_array(p, big), u, s)
    logits = specjax.verify_from_logits(xl, global_array(dl, big), global_array(tl, big), **kwargs)
    result = {f"{kernel}_{k}": multihost_utils.process_allgather(v, tiled=True)
              for kernel, r in (("probs", probs), ("logits", logits)) for k, v in r.items()}
    np.savez(f"{out}_{process_id}.npz", **result)


@check("multiprocess_2x4_two_processes", core=False)
def _multiprocess() -> str:
    """Two processes with 4 devices each, one 2x4 mesh over both (gloo collectives on CPU)."""
    import socket
    import subprocess
    import tempfile

    from specjax.kernels.frontend import verify_from_logits
    from specjax.kernels.rejection import rejection_sample

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    tmp = tempfile.mkdtemp()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), "2", str(port), f"{tmp}/out"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [proc.communicate(timeout=900)[0] for proc in procs]
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
    (x, q, p, u, s), (xl, dl, tl, kwargs) = multiprocess_inputs()
    ref = {"probs": host(rejection_sample(x, q, p, u, s)), "logits": host(verify_from_logits(xl, dl, tl, **kwargs))}
    for i in range(2):
        got = np.load(f"{tmp}/out_{i}.npz")
        for kernel in ("probs", "logits"):
            assert_equal(ref[kernel], {k: got[f"{kernel}_{k}"] for k in ("num_accepted", "tokens")},
                         f"process {i}, {kernel}")
    return "both processes return the one-device results for both kernels"


CHECK_NAMES = tuple(CHECKS)
CORE_NAMES = tuple(CORE)
FULL_ONLY_NAMES = tuple(n for n in CHECK_NAMES if n not in CORE)


# --------------------------------------------------------------------------- main


def run(names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    import jax

    if len(jax.devices()) < 8:
        raise SystemExit(f"need 8 devices, got {len(jax.devices())}: set XLA_FLAGS before JAX starts")
    results = {}
    for name in names or CHECK_NAMES:
        t0 = time.perf_counter()
        try:
            detail, ok = CHECKS[name](), True
        except Exception as err:  # report every failure, keep going
            detail, ok = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=4)}", False
        results[name] = {"ok": ok, "detail": detail, "seconds": round(time.perf_counter() - t0, 2)}
        print(f"{'ok  ' if ok else 'FAIL'} {name} ({results[name]['seconds']} s): {detail.splitlines()[0]}",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--only", nargs="*", help="run only these checks")
    parser.add_argument("--worker", nargs=4, metavar=("ID", "N", "PORT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), int(args.worker[2]), args.worker[3])
        return 0
    unknown = set(args.only or ()) - set(CHECK_NAMES)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; known: {list(CHECK_NAMES)}")
    results = run(args.only)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
