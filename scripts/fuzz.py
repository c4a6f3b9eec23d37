"""``make fuzz``: run the API fuzzer (tests/test_fuzz.py) in its long profile for a given time.

Each run is one pytest session with ``SPECJAX_FUZZ=long`` (many examples per property,
drawn at random) and a fresh ``--hypothesis-seed``; runs repeat until ``FUZZ_SECONDS``
(default 600) have passed, and stop at the first failure, whose seed and shrunk example
pytest prints (rerun one with ``--hypothesis-seed=SEED``). Exit status: pytest's on a
failure, else 0.

    FUZZ_SECONDS=1800 make fuzz
    .venv/bin/python scripts/fuzz.py --seconds 300 -- -k rejection
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description="Run tests/test_fuzz.py's long profile for a given time.")
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_SECONDS", 600)))
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    env = dict(os.environ, SPECJAX_FUZZ="long", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    runs = 0
    while runs == 0 or time.monotonic() - start < args.seconds:
        seed = random.SystemRandom().randrange(2**32)
        runs += 1
        print(f"fuzz run {runs} (seed {seed}), {time.monotonic() - start:.0f} of {args.seconds:.0f} s", flush=True)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"--hypothesis-seed={seed}",
            str(ROOT / "tests" / "test_fuzz.py"),
            *args.pytest_args,
        ]
        rc = subprocess.call(cmd, cwd=ROOT, env=env)
        if rc != 0:
            print(f"fuzz: FAILED in run {runs}; rerun with: SPECJAX_FUZZ=long {shlex.join(cmd)}", flush=True)
            return rc
    print(f"fuzz: {runs} runs, no failure in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
