"""sess engine and SDK: the clients a loop uses, the types it builds, and the engine they drive.

Everything in the SDK contract (API.md) is importable from here::

    from sess.engine import ServiceClient, SamplingParams, AdamParams, Datum, ModelInput

The package is layered, each layer a subpackage that imports only the ones below it:

- ``sdk/``: what a client machine needs (clients, futures, transports, the local-engine launcher);
  importing it, and this package, loads no torch, transformers or peft;
- ``server/``: the engine as an HTTP service (routes, keys, registry);
- ``runtime/``: the executor thread and the ops it runs on torch (sessions, training, checkpoints,
  the model catalog and the host of one base model with its adapters);
- ``sampling/``: the continuous decode batch and the decoders that do a step's arithmetic;
- ``protocol/``: what both sides of the wire agree on (wire types, typed requests, errors, checks,
  checkpoint paths, the loss and call tables, prices, the engine home's layout), below the SDK and
  the engine alike; it loads no torch either.
- ``native/`` and ``libraries/``, under both: the C kernels and their build, and the torch and
  transformers internals the engine uses, one function each with the versions it was checked on.
"""

from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.protocol.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoadStateResponse,
    LossFunction,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    SaveWeightsResponse,
    SessionStatus,
    TensorData,
    TrainingSessionSummary,
    Usage,
)
from sess.engine.sdk.futures import APIFuture
from sess.engine.sdk.sampling_client import SamplingClient
from sess.engine.sdk.service_client import ServiceClient
from sess.engine.sdk.training_client import TrainingClient

__all__ = [
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "InvalidRequest",
    "LoadStateResponse",
    "LossFunction",
    "ModelInput",
    "NotFound",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SaveStateResponse",
    "SaveWeightsResponse",
    "ServiceClient",
    "SessError",
    "SessionStatus",
    "TensorData",
    "TrainingClient",
    "TrainingSessionSummary",
    "Usage",
]
