"""Inputs and helpers of the sharded-kernel tests (``tests/mesh/``, and ``tests/test_sharded.py``).

Importing this module starts no JAX backend: the mesh tests run in their own
pytest process whose ``tests/mesh/conftest.py`` asks XLA for 8 simulated CPU
devices before JAX starts, and the one-device tests in ``tests/test_sharded.py``
use the input builders too.

Every equality check compares ``num_accepted`` and ``tokens`` exactly with the
single-device public function on the same inputs (computed on device 0 of the
same process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

# The rest of the mesh matrix is opt-in (slow): SPECJAX_SHARDED_FULL=1.
FULL = os.environ.get("SPECJAX_SHARDED_FULL") == "1"
full_matrix = pytest.mark.skipif(not FULL, reason="the full mesh matrix runs with SPECJAX_SHARDED_FULL=1")

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
        target[2, :, vocab // 2 :] = -np.inf  # a target that excludes half the vocabulary
    temperature = np.resize(np.array([0.0, 0.7, 1.0, 1.6], np.float32), batch)
    scaled = draft / np.where(temperature > 0, temperature, 1)[:, None, None]
    gumbel = rng.gumbel(size=draft.shape).astype(np.float32)
    x = np.where(temperature[:, None] > 0, np.argmax(scaled + gumbel, -1), np.argmax(draft, -1))
    x = x.astype(np.int32)
    k = np.minimum(np.resize(np.array([g, 0, max(g - 1, 0), 1, g], np.int32), batch), g)
    kwargs: dict[str, Any] = {"temperature": temperature, "draft_lengths": k}
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


def host(out: Any) -> dict[str, np.ndarray]:
    """An AcceptanceResult (or a dict of its fields) as a dict of host arrays."""
    fields = out if isinstance(out, dict) else vars(out)
    return {k: np.asarray(v) for k, v in fields.items()}


def assert_equal(ref: dict, got: dict, what: str) -> str:
    ref, got = host(ref), host(got)
    for key in ("num_accepted", "tokens"):
        if ref[key].shape != got[key].shape or not np.array_equal(ref[key], got[key]):
            rows = np.nonzero(np.any((ref[key] != got[key]).reshape(len(ref[key]), -1), axis=1))[0]
            raise AssertionError(
                f"{what}: {key} differs from one device in rows {rows.tolist()}: "
                f"{ref[key][rows].tolist()} vs {got[key][rows].tolist()}"
            )
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


def run_case(case: Case, mesh_name: str) -> str:
    from jax.sharding import PartitionSpec as P

    from specjax import rejection_sample, verify_from_logits
    from specjax.boundary.api import rejection_sample_sharded, verify_from_logits_sharded

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
        x, dl, tl, kwargs = logits_inputs(case.batch, case.num_draft, case.vocab, seed, case.filters, case.row_keys)
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
    for key, value in vars(got).items():
        if value.sharding.mesh.shape != mesh.shape or len(value.sharding.device_set) != 8:
            raise AssertionError(f"{key}: expected a result on the 8-device mesh, got {value.sharding}")
    return assert_equal(ref, got, case.name(mesh_name))


# --------------------------------------------------------------------------- agreement

AGREE_MESH = "1x8"


def per_shard_probs(bad: bool) -> dict:
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
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=_out_specs(layout, True), check_vma=False))
    return fn(
        *(place(a, mesh, spec) for a, spec in zip((x, q, p), specs, strict=False)), place(jax.random.key(0), mesh, P())
    )


def check_copies(ref: dict, got: dict) -> str:
    bad = shards_agree(got)
    assert not bad, f"vocabulary shards disagree on {bad}"
    got = host(got)
    for i in range(got["tokens"].shape[0]):
        assert_equal(ref, {k: v[i] for k, v in got.items()}, f"shard {i}")
    return f"all {got['tokens'].shape[0]} vocabulary shards agree with each other and with one device"


# --------------------------------------------------------------------------- HLO

# V-sharded inputs of a realistic vocabulary (32000 = 8 x 4000: shards not
# multiples of the 128-wide CDF blocks). The same compiled program is checked
# for collectives and then run against one device.
HLO_BATCH, HLO_DRAFT, HLO_VOCAB = 16, 4, 32000


def hlo_inputs(mesh, kernel: str, filters: bool = False) -> tuple[tuple, dict, Any]:
    """(arguments of the jitted mesh kernel placed on ``mesh``, its static kwargs, the reference)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from specjax import rejection_sample, verify_from_logits
    from specjax.boundary.validation import prepare_params
    from specjax.kernels.sharded import MeshLayout

    b, g, v = HLO_BATCH, HLO_DRAFT, HLO_VOCAB
    layout = MeshLayout(mesh, "b", "v")
    big, row, pair = P("b", None, "v"), P("b"), P("b", None)
    if kernel == "probs":
        x, q, p, u, s = probs_inputs(b, g, v, seed=5)
        args = (
            place(x, mesh, pair),
            place(q, mesh, big),
            place(p, mesh, big),
            place(u, mesh, pair),
            place(s, mesh, row),
        )
        return args, {"layout": layout}, rejection_sample(x, q, p, u, s)
    x, dl, tl, kw = logits_inputs(b, g, v, seed=5, filters=filters, row_keys=False)
    params = prepare_params(kw["temperature"], kw.get("top_k"), kw.get("top_p"), b, False)
    assert params.use_top_k == params.use_top_p == filters
    args = (
        place(x, mesh, pair),
        place(dl, mesh, big),
        place(tl, mesh, big),
        place(kw["key"], mesh, P()),
        jax.tree.map(lambda a: place(np.asarray(a), mesh, row), params),
        place(np.asarray(kw["draft_lengths"]), mesh, row),
    )
    static = {"layout": layout}
    return args, static, verify_from_logits(x, dl, tl, **kw)


def naive_rejection_jit(mesh):
    """The obvious sharded version: all-gather the vocabulary, then run the kernel on every device."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from specjax.kernels.results import AcceptanceResult
    from specjax.kernels.sharded import _rejection_body

    def body(x, q, p, u, s):
        q = lax.all_gather(q, "v", axis=2, tiled=True)
        p = lax.all_gather(p, "v", axis=2, tiled=True)
        return _rejection_body(x, q, p, u, s, vocab_axis=None, per_shard=False)

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("b", None), P("b", None, "v"), P("b", None, "v"), P("b", None), P("b")),
            out_specs=AcceptanceResult(P("b"), P("b", None)),
            check_vma=False,
        )
    )


def vocab_sized(collectives: list[dict], vocab_local: int) -> list[dict]:
    """The collectives with an operand or result dimension of a vocabulary shard's size or more."""
    return [c for c in collectives if c["max_dim"] >= vocab_local]


def hlo_check(mesh_name: str, kernel: str, filters: bool = False) -> str:
    from specjax.kernels.sharded import (
        _rejection_sample_mesh_jit,
        _verify_mesh_jit,
    )

    mesh = make_mesh(mesh_name)
    vocab_local = HLO_VOCAB // MESHES[mesh_name][1]
    args, static, ref = hlo_inputs(mesh, kernel, filters)
    jitted = _rejection_sample_mesh_jit if kernel == "probs" else _verify_mesh_jit
    compiled = jitted.lower(*args, **static).compile()
    from _hlo import hlo_collectives

    found = hlo_collectives(compiled.as_text())
    assert found, "no collectives at all: is the vocabulary really split?"
    offenders = vocab_sized(found, vocab_local)
    assert not offenders, "collectives carrying a vocabulary dimension:\n" + "\n".join(
        c["line"][:300] for c in offenders
    )
    # A collective inside a loop reuses one rendezvous key per iteration on XLA:CPU,
    # and a device running ahead can join the wrong iteration's rendezvous (a crash
    # under load); see collectives._smallest_float.
    in_loops = [c for c in found if c["count"] != 1]
    assert not in_loops, "collectives inside loops:\n" + "\n".join(c["line"][:300] for c in in_loops)
    assert_equal(ref, compiled(*args), f"{kernel} on {mesh_name}")
    total = sum(c["operand_bytes"] * c["count"] for c in found)
    biggest = max(c["max_dim"] for c in found)
    return (
        f"{len(found)} collectives, largest dimension {biggest} < V/S = {vocab_local}, "
        f"{total} operand bytes per device per call; results equal one device's"
    )


# --------------------------------------------------------------------------- rounding


def draw_weights(q: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    """float64 weights the emitted token is drawn from, for a row with n accepted."""
    g = q.shape[0]
    target = p[n].astype(np.float64)
    if n == g:
        return target
    residual = np.maximum(target - q[n].astype(np.float64), 0)
    return residual if residual.sum() > 0 else target


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

    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=num_processes, process_id=process_id
    )
    mesh = jax.make_mesh((2, len(jax.devices()) // 2), ("b", "v"))  # the devices of all processes

    def global_array(x, spec):
        # Each process contributes the slices its own devices hold.
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])

    (x, q, p, u, s), (xl, dl, tl, kwargs) = multiprocess_inputs()
    big = P("b", None, "v")
    probs = specjax.rejection_sample(x, global_array(q, big), global_array(p, big), u, s)
    logits = specjax.verify_from_logits(xl, global_array(dl, big), global_array(tl, big), **kwargs)
    result = {
        f"{kernel}_{k}": multihost_utils.process_allgather(v, tiled=True)
        for kernel, r in (("probs", probs), ("logits", logits))
        for k, v in r.items()
    }
    np.savez(f"{out}_{process_id}.npz", **result)
