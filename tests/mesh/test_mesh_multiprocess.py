"""Two processes with 4 devices each, one 2x4 mesh over both (gloo collectives on CPU); opt-in."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sharded_inputs import assert_equal, full_matrix, host, multiprocess_inputs

WORKER = Path(__file__).with_name("multiprocess_worker.py")


@pytest.mark.slow
@full_matrix
def test_multiprocess_2x4_two_processes(tmp_path: Path) -> None:
    from specjax import rejection_sample, verify_from_logits

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), f"{tmp_path}/out"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [proc.communicate(timeout=900)[0] for proc in procs]
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
    (x, q, p, u, s), (xl, dl, tl, kwargs) = multiprocess_inputs()
    ref = {"probs": host(rejection_sample(x, q, p, u, s)), "logits": host(verify_from_logits(xl, dl, tl, **kwargs))}
    for i in range(2):
        got = np.load(f"{tmp_path}/out_{i}.npz")
        for kernel in ("probs", "logits"):
            assert_equal(
                ref[kernel], {k: got[f"{kernel}_{k}"] for k in ("num_accepted", "tokens")}, f"process {i}, {kernel}"
            )
