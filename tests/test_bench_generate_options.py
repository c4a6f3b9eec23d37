"""benchmarks/bench_generate.py's ``--options`` (issue 56): what each side gets, and what it refuses.

The runs themselves (greedy output identical to ``generate`` with the same processors) need the default
pair and are checked by the script's own ``same output`` column; these tests hold the rules the runs rely on.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        return importlib.import_module("bench_generate")


@pytest.mark.parametrize(
    ("name", "temperature", "expected"),
    [
        ("none", 0.0, {}),
        ("penalty-minp", 0.0, {"repetition_penalty": 1.1}),  # greedy decoding ignores min_p
        ("penalty-minp", 0.7, {"repetition_penalty": 1.1, "min_p": 0.05}),
        ("json", 0.0, {}),  # the schema goes per call (json_schema= / xgrammar's processor)
    ],
)
def test_each_side_gets_the_same_options(bench: Any, name: str, temperature: float, expected: dict) -> None:
    assert bench.OPTIONS[name].at(temperature) == expected


@pytest.mark.parametrize(
    ("name", "categories", "sizes", "problem"),
    [
        ("penalty-minp", ["open"], [1, 8], None),
        ("json", None, [1], None),
        ("json", ["extraction"], [1], None),
        ("json", ["open"], [1], r"--options json: needs --categories extraction"),
        ("json", ["extraction", "grounded"], [1], r"--options json: needs --categories extraction"),
        ("json", ["extraction"], [1, 8], r"--options json: needs --batch-sizes 1 \(one JSON schema a call\)"),
    ],
)
def test_json_runs_on_extraction_prompts_at_b1_only(
    bench: Any, name: str, categories: list[str] | None, sizes: list[int], problem: str | None, capsys: Any
) -> None:
    found = bench.options_problem(bench.OPTIONS[name], categories, sizes)
    if problem is None:
        assert found is None
        return
    assert found is not None
    with pytest.raises(ValueError, match=problem):
        bench.bench_generate(True, options=name, categories=categories, batch_sizes=sizes)
    argv = ["--options", name, "--batch-sizes", ",".join(map(str, sizes))]
    with pytest.raises(SystemExit):
        bench.main([*argv, *(["--categories", ",".join(categories)] if categories else [])])
    assert "--options json: needs" in capsys.readouterr().err


def test_an_unknown_option_set_is_named(bench: Any) -> None:
    with pytest.raises(ValueError, match=r"options: expected one of none, penalty-minp, json, got 'minp'"):
        bench.bench_generate(True, options="minp")


def test_each_extraction_prompt_asks_for_its_schema_keys(bench: Any) -> None:
    """Unit u of a json run gets the u-th prompt and the u-th schema: each prompt names exactly its keys."""
    from specjax.prompts import EXTRACTION

    schemas = bench.category_schemas("extraction")
    assert len(schemas) == len(EXTRACTION) >= 8
    for (name, messages), schema in zip(EXTRACTION.items(), schemas, strict=True):
        keys = messages[0]["content"].split("with exactly the keys ", 1)[1].split(". Reply", 1)[0]
        assert keys.split(", ") == list(schema["properties"]) == schema["required"], name
        assert schema["additionalProperties"] is False
        json.dumps(schema)  # plain JSON: what json_schema= and xgrammar compile


def test_b8_batches_rotate_the_prompts(bench: Any, capsys: Any) -> None:
    """``--batches N``: N different batches of 8 (batch 0 the first 8, as with one batch), each prompt in each."""
    prompts = [f"p{i}" for i in range(6)]
    one = bench.batches_of_eight(prompts, 1)
    assert one == [(prompts * 2)[:8]]
    three = bench.batches_of_eight(prompts, 3)
    assert three[0] == one[0] and len(three) == 3
    assert [b[0] for b in three] == ["p0", "p1", "p2"]
    assert all(len(b) == 8 and set(b) == set(prompts) for b in three)
    assert len({tuple(b) for b in three}) == 3
    with pytest.raises(SystemExit):
        bench.main(["--batches", "0"])
    assert "--batches: expected an integer >= 1, got 0" in capsys.readouterr().err
