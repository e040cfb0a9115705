"""Run records: the ``runs/<timestamp>-<loop>-<model>/`` directory and the loggers that fill it.

``config.yaml`` (resolved), ``overrides.yaml``, ``meta.json`` (versions, git commit, seed, engine,
session, command line, status), ``metrics.jsonl`` (one row per train step or eval, keyed by ``step`` =
steps completed), ``checkpoints.jsonl`` (state and sampler saves with their step), ``session_steps.jsonl`` (the
session's optimizer-step count at each step's end, :mod:`.resumes`), ``usage.json`` and
``forecast.json`` (the bound and expected figure the run started with, :mod:`.spend`).
The local logger appends to ``metrics.jsonl`` and drives a rich progress line; ``logger=wandb`` also
sends config and metrics to Weights & Biases (online or offline); ``logger=mlflow`` also logs params
(the flattened config), per-step metrics and the resolved config (``config.yaml`` artifact) to MLflow:
to ``MLFLOW_TRACKING_URI`` when set, else to a local store in the run directory (``mlflow.db``, SQLite,
artifacts under ``mlartifacts/``), offline; ``mlflow ui --backend-store-uri sqlite:///<run>/mlflow.db``
shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from sess.engine.protocol.home import atomic_write_bytes

RECORD_FILES = (
    "config.yaml",
    "overrides.yaml",
    "meta.json",
    "metrics.jsonl",
    "checkpoints.jsonl",
    "session_steps.jsonl",
    "usage.json",
    "forecast.json",
)


def new_run_dir(runs_dir: str | Path, loop: str, model: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(runs_dir) / f"{stamp}-{loop}-{model.replace('/', '-')}"
    path, n = base, 1
    while path.exists():  # two runs in the same second
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


class DamagedRecord(ValueError):
    """A run file that cannot be read (cut short, edited, overwritten); the message names the file."""


def _write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())  # a reader sees the old file or the new one, never half


def _write_json(path: Path, value: Any) -> None:
    _write_text(path, json.dumps(value, indent=1, default=str) + "\n")


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DamagedRecord(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise DamagedRecord(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines record. A last line cut short without its newline is what a killed
    run leaves mid-write: it is skipped; any other unreadable line is damage, named by its number."""
    if not path.is_file():
        return []
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise DamagedRecord(f"{path}: not text ({exc})") from None
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise DamagedRecord(f"{path}: line {number} is not valid JSON ({exc})") from None
    return rows


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0]}
    for dist in ("sess", "torch", "transformers", "peft", "hydra-core", "omegaconf"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class RunRecord:
    """One run directory. Rows are appended and flushed at once so a killed run keeps what it did."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, path: Path, config_yaml: str, overrides: list[str], meta: dict) -> RunRecord:
        record = cls(path)
        _write_text(path / "config.yaml", config_yaml)
        _write_text(path / "overrides.yaml", yaml.safe_dump(list(overrides), default_flow_style=False))
        for name in ("metrics.jsonl", "checkpoints.jsonl", "session_steps.jsonl"):
            (path / name).touch()
        _write_json(path / "usage.json", {})
        record.write_meta(
            {
                "created": datetime.now().isoformat(timespec="seconds"),
                "status": "running",
                "command": sys.argv,
                "cwd": os.getcwd(),
                "git_commit": git_commit(),
                "versions": versions(),
                **meta,
            }
        )
        return record

    @property
    def meta(self) -> dict:
        return read_json(self.path / "meta.json")

    def write_meta(self, meta: dict) -> None:
        _write_json(self.path / "meta.json", meta)

    def update_meta(self, **changes: Any) -> None:
        self.write_meta({**self.meta, **changes})

    def append(self, name: str, row: dict) -> None:
        with (self.path / name).open("a") as f:
            f.write(json.dumps(row, default=float) + "\n")
            f.flush()

    def metrics(self) -> list[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def checkpoints(self) -> list[dict]:
        return read_jsonl(self.path / "checkpoints.jsonl")

    def rows(self, name: str) -> list[dict]:
        return read_jsonl(self.path / name)

    def last_state(self) -> dict | None:
        states = [c for c in self.checkpoints() if c.get("kind") == "state"]
        return states[-1] if states else None

    def truncate_after(self, step: int) -> None:
        """Drop rows past ``step`` (work a killed run did after its last save; a resume redoes it)."""
        for name in ("metrics.jsonl", "checkpoints.jsonl", "session_steps.jsonl"):
            if not (self.path / name).is_file():
                continue
            rows = [r for r in read_jsonl(self.path / name) if r.get("step", 0) <= step]
            _write_text(self.path / name, "".join(json.dumps(r) + "\n" for r in rows))

    def write_usage(self, usage: dict) -> None:
        _write_json(self.path / "usage.json", usage)

    def write_forecast(self, forecast: dict) -> None:
        _write_json(self.path / "forecast.json", forecast)


def list_runs(runs_dir: str | Path) -> list[dict]:
    """Summaries of the run directories under ``runs_dir``, oldest first. A run whose files cannot
    be read is listed with ``problem`` saying which file and why, so one damaged run hides no other."""
    root = Path(runs_dir)
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if (path / "meta.json").is_file():
            found.append(_run_summary(path))
    return found


def _run_summary(path: Path) -> dict:
    from_meta = ("loop", "model", "status", "steps", "session", "error")
    summary: dict[str, Any] = {"run": path.name, "path": str(path), "step": 0, "eval": None, "problem": None}
    summary.update(dict.fromkeys(from_meta))
    try:
        meta = read_json(path / "meta.json")
        summary.update({key: meta.get(key) for key in from_meta})
        rows = read_jsonl(path / "metrics.jsonl")
    except (DamagedRecord, OSError) as exc:
        summary["problem"] = str(exc)
        return summary
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    summary.update(step=train[-1]["step"] if train else 0, eval=_headline(evals[-1]) if evals else None)
    return summary


def _headline(row: dict) -> float | None:
    """The number `sess runs` shows for an eval: accuracy, else chat loss, else an env's mean reward."""
    for key in ("eval/accuracy", "eval/loss", "eval/reward"):
        if key in row:
            return row[key]
    return None


class Logger:
    """metrics.jsonl + an optional wandb or MLflow run; the progress display lives in the runner."""

    def __init__(self, record: RunRecord, cfg, config_dict: dict):
        self.record = record
        self.wandb = None
        self.mlflow = None
        if cfg.name == "wandb":
            self.wandb = _start_wandb(record, cfg, config_dict)
        elif cfg.name == "mlflow":
            self.mlflow = MlflowRun(record, cfg, config_dict)

    def log(self, row: dict) -> None:
        row = {"time": round(time.time(), 3), **row}
        self.record.append("metrics.jsonl", row)
        numbers = {
            k: v
            for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "time")
        }
        if self.wandb is not None:
            self.wandb.log(numbers, step=int(row["step"]))
        if self.mlflow is not None:
            self.mlflow.log(numbers, int(row["step"]), row["time"])

    def close(self, status: str = "completed") -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.mlflow is not None:
            self.mlflow.close(status)
            self.mlflow = None


class MlflowRun:
    """One MLflow run through ``MlflowClient`` (no process-wide active run): params, metrics, config."""

    def __init__(self, record: RunRecord, cfg, config_dict: dict):
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError("logger=mlflow needs the mlflow package: pip install 'sess[mlflow]'") from None
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(record.path / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.project)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = (
                None if os.environ.get("MLFLOW_TRACKING_URI") else (record.path / "mlartifacts").resolve()
            )
            experiment_id = self.client.create_experiment(
                cfg.project, artifact_location=artifacts.as_uri() if artifacts else None
            )
        tags = {f"tag.{t}": "true" for t in cfg.tags}
        run = self.client.create_run(experiment_id, run_name=record.path.name, tags=tags)
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(config_dict).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_text(self.run_id, yaml.safe_dump(config_dict, sort_keys=False), "config.yaml")
        record.update_meta(mlflow={"tracking_uri": uri, "run_id": self.run_id, "experiment": cfg.project})

    def log(self, numbers: dict, step: int, when: float) -> None:
        from mlflow.entities import Metric

        stamp = int(when * 1000)
        metrics = [Metric(k, float(v), stamp, step) for k, v in numbers.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if status == "completed" else "FAILED")


def _flat(tree: dict, prefix: str = "") -> dict:
    """``{"loop": {"steps": 2}}`` -> ``{"loop.steps": 2}`` (lists stay values)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _start_wandb(record: RunRecord, cfg, config_dict: dict):
    try:
        import wandb
    except ImportError:
        raise RuntimeError("logger=wandb needs the wandb package: pip install 'sess[wandb]'") from None
    mode = os.environ.get("WANDB_MODE") or cfg.mode
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=record.path.name,
        dir=str(record.path),
        config=config_dict,
        tags=list(cfg.tags),
        mode=mode,
        reinit="finish_previous",
    )
    record.update_meta(wandb={"id": run.id, "mode": mode, "dir": str(Path(run.dir).parent)})
    return run
