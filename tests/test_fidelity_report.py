"""The corpus report's floor figures (``benchmarks/fidelity_report.py``), on hand-made rows: a floor chain that
ends accepted above a budget a fraction point had accepted is counted as an overshoot, and the floor table's note
says which of the chain's budgets were refused and where it ended."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# the benchmark's report module, loaded from its file (benchmarks/ is scripts, not a package)
_SPEC = importlib.util.spec_from_file_location(
    "fidelity_report", Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_report.py")
fidelity_report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fidelity_report)


def _refused(budget: int, named: int) -> dict:
    return {"budget_bytes": budget, "error": "infeasible: ...", "min_budget_bytes": named}


def _accepted(budget: int, measured: int) -> dict:
    return {"budget_bytes": budget, "measured_later_bytes": measured}


def _model(chain_end: int, fraction_budget: int) -> dict:
    return {"probe": {"floor_bytes": 100}, "floor": _refused(100, 200), "floor-named": _refused(200, chain_end),
            "floor-named-2": _accepted(chain_end, chain_end - 10), "0.5": _accepted(fraction_budget, fraction_budget - 5)}


def test_a_chain_accepted_above_a_smaller_accepted_budget_is_an_overshoot():
    models = {"over": _model(chain_end=800, fraction_budget=500), "under": _model(chain_end=400, fraction_budget=500)}
    assert fidelity_report.floor_retries(models["over"]) == 2
    assert fidelity_report.chain_overshoots(models) == {"over": 800 / 500}


def test_the_floor_note_names_the_refused_budgets_and_where_the_chain_ended():
    floor, at_floor, note = fidelity_report._accepted_floor(_model(chain_end=800, fraction_budget=500))
    assert (floor, at_floor) == (500, 495)
    assert "its retry were refused" in note and "the next retry accepted at" in note
    floor, _, note = fidelity_report._accepted_floor(_model(chain_end=400, fraction_budget=500))
    assert floor == 400 and note.startswith(" (retry 2;")


def test_the_floor_note_says_when_the_probes_budget_was_not_run():
    points = {"probe": {"floor_bytes": 100}, "0.9": _accepted(300, 290)}
    floor, _, note = fidelity_report._accepted_floor(points)
    assert floor == 300 and "the probe's 0.000 was not run" in note, note
