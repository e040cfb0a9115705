"""Wire and SDK types: what a loop builds and what the engine answers.

Plain dataclasses with ``to_wire``/``from_wire`` so every type crosses the in-process and HTTP
transports as JSON-able data (no pickle). Number arrays travel as base64 of little-endian bytes,
which keeps a batch of token ids or logprobs compact on the wire.
"""

from __future__ import annotations

import base64
import enum
import math
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, ClassVar

import numpy as np

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.loss_registry import LOSSES
from sess.engine.protocol.sample_types import SampledSequence, SampleResponse  # noqa: F401 (re-exported)
from sess.engine.protocol.wire_checks import bounded, check_fields, check_instance

_DTYPES = {"float32": np.float32, "int64": np.int64}


class SessionStatus(str, enum.Enum):
    Starting = "Starting"
    Running = "Running"
    Stopping = "Stopping"
    Stopped = "Stopped"
    Failed = "Failed"
    Interrupted = "Interrupted"


# the built-in losses, one member per row of the loss registry (LossFunction.ppo == "ppo")
LossFunction = enum.Enum("LossFunction", [(name, name) for name in LOSSES], type=str, module=__name__)


@dataclass
class EncodedTextChunk:
    tokens: list[int]
    type: str = "encoded_text"

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ModelInput:
    chunks: list[EncodedTextChunk] = field(default_factory=list)

    @classmethod
    def from_ints(cls, tokens) -> ModelInput:
        return cls(chunks=[EncodedTextChunk(tokens=[int(t) for t in tokens])])

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(chunks=[])

    def append_int(self, token: int) -> ModelInput:
        return ModelInput.from_ints([*self.to_ints(), int(token)])

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def to_wire(self) -> dict:
        return {"tokens": encode_array(np.asarray(self.to_ints(), dtype=np.int64))}

    @classmethod
    def from_wire(cls, wire: dict) -> ModelInput:
        return cls.from_ints(decode_array(wire["tokens"]).tolist())


@dataclass
class TensorData:
    data: list | np.ndarray
    dtype: str = "float32"
    shape: list[int] | None = None

    def __post_init__(self):
        if self.dtype not in _DTYPES:
            raise InvalidRequest(f"TensorData.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> TensorData:
        array = np.asarray(array)
        dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
        return cls(data=array.astype(_DTYPES[dtype]), dtype=dtype, shape=list(array.shape))

    @classmethod
    def from_torch(cls, tensor) -> TensorData:
        return cls.from_numpy(tensor.detach().cpu().numpy())

    def to_numpy(self) -> np.ndarray:
        array = np.asarray(self.data, dtype=_DTYPES[self.dtype])
        return array.reshape(self.shape) if self.shape is not None else array

    def to_torch(self):
        import torch

        return torch.from_numpy(self.to_numpy().copy())

    def tolist(self) -> list:
        return self.to_numpy().tolist()

    def to_wire(self) -> dict:
        array = self.to_numpy()
        return {"dtype": self.dtype, "shape": list(array.shape), "data": encode_array(array)}

    @classmethod
    def from_wire(cls, wire: dict, name: str = "TensorData") -> TensorData:
        array = decode_array(wire["data"], wire["dtype"])
        shape = wire["shape"]
        # numpy would read any negative size as "the rest", so [-5] would pass for 5 values
        if (
            not isinstance(shape, list)
            or not all(type(size) is int and size >= 0 for size in shape)
            or math.prod(shape) != array.size
        ):
            raise InvalidRequest(
                f"{name}.shape: {str(shape)[:80]} does not hold the {array.size} values sent "
                "(sizes are integers from 0 whose product is the number of values)"
            )
        return cls(data=array.reshape(shape), dtype=wire["dtype"], shape=shape)


def as_tensor_data(value: Any, key: str = "value") -> TensorData:
    """Accept TensorData, numpy, torch, or nested lists (ints -> int64, otherwise float32)."""
    if isinstance(value, TensorData):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        return TensorData.from_torch(value)
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"{key}: cannot be read as an array ({exc})") from None
    if array.dtype == object or not (
        np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.bool_)
    ):
        raise InvalidRequest(f"{key}: expected numbers, got {array.dtype}")
    return TensorData.from_numpy(array)


def encode_array(array: np.ndarray) -> str:
    dtype = "int64" if np.issubdtype(array.dtype, np.integer) else "float32"
    return base64.b64encode(
        np.ascontiguousarray(array, dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<")).tobytes()
    ).decode()


def decode_array(text: str, dtype: str = "int64") -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<")).astype(
        _DTYPES[dtype]
    )


@dataclass
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.model_input, list | tuple):
            self.model_input = ModelInput.from_ints(self.model_input)
        self.loss_fn_inputs = {k: as_tensor_data(v, k) for k, v in self.loss_fn_inputs.items()}

    def to_wire(self) -> dict:
        return {
            "model_input": self.model_input.to_wire(),
            "loss_fn_inputs": {k: v.to_wire() for k, v in self.loss_fn_inputs.items()},
        }

    @classmethod
    def from_wire(cls, wire: dict) -> Datum:
        return cls(
            model_input=ModelInput.from_wire(wire["model_input"]),
            loss_fn_inputs={
                k: TensorData.from_wire(v, f"loss_fn_inputs[{k!r}]")
                for k, v in wire["loss_fn_inputs"].items()
            },
        )


class WireParams:
    """Settings a request carries (sampling, optimizer): read from the wire field by field against
    their annotations and bounds (:mod:`.wire_checks`), then checked as a whole (:meth:`check`)."""

    where: ClassVar[str] = "params"  # the field name errors start with

    def check(self, where: str | None = None) -> None:
        check_instance(self, where or self.where)

    def validate(self) -> None:
        self.check()

    @classmethod
    def from_wire(cls, wire: dict, where: str | None = None):
        params = cls(**check_fields(cls, wire, where or cls.where))
        params.check(where or cls.where)
        return params

    def to_wire(self) -> dict:
        return asdict(self)


MAX_TOKEN_ID = (1 << 31) - 1  # token ids travel as int32 in the Tinker protocol; no vocabulary is larger
# Beyond this the tempered distribution is uniform to within float32 rounding for any model's logits
# (they span tens of nats), so nothing real is refused; an unbounded one overflows float32 in torch.
MAX_TEMPERATURE = 1e4


@dataclass
class SamplingParams(WireParams):
    where: ClassVar[str] = "sampling_params"
    max_tokens: int = bounded(512, 1)  # the engine bounds it by the model's context
    temperature: float = bounded(1.0, 0.0, MAX_TEMPERATURE)
    top_p: float = bounded(1.0, above=0.0, hi=1.0)
    top_k: int = bounded(-1, -1, MAX_TOKEN_ID)  # -1: off; a k of the vocabulary or more keeps every token
    seed: int | None = bounded(None, 0)
    # token ids here are checked against the vocabulary by the engine; None stops at EOS, [] turns
    # every stop off, EOS included (the Tinker SDK's meaning)
    stop: str | list[str] | list[int] | None = bounded(None, max_items=64)

    def check(self, where: str | None = None) -> None:
        where = where or self.where
        super().check(where)
        if self.top_k == 0:
            raise InvalidRequest(f"{where}.top_k: must be -1 (off) or >= 1, got 0")
        if isinstance(self.stop, list):
            bad = next((s for s in self.stop if isinstance(s, int) and not 0 <= s <= MAX_TOKEN_ID), None)
            if bad is not None:
                raise InvalidRequest(f"{where}.stop: token id {bad} is outside 0..{MAX_TOKEN_ID}")


# AdamW's step is m / (sqrt(v) + eps): an eps of 0 divides 0 by 0 where a gradient is zero (LoRA's A
# at the first step), and a tinier one than this explodes where the squared gradient v underflows
# float32 or bfloat16 but m does not. Tinker's default is 1e-12, torch's 1e-8.
MIN_EPS = 1e-20


@dataclass
class AdamParams(WireParams):
    """The engine's one rule for optimizer settings (both protocols read them through this class).
    The upper bounds are far beyond real use (LoRA learning rates are ~1e-5..1e-3) and keep
    AdamW's decoupled decay factor ``1 - learning_rate * weight_decay`` within [0, 1]."""

    where: ClassVar[str] = "adam_params"
    learning_rate: float = bounded(1e-4, 0.0, 1.0)
    beta1: float = bounded(0.9, 0.0)  # and below 1 (check)
    beta2: float = bounded(0.95, 0.0)
    eps: float = bounded(1e-8, MIN_EPS)
    weight_decay: float = bounded(0.0, 0.0, 1.0)
    grad_clip_norm: float = bounded(0.0, 0.0)  # 0: no clipping

    def check(self, where: str | None = None) -> None:
        where = where or self.where
        super().check(where)
        for name in ("beta1", "beta2"):
            if getattr(self, name) >= 1:
                raise InvalidRequest(f"{where}.{name}: must be below 1, got {getattr(self, name)!r}")


@dataclass
class ForwardBackwardOutput:
    loss_fn_outputs: list[dict[str, TensorData]]
    metrics: dict[str, float]

    def to_wire(self) -> dict:
        # a loss can overflow float32 (a huge weight, an importance ratio exp(100)); JSON has no
        # inf or NaN, so those travel as the strings "inf", "-inf", "nan" and read back as floats
        return {
            "loss_fn_outputs": [{k: v.to_wire() for k, v in out.items()} for out in self.loss_fn_outputs],
            "metrics": {k: v if math.isfinite(v) else str(float(v)) for k, v in self.metrics.items()},
        }

    @classmethod
    def from_wire(cls, wire: dict) -> ForwardBackwardOutput:
        outputs = [{k: TensorData.from_wire(v) for k, v in out.items()} for out in wire["loss_fn_outputs"]]
        return cls(loss_fn_outputs=outputs, metrics={k: float(v) for k, v in wire["metrics"].items()})


@dataclass
class OptimStepResponse:
    metrics: dict[str, float]

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: dict) -> OptimStepResponse:
        return cls(**wire)


@dataclass
class SaveStateResponse:
    path: str

    def to_wire(self) -> dict:
        return asdict(self)

    @classmethod
    def from_wire(cls, wire: dict):
        return cls(**wire)


@dataclass
class SaveWeightsResponse(SaveStateResponse):
    released: list[str] = field(default_factory=list)  # transient sampler saves deleted by this save


class LoadStateResponse(SaveStateResponse):
    pass


@dataclass
class Usage:
    prefill_tokens: int = 0  # prompt tokens, cached or computed
    # of prefill_tokens, those whose KV entries the sampler found cached and did not compute (the
    # rest, prefill_tokens - cached_prefill_tokens, were computed)
    cached_prefill_tokens: int = 0
    sampled_tokens: int = 0
    training_tokens: int = 0
    wall_time_s: float = 0.0
    operations: int = 0
    cost: str | None = None  # exact decimal string in ``currency``; None where the engine has no prices
    currency: str | None = None

    def add(self, other: Usage) -> Usage:
        counts = {
            k: getattr(self, k) + getattr(other, k) for k in asdict(self) if k not in ("cost", "currency")
        }
        if self.cost is None or other.cost is None:
            return Usage(**counts, cost=self.cost or other.cost, currency=self.currency or other.currency)
        return Usage(**counts, cost=str(Decimal(self.cost) + Decimal(other.cost)), currency=self.currency)

    def to_wire(self) -> dict:
        wire = asdict(self)
        return (
            wire
            if self.cost is not None
            else {k: v for k, v in wire.items() if k not in ("cost", "currency")}
        )

    @classmethod
    def from_wire(cls, wire: dict) -> Usage:
        return cls(**wire)


@dataclass
class TrainingSessionSummary:
    name: str
    base_model: str
    status: SessionStatus
    created: float
    last_active: float
    step: int
    usage: Usage
    user_metadata: dict | None = None
    lora: dict | None = None

    def to_wire(self) -> dict:
        wire = asdict(self)
        wire["status"] = self.status.value
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> TrainingSessionSummary:
        wire = dict(wire)
        wire["status"] = SessionStatus(wire["status"])
        wire["usage"] = Usage.from_wire(wire["usage"])
        return cls(**wire)
