"""vLLM as the engine's sampler: the engine side (:mod:`.sampler`) and the worker script it starts
in vLLM's own environment (:mod:`.worker`, which imports nothing of sess)."""
