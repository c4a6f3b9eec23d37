"""A model's parameters and buffers by name, walked once while its module tree is unchanged.

Each call of the loop validates its models and, on the JAX path, checks that the
weights it converted are still the model's (:func:`specjax.generate.jax_model.jax_model`).
Both read every named tensor, and walking a 30-layer model's module tree for them
(``named_parameters``, ``named_buffers``) costs milliseconds a call, twice per model.

:func:`named_tensors` walks once and serves that walk again while

* no module anywhere registered a parameter, a buffer or a submodule since (torch's
  global registration hooks count them: ``module.weight = Parameter(...)``, a module
  swapped for another, ``register_buffer``), and
* every tensor of the walk is still the one its module holds under its name (what
  ``model.to(...)`` and other direct replacements change).

What a tensor holds is not part of this: callers read its values, version
(``_version``, bumped by in-place writes) or array each call.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["named_tensors"]

_LOCK = threading.Lock()
_generation = 0  # registrations seen so far (any module of the process)
_hooked = False
# model -> (generation at the walk, [(its module's _parameters or _buffers dict, name, tensor)], the walk's dict)
_WALKS: weakref.WeakKeyDictionary[Any, tuple[int, list[tuple[dict[str, Any], str, Any]], dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)


def _registered(*_args: Any) -> None:
    global _generation
    _generation += 1


def _hook() -> None:
    global _hooked
    if not _hooked:
        from torch.nn.modules import module

        module.register_module_parameter_registration_hook(_registered)
        module.register_module_buffer_registration_hook(_registered)
        module.register_module_module_registration_hook(_registered)
        _hooked = True


def named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{**dict(model.named_parameters()), **dict(model.named_buffers())}``: every parameter and buffer by its
    name, a tied weight once (under its first name).

    The same dict (do not modify it) while the model's tree is unchanged (module docstring); a fresh walk
    otherwise.
    """
    with _LOCK:
        _hook()
        known = _WALKS.get(model)
        if (
            known is not None
            and known[0] == _generation
            and all(slots.get(name) is tensor for slots, name, tensor in known[1])
        ):
            return known[2]
        generation = _generation
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        held = [
            (slots, name, tensor)
            for module in model.modules()
            for slots in (module._parameters, module._buffers)
            for name, tensor in slots.items()
            if tensor is not None
        ]
        _WALKS[model] = (generation, held, named)
        return named
