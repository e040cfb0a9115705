"""The diagnostics a run records and shows (zero-advantage share, sampled-token entropy, sampler-
trainer KL, clip fraction, KL to the reference, held-out accuracy ± standard error) and the seed
table of ``sess runs seeds`` over tiny runs."""

from __future__ import annotations

import re

import pytest

from sess.cli.main import app
from sess.harness.records import read_jsonl

from run_helpers import TINY, cli, train_rows


@pytest.fixture(scope="module")
def seed_runs(sess_home, tmp_path_factory):
    """Two one-step grpo runs of tiny-llama, seeds 0 and 1, and the `sess run` output of each."""
    runs_dir = tmp_path_factory.mktemp("seed-runs")
    outputs = []
    for seed in (0, 1):
        args = ["run", *TINY, "engine=inprocess", f"runs_dir={runs_dir}", "loop.steps=1"]
        result = cli.invoke(app, [*args, "loop.group_size=4", f"seed={seed}"])
        assert result.exit_code == 0, result.output + repr(result.exception)
        outputs.append(result.output)
    runs = sorted(p for p in runs_dir.iterdir() if (p / "meta.json").exists())
    assert len(runs) == 2
    return runs_dir, runs, outputs


def test_a_grpo_run_records_the_diagnostics_with_sane_values(seed_runs):
    _, runs, _ = seed_runs
    (row,) = train_rows(runs[0])
    assert 0 <= row["groups/zero_advantage"] <= 1
    assert row["groups/zero_advantage"] == pytest.approx(1 - row["groups_with_signal"])
    assert row["entropy/sampled_mc"] > 0  # a random tiny model at temperature 1: far from collapse
    if row.get("datums"):  # a step with signal trained: the learner's logprobs give these
        assert 0 <= row["clip/fraction"] <= 1
        assert row["drift/kl_sample_train_k3"] >= 0
        assert abs(row["drift/kl_sample_train"]) < 1e-3  # on-policy, the same kernels
    evals = [r for r in read_jsonl(runs[0] / "metrics.jsonl") if r["kind"] == "eval"]
    for r in evals:
        p, n = r["eval/accuracy"], r["eval/n"]
        assert n == 4 and r["eval/accuracy_se"] == pytest.approx((p * (1 - p) / n) ** 0.5)


def test_run_and_show_print_accuracy_with_its_standard_error(seed_runs):
    runs_dir, runs, outputs = seed_runs
    assert re.search(
        r"held-out accuracy \d\.\d{3} ± \d\.\d{3} \(n=4\) → \d\.\d{3} ± \d\.\d{3} \(n=4\)", outputs[0]
    )
    shown = cli.invoke(app, ["runs", "show", runs[0].name, "--dir", str(runs_dir)])
    assert shown.exit_code == 0, shown.output
    assert "entropy" in shown.output and "zero-adv" in shown.output
    assert re.search(r"\d\.\d{3} ± \d\.\d{3}", shown.output)


def test_runs_seeds_prints_each_run_and_the_mean_and_spread(seed_runs):
    runs_dir, runs, _ = seed_runs
    result = cli.invoke(app, ["runs", "seeds", *(r.name for r in runs), "--dir", str(runs_dir)])
    assert result.exit_code == 0, result.output
    befores = [
        [r for r in read_jsonl(p / "metrics.jsonl") if r["kind"] == "eval"][0]["eval/accuracy"] for p in runs
    ]
    text = result.output
    assert "mean ± spread (2 runs)" in text
    mean = sum(befores) / 2
    spread = abs(befores[0] - befores[1]) / 2**0.5  # the sample standard deviation of two values
    assert f"{mean:.3f} ± {spread:.3f}" in text
    for p in runs:
        assert p.name[:20] in text


def test_ppo_records_kl_to_the_reference_and_the_clip_fraction(sess_home, tmp_path):
    args = ["run", *TINY, "engine=inprocess", f"runs_dir={tmp_path}", "loop=ppo", "loop.steps=1"]
    result = cli.invoke(app, [*args, "loop.group_size=2"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (run_dir,) = [p for p in tmp_path.iterdir() if (p / "meta.json").exists()]
    (row,) = train_rows(run_dir)
    assert 0 <= row["clip/fraction"] <= 1 and 0 <= row["groups/zero_advantage"] <= 1
    # the first update starts at the base weights (LoRA's B is 0): the policy is the reference
    assert row["kl/reference_per_token"] == pytest.approx(0.0, abs=1e-4)
    assert row["entropy/sampled_mc"] > 0
