"""``python -m sess.engine.server``: run an engine server in this process.

It first re-executes itself under the engine's process environment (malloc settings that keep freed
memory for the next step, oneDNN cache caps: :mod:`sess.engine.runtime.memory.malloc_tuning`), since glibc reads
them only at start; a process started with them in effect goes straight on.
"""

import sys

from sess.engine.runtime.memory.malloc_tuning import exec_as_engine
from sess.engine.server.serve import main

_args = sys.argv[1:]
_device = _args[_args.index("--device") + 1] if "--device" in _args[:-1] else "cpu"
try:
    exec_as_engine([sys.executable, "-m", "sess.engine.server", *_args], device=_device)
except ValueError as exc:  # SESS_MALLOC names a malloc this machine lacks: one line, as serve's refusals
    raise SystemExit(f"sess engine: {exc}") from None
main()
