"""Shared output of the benchmark scripts: result rows appended to a JSONL file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any


def append_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    """Append one JSON object per row to ``path`` (its directory is created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")


def flat_record(row: Any) -> dict[str, Any]:
    """A dataclass result row as a dict, its ``extra`` dict merged into the top level."""
    from dataclasses import asdict

    rec = asdict(row)
    rec.update(rec.pop("extra"))
    return rec
