"""Every public method of the tinker SDK's clients (0.38) and what this engine does with it, the
companion of :mod:`.fields` for docs/tinker.md: ``honoured`` (it works; the note says how where that
is not plain), ``refused`` (a 400 with the reason), ``client-side`` (the SDK answers it without the
engine) or ``dropped today`` (it runs but part of what it asks is not kept yet; other work decides).
A ``*_async`` twin is what its method is. ``tests/tinker/test_tinker_fields.py`` checks the SDK's
public methods against this table and docs/tinker.md against :func:`markdown_table`."""

from __future__ import annotations

from sess.engine.server.tinker import fields

OK, REFUSED, CLIENT, DROPPED = "honoured", "refused", "client-side", "dropped today"
NOT_SERVED = "not served by this engine (the catch-all route's 400)"

METHODS: dict[str, tuple[str, str]] = {
    "ServiceClient.close": (CLIENT, ""),
    "ServiceClient.copy_weights": (
        OK,
        "a copy in a new run of the copier's, with its own TTL; " + fields.NO_COPY,
    ),
    "ServiceClient.create_custom_loss": (REFUSED, fields.NO_CUSTOM_LOSS),
    "ServiceClient.create_lora_training_client": (
        OK,
        "LoRA on a catalog model; alpha 32 at every rank, as Tinker's",
    ),
    "ServiceClient.create_rest_client": (CLIENT, ""),
    "ServiceClient.create_sampling_client": (
        OK,
        "record_stability_info records each sequence for stable_reinforce",
    ),
    "ServiceClient.create_training_client_from_state": (
        OK,
        "a base_model other than the checkpoint's is refused naming both",
    ),
    "ServiceClient.create_training_client_from_state_with_optimizer": (OK, "as from_state"),
    "ServiceClient.get_console_url": (CLIENT, "there is no console"),
    "ServiceClient.get_server_capabilities": (OK, "the engine's catalog"),
    "ServiceClient.get_telemetry": (CLIENT, ""),
    "TrainingClient.create_sampling_client": (
        OK,
        "record_stability_info records each sequence for stable_reinforce",
    ),
    "TrainingClient.forward": (OK, "cross_entropy takes (N, K) targets"),
    "TrainingClient.forward_backward": (OK, "as forward"),
    "TrainingClient.forward_backward_custom": (OK, "the loss runs on the client"),
    "TrainingClient.get_console_url": (CLIENT, "there is no console"),
    "TrainingClient.get_info": (OK, ""),
    "TrainingClient.get_telemetry": (CLIENT, ""),
    "TrainingClient.get_tokenizer": (OK, "get_info names the public hub id of a catalog model's tokenizer"),
    "TrainingClient.load_state": (OK, ""),
    "TrainingClient.load_state_with_optimizer": (OK, ""),
    "TrainingClient.optim_step": (OK, "AdamW; " + fields.ADAMW_ONLY),
    "TrainingClient.save_state": (OK, "ttl_seconds and user_metadata kept"),
    "TrainingClient.save_weights_and_get_sampling_client": (
        OK,
        "a snapshot lives while its session does; kind='inflight' follows each newer inflight save",
    ),
    "TrainingClient.save_weights_external": (OK, "merged weights; encrypted exports refused"),
    "TrainingClient.save_weights_for_sampler": (OK, "ttl_seconds and user_metadata kept"),
    "SamplingClient.compute_logprobs": (OK, "prompt_logprobs_last_n honoured"),
    "SamplingClient.create": (OK, ""),
    "SamplingClient.from_sampler_handle": (CLIENT, ""),
    "SamplingClient.get_base_model": (OK, ""),
    "SamplingClient.get_sampler_handle": (CLIENT, ""),
    "SamplingClient.get_telemetry": (CLIENT, ""),
    "SamplingClient.get_tokenizer": (OK, "as TrainingClient's"),
    "SamplingClient.on_queue_state_change": (CLIENT, ""),
    "SamplingClient.sample": (OK, "every SampleRequest option"),
    "RestClient.assign_session_project": (REFUSED, NOT_SERVED),
    "RestClient.copy_weights": (OK, "as ServiceClient's"),
    "RestClient.delete_checkpoint": (OK, ""),
    "RestClient.delete_checkpoint_from_tinker_path": (OK, ""),
    "RestClient.export_session_trace": (
        OK,
        "Chrome trace JSON: one slice per op with queue wait, run time, tokens",
    ),
    "RestClient.get_audit_log": (OK, "a key's own entries; the engine's key sees all"),
    "RestClient.get_billing_usage": (OK, "hour-aligned UTC, at most 14 days"),
    "RestClient.get_current_checkpoint_storage_usage": (OK, "bytes per project and owner"),
    "RestClient.get_external_weights_urls": (OK, ""),
    "RestClient.get_sampler": (OK, ""),
    "RestClient.get_server_capabilities": (OK, ""),
    "RestClient.get_session": (OK, ""),
    "RestClient.get_telemetry": (CLIENT, ""),
    "RestClient.get_training_run": (OK, ""),
    "RestClient.get_training_run_by_tinker_path": (OK, ""),
    "RestClient.get_weights_info_by_tinker_path": (OK, ""),
    "RestClient.list_checkpoints": (OK, ""),
    "RestClient.list_sessions": (OK, ""),
    "RestClient.list_training_runs": (OK, ""),
    "RestClient.list_user_checkpoints": (OK, ""),
    "RestClient.publish_checkpoint_from_tinker_path": (OK, "readable by every key, writable by its owner"),
    "RestClient.search_sessions": (REFUSED, fields.NOT_SEARCHABLE),
    "RestClient.set_checkpoint_ttl_from_tinker_path": (OK, "sets or clears expires_at"),
    "RestClient.unpublish_checkpoint_from_tinker_path": (OK, "the owner's only"),
    "RestClient.whoami": (REFUSED, NOT_SERVED),
    "AdminClient.get_audit_log": (OK, "as RestClient's"),
    "AdminClient.get_billing_usage": (OK, "as RestClient's"),
    "AdminClient.get_current_checkpoint_storage_usage": (OK, "as RestClient's"),
    "AdminClient.get_telemetry": (CLIENT, ""),
}


def status(method: str) -> tuple[str, str] | None:
    """A method's (status, note); an ``_async`` twin's is its method's; None for a method not listed."""
    return METHODS.get(method) or METHODS.get(method.removesuffix("_async"))


def markdown_table() -> str:
    """docs/tinker.md's table of every public client method."""
    rows = ["| method | here | how or why |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {state} | {note} |" for name, (state, note) in sorted(METHODS.items())]
    return "\n".join(rows)
