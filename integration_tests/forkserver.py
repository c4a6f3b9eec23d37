"""Run a test's commands as fresh processes without paying for their imports each time.

A test that runs ``specjax ...`` or a Python snippet in a new interpreter spends 3-5 s
of a 2-core machine importing torch, JAX and transformers before the command starts.
:func:`run` takes the arguments of :func:`subprocess.run` and gives its result, but
executes the command in a child forked from a server that has imported those modules
once (without starting JAX's backends: the server checks). The child gets the
command's own argv, ``sys.path``, working directory, environment, stdout and stderr,
runs it as its interpreter would (``python -c``/``-m``/a script, or the ``specjax``
console script's ``main``) and exits with its status; a timeout kills it and raises
:class:`subprocess.TimeoutExpired`.

What a fork cannot give a command is the state of an interpreter that started with
its environment: variables read at start-up or at import (``PYTHON*``, ``JAX_*``,
``HF_*``, thread-pool settings, ...) therefore select the server, one per distinct
set, started on first use. Commands of other shapes (other executables, interpreter
options, ``stdin``) run as real subprocesses.

The server is this file run as ``python -P forkserver.py``; requests and replies are
JSON lines on its stdin and on a private copy of its stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PRELOAD = (
    "numpy",
    "torch",
    "jax",
    "jax.numpy",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "specjax",
    "specjax.cli",
)
# Read when the interpreter starts or when a preloaded module is imported.
START_PREFIXES = (
    "PYTHON",
    "JAX_",
    "XLA_",
    "TF_",
    "HF_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "LD_",
    "MALLOC_",
    "CUDA",
    "NVIDIA",
)
DYNAMIC = ("PYTHONPATH",)  # applied in the child (sys.path)
CONSOLE_SCRIPTS = {"specjax": "specjax.cli:main"}
BIN = Path(sys.executable).parent


def _start_time(name: str) -> bool:
    return name.startswith(START_PREFIXES) and name not in DYNAMIC


# --------------------------------------------------------------------------- client


class _Server:
    def __init__(self, env: Mapping[str, str]) -> None:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-P", str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=dict(env),
            text=True,
        )
        self._read()  # the "ready" line, after the imports

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"fork server died:\n{self.log.read().decode(errors='replace')[-4000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


def _mode(cmd: Sequence[str]) -> dict[str, Any] | None:
    """How the child runs ``cmd``, or None where only a real subprocess can."""
    exe, args = str(cmd[0]), [str(a) for a in cmd[1:]]
    if Path(exe).parent == BIN and Path(exe).name in CONSOLE_SCRIPTS:
        return {"kind": "entry", "target": CONSOLE_SCRIPTS[Path(exe).name], "argv": [exe, *args]}
    if exe != sys.executable or not args:
        return None
    if args[0] == "-c" and len(args) > 1:
        return {"kind": "code", "code": args[1], "argv": ["-c", *args[2:]]}
    if args[0] == "-m" and len(args) > 1:
        return {"kind": "module", "module": args[1], "argv": [args[1], *args[2:]]}
    if not args[0].startswith("-"):
        return {"kind": "script", "argv": [str(Path(args[0])), *args[1:]]}
    return None


def run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)``."""
    env = dict(os.environ if env is None else env)
    args = [str(c) for c in cmd]
    mode = _mode(args)
    if mode is None:
        return subprocess.run(args, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
    key = tuple(sorted((k, v) for k, v in env.items() if _start_time(k)))
    if key not in _servers:  # this process's other variables: PYTHONPATH is the base of the children's
        _servers[key] = _Server({**{k: v for k, v in os.environ.items() if not _start_time(k)}, **dict(key)})
    server = _servers[key]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        reply = server.request(
            {
                **mode,
                "env": {k: v for k, v in env.items() if not _start_time(k)},
                "cwd": str(Path(cwd or os.getcwd()).resolve()),
                "stdout": str(out),
                "stderr": str(err),
                "timeout": timeout,
            }
        )
        stdout = out.read_text(encoding="utf-8", errors="replace") if out.exists() else ""
        stderr = err.read_text(encoding="utf-8", errors="replace") if err.exists() else ""
    if reply.get("timed_out"):
        raise subprocess.TimeoutExpired(args, timeout or 0, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(args, reply["returncode"], stdout, stderr)


# --------------------------------------------------------------------------- server


def _child(req: dict[str, Any]) -> int:
    """Runs in the forked child: become the command's process, run it, return its exit status."""
    import importlib
    import runpy
    import traceback
    import types

    os.setpgid(0, 0)  # a timeout kills the command's own subprocesses too
    if sys.platform == "linux":  # and a server that dies (its test run killed) takes the child with it
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        f = os.open(path, flags, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update({**req["env"], **_START_ENV})
    kind, argv = req["kind"], req["argv"]
    # sys.path[0] as the interpreter sets it for each way of running a command
    first = {
        "entry": str(Path(argv[0]).parent),
        "code": "",
        "module": os.getcwd(),
        "script": str(Path(argv[0]).resolve().parent),
    }[kind]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *_BASE_PATH]
    importlib.invalidate_caches()
    sys.argv = list(argv)
    code: Any = 0
    try:
        if kind == "entry":
            module, _, func = req["target"].partition(":")
            code = getattr(importlib.import_module(module), func)()
        elif kind == "code":
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(req["code"], "<string>", "exec"), main.__dict__)
        elif kind == "module":
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    try:
        atexit._run_exitfuncs()  # as the interpreter does on its way out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return int(code) & 0xFF


def _wait(pid: int, timeout: float | None) -> dict[str, Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if deadline is not None and time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return {"returncode": -signal.SIGKILL, "timed_out": True}
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def serve() -> None:
    import importlib

    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports print goes to the log, not into the replies
    for name in PRELOAD:
        importlib.import_module(name)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("a preloaded module started JAX's backends: a child could not configure them")
    reply.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = _child(req)
            finally:
                os._exit(status)
        reply.write(json.dumps(_wait(pid, req.get("timeout"))) + "\n")


_START_ENV: dict[str, str] = {}
_BASE_PATH: list[str] = []

if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _START_ENV = {k: v for k, v in os.environ.items() if _start_time(k)}
    # without this process's own PYTHONPATH entries: each child puts its own in front
    _own = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    _BASE_PATH = [p for p in sys.path if os.path.abspath(p) not in _own]
    serve()
