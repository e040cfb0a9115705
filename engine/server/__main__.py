"""``python -m sess.engine.server``: run an engine server in this process."""

from sess.engine.server.serve import main

main()
