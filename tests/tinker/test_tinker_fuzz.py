"""A mutation fuzz of the Tinker routes (the idea of test_fuzz.py, for /api/v1): real SDK-shaped
bodies, JSON and protobuf, with fields dropped, retyped, swapped for huge, negative and NaN values,
truncated, bit-flipped or replaced by random bytes. No answer is a 5xx, every error says why in
``detail``, and afterwards the engine serves and the fuzzed model still trains."""

from __future__ import annotations

import copy
import json
import random

import httpx

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema

from helpers import SENTENCES
from tinker_helpers import TinkerHttp, fb_request, read_fb_output

SEED = 20261201
REQUESTS = 500
ODD = [
    None,
    True,
    "",
    "x" * 3000,
    -1,
    0,
    2**31,
    2**63,
    -(2**63),
    1e308,
    float("nan"),
    [],
    [1, "a"],
    {},
    {"k": 1},
]


def _json_routes(session: str, model: str, sampler: str, tokens: list[int], checkpoint: str, request_id: str):
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tokens}]}
    params = {"max_tokens": 3, "seed": 1, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "stop": ["\n"]}
    return [
        ("POST", "/client/config", {"sdk_version": "0.38.0"}),
        (
            "POST",
            "/create_session",
            {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        ),
        ("POST", "/session_heartbeat", {"session_id": session, "type": "session_heartbeat"}),
        (
            "POST",
            "/create_model",
            {
                "session_id": session,
                "model_seq_id": 7,
                "base_model": "tiny-llama",
                "lora_config": {
                    "rank": 4,
                    "seed": 1,
                    "train_mlp": True,
                    "train_attn": True,
                    "train_unembed": False,
                },
                "optimizer_config": {"type": "adamw"},
            },
        ),
        ("POST", "/get_info", {"model_id": model, "type": "get_info"}),
        (
            "POST",
            "/optim_step",
            {
                "model_id": model,
                "seq_id": 2,
                "adam_params": {
                    "learning_rate": 1e-4,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-8,
                    "weight_decay": 0.0,
                    "grad_clip_norm": 0.0,
                },
            },
        ),
        ("POST", "/save_weights", {"model_id": model, "path": "fz", "seq_id": 3, "overwrite": True}),
        (
            "POST",
            "/save_weights_for_sampler",
            {"model_id": model, "sampling_session_seq_id": 4, "kind": "snapshot", "seq_id": 4},
        ),
        ("POST", "/save_weights_external", {"model_id": model, "path": "fx", "seq_id": 5}),
        (
            "POST",
            "/load_weights",
            {"session_id": session, "model_seq_id": 8, "path": checkpoint, "optimizer": True},
        ),
        ("POST", "/load_weights", {"model_id": model, "seq_id": 6, "path": checkpoint, "optimizer": False}),
        (
            "POST",
            "/create_sampling_session",
            {"session_id": session, "sampling_session_seq_id": 9, "model_path": checkpoint},
        ),
        (
            "POST",
            "/asample",
            {
                "sampling_session_id": sampler,
                "seq_id": 0,
                "num_samples": 2,
                "prompt": prompt,
                "sampling_params": params,
                "prompt_logprobs": True,
                "topk_prompt_logprobs": 2,
                "topk_sample_logprobs": 2,
                "prompt_logprobs_last_n": 2,
                "target_prompt_logprobs": {
                    "data": [1, 2],
                    "dtype": "int64",
                    "shape": [len(tokens) - 1, 2],
                    "sparse_crow_indices": [0, 2] + [2] * (len(tokens) - 2),
                    "sparse_col_indices": [0, 1],
                },
                "prompt_alt_tokens_k": 2,
            },
        ),
        ("POST", "/retrieve_future", {"request_id": request_id, "allow_metadata_only": True}),
        ("POST", "/weights_info", {"tinker_path": checkpoint}),
        (
            "POST",
            "/telemetry",
            {"events": [], "platform": "x", "sdk_version": "0.38.0", "session_id": session},
        ),
        ("GET", f"/training_runs/{model}", None),
        ("GET", f"/training_runs/{model}/checkpoints", None),
        ("GET", "/training_runs", None),
        ("GET", f"/samplers/{sampler}", None),
        ("GET", f"/sessions/{session}", None),
        ("GET", "/checkpoints", None),
        ("PUT", f"/training_runs/{model}/checkpoints/weights/fz/ttl", {"ttl_seconds": 5}),
        ("POST", f"/training_runs/{model}/checkpoints/weights/fz/publish", None),
        ("DELETE", f"/training_runs/{model}/checkpoints/weights/fz/publish", None),
        (
            "POST",
            "/copy_weights",
            {"source_path": checkpoint, "destination_project_id": "p", "ttl_seconds": 7200},
        ),
        ("GET", f"/sessions/{session}/trace_export", None),
        ("GET", "/audit", None),
        ("GET", "/billing/usage/checkpoints/current", None),
    ]


def _mutate_json(rng: random.Random, body):
    kind = rng.choice(["drop", "retype", "retype", "unknown", "raw", "truncate", "top", "deep"])
    if kind == "raw":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 120)))
    if kind == "top":
        return json.dumps(rng.choice(ODD))
    if kind == "deep":
        return "[" * 50_000 + "]" * 50_000
    text = json.dumps(body if body is not None else {})
    if kind == "truncate":
        return text[: rng.randint(0, max(0, len(text) - 1))]
    body = copy.deepcopy(body) if isinstance(body, dict) else {}
    paths = list(_paths(body))
    if not paths:
        return json.dumps({"x": rng.choice(ODD)})
    parent, key = rng.choice(paths)
    if kind == "drop":
        del parent[key]
    elif kind == "unknown" and isinstance(parent, dict):
        parent[f"{key}_x"] = parent[key]
    else:
        parent[key] = rng.choice(ODD)
    return json.dumps(body)


def _paths(node, parent=None, key=None):
    if parent is not None:
        yield parent, key
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in list(children):
        yield from _paths(v, node, k)


def _mutate_proto(rng: random.Random, model: str, tokens: list[int]) -> bytes:
    raw = bytearray(
        fb_request(
            model, rng.choice([1, 2, 50, 10**9]), [tokens], rng.choice(["cross_entropy", "ppo", "gspo"])
        )
    )
    kind = rng.choice(["flip", "truncate", "append", "fields", "random"])
    if kind == "flip":
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if kind == "truncate":
        return bytes(raw[: rng.randrange(len(raw))])
    if kind == "append":
        return bytes(raw) + bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40)))
    if kind == "random":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
    message = schema.ForwardBackwardRequest()
    message.ParseFromString(bytes(raw))
    datum = message.data[0]
    change = rng.choice(["dtype", "shape", "tokens", "sparse", "config", "image", "empty"])
    tensor = datum.loss_fn_inputs["target_tokens"]
    if change == "dtype":
        tensor.dtype = rng.choice([0, 3, 4, 99])
    elif change == "shape":
        del tensor.shape[:]
        tensor.shape.extend(rng.choice([[], [3, 5], [-1], [2**40]]))
    elif change == "tokens":
        datum.model_input[0].encoded_text.tokens = rng.choice([b"\x01", b"\xff" * 8, b""])
    elif change == "sparse":
        tensor.sparse_csr.values = b"\x00" * 16
        tensor.sparse_csr.crow_indices = rng.choice([b"", b"\x05" * 16, b"\x00" * 8])
        tensor.sparse_csr.col_indices = b"\xff" * 16
        tensor.shape.append(rng.choice([3, -2]))
    elif change == "config":
        message.loss_fn_config_v2["clip_low_threshold"].text = "low"
    elif change == "image":
        datum.model_input.add().image.data = b"png"
    else:
        del message.data[:]
    return message.SerializeToString()


def test_mutated_tinker_requests_never_get_a_5xx_and_the_model_trains_after(http_engine, sess_home):
    url = http_engine["url"]
    key = KeyStore(sess_home).add("tinker-fuzz", max_sessions=100)["key"]
    client = TinkerHttp(url, key)
    svc = ServiceClient(url, api_key=key)
    try:
        tokens = svc.get_tokenizer("tiny-llama").encode(SENTENCES[0])
        session = client.session()
        model = client.create_model(session)
        first = client.forward_backward(fb_request(model, 1, [tokens])).json()["request_id"]
        checkpoint = client.result(
            client.ok("/save_weights", {"model_id": model, "seq_id": 2, "path": "start"})["request_id"]
        )["path"]
        saved = client.ok(
            "/save_weights_for_sampler", {"model_id": model, "seq_id": 3, "sampling_session_seq_id": 0}
        )
        sampler = client.result(saved["request_id"])["sampling_session_id"]
        routes = _json_routes(session, model, sampler, tokens, checkpoint, first)
        rng = random.Random(SEED)
        statuses: dict[int, int] = {}
        failures = []
        short_polls = {"x-stainless-read-timeout": "1"}
        for i in range(REQUESTS):
            if i % 4 == 3:
                path = "/forward_backward"
                response = client.forward_backward(_mutate_proto(rng, model, tokens), **short_polls)
                sent = "protobuf"
            else:
                method, path, body = routes[i % len(routes)] if i < len(routes) else rng.choice(routes)
                sent = json.dumps(body) if i < len(routes) else _mutate_json(rng, body)
                if method == "GET":
                    response = client.http.get(
                        path, params={"limit": rng.choice(["5", "-3", "x"])}, headers=short_polls
                    )
                else:
                    response = client.http.request(method, path, content=sent, headers=short_polls)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                failures.append((path, str(sent)[:200], response.text[:300]))
            elif response.status_code >= 400:
                assert response.json()["detail"], (path, response.text[:300])
        assert failures == [], failures[:5]
        assert sum(statuses.values()) == REQUESTS and statuses.get(400, 0) > 100, statuses
        # the engine keeps serving, and the fuzzed model still trains
        assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}
        seq = svc.transport.call("session_info", {"name": model.replace(":", ".")})["next_seq"]
        losses = []
        for step in range(3):
            answer = client.result(
                client.forward_backward(fb_request(model, seq + 2 * step, [tokens])).json()["request_id"]
            )
            losses.append(read_fb_output(answer)[1]["loss:sum"])
            optim = {"model_id": model, "seq_id": seq + 2 * step + 1, "adam_params": {"learning_rate": 1e-2}}
            client.result(client.ok("/optim_step", optim)["request_id"])
        assert losses[-1] < losses[0], losses
    finally:
        for summary in svc.list_sessions(status_equals="Running"):
            svc.stop_session(summary.name)
        client.close()
        svc.close()
