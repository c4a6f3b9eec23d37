"""torchax tensors at specjax's boundary (issue 55): taken as the jax.Array they hold, never copied.

A torchax tensor is a ``torch.Tensor`` holding a ``jax.Array`` (here on JAX's
CPU backend; on a TPU the same). Before, the boundary recognised torch tensors
by ``type(x).__module__ == "torch"``, missed torchax's (``torchax.tensor``) and
fell back to ``np.asarray``: a host copy no counter saw. Identity of the
returned array with the tensor's own is what shows no copy was made.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torchax.interop

import specjax
from specjax.adapters import count_copies, host_array, jit_input, to_jax
from specjax.boundary.validation import as_array

# torchax registers torch's "jax" device in this process, which breaks accelerate's
# offloading elsewhere: these run in their own pytest session (make test-torchax).
pytestmark = pytest.mark.torchax


def held(shape=(2, 3, 32), seed=0, dtype=jnp.float32):
    """A jax.Array and the torchax tensor that holds it."""
    a = jax.random.normal(jax.random.key(seed), shape, dtype)
    return a, torchax.interop.torch_view(a)


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda t: to_jax(t), id="to_jax"),
        pytest.param(lambda t: to_jax(t, copy=False), id="to_jax-copy-False"),
        pytest.param(jit_input, id="jit_input"),
        pytest.param(lambda t: as_array("x", t), id="as_array"),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_a_torchax_tensor_is_its_own_array(convert, dtype):
    a, t = held(dtype=jnp.float32)
    a = a.astype(dtype)
    t = torchax.interop.torch_view(a)
    with count_copies() as c:
        out = convert(t)
    assert out is a
    assert c.copies == 0


def test_copy_true_copies_on_the_device_and_counts_it():
    a, t = held()
    with count_copies() as c:
        out = to_jax(t, copy=True)
    assert out is not a and out.unsafe_buffer_pointer() != a.unsafe_buffer_pointer()
    assert out.devices() == a.devices()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
    assert c.by_reason["requested"] == 1


def test_host_array_of_a_torchax_tensor_on_the_cpu_backend_shares_its_buffer():
    a, t = held()
    h = host_array(t)
    assert isinstance(h, np.ndarray)
    assert h.ctypes.data == a.unsafe_buffer_pointer()


def test_verify_from_logits_takes_torchax_logits_without_a_copy():
    """The public entry point on torchax tensors: the JAX arrays' result, zero counted copies. (That no
    uncounted host copy is made either is the identity test above: on JAX's CPU backend a host copy
    and the array give the same result here.)"""
    b, g, v = 3, 4, 64
    dl, dl_t = held((b, g, v), 1)
    tl, tl_t = held((b, g + 1, v), 2)
    draft = jnp.argmax(dl, axis=-1).astype(jnp.int32)
    kw = dict(key=jax.random.key(7), temperature=0.8, top_k=20)
    want = specjax.verify_from_logits(draft, dl, tl, **kw)
    with count_copies() as c:
        got = specjax.verify_from_logits(torchax.interop.torch_view(draft), dl_t, tl_t, **kw)
    assert c.copies == 0
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.num_accepted), np.asarray(want.num_accepted))
