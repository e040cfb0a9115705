"""Checkpoints and operations: ``sess checkpoints SESSION`` (with expiry, metadata and who may read
each), ``sess checkpoints publish|unpublish|ttl|copy PATH``, ``sess trace SESSION -o FILE`` and
``sess engine audit``.

They read and change the engine's registry through the SDK (:mod:`sess.engine.sdk.checkpoint_admin`),
so they need a running engine and never start one.
"""

from __future__ import annotations

import json
import time

import typer

from sess.cli.app import app, fail, guard
from sess.cli.engine_cmds import engine_app
from sess.cli.output import out, print_table
from sess.cli.session_cmds import known_session, reader

ACTIONS = ("publish", "unpublish", "ttl", "copy")


def _when(timestamp: float | None, never: str = "never") -> str:
    return never if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _ttl(text: str | None) -> int | None:
    """``--ttl``: seconds, or ``none`` for no expiry."""
    if text is None or text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        fail(f"--ttl: expected seconds (an integer) or none, got {text!r}")


@app.command()
def checkpoints(
    name: str = typer.Argument(..., help="A session; or publish, unpublish, ttl, copy (then PATH)."),
    path: str = typer.Argument(None, help="The sess:// checkpoint an action works on."),
    ttl: str = typer.Option(None, "--ttl", help="ttl, copy: seconds until it expires, or none."),
    as_json: bool = typer.Option(False, "--json", help="As JSON."),
) -> None:
    """List a session's checkpoints (size, expiry, metadata, public), or change one.

    sess checkpoints publish PATH lets every key on the engine read it (sample, load, download);
    unpublish makes it yours alone again; ttl PATH --ttl SECONDS|none sets or clears its expiry;
    copy PATH [--ttl SECONDS] copies a checkpoint you can read into a new session of yours."""
    svc = reader()
    if name in ACTIONS:
        if path is None:
            fail(f"sess checkpoints {name} PATH: give the sess:// path of a checkpoint")
        if name == "ttl" and ttl is None:
            fail("sess checkpoints ttl PATH --ttl SECONDS|none: give --ttl")
        if name == "copy":
            copied = guard(svc.copy_checkpoint, path, ttl_seconds=_ttl(ttl))
            out.print(f"copied {path} to {copied}", highlight=False)
            return
        change = {
            "publish": lambda: svc.publish_checkpoint(path),
            "unpublish": lambda: svc.unpublish_checkpoint(path),
            "ttl": lambda: svc.set_checkpoint_ttl(path, _ttl(ttl)),
        }[name]
        row = guard(change)
        state = "published (every key may read it)" if row["public"] else "private"
        out.print(f"{row['path']}: {state}, expires {_when(row['expires_at'])}", highlight=False)
        return
    known_session(svc, name)
    found = guard(svc.list_checkpoints, name)
    if as_json:
        print(json.dumps(found))
        return
    rows = [
        (
            c["path"],
            c["kind"],
            _when(c["created"]),
            f"{c['bytes'] / 1e6:.1f}",
            _when(c.get("expires_at")),
            "yes" if c.get("public") else "no",
            ", ".join(f"{k}={v}" for k, v in (c.get("user_metadata") or {}).items()),
        )
        for c in found
    ]
    rows.append(("total", "", "", f"{sum(c['bytes'] for c in found) / 1e6:.1f}", "", "", ""))
    print_table(("path", "kind", "created", "MB", "expires", "public", "metadata"), rows, bold_last=True)


@app.command()
def trace(
    session: str,
    output: str = typer.Option(..., "-o", "--output", help="Where to write the trace (JSON)."),
) -> None:
    """Write a session's ops as a trace that https://ui.perfetto.dev opens: one slice per op, from
    its submit to its end, with its queue wait, run time and tokens."""
    svc = reader()
    found = guard(svc.export_trace, session, output)
    slices = sum(1 for e in found["traceEvents"] if e.get("ph") == "X")
    out.print(
        f"wrote {slices} ops of {session} to {output} (open it in https://ui.perfetto.dev)", highlight=False
    )


@engine_app.command("audit")
def audit(
    hours: float = typer.Option(24.0, "--hours", help="How far back, in hours."),
    as_json: bool = typer.Option(False, "--json", help="As JSON."),
) -> None:
    """The engine's audit log: who created, deleted, resumed, published a session or checkpoint,
    changed a key or its budget, and when (every key's for the engine's own key)."""
    svc = reader()
    entries = guard(svc.audit_log, time.time() - hours * 3600)
    if as_json:
        print(json.dumps(entries))
        return
    rows = [
        (
            _when(e["time"]),
            e["owner"] or "",
            e["event"],
            ", ".join(f"{k}={v}" for k, v in e["details"].items()),
        )
        for e in entries
    ]
    print_table(("time", "who", "event", "details"), rows)
