#!/usr/bin/env python
"""``bench_generate.py`` with the draft schedule's inputs logged at every B = 1 step (diagnosis).

Writes one JSON line per ``speculative_generate`` call (its prompt's shape
[B, width] and temperature), one per schedule (batch size, drafter, the
acceptance tally carried from earlier calls) and, for batch-1 calls, one per step: the
width chosen (``w``, 0 = a plain step), whether it explored, the verification
costs the schedule assumed for q = 1, 2, 3, 4, 5, 8, 9 (ms), which widths it
had measured, its per-step overheads (drafted, plain; ms), its draft cost per
token (ms) and the row's acceptance estimate. Usage (every other argument is
``bench_generate.py``'s)::

    python benchmarks/trace_schedule.py --log OUT.jsonl --quick --drafter eagle \\
        --categories open,grounded --batch-sizes 1,8 --temperatures 0
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--log":
        raise SystemExit("usage: trace_schedule.py --log OUT.jsonl [bench_generate.py arguments]")
    log = open(argv[1], "w")  # open for the whole run
    from specjax.generate import schedule

    cls = schedule.DraftSchedule
    init, plan = cls.__init__, cls.plan
    calls = [0]

    def traced_init(self: Any, batch: int, max_draft: int, **kw: Any) -> None:
        init(self, batch, max_draft, **kw)
        calls[0] += 1
        self._trace_call = calls[0]
        head = {"call": calls[0], "batch": batch, "drafter": kw.get("drafter_key"), "greedy": kw.get("greedy")}
        log.write(json.dumps({**head, "tally": self.tally.tolist()}) + "\n")

    def traced_plan(self: Any, caps: Any, active: Any, remaining: Any = None) -> Any:
        out = plan(self, caps, active, remaining)
        if len(caps) == 1:
            step = {
                "c": self._trace_call,
                "w": int(out.max()),
                "forced": bool(self._forced),
                "verify": [round(self._verify_cost(q) * 1e3, 1) for q in (1, 2, 3, 4, 5, 8, 9)],
                "measured": sorted(k[1] for k in self.times if k[0] == "verify" and self._estimate(k) is not None),
                "ovh": [round(self._overhead(True) * 1e3, 1), round(self._overhead(False) * 1e3, 1)],
                "draft": round(self._draft_cost() * 1e3, 2),
                "alpha": round(float(self.alpha()[0]), 3),
            }
            log.write(json.dumps(step) + "\n")
        return out

    cls.__init__, cls.plan = traced_init, traced_plan  # type: ignore[method-assign]
    import specjax

    generate = specjax.speculative_generate

    def traced_generate(target: Any, draft: Any, ids: Any, *args: Any, **kw: Any) -> Any:
        # the next schedule's call: its prompt width and temperature (bench_generate imports it per call)
        log.write(json.dumps({"generate": list(ids.shape), "temperature": kw.get("temperature")}) + "\n")
        return generate(target, draft, ids, *args, **kw)

    specjax.speculative_generate = traced_generate
    sys.path.insert(0, str(HERE))
    sys.argv = [str(HERE / "bench_generate.py"), *argv[2:]]
    try:
        runpy.run_path(str(HERE / "bench_generate.py"), run_name="__main__")
    finally:
        log.close()


if __name__ == "__main__":
    main(sys.argv[1:])
