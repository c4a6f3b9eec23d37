"""The drafters of the default pair, by name (the CLI's and the demo's ``--drafter``)."""

from __future__ import annotations

from typing import Any

__all__ = ["PAIR_DRAFTERS", "make_pair_drafter"]

#: The drafters :func:`make_pair_drafter` builds by name.
PAIR_DRAFTERS = ("eagle", "hybrid", "hybrid-model", "model", "ngram")


def make_pair_drafter(name: str, *, draft: Any = None, head: Any = None, context_tokens: int | None = None) -> Any:
    """A fresh drafter for one ``speculative_generate`` call over a pair, by name.

    Parameters
    ----------
    name : str
        ``eagle`` (:class:`~specjax.drafters.EagleDrafter` over ``head``),
        ``model`` (the draft model itself), ``ngram`` (prompt lookup),
        ``hybrid`` (n-gram where it matches, else the EAGLE head if ``head`` is
        given, else the draft model) or ``hybrid-model`` (n-gram, else the
        draft model).
    draft : transformers.PreTrainedModel, optional
        The draft model (``model``, ``hybrid-model``, ``hybrid`` without a head).
    head : specjax.drafters.eagle_head.EagleHead, optional
        The EAGLE head (``eagle``, ``hybrid``).
    context_tokens : int, optional
        How many of the rows' context tokens the head scores beside its own
        (:class:`~specjax.drafters.EagleDrafter`'s ``context_tokens``; None:
        its default).

    Raises
    ------
    ValueError
        An unknown name, or a name whose model or head was not given.
    """
    from specjax.drafters import EagleDrafter, HybridDrafter, ModelDrafter, NgramDrafter

    if name not in PAIR_DRAFTERS:
        raise ValueError(f"drafter: expected one of {', '.join(PAIR_DRAFTERS)}, got {name!r}")
    if name == "ngram":
        return NgramDrafter()
    if name == "eagle" or (name == "hybrid" and head is not None):
        if head is None:
            raise ValueError("drafter: 'eagle' needs the pair's EAGLE head (head=)")
        eagle = EagleDrafter(head) if context_tokens is None else EagleDrafter(head, context_tokens)
        return eagle if name == "eagle" else HybridDrafter(NgramDrafter(), eagle)
    if draft is None:
        raise ValueError(f"drafter: {name!r} needs a draft model (draft=)")
    return draft if name == "model" else HybridDrafter(NgramDrafter(), ModelDrafter(draft))
