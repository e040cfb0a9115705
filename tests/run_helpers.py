"""Shared pieces of the tests that run ``sess run``: tiny-model overrides and a run through the CLI."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from sess.cli.main import app
from sess.harness.records import read_jsonl

cli = CliRunner()

TINY = ["model=tiny-llama", "data.eval_size=4", "loop.max_tokens=8", "loop.batch_size=2"]
GROUPS = {
    "grpo": ["loop.group_size=4"],
    "ppo": ["loop.group_size=2"],
    "importance_sampling": ["loop.group_size=4"],
}


def run(tmp_path, *overrides: str) -> Path:
    engine = [] if any(o.startswith("engine=") for o in overrides) else ["engine=inprocess"]
    result = cli.invoke(app, ["run", *TINY, *engine, f"runs_dir={tmp_path}", *overrides])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and (p / "meta.json").exists()]
    return run_dir


def train_rows(run_dir: Path) -> list[dict]:
    """The run's per-step training records."""
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def comparable(rows: list[dict]) -> list[dict]:
    """Rows without wall time: what two runs of one config must record alike, to the bit (sampling is
    batch-invariant, so thread timing cannot leak in)."""
    drop = {"time", "seconds", "eval/seconds"}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]
