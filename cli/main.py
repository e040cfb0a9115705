"""The ``sess`` command: one Typer app; each command group lives in its own module.

Errors a user can act on print as one red line; ``--debug`` (or ``SESS_DEBUG=1``) shows the traceback.
"""

from __future__ import annotations

import os
import sys

import typer
from rich.console import Console

app = typer.Typer(
    name="sess",
    help="Write LLM post-training loops in plain Python; run the heavy work in live sessions on an engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    if debug:
        os.environ["SESS_DEBUG"] = "1"


def fail(message: str, code: int = 1) -> None:
    """Print one red line and exit."""
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _register() -> None:
    # Command modules register themselves on ``app`` at import.
    import importlib

    for module in ("sess.cli.engine_cmds", "sess.cli.session_cmds", "sess.cli.run_cmds"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


def main() -> None:
    try:
        app()
    except Exception as exc:  # one line for users; --debug for the traceback
        if os.environ.get("SESS_DEBUG"):
            raise
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(1)


_register()
