"""Every ```python block in README.md and docs/*.md runs (blocks fenced as `python no-run` are skipped)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import forkserver
import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```python[ \t]*(?P<info>[^\n]*)\n(?P<code>.*?)^```", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, int, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            if "no-run" in match.group("info"):
                continue
            line = text[: match.start()].count("\n") + 1
            found.append((path.relative_to(ROOT).as_posix(), line, match.group("code")))
    return found


BLOCKS = _blocks()


def test_docs_have_runnable_examples():
    files = {name for name, _, _ in BLOCKS}
    assert "README.md" in files
    assert "docs/index.md" in files
    assert "docs/api.md" in files


@pytest.mark.parametrize(("name", "line", "code"), BLOCKS, ids=[f"{n}:{ln}" for n, ln, _ in BLOCKS])
def test_doc_block_runs(name, line, code, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONHASHSEED="0")
    # `python block.py` in a fresh process (forked with torch, JAX and transformers imported)
    proc = forkserver.run([sys.executable, script], cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, f"{name}:{line} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
