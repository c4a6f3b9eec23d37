"""The vLLM plugin's step: vLLM's flattened drafts in, the kernels' layouts, vLLM's token layout out.

:func:`run_step` is :func:`specjax.plugin.vllm.rejection_sample`'s work
(the package docstring describes the modes): all-greedy steps from torch's
argmax, point-mass drafts on :mod:`specjax.kernels.flat`, given draft
probabilities on the kernel's (B', G+1, V) layout in reused buffers. The
jitted functions are built once per process, at the first sampled step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["all_greedy", "run_step"]


def _bucket(batch: int) -> int:
    """The padded batch size B': the next power of two (JAX compiles once per B')."""
    return 1 << max(batch - 1, 0).bit_length()


_widest_draft = 0


def _draft_width(max_spec_len: int) -> int:
    """The kernel's G: the longest draft seen in this process (it only grows).

    vLLM's ``max_spec_len`` is the longest draft of the step, which varies from
    step to step below ``num_speculative_tokens``; one width keeps the number
    of compiled shapes to one per B'. Positions past a row's ``k_b`` are
    never tested.
    """
    global _widest_draft
    _widest_draft = max(_widest_draft, max_spec_len)
    return _widest_draft


class _Buffers:
    """Reused device buffers for the kernel's (B', G+1, V) layout, one per (kind, device, dtype).

    Each grows to the largest size seen; a step takes a contiguous prefix of
    it, so the view starts at the buffer's (aligned) start. The step blocks on
    the kernel's results before it returns, so the next step may overwrite the
    buffer (the aliasing rule of :mod:`specjax.adapters`).
    """

    def __init__(self) -> None:
        self._store: dict[tuple[str, Any, Any], Any] = {}

    def get(self, kind: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Any:
        import math

        import torch

        numel = math.prod(shape)
        key = (kind, device, dtype)
        buf = self._store.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(numel, dtype=dtype, device=device)
            self._store[key] = buf
        return buf[:numel].view(shape)


_buffers = _Buffers()


def _to_kernel(tensor: Any) -> Any:
    """A torch tensor as a jitted call's argument, without a copy (specjax.adapters).

    On CPU, a NumPy view (the logits buffers are aligned; XLA:CPU reads them in
    place, and the small per-row arrays whatever their alignment); on a GPU,
    DLPack.
    """
    import numpy as np

    from specjax.adapters import jit_input

    if isinstance(tensor, np.ndarray):
        return tensor
    if tensor.is_cpu and (not tensor.is_floating_point() or tensor.numel() <= 4096):
        return tensor.numpy()
    return jit_input(tensor)


def run_step(draft_token_ids, draft_lengths, g, draft_probs, target_logits, bonus_token_ids, sampling_metadata):
    """:func:`rejection_sample`'s work (``g`` = max_spec_len, ``draft_lengths`` a host list)."""
    import numpy as np
    import torch

    if all_greedy(sampling_metadata):
        return _greedy_flat(draft_token_ids, draft_lengths, g, target_logits, bonus_token_ids)
    batch = len(draft_lengths)
    device = target_logits.device
    bonus = bonus_token_ids.reshape(batch).to(torch.int32)
    out = torch.full((batch, g + 1), -1, dtype=torch.int32, device=device)
    num_tokens = int(draft_token_ids.shape[0])
    if num_tokens == 0 or g == 0:  # no drafts in this batch: every row emits its bonus token
        out[:, 0] = bonus
        return out
    vocab = int(target_logits.shape[-1])
    if target_logits.dtype != torch.float32:
        target_logits = target_logits.float()
    bp = _bucket(batch)
    width = _draft_width(g)

    # Kernel temperature per request: 0 = greedy (vLLM's temperature 0), 1 = the logits
    # are already processed by vLLM. Padding requests are greedy (the cheapest).
    # (Not every request is greedy here: all-greedy steps took _greedy_flat.)
    temperature = np.zeros(bp, np.float32)
    temperature[:batch] = (sampling_metadata.temperature[:batch] != 0).cpu().numpy()
    k = np.zeros(bp, np.int32)
    k[:batch] = draft_lengths
    starts = np.cumsum(k, dtype=np.int64) - k
    request = np.repeat(np.arange(batch), k[:batch])
    position = np.arange(num_tokens) - starts[request]
    bonus_p = np.full(bp, -1, np.int32)
    bonus_p[:batch] = bonus.cpu().numpy()
    keys = _row_keys(batch, bp, draft_lengths, sampling_metadata.generators, device)

    if draft_probs is None:
        tokens = _point_mass_flat(
            draft_token_ids, target_logits, width, k, starts, request, position, temperature, keys, bonus_p
        )
    else:
        # The given-probabilities step takes the (B', G+1, V) layout: each of the T
        # flattened rows goes to its (request, position) slot once; the other slots
        # (positions >= k_b, padding requests) keep whatever the buffer holds (stale
        # logits): tests there count as failures (their p is zeroed), the token
        # emitted at k_b is replaced by vLLM's bonus, padding results are dropped,
        # and no row's arithmetic reads another.
        slots = torch.from_numpy(request * (width + 1) + position).to(device, non_blocking=True)
        target = _buffers.get("target", (bp, width + 1, vocab), torch.float32, device)
        target.view(-1, vocab).index_copy_(0, slots, target_logits)
        draft = torch.zeros((bp * (width + 1),), dtype=torch.int32, device=device)
        draft.index_copy_(0, slots, draft_token_ids.to(torch.int32))
        draft = draft.view(bp, width + 1)[:, :width].contiguous()
        if draft_probs.dtype != torch.float32:
            draft_probs = draft_probs.float()
        q = _buffers.get("draft", (bp, width, vocab), torch.float32, device)
        q_slots = torch.from_numpy(request * width + position).to(device, non_blocking=True)
        q.view(-1, vocab).index_copy_(0, q_slots, draft_probs)
        tokens = _given_probs_step(draft, q, target, keys, temperature, k, bonus_p)
    out.copy_(_from_kernel(tokens, device)[:batch, : g + 1])
    return out


def all_greedy(sampling_metadata: Any) -> bool:
    """Whether every request of the step is greedy (vLLM's temperature 0)."""
    return sampling_metadata.temperature is None or bool(sampling_metadata.all_greedy)


def _greedy_flat(draft_token_ids, draft_lengths, g, target_logits, bonus_token_ids) -> Any:
    """An all-greedy step on vLLM's flattened rows, by :func:`specjax.kernels.greedy.greedy_row`.

    A greedy row's result needs only the target's first argmax at each draft
    position (and vLLM's bonus token, its greedy token after the last draft):
    one torch reduction over the T rows, then integer compares on the host.
    The JAX step gives the same tokens (``tests/test_vllm_plugin_step.py``)
    but pays, right after the engine's torch forward, more for its dispatch
    than this whole step costs (docs/vllm.md).

    Args:
      draft_token_ids: int[T] (torch); draft_lengths: B host ints ``k_b``;
      g: max ``k_b``; target_logits: f[T, V] (torch);
      bonus_token_ids: int[B, 1] (torch).

    Returns:
      i32[B, g + 1] (torch, on the logits' device).
    """
    import torch

    from specjax.kernels.greedy import greedy_row

    # the first maximum: torch's max over a dim returns the first index on ties, as argmax
    # does, and runs 2.5 times faster here over V = 49152
    best = target_logits.max(dim=-1).indices.tolist()
    draft = draft_token_ids.tolist()
    bonus = bonus_token_ids.reshape(-1).tolist()
    rows = []
    start = 0
    for b, k in enumerate(draft_lengths):
        emitted = greedy_row(draft[start : start + k], [*best[start : start + k], bonus[b]])
        rows.append(emitted + [-1] * (g + 1 - len(emitted)))
        start += k
    return torch.tensor(rows, dtype=torch.int32, device=target_logits.device)


def _row_keys(batch, bp, draft_lengths, generators, device) -> Any:
    """i32[B', 2] (host): each row's key data (a threefry2x32 key's two words, as int32).

    A seeded request's words come from its own generator (so its draws do not
    depend on the batch), and only in steps where it has draft tokens, as
    vLLM's own step consumes its generators; other rows share one draw from
    torch's default generator. (All-greedy steps draw nothing: they never get here.)
    """
    import numpy as np
    import torch

    keys = np.zeros((bp, 2), dtype=np.int32)
    lo, hi = -(2**31), 2**31
    keys[:batch] = torch.randint(lo, hi, (batch, 2), dtype=torch.int32, device=device).cpu().numpy()
    for row, gen in generators.items():
        if row < batch and draft_lengths[row] > 0:
            keys[row] = torch.randint(lo, hi, (2,), dtype=torch.int32, generator=gen, device=gen.device).cpu().numpy()
    return keys


def _from_kernel(array: Any, device: Any) -> Any:
    """The kernel's i32 result as a torch tensor on ``device`` (waits for the kernel)."""
    import numpy as np
    import torch

    if device.type == "cpu" or isinstance(array, np.ndarray):
        return torch.from_numpy(np.array(array)).to(device)
    from specjax.adapters import to_torch

    return to_torch(array).to(device)


def _point_mass_flat(draft_token_ids, target_logits, width, k, starts, request, position, temperature, keys, bonus):
    """Point-mass drafts on vLLM's flattened rows (:mod:`specjax.kernels.flat`): no copy of the logits.

    The T rows are summarised in zero-copy slices whose lengths are the powers of
    two in T's binary expansion (at most log2(T) + 1 calls, each compiled once per
    length and V); the last slice's call also computes the accepted prefixes and
    every token but the sampled corrections on the (B', G) grid; the sampled rows that
    rejected a token are gathered (R rows, padded to a power of two) and drawn in
    one more call.

    Returns:
      i32[B', G+1] on the host.
    """
    import numpy as np
    import torch

    summarise, finish, draw = _point_mass_fns()
    bp = k.shape[0]
    num_tokens = int(draft_token_ids.shape[0])
    draft = draft_token_ids.to(torch.int32).cpu().numpy()
    slots = (request * width + position).astype(np.int32)
    row_temperature = temperature[request]
    grid_p = np.zeros(bp * width, np.float32)
    grid_argmax = np.zeros(bp * width, np.int32)
    grid_draft = np.zeros(bp * width, np.int32)
    grid_draft[slots] = draft
    sizes = [1 << bit for bit in reversed(range(num_tokens.bit_length())) if num_tokens & (1 << bit)]
    start = 0
    for size in sizes[:-1]:
        end = start + size
        grid_p, grid_argmax = summarise(
            grid_p,
            grid_argmax,
            _to_kernel(target_logits[start:end]),
            row_temperature[start:end],
            draft[start:end],
            slots[start:end],
        )
        start = end
    tokens, num_accepted, needs_draw, sample_uniforms = finish(
        grid_p,
        grid_argmax,
        _to_kernel(target_logits[start:]),
        row_temperature[start:],
        draft[start:],
        slots[start:],
        grid_draft,
        keys,
        temperature,
        k,
        bonus,
    )
    tokens = np.array(tokens)
    needs_draw = np.asarray(needs_draw)
    if needs_draw.any():
        rows = np.flatnonzero(needs_draw)
        n = np.asarray(num_accepted)[rows]
        index = np.full(_bucket(len(rows)), starts[rows[0]] + n[0], np.int64)
        index[: len(rows)] = starts[rows] + n
        picked = target_logits.index_select(0, torch.from_numpy(index).to(target_logits.device))
        u = np.asarray(sample_uniforms)[rows]
        y = draw(
            _to_kernel(picked),
            np.ones(len(index), np.float32),
            draft[index],
            np.concatenate([u, np.zeros(len(index) - len(rows), np.float32)]),
        )
        tokens[rows, n] = np.asarray(y)[: len(rows)]
    return tokens


@functools.cache
def _point_mass_fns() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """The jitted stages of :func:`_point_mass_flat` (built on first use: importing JAX is not free).

    ``summarise`` handles every slice but the last; ``finish`` summarises the last
    slice and accepts on the grid in the same call, so a step whose T is a power
    of two (one slice: B = 1 with k = 4, B = 8 with k = 4...) is one dispatch.
    ``summarise`` recompiles per slice length (a power of two), V and B'·G;
    ``finish`` per slice length, V, B' and G; ``draw`` per R' (a power of two) and V. Never
    for values.
    """
    from functools import partial

    from specjax.kernels import cpu_kernels, flat
    from specjax.kernels.compile_options import vector_jit

    impl = cpu_kernels.resolve("auto")  # eager, here: never while tracing
    summarise = vector_jit(partial(flat.summarise_rows, impl=impl))

    @vector_jit
    def finish(
        grid_p,
        grid_argmax,
        logits,
        row_temperature,
        draft,
        slots,
        grid_draft,
        key_words,
        temperature,
        k,
        bonus,
    ):
        grid_p, grid_argmax = flat.summarise_rows(grid_p, grid_argmax, logits, row_temperature, draft, slots, impl)
        b = k.shape[0]
        g = grid_p.shape[0] // b
        u = _uniforms(key_words, g + 1)
        tokens, n, needs_draw = flat.accept(
            grid_p.reshape(b, g),
            grid_argmax.reshape(b, g),
            grid_draft.reshape(b, g),
            k,
            u[:, :g],
            temperature == 0,
            bonus,
        )
        return tokens, n, needs_draw, u[:, g]

    draw = vector_jit(partial(flat.residual_draw, impl=impl))
    return summarise, finish, draw


def _uniforms(key_words: Any, count: int) -> Any:
    """f32[B', count] uniforms in [0, 1), row b's from its own key (traced)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.wrap_key_data(jax.lax.bitcast_convert_type(key_words, jnp.uint32), impl="threefry2x32")
    return jax.vmap(lambda key: jax.random.uniform(key, (count,), jnp.float32))(keys)


def _splice_bonus(xp: Any, tokens: Any, num_accepted: Any, draft_lengths: Any, bonus: Any) -> Any:
    """Where a row accepted all its ``k_b`` draft tokens, vLLM's bonus token at position ``k_b``."""
    positions = xp.arange(tokens.shape[1], dtype=xp.int32)[None, :]
    all_accepted = (num_accepted == draft_lengths)[:, None]
    return xp.where(all_accepted & (positions == draft_lengths[:, None]), bonus[:, None], tokens)


@functools.cache
def _target_probs_fn() -> Callable[..., Any]:
    """Jitted: the target's probabilities (B', G+1, V), 0 at positions >= k_b, and the uniforms.

    Zero rows make every test past ``k_b`` fail (``p(x) = 0``); what the kernel
    emits at ``k_b`` is replaced by vLLM's bonus token.
    """
    import jax.numpy as jnp

    from specjax.kernels import cpu_kernels
    from specjax.kernels.compile_options import vector_jit
    from specjax.kernels.frontend import row_probs, row_stats

    impl = cpu_kernels.resolve("auto")  # eager, here: never while tracing

    @vector_jit
    def probs(target_logits, key_words, temperature, draft_lengths):
        g1 = target_logits.shape[1]
        p = row_probs(row_stats(target_logits, temperature[:, None], impl=impl), target_logits, impl)
        inside = jnp.arange(g1, dtype=jnp.int32)[None, :] < draft_lengths[:, None]
        u = _uniforms(key_words, g1)
        return jnp.where(inside[:, :, None], p, 0), u[:, : g1 - 1], u[:, g1 - 1]

    return probs


def _given_probs_step(draft, q, target, keys, temperature, k_t, bonus_p):
    import numpy as np

    from specjax.boundary.api import rejection_sample as kernel

    p, u, s = _target_probs_fn()(_to_kernel(target), _to_kernel(keys), _to_kernel(temperature), _to_kernel(k_t))
    out = kernel(_to_kernel(draft), _to_kernel(q), p, u, s, validate=False)
    return _splice_bonus(
        np,
        np.asarray(out.tokens),
        np.asarray(out.num_accepted),
        np.asarray(_to_kernel(k_t)),
        np.asarray(_to_kernel(bonus_p)),
    )
