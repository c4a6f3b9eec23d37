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
    last = rows[-1]["run"]  # the file may hold several runs; the report reads the last

    def shown(r: dict) -> bool:
        return r["run"] == last and (r["method"], r["B"], r["G"], r["V"]) == ("kernel", 64, 4, 32000)

    (ratio,) = [r["ratio"] for r in rows if shown(r)]
    assert ratio <= 0.25, "the test below needs a met verdict to turn"
    verdict = render_benchmarks.verdict_kernel(render_benchmarks.load("kernel", results))
    assert f"**met** ({ratio:.3f}×)" in verdict, verdict
    for r in rows:
        if shown(r):
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
    for r in rows:  # rows that record the load at the start apart say which one they show
        r["run"] = {**new_run, "loadavg_end": "1.90 1.00 0.50", "cpu": "Some CPU 9000"}
    assert "commit abc1234, Some CPU 9000, load average at start 0.10 0.20 0.30" in render_benchmarks.run_line(rows)


def test_a_missing_results_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no results file .*nothing\.jsonl"):
        render_benchmarks.load("nothing", tmp_path)


def test_a_row_filter_shows_a_subset_and_the_verdict_still_reads_every_row(tmp_path: Path) -> None:
    results = _copy_results(tmp_path)
    path = results / "kernel.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    shown = render_benchmarks.shown_table("kernel", render_benchmarks.load("kernel", results), "G=4, V=32000")
    table_lines = [line for line in shown.splitlines() if line.startswith("| ")][1:]
    assert [line.split(" | ")[:3] for line in table_lines] == [
        ["| 1", "4", "32000"],
        ["| 8", "4", "32000"],
        ["| 64", "4", "32000"],
        ["| 256", "4", "32000"],
    ]
    assert "Shown: G = 4, V = 32000 (4 of 16 table rows; verdicts read all `kernel.jsonl` rows)." in shown
    # A row the filter hides still decides the verdict.
    for r in rows:
        if (r["method"], r["B"], r["G"], r["V"]) == ("kernel", 256, 8, 128256):
            r["ratio_to_floor"] = 5.0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = render_benchmarks.render(results=results)
    assert "within 3× of the memory floor for B ≥ 8: **not met** (worst 5.00× at B = 256, G = 8, V = 128256)" in text
    assert shown in text


@pytest.mark.parametrize(
    ("conditions", "message"),
    [
        ("G=3", r"'G=3' matches no row"),
        ("Q=4", r"'Q=4': no row has the field 'Q'"),
        ("G", r"'G': expected field=value\|value"),
    ],
)
def test_a_bad_row_filter_is_named(conditions: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        render_benchmarks.select(render_benchmarks.load("kernel"), conditions)


def test_the_pivoted_tables_show_every_row() -> None:
    logits = render_benchmarks.table_logits(render_benchmarks.load("logits"))
    for r in render_benchmarks.load("logits"):
        assert render_benchmarks._us(r["median_us"]) in logits, r["method"]
    for name in ("generate-synthetic", "generate-default", "generate-drafters"):
        rows = render_benchmarks.load(name)
        table = render_benchmarks.TABLES[name](rows)
        for r in rows:
            cell = f"{r['tokens_per_s']:.1f}" if r["method"] == "target" else f"{r['speedup']:.2f}×"
            assert cell in table, (name, r["method"], r.get("num_draft_tokens"))
    sweep = render_benchmarks.table_draft_sweep(render_benchmarks.load("draft-sweep"))
    for r in render_benchmarks.load("draft-sweep"):
        assert (
            f"{r['speedup']:.2f}× ({r['mean_accepted_length']:.2f})"
            if r["method"] == "specjax"
            else f"{r['tokens_per_s']:.1f}"
        ) in sweep


def test_the_cutoff_table_shows_every_row_and_marks_differing_kept_sets() -> None:
    rows = render_benchmarks.load("cutoff")
    table = render_benchmarks.table_cutoff(rows)
    for r in rows:
        assert f"{r['ratio']:.1f}× ({r['ours_ms']:.2f} ms)" in table, r
    assert "kept sets differ" not in table
    wrong = render_benchmarks.table_cutoff([{**rows[0], "kept_sets_equal": False}, *rows[1:]])
    assert wrong.count("kept sets differ") == 1


def test_a_logits_method_without_a_column_is_named() -> None:
    rows = render_benchmarks.load("logits")
    with pytest.raises(SystemExit, match=r"logits method 'flashinfer' has no column"):
        render_benchmarks.table_logits([*rows, {**rows[0], "method": "flashinfer"}])


def test_the_fixed_g_verdict_compares_loop_with_loop() -> None:
    """Against transformers' assisted generation with G fixed (`assisted-G`), the verdict reads specjax with
    the same fixed G (`specjax-G`) and turns with it; runs without that row fall back to the adaptive one."""
    rows = render_benchmarks.load("generate-synthetic")
    fixed = render_benchmarks._gen(rows, "assisted-G", 1, 0.0, 4)
    ours = render_benchmarks._gen(rows, "specjax-G", 1, 0.0, 4)
    adaptive = render_benchmarks._gen(rows, "specjax", 1, 0.0, 4)
    assert fixed is not None and ours is not None and adaptive is not None, "the last run has all three rows"
    head = "assisted generation with the same fixed G = 4 (`assisted-G`)"
    for factor, verdict in ((1.1, "**met** (1.10×"), (0.9, "**not met** (0.90×")):
        changed = [dict(r, tokens_per_s=fixed["tokens_per_s"] * factor) if r is ours else r for r in rows]
        text = render_benchmarks.verdict_generate_synthetic(changed)
        assert f"{head}, specjax's loop with the same fixed G (`specjax-G`): {verdict}" in text, text
    without = [r for r in rows if r is not ours]
    ratio = adaptive["tokens_per_s"] / fixed["tokens_per_s"]
    assert f"{head}: " in render_benchmarks.verdict_generate_synthetic(without)
    assert f"({ratio:.2f}×;" in render_benchmarks.verdict_generate_synthetic(without)


def _processor_rows(options: str, category: str, speedups: dict[str, float]) -> list[dict]:
    """Rows as ``bench_generate.py --options`` writes them: target-only, then specjax per drafter at B = 1, T = 0."""
    common = {"category": category, "options": options, "batch_size": 1, "temperature": 0.0, "run": {"command": "x"}}
    rows = [{**common, "method": "target", "drafter": None, "num_draft_tokens": 0, "tokens_per_s": 12.5}]
    for i, (drafter, speedup) in enumerate(speedups.items()):
        rows.append(
            {
                **common,
                "method": "specjax",
                "drafter": drafter,
                "num_draft_tokens": 8,
                "tokens_per_s": 12.5 * speedup,
                "speedup": speedup,
                "mean_accepted_length": 1.5 + i,
                "processor_step_ms": 0.25 + i,
                "same_as_target": True,
            }
        )
    return rows


@pytest.mark.parametrize(
    ("speedups", "lines"),
    [
        (
            {"ngram": 1.6, "hybrid": 1.2},
            [
                "JSON schema ≥ 1.5× `generate` with the same schema: **met** (best `ngram` 1.60×)",
                "0.95× target-only: **met**.",
            ],
        ),
        (
            {"ngram": 1.4, "hybrid": 0.9},
            [
                "JSON schema ≥ 1.5× `generate` with the same schema: **not met** (best `ngram` 1.40×)",
                "0.95× target-only: **not met** (below: extraction G = 8 `hybrid` 0.90×).",
            ],
        ),
    ],
)
def test_the_processor_verdicts_follow_the_rows(speedups: dict[str, float], lines: list[str]) -> None:
    rows = _processor_rows("json", "extraction", speedups)
    verdict = render_benchmarks.verdict_generate_json(rows)
    for line in lines:
        assert line in verdict, verdict
    assert "identical to `generate` with the same processors: **met**" in verdict
    assert "time per speculative step (part of drafting and the loop's work): 0.25–1.25 ms" in verdict
    rows[1]["same_as_target"] = False
    assert "same processors: **not met**" in render_benchmarks.verdict_generate_penalty_minp(rows)


def test_the_processor_sections_render_every_row(tmp_path: Path) -> None:
    """The placeholders the section gets once the runs are committed render, with every row in the tables."""
    results, fragments = tmp_path / "results", tmp_path / "report"
    results.mkdir()
    fragments.mkdir()
    runs = {
        "generate-penalty-minp": _processor_rows("penalty-minp", "open", {"model": 1.3, "ngram": 0.97}),
        "generate-json": _processor_rows("json", "extraction", {"ngram": 1.7, "hybrid": 1.55}),
    }
    for name, rows in runs.items():
        (results / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (fragments / "38.md").write_text(
        "".join(f"{{{{table {n}}}}}\n\n{{{{run {n}}}}}\n{{{{verdict {n}}}}}\n\n" for n in runs)
    )
    text = render_benchmarks.render(fragments, results)
    assert "{{" not in text
    assert "| method | open, `penalty-minp`, B = 1, T = 0 |" in text
    assert "| specjax `ngram`, G = 8 | 0.97× (2.50; 1.25 ms) |" in text
    assert "| specjax `hybrid`, G = 8 | 1.55× (2.50; 1.25 ms) |" in text
    assert text.count("| target | 12.5 tokens/s |") == 2
    assert "**met** (best `ngram` 1.70×)" in text
