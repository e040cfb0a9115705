"""The Tinker wire's protobuf messages, built at import from the table below with protobuf's descriptor API.

The tinker SDK (0.25+) sends ``forward_backward`` bodies as ``tinker_public.ForwardBackwardRequest``
and reads ``ForwardBackwardOutput`` and ``SampleResponse`` results only as protobuf. The engine
must not need the SDK installed, so it carries the schema itself. It is written here as a table
(message -> fields: name, number, type, repeated/optional, oneof) and turned into a
``FileDescriptorProto`` and message classes by the ``protobuf`` package, rather than committed as
``protoc`` output: generated ``_pb2`` modules embed an opaque serialized descriptor and refuse
protobuf runtimes older than the ``protoc`` that made them, while this table reads like the
``.proto`` file and works with any protobuf >= 4.21. Field numbers and types follow the SDK's
``tinker/proto/tinker_public_pb2.py``; ``tests/tinker/test_tinker_sdk.py`` checks the two descriptors
field by field.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
ENUMS: dict[str, list[str]] = {
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
}
# name -> [(field, number, type, flags)]; type "map<K,V>" is a map, flags: "*" repeated,
# "?" proto3 optional, "|name" a member of oneof ``name``.
MESSAGES: dict[str, list[tuple[str, int, str, str]]] = {
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "*"),
        ("prompt_logprobs", 2, "bytes", "?"),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", "?"),
        ("prompt_cache_hit_tokens", 4, "int32", ""),
        ("target_prompt_logprobs", 5, "Tensor", "?"),
        ("prompt_alt_tokens", 6, "PromptAltTokens", "?"),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", ""), ("logprobs", 2, "Tensor", "")],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", ""),
        ("tokens", 2, "bytes", ""),
        ("logprobs", 3, "bytes", "?"),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", "?"),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", ""),
        ("logprobs", 2, "bytes", ""),
        ("k", 3, "uint32", ""),
        ("length", 4, "uint32", ""),
    ],
    "SparseCsr": [
        ("values", 1, "bytes", ""),
        ("crow_indices", 2, "bytes", ""),
        ("col_indices", 3, "bytes", ""),
    ],
    "Tensor": [
        ("dense", 1, "bytes", "|encoding"),
        ("sparse_csr", 2, "SparseCsr", "|encoding"),
        ("dtype", 3, "DType", ""),
        ("shape", 4, "int64", "*"),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", ""),
        ("offsets", 2, "bytes", ""),
        ("dtype", 3, "DType", ""),
        ("trailing_shape", 4, "int64", "*"),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", ""),
        ("fields", 2, "map<string,BatchedTensor>", ""),
        ("num_datums", 3, "int64", ""),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", ""),
        ("loss_fn_outputs", 2, "ArrayRecord", "*"),
        ("metrics", 3, "map<string,double>", ""),
    ],
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", ""),
        ("seq_id", 2, "int32", ""),
        ("data", 3, "Datum", "*"),
        ("loss_fn", 4, "string", ""),
        ("loss_fn_config", 5, "map<string,double>", ""),
        ("forward_only", 6, "bool", ""),
        ("loss_fn_config_v2", 7, "map<string,LossConfigValue>", ""),
    ],
    "LossConfigValue": [("number", 1, "double", "|value"), ("text", 2, "string", "|value")],
    "Datum": [
        ("model_input", 1, "Chunk", "*"),
        ("loss_fn_inputs", 2, "map<string,Tensor>", ""),
        ("model_input_spans", 3, "ProvenanceSpan", "*"),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "*"),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "|span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "|span"),
    ],
    "PromptProvenanceSpan": [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ],
    "SampledProvenanceSpan": [
        ("sequence_id", 1, "string", ""),
        ("offset", 2, "int64", ""),
        ("length", 3, "int64", ""),
    ],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "|chunk"),
        ("image", 2, "ImageChunk", "|chunk"),
        ("dmel", 3, "DmelChunk", "|chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "")],
    "ImageChunk": [
        ("data", 1, "bytes", ""),
        ("format", 2, "string", ""),
        ("expected_tokens", 3, "int32", "?"),
        ("override_dimensions", 4, "ImageDimensions", "?"),
    ],
    "ImageDimensions": [("width", 1, "uint32", ""), ("height", 2, "uint32", "")],
    "DmelChunk": [("dmel", 1, "bytes", "")],
    "SamplingParams": [
        ("max_tokens", 1, "int32", "?"),
        ("seed", 2, "uint64", "?"),
        ("temperature", 3, "float", "?"),
        ("top_k", 4, "int32", "?"),
        ("top_p", 5, "float", "?"),
        ("stop_strs", 6, "StopStrings", "|stop"),
        ("stop_tokens", 7, "StopTokens", "|stop"),
    ],
    "StopStrings": [("values", 1, "string", "*")],
    "StopTokens": [("values", 1, "int32", "*")],
}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "bytes": _F.TYPE_BYTES,
    "string": _F.TYPE_STRING,
    "bool": _F.TYPE_BOOL,
    "int32": _F.TYPE_INT32,
    "int64": _F.TYPE_INT64,
    "uint32": _F.TYPE_UINT32,
    "uint64": _F.TYPE_UINT64,
    "float": _F.TYPE_FLOAT,
    "double": _F.TYPE_DOUBLE,
}


def _set_type(field: descriptor_pb2.FieldDescriptorProto, kind: str) -> None:
    if kind in _SCALARS:
        field.type = _SCALARS[kind]
    else:
        field.type = _F.TYPE_ENUM if kind in ENUMS else _F.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{kind}"


def _message(name: str, fields: list[tuple[str, int, str, str]]) -> descriptor_pb2.DescriptorProto:
    message = descriptor_pb2.DescriptorProto(name=name)
    oneofs: dict[str, int] = {}
    for field_name, number, kind, flags in fields:
        field = message.field.add(name=field_name, number=number, json_name=_camel(field_name))
        field.label = _F.LABEL_REPEATED if "*" in flags else _F.LABEL_OPTIONAL
        if kind.startswith("map<"):
            key, value = kind[4:-1].split(",")
            entry = message.nested_type.add(name=_camel(field_name, upper=True) + "Entry")
            entry.options.map_entry = True
            _set_type(entry.field.add(name="key", number=1, label=_F.LABEL_OPTIONAL, json_name="key"), key)
            _set_type(
                entry.field.add(name="value", number=2, label=_F.LABEL_OPTIONAL, json_name="value"), value
            )
            field.label, field.type = _F.LABEL_REPEATED, _F.TYPE_MESSAGE
            field.type_name = f".{PACKAGE}.{name}.{entry.name}"
            continue
        _set_type(field, kind)
        oneof = f"_{field_name}" if "?" in flags else flags.partition("|")[2]
        if oneof:
            if oneof not in oneofs:
                oneofs[oneof] = len(message.oneof_decl)
                message.oneof_decl.add(name=oneof)
            field.oneof_index = oneofs[oneof]
            field.proto3_optional = "?" in flags
    # proto3 wants synthetic oneofs (of optional fields) after the real ones
    real = [o for o in message.oneof_decl if not o.name.startswith("_")]
    if len(real) != len(message.oneof_decl) and real:
        order = [o.name for o in real] + [o.name for o in message.oneof_decl if o.name.startswith("_")]
        index = {n: i for i, n in enumerate(order)}
        names = [o.name for o in message.oneof_decl]
        for field in message.field:
            if field.HasField("oneof_index"):
                field.oneof_index = index[names[field.oneof_index]]
        del message.oneof_decl[:]
        for n in order:
            message.oneof_decl.add(name=n)
    return message


def _camel(name: str, upper: bool = False) -> str:
    head, *rest = name.split("_")
    text = head + "".join(part.title() for part in rest)
    return text[:1].upper() + text[1:] if upper else text


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The schema as a ``FileDescriptorProto`` (what ``protoc`` would make of the .proto file)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="sess_tinker_public.proto", package=PACKAGE, syntax="proto3"
    )
    for name, values in ENUMS.items():
        enum = proto.enum_type.add(name=name)
        for number, value in enumerate(values):
            enum.value.add(name=value, number=number)
    for name, fields in MESSAGES.items():
        proto.message_type.append(_message(name, fields))
    return proto


_pool = descriptor_pool.DescriptorPool()  # our own pool: no clash with an SDK's classes in one process
_classes = message_factory.GetMessages([file_descriptor()], pool=_pool)

ForwardBackwardRequest = _classes[f"{PACKAGE}.ForwardBackwardRequest"]
ForwardBackwardOutput = _classes[f"{PACKAGE}.ForwardBackwardOutput"]
SampleResponse = _classes[f"{PACKAGE}.SampleResponse"]
Tensor = _classes[f"{PACKAGE}.Tensor"]
DTYPE = {name: number for number, name in enumerate(ENUMS["DType"])}
STOP_REASON = {"stop": 0, "length": 1}
