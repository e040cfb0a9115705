"""Tinker training routes: create a model (fresh or from a checkpoint), get its info, and its ops.

A model is a sess session (:mod:`.ids`); ``forward_backward`` (also ``forward``, with
``forward_only``), ``optim_step``, the saves and the in-place load are that session's ordered ops
with the SDK's ``seq_id`` as their sequence number, so the engine runs them in the order the
client called them even when requests arrive out of order. Each POST answers at once with a
request id (:mod:`.futures`); a re-sent POST for the same model and ``seq_id`` gets the same one.
Bad input is refused at once with a 400 that names the field, and its ``seq_id`` is used up so
the model's later ops still run.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import check_name
from sess.engine.protocol.data_checks import REQUIRED_INPUTS, check_data, check_loss_fn
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.runtime.models.model_policy import model_name
from sess.engine.server.tinker import fields, ids, provenance, wire
from sess.engine.server.tinker.request_futures import Answer
from sess.engine.server.tinker.session_room import make_room
from sess.engine.server.tinker.state import Sampler, Tinker, field_of, json_response

LOSSES = ", ".join(REQUIRED_INPUTS)
# Tinker's LoRA scale: alpha 32 at every rank, so the update is scaled by 32 / rank (LoraConfig has
# no alpha field; tinker-cookbook's hyperparam_utils.get_lora_lr_over_full_finetune_lr assumes
# lora_alpha=32 and a learning rate that does not depend on the rank, and its weights/README.md lists
# lora_alpha 32 for Tinker's adapters). sess's own SDK defaults to alpha 64 and lets users choose.
TINKER_LORA_ALPHA = 32.0
# sess's optim_step metrics under Tinker's "name:reduction" keys
OPTIM_METRICS = {"grad_norm": "grad_norm:mean", "learning_rate": "learning_rate:mean", "step": "step:max"}


def _optimizer(body: dict, field: str) -> None:
    config = field_of(body, field, dict, {})
    if config.get("type", "adamw") not in ("adam", "adamw"):
        raise InvalidRequest(f"{field}.type: {str(config.get('type'))[:40]!r}: {fields.ADAMW_ONLY}")


def _seq(body: dict, field: str = "seq_id", low: int = 1) -> int:
    seq = field_of(body, field, int)
    if not low <= seq < 1 << 31:
        raise InvalidRequest(f"{field}: expected an integer from {low}, got {seq}")
    return seq


def add_routes(route, tinker: Tinker) -> None:
    async def new_model(request: Request, body: dict, create) -> Response:
        """Create-model and create-via-load: model ``<session>:train:<model_seq_id>``, made once."""
        owner = tinker.owner(request)
        session = tinker.session(owner, field_of(body, "session_id", str))
        model_id = ids.model_id(session.id, _seq(body, "model_seq_id", low=0))
        name = ids.sess_name(model_id)

        async def make() -> dict:
            work = await create(owner, name)

            async def run() -> Answer:
                await make_room(tinker, owner)  # an exited client's session goes first
                answer = await work
                session.models.add(name)
                if session.project_id or session.display_name:  # list_training_runs filters by project
                    tinker.engine.registry.tag_run(name, owner, session.project_id, session.display_name)
                # the SDK heart-beats its session from its start (every 10 s): a model whose client
                # exits before its first beat is released after the heartbeat lapse too
                tinker.engine.heartbeat(owner, [name])
                return answer

            return {"request_id": tinker.task_future(owner, run()), "model_id": model_id}

        return json_response(await tinker.once((owner, "model", model_id), make))

    async def ordered(request: Request, body: dict, prepare) -> Response:
        """One of a model's ordered ops: ``prepare(owner, name)`` checks the request and returns
        (op, args, convert). The same (model, seq_id) always gets one request id, and a request
        refused here still uses up its seq_id, so the model's later ops run."""
        owner = tinker.owner(request)
        model_id = field_of(body, "model_id", str)
        seq = _seq(body)
        name = ids.sess_name(model_id)

        async def make() -> dict:
            try:
                op, args, convert = await prepare(owner, name)
            except Exception:  # a refusal, or a bug of ours (a 500): either way later ops must not wait
                await tinker.skip(owner, name, seq)  # does nothing for another key's model
                raise
            op_id = await tinker.submit(owner, op, args, session=name, seq=seq)
            return {"request_id": tinker.op_future(owner, op_id, convert), "model_id": model_id}

        return json_response(await tinker.once((owner, "op", name, seq), make))

    @route("POST", "/create_model")
    async def create_model(request: Request) -> Response:
        body = await tinker.json(request)
        base_model = field_of(body, "base_model", str)
        lora = field_of(body, "lora_config", dict, {})
        _optimizer(body, "optimizer_config")
        metadata = field_of(body, "user_metadata", dict, None)

        async def create(owner: str, name: str):
            args = {
                k: lora[k] for k in ("rank", "seed", "train_mlp", "train_attn", "train_unembed") if k in lora
            }
            args.update(name=name, base_model=base_model, user_metadata=metadata, alpha=TINKER_LORA_ALPHA)
            rq.CreateSession.from_wire(args)  # a bad rank or flag is a 400 now, not a failed future
            model_name(tinker.engine.runtime.home, owner, base_model)  # so is a model not served

            async def run() -> Answer:
                facts = await tinker.facts(owner, base_model)  # loads the model the first time
                await tinker.call(owner, "create_session", {**args, "base_model": facts["base_model"]})
                tinker.model_names[name] = base_model
                return Answer.of({"model_id": ids.run_id(name), "type": "create_model"})

            return run()

        return await new_model(request, body, create)

    @route("POST", "/load_weights")
    async def load_weights(request: Request) -> Response:
        body = await tinker.json(request)

        async def checked_path(owner: str) -> str:
            _optimizer(body, "optimizer_config")
            if body.get("weights_access_token") is not None:
                raise InvalidRequest(
                    "weights_access_token: access tokens are not used by this engine; the checkpoint's "
                    "owner publishes it (publish_checkpoint_from_tinker_path) for every key to load"
                )
            path = ids.to_sess_path(field_of(body, "path", str))
            # another key's checkpoint, or none at all, is a 404 now rather than a failed future
            await tinker.call(owner, "checkpoint_files", {"path": path})
            return path

        if body.get("session_id") is None:  # the deprecated in-place load_state

            async def prepare(owner: str, name: str):
                args = {
                    "path": await checked_path(owner),
                    "with_optimizer": field_of(body, "optimizer", bool),
                }
                return "load_state", args, _load_answer(body)

            return await ordered(request, body, prepare)

        async def create(owner: str, name: str):
            args = {
                "path": await checked_path(owner),
                "name": name,
                "with_optimizer": field_of(body, "optimizer", bool),
                "user_metadata": field_of(body, "user_metadata", dict, None),
            }
            source = ids.sess_name(body["path"][len("tinker://") :].split("/")[0], "path")
            await _same_base_model(tinker, owner, body, args["path"])

            async def run() -> Answer:
                await tinker.call(owner, "create_session_from_state", args)
                if source in tinker.model_names:
                    tinker.model_names[name] = tinker.model_names[source]
                return Answer.of({"path": body["path"], "model_id": ids.run_id(name), "type": "load_weights"})

            return run()

        return await new_model(request, body, create)

    @route("POST", "/get_info")
    async def get_info(request: Request) -> Response:
        owner = tinker.owner(request)
        model_id = field_of(await tinker.json(request), "model_id", str)
        name, summary, facts = await tinker.model(owner, model_id)
        model_name = tinker.client_model_name(name, summary, facts)
        lora = summary.get("lora") or {}
        return json_response(
            {
                "model_id": model_id,
                "type": "get_info",
                "model_data": {
                    "arch": facts["arch"],
                    "model_name": model_name,
                    "tokenizer_id": tinker.tokenizer_id(name, summary, facts),
                },
                "is_lora": True,
                "lora_rank": lora.get("rank"),
                "model_name": model_name,
                "optimizer_config": {"type": "adamw"},
            }
        )

    @route("POST", "/forward_backward")
    async def forward_backward(request: Request) -> Response:
        if "zstd" in request.headers.get("content-encoding", ""):
            raise InvalidRequest(
                "body: zstd-compressed; this engine's client config sets proto_compress_fwdbwd=false"
            )
        message = wire.parse_training_request(await tinker.body(request))

        async def prepare(owner: str, name: str):
            batch = wire.read_training_batch(message)  # refused here, the seq_id is still used up
            if batch.loss_fn not in REQUIRED_INPUTS:
                check_loss_fn(batch.loss_fn[:40], None)  # a loss refused with its reason
                raise InvalidRequest(
                    f"loss_fn: {batch.loss_fn[:40]!r} is not supported by this engine; supported: {LOSSES}"
                )
            records = tinker.records_of(owner, ids.session_of_model(message.model_id))
            provenance.apply(batch.data, batch.spans, records, batch.loss_fn)
            facts = await tinker.model_facts(owner, name)
            check_data(batch.data, batch.loss_fn, vocab_size=facts["vocab_size"])
            args = {
                "data": batch.data,
                "loss_fn": batch.loss_fn,
                "loss_fn_config": batch.loss_fn_config or None,
            }
            return ("forward" if batch.forward_only else "forward_backward"), args, _training_output

        return await ordered(request, {"model_id": message.model_id, "seq_id": message.seq_id}, prepare)

    @route("POST", "/optim_step")
    async def optim_step(request: Request) -> Response:
        body = await tinker.json(request)

        async def prepare(owner: str, name: str):
            params = field_of(body, "adam_params", dict, None)
            if params is None:
                field = "optimizer_params" if "optimizer_params" in body else "adam_params"
                raise InvalidRequest(
                    f"{field}: {'missing; ' if field == 'adam_params' else ''}{fields.ADAMW_ONLY}"
                )
            return "optim_step", {"adam_params": params}, _optim_output

        return await ordered(request, body, prepare)

    @route("POST", "/save_weights")
    async def save_weights(request: Request) -> Response:
        body = await tinker.json(request)

        async def prepare(owner: str, name: str):
            checkpoint = check_name(field_of(body, "path", str), "path")
            if not field_of(body, "overwrite", bool, False):
                target = ids.to_sess_path(f"tinker://{ids.run_id(name)}/weights/{checkpoint}")
                saved = await tinker.call(owner, "list_checkpoints", {"session": name})
                if any(c["path"] == target for c in saved):
                    raise InvalidRequest(
                        f"path: a checkpoint named {checkpoint!r} exists; pass overwrite=True or another name"
                    )
            return "save_state", {"name": checkpoint, **_lifecycle(body)}, _path_output("save_weights")

        return await ordered(request, body, prepare)

    @route("POST", "/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> Response:
        body = await tinker.json(request)

        async def prepare(owner: str, name: str):
            if body.get("path") is not None:
                checkpoint = check_name(field_of(body, "path", str), "path")
                args = {"name": checkpoint, **_lifecycle(body)}
                return "save_weights", args, _path_output("save_weights_for_sampler")
            # no name: a snapshot for sampling session <session>:sample:<sampling_session_seq_id>
            number = _seq(body, "sampling_session_seq_id", low=0)
            model_id = ids.run_id(name)
            sampler_id = ids.sampler_id(ids.session_of_model(model_id) or name, number)
            kind = body.get("kind", "snapshot")
            if kind not in (None, "snapshot", "inflight"):
                raise InvalidRequest(f"kind: expected 'snapshot' or 'inflight', got {str(kind)[:40]!r}")
            inflight = kind == "inflight"

            def convert(result: dict) -> Answer:
                target = {"model_path": result["path"]}
                if inflight:  # every inflight sampler of this model now samples the newest weights
                    for other in tinker.samplers.values():
                        if other.inflight and other.session == name and other.owner == owner:
                            other.target = dict(target)
                tinker.add_sampler(Sampler(sampler_id, owner, target, name, inflight=inflight))
                return Answer.of({"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})

            return "save_weights", {"transient": True, **_lifecycle(body)}, convert

        return await ordered(request, body, prepare)

    @route("POST", "/save_weights_external")
    async def save_weights_external(request: Request) -> Response:
        body = await tinker.json(request)

        async def prepare(owner: str, name: str):
            checkpoint = check_name(field_of(body, "path", str), "path")
            if body.get("age_encryption_recipients"):
                raise InvalidRequest(
                    "age_encryption_recipients: encrypted exports are not supported by this engine"
                )
            args = {"name": checkpoint, "merge": True, **_lifecycle(body)}
            return "save_weights", args, _path_output("save_weights_external")

        return await ordered(request, body, prepare)


def _training_output(result: dict) -> Answer:
    return Answer(wire.training_output(result), "application/x-protobuf")


def _optim_output(result: dict) -> Answer:
    return Answer.of(
        {"metrics": {OPTIM_METRICS.get(k, f"{k}:mean"): float(v) for k, v in result["metrics"].items()}}
    )


def _path_output(kind: str):
    return lambda result: Answer.of({"path": ids.to_tinker_path(result["path"]), "type": kind})


def _load_answer(body: dict):
    return lambda result: Answer.of(
        {"path": body["path"], "model_id": body["model_id"], "type": "load_weights"}
    )


def _lifecycle(body: dict) -> dict:
    """A save's ``ttl_seconds`` and ``user_metadata``, checked by the engine's request types
    (out of range: a 400 naming the field)."""
    return {k: body[k] for k in ("ttl_seconds", "user_metadata") if body.get(k) is not None}


async def _same_base_model(tinker: Tinker, owner: str, body: dict, path: str) -> None:
    """A ``base_model`` given with a load must be the checkpoint's own (any spelling of it)."""
    wanted = field_of(body, "base_model", str, None)
    if wanted is None:
        return
    saved = (await tinker.call(owner, "checkpoint_info", {"path": path}))["base_model"]
    # the served name of any spelling (hub id, a path named after it), without loading a model
    if model_name(tinker.engine.runtime.home, owner, wanted) != saved:
        raise InvalidRequest(
            f"base_model: {wanted[:120]!r} differs from the checkpoint's base model {saved!r}; "
            "a checkpoint loads onto the base model it was trained on (leave base_model out)"
        )
