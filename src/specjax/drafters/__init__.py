"""Drafters: what proposes the tokens the target verifies (see :mod:`specjax.drafters.base`).

Built in:

* ``model`` — :class:`ModelDrafter`, a smaller causal LM sharing the tokenizer
  (what passing a model as ``draft`` means);
* ``ngram`` — :class:`NgramDrafter`, prompt lookup: no model, no training;
  strong on input-grounded tasks (summaries, edits, extraction, quoting);
* ``hybrid`` — :class:`HybridDrafter`, n-gram where it matches, a fallback
  drafter (a model) elsewhere;
* ``eagle`` — :class:`EagleDrafter`, a draft head over the target's own hidden
  states (EAGLE; ``load_drafter("eagle", head=DIRECTORY)``).

Third-party drafters are installed as entry points of the group
``specjax.drafters`` (``name = "module:factory"``; ``factory(**options)``
returns a drafter); ``SPECJAX_PLUGINS`` filters them by name, as it filters
samplers. :func:`load_drafter` builds one by name; :func:`resolve_drafter`
turns whatever ``speculative_generate(draft=...)`` was given into a drafter.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from specjax.drafters.base import (
    DRAFTER_METHODS,
    CommitInfo,
    Drafter,
    DraftRequest,
    DraftSetup,
    Proposal,
    SamplingState,
    is_drafter,
)
from specjax.drafters.eagle import CONTEXT_TOKENS, EagleDrafter
from specjax.drafters.hybrid import HybridDrafter
from specjax.drafters.model import ModelDrafter
from specjax.drafters.ngram import NgramDrafter
from specjax.registry import ENV_VAR, allowed_names, named_entry_points, resolve_target

__all__ = [
    "DRAFTERS_GROUP",
    "CommitInfo",
    "DraftRequest",
    "DraftSetup",
    "Drafter",
    "EagleDrafter",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "SamplingState",
    "available_drafters",
    "claim_drafter",
    "is_drafter",
    "load_drafter",
    "resolve_drafter",
]

DRAFTERS_GROUP = "specjax.drafters"
logger = logging.getLogger("specjax.drafters")


def _model(model: Any = None, **_: Any) -> ModelDrafter:
    if model is None:
        raise ValueError("draft: the 'model' drafter needs a model: pass the draft model itself as draft=")
    return ModelDrafter(model)


def _hybrid(model: Any = None, fallback: Any = None, min_n: int = 2, max_n: int = 5) -> HybridDrafter:
    if fallback is None and model is None:
        raise ValueError(
            "draft: the 'hybrid' drafter needs a fallback: load_drafter('hybrid', model=draft_model) "
            "or HybridDrafter(NgramDrafter(), ModelDrafter(draft_model))"
        )
    fb = fallback if fallback is not None else ModelDrafter(model)
    return HybridDrafter(NgramDrafter(min_n, max_n), fb)


def _ngram(min_n: int = 2, max_n: int = 5, **_: Any) -> NgramDrafter:
    return NgramDrafter(min_n, max_n)


def _eagle(head: Any = None, context_tokens: int = CONTEXT_TOKENS, **_: Any) -> EagleDrafter:
    if head is None:
        raise ValueError(
            "draft: the 'eagle' drafter needs a trained head: load_drafter('eagle', head=DIRECTORY) "
            "(a directory written by specjax.drafters.eagle_head.save_head, e.g. by recipes/eagle)"
        )
    return EagleDrafter(head, context_tokens)


_BUILTIN: dict[str, Callable[..., Any]] = {"model": _model, "ngram": _ngram, "hybrid": _hybrid, "eagle": _eagle}


def _entry_points() -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The installed ``specjax.drafters`` entry points by name, and names declared twice (the registry's rule)."""
    return named_entry_points(DRAFTERS_GROUP, dict.fromkeys(_BUILTIN), allowed_names())


def available_drafters() -> list[str]:
    """Sorted names :func:`load_drafter` accepts: the built-ins and the installed entry points."""
    return sorted({*_BUILTIN, *_entry_points()[0]})


def load_drafter(name: str, **options: Any) -> Any:
    """Build the drafter called ``name`` with ``options`` (e.g. ``model=`` for ``model`` and ``hybrid``).

    Raises:
      ValueError: an unknown name (the message lists the available drafters), a
        factory that fails, or one that returns something that is not a drafter.
      TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"draft: expected a drafter name (str), got {type(name).__name__}")
    if name in _BUILTIN:
        return _BUILTIN[name](**options)
    eps, clashes = _entry_points()
    if name in clashes:
        raise ValueError(
            f"draft: drafter {name!r} is ambiguous: declared as "
            + " and as ".join(clashes[name])
            + f"; uninstall one, or choose one with {ENV_VAR}"
        )
    if name not in eps:
        raise ValueError(f"draft: unknown drafter {name!r}; available drafters: {', '.join(available_drafters())}")
    target = eps[name]
    try:
        factory = resolve_target("drafter", name, target)
    except (ImportError, TypeError) as err:
        raise ValueError(f"draft: {err}") from err
    drafter = factory(**options)
    missing = [m for m in DRAFTER_METHODS if not callable(getattr(drafter, m, None))]
    if missing:
        raise ValueError(
            f"draft: drafter {name!r} ({target.spec}) returned a {type(drafter).__name__} without "
            f"{', '.join(missing)}()"
        )
    return drafter


def resolve_drafter(draft: Any) -> Any:
    """A drafter for ``speculative_generate``'s ``draft``: a model, a drafter object or a registered name."""
    if isinstance(draft, str):
        return load_drafter(draft)
    if is_drafter(draft):
        return draft
    import torch

    if isinstance(draft, torch.nn.Module):
        return ModelDrafter(draft)
    raise TypeError(
        f"draft: expected a transformers causal LM, a drafter object or a drafter name "
        f"({', '.join(available_drafters())}), got {type(draft).__name__}"
    )


# The drafter objects (and their parts) that running calls use, by id: a drafter holds one
# call's state from start() to the call's end, so two calls must not share one.
_in_use: set[int] = set()
_in_use_lock = threading.Lock()


def _parts(drafter: Any) -> list[Any]:
    """``drafter`` and the drafters inside it (a hybrid drafter's two)."""
    if isinstance(drafter, HybridDrafter):
        return [drafter, *_parts(drafter.ngram), *_parts(drafter.fallback)]
    return [drafter]


def _try_claim(drafter: Any) -> bool:
    """Mark ``drafter`` and its parts in use, unless one of them is already."""
    ids = {id(p) for p in _parts(drafter)}
    with _in_use_lock:
        if ids & _in_use:
            return False
        _in_use.update(ids)
        return True


@contextlib.contextmanager
def claim_drafter(drafter: Any) -> Iterator[Any]:
    """The drafter one :func:`specjax.speculative_generate` call runs with, kept for the call's duration.

    ``drafter`` itself when no other running call uses it or a part of it (a
    hybrid drafter's n-gram or fallback drafter); else a fresh drafter from its
    ``fork()`` (see :class:`Drafter`): a server may share one drafter object
    between threads. Released when the block ends, also on an error.

    Raises:
      ValueError: the drafter is in use by another call and has no ``fork()``
        (or its fork shares a part in use).
    """
    mine = drafter
    if not _try_claim(drafter):
        name = getattr(drafter, "name", type(drafter).__name__)
        fork = getattr(drafter, "fork", None)
        if not callable(fork):
            raise ValueError(
                f"draft: drafter {name!r} ({type(drafter).__name__}) is in use by another speculative_generate "
                "call, and a drafter holds one call's state; pass one drafter object per concurrent call (build "
                "one per thread or request), or give its class a fork() method that returns a fresh drafter of "
                "the same configuration (the built-in drafters have one)"
            )
        mine = fork()
        if mine is drafter or not is_drafter(mine) or not _try_claim(mine):
            raise ValueError(
                f"draft: drafter {name!r} ({type(drafter).__name__}) is in use by another speculative_generate "
                f"call, and its fork() returned {type(mine).__name__} that is not a fresh drafter (it must share "
                "no state with the original); pass one drafter object per concurrent call"
            )
    try:
        yield mine
    finally:
        with _in_use_lock:
            _in_use.difference_update(id(p) for p in _parts(mine))
