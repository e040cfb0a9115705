"""``sess``: the command line. Each command module registers its commands on :data:`~.app.app`;
this module imports them all, and :func:`main` runs the app with errors as one red line."""

from __future__ import annotations

import os
import sys

from sess.cli.app import app, report, unwrap_help

# The command modules register on ``app`` at import, in the order `sess --help` lists them.
# isort: off
from sess.cli import engine_cmds  # noqa: F401
from sess.cli import keys_cmds  # noqa: F401
from sess.cli import models_cmds  # noqa: F401
from sess.cli import session_cmds  # noqa: F401
from sess.cli import checkpoint_cmds  # noqa: F401
from sess.cli import run_cmds  # noqa: F401
from sess.cli import runs_cmds  # noqa: F401
from sess.cli import runs_seeds  # noqa: F401
from sess.cli import attach_cmd  # noqa: F401
# isort: on

unwrap_help(app)  # docstrings are hard-wrapped: `--help` shows them as paragraphs


def main() -> None:
    try:
        app()
    except Exception as exc:  # one line for users; --debug for the traceback
        if os.environ.get("SESS_DEBUG"):
            raise
        report(str(exc) or type(exc).__name__)
        sys.exit(1)
