"""docs/benchmarks.md is rendered from the committed results; it cannot drift from them."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_benchmarks", ROOT / "scripts" / "render_benchmarks.py")
assert _spec is not None and _spec.loader is not None
render_benchmarks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_benchmarks)


def test_committed_report_is_what_the_results_render_to() -> None:
    committed = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == render_benchmarks.render(), (
        "docs/benchmarks.md differs from scripts/render_benchmarks.py's output: edit benchmarks/report/*.md or "
        "benchmarks/results/*.jsonl, then run make bench-report"
    )


def test_every_placeholder_is_replaced_and_every_results_file_is_used() -> None:
    text = render_benchmarks.render()
    assert "{{" not in text
    fragments = "".join(p.read_text() for p in render_benchmarks.FRAGMENTS.glob("*.md"))
    for path in render_benchmarks.RESULTS.glob("*.jsonl"):
        assert f" {path.stem}}}}}" in fragments or f" {path.stem}:" in fragments, f"{path.name} is in no section"


def _copy_results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(render_benchmarks.RESULTS, results)
    return results


def test_the_verdict_follows_the_rows(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    path = results / "kernel.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert "**met** (0.005×)" in render_benchmarks.verdict_kernel(render_benchmarks.load("kernel", results))
    for r in rows:
        if (r["method"], r["B"], r["G"], r["V"]) == ("kernel", 64, 4, 32000):
            r["ratio"] = 0.3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = render_benchmarks.render(results=results)
    assert "V = 32000: **not met** (0.300×)" in text
    assert text != render_benchmarks.render()


def test_the_last_run_of_a_file_is_rendered(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    path = results / "draft-sweep.jsonl"
    old = [json.loads(line) for line in path.read_text().splitlines()]
    new_run = {"commit": "abc1234", "command": "python benchmarks/bench_draft_sweep.py", "loadavg": "0.10 0.20 0.30"}
    with path.open("a") as fh:
        for r in old:
            fh.write(json.dumps({**r, "tokens_per_s": r["tokens_per_s"] + 1000, "run": new_run}) + "\n")
    rows = render_benchmarks.load("draft-sweep", results)
    assert len(rows) == len(old) and all(r["run"] == new_run for r in rows)
    assert "commit abc1234, load average 0.10 0.20 0.30" in render_benchmarks.run_line(rows)


def test_a_missing_results_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no results file .*nothing\.jsonl"):
        render_benchmarks.load("nothing", tmp_path)
