"""The SDK layer: what a client machine needs to drive an engine.

Clients (``ServiceClient`` -> ``TrainingClient`` -> ``SamplingClient``), futures, the in-process
and HTTP transports and the wire types. Nothing here imports torch, transformers or peft at import
time, so a machine that only drives a remote engine installs the client without them.
"""
