"""transformers integration (the ``transformers`` plugin).

:func:`register` registers the ``custom_generate`` name ``"specjax"``; the
drop-ins themselves follow.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    """The ``transformers`` plugin: register ``custom_generate`` ``"specjax"`` (imports nothing)."""
    from specjax.plugin.registry import register_custom_generate

    register_custom_generate("specjax", "specjax.plugin.hf:speculative_decoding")
