"""Collapse warnings: sampled-token entropy under its floor, held-out accuracy down beyond noise;
each recorded in the row, on the progress output and in ``meta.json``."""

from __future__ import annotations

import json

from sess.harness.collapse import ENTROPY_FLOOR, CollapseWatch, record_warning
from sess.harness.records import RunRecord


def test_collapse_warns_on_low_entropy_and_on_an_accuracy_drop_beyond_noise():
    watch = CollapseWatch()
    assert watch.after_step(1, {"entropy/sampled_mc": 1.2}) is None
    assert watch.after_step(1, {"loss": 0.0}) is None  # a loop without the metric: no warning
    low = watch.after_step(2, {"entropy/sampled_mc": ENTROPY_FLOOR / 2})
    assert low and "entropy" in low and str(ENTROPY_FLOOR) in low
    assert watch.after_eval(0, {"eval/accuracy": 0.40, "eval/n": 256}) is None
    assert watch.after_eval(5, {"eval/accuracy": 0.70, "eval/n": 256}) is None  # a gain
    # se ~0.029 each: noise 2*sqrt(2)*0.029 ~ 0.08; a 0.05 drop is within it, a 0.2 drop is not
    assert watch.after_eval(10, {"eval/accuracy": 0.65, "eval/n": 256}) is None
    drop = watch.after_eval(15, {"eval/accuracy": 0.50, "eval/n": 256})
    assert drop and "0.700 at step 5" in drop
    # the same drop on 8 problems is noise
    small = CollapseWatch()
    small.after_eval(0, {"eval/accuracy": 0.75, "eval/n": 8})
    assert small.after_eval(5, {"eval/accuracy": 0.5, "eval/n": 8}) is None


class _Lines:
    def __init__(self):
        self.lines = []

    def note(self, text: str) -> None:
        self.lines.append(text)


def test_a_warning_goes_to_the_row_the_progress_output_and_meta(tmp_path):
    record = RunRecord.create(tmp_path / "run", "seed: 0\n", [], {"loop": "grpo"})
    progress, row = _Lines(), {"kind": "train", "step": 3}
    record_warning(record, progress, row, None)
    assert "warning" not in row and progress.lines == [] and "warnings" not in record.meta
    watch = CollapseWatch()
    for step, entropy in ((1, ENTROPY_FLOOR / 5), (2, ENTROPY_FLOOR / 2)):
        row = {"kind": "train", "step": step, "entropy/sampled_mc": entropy}
        record_warning(record, progress, row, watch.after_step(step, row))
        assert "entropy" in row["warning"]
    assert [line.startswith("warning: policy collapse?") for line in progress.lines] == [True, True]
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["loop"] == "grpo" and len(meta["warnings"]) == 2 and "step 2" in meta["warnings"][1]
