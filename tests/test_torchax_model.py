"""A transformers model as a jitted pure JAX function through torchax (issue 55), on JAX's CPU backend.

The reference is the same model's torch eager forward over each row's whole
sequence; the JAX forward runs it in pieces through its static, per-row KV
cache (:mod:`specjax.generate.jax_model`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchax.interop import jax_view
from torchax_models import on_jax, tiny_llama
from transformers import MistralConfig, MistralForCausalLM

from specjax.generate import jax_model as jm
from specjax.generate.jax_model import cache_dtype, jax_model

# torchax registers torch's "jax" device in this process, which breaks accelerate's
# offloading elsewhere: these run in their own pytest session (make test-torchax).
pytestmark = pytest.mark.torchax

TOL = 2e-5  # float32 on both sides; observed about 3e-7


def eager_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))[None].long()).logits[0].numpy()


@pytest.fixture(scope="module")
def forward():
    return jax.jit(lambda m, w, c, t, s, keep: m.forward(w, c, t, s, keep), static_argnums=(0, 5))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_pieces_through_the_cache_match_the_eager_forward(forward, tie):
    """Rows at different positions (a prefill with filler past the shorter row, then pieces of width 3
    and 1), each compared with torch's eager forward over that row's whole sequence."""
    model = tiny_llama(tie=tie)
    m = jax_model("target", model)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 256, 12), rng.integers(0, 256, 9)]
    lengths = [7, 4]  # prompt lengths: row 1's prefill has 3 filler tokens past its prompt
    cache = m.init_cache(2, 16)
    prefill = np.zeros((2, 7), np.int32)
    for b, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
        prefill[b, :n] = seq[:n]
    got = [[], []]
    logits, cache = forward(m, m.weights, cache, jnp.asarray(prefill), jnp.zeros(2, jnp.int32), None)
    for b, n in enumerate(lengths):
        got[b].append(np.asarray(logits[b, :n]))
    pos = np.array(lengths)
    for width in (3, 1, 1):
        piece = np.stack([seqs[b][pos[b] : pos[b] + width] for b in range(2)]).astype(np.int32)
        logits, cache = forward(m, m.weights, cache, jnp.asarray(piece), jnp.asarray(pos, jnp.int32), None)
        for b in range(2):
            got[b].append(np.asarray(logits[b]))
        pos += width
    for b in range(2):
        mine = np.concatenate(got[b])
        ref = eager_logits(model, seqs[b][: pos[b]])
        np.testing.assert_allclose(mine, ref, atol=TOL, rtol=0)
        assert (mine.argmax(-1) == ref.argmax(-1)).all()


def test_rejected_tokens_are_overwritten_by_the_next_forward(forward):
    """A forward of 4 tokens of which the row keeps 1; the next forward starts right after it: the
    logits are those of the kept sequence (the 3 rejected ones are neither seen nor kept)."""
    model = tiny_llama(seed=1)
    m = jax_model("target", model)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 256, 10).astype(np.int32)
    junk = rng.integers(0, 256, 3).astype(np.int32)
    cache = m.init_cache(1, 16)
    _, cache = forward(m, m.weights, cache, jnp.asarray(seq[None, :5]), jnp.zeros(1, jnp.int32), None)
    step = np.concatenate([seq[5:6], junk])[None]
    _, cache = forward(m, m.weights, cache, jnp.asarray(step), jnp.full(1, 5, jnp.int32), None)
    logits, _ = forward(m, m.weights, cache, jnp.asarray(seq[None, 6:10]), jnp.full(1, 6, jnp.int32), 2)
    ref = eager_logits(model, seq)[-2:]
    np.testing.assert_allclose(np.asarray(logits[0]), ref, atol=TOL, rtol=0)


def test_the_cache_is_written_without_a_scatter_loop(forward):
    """A step's few tokens go in by selects against the slot index (no scatter: a TPU runs XLA's per-row slice
    update as a loop over the rows, 6 of a B = 32 token's 6.75 ms); a prompt's many as one slice a row (a
    batched dynamic_update_slice, one index per row), never an element-wise scatter (B·H·W·D indices, about
    3x slower a forward on a TPU v5e chip: docs/tpu.md). The pieces test above checks the values."""
    m = jax_model("target", tiny_llama(seed=3))
    cache = m.init_cache(2, 48)

    def scatters(width: int) -> list[str]:
        tokens, start = jnp.zeros((2, width), jnp.int32), jnp.array([4, 0], jnp.int32)
        hlo = forward.lower(m, m.weights, cache, tokens, start, None).as_text()
        return [line for line in hlo.splitlines() if '"stablehlo.scatter"' in line]

    assert scatters(1) == [] and scatters(5) == [] and scatters(17) == []  # 17: the draft's catch-up
    wide = scatters(40)
    assert len(wide) == 2 * m.num_layers  # keys and values of each layer
    for line in wide:
        assert "update_window_dims = [1, 2, 3]" in line and "inserted_window_dims" not in line, line


@pytest.mark.parametrize("width", [1, 2, 5, 17, 32, 33, 40])
def test_written_slots_are_each_rows_slice_update(width):
    """write_slots puts each row's W new entries at its own slots, as a dynamic_update_slice per row does, bit
    for bit (selects up to 32 wide, the slice update beyond); nothing else in the cache changes."""
    from specjax.generate.jax_model import write_slots

    rng = np.random.default_rng(width)
    b, h, s, d = 3, 2, 48, 4
    cache = jnp.asarray(rng.normal(size=(b, h, s, d)), jnp.float32)
    new = jnp.asarray(rng.normal(size=(b, h, width, d)), jnp.float32)
    first = jnp.asarray([0, 3, s - width], jnp.int32)
    want = jax.vmap(lambda c, n, f: jax.lax.dynamic_update_slice(c, n, (0, f, 0)))(cache, new, first)
    got = jax.jit(write_slots)(cache, new, first)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(np.asarray(got), np.asarray(cache))


@pytest.mark.parametrize("width", [1, 3])
def test_grouped_query_heads_read_the_cache_without_repeating_it(forward, width):
    """4 query heads over 2 key/value heads: transformers' sdpa repeats each key/value head for a forward of
    more than one token (a copy of the whole cache per layer and forward, which a TPU pays at every
    verification); here no array of the repeated shape (B, H, S, D) is made at any width, the shared
    heads are read as they lie (the pieces test above checks the values), and the model's config names
    its own attention again after the trace."""
    model = tiny_llama(seed=4)
    m = jax_model("target", model)
    cache = m.init_cache(2, 16)  # 17 slots
    text = forward.lower(m, m.weights, cache, jnp.zeros((2, width), jnp.int32), jnp.array([4, 0], jnp.int32), None)
    text = text.as_text()
    assert "tensor<2x2x17x16xf32>" in text  # the cache itself (B, H_kv, S, D)
    assert "tensor<2x4x17x16xf32>" not in text and "tensor<2x2x2x17x16xf32>" not in text
    assert model.config._attn_implementation == "sdpa"


def test_a_torchax_model_is_read_without_copies():
    """A model moved to torchax's jax device: its weights are its own arrays (the same buffers)."""
    model = on_jax(tiny_llama(seed=2))
    m = jax_model("target", model)

    for name, p in model.named_parameters():
        assert m.weights[name] is jax_view(p), name


def test_sliding_window_models_are_refused():
    torch.manual_seed(0)
    cfg = MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    with pytest.raises(ValueError, match=r"target: the JAX path .* full causal attention"):
        jax_model("target", MistralForCausalLM(cfg))


@pytest.mark.parametrize("layers", [(-1,), (0, 1, -1)], ids=["final", "several"])
def test_hidden_states_through_the_cache_match_the_eager_forward(layers):
    """The states an EAGLE head reads, from the same forward as the logits: a prefill, then a piece of 3
    at each row's own position, against torch's ``output_hidden_states`` over the whole sequence (the
    final normed state at -1; EAGLE-3's layers concatenated in order)."""
    model = tiny_llama(seed=3)
    m = jax_model("target", model)
    step = jax.jit(lambda w, c, t, s: m.forward_hidden(w, c, t, s, 1, layers))
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 256, 9), rng.integers(0, 256, 7)]
    lengths = [6, 4]
    prefill = np.zeros((2, 6), np.int32)
    for b, n in enumerate(lengths):
        prefill[b, :n] = seqs[b][:n]
    _, cache, first = step(m.weights, m.init_cache(2, 16), jnp.asarray(prefill), jnp.zeros(2, jnp.int32))
    piece = np.stack([seqs[b][n : n + 3] for b, n in enumerate(lengths)]).astype(np.int32)
    logits, _, second = step(m.weights, cache, jnp.asarray(piece), jnp.asarray(lengths, jnp.int32))
    assert second.shape == (2, 3, len(layers) * 64) and logits.shape == (2, 1, 256)
    for b, n in enumerate(lengths):
        with torch.no_grad():
            out = model(torch.as_tensor(seqs[b][: n + 3])[None].long(), output_hidden_states=True)
        ref = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).numpy()
        mine = np.concatenate([np.asarray(first[b, :n]), np.asarray(second[b])])
        np.testing.assert_allclose(mine, ref, atol=TOL, rtol=0)
        np.testing.assert_allclose(np.asarray(logits[b, 0]), out.logits[0, -1].numpy(), atol=TOL, rtol=0)


def test_threads_tracing_one_model_at_once_get_the_sequential_results():
    """``functional_call`` swaps the module's weights while a forward is traced: threads tracing the same model at
    once (a server's requests, tpu_loop's overlapping compilations) must neither see each other's tracers
    (UnexpectedTracerError) nor each other's weights. Each thread traces a program of its own width."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    m = jax_model("target", on_jax(tiny_llama()))
    widths = [1, 2, 3, 4, 5, 6]

    def run(width: int) -> np.ndarray:  # a fresh jit: every call traces
        fwd = jax.jit(lambda w, c, t: m.forward(w, c, t, jnp.zeros(2, jnp.int32), None)[0])
        tokens = (jnp.arange(2 * width, dtype=jnp.int32).reshape(2, width) * 37) % 256
        return np.asarray(fwd(m.weights, m.init_cache(2, 16), tokens))

    barrier = threading.Barrier(len(widths))

    def together(width: int) -> np.ndarray:
        barrier.wait()
        return run(width)

    with ThreadPoolExecutor(len(widths)) as pool:
        got = list(pool.map(together, widths))
    for width, logits in zip(widths, got, strict=True):
        np.testing.assert_allclose(logits, run(width), rtol=0, atol=TOL)


@pytest.mark.parametrize(
    ("weights", "platform", "precision", "want"),
    [
        ("float32", "tpu", None, "bfloat16"),
        ("float32", "tpu", "default", "bfloat16"),
        ("float32", "tpu", "bfloat16", "bfloat16"),
        ("float32", "tpu", "fastest", "bfloat16"),
        ("float32", "tpu", "high", "float32"),
        ("float32", "tpu", "highest", "float32"),
        ("float32", "tpu", "float32", "float32"),
        ("float32", "tpu", "tensorfloat32", "float32"),
        ("float32", "cpu", None, "float32"),
        ("float32", "gpu", None, "float32"),
        ("bfloat16", "tpu", None, "bfloat16"),
        ("float16", "tpu", None, "float16"),
        ("float16", "tpu", "highest", "float16"),
    ],
)
def test_the_cache_is_bfloat16_only_where_a_tpus_products_read_bfloat16(weights, platform, precision, want):
    assert cache_dtype(jnp.dtype(weights), platform, precision) == jnp.dtype(want)


def test_a_float32_model_on_this_backend_keeps_a_float32_cache():
    m = jax_model("target", tiny_llama())
    assert {a.dtype for layer in m.init_cache(1, 4) for a in layer} == {jnp.dtype("float32")}


def test_a_bfloat16_cache_holds_the_rounded_keys_and_feeds_float32_attention(forward, monkeypatch):
    """The TPU's choice (:func:`cache_dtype`) forced on this backend: the first layer's keys and values (which
    no cache read precedes) are the float32 cache's rounded to bfloat16, bit for bit; the attention reads
    them back as float32 (the logits stay float32 and close to the float32 cache's, yet differ: the
    narrower cache is what later layers read)."""
    m = jax_model("target", tiny_llama())
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 7)), jnp.int32)
    start = jnp.zeros(2, jnp.int32)
    wide, wide_cache = forward(m, m.weights, m.init_cache(2, 16), tokens, start, None)
    monkeypatch.setattr(jm, "cache_dtype", lambda *args: np.dtype(jnp.bfloat16))
    narrow_cache = m.init_cache(2, 16)
    assert narrow_cache[0][0].dtype == jnp.bfloat16
    narrow, narrow_cache = forward(m, m.weights, narrow_cache, tokens, start, None)
    assert narrow.dtype == jnp.float32 and narrow_cache[-1][1].dtype == jnp.bfloat16
    for a, b in zip(narrow_cache[0], wide_cache[0], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b.astype(jnp.bfloat16), np.float32))
    gap = np.abs(np.asarray(narrow) - np.asarray(wide)).max()
    assert 0 < gap < 0.05, gap
