"""Shared output of the benchmark scripts: result rows appended to a JSONL file.

Every row gets a ``run`` field saying what produced it (commit, command, time,
load average at the start and at the end, machine, CPU model), the same for
all rows of one process, so that ``scripts/render_benchmarks.py`` can tell
runs apart and render the latest run of each file (``benchmarks/results/*.jsonl``
are the committed ones; results not yet committed do not make a commit dirty).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable
from functools import cache
from typing import Any

# The load average when the benchmark started (this module is imported first thing): the one that
# says whether the machine was quiet; one read at the end includes the benchmark's own load.
_LOAD_AT_START = os.getloadavg()


@cache
def run_info() -> dict[str, Any]:
    """What produced this process's rows: commit (``+dirty`` with local changes; ``SPECJAX_COMMIT`` overrides it,
    for a copy of the tree on another host), command, time, loads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = os.environ.get("SPECJAX_COMMIT")  # set where the tree is a copy without its own history
    if commit is None:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "src", "benchmarks", ":!benchmarks/results")
        if commit and changed:
            commit += "+dirty"
    return {
        "commit": commit,
        "command": " ".join(["python", os.path.relpath(sys.argv[0], root), *sys.argv[1:]]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": " ".join(f"{x:.2f}" for x in _LOAD_AT_START),
        "loadavg_end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "cpu": _cpu_model(),
    }


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what platform says): runs on different CPUs differ."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def append_jsonl(path: str, rows: Iterable[dict[str, Any]]) -> None:
    """Append one JSON object per row to ``path`` (its directory is created), each with :func:`run_info`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    info = run_info()
    with open(path, "a", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "run": r.get("run", info)}, ensure_ascii=False) + "\n")


def flat_record(row: Any) -> dict[str, Any]:
    """A dataclass result row as a dict, its ``extra`` dict merged into the top level."""
    from dataclasses import asdict

    rec = asdict(row)
    rec.update(rec.pop("extra"))
    return rec
