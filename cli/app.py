"""The ``sess`` command: one Typer app; each command group lives in its own module.

An error a user can act on prints as one red line (and, where the fix is a list, the list under it);
``--debug`` (or ``SESS_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console
from rich.text import Text

app = typer.Typer(
    name="sess",
    help="Write LLM post-training loops in plain Python; run the heavy work in live sessions on an engine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
err = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    if debug:
        os.environ["SESS_DEBUG"] = "1"


def report(message: str) -> None:
    """``error: <first line>`` in red, unwrapped whatever the terminal's width; further lines (a list
    of options, say) under it as they are."""
    first, _, rest = str(message).strip().partition("\n")
    err.print(Text.assemble(("error:", "red"), " ", " ".join(first.split())))
    if rest:
        err.print(Text(rest))


def fail(message: str, code: int = 1) -> None:
    """Report ``message`` and exit."""
    report(message)
    raise typer.Exit(code)


def guard(fn: Callable[..., T], *args, **kwargs) -> T:
    """Run ``fn``; an error becomes :func:`report`'s lines (``--debug`` shows the traceback)."""
    try:
        return fn(*args, **kwargs)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except Exception as exc:
        if os.environ.get("SESS_DEBUG"):
            raise
        fail(str(exc) or type(exc).__name__)


def as_paragraphs(text: str | None) -> str | None:
    """A hard-wrapped docstring as paragraphs: the single line breaks inside a paragraph become
    spaces, so Typer wraps each paragraph to the terminal's width; a line that starts a list item
    (``- ``) or is indented keeps its own line."""
    if not isinstance(text, str):
        return text
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            if lines and not re.match(r"\s|[-*] |\d+\. ", line):
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def unwrap_help(typer_app: typer.Typer) -> None:
    """Give every command and group of ``typer_app`` its help as paragraphs (:func:`as_paragraphs`);
    Typer would otherwise keep a docstring's line breaks and break sentences mid-line."""
    for info in typer_app.registered_commands:
        info.help = as_paragraphs(info.help if isinstance(info.help, str) else inspect.getdoc(info.callback))
    for info in [typer_app.info, typer_app.registered_callback]:
        if info is not None and isinstance(info.help, str):
            info.help = as_paragraphs(info.help)
        elif info is not None and info.callback is not None:  # Typer falls back to it last
            info.callback.__doc__ = as_paragraphs(inspect.getdoc(info.callback))
    for group in typer_app.registered_groups:
        group.help = as_paragraphs(group.help)
        unwrap_help(group.typer_instance)
