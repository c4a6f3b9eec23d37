"""specjax.generate.module_tensors.named_tensors: one walk of a model's tree, served again only while it holds.

Each case changes a model the way users and libraries do between two calls of the loop and checks that the
next call sees the change (a stale walk would hand the loop weights the model no longer has).
"""

from __future__ import annotations

import torch
from torch import nn

from specjax.generate.module_tensors import named_tensors


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    net.register_buffer("scale", torch.ones(2))
    return net


def walked(net: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(net.named_parameters()), **dict(net.named_buffers())}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def test_an_unchanged_model_is_walked_once():
    net = model()
    first = named_tensors(net)
    assert same(first, walked(net))
    assert named_tensors(net) is first  # served again
    with torch.no_grad():
        net[0].weight.mul_(2.0)  # values change; the tensors are the same (callers read their _version)
    assert named_tensors(net) is first


def test_a_parameter_set_anew_is_seen():
    net = model()
    named_tensors(net)
    net[0].weight = nn.Parameter(torch.zeros(4, 3))
    assert named_tensors(net)["0.weight"] is net[0].weight


def test_a_swapped_submodule_is_seen():
    # the old submodule still holds its own tensors: only the registration of the new one tells
    net = model()
    named_tensors(net)
    net[2] = nn.Linear(4, 2)
    got = named_tensors(net)
    assert same(got, walked(net))
    assert got["2.weight"] is net[2].weight


def test_an_added_parameter_or_buffer_is_seen():
    net = model()
    named_tensors(net)
    net[1].extra = nn.Parameter(torch.ones(1))
    assert "1.extra" in named_tensors(net)
    net[0].register_buffer("mask", torch.ones(4, 3))
    assert same(named_tensors(net), walked(net))


def test_a_tensor_replaced_in_its_module_dict_is_seen():
    # as Module._apply does when a conversion cannot keep the tensor (no registration hook runs)
    net = model()
    named_tensors(net)
    replacement = nn.Parameter(torch.full((4,), 3.0))
    net[1]._parameters["bias"] = replacement
    assert named_tensors(net)["1.bias"] is replacement


def test_tied_weights_appear_once_under_their_first_name():
    net = model()
    net[2] = nn.Linear(3, 4)
    net[2].weight = net[0].weight  # tied
    got = named_tensors(net)
    assert "0.weight" in got and "2.weight" not in got
    assert same(got, walked(net))
