"""The engine process's memory: malloc settings that keep freed pages for the next step and hand
them back when idle (:mod:`.malloc_tuning`), and each training op's memory budget: micro-batch
sizes, activation checkpointing and refusals (:mod:`.training_budget`)."""
