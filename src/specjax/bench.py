"""``specjax bench``: run the benchmark scripts, collect JSONL, draw PNG plots.

The scripts live in the repository's ``benchmarks/`` directory (a source
checkout, e.g. the editable install ``make`` sets up). Each runs in its own
process (``python benchmarks/X.py [--quick] --jsonl OUT/X.jsonl``) so that JAX
flags and memory do not leak between sections. Then:

* ``OUT/results.jsonl`` — every row of every section;
* ``OUT/draft_sweep.png`` — speed-up and mean accepted length against the number
  of draft tokens per step;
* ``OUT/kernel_vs_batch.png`` — kernel time against batch size beside the
  straightforward implementation, transformers' ``_speculative_sampling`` and
  the memory floor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from specjax.console import CLIError

# section name -> (script, extra args in quick mode, extra args in full mode)
SECTIONS: dict[str, tuple[str, list[str], list[str]]] = {
    "kernel": ("bench_kernel.py", ["--quick"], []),
    "logits": ("bench_logits.py", ["--quick"], []),
    "draft-sweep": ("bench_draft_sweep.py", ["--quick"], []),
    "generate": ("bench_generate.py", ["--quick"], []),
    "sharded": ("bench_sharded.py", ["--quick"], []),
    "overheads": ("bench_overheads.py", ["--rounds", "5"], []),
}
# Sections whose script takes --jax-cpu-threads (bench_sharded starts its own processes).
THREAD_OPTION_SECTIONS = ("kernel", "logits", "draft-sweep", "generate", "overheads")
QUICK_SECTIONS = ("kernel", "logits", "draft-sweep", "overheads")
FULL_SECTIONS = ("kernel", "logits", "draft-sweep", "generate", "sharded", "overheads")


def benchmarks_dir() -> Path:
    """The repository's benchmarks/ directory (needs a source checkout)."""
    here = Path(__file__).resolve()
    candidate = here.parents[2] / "benchmarks"
    if not candidate.is_dir():
        raise CLIError(
            f"bench: no benchmarks/ directory next to {here.parents[1]}; run from a source checkout "
            "(git clone, then make install)"
        )
    return candidate


def run_bench(
    *, out_dir: Path, quick: bool, sections: list[str] | None = None, jax_cpu_threads: int | None = None
) -> int:
    from tqdm import tqdm

    chosen = list(sections) if sections else list(QUICK_SECTIONS if quick else FULL_SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise CLIError(f"--sections: unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    if jax_cpu_threads is not None and any(s not in THREAD_OPTION_SECTIONS for s in chosen):
        others = [s for s in chosen if s not in THREAD_OPTION_SECTIONS]
        raise CLIError(
            f"--jax-cpu-threads: applies to sections {', '.join(THREAD_OPTION_SECTIONS)}, not to "
            f"{', '.join(others)}; leave those out with --sections"
        )
    threads_args = [] if jax_cpu_threads is None else ["--jax-cpu-threads", str(jax_cpu_threads)]
    bench = benchmarks_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"--out {out_dir}: cannot create the output directory ({err.strerror or err})") from err
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    rows: list[dict[str, Any]] = []
    failed = []
    bar = tqdm(chosen, desc="bench", unit="section", file=sys.stderr)
    for name in bar:
        bar.set_postfix_str(name)
        script, quick_args, full_args = SECTIONS[name]
        jsonl = out_dir / f"{name}.jsonl"
        jsonl.unlink(missing_ok=True)
        log = out_dir / f"{name}.log"
        t0 = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(bench / script),
                    *(quick_args if quick else full_args),
                    *threads_args,
                    "--jsonl",
                    str(jsonl),
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
            )
        took = time.perf_counter() - t0
        if proc.returncode != 0:
            failed.append(name)
            tqdm.write(f"{name}: FAILED (exit {proc.returncode}), see {log}", file=sys.stderr)
            continue
        tqdm.write(f"{name}: {took:.0f} s, table in {log}", file=sys.stderr)
        section_rows = (
            [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()] if jsonl.exists() else []
        )
        for r in section_rows:
            r.setdefault("section", name)
        rows.extend(section_rows)
    results = out_dir / "results.jsonl"
    with open(results, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    plots = make_plots(rows, out_dir)
    print(f"results: {results}")
    for p in plots:
        print(f"plot: {p}")
    if failed:
        print(f"error: benchmark section(s) failed: {', '.join(failed)} (logs in {out_dir})", file=sys.stderr)
        return 1
    return 0


def make_plots(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    made = []
    sweep = [r for r in rows if r.get("section") == "draft_sweep" or r.get("section") == "draft-sweep"]
    if sweep:
        made.append(plot_draft_sweep(sweep, out_dir / "draft_sweep.png"))
    kernel = [r for r in rows if r.get("section") in ("kernel", "logits")]
    if kernel:
        path = plot_kernel_vs_batch(kernel, out_dir / "kernel_vs_batch.png")
        if path:
            made.append(path)
    return made


def plot_draft_sweep(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    temps = sorted({r["temperature"] for r in rows if r["method"] == "specjax"})
    for temp in temps:
        pts = sorted(
            (r["num_draft_tokens"], r["speedup"], r["mean_accepted_length"])
            for r in rows
            if r["method"] == "specjax" and r["temperature"] == temp
        )
        label = "greedy" if temp == 0 else f"T={temp}"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set(xlabel="draft tokens per step (G)", ylabel="speed-up over target-only generate", title="Speed-up (B=1)")
    ax2.set(xlabel="draft tokens per step (G)", ylabel="tokens per step (accepted + 1)", title="Mean accepted length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    pair = rows[0].get("model_pair", "")
    fig.suptitle(pair, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kernel_vs_batch(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Kernel time vs B at the largest common (G, V) with several batch sizes."""
    import matplotlib.pyplot as plt

    probs = [r for r in rows if r.get("section") == "kernel" and r.get("median_us")]
    if not probs:
        return None
    combos: dict[tuple[int, int], set[int]] = {}
    for r in probs:
        combos.setdefault((r["G"], r["V"]), set()).add(r["B"])
    g, v = max(combos, key=lambda k: (len(combos[k]), -k[1], -k[0]))
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for method, label, style in (
        ("kernel", "specjax kernel (probabilities)", "o-"),
        ("straightforward", "straightforward JAX (full residual)", "s--"),
        ("floor", "memory floor (2 rows of V per batch row)", "k:"),
    ):
        pts = sorted((r["B"], r["median_us"]) for r in probs if r["method"] == method and r["G"] == g and r["V"] == v)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    logits = [r for r in rows if r.get("section") == "logits" and r.get("processing", "T=1") == "T=1"]
    for method, label, style in (
        ("transformers _speculative_sampling", "transformers _speculative_sampling (B>1: loop of B calls)", "^-"),
        ("specjax _verify_jit", "specjax verify_from_logits (jitted core)", "v-"),
    ):
        pts = sorted(
            (int(r["B"]), float(r["median_us"])) for r in logits if r.get("method") == method and r.get("median_us")
        )
        if pts:
            ax.plot(
                [p[0] for p in pts], [p[1] for p in pts], style, label=f"{label}, logits V={logits[0].get('V', '?')}"
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="batch size B",
        ylabel="time per call (µs)",
        title=f"Acceptance step, G={g}; probabilities V={v}",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
