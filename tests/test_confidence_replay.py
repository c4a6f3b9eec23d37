"""scripts/confidence_calibration.py's replay: what fixed lengths and the confidence's choice are worth."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("confidence_calibration", ROOT / "scripts" / "confidence_calibration.py")
assert _spec is not None and _spec.loader is not None
calibration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(calibration)

COST = {1: 0.040, 2: 0.056, 3: 0.056, 4: 0.056, 5: 0.056}


def test_fixed_lengths_are_priced_from_the_recorded_outcomes():
    steps = [(np.array([0.9, 0.9, 0.9, 0.9]), 2)] * 4  # two of four pass, every step
    out = calibration.replay(steps, COST, 0.0, 4)
    assert out["fixed 1"] == pytest.approx(2 / 0.056 * 0.040)
    assert out["fixed 4"] == pytest.approx(3 / 0.056 * 0.040)


def test_the_confidence_verifies_what_it_is_sure_of_and_skips_the_rest():
    sure = (np.array([0.95, 0.95, 0.95, 0.95]), 4)
    unsure = (np.array([0.05, 0.05, 0.05, 0.05]), 0)
    out = calibration.replay([sure, unsure], COST, 0.001, 4)
    # sure: all four verified (5 tokens, 56 ms + 4 ms); unsure: a plain step (1 token, 40 ms + the first draft)
    assert out["by confidence"] == pytest.approx(6 / (0.060 + 0.041) * 0.040)
    assert out["by confidence"] > max(v for k, v in out.items() if k.startswith("fixed"))
    # negative control: a confidence that says the opposite of the outcomes loses to drafting 4 every step
    wrong = [(sure[0], 0), (unsure[0], 4)]
    out = calibration.replay(wrong, COST, 0.001, 4)
    assert out["by confidence"] < out["fixed 4"]
