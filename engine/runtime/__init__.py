"""The runtime layer: the executor thread and everything it runs on torch.

Here: the runtime's state (:mod:`.runtime`), the executor (:mod:`.executor`) with its fair ready
queue (:mod:`.fair_queue`) and each session's sequence order (:mod:`.sequence_order`), a training
session (:mod:`.session`), the two modes the runtime starts with (where work runs,
:mod:`.placement`: this process or several ranks; who samples, :mod:`.samplers`: the built-in
decode batch or vLLM), the in-process transport (:mod:`.inprocess`), what an op costs
(:mod:`.usage`), and the training forwards: batched forwards, chunked output-layer logprobs,
activation recompute, the loss table, sample scores. In rooms: :mod:`.ops` (the op table and the
handlers), :mod:`.models` (catalog and model host), :mod:`.checkpoints`, :mod:`.memory`,
:mod:`.distributed` (several ranks: a placement) and :mod:`.vllm` (vLLM: a sampler), which import
the ops, never the other way round.
"""
