"""Tinker sampling routes: sampling sessions, ``GET /samplers/{id}`` and ``asample``.

A sampling session samples a checkpoint (``tinker://…/sampler_weights/…`` or ``…/weights/…``) or
a base model; ``save_weights_for_sampler`` without a name makes one of the model's current weights
(:mod:`.training_routes`). ``asample`` is sess's ``sample`` op: the request joins the engine's
continuous decode batch, each sampled token carries its logprob, and prompt logprobs and top-k
prompt logprobs come from the same prefill (``compute_logprobs`` is a one-token sample that asks
for prompt logprobs); the scores beyond the sampled tokens (top-k of sampled positions, chosen ids'
and alternative draws at prompt positions) come from forward passes as the request finishes
(:mod:`sess.engine.runtime.prompt_scores`). Every field of the request is honoured or refused
(:mod:`.fields`); each sequence a sampling session samples is recorded under its ``sequence_id``
(:mod:`.sequence_records`), which ``record_stability_info`` asks for and provenance spans need. Sample requests are not ordered; a re-sent one (same sampling session and
``seq_id``) gets the same request id.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.responses import Response

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.tinker import fields, ids, wire
from sess.engine.server.tinker.request_futures import Answer
from sess.engine.server.tinker.sequence_records import SequenceRecords
from sess.engine.server.tinker.state import Sampler, Tinker, field_of, json_response


def add_routes(route, tinker: Tinker) -> None:
    async def target_of(
        owner: str, model_path: str | None, base_model: str | None
    ) -> tuple[dict, str | None]:
        """The sess sampling target of a checkpoint path or base model, checked to exist and be
        owner's (or published). Both may be given (the SDK allows it; the cookbook's teacher sampler
        sends both): then the base model must be the checkpoint's, and the checkpoint is sampled."""
        if model_path is None and base_model is None:
            raise InvalidRequest("model_path, base_model: give one (a checkpoint or a base model)")
        if model_path is None:
            facts = await tinker.facts(owner, base_model)
            return {"base_model": facts["base_model"]}, None
        path = ids.to_sess_path(model_path, "model_path")
        session = await tinker.readable_checkpoint(owner, path)
        if base_model is not None:
            info = await tinker.call(owner, "checkpoint_info", {"path": path})
            if info["base_model"] != (await tinker.facts(owner, base_model))["base_model"]:
                raise InvalidRequest(
                    f"base_model, model_path: base_model {base_model[:80]!r} is not the base model of "
                    f"model_path {model_path[:200]!r} ({info['base_model']}); give the checkpoint's base "
                    "model or omit it"
                )
        return {"model_path": path}, session

    @route("POST", "/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        session = tinker.session(owner, field_of(body, "session_id", str))
        sampler_id = ids.sampler_id(session.id, field_of(body, "sampling_session_seq_id", int))
        model_path = field_of(body, "model_path", str, None)

        async def make() -> dict:
            target, of = await target_of(owner, model_path, field_of(body, "base_model", str, None))
            tinker.add_sampler(Sampler(sampler_id, owner, target, of, model_path))
            return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

        return json_response(await tinker.once((owner, "sampler", sampler_id), make))

    @route("GET", "/samplers/{sampler_id}")
    async def get_sampler(request: Request) -> Response:
        owner = tinker.owner(request)
        sampler = tinker.sampler(owner, request.path_params["sampler_id"])
        base_model = await tinker.sampler_base_model(owner, sampler)
        return json_response(
            {"sampler_id": sampler.id, "base_model": base_model, "model_path": sampler.model_path}
        )

    @route("POST", "/asample")
    async def asample(request: Request) -> Response:
        owner = tinker.owner(request)
        body = await tinker.json(request)
        fields.check_known("SampleRequest", body)
        fields.check_refused("SampleRequest", body)
        num_samples = field_of(body, "num_samples", int, 1)
        prompt = wire.read_prompt(body.get("prompt"))
        targets, sparse = (
            wire.read_target_ids(body["target_prompt_logprobs"], len(prompt) - 1)
            if body.get("target_prompt_logprobs") is not None
            else (None, None)
        )
        params = wire.sampling_params(body.get("sampling_params"))
        topk = field_of(body, "topk_prompt_logprobs", int, 0)
        records = None
        if body.get("sampling_session_id") is not None:
            sampler = tinker.sampler(owner, body["sampling_session_id"])
            target, of = sampler.target, sampler.session
            key = (owner, "sample", sampler.id, field_of(body, "seq_id", int))
            # every sequence is recorded, record_stability_info or not: the cookbook attaches
            # provenance spans to every RL datum, whatever its loss, and they are checked against it
            field_of(body, "record_stability_info", bool, False)
            records = tinker.records_of(owner, sampler.id.split(":", 1)[0], create=True)
        else:  # the schema also allows naming the weights directly (the 0.38 SDK never does)
            if field_of(body, "record_stability_info", bool, False):
                raise InvalidRequest(
                    "record_stability_info: records belong to a session; sample through a sampling "
                    "session (sampling_session_id)"
                )
            target, of = await target_of(
                owner, field_of(body, "model_path", str, None), field_of(body, "base_model", str, None)
            )
            key = None
        args = {
            "target": target,
            "prompt": prompt,
            "num_samples": num_samples,
            "sampling_params": params,
            "include_prompt_logprobs": field_of(body, "prompt_logprobs", bool, False),
            "topk_prompt_logprobs": topk or None,
            "topk_sample_logprobs": field_of(body, "topk_sample_logprobs", int, 0) or None,
            "prompt_logprobs_last_n": field_of(body, "prompt_logprobs_last_n", int, None),
            "target_prompt_logprobs": targets,
            "prompt_alt_tokens_k": field_of(body, "prompt_alt_tokens_k", int, 0) or None,
        }

        async def make() -> dict:
            if of is not None:
                facts = await tinker.model_facts(owner, of)
            else:
                facts = await tinker.facts(owner, target["base_model"])
            bad = next((t for t in prompt if not 0 <= t < facts["vocab_size"]), None)
            if bad is not None:
                raise InvalidRequest(
                    f"prompt: token id {bad} is outside the vocabulary (0..{facts['vocab_size'] - 1})"
                )
            op_id = await tinker.submit(owner, "sample", args)
            request_id = tinker.op_future(
                owner,
                op_id,
                lambda result: _sample_output(
                    result, sparse, records, request_id, prompt, lambda: tinker.bound_records(owner)
                ),
            )
            return {
                "request_id": request_id,
                "sample_sequence_ids": [f"{request_id}.{i}" for i in range(num_samples)],
            }

        return json_response(await (tinker.once(key, make) if key else make()))


def _sample_output(
    result: dict,
    sparse_targets: tuple[list, list] | None,
    records: SequenceRecords | None,
    request_id: str,
    prompt: list[int],
    bound: Callable[[], None] = lambda: None,
) -> Answer:
    """The ``SampleResponse``; each sequence recorded under its ``sequence_id`` (``<request_id>.<i>``,
    the ids ``asample`` answered) first, when the request came through a sampling session."""
    if records is not None:
        for i, sequence in enumerate(result["sequences"]):
            records.add(f"{request_id}.{i}", prompt, sequence["tokens"], sequence["logprobs"])
        bound()
    return Answer(wire.sample_output(result, sparse_targets), "application/x-protobuf")
