"""Read the cross-device collectives and their sizes out of a compiled program's HLO text.

Used by the mesh tests (no collective carries a vocabulary-sized array) and by
benchmarks/bench_sharded.py (bytes moved per call), which puts tests/ on its
``sys.path``. Not part of specjax.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["hlo_collectives"]

_COLLECTIVE_OPS = (
    "all-reduce",
    "all-gather",
    "collective-permute",
    "all-to-all",
    "reduce-scatter",
    "collective-broadcast",
    "ragged-all-to-all",
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}])(?P<op>[a-z][\w\-]*)\((?P<args>[^()]*)\)")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8\w*|c\d+)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_BYTES = {"pred": 1, "bf16": 2}


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(text)]


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    width = _BYTES.get(dtype)
    if width is None:
        bits = re.match(r"[a-z]+(\d+)", dtype)
        width = max(int(bits.group(1)) // 8, 1) if bits else 1
    return width * math.prod(dims)


_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<kind>body|calls|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


def hlo_collectives(hlo_text: str) -> list[dict[str, Any]]:
    """The cross-device collectives of a compiled HLO module, with their sizes.

    Args:
      hlo_text: ``jitted.lower(...).compile().as_text()``.

    Returns:
      One dict per collective instruction (the ``-done`` halves of asynchronous
      pairs are skipped): ``op`` (e.g. ``"all-gather"``), ``operands`` and
      ``results`` (lists of ``(dtype, dims)``; operand shapes are looked up from
      their defining instructions), ``operand_bytes`` and ``result_bytes`` (per
      device and execution), ``count`` (executions per call: the product of the
      known trip counts of the while loops around it, 1 outside loops),
      ``max_dim`` (the largest dimension of any operand or result) and ``line``.
    """
    defined: dict[str, str] = {}
    calls = []
    edges: dict[str, list[tuple[str, int]]] = {}
    entry = None
    current = ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group("name")
            if head.group("entry"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        rest = m.group("rest")
        op = _OPCODE.search(rest)
        if not op:
            continue
        defined[m.group("name")] = rest[: op.start("op")]
        trip = _TRIP_COUNT.search(rest)
        for callee in _CALLEE.finditer(rest):
            factor = int(trip.group("n")) if callee.group("kind") == "body" and trip else 1
            edges.setdefault(current, []).append((callee.group("name"), factor))
        for branches in _BRANCHES.finditer(rest):
            for name in _OPERAND.findall(branches.group("names")):
                edges.setdefault(current, []).append((name, 1))
        name = op.group("op")
        is_async = name.endswith("-start")
        if is_async:
            name = name[: -len("-start")]
        if name in _COLLECTIVE_OPS:
            calls.append((current, name, is_async, rest[: op.start("op")], op.group("args"), line.strip()))

    count: dict[str, int] = {}

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        count[comp] = count.get(comp, 0) + times
        for callee, factor in edges.get(comp, ()):
            visit(callee, times * factor, depth + 1)

    if entry is not None:
        visit(entry, 1)
    found = []
    for comp, name, is_async, result_text, args, line in calls:
        operands = _shapes(args)
        if not operands:
            operands = [s for ref in _OPERAND.findall(args) for s in _shapes(defined.get(ref, ""))]
        results = _shapes(result_text)
        if is_async:  # "-start" results repeat the operands and add u32[] context scalars
            if results[: len(operands)] == operands and len(results) > len(operands):
                results = results[len(operands) :]
            results = [r for r in results if r[1]] or results
        dims = [d for _, shape in operands + results for d in shape]
        found.append(
            {
                "op": name,
                "operands": operands,
                "results": results,
                "operand_bytes": sum(_nbytes(dt, s) for dt, s in operands),
                "result_bytes": sum(_nbytes(dt, s) for dt, s in results),
                "count": count.get(comp, 1),
                "max_dim": max(dims, default=0),
                "line": line,
            }
        )
    return found


def analytic_bytes(kernel: str, method: str, batch: int, g: int, vocab: int, shards: int = 8) -> int:
    """Collective operand bytes per device per call of the mesh kernels, from the algorithm (float32/int32:
    4 bytes), vocabulary split in ``shards``: the formula docs/distributed.md gives and the mesh tests hold
    against :func:`hlo_collectives` of the compiled program.

    probs, sharded: psum of (p_i(x_i), q_i(x_i)) 2·B·G; psum of the residual
    sums B; all-gather of the shard totals B (operand); pmax of (candidate,
    fallback) ids 2·B.
    logits, sharded: per target position (B·(G+1)) and per draft position
    (B·G): pmax of the row's max, psum of its normaliser and pmin of its argmax
    (3 each); at the draft tokens, psum of the flags saying whether a shard
    holds the id (B·G; an id outside the vocabulary is never accepted) and of
    the two gathered logits (2·B·G); then B + B + 2·B for the draw as above.
    naive: all-gather operands of the local vocabulary slices, B·G·V/S +
    B·(G+1)·V/S (each device receives S-1 times that).
    """
    local = -(-vocab // shards)
    if method == "naive":
        return 4 * (batch * g * local + batch * (g + 1) * local)
    if kernel == "probs":
        return 4 * (2 * batch * g + batch + batch + 2 * batch)
    return 4 * (3 * batch * (g + 1) + 3 * batch * g + batch * g + 2 * batch * g + batch + batch + 2 * batch)
