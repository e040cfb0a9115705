"""An engine process's files and defaults, in one place for the server, its launcher and the CLI."""

from __future__ import annotations

import os

# the files in an engine's home that the client's launcher reads
from sess.engine.protocol.home import ENGINE_FILE, LOG_FILE  # noqa: F401

IDLE_TIMEOUT_S = 600.0  # a session whose client sent no op or heartbeat this long is saved and stopped
# A session whose client heart-beat and then fell silent this long (its process is gone: the tinker
# SDK beats every 10 s, sess's SDK every quarter of this) is saved and stopped, so it stops holding
# its key's session limit long before the idle timeout.
HEARTBEAT_LAPSE_S = float(os.environ.get("SESS_HEARTBEAT_LAPSE_S", 60.0))
MAX_SESSIONS = 8  # live sessions per API key
MAX_QUEUED = 256  # a key's ops queued or running at once; past it a submit gets 429 + Retry-After
MAX_BODY_BYTES = int(os.environ.get("SESS_MAX_BODY_BYTES", 256 << 20))
# HTTP connections (see connections.py): a request head (or a pause in a body) past READ_TIMEOUT_S
# closes the connection; one client address holds at most MAX_CLIENT_CONNECTIONS; a connection
# idle after a response is closed after KEEP_ALIVE_S; past MAX_CONNECTIONS in all, requests get 503.
READ_TIMEOUT_S = float(os.environ.get("SESS_READ_TIMEOUT_S", 30.0))
KEEP_ALIVE_S = float(os.environ.get("SESS_KEEP_ALIVE_S", 120.0))
MAX_CLIENT_CONNECTIONS = int(os.environ.get("SESS_MAX_CLIENT_CONNECTIONS", 1024))
MAX_CONNECTIONS = 4096
MAX_HEAD_BYTES = 16 << 10  # an unfinished request head beyond this is refused (400): h11's default
# engine.log rotates past LOG_MAX_BYTES, keeping LOG_BACKUPS older files (engine.log.1, .2)
LOG_MAX_BYTES = int(os.environ.get("SESS_LOG_MAX_BYTES", 10 << 20))
LOG_BACKUPS = 2
