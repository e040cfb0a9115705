"""An engine process's files and defaults, in one place for the server, its launcher and the CLI."""

from __future__ import annotations

import os

# the files and start timeout the client's launcher shares with the server
from sess.engine.sdk.local_engine import ENGINE_FILE, LOG_FILE, START_TIMEOUT_S  # noqa: F401

IDLE_TIMEOUT_S = 600.0  # a session whose client sent no op or heartbeat this long is saved and stopped
MAX_SESSIONS = 8  # live sessions per API key
MAX_QUEUED = 256  # a key's ops queued or running at once; past it a submit gets 429 + Retry-After
MAX_BODY_BYTES = int(os.environ.get("SESS_MAX_BODY_BYTES", 256 << 20))
