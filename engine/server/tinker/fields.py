"""Every field of every request the tinker SDK (0.38) can send, and what this engine does with it.

:data:`HONOURED` fields are read and acted on (the note says how, where it is not plainly what the
SDK documents); :data:`REFUSED` fields get a 400 that names the field and gives the reason here when
a client sets them (:func:`check_refused`, :func:`refusal`); the Tinker routes read their refusals
from this module. :data:`UNDECIDED` holds the fields still dropped without a word: each must move to
one of the other two (``tests/tinker/test_tinker_fields.py`` walks the SDK's request types, fails on
a field in none of the three, and marks a non-empty :data:`UNDECIDED` as a known failure). The keys
are the SDK's class names in ``tinker.types``; docs/tinker.md's table is checked against this module.
"""

from __future__ import annotations

from typing import Any

from sess.engine.protocol import loss_registry
from sess.engine.protocol.errors import InvalidRequest

ADAMW_ONLY = (
    "this engine runs AdamW (optimizer type adamw, adam_params); the dimuon optimizer is not supported"
)
TEXT_ONLY = "this engine runs text models: send encoded_text chunks (image, image-pointer and dmel chunks are not supported)"
STABILITY = (
    "the sampling session's Tinker session keeps each sequence's prompt, tokens and sampling logprobs "
    "under its sequence_id for a day (each use restarts it; in memory, bounded, gone with the session); "
    "it does so with the flag off too, so that provenance spans can be checked for any loss"
)
SPANS = (
    "checked: the runs tile the field, offsets in range, each sequence one the session sampled, with "
    "the tokens claimed; stable_reinforce reads the recorded sampler logprobs"
)
NO_CUSTOM_LOSS = (
    "custom losses run on the client: forward_backward_custom works with the default client config"
)
NOT_SEARCHABLE = "sessions/search is not served; list sessions with GET /sessions"
NO_FUTURES_BATCH = (
    "retrieve_futures is not served (client config sample_use_retrieve_futures=false): poll retrieve_future"
)
NO_JOIN = "join_sampling_session is not served (client config sample_join_sampling_session=false)"
NO_COPY = "a copy makes a training run of its own: copy_weights into a given session is not served"
NO_TOKEN = "access tokens are not used by this engine: publish the checkpoint instead"
NO_TAGS = "session tags are not kept by this engine: use user_metadata or project_id"
TTL = "kept as expires_at; the engine deletes the checkpoint after it (1 s to 10 years)"
NO_UNLOAD = "unload_model is not served: finish the session (its models stop; checkpoints stay)"
AS_DOCUMENTED = ""
TELEMETRY = "accepted and not stored: the engine keeps its own usage records"


def _all(note: str, *names: str) -> dict[str, str]:
    return dict.fromkeys(names, note)


HONOURED: dict[str, dict[str, str]] = {
    "ClientConfigRequest": _all("an SDK outside tinker>=0.34,<0.39 is refused with the range", "sdk_version"),
    "CreateSessionRequest": _all(AS_DOCUMENTED, "user_metadata", "sdk_version", "type")
    | _all("stored and returned; list_training_runs filters by project", "project_id", "display_name"),
    "CreateModelRequest": {
        **_all(
            AS_DOCUMENTED, "session_id", "model_seq_id", "base_model", "user_metadata", "lora_config", "type"
        ),
        "optimizer_config": "adamw; " + ADAMW_ONLY,
    },
    "LoraConfig": _all(AS_DOCUMENTED, "rank", "seed", "train_unembed", "train_mlp", "train_attn"),
    "AdamOptimizerConfig": _all(AS_DOCUMENTED, "type"),
    "OptimizerConfigBase": _all("adamw; " + ADAMW_ONLY, "type"),
    "OptimStepRequest": {
        **_all(AS_DOCUMENTED, "model_id", "seq_id", "type"),
        "optim_params": "adam_params; " + ADAMW_ONLY,
    },
    "AdamParams": _all(
        AS_DOCUMENTED, "learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"
    ),
    "LoadWeightsRequest": _all(
        AS_DOCUMENTED,
        "model_id",
        "seq_id",
        "session_id",
        "model_seq_id",
        "path",
        "optimizer",
        "type",
        "user_metadata",
    )
    | {
        "optimizer_config": "adamw; " + ADAMW_ONLY,
        "base_model": "a base model other than the checkpoint's is refused naming both",
    },
    "SaveWeightsRequest": _all(
        AS_DOCUMENTED, "model_id", "path", "seq_id", "overwrite", "type", "user_metadata"
    )
    | {"ttl_seconds": TTL},
    "SaveWeightsForSamplerRequest": {
        **_all(
            AS_DOCUMENTED, "model_id", "path", "sampling_session_seq_id", "seq_id", "type", "user_metadata"
        ),
        "ttl_seconds": TTL,
        "kind": "snapshot keeps its weights while its session lives; inflight follows each newer inflight save",
    },
    "SaveWeightsExternalRequest": _all("a merged safetensors export", "model_id", "path", "seq_id", "type")
    | {"ttl_seconds": TTL},
    "CopyWeightsRequest": _all(
        "a copy in a new stopped run of the copier's, with its own TTL",
        "source_path",
        "ttl_seconds",
        "destination_project_id",
    ),
    "GetCurrentCheckpointStorageUsageRequest": _all("bytes per project and owner", "project_id"),
    "CreateSamplingSessionRequest": _all(
        AS_DOCUMENTED, "session_id", "sampling_session_seq_id", "base_model", "model_path", "type"
    ),
    "SampleRequest": {
        **_all(
            AS_DOCUMENTED,
            "num_samples",
            "prompt",
            "sampling_params",
            "base_model",
            "model_path",
            "sampling_session_id",
            "seq_id",
            "prompt_logprobs",
            "topk_prompt_logprobs",
            "prompt_logprobs_last_n",
            "type",
        ),
        "topk_sample_logprobs": "the model's own logprobs (temperature 1), from a forward pass",
        "target_prompt_logprobs": "dense or sparse CSR; the answer has the request's layout",
        "prompt_alt_tokens_k": "draws at the request's temperature, seeded by its seed; logprobs at temperature 1",
        "record_stability_info": STABILITY,
    },
    "SamplingParams": {
        **_all(AS_DOCUMENTED, "max_tokens", "seed", "temperature", "top_k", "top_p"),
        "stop": "None stops at EOS; [] turns every stop off, EOS included",
    },
    "ModelInput": _all(AS_DOCUMENTED, "chunks"),
    "EncodedTextChunk": _all(AS_DOCUMENTED, "tokens", "type"),
    "Datum": _all(AS_DOCUMENTED, "model_input", "loss_fn_inputs")
    | _all(SPANS, "model_input_spans", "loss_fn_input_spans"),
    "PromptProvenanceSpan": _all(SPANS, "sequence_id", "offset", "length"),
    "SampledProvenanceSpan": _all(SPANS, "sequence_id", "offset", "length"),
    "TensorData": _all(AS_DOCUMENTED, "data", "dtype", "shape", "sparse_crow_indices", "sparse_col_indices"),
    "ForwardBackwardRequest": _all(AS_DOCUMENTED, "forward_backward_input", "model_id", "seq_id"),
    "ForwardRequest": _all(AS_DOCUMENTED, "forward_input", "model_id", "seq_id"),
    "ForwardBackwardInput": {
        "data": "cross_entropy takes (N, K) target_tokens and weights: K targets per position",
        "loss_fn": f"{', '.join(loss_registry.LOSSES)}; {' and '.join(loss_registry.REFUSED)} refused",
        "loss_fn_config": AS_DOCUMENTED,
    },
    "FutureRetrieveRequest": {
        "request_id": AS_DOCUMENTED,
        "allow_metadata_only": "a permission, not a demand: the answer always comes in full",
    },
    "GetInfoRequest": _all(AS_DOCUMENTED, "model_id", "type"),
    "SessionHeartbeatRequest": _all(AS_DOCUMENTED, "session_id", "type"),
    "GetBillingUsageRequest": _all("hour-aligned UTC, at most 14 days", "starting_on", "ending_before"),
    "TelemetrySendRequest": _all(
        TELEMETRY, "events", "platform", "process_uuid", "sdk_version", "session_id"
    ),
    "GenericEvent": _all(
        TELEMETRY,
        "event",
        "event_data",
        "event_id",
        "event_name",
        "event_session_index",
        "severity",
        "timestamp",
    ),
    "SessionStartEvent": _all(TELEMETRY, "event", "event_id", "event_session_index", "severity", "timestamp"),
    "SessionEndEvent": _all(
        TELEMETRY, "duration", "event", "event_id", "event_session_index", "severity", "timestamp"
    ),
    "UnhandledExceptionEvent": _all(
        TELEMETRY,
        "error_message",
        "error_type",
        "event",
        "event_id",
        "event_session_index",
        "severity",
        "timestamp",
        "traceback",
    ),
}

REFUSED: dict[str, dict[str, str]] = {
    "ImageChunk": _all(TEXT_ONLY, "data", "format", "expected_tokens", "type"),
    "ImageAssetPointerChunk": _all(TEXT_ONLY, "format", "location", "expected_tokens", "type"),
    "DmelChunk": _all(TEXT_ONLY, "dmel", "type"),
    "DimuonOptimizerConfig": _all(ADAMW_ONLY, "type", "version"),
    "DimuonParams": _all(ADAMW_ONLY, "type", "learning_rate", "grad_clip_norm", "beta1"),
    "OptimParamsBase": _all(ADAMW_ONLY, "type"),
    "SaveWeightsExternalRequest": {
        "age_encryption_recipients": "encrypted exports are not supported by this engine; export unencrypted"
    },
    "CreateCustomLossRequest": _all(
        NO_CUSTOM_LOSS, "session_id", "custom_loss_seq_id", "name", "inputs", "graph", "type"
    ),
    "CustomLossGraph": _all(NO_CUSTOM_LOSS, "format", "nodes"),
    "CustomLossInput": _all(NO_CUSTOM_LOSS, "name", "rank"),
    "CustomLossNode": _all(NO_CUSTOM_LOSS, "op", "name", "target", "args", "kwargs"),
    "FuturesRetrieveRequest": _all(
        NO_FUTURES_BATCH, "target", "prev_cursor", "timeout", "retrieved_request_ids"
    ),
    "SamplingSessionFuturesTarget": _all(
        NO_FUTURES_BATCH, "type", "sampling_session_id", "cloned_sampler_id"
    ),
    "JoinSamplingSessionRequest": _all(NO_JOIN, "sampling_session_id", "type"),
    "CopyWeightsRequest": _all(NO_COPY, "session_id", "model_seq_id") | {"weights_access_token": NO_TOKEN},
    "LoadWeightsRequest": {"weights_access_token": NO_TOKEN},
    "CreateSessionRequest": {"tags": NO_TAGS},
    "UnloadModelRequest": _all(NO_UNLOAD, "model_id", "type"),
    "SessionSearchRequest": _all(
        NOT_SEARCHABLE,
        "session_id",
        "project_ids",
        "user_metadata",
        "display_name",
        "owner",
        "statuses",
        "limit",
        "cursor",
    ),
    "SessionSearchCursor": _all(NOT_SEARCHABLE, "last_created_at", "last_session_id"),
    **{
        name: _all(NOT_SEARCHABLE, *fields)
        for name, fields in {
            "AccessibleSearchOwner": ("type",),
            "OwnSearchOwner": ("type",),
            "UserSearchOwner": ("type", "owner_urns"),
            "ActiveSessionStatusQuery": ("type",),
            "CancelledSessionStatusQuery": ("type",),
            "FailedSessionStatusQuery": ("type",),
            "ClientFinishedSessionStatusQuery": ("type", "reasons"),
        }.items()
    },
}

# dropped today without a word: none (a new SDK's fields land here until decided)
UNDECIDED: dict[str, dict[str, str]] = {}


def uncovered(
    sdk: dict[str, list[str]],
    honoured: dict[str, dict[str, str]] = HONOURED,
    refused: dict[str, dict[str, str]] = REFUSED,
    undecided: dict[str, dict[str, str]] = UNDECIDED,
) -> list[str]:
    """``Type.field`` of every field of ``sdk`` (class name -> field names) in none of the three tables."""
    return [
        f"{name}.{field}"
        for name, fields in sorted(sdk.items())
        for field in fields
        if not any(field in table.get(name, {}) for table in (honoured, refused, undecided))
    ]


def refusal(type_name: str, field: str, where: str | None = None) -> InvalidRequest:
    """The 400 for a refused field: its path and the reason."""
    return InvalidRequest(f"{where or field}: not supported by this engine: {REFUSED[type_name][field]}")


def check_known(type_name: str, body: dict[str, Any]) -> None:
    """Refuse a field of ``body`` that the SDK's ``type_name`` does not have (nothing is dropped)."""
    known = {**HONOURED.get(type_name, {}), **REFUSED.get(type_name, {}), **UNDECIDED.get(type_name, {})}
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise InvalidRequest(
            f"{unknown[0][:64]}: not a field of {type_name} (fields: {', '.join(sorted(known))})"
        )


def check_refused(type_name: str, body: dict[str, Any], where: str = "") -> None:
    """Refuse ``body`` when it sets (to anything but null, false, 0 or empty) a refused field."""
    for field in REFUSED.get(type_name, {}):
        if body.get(field) not in (None, False, 0, "", [], {}):
            raise refusal(type_name, field, f"{where}{field}")


def markdown_table() -> str:
    """docs/tinker.md's table of every request field (the test checks the doc against this)."""
    rows = ["| request type | field | here | how or why |", "| --- | --- | --- | --- |"]
    tables = (("honoured", HONOURED), ("refused", REFUSED), ("dropped today", UNDECIDED))
    for name in sorted({n for _, table in tables for n in table}):
        for status, table in tables:
            for field, note in sorted(table.get(name, {}).items()):
                rows.append(f"| `{name}` | `{field}` | {status} | {note or 'as the SDK documents'} |")
    return "\n".join(rows)
