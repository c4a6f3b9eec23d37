"""What the command line, the demo and the benchmark runner share: user-facing errors and text output.

Below :mod:`specjax.cli`, :mod:`specjax.demo` and :mod:`specjax.bench`, so the
command line imports the demo and the runner and never the other way round.
Imports nothing heavy.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["CLIError", "TextStream"]


class CLIError(Exception):
    """An error with a one-line message for the user (exit status 2)."""


class TextStream:
    """Prints a row's text as tokens are committed (decoding the whole suffix each time)."""

    def __init__(self, tokenizer: Any, out: Any = None) -> None:
        self.tokenizer = tokenizer
        self.out = out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)
