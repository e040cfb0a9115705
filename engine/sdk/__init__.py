"""The SDK layer: what a client machine needs to drive an engine.

Clients (``ServiceClient`` -> ``TrainingClient`` -> ``SamplingClient``), futures, the in-process
and HTTP transports, the local-engine launcher and the checkpoint admin calls. The wire types,
typed requests and errors they send and read are the protocol's (:mod:`sess.engine.protocol`),
shared with the engine. Nothing here imports torch, transformers or peft at import time, so a
machine that only drives a remote engine installs the client without them.
"""
