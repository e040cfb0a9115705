"""An engine process's files and defaults, in one place for the server, its launcher and the CLI."""

from __future__ import annotations

import os

ENGINE_FILE = "engine.json"  # written by a running engine into its home: url, pid, port
LOG_FILE = "engine.log"  # a background engine's output, in its home
START_TIMEOUT_S = float(os.environ.get("SESS_ENGINE_START_TIMEOUT_S", 120.0))
IDLE_TIMEOUT_S = 600.0  # a session whose client sent no op or heartbeat this long is saved and stopped
MAX_SESSIONS = 8  # live sessions per API key
MAX_QUEUED = 256  # a key's ops queued or running at once; past it a submit gets 429 + Retry-After
MAX_BODY_BYTES = int(os.environ.get("SESS_MAX_BODY_BYTES", 256 << 20))
