"""The server layer: the engine as an HTTP service.

The FastAPI app (sess routes and OpenAI-compatible routes), API keys, the SQLite registry, the
managed engine (registry records, limits, idle stops) and the launcher that finds, starts and stops
the local engine process. Run it with ``sess engine up`` or ``python -m sess.engine.server``.
"""
