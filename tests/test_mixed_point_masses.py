"""Point masses and draft logits in one batch: the per-row point-mass mask.

A step may verify rows whose proposals are deterministic (n-gram lookups: ``q``
is the point mass at each token) beside rows drawn from a draft model's logits
(the ``hybrid`` drafter's steps). The draft batch marks the first kind
(``DraftBatch.point_mass_rows``) and the jitted steps take the mask
(``steps.verify_step`` / ``steps.probs_step``, ``point_mass_rows``). Checked here:

* each row of a mixed batch gets exactly the result it gets alone, verified
  as its own kind (same key and ``k_b``, so the same uniforms): the point-mass
  rule or its logits; the point-mass rows' logits are never read (NaN there
  changes nothing); a negative control shows those logits would change the
  result if they were read;
* ``probs_step`` (what sampler plugins get): one-hot ``q`` on the mask's rows,
  the processed logits elsewhere;
* the draft batch's mask from a :class:`~specjax.drafters.Proposal`, and the
  proposal checks (the mask's type; the mask's rows exempt from the draft-logits
  value checks).

The hybrid drafter's proposals carry the mask (integration_tests/test_drafters.py)
and its output follows the target's law (integration_tests/test_generate_stats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import pytest
import torch

from specjax.boundary.validation import prepare_params
from specjax.drafters import Proposal
from specjax.generate.checks import PluginOutputError
from specjax.generate.draft_batch import check_proposal, draft_batch
from specjax.kernels import steps

B, G, V, STEP = 6, 4, 64, 3
MASK = np.array([True, False, True, False, True, False])
K = np.array([4, 4, 2, 1, 0, 3], np.int32)  # ragged, with 0 and G


@dataclass(frozen=True)
class Params:
    name: str
    temperature: Any
    top_k: Any = None
    top_p: Any = None


CASES = [
    Params("T0.7-top-k-top-p", 0.7, 20, 0.9),
    Params("greedy-rows-among-sampled", [0.0, 0.7, 1.0, 0.0, 0.5, 1.3]),
    Params("T1-no-top-k", 1.0),
    Params("every-row-greedy", 0.0),
]


def _inputs(seed: int = 0) -> tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray, Any]:
    """Draft tokens i32[B, G], draft logits (G arrays f32[B, V]), target logits f32[B, G+1, V], keys key[B].

    Half the draft tokens are the target's argmax (so tests pass as well as fail). On the
    point-mass rows the draft logits make each token unlikely: read as the token's law, they
    would give other decisions than the point mass (the negative control below relies on it).
    """
    rng = np.random.default_rng(seed)
    target = (rng.normal(size=(B, G + 1, V)) * 2).astype(np.float32)
    x = np.where(rng.random((B, G)) < 0.5, target[:, :G].argmax(-1), rng.integers(0, V, (B, G))).astype(np.int32)
    draft = rng.normal(size=(B, G, V)).astype(np.float32)
    rows, cols = np.nonzero(MASK[:, None] & np.ones((1, G), bool))
    draft[rows, cols, x[rows, cols]] = -6.0
    keys = jax.random.split(jax.random.key(seed + 1), B)
    return x, tuple(draft.transpose(1, 0, 2)), target, keys


def _params(case: Params, rows: slice = slice(None)) -> Any:
    # the JAX code on every path: a row alone with logits would otherwise take the C++ CPU kernel,
    # equal in law but not always in the last bit of a probability
    params = prepare_params(case.temperature, case.top_k, case.top_p, B, True, "xla")
    return jax.tree.map(lambda a: a[rows], params)


def _host(out: Any) -> tuple[list[int], list[list[int]]]:
    return np.asarray(out.num_accepted).tolist(), np.asarray(out.tokens).tolist()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_each_row_of_a_mixed_batch_gets_its_result_alone(case: Params) -> None:
    x, d, t, keys = _inputs()
    n, tokens = _host(steps.verify_step(x, d, t, keys, STEP, _params(case), K, MASK))
    for b in range(B):
        one = slice(b, b + 1)
        alone_logits = None if MASK[b] else tuple(a[one] for a in d)  # its own kind
        n_b, tokens_b = _host(
            steps.verify_step(x[one], alone_logits, t[one], keys[one], STEP, _params(case, one), K[one])
        )
        assert (n[b], tokens[b]) == (n_b[0], tokens_b[0]), f"row {b} ({'point mass' if MASK[b] else 'logits'})"


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_the_point_mass_rows_logits_are_never_read(case: Params) -> None:
    x, d, t, keys = _inputs()
    mixed = _host(steps.verify_step(x, d, t, keys, STEP, _params(case), K, MASK))
    nan_rows = tuple(np.where(MASK[:, None], np.float32(np.nan), a) for a in d)
    assert _host(steps.verify_step(x, nan_rows, t, keys, STEP, _params(case), K, MASK)) == mixed


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
def test_negative_control_reading_the_point_mass_rows_logits_changes_them(case: Params) -> None:
    """Without the mask the point-mass rows are verified against their (unlikely-token) logits:
    other results there, the same on the logits rows. So the comparisons above can fail."""
    x, d, t, keys = _inputs()
    n, tokens = _host(steps.verify_step(x, d, t, keys, STEP, _params(case), K, MASK))
    n_wrong, tokens_wrong = _host(steps.verify_step(x, d, t, keys, STEP, _params(case), K))
    masked = np.flatnonzero(MASK).tolist()
    assert any((n[b], tokens[b]) != (n_wrong[b], tokens_wrong[b]) for b in masked)
    assert all((n[b], tokens[b]) == (n_wrong[b], tokens_wrong[b]) for b in range(B) if b not in masked)


def test_probs_step_gives_the_point_mass_rows_one_hot_draft_probabilities() -> None:
    x, d, t, keys = _inputs()
    params = _params(CASES[0])
    q, p, u = (np.asarray(a) for a in steps.probs_step(d, t, keys, STEP, params, x, MASK))
    q_logits, p_ref, u_ref = (np.asarray(a) for a in steps.probs_step(d, t, keys, STEP, params))
    one_hot = (x[..., None] == np.arange(V)).astype(np.float32)
    np.testing.assert_array_equal(q[MASK], one_hot[MASK])
    np.testing.assert_array_equal(q[~MASK], q_logits[~MASK])
    np.testing.assert_array_equal(p, p_ref)
    np.testing.assert_array_equal(u, u_ref)
    assert not np.array_equal(q_logits[MASK], one_hot[MASK])  # negative control: the logits' q differs


# --------------------------------------------------------------------------- the draft batch


@dataclass(frozen=True)
class BatchCase:
    name: str
    with_logits: bool
    point_mass_rows: list[bool] | None
    k: list[int]
    rows: list[bool]  # DraftBatch.point_mass_rows
    kept_logits: bool  # DraftBatch.logits is not None
    mixed: bool  # DraftBatch.mixed_point_masses is not None


BATCH_CASES = [
    BatchCase("point masses", False, None, [2, 1, 0], [True] * 3, False, False),
    BatchCase("logits", True, None, [2, 1, 0], [False] * 3, True, False),
    BatchCase("mixed", True, [True, False, True], [2, 1, 0], [True, False, True], True, True),
    BatchCase("mixed, but no logits row tests", True, [True, False, True], [2, 0, 1], [True] * 3, False, False),
    BatchCase("marked rows test nothing", True, [False, True, False], [2, 0, 1], [False, True, False], True, False),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: c.name)
def test_draft_batch_marks_the_point_mass_rows(case: BatchCase) -> None:
    b, g = len(case.k), 2
    tokens = np.arange(b * g, dtype=np.int32).reshape(b, g)
    logits = tuple(np.zeros((b, 8), np.float32) for _ in range(g)) if case.with_logits else None
    rows = None if case.point_mass_rows is None else np.array(case.point_mass_rows)
    proposal = Proposal(tokens, np.array(case.k), logits, point_mass_rows=rows)
    batch = draft_batch(proposal, np.array(case.k), g, np.zeros(b, np.int64), torch.device("cpu"), None)
    assert batch.point_mass_rows.tolist() == case.rows
    assert (batch.logits is not None) == case.kept_logits
    assert (batch.mixed_point_masses is not None) == case.mixed


def _proposal(point_mass_rows: Any) -> Proposal:
    """Row 0 proposes token 9, outside its 8-wide draft logits: not a token drawn from them."""
    tokens = np.array([[9], [1]], np.int32)
    return Proposal(tokens, np.array([1, 1]), (np.zeros((2, 8), np.float32),), point_mass_rows=point_mass_rows)


def test_the_point_mass_rows_are_exempt_from_the_draft_logits_checks() -> None:
    check_proposal("drafter 'd'", _proposal(np.array([True, False])), np.array([1, 1]), 2, 16,
                   check_ids=True, check_logits=True)  # fmt: skip
    with pytest.raises(PluginOutputError, match=r"drafter 'd' proposed token 9 at row 0, position 0, outside"):
        check_proposal("drafter 'd'", _proposal(None), np.array([1, 1]), 2, 16, check_ids=True, check_logits=True)


@pytest.mark.parametrize("rows", [np.array([1, 0]), np.array([True, False, True]), np.array([1.0, 0.0])])
def test_a_malformed_point_mass_mask_is_refused_by_name(rows: Any) -> None:
    with pytest.raises(PluginOutputError, match=r"drafter 'd' returned point_mass_rows of shape .* expected bool"):
        check_proposal("drafter 'd'", _proposal(rows), np.array([1, 1]), 2, 16, check_ids=True, check_logits=True)
