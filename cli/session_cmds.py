"""Session lifecycle: ``sess start|list|stop|resume|delete|usage|checkpoints``.

Each command talks to the engine through the SDK: the local engine of ``SESS_HOME`` (started if
needed), or ``engine=remote engine.url=... engine.api_key=...`` / ``SESS_ENGINE_URL``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from sess.cli.main import app, fail

out = Console()
CONF = Path(__file__).resolve().parent.parent / "conf"


def _compose(overrides: list[str]) -> dict:
    """``model=NAME lora.rank=8 seed=1 engine=remote engine.url=...`` -> a session config."""
    from omegaconf import OmegaConf

    groups = {
        k: v for k, v in (o.split("=", 1) for o in overrides if "=" in o and "." not in o.split("=")[0])
    }
    bad = [o for o in overrides if "=" not in o]
    if bad:
        fail(f"override {bad[0]!r}: expected key=value (e.g. model=tiny-llama lora.rank=8)")
    model_name = groups.pop("model", "smollm2-135m")
    engine_name = groups.pop("engine", "local")
    model_file, engine_file = CONF / "model" / f"{model_name}.yaml", CONF / "engine" / f"{engine_name}.yaml"
    model = (
        OmegaConf.load(model_file) if model_file.exists() else OmegaConf.create({"base_model": model_name})
    )
    engine = (
        OmegaConf.load(engine_file) if engine_file.exists() else fail(f"engine={engine_name}: unknown engine")
    )
    config = OmegaConf.create({"model": model, "lora": model.get("lora", {}), "engine": engine, "seed": None})
    dotted = [o for o in overrides if "." in o.split("=")[0] or o.split("=")[0] == "seed"]
    try:
        config = OmegaConf.merge(config, OmegaConf.from_dotlist(dotted))
    except Exception as exc:
        fail(f"overrides: {exc}")
    unknown = set(groups) - {"seed"}
    if unknown:
        fail(f"override {sorted(unknown)[0]!r}: unknown key (use model=, engine=, lora.*, seed=)")
    return OmegaConf.to_container(config, resolve=True)


def _client(engine: dict | None = None):
    from sess.engine import ServiceClient

    engine = engine or {}
    if engine.get("kind") == "inprocess":
        fail("engine=inprocess: a session started from the CLI needs an engine that outlives the command")
    return ServiceClient(engine.get("url"), engine.get("api_key"))


def _tokens(usage) -> int:
    return usage.prefill_tokens + usage.sampled_tokens + usage.training_tokens


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


@app.command()
def start(
    overrides: list[str] = typer.Argument(None, help="model=NAME lora.rank=N lora.alpha=A seed=S engine=..."),
    name: str = typer.Option(None, "--name", help="Session name (default: derived from the model)."),
) -> None:
    """Start a live training session and print its name."""
    config = _compose(overrides or [])
    lora = {
        k: v
        for k, v in config["lora"].items()
        if k in ("rank", "alpha", "train_mlp", "train_attn", "train_unembed")
    }
    svc = _client(config["engine"])
    tc = svc.create_lora_training_client(
        config["model"]["base_model"], training_session_name=name, seed=config["seed"], **lora
    )
    out.print(f"session [bold]{tc.name}[/bold] started on {tc.base_model} (rank {lora.get('rank')})")


@app.command("list")
def list_(
    status: str = typer.Option(None, help="Only sessions with this status."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """List sessions: name, model, status, step, tokens used, last active."""
    sessions = _client().list_sessions(status_equals=status)
    if as_json:
        print(
            json.dumps(
                [s.__dict__ | {"status": s.status.value, "usage": s.usage.to_wire()} for s in sessions]
            )
        )
        return
    table = Table("name", "model", "status", "step", "tokens", "last active")
    for s in sessions:
        table.add_row(
            s.name, s.base_model, s.status.value, str(s.step), str(_tokens(s.usage)), _when(s.last_active)
        )
    out.print(table)


@app.command()
def stop(name: str) -> None:
    """Stop a session (its checkpoints stay)."""
    summary = _client().stop_session(name)
    out.print(f"session {summary.name} is {summary.status.value}")


@app.command()
def delete(
    name: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a session and all its checkpoints, files included (a running one is stopped first).

    Download what you want to keep first: sess checkpoints NAME lists the paths."""
    svc = _client()
    found = svc.list_checkpoints(name)  # also: an unknown session fails here, before the question
    if not yes and not typer.confirm(f"delete session {name} and its {len(found)} checkpoint(s)?"):
        fail("nothing deleted")
    svc.delete_session(name, stop_if_active=True)
    out.print(f"session {name} deleted with {len(found)} checkpoint(s)")


@app.command()
def resume(
    name: str,
    checkpoint: str = typer.Option(
        None, "--checkpoint", help="A sess:// state checkpoint (default: the last one)."
    ),
    new_name: str = typer.Option(None, "--name", help="Name of the new session."),
) -> None:
    """Continue a session in a new one from a state checkpoint, optimizer included."""
    svc = _client()
    if checkpoint is None:
        states = [c for c in svc.list_checkpoints(name) if c["kind"] == "state"]
        if not states:
            fail(f"session {name!r} has no state checkpoint to resume from (save_state() saves one)")
        checkpoint = states[-1]["path"]
    tc = svc.create_training_client_from_state_with_optimizer(checkpoint, training_session_name=new_name)
    step = svc.list_sessions(name_contains=tc.name)[0].step
    out.print(f"session [bold]{tc.name}[/bold] resumed from {checkpoint} at step {step}")


@app.command()
def usage(
    name: str = typer.Argument(None, help="A session (default: all of this key's sessions)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Tokens (prefill, sampled, training) and wall time, per session and per operation."""
    svc = _client()
    transport = svc.transport
    if hasattr(transport, "usage"):
        report = transport.usage(name)
    else:
        report = {"session": name, "usage": svc.get_usage(name).to_wire(), "operations": {}}
    if as_json:
        print(json.dumps(report))
        return
    table = Table("operation", "count", "prefill", "sampled", "training", "wall s")
    for op, row in sorted(report["operations"].items()):
        table.add_row(
            op,
            str(row["count"]),
            str(row["prefill_tokens"]),
            str(row["sampled_tokens"]),
            str(row["training_tokens"]),
            f"{row['wall_time_s']:.2f}",
        )
    total = report["usage"]
    table.add_row(
        "total",
        str(total["operations"]),
        str(total["prefill_tokens"]),
        str(total["sampled_tokens"]),
        str(total["training_tokens"]),
        f"{total['wall_time_s']:.2f}",
        style="bold",
    )
    out.print(table)


@app.command()
def checkpoints(name: str) -> None:
    """List a session's checkpoints, with their size on disk."""
    found = _client().list_checkpoints(name)
    table = Table("path", "kind", "created", "MB")
    for c in found:
        table.add_row(c["path"], c["kind"], _when(c["created"]), f"{c['bytes'] / 1e6:.1f}")
    table.add_row("total", "", "", f"{sum(c['bytes'] for c in found) / 1e6:.1f}", style="bold")
    out.print(table)
