"""docs/api.md against the code: every documented signature is the real one, every public name is documented.

The page is written by hand (it explains more than the docstrings); this test
keeps its signatures from drifting. It reads the ``### `name(...)` `` headings
and the first cell of every table row that starts with a backticked call, takes
the module from the section heading (``## Adapters — `specjax.adapters` ``)
unless the name is dotted, and compares parameter names, order, kinds
(positional, keyword-only after ``*``, ``*args``, ``**kwargs``) and defaults
with :func:`inspect.signature`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import specjax

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
SECTION = re.compile(r"^##+ .*`(specjax(?:\.\w+)*)`\s*$")
CALL = re.compile(r"`((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(([^`]*?)\)(?: -> [^`]*)?`")


@dataclass(frozen=True)
class Documented:
    module: str
    name: str  # possibly dotted (absolute)
    params: str  # the text between the parentheses
    line: int

    def id(self) -> str:
        return f"api.md:{self.line}:{self.name}"


def documented() -> list[Documented]:
    out = []
    module = "specjax"
    for i, line in enumerate(API_MD.read_text(encoding="utf-8").splitlines(), 1):
        m = SECTION.match(line)
        if m:
            module = m.group(1)
        if line.startswith("### "):
            cells = [line]
        elif line.startswith("| `"):
            cells = [line.split(" | ")[0]]
        else:
            continue
        for call in CALL.finditer(cells[0]):
            out.append(Documented(module, call.group(1), call.group(2), i))
    return out


def split_params(text: str) -> list[str]:
    """Top-level comma split (defaults may hold brackets or strings)."""
    parts, depth, cur, quote = [], 0, "", None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def resolve(doc: Documented) -> Any:
    if doc.name.startswith("specjax."):
        module, _, attr = doc.name.rpartition(".")
        while True:
            try:
                return getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError:
                module, _, outer = module.rpartition(".")
                attr = f"{outer}.{attr}"
                obj = importlib.import_module(module)
                for part in attr.split("."):
                    obj = getattr(obj, part)
                return obj
    obj: Any = importlib.import_module(doc.module)
    for part in doc.name.split("."):
        obj = getattr(obj, part)
    return obj


DOCUMENTED = documented()


def test_the_page_documents_signatures() -> None:
    names = {d.name for d in DOCUMENTED}
    assert {"rejection_sample", "verify_from_logits", "speculative_generate", "to_jax"} <= names, names


@pytest.mark.parametrize("doc", DOCUMENTED, ids=[d.id() for d in DOCUMENTED])
def test_documented_signature_is_the_real_one(doc: Documented) -> None:
    obj = resolve(doc)
    real = list(inspect.signature(obj).parameters.values())
    written = split_params(doc.params)
    assert [p.split("=")[0].split(":")[0].strip() for p in written] == _with_star(real), (
        f"{doc.id()}: documented ({doc.params}), real {inspect.signature(obj)}"
    )
    by_name = {p.name: p for p in real}
    for text in written:
        name, has_default, default = text.partition("=")
        name = name.split(":")[0].strip().lstrip("*")
        if name not in by_name:
            continue
        param = by_name[name]
        if not has_default:
            assert param.default is inspect.Parameter.empty or param.kind in (
                param.VAR_POSITIONAL,
                param.VAR_KEYWORD,
            ), f"{doc.id()}: {name} has a default in the code ({param.default!r}), none in api.md"
            continue
        assert param.default is not inspect.Parameter.empty, f"{doc.id()}: {name} has no default in the code"
        try:
            value = ast.literal_eval(default.strip())
        except ValueError:
            continue  # a name or expression: checked by its presence only
        assert param.default == value, f"{doc.id()}: {name} defaults to {param.default!r}, api.md says {default}"


def _with_star(params: list[inspect.Parameter]) -> list[str]:
    """Parameter names as a signature writes them: a bare ``*`` before the first keyword-only one."""
    out: list[str] = []
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not any(o.startswith("*") for o in out):
            out.append("*")
        out.append(("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name)
    return out


@pytest.mark.parametrize("name", [n for n in specjax.__all__ if n != "__version__"])
def test_every_public_name_is_on_the_page(name: str) -> None:
    text = API_MD.read_text(encoding="utf-8")
    assert re.search(rf"`(specjax\.)?{name}[(`.]", text), f"specjax.{name} is not documented in docs/api.md"
