"""A load test (slow): 16 sessions over 4 keys on one priced engine for a few minutes of mixed
forward_backward / optim_step / sample / compute_logprobs / save_state, one key put over its budget a
third of the way in and raised two thirds in (benchmarks/load.py runs it and prints the figures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

LOAD = Path(__file__).resolve().parents[2] / "benchmarks" / "load.py"


@pytest.mark.slow
def test_many_tenants_under_load_are_billed_exactly_and_a_raised_budget_resumes(tmp_path):
    spec = importlib.util.spec_from_file_location("sess_load_benchmark", LOAD)
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    report = load.run(150.0, keys=4, sessions=4, home=tmp_path / "home")
    load.print_report(report, 4, 4)  # pytest -s shows the figures
    for key in report["keys"]:
        assert key["server_errors"] == 0 and not key["other_errors"], key  # every accepted op resolved
        assert key["ops"] > 0, key
        assert key["engine_tokens"] == key["client_tokens"], key  # each op counted once
        assert key["engine_cost"] == key["client_cost"], key
    limited = report["keys"][-1]
    assert limited["refused"] > 0 and limited["resumed"], limited  # 402s, then its sessions went on
    assert report["rss_last_mb"] <= 1.15 * report["rss_middle_mb"], report
