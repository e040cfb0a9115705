"""The engine's log: ``engine.log`` in its home, rotated past ``LOG_MAX_BYTES``.

A background engine (``sess engine up --detach``, or one the SDK starts) has its stdout and stderr
sent to ``engine.log`` by its launcher. Its log records then go through a
:class:`logging.handlers.RotatingFileHandler` on that file, which at ``LOG_MAX_BYTES`` renames it to
``engine.log.1`` (keeping ``LOG_BACKUPS`` old files) and points stdout and stderr at the new file
too, so nothing the process writes grows a file past the limit by more than a line. uvicorn's own
loggers go through the same handler. An engine in the foreground logs to its terminal.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

from sess.engine.server.settings import LOG_BACKUPS, LOG_FILE, LOG_MAX_BYTES

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class EngineLogHandler(logging.handlers.RotatingFileHandler):
    """A rotating ``engine.log`` whose rollover also moves this process's stdout and stderr."""

    def doRollover(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        super().doRollover()
        if self.stream is not None:
            os.dup2(self.stream.fileno(), 1)
            os.dup2(self.stream.fileno(), 2)


def _is_stdout(path: Path) -> bool:
    """Whether this process's stdout is ``path`` (its launcher sent its output there)."""
    try:
        out, file = os.fstat(1), path.stat()
    except OSError:
        return False
    return (out.st_dev, out.st_ino) == (file.st_dev, file.st_ino)


def configure(home: Path, max_bytes: int = LOG_MAX_BYTES) -> logging.Handler:
    """Log warnings and errors to the home's rotating ``engine.log`` (or stderr in the foreground)."""
    path = Path(home) / LOG_FILE
    if _is_stdout(path):
        handler: logging.Handler = EngineLogHandler(path, maxBytes=max_bytes, backupCount=LOG_BACKUPS)
    else:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    return handler
