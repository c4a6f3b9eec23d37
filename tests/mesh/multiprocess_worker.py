"""One process of the two-process mesh test: ``python multiprocess_worker.py ID N PORT OUT``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for sharded_inputs

from sharded_inputs import worker

if __name__ == "__main__":
    process_id, num_processes, port, out = sys.argv[1:5]
    worker(int(process_id), int(num_processes), int(port), out)
