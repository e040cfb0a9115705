"""The headline (slow, real weights): default GRPO on smollm2-135m lifts held-out greedy accuracy."""

from __future__ import annotations

import pytest

from sess.harness import runner
from sess.harness.records import read_jsonl


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["grpo", "sft"])
def test_default_run_raises_held_out_accuracy_by_15_points(tmp_path, loop):
    run_dir = runner.start([f"loop={loop}", "engine=inprocess", f"runs_dir={tmp_path}"], show_progress=False)
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[0]["eval/n"] >= 64 and evals[-1]["step"] <= 20
    assert evals[-1]["eval/accuracy"] >= evals[0]["eval/accuracy"] + 0.15, evals
