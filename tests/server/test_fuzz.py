"""A mutation fuzz of real request bodies over HTTP: no answer is a 5xx and the engine keeps serving.

The bodies start as what the SDK really sends on every route (sess routes and the OpenAI ones), then
a seeded generator drops fields, swaps types, sends huge, negative and NaN numbers, long strings,
unknown fields, deep nesting, truncated JSON and random bytes. Afterwards the fuzzed session still
trains.
"""

from __future__ import annotations

import copy
import json
import random

import httpx
import numpy as np

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from sess.engine.protocol.home import read_local_key

SEED = 20261130
REQUESTS = 600
ODD_VALUES = [
    None,
    True,
    "",
    "x" * 5000,
    -1,
    0,
    2**63,
    -(2**63) - 1,
    1e308,
    float("nan"),
    float("inf"),
    [],
    [1, "a", None],
    {},
    {"unexpected": 1},
    "sess://../../etc/passwd",
    "\udcff",
]


def _nasty(session: str) -> list[tuple[str, str, str]]:
    """Bodies that each once answered 500: deep nesting, lone surrogates and NULs in text, huge
    integers."""
    deep = '{"a":' * 900 + "1" + "}" * 900
    return [
        (
            "POST",
            "/api/call",
            '{"name": "create_session", "args": {"base_model": "tiny-llama", "user_metadata": ' + deep + "}}",
        ),
        (
            "POST",
            "/api/call",
            json.dumps({"name": "create_session", "args": {"base_model": "\udcff", "name": "x"}}),
        ),
        ("POST", "/api/call", json.dumps({"name": "tokenizer_files", "args": {"base_model": "a\x00b"}})),
        ("POST", "/api/call", json.dumps({"name": "list_sessions", "args": {"name_contains": 5}})),
        ("POST", "/v1/completions", json.dumps({"model": session, "prompt": "\udcff", "max_tokens": 2})),
        (
            "POST",
            "/v1/chat/completions",
            json.dumps({"model": session, "messages": [{"role": "user", "content": "\udcff"}]}),
        ),
        ("POST", "/api/submit", "[" * 100_000 + "]" * 100_000),
        ("POST", "/api/wait", '{"op_id": "x", "timeout": 1' + "0" * 400 + "}"),  # float() overflowed
        (
            "POST",
            "/api/submit",
            '{"name": "sample", "args": {"target": {"base_model": "tiny-llama"}, "prompt": [1, 2], '
            '"sampling_params": {"top_p": 1' + "0" * 400 + "}}}",
        ),
    ]


def _datum(tokens: list[int], **arrays) -> dict:
    inputs = {
        "target_tokens": np.array(tokens[1:]),
        **{k: np.asarray(v, np.float32) for k, v in arrays.items()},
    }
    return Datum(ModelInput.from_ints(tokens[:-1]), inputs).to_wire()


def _bodies(session: str, tokens: list[int], checkpoint: str, op_id: str) -> list[tuple[str, str, object]]:
    """(method, path, body or query) for every route, as the SDK sends them."""
    n = len(tokens) - 1
    ce = _datum(tokens, weights=np.ones(n))
    rl = _datum(tokens, logprobs=-np.ones(n), advantages=np.ones(n))
    sampling = SamplingParams(max_tokens=4, seed=1, stop=["\n"]).to_wire()
    target = {"session": session}
    calls = {
        "list_base_models": {},
        "model_windows": {},
        "create_session": {"base_model": "tiny-llama", "name": None, "rank": 4, "alpha": 8.0, "seed": 1},
        "create_session_from_state": {"path": checkpoint, "name": None, "with_optimizer": True},
        "list_sessions": {"name_contains": "fuzz", "status_equals": "Running", "max_results": 5},
        "get_usage": {"name": session},
        "tokenizer_files": {"base_model": "tiny-llama"},
        "list_checkpoints": {"session": session},
        "session_info": {"name": session},
        "stop_session": {"name": "no-such-session"},
        "delete_session": {"name": "no-such-session", "stop_if_active": False},
    }
    submits = {
        "forward": {"data": [ce], "loss_fn": "cross_entropy", "loss_fn_config": None},
        "forward_backward": {"data": [rl], "loss_fn": "ppo", "loss_fn_config": {"clip_low_threshold": 0.9}},
        "optim_step": {"adam_params": AdamParams(learning_rate=1e-3).to_wire()},
        "save_weights": {"name": None, "merge": False, "transient": True},
        "save_state": {"name": "fuzzed"},
        "load_state": {"path": checkpoint, "with_optimizer": False},
        "noop": {},
        "sample": {"target": target, "prompt": tokens, "num_samples": 2, "sampling_params": sampling},
        "compute_logprobs": {"target": target, "prompt": tokens},
    }
    routes = [("POST", "/api/call", {"name": name, "args": args}) for name, args in calls.items()]
    routes += [
        (
            "POST",
            "/api/submit",
            {"name": name, "args": args, "session": session, "seq": 10**6, "client_token": None},
        )
        for name, args in submits.items()
    ]
    routes += [
        ("POST", "/api/wait", {"op_id": op_id, "timeout": 0.0}),
        ("POST", "/api/heartbeat", {"sessions": [session]}),
        ("GET", "/api/checkpoints/files", {"path": checkpoint}),
        ("GET", "/api/checkpoints/file", {"path": checkpoint, "file": "adapter_config.json"}),
        ("GET", "/api/usage", {"name": session}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": session, "prompt": "Hi", "max_tokens": 3, "n": 1, "seed": 2}),
        (
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny-llama",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "stop": "\n",
            },
        ),
        ("GET", "/healthz", None),
    ]
    return routes


def _mutate(rng: random.Random, body):
    """One mutation of a JSON body, or raw bytes that are not one."""
    kind = rng.choice(["drop", "retype", "retype", "nested", "unknown", "deep", "raw", "truncate", "top"])
    if kind == "raw":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
    if kind == "deep":
        depth = rng.choice([500, 5000, 200_000])
        if rng.random() < 0.5:
            return ("[" * depth + "]" * depth).encode()
        return '{"a":[' * depth + json.dumps(body) + "]}" * depth
    if kind == "top":
        return json.dumps(rng.choice(ODD_VALUES[:14]))
    text = json.dumps(body) if body is not None else "{}"
    if kind == "truncate":
        return text[: rng.randint(0, max(0, len(text) - 1))]
    body = copy.deepcopy(body) if isinstance(body, dict) else {}
    paths = list(_paths(body))
    if not paths:
        body["x"] = rng.choice(ODD_VALUES)
        return json.dumps(body)
    parent, key = rng.choice(paths)
    if kind == "drop":
        del parent[key]
    elif kind == "unknown":
        if isinstance(parent, dict):
            parent[f"{key}_typo"] = parent[key]
        else:
            parent.append(parent[key])
    elif kind == "nested":
        parent[key] = _nest(parent[key], rng.choice([3, 50, 400]))
    else:
        parent[key] = rng.choice(ODD_VALUES)
    return json.dumps(body)


def _paths(node, parent=None, key=None):
    if parent is not None:
        yield parent, key
    if isinstance(node, dict):
        for k in list(node):
            yield from _paths(node[k], node, k)
    elif isinstance(node, list):
        for i in range(len(node)):
            yield from _paths(node[i], node, i)


def _nest(value, depth: int):
    for _ in range(depth):
        value = {"a": [value]}
    return value


def test_mutated_requests_never_get_a_5xx_and_the_session_trains_after(http_engine, sess_home):
    running_before = {s.name for s in ServiceClient(http_engine["url"], home=sess_home).list_sessions()}
    url = http_engine["url"]
    key = read_local_key(sess_home)
    svc = ServiceClient(url, home=sess_home)
    try:
        _fuzz(svc, url, key)
    finally:  # sessions the mutated requests created would hold this key's live-session slots
        for summary in svc.list_sessions(status_equals="Running"):
            if summary.name not in running_before:
                svc.stop_session(summary.name)
        svc.close()


def _fuzz(svc: ServiceClient, url: str, key: str) -> None:
    tc = svc.create_lora_training_client(
        "tiny-llama", rank=4, alpha=8, seed=0, training_session_name="fuzz-target"
    )
    tok = tc.get_tokenizer()
    tokens = tok.encode("Two plus three is five.")
    tc.forward_backward([tokens]).result()
    checkpoint = tc.save_state(name="fuzz-start").result().path
    op_id = svc.transport.submit("compute_logprobs", {"target": {"session": tc.name}, "prompt": tokens})
    rng = random.Random(SEED)
    routes = _bodies(tc.name, tokens, checkpoint, op_id)
    statuses: dict[int, int] = {}
    server_errors = []
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=120) as http:
        for method, path, content in _nasty(tc.name):
            response = http.request(method, path, content=content)
            assert 400 <= response.status_code < 500, (path, content[:80], response.text[:300])
        for i in range(REQUESTS):
            method, path, body = routes[i % len(routes)] if i < len(routes) else rng.choice(routes)
            if method == "GET":
                params = dict(body or {})
                if params and rng.random() < 0.8:
                    name = rng.choice(list(params))
                    params[name] = str(rng.choice(ODD_VALUES[:-1])) if rng.random() < 0.7 else None
                    params = {k: v for k, v in params.items() if v is not None}
                response = http.get(path, params=params)
            else:
                content = json.dumps(body) if i < len(routes) else _mutate(rng, body)
                headers = {} if rng.random() < 0.95 else {"authorization": "Bearer wrong"}
                response = http.request(method, path, content=content, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                server_errors.append(
                    (path, str(content)[:200] if method != "GET" else params, response.text[:300])
                )
            else:
                assert response.status_code < 300 or "error" in response.json(), response.text[:300]
    assert server_errors == [], server_errors[:5]
    assert sum(statuses.values()) == REQUESTS and statuses.get(400, 0) > 100
    # the engine keeps serving, and the fuzzed session still trains
    assert httpx.get(f"{url}/healthz").json()["ok"]
    again = svc.get_training_client(tc.name)
    losses = []
    for _ in range(3):
        fb = again.forward_backward([tokens])
        opt = again.optim_step(AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    assert losses[-1] < losses[0]
    again.stop()
