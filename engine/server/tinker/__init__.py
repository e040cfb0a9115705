"""The Tinker protocol: a second front end of the engine, for the unmodified ``tinker`` SDK and
tinker-cookbook. Routes under ``/api/v1`` (:mod:`.routes`) map Tinker sessions, models, sampling
sessions, futures and ``tinker://`` paths onto sess sessions, ops and ``sess://`` paths, and run
them on the same executor as sess's own routes; nothing here touches torch."""
