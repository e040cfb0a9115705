"""Base models: the catalog of names and how each loads (:mod:`.catalog`), tiny random models of
real architectures for tests (:mod:`.tiny_models`), and the host that keeps one base model in memory
with many LoRA adapters on it (:mod:`.model_host`)."""
