"""``sess``: the command line. Each command module registers its commands on :data:`~.app.app`;
this module imports them all, and :func:`main` runs the app with errors as one red line."""

from __future__ import annotations

import os
import sys

# isort: off  (the commands register in this order, the order `sess --help` lists them in)
from sess.cli import attach_cmd, engine_cmds, run_cmds, runs_cmds, session_cmds  # noqa: F401, E402
from sess.cli.app import app, report

# isort: on


def main() -> None:
    try:
        app()
    except Exception as exc:  # one line for users; --debug for the traceback
        if os.environ.get("SESS_DEBUG"):
            raise
        report(str(exc) or type(exc).__name__)
        sys.exit(1)
