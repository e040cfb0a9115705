"""``sess runs``: list recorded runs, ``show`` one (config, per-step table, chart), ``compare`` two.

A run is named by its directory, or by the directory's name under ``--dir`` (default ``runs``). All
of it reads the run's files (``config.yaml``, ``meta.json``, ``metrics.jsonl``); no engine is needed.
"""

from __future__ import annotations

from pathlib import Path

import typer

from sess.cli.app import app, err, fail
from sess.cli.output import out, print_table
from sess.cli.text_chart import line_chart

runs_app = typer.Typer(help="Recorded runs: list them, show one, compare two.", invoke_without_command=True)
app.add_typer(runs_app, name="runs")
RUNS_DIR = typer.Option(Path("runs"), "--dir", help="Where run records live.")
# per-step columns, in this order, where a run has them: (metric key, column title)
STEP_COLUMNS = (
    ("loss", "loss"),
    ("reward/mean", "reward"),
    ("accuracy", "accuracy"),
    ("margin", "margin"),
    ("grad_norm", "grad norm"),
    ("groups/zero_advantage", "zero-adv"),
    ("entropy/sampled_mc", "entropy"),
    ("drift/kl_sample_train", "kl s-t"),
    ("clip/fraction", "clipped"),
    ("kl/reference_per_token", "kl ref"),
    ("tokens", "tokens"),
    ("spend/tokens", "spent"),
    ("spend/projected_tokens", "projected"),
    ("seconds", "s"),
)
EVAL_KEYS = ("eval/accuracy", "eval/loss", "eval/margin", "eval/reward")


@runs_app.callback()
def runs(ctx: typer.Context, runs_dir: Path = RUNS_DIR) -> None:
    """List recorded runs (with no subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    from sess.harness.records import list_runs

    found = list_runs(runs_dir)
    if not found:
        out.print(f"no runs under {runs_dir}")
        return
    header = ("run", "loop", "model", "status", "step", "eval", "session")
    rows = [
        (
            r["run"],
            r["loop"] or "",
            r["model"] or "",
            "damaged" if r["problem"] else r["status"],
            f"{r['step']}/{r['steps']}" if r["steps"] else str(r["step"]),
            "" if r["eval"] is None else f"{r['eval']:.3f}",
            r["session"] or "",
        )
        for r in found
    ]
    print_table(header, rows)
    for r in found:  # why a run failed or cannot be read: one line each, on stderr (stdout stays a table)
        if r["problem"] or r["error"]:
            note = r["problem"] or f"{r['status']}: {r['error']}"
            err.print(f"{r['run']}: {note}", highlight=False, markup=False)


def find_run(run: str, runs_dir: Path) -> Path:
    for candidate in (Path(run), runs_dir / run):
        if (candidate / "meta.json").is_file():
            return candidate
    matches = (
        sorted(p for p in runs_dir.glob(f"*{run}*") if (p / "meta.json").is_file())
        if runs_dir.is_dir()
        else []
    )
    if len(matches) == 1:
        return matches[0]
    if matches:
        fail(
            f"run {run!r} matches {len(matches)} runs under {runs_dir}; give more of its name:\n"
            + "\n".join(f"  {m.name}" for m in matches)
        )
    fail(f"no run {run!r} (a run directory, or a name under {runs_dir}; `sess runs` lists them)")


def run_summary(path: Path) -> dict:
    """The run's meta, resolved config and metric rows; a file that cannot be read is one line
    naming it."""
    from sess.harness.records import DamagedRecord, read_json, read_jsonl

    try:
        meta = read_json(path / "meta.json")
        config = _read_yaml(path / "config.yaml")
        rows = read_jsonl(path / "metrics.jsonl")
    except DamagedRecord as exc:
        fail(str(exc))
    return {
        "meta": meta,
        "usage": _usage(path),
        "forecast": _usage(path, "forecast.json"),
        "config": config or {},
        "train": [r for r in rows if r.get("kind") == "train"],
        "eval": [r for r in rows if r.get("kind") == "eval"],
    }


def _usage(path: Path, name: str = "usage.json") -> dict:
    """The run's ``usage.json`` (tokens, and cost where the engine had prices), or its
    ``forecast.json``; {} if it has none."""
    import json

    try:
        usage = json.loads((path / name).read_text())
    except (OSError, ValueError):
        return {}
    return usage if isinstance(usage, dict) else {}


def _usage_cells(usage: dict) -> tuple[str, str]:
    """(tokens, cost) of a run's usage as table cells: cost only where the engine priced it."""
    if not usage:
        return "", ""
    tokens = sum(int(usage.get(k) or 0) for k in ("prefill_tokens", "sampled_tokens", "training_tokens"))
    cost = f"{usage['cost']} {usage.get('currency') or ''}".strip() if usage.get("cost") is not None else ""
    return str(tokens), cost


def _read_yaml(path: Path) -> dict:
    import yaml

    from sess.harness.records import DamagedRecord

    if not path.is_file():
        return {}
    try:
        value = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DamagedRecord(
            f"{path}: not valid YAML ({getattr(exc, 'problem', None) or exc}{where})"
        ) from None
    if value is not None and not isinstance(value, dict):
        raise DamagedRecord(f"{path}: expected a mapping of config keys, got {type(value).__name__}")
    return value or {}


@runs_app.command("show")
def show(
    run: str = typer.Argument(..., help="A run directory, or its name under --dir."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """A run's config summary, its usage against its forecast (bound, expected figure, projection),
    its per-step metrics as a table (with the RL diagnostics: groups with zero advantage, sampled-token
    entropy, sampler-trainer KL, clipped share, KL to the reference), held-out accuracy ± its
    standard error, a chart of reward and held-out accuracy (or loss) over steps, and any collapse
    warnings the run recorded."""
    path = find_run(run, runs_dir)
    found = run_summary(path)
    meta, cfg = found["meta"], found["config"]
    loop, data, model = cfg.get("loop", {}), cfg.get("data", {}), cfg.get("model", {})
    out.print(
        f"[bold]{path.name}[/bold]  {meta.get('status')}  created {meta.get('created')}", highlight=False
    )
    out.print(
        f"loop {loop.get('name')} ({loop.get('steps')} steps, batch {loop.get('batch_size')}, lr "
        f"{loop.get('learning_rate')}), model {model.get('name')} (LoRA rank {model.get('lora', {}).get('rank')}), "
        f"data {data.get('name')}, seed {cfg.get('seed')}, engine {cfg.get('engine', {}).get('kind')}, "
        f"session {meta.get('session')}",
        highlight=False,
    )
    tokens, cost = _usage_cells(found["usage"])
    if tokens:
        usage = found["usage"]
        out.print(
            f"usage {tokens} tokens (prefill {usage.get('prefill_tokens')}, sampled {usage.get('sampled_tokens')}, "
            f"training {usage.get('training_tokens')}){', cost ' + cost if cost else ''}",
            highlight=False,
        )
    from sess.harness.costs.spend import forecast_lines

    resumed = bool(meta.get("resumes"))
    for line in forecast_lines(
        found["forecast"], found["usage"], found["train"], meta.get("status"), resumed
    ):
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    if meta.get("error"):
        out.print(f"{meta.get('status')}: {meta['error']}", highlight=False, markup=False, soft_wrap=True)
    evals = {r["step"]: r for r in found["eval"]}
    headline = next((k for k in EVAL_KEYS if any(k in r for r in found["eval"])), None)
    columns = [(k, t) for k, t in STEP_COLUMNS if any(k in r for r in found["train"])]
    steps = sorted({r["step"] for r in found["train"]} | set(evals))
    train = {r["step"]: r for r in found["train"]}
    rows = []
    for step in steps:
        row = train.get(step, {})
        cells = [_cell(row.get(k)) for k, _ in columns]
        if headline:
            cells.append(_eval_cell(evals.get(step, {}), headline))
        rows.append((step, *cells))
    header = ("step", *[t for _, t in columns], *([f"eval {headline[5:]}"] if headline else []))
    print_table(header, rows)
    series = {
        "train reward": [(r["step"], r["reward/mean"]) for r in found["train"] if "reward/mean" in r],
        "train loss": []
        if any("reward/mean" in r for r in found["train"])
        else [(r["step"], r["loss"]) for r in found["train"] if "loss" in r],
    }
    if headline:
        series[f"held-out {headline[5:]}"] = [
            (r["step"], r[headline]) for r in found["eval"] if headline in r
        ]
    print(line_chart(series))
    for warning in meta.get("warnings", []):
        out.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)


def _eval_cell(row: dict, key: str) -> str:
    """An eval value, with ``± standard error`` where the run recorded one."""
    if f"{key}_se" not in row:
        return _cell(row.get(key))
    return f"{row[key]:.3f} ± {row[f'{key}_se']:.3f}"


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


@runs_app.command("compare")
def compare(
    first: str = typer.Argument(..., help="A run directory or name."),
    second: str = typer.Argument(..., help="Another one."),
    runs_dir: Path = RUNS_DIR,
) -> None:
    """Two runs side by side: the config keys that differ, then their final metrics."""
    a_path, b_path = find_run(first, runs_dir), find_run(second, runs_dir)
    a, b = run_summary(a_path), run_summary(b_path)
    flat_a, flat_b = _flatten(a["config"]), _flatten(b["config"])
    differ = sorted(
        k for k in flat_a.keys() | flat_b.keys() if flat_a.get(k) != flat_b.get(k) and k != "session"
    )
    rows = [(key, str(flat_a.get(key, "-")), str(flat_b.get(key, "-"))) for key in differ]
    header = ("config", a_path.name, b_path.name)
    print_table(header, rows or [("(same config)", "", "")], title="config differences")
    final = [("status", str(a["meta"].get("status")), str(b["meta"].get("status")))]
    final.append(("steps done", *(str(s["train"][-1]["step"]) if s["train"] else "0" for s in (a, b))))
    keys = [k for k, _ in STEP_COLUMNS if any(k in s["train"][-1] for s in (a, b) if s["train"])]
    for key in keys:
        final.append((key, *(_cell(s["train"][-1].get(key)) if s["train"] else "" for s in (a, b))))
    for key in [k for k in EVAL_KEYS if any(k in r for s in (a, b) for r in s["eval"])]:
        final.append((key, *(_eval_cell(s["eval"][-1], key) if s["eval"] else "" for s in (a, b))))
    usage_a, usage_b = _usage_cells(a["usage"]), _usage_cells(b["usage"])
    if usage_a[0] or usage_b[0]:
        final.append(("total tokens", usage_a[0], usage_b[0]))
    if usage_a[1] or usage_b[1]:
        final.append(("cost", usage_a[1], usage_b[1]))
    print_table(("final", a_path.name, b_path.name), final, title="final metrics")


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        flat: dict[str, object] = {}
        for key, value in node.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): node}
