"""sess engine and SDK: the clients a loop uses, the types it builds, and the engine they drive.

Everything in the SDK contract (API.md) is importable from here::

    from sess.engine import ServiceClient, SamplingParams, AdamParams, Datum, ModelInput
"""

from .client import SamplingClient, ServiceClient, TrainingClient
from .futures import APIFuture
from .types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    InvalidRequest,
    LoadStateResponse,
    LossFunction,
    ModelInput,
    NotFound,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    SaveWeightsResponse,
    SessError,
    SessionStatus,
    TensorData,
    TrainingSessionSummary,
    Usage,
)

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
