"""The server layer: the engine as an HTTP service.

The FastAPI app (:mod:`.http_app`: sess routes, with :mod:`.openai` and the Tinker
protocol in :mod:`.tinker`), API keys, the SQLite registry (:mod:`.sqlite_registry`), billing, the
managed engine (registry records, limits, idle stops) and the launcher that finds, starts and stops
the local engine process. Run it with ``sess engine up`` or ``python -m sess.engine.server``.
"""
