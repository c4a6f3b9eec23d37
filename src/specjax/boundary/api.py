"""The public entry points: user inputs in, validated JAX arrays to the kernels, results out.

This is the boundary layer, above :mod:`specjax.kernels` (pure JAX, JAX arrays
in and out) and :mod:`specjax.adapters` (torch ↔ JAX). Each function converts
and checks its inputs (:mod:`specjax.boundary.validation`, outside jit), then
calls one jitted kernel: on one device, or on a device mesh
(:mod:`specjax.kernels.sharded`) when the target probabilities/logits carry a
``NamedSharding`` that splits B and/or V, or when the ``*_sharded`` forms name
the mesh. Vocabulary: see :mod:`specjax.kernels.rejection`.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specjax.boundary import validation as _v
from specjax.boundary.validation import ArrayInput, FloatOrRows, IntOrRows
from specjax.kernels import cpu_kernels, frontend, rejection, sharded
from specjax.kernels.core import AxisName
from specjax.kernels.types import AcceptanceResult

__all__ = [
    "rejection_sample",
    "rejection_sample_sharded",
    "sample_from_logits",
    "verify_from_logits",
    "verify_from_logits_sharded",
]


def rejection_sample(
    draft_tokens: ArrayInput,
    draft_probs: ArrayInput | None,
    target_probs: ArrayInput,
    accept_uniforms: ArrayInput,
    sample_uniforms: ArrayInput,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> AcceptanceResult:
    """Decide how many draft tokens to keep and draw the correction or bonus token.

    Args:
      draft_tokens: i32[B, G] or i64[B, G], ``x_i``, in [0, V).
      draft_probs: f[B, G, V], ``q_i``: the distribution ``x_i`` was sampled from;
        or None when each ``x_i`` was proposed deterministically (an n-gram
        match, a greedy head): ``q_i`` is then the point mass at ``x_i``, so test
        ``i`` passes iff ``u_i < p_i(x_i)`` and a correction token is drawn
        from ``p_n`` without ``x_n`` (renormalised). No (B, G, V) array is built.
      target_probs: f[B, G+1, V], ``p_i``; ``p_G`` follows the last draft token.
      accept_uniforms: f[B, G], ``u_i`` in [0, 1).
      sample_uniforms: f[B], ``s`` in [0, 1).
      validate: check shapes, dtypes and values at the Python boundary (the value
        checks need one device→host sync). ``validate=False`` keeps only the
        shape/dtype checks, for generation loops.
      impl: ``"auto"`` (the default: the C++ CPU kernels where they are
        available, else the JAX code), ``"xla"`` (the JAX code, the reference,
        on every platform) or ``"cpu"`` (the kernels; an error where they are
        not available). Static: each choice compiles its own function; see
        :mod:`specjax.kernels.cpu_kernels`.

    Inputs may be Python lists, NumPy arrays, JAX arrays or torch tensors
    (torch tensors cross through :func:`specjax.adapters.to_jax`).
    Probabilities may be float16, bfloat16, float32 or float64; they are
    compared in the wider of their dtype and float32 (float64 needs
    ``jax_enable_x64``; otherwise JAX stores float64 inputs as float32).

    Returns:
      :class:`AcceptanceResult` ``(num_accepted: i32[B], tokens: i32[B, G+1])``.
      Row b of ``tokens`` holds the ``n`` accepted draft tokens, then ``y``,
      then -1.

    The contract:

    * test ``i`` passes iff ``u_i < p_i(x_i) / q_i(x_i)``; tests run in order and
      ``n`` counts those passed before the first failure (``n = G`` if none
      fails). ``q_i(x_i) = 0`` passes iff ``p_i(x_i) > 0``; ``p_i(x_i) = 0``
      always fails, also with ``u_i = 0``.
    * ``y`` is drawn at position ``n`` from ``r(v) ∝ max(p_n(v) − q_n(v), 0)`` if
      ``n < G``, or ``r(v) ∝ p_G(v)`` if ``n = G``: the smallest ``v`` whose
      cumulative probability ``r(0)+…+r(v)`` exceeds ``s``.
    * a residual that sums to zero (only possible with unnormalised inputs)
      draws from ``p_n`` instead; when rounding leaves no cumulative value above
      ``s``, ``y`` is the largest ``v`` with ``r(v) > 0``. So ``y`` is never a
      zero-probability token, -1 or V.
    * ``G = 0`` draws ``y`` from ``p_0``; ``B = 0`` returns empty arrays.

    Compilation: jitted; recompiles only when the shapes or dtypes of the inputs
    change, never for new values.

    Device meshes: when ``target_probs`` is a ``NamedSharding`` that splits B
    and/or V, the kernel runs on that mesh without gathering the vocabulary
    (:mod:`specjax.kernels.sharded`, ``docs/distributed.md``).

    Raises:
      ValueError: naming the argument, with what was expected and what was got.
    """
    return _rejection_sample(
        draft_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        validate=validate,
        layout=None,
        impl=impl,
    )


def _rejection_sample(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    validate: bool,
    layout: sharded.MeshLayout | None,
    impl: str = "auto",
) -> AcceptanceResult:
    """:func:`rejection_sample` on ``layout``, or where ``target_probs`` lies (``layout=None``)."""
    impl = cpu_kernels.resolve(impl)
    args = _v.convert_kernel_inputs(
        draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms, validate=validate
    )
    b, g = args[0].shape
    if b == 0:
        return AcceptanceResult(jnp.zeros((0,), jnp.int32), jnp.zeros((0, g + 1), jnp.int32))
    if layout is None:
        layout = sharded.mesh_layout(args[2], "target_probs")
    if layout is not None:  # split over B and/or V on a device mesh
        return sharded.rejection_sample_on_mesh(*args, layout)
    return rejection._rejection_sample_jit(*args, impl=impl)


def sample_from_logits(
    logits: Any,  # ArrayInput; Any because the body rebinds it to the converted array
    *,
    key: jax.Array,
    temperature: FloatOrRows,
    top_k: IntOrRows | None = None,
    top_p: FloatOrRows | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Process logits into a sampling distribution and draw one token per row.

    Args:
      logits: f[B, V] (float16/bfloat16/float32/float64; processed in float32).
      key: a JAX PRNG key, or one key per row (shape (B,)).
      temperature: scalar or f32[B]; 0 = greedy (argmax, first index on ties).
      top_k: None, or scalar / i32[B]; 0 keeps all.
      top_p: None, or scalar / f32[B] in (0, 1]; 1 keeps all.
      validate: check values (one host sync). Shapes are always checked.
      impl: ``"auto"`` (the default: the C++ CPU kernels where they are
        available, else the JAX code), ``"xla"`` (the JAX code, the reference,
        on every platform) or ``"cpu"`` (the kernels; an error where they are
        not available). Static: each choice compiles its own function; see
        :mod:`specjax.kernels.cpu_kernels`.

    Returns:
      ``(tokens, probs)``: ``tokens`` i32[B] drawn from ``probs`` f32[B, V], the
      processed distribution (one-hot for greedy rows). The draw is the inverse
      CDF of ``probs`` at a uniform from ``key``, so tokens and probabilities agree
      by construction.

    Compilation: recompiles when shapes/dtypes change, when ``key`` switches
    between one key and one per row, or when ``top_k``/``top_p`` switch between
    None and given; never when their values change.
    """
    logits = _v.as_array("logits", logits)
    _v.check_rank("logits", logits, 2, "BV")
    _v.check_float("logits", logits)
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError("logits: expected a vocabulary size V >= 1, got V = 0")
    key = _v.as_key(key, batch)
    params = _v.prepare_params(temperature, top_k, top_p, batch, validate, impl)
    logits = _v.for_jit(logits)  # read by the check and the draw
    if validate and batch:
        _v.check_logits("logits", logits)
    if batch == 0:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0, vocab), jnp.float32)
    return frontend._sample_jit(logits, key, params)


def verify_from_logits(
    # ArrayInput (draft_logits: or None); Any because the body rebinds them to the converted arrays
    draft_tokens: Any,
    draft_logits: Any,
    target_logits: Any,
    *,
    key: jax.Array,
    temperature: FloatOrRows,
    top_k: IntOrRows | None = None,
    top_p: FloatOrRows | None = None,
    draft_lengths: IntOrRows | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> AcceptanceResult:
    """The acceptance step from logits: process both sides identically, then accept/draw.

    Args:
      draft_tokens: i32/i64[B, G], ``x_i``; entries at positions ``>= k_b`` are ignored.
      draft_logits: f[B, G, V]: the draft model's logits the ``x_i`` were sampled
        from; or None for deterministic proposals (an n-gram match): each ``q_i``
        is then the point mass at ``x_i`` (see :func:`specjax.rejection_sample`),
        at every temperature, with the target processed as usual.
      target_logits: f[B, G+1, V]: the target model's logits at the same positions,
        plus the one after the last draft token.
      key: a JAX PRNG key, or one per row (shape (B,)) so that a row's outcome does
        not depend on which other rows share its batch. The acceptance uniforms
        ``u`` and the sampling uniform ``s`` come from it.
      temperature: scalar or f32[B]; rows with 0 are greedy: ``x_i`` is accepted iff
        it equals ``argmax p_i``, and the correction/bonus token is ``argmax``.
      top_k: None, or scalar / i32[B] (0 keeps all).
      top_p: None, or scalar / f32[B] in (0, 1] (1 keeps all).
      draft_lengths: None (every row's draft length is G), or i32[B] ``k_b`` in
        [0, G], each row's draft length: row b tests only its first ``k_b`` draft
        tokens; its correction or bonus token sits at position ``<= k_b``;
        ``k_b = 0`` emits one token from ``p_0``.
      validate: check values (one host sync); shapes are always checked. Without
        the checks, a draft id outside [0, V) is never accepted and ``k_b``
        outside [0, G] acts as its clamped value; non-finite logits give
        unspecified tokens.
      impl: ``"auto"`` (the default: the C++ CPU kernels where they are
        available, else the JAX code), ``"xla"`` (the JAX code, the reference,
        on every platform) or ``"cpu"`` (the kernels; an error where they are
        not available). Static: each choice compiles its own function; see
        :mod:`specjax.kernels.cpu_kernels`.

    Returns:
      :class:`AcceptanceResult` ``(num_accepted: i32[B], tokens: i32[B, G+1])`` as
      :func:`specjax.rejection_sample`: accepted tokens, then the emitted token,
      then -1.

    Both logits go through :func:`row_stats` with the same parameters, then the
    foundation kernel's acceptance rule and blocked inverse-CDF draw run in the
    same jitted function. Compilation: recompiles when shapes/dtypes change,
    when ``key`` switches between one key and one per row, or when ``top_k`` /
    ``top_p`` switch between None and given; never for new values.

    Device meshes: when ``target_logits`` is a ``NamedSharding`` that splits B
    and/or V (a tensor-parallel LM head), the step runs on that mesh without
    gathering the vocabulary (:mod:`specjax.kernels.sharded`, ``docs/distributed.md``).
    """
    return _verify_from_logits(
        draft_tokens,
        draft_logits,
        target_logits,
        key=key,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        draft_lengths=draft_lengths,
        validate=validate,
        layout=None,
        impl=impl,
    )


@functools.lru_cache(maxsize=256)
def _verify_shapes(
    tokens_shape: tuple[int, ...],
    draft: tuple[tuple[int, ...], Any] | None,
    target: tuple[tuple[int, ...], Any],
) -> tuple[int, int, int]:
    """(B, G, V) of :func:`verify_from_logits`'s arrays, or the ``ValueError`` naming the argument.

    Takes shapes and dtypes only, so a call with the shapes and dtypes of an
    earlier one costs one cache lookup (at B = 1 on a CPU the boundary's Python
    is a good part of the call). ``draft`` is None for point-mass drafts.
    """
    draft_shape: tuple[int, ...] = () if draft is None else draft[0]
    draft_dtype = None if draft is None else draft[1]
    target_shape, target_dtype = target
    _v.check_rank("draft_tokens", _Shaped(tokens_shape), 2, "BG")
    if draft is not None:
        _v.check_rank("draft_logits", _Shaped(draft_shape), 3, "BGV")
    _v.check_rank("target_logits", _Shaped(target_shape), 3, ("B", "G+1", "V"))
    batch, g = tokens_shape
    vocab = target_shape[2]
    logits_bg = (target_shape[0], target_shape[1] - 1)
    if draft is not None and tuple(draft_shape[:2]) == logits_bg and (batch, g) != logits_bg:
        # both logits agree: the tokens are the odd one out (B and G are read from them below)
        raise ValueError(f"draft_tokens: expected shape (B, G) = {logits_bg} like the logits, got {(batch, g)}")
    if draft is not None and draft_shape[2] != vocab:
        raise ValueError(
            f"draft_logits: expected the target's vocabulary size V = {vocab}, got {draft_shape[2]} "
            "(pad the smaller vocabulary with -inf logits first)"
        )
    _v.check_shape("target_logits", _Shaped(target_shape), (batch, g + 1, vocab), ("B", "G+1", "V"))
    if draft is not None:
        _v.check_shape("draft_logits", _Shaped(draft_shape), (batch, g, vocab), "BGV")
    if vocab == 0:
        raise ValueError("target_logits: expected a vocabulary size V >= 1, got V = 0")
    if draft is not None:
        _v.check_float("draft_logits", _Shaped(draft_shape, draft_dtype))
    _v.check_float("target_logits", _Shaped(target_shape, target_dtype))
    return batch, g, vocab


class _Shaped(NamedTuple):
    """A shape (and dtype) standing for an array in :mod:`specjax.boundary.validation`'s checks."""

    shape: tuple[int, ...]
    dtype: Any = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _verify_from_logits(
    draft_tokens: Any,
    draft_logits: Any,
    target_logits: Any,
    *,
    key: jax.Array,
    temperature: FloatOrRows,
    top_k: IntOrRows | None = None,
    top_p: FloatOrRows | None = None,
    draft_lengths: IntOrRows | None = None,
    validate: bool = True,
    layout: sharded.MeshLayout | None,
    impl: str = "auto",
) -> AcceptanceResult:
    """:func:`verify_from_logits` on ``layout``, or where ``target_logits`` lies (``layout=None``)."""
    draft_tokens = _v.as_array("draft_tokens", _v.token_ids_unchecked(draft_tokens, validate))
    point_masses = draft_logits is None
    if not point_masses:
        draft_logits = _v.as_array("draft_logits", draft_logits)
    target_logits = _v.as_array("target_logits", target_logits)
    batch, g, vocab = _verify_shapes(
        tuple(draft_tokens.shape),
        None if point_masses else (tuple(draft_logits.shape), draft_logits.dtype),
        (tuple(target_logits.shape), target_logits.dtype),
    )
    draft_tokens = _v.as_token_ids("draft_tokens", draft_tokens)
    key = _v.as_key(key, batch)
    params = _v.prepare_params(temperature, top_k, top_p, batch, validate, impl)
    if draft_lengths is None:
        k = _v.full_k(batch, g)
    else:
        k = _v.row_param("draft_lengths", draft_lengths, batch, "int")
        if validate:
            kh = _v.host_copy(k)
            if np.any(kh < 0) or np.any(kh > g):
                raise ValueError(f"draft_lengths: expected values in [0, G] = [0, {g}], got {kh.tolist()}")
        k = np.ascontiguousarray(k, np.int32)
    if batch == 0:
        return AcceptanceResult(jnp.zeros((0,), jnp.int32), jnp.zeros((0, g + 1), jnp.int32))
    if validate:  # one fused check, one transfer to the host
        # read by the check and the step
        draft_tokens, target_logits = _v.for_jit(draft_tokens), _v.for_jit(target_logits)
        draft_logits = None if point_masses else _v.for_jit(draft_logits)
        lo_hi, t_finite, d_finite = jax.device_get(_v.verify_summary(draft_tokens, k, target_logits, draft_logits))
        lo, hi = (int(v) for v in np.asarray(lo_hi))
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"draft_tokens: expected token ids in [0, V) = [0, {vocab}) at positions < draft_lengths, "
                f"got values in [{lo}, {hi}]"
            )
        _v.check_logits("target_logits", target_logits, bool(t_finite))
        if not point_masses:
            _v.check_logits("draft_logits", draft_logits, bool(d_finite))
    if layout is None:
        layout = sharded.mesh_layout(target_logits, "target_logits")  # split over B and/or V?
    verify = frontend._verify_jit if layout is None else partial(sharded.verify_on_mesh, layout=layout)
    return verify(draft_tokens, draft_logits, target_logits, key, params, k)


def rejection_sample_sharded(
    draft_tokens: Any,
    draft_probs: Any,
    target_probs: Any,
    accept_uniforms: Any,
    sample_uniforms: Any,
    *,
    mesh: Mesh,
    batch_axis: AxisName = None,
    vocab_axis: AxisName = None,
    validate: bool = True,
) -> AcceptanceResult:
    """:func:`rejection_sample` on ``mesh``, rows split over ``batch_axis``, ids over ``vocab_axis``.

    Args:
      draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms,
        validate: as :func:`rejection_sample` (i32[B, G], f[B, G, V],
        f[B, G+1, V], f[B, G], f[B]). Inputs may live anywhere: arrays already
        on ``mesh`` keep their placement, others are placed on it.
      mesh: a :class:`jax.sharding.Mesh`.
      batch_axis: the mesh axis (or tuple of axes) splitting B, or None.
      vocab_axis: the mesh axis (or tuple of axes) splitting V, or None.

    Returns:
      :class:`AcceptanceResult` ``(num_accepted: i32[B], tokens: i32[B, G+1])`` on ``mesh``, split over
      ``batch_axis`` and replicated over the other axes; the values of
      :func:`rejection_sample` (see :mod:`specjax.kernels.sharded` on equality).

    B and V need not divide the shard counts (they are padded). Compilation:
    recompiles when shapes, dtypes or the layout change, never for new values.
    """
    sharded.check_axes(mesh, batch_axis, vocab_axis)
    return _rejection_sample(
        draft_tokens,
        draft_probs,
        target_probs,
        accept_uniforms,
        sample_uniforms,
        validate=validate,
        layout=sharded.MeshLayout(mesh, batch_axis, vocab_axis),
    )


def verify_from_logits_sharded(
    draft_tokens: Any,
    draft_logits: Any,
    target_logits: Any,
    *,
    mesh: Mesh,
    batch_axis: AxisName = None,
    vocab_axis: AxisName = None,
    **kwargs: Any,
) -> AcceptanceResult:
    """:func:`verify_from_logits` on ``mesh``, rows over ``batch_axis``, ids over ``vocab_axis``.

    Args:
      draft_tokens: i32/i64[B, G]; draft_logits: f[B, G, V]; target_logits:
        f[B, G+1, V]; keyword arguments (``key``, ``temperature``, ``top_k``,
        ``top_p``, ``draft_lengths``, ``validate``): as
        :func:`verify_from_logits`.
      mesh, batch_axis, vocab_axis: as :func:`rejection_sample_sharded`.

    Returns:
      :class:`AcceptanceResult` ``(num_accepted: i32[B], tokens: i32[B, G+1])`` on ``mesh``, split over
      ``batch_axis``. The uniforms come from ``key`` exactly as on one device,
      drawn once and shared by all vocabulary shards.
    """
    sharded.check_axes(mesh, batch_axis, vocab_axis)
    return _verify_from_logits(
        draft_tokens,
        draft_logits,
        target_logits,
        layout=sharded.MeshLayout(mesh, batch_axis, vocab_axis),
        **kwargs,
    )
