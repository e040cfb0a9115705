"""Session lifecycle: ``sess start|list|stop|resume|delete|usage`` (``checkpoints``: :mod:`.checkpoint_cmds`).

Each command talks to the engine through the SDK: the local engine of ``SESS_HOME``, or
``engine=remote engine.url=... engine.api_key=...`` / ``SESS_ENGINE_URL``. Commands that make
something (``start``, ``resume``, ``delete``) start the local engine when none runs; commands that
only read or stop (``list``, ``usage``, ``checkpoints``, ``stop``, ``attach``) never do: with no
engine running they say so and how to start one.
"""

from __future__ import annotations

import difflib
import json
import sys
import time

import typer

from sess.cli.app import app, fail, guard
from sess.cli.output import out, print_table


def _compose(overrides: list[str]):
    """``model=NAME lora.rank=8 seed=1 engine=remote engine.url=...`` -> a run config (model, engine, seed).

    Composed by the same Hydra path as ``sess run`` (``sess.harness.config.compose``), so the model's
    LoRA defaults, the engine options and the key checks are the same. ``lora.X=`` is short for
    ``model.lora.X=``; a model that is no conf option (a local directory) is used as the base model."""
    from sess.harness import config

    composed = []
    for override in overrides:
        key, equals, value = override.partition("=")
        root = key.lstrip("+~").split(".")[0]
        if not equals or root not in ("model", "lora", "engine", "seed"):
            fail(
                f"override {override!r}: sess start takes model=, model.*, lora.* (short for model.lora.*), "
                "engine=, engine.*, seed="
            )
        if root == "lora":
            prefix = key[: len(key) - len(key.lstrip("+~"))]  # Hydra's + (add) and ~ (delete) stay in front
            composed.append(f"{prefix}model.{override[len(prefix) :]}")
        elif key == "model" and value not in config.group_options("model"):
            composed += [f"model.name={value}", f"model.base_model={value}"]
        else:
            composed.append(override)
    return config.compose(composed)  # a ConfigError names the key; main() prints it as one red line


def _client(engine=None):
    from sess.engine import ServiceClient

    if engine is not None and engine.kind == "inprocess":
        fail("engine=inprocess: a session started from the CLI needs an engine that outlives the command")
    if engine is None:
        return guard(ServiceClient)
    return guard(ServiceClient, engine.url, engine.api_key)


def reader(url: str | None = None, api_key: str | None = None):
    """A client for a command that only reads: an engine that already runs, never a new one."""
    import os

    from sess.engine import ServiceClient

    if url or os.environ.get("SESS_ENGINE_URL"):
        return guard(ServiceClient, url, api_key)
    from sess.engine.protocol.home import sess_home
    from sess.engine.sdk.local_engine import engine_info

    if engine_info() is None:
        fail(
            f"no engine is running for {sess_home()} (this command only reads, so it starts none); "
            "start it with `sess engine up --detach`, or point at one with SESS_ENGINE_URL"
        )
    return guard(ServiceClient, None, api_key)


def known_session(svc, name: str):
    """Session ``name``'s summary; an unknown name exits 1 with the nearest names, before anything
    is changed."""
    sessions = guard(svc.list_sessions)
    for summary in sessions:
        if summary.name == name:
            return summary
    names = [s.name for s in sessions]
    nearest = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {' or '.join(nearest)}?" if nearest else ""
    listing = " (sess list shows them)" if names else " (this engine has no sessions of this key)"
    fail(f"no session {name!r}{hint}{listing}")


def _tokens(usage) -> int:
    return usage.prefill_tokens + usage.sampled_tokens + usage.training_tokens


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


@app.command()
def start(
    overrides: list[str] = typer.Argument(
        None,
        help="Overrides as for sess run: model=NAME (or a model directory), lora.rank=N lora.alpha=A "
        "(short for model.lora.*), seed=S (default 0), engine=remote engine.url=URL engine.api_key=KEY.",
    ),
    name: str = typer.Option(None, "--name", help="Session name (default: derived from the model)."),
) -> None:
    """Start a live training session and print its name."""
    cfg = _compose(overrides or [])
    lora = cfg.model.lora
    svc = _client(cfg.engine)
    tc = svc.create_lora_training_client(
        cfg.model.base_model,
        training_session_name=name,
        seed=int(cfg.seed),
        rank=lora.rank,
        alpha=lora.alpha,
        train_attn=lora.train_attn,
        train_mlp=lora.train_mlp,
        train_unembed=lora.train_unembed,
    )
    out.print(
        f"session [bold]{tc.name}[/bold] started on {tc.base_model} (rank {lora.rank})", highlight=False
    )


@app.command("list")
def list_(
    status: str = typer.Option(
        None,
        help="Only sessions with this status: Starting, Running, Stopping, Stopped, Failed or Interrupted.",
    ),
    as_json: bool = typer.Option(False, "--json", help="As JSON: one object per session, usage included."),
) -> None:
    """List sessions: name, model, status, step, tokens used, last active."""
    from sess.engine.protocol.types import SessionStatus

    if status is not None:
        statuses = {s.value.lower(): s.value for s in SessionStatus}
        if status.lower() not in statuses:
            fail(f"--status: expected one of {', '.join(statuses.values())} (any case), got {status!r}")
        status = statuses[status.lower()]
    sessions = guard(reader().list_sessions, status_equals=status)
    if as_json:
        print(
            json.dumps(
                [s.__dict__ | {"status": s.status.value, "usage": s.usage.to_wire()} for s in sessions]
            )
        )
        return
    rows = [
        (s.name, s.base_model, s.status.value, s.step, _tokens(s.usage), _when(s.last_active))
        for s in sessions
    ]
    print_table(("name", "model", "status", "step", "tokens", "last active"), rows)


@app.command()
def stop(name: str) -> None:
    """Stop a session and free its memory; its checkpoints stay.

    If it trained since its last save_state, the engine saves its state first
    (sess://NAME/state/stop-step...), so sess resume NAME continues it from the step it stopped at."""
    svc = reader()
    known_session(svc, name)
    summary = guard(svc.stop_session, name)
    out.print(
        f"session {summary.name} is {summary.status.value} at step {summary.step} (sess resume {name} continues it)",
        highlight=False,
    )


@app.command()
def delete(
    name: str,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a session and all its checkpoints, files included (a running one is stopped first).

    Download what you want to keep first: sess checkpoints NAME lists the paths."""
    if not yes and not sys.stdin.isatty():  # no one to answer: refuse now, not after the question
        fail(
            f"sess delete asks before deleting and stdin is not a terminal; "
            f"to delete {name} without asking: --yes"
        )
    svc = _client()
    known_session(svc, name)
    found = guard(svc.list_checkpoints, name)
    if not yes and not typer.confirm(f"delete session {name} and its {len(found)} checkpoint(s)?"):
        fail("nothing deleted")
    guard(svc.delete_session, name, stop_if_active=True)
    out.print(f"session {name} deleted with {len(found)} checkpoint(s)", highlight=False)


@app.command()
def resume(
    name: str,
    checkpoint: str = typer.Option(
        None, "--checkpoint", help="A sess:// state checkpoint (default: the last one)."
    ),
    new_name: str = typer.Option(
        None, "--name", help="Continue in a new session of this name instead (NAME stays as it is)."
    ),
) -> None:
    """Continue stopped session NAME from one of its state checkpoints, optimizer included, under
    the same name: its checkpoints and usage carry on, and the engine's registry records the resume.

    --checkpoint must be NAME's own; to branch from another session's checkpoint, name that session."""
    if checkpoint is not None:
        from sess.engine.protocol.checkpoint_paths import parse_path

        owner = guard(parse_path, checkpoint, field="--checkpoint").session
        if owner != name:  # a typo'd NAME or path would otherwise resume the wrong session silently
            fail(
                f"--checkpoint {checkpoint} is a checkpoint of session {owner!r}, not of {name!r}; "
                f"to continue {owner} from it: sess resume {owner} --checkpoint {checkpoint}"
            )
    svc = _client()
    before = known_session(svc, name)
    if before.status.value == "Running" and new_name is None:
        fail(
            f"session {name!r} is running: nothing to resume; attach to it (sess attach {name}), or "
            f"continue its last state in a new session (sess resume {name} --name NEW)"
        )
    if checkpoint is None:
        states = [c for c in guard(svc.list_checkpoints, name) if c["kind"] == "state"]
        if not states:
            fail(f"session {name!r} has no state checkpoint to resume from (save_state() saves one)")
        checkpoint = states[-1]["path"]
    tc = guard(
        svc.create_training_client_from_state_with_optimizer,
        checkpoint,
        training_session_name=new_name or name,
    )
    step = known_session(svc, tc.name).step
    was = "" if new_name else f" (it was {before.status.value} at step {before.step})"
    out.print(
        f"session [bold]{tc.name}[/bold] resumed from {checkpoint} at step {step}{was}", highlight=False
    )


@app.command()
def usage(
    name: str = typer.Argument(None, help="A session (default: all of this key's sessions)."),
    as_json: bool = typer.Option(False, "--json", help="The same report as JSON."),
    by: str = typer.Option(
        "operation",
        "--by",
        help="Rows per operation, session or key (key: every key, with the home's own key).",
    ),
) -> None:
    """What sessions cost, per operation (or per session or key), with the total under it (the sum
    of the rows).

    Columns: count, how many ops of that kind ran (failed ones too); prefill, prompt tokens read
    (sample, compute_logprobs); cached, the part of those a prefix cache served (billed at the
    cached_prefill price); sampled, tokens generated; training, tokens through forward and
    forward_backward; wall s, the engine's own seconds on those ops; cost, in the currency of the
    engine's price table (sess engine up --prices), shown only when it has one. A sample request's
    seconds are its share of each prefill and decode step it was part of, not the time it waited,
    so concurrent requests do not count the same second twice. Billing: forward_backward's tokens
    are trained, forward's and compute_logprobs' prefilled, a sample's prompt prefilled once and its
    new tokens sampled."""
    if by not in ("operation", "session", "key"):
        fail(f"--by: expected operation, session or key, got {by!r}")
    svc = reader()
    transport = svc.transport
    if hasattr(transport, "usage"):
        report = guard(transport.usage, name, by)
    else:
        report = {"session": name, "usage": svc.get_usage(name).to_wire(), "operations": {}, "rows": {}}
    if as_json:
        print(json.dumps(report))
        return
    rows = report.get("rows", report["operations"])
    priced = report.get("currency") is not None
    keys = ("prefill_tokens", "cached_prefill_tokens", "sampled_tokens", "training_tokens")
    table = [
        (
            name,
            row["count"],
            *(row.get(k) or 0 for k in keys),
            f"{row['wall_time_s']:.2f}",
            *([row["cost"]] if priced else []),
        )
        for name, row in sorted(rows.items())
    ]
    total = report["usage"]
    table.append(
        ("total", total["operations"], *(total.get(k) or 0 for k in keys), f"{total['wall_time_s']:.2f}")
        + ((total["cost"],) if priced else ())
    )
    headers = (by, "count", "prefill", "cached", "sampled", "training", "wall s")
    print_table(headers + ((f"cost ({report['currency']})",) if priced else ()), table, bold_last=True)
