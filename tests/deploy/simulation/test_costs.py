"""The cost model: its default is what bench/sim_fit.py fitted (one source of truth, the results file), and a bad
cost file is refused naming the figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.simulation import costs

pytestmark = pytest.mark.unit

FIT = Path(__file__).resolve().parents[3] / "bench" / "results" / "sim_fit.json"


def test_the_default_is_the_fit_in_the_results():
    assert costs.DEFAULT.to_json() == json.loads(FIT.read_text())["costs"]


def test_a_cost_file_round_trips(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.DEFAULT.to_json()))
    assert costs.load(path) == costs.DEFAULT


@pytest.mark.parametrize("change, message", [
    ({"pull_s": -1.0}, "pull_s must be a finite number >= 0"),
    ({"steps": {"off": {"step_s": 0.1, "prefill_token_s": 0.0}}}, "no step costs for mode"),
    ({"pd_step_scale": 0.0}, "must be > 0"),
    ({"pull_ms": 1.0}, "not a cost model"),
])
def test_a_bad_cost_file_names_the_figure(tmp_path, change, message):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({**costs.DEFAULT.to_json(), **change}))
    with pytest.raises(ValueError, match=message):
        costs.load(path)
