"""Tinker wire data to sess types and back: protobuf training batches, JSON prompts and sampling
parameters in; ``ForwardBackwardOutput`` and ``SampleResponse`` protobuf out.

Token ids travel as little-endian int32 bytes, loss inputs as ``Tensor`` messages (dense bytes or
sparse CSR) and outputs as ``BatchedTensor`` (one flat buffer plus byte offsets per datum), as
the SDK's ``proto/request_conv.py`` and ``proto/response_conv.py`` write and read them. Anything
sess cannot run (image and dmel chunks) is refused with an
:class:`~sess.engine.protocol.errors.InvalidRequest` that names the field and what to do instead.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import Datum, ModelInput, TensorData
from sess.engine.server.tinker import fields, provenance, schema

_NUMPY = {
    schema.DTYPE["DTYPE_FLOAT32"]: "<f4",
    schema.DTYPE["DTYPE_INT64"]: "<i8",
    schema.DTYPE["DTYPE_INT32"]: "<i4",
}
_SESS_DTYPE = {"<f4": "float32", "<i8": "int64", "<i4": "int64"}
MAX_TARGET_CELLS = 1 << 20  # ids of one target_prompt_logprobs request
TOPK_EMPTY = (0, -99999.0)  # the SDK's marker of an empty top-k slot (and of prompt position 0)


@dataclass
class TrainingBatch:
    """What a ``ForwardBackwardRequest`` asks to compute (its model and seq_id stay on the message)."""

    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool
    data: list[Datum]
    spans: list[tuple[list[provenance.Span], list[provenance.Span]]]  # per datum: model input's, targets'


def parse_training_request(body: bytes):
    """A ``ForwardBackwardRequest`` body as its protobuf message: enough to know the model and the
    ``seq_id``, so that a batch :func:`read_training_batch` then refuses still uses that seq_id up."""
    message = schema.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:  # upb raises DecodeError; old runtimes others
        raise InvalidRequest(f"body: not a tinker_public.ForwardBackwardRequest protobuf ({exc})") from None
    if not message.model_id:
        raise InvalidRequest("model_id: missing")
    return message


def read_training_batch(message) -> TrainingBatch:
    """A parsed ``ForwardBackwardRequest`` as sess datums (checked against the model later)."""
    config: dict[str, float] = {k: float(v) for k, v in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():  # the SDK writes numbers to both; v2 wins
        if value.WhichOneof("value") == "text":
            raise InvalidRequest(f"loss_fn_config.{key}: text values are not options of any loss here")
        config[key] = value.number
    data = [_datum(d, i) for i, d in enumerate(message.data)]
    if not data:
        raise InvalidRequest("data: expected at least one Datum")
    spans = [
        tuple(provenance.read_spans(getattr(d, name), f"data[{i}].{name}") for name in _SPANS)
        for i, d in enumerate(message.data)
    ]
    return TrainingBatch(message.loss_fn, config, message.forward_only, data, spans)


_SPANS = ("model_input_spans", "loss_fn_input_spans")


def _datum(message, i: int) -> Datum:
    tokens = []
    for j, chunk in enumerate(message.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise InvalidRequest(f"data[{i}].model_input[{j}]: {kind or 'empty'} chunk: {fields.TEXT_ONLY}")
        tokens.append(_array(chunk.encoded_text.tokens, "<i4", f"data[{i}].model_input[{j}].tokens"))
    ids = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    inputs = {
        key: _tensor(tensor, f"data[{i}].loss_fn_inputs[{key!r}]")
        for key, tensor in message.loss_fn_inputs.items()
    }
    return Datum(ModelInput.from_ints(ids.tolist()), inputs)


def _array(raw: bytes, dtype: str, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise InvalidRequest(
            f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values"
        )
    return np.frombuffer(raw, dtype=dtype)


def _tensor(message, where: str) -> TensorData:
    dtype = _NUMPY.get(message.dtype)
    if dtype is None:
        raise InvalidRequest(f"{where}: dtype {message.dtype} is not float32, int64 or int32")
    shape = [int(s) for s in message.shape]
    if message.WhichOneof("encoding") == "sparse_csr":
        values = _dense_from_csr(message.sparse_csr, dtype, shape, where)
    else:
        values = _array(message.dense, dtype, where)
        shape = shape or [values.size]
        if any(s < 0 for s in shape) or math.prod(shape) != values.size:
            raise InvalidRequest(f"{where}: shape {shape} does not hold {values.size} values")
    if len(shape) not in (1, 2):
        raise InvalidRequest(
            f"{where}: shape {shape}; this engine takes loss inputs of shape (N,) or, for cross_entropy's "
            "target_tokens and weights, (N, K)"
        )
    sess_dtype = _SESS_DTYPE[dtype]
    return TensorData(values.astype(sess_dtype), dtype=sess_dtype, shape=shape)


def _dense_from_csr(csr, dtype: str, shape: list[int], where: str) -> np.ndarray:
    values = _array(csr.values, dtype, f"{where}.values")
    rows = _array(csr.crow_indices, "<i8", f"{where}.crow_indices")
    cols = _array(csr.col_indices, "<i8", f"{where}.col_indices")
    if len(shape) != 2 or min(shape) < 0 or shape[0] * shape[1] > 1 << 28:
        raise InvalidRequest(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
    if (
        len(rows) != shape[0] + 1
        or len(cols) != len(values)
        or rows[0] != 0
        or rows[-1] != len(values)
        or np.any(np.diff(rows) < 0)
        or (len(cols) and (cols.min() < 0 or cols.max() >= shape[1]))
    ):
        raise InvalidRequest(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(shape[0]), np.diff(rows)), cols] = values
    return dense


def read_prompt(prompt: Any, where: str = "prompt") -> list[int]:
    """A JSON ``ModelInput`` ({chunks: [{type: encoded_text, tokens: [...]}, ...]}) as token ids."""
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise InvalidRequest(f"{where}: expected an object with a list of chunks")
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise InvalidRequest(
                f"{where}.chunks[{j}]: {str(kind)[:40] or 'malformed'} chunk: {fields.TEXT_ONLY}"
            )
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"{where}.chunks[{j}].tokens: expected a list of integers")
        tokens += ids
    return tokens


def read_target_ids(value: Any, positions: int) -> tuple[list[list[int]], tuple[list, list] | None]:
    """``target_prompt_logprobs`` (a JSON ``TensorData`` of int64 ids, [len(prompt) - 1, K], dense or
    sparse CSR) as dense rows (-1 where nothing is asked) and, when sparse, its (crow, col) indices."""
    where = "target_prompt_logprobs"
    if not isinstance(value, dict) or value.get("dtype") != "int64":
        raise InvalidRequest(f"{where}: expected an int64 TensorData of token ids")
    shape, data = value.get("shape"), value.get("data")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n >= 0 for n in shape)):
        raise InvalidRequest(
            f"{where}: shape {str(shape)[:40]} is not [len(prompt) - 1, K] = [{positions}, K]"
        )
    if shape[0] != positions or shape[1] < 1 or shape[0] * shape[1] > MAX_TARGET_CELLS:
        raise InvalidRequest(
            f"{where}: shape {shape} is not [len(prompt) - 1, K] = [{positions}, K] with K >= 1 "
            f"(at most {MAX_TARGET_CELLS} cells)"
        )
    crow, col = value.get("sparse_crow_indices"), value.get("sparse_col_indices")
    for name, ids in (("data", data), ("sparse_crow_indices", crow), ("sparse_col_indices", col)):
        if not (ids is None and name != "data") and not _int_list(ids):
            raise InvalidRequest(f"{where}.{name}: expected a list of integers")
    if crow is None and col is None:
        if len(data) != shape[0] * shape[1]:
            raise InvalidRequest(f"{where}: shape {shape} does not hold {len(data)} values")
        return np.asarray(data, np.int64).reshape(shape).tolist(), None
    csr = schema.Tensor().sparse_csr
    csr.values, csr.crow_indices, csr.col_indices = (
        np.asarray(v if isinstance(v, list) else [], dtype).tobytes()
        for v, dtype in ((data, "<i8"), (crow, "<i8"), (col, "<i8"))
    )
    dense = _dense_from_csr(csr, "<i8", shape, where)
    listed = np.zeros(shape, bool)
    listed[np.repeat(np.arange(shape[0]), np.diff(crow)), col] = True
    return np.where(listed, dense, -1).tolist(), (list(crow), list(col))  # unlisted cells ask nothing


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and -(1 << 62) < v < 1 << 62 for v in value)


def sampling_params(params: Any) -> dict:
    """Tinker ``SamplingParams`` JSON as sess's (its checks run when the op is read)."""
    if not isinstance(params, dict):
        raise InvalidRequest("sampling_params: expected an object")
    known = set(fields.HONOURED["SamplingParams"])
    unknown = sorted(set(params) - known)
    if unknown:
        raise InvalidRequest(
            f"sampling_params: unknown field {unknown[0]!r} (fields: {', '.join(sorted(known))})"
        )
    return {k: v for k, v in params.items() if v is not None}


def training_output(result: dict) -> bytes:
    """sess's ``forward``/``forward_backward`` result (wire dict) as a ``ForwardBackwardOutput``."""
    out = schema.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result["loss_fn_outputs"]))
    fields = sorted({k for datum in result["loss_fn_outputs"] for k in datum})
    for name in fields:
        arrays = [base64.b64decode(datum[name]["data"]) for datum in result["loss_fn_outputs"]]
        first = result["loss_fn_outputs"][0][name]
        offsets = np.cumsum([0, *(len(a) for a in arrays)], dtype=np.int64)
        batched = record.fields[name]
        batched.data = b"".join(arrays)
        batched.offsets = offsets.astype("<i8").tobytes()
        batched.dtype = schema.DTYPE["DTYPE_FLOAT32" if first["dtype"] == "float32" else "DTYPE_INT64"]
        batched.trailing_shape.extend(first["shape"][1:])
    for key, value in result["metrics"].items():
        out.metrics[key if ":" in key else f"{key}:sum"] = float(value)
    return out.SerializeToString()


def sample_output(result: dict, sparse_targets: tuple[list, list] | None = None) -> bytes:
    """sess's ``sample`` result (wire dict) as a ``SampleResponse``; ``sparse_targets`` the (crow,
    col) indices of a sparse ``target_prompt_logprobs`` request, whose layout the answer keeps."""
    out = schema.SampleResponse(prompt_cache_hit_tokens=int(result.get("prompt_cache_hit_tokens") or 0))
    for sequence in result["sequences"]:
        added = out.sequences.add(
            stop_reason=schema.STOP_REASON[sequence["stop_reason"]],
            tokens=np.asarray(sequence["tokens"], "<i4").tobytes(),
            logprobs=np.asarray(sequence["logprobs"], "<f4").tobytes(),
        )
        if sequence.get("topk_logprobs") is not None:
            _topk(added.topk_sampled_logprobs, sequence["topk_logprobs"])
    targets = result.get("target_prompt_logprobs")
    if targets is not None:
        values = np.asarray(targets, "<f4")
        out.target_prompt_logprobs.dtype = schema.DTYPE["DTYPE_FLOAT32"]
        out.target_prompt_logprobs.shape.extend(values.shape)
        if sparse_targets is None:
            out.target_prompt_logprobs.dense = values.tobytes()
        else:
            crow, col = (np.asarray(v, "<i8") for v in sparse_targets)
            csr = out.target_prompt_logprobs.sparse_csr
            csr.values = values[np.repeat(np.arange(values.shape[0]), np.diff(crow)), col].tobytes()
            csr.crow_indices, csr.col_indices = crow.tobytes(), col.tobytes()
    alt = result.get("prompt_alt_tokens")
    if alt is not None:
        for name, dtype, kind in (("tokens", "<i8", "DTYPE_INT64"), ("logprobs", "<f4", "DTYPE_FLOAT32")):
            array = np.asarray(alt[name], dtype)
            array = array if array.ndim == 2 else array.reshape(0, 0)  # a one-token prompt has no rows
            tensor = getattr(out.prompt_alt_tokens, name)
            tensor.dense, tensor.dtype = array.tobytes(), schema.DTYPE[kind]
            tensor.shape.extend(array.shape)
    prompt = result.get("prompt_logprobs")
    if prompt is not None:
        out.prompt_logprobs = np.asarray([math.nan if v is None else v for v in prompt], "<f4").tobytes()
    top = result.get("topk_prompt_logprobs")
    if top is not None:
        _topk(out.topk_prompt_logprobs, top)
    return out.SerializeToString()


def _topk(topk, rows: list) -> None:
    """``TopkLogprobs`` of rows of (token, logprob) pairs; a None row or a short one is padded with
    the SDK's empty-slot marker."""
    k = max((len(row) for row in rows if row), default=0)
    filled = [list(row or []) + [TOPK_EMPTY] * (k - len(row or [])) for row in rows]
    topk.k, topk.length = k, len(filled)
    topk.token_ids = np.asarray([[int(t) for t, _ in row] for row in filled], "<i4").tobytes()
    topk.logprobs = np.asarray([[float(v) for _, v in row] for row in filled], "<f4").tobytes()
