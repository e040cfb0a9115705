"""The Tinker routes over plain HTTP: the protocol's shapes, futures and retries, bad input, and both
protocols on one engine (the real tinker SDK is exercised in test_tinker_sdk.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import NotFound, ServiceClient
from sess.engine.protocol.home import read_local_key
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema

from helpers import SENTENCES, ce_datum
from tinker_helpers import TinkerHttp, fb_request, read_fb_output


@pytest.fixture(scope="module")
def keys(sess_home):
    """Two keys of their own (so these sessions never count against other tests' limits)."""
    store = KeyStore(sess_home)
    return store.add("tinker-a")["key"], store.add("tinker-b")["key"]


@pytest.fixture()
def a(http_engine, keys):
    client = TinkerHttp(http_engine["url"], keys[0])
    yield client
    client.close()


@pytest.fixture()
def b(http_engine, keys):
    client = TinkerHttp(http_engine["url"], keys[1])
    yield client
    client.close()


@pytest.fixture()
def tokens(http_engine, sess_home):
    svc = ServiceClient(http_engine["url"], home=sess_home)
    tok = svc.get_tokenizer("tiny-llama")
    yield [tok.encode(s) for s in SENTENCES[:3]]
    svc.close()


def _model(client: TinkerHttp) -> tuple[str, str]:
    session = client.session()
    return session, client.create_model(session)


def _usage(url: str, key: str, model_id: str) -> dict:
    import httpx

    name = model_id.replace(":", ".")
    answer = httpx.get(f"{url}/api/usage", params={"name": name}, headers={"x-api-key": key}).json()
    return {op: row["count"] for op, row in answer["operations"].items()}


def test_client_config_refuses_untested_sdk_versions_at_once(a, http_engine):
    config = a.ok("/client/config", {"sdk_version": "0.38.0"})
    assert config["parallel_fwdbwd_chunks"] is False and config["use_pyqwest_transport"] is False
    for version in ("0.34.0", "0.35.2", "0.36.0", "0.37.1"):  # the range tinker-cookbook 0.5.x accepts
        assert a.ok("/client/config", {"sdk_version": version}) == config
    for version in ("0.24.0", "0.33.1", "0.39.1", "1.0.0", None):
        response = a.post("/client/config", {"sdk_version": version})
        assert response.status_code == 400 and response.headers["x-should-retry"] == "false"
        assert "tinker>=0.34,<0.39" in response.json()["detail"], response.text
    assert TinkerHttp(http_engine["url"], "tml-wrong").post("/client/config", {}).status_code == 401
    assert a.ok("/client/dynamic_config", {"sdk_version": "0.38.0"}) == {"sample_cancel_enabled": False}
    assert a.http.get("/healthz").json() == {"status": "ok"}
    supported = {
        m["model_name"]: m for m in a.http.get("/get_server_capabilities").json()["supported_models"]
    }
    assert supported["tiny-llama"]["max_context_length"] == 4096  # tinker's SupportedModel field
    assert supported["smollm2-135m"]["max_context_length"] == 8192


def test_training_ops_in_protobuf_and_a_resent_post_runs_once(a, tokens, http_engine, keys):
    session, model = _model(a)
    assert model == f"{session}:train:0"
    info = a.ok("/get_info", {"model_id": model})
    assert info["lora_rank"] == 4 and info["model_data"]["tokenizer_id"].endswith("tiny-llama")
    body = fb_request(model, 1, tokens)
    first = a.forward_backward(body)
    again = a.forward_backward(body)  # the SDK's retry of a POST whose answer it lost: same body
    assert first.status_code == again.status_code == 200
    assert first.json()["request_id"] == again.json()["request_id"]
    logprobs, metrics = read_fb_output(a.result(first.json()["request_id"]))
    assert [len(lp) for lp in logprobs] == [len(t) - 1 for t in tokens]
    assert abs(metrics["loss:sum"] + sum(float(lp.sum()) for lp in logprobs)) < 1e-3
    optim = {
        "model_id": model,
        "seq_id": 2,
        "adam_params": {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
    }
    step = a.ok("/optim_step", optim)
    assert a.ok("/optim_step", optim)["request_id"] == step["request_id"]
    assert a.result(step["request_id"])["metrics"]["step:max"] == 1
    forward = a.forward_backward(fb_request(model, 3, tokens, forward_only=True)).json()
    after, _ = read_fb_output(a.result(forward["request_id"]))
    assert sum(float(lp.sum()) for lp in after) > sum(float(lp.sum()) for lp in logprobs)  # it learned
    assert _usage(http_engine["url"], keys[0], model) == {
        "create_session": 1,
        "forward_backward": 1,
        "optim_step": 1,
        "forward": 1,
    }
    # an answered future can be fetched again (a poll whose answer was lost)
    assert a.result(step["request_id"])["metrics"]["step:max"] == 1


def test_a_long_op_answers_try_again_with_its_queue_state(a, tokens):
    _, model = _model(a)
    long = [tokens[0] * 8] * 24
    request_id = a.forward_backward(fb_request(model, 1, long)).json()["request_id"]
    answer = a.http.post(
        "/retrieve_future",
        json={"request_id": request_id, "allow_metadata_only": True},
        headers={"x-stainless-read-timeout": "0"},  # hold the poll 0 s: answer at once
    ).json()
    assert answer["type"] == "try_again" and answer["request_id"] == request_id
    assert answer["queue_state"] == "active" and "queued on the engine" in answer["queue_state_reason"]
    assert isinstance(a.result(request_id), bytes)


def test_sampling_session_prompt_logprobs_and_sequence_ids(a, tokens):
    session, model = _model(a)
    saved = a.ok("/save_weights_for_sampler", {"model_id": model, "seq_id": 1, "sampling_session_seq_id": 0})
    sampler = a.result(saved["request_id"])["sampling_session_id"]
    assert sampler == f"{session}:sample:0"
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 2,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[0]}]},
        "sampling_params": {"max_tokens": 4, "seed": 3, "temperature": 1.0, "top_k": -1, "top_p": 1.0},
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
    }
    posted = a.ok("/asample", body)
    assert a.ok("/asample", body) == posted and len(set(posted["sample_sequence_ids"])) == 2
    out = schema.SampleResponse()
    out.ParseFromString(a.result(posted["request_id"]))
    assert [len(np.frombuffer(s.tokens, "<i4")) for s in out.sequences] == [4, 4]
    prompt_lp = np.frombuffer(out.prompt_logprobs, "<f4")
    assert len(prompt_lp) == len(tokens[0]) and np.isnan(prompt_lp[0]) and np.all(prompt_lp[1:] < 0)
    top = out.topk_prompt_logprobs
    assert (top.k, top.length) == (2, len(tokens[0]))
    ids = np.frombuffer(top.token_ids, "<i4").reshape(-1, 2)
    lps = np.frombuffer(top.logprobs, "<f4").reshape(-1, 2)
    assert tuple(ids[0]) == (0, 0) and np.all(lps[0] == -99999.0)  # the SDK's "no entry" row
    assert np.all(lps[1:, 0] >= lps[1:, 1]) and np.all(lps[1:, 0] >= prompt_lp[1:] - 1e-5)


def test_bad_input_gets_a_4xx_that_says_why_and_the_model_keeps_training(a, b, tokens):
    session, model = _model(a)
    saved = a.result(a.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "mine"})["request_id"])
    checkpoint = saved["path"]
    assert checkpoint == f"tinker://{model}/weights/mine"
    cases = [
        (a.post("/forward_backward", content=b"\xff\x00garbage"), 400, "protobuf"),
        (a.forward_backward(fb_request(model, 2, [[1, 2, 10**6]])), 400, "outside the vocabulary"),
        (
            a.forward_backward(
                fb_request(model, 3, tokens, "stable_reinforce", config={"clip_low_threshold": 0.5})
            ),
            400,
            "clip_low_threshold",
        ),
        (a.post("/optim_step", {"model_id": model, "seq_id": "four"}), 400, "seq_id"),
        (
            a.post("/optim_step", {"model_id": model, "seq_id": 4, "adam_params": {"learning_rate": "hot"}}),
            400,
            "learning_rate",
        ),
        (
            a.post(
                "/create_model",
                {"session_id": "tk-000000000000", "model_seq_id": 0, "base_model": "tiny-llama"},
            ),
            404,
            "session",
        ),
        (a.post("/get_info", {"model_id": "tk-000000000000:train:0"}), 404, "not found"),
        (
            a.post(
                "/create_model",
                {
                    "session_id": session,
                    "model_seq_id": 1,
                    "base_model": "tiny-llama",
                    "lora_config": {"rank": 0},
                },
            ),
            400,
            "rank",
        ),
        (a.post("/save_weights", {"model_id": model, "seq_id": 5, "path": "mine"}), 400, "exists"),
        (a.post("/save_weights", {"model_id": model, "seq_id": 6, "path": "../up"}), 400, "not a valid name"),
        (
            a.post(
                "/load_weights",
                {"model_id": model, "seq_id": 7, "path": "tinker://elsewhere", "optimizer": False},
            ),
            400,
            "tinker://",
        ),
        (
            a.post(
                "/asample",
                {"sampling_session_id": "nope", "seq_id": 0, "prompt": {"chunks": []}, "sampling_params": {}},
            ),
            404,
            "sampling session",
        ),
        (a.post("/create_custom_loss", {}), 400, "not supported"),
        (a.post("/retrieve_future", {"request_id": "req-unknown"}), 404, "no future"),
        (a.post("/session_heartbeat", {"session_id": 5}), 400, "session_id"),
        (a.post("/create_session", content=b"[1,2"), 400, "malformed JSON"),
        # another key sees nothing of a's: its model, checkpoint and session are not found
        (b.post("/get_info", {"model_id": model}), 404, "not found"),
        (
            b.post(
                "/load_weights",
                {"session_id": b.session(), "model_seq_id": 0, "path": checkpoint, "optimizer": True},
            ),
            404,
            "not found",
        ),
        (
            b.post(
                "/create_sampling_session",
                {"session_id": session, "sampling_session_seq_id": 0, "model_path": checkpoint},
            ),
            404,
            "session",
        ),
        (b.http.get(f"/training_runs/{model}"), 404, "not found"),
        (b.post("/weights_info", {"tinker_path": checkpoint}), 404, "not found"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, (words, response.status_code, response.text[:300])
        assert words in response.json()["detail"], (words, response.text[:300])
        if status == 400:
            assert response.headers.get("x-should-retry") == "false"
    # the refused ops used up their seq_ids (2..7), so the model's next op runs at once
    answer = a.result(a.forward_backward(fb_request(model, 8, tokens)).json()["request_id"])
    assert read_fb_output(answer)[1]["loss:sum"] > 0
    sampler = a.ok(
        "/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "model_path": checkpoint},
    )
    bad_prompt = {
        "sampling_session_id": sampler["sampling_session_id"],
        "seq_id": 0,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 10**7]}]},
        "sampling_params": {"max_tokens": 2},
    }
    response = a.post("/asample", bad_prompt)
    assert response.status_code == 400 and "outside the vocabulary" in response.json()["detail"]
    image = {
        **bad_prompt,
        "seq_id": 1,
        "prompt": {"chunks": [{"type": "image", "data": "", "format": "png"}]},
    }
    assert "not supported" in a.post("/asample", image).json()["detail"]


def _dtype_bfloat16(message) -> None:
    message.data[0].loss_fn_inputs["weights"].dtype = 4


def _text_option(message) -> None:
    message.loss_fn_config_v2["clip_low_threshold"].text = "low"


def _image_chunk(message) -> None:
    message.data[0].model_input.add().image.data = b"png"


def _empty_chunk(message) -> None:
    message.data[0].model_input.add()


def _token_bytes_not_int32(message) -> None:
    message.data[0].model_input[0].encoded_text.tokens = b"\x01\x02\x03"


def _shape(sizes):
    def change(message) -> None:
        weights = message.data[0].loss_fn_inputs["weights"]
        n = weights.shape[0]
        del weights.shape[:]
        weights.shape.extend([size if size != "n" else n for size in sizes] if sizes else [-n])

    return change


def _sparse(message) -> None:
    weights = message.data[0].loss_fn_inputs["weights"]
    weights.sparse_csr.values = b"\x00" * 4
    weights.sparse_csr.crow_indices = b"\x00" * 16
    weights.sparse_csr.col_indices = b"\x00" * 8
    del weights.shape[:]
    weights.shape.extend([1, 3])


def _no_data(message) -> None:
    del message.data[:]


BATCHES_REFUSED_WHILE_READ = {
    "bfloat16": (_dtype_bfloat16, "dtype 4 is not float32"),
    "text-option": (_text_option, "text values"),
    "image-chunk": (_image_chunk, "image chunk: this engine runs text models: send encoded_text"),
    "empty-chunk": (_empty_chunk, "empty chunk: this engine runs text models"),
    "odd-token-bytes": (_token_bytes_not_int32, "3 bytes is not a whole number of int32"),
    "2-d": (_shape([1, "n"]), "['weights']: shape (1, "),  # (1, n) for n positions
    "3-d": (_shape([1, 1, "n"]), "this engine takes loss inputs of shape (N,) or, for cross_entropy"),
    "negative-shape": (_shape(None), "does not hold"),  # [-n] for n values
    "sparse": (_sparse, "inconsistent sparse CSR"),
    "no-data": (_no_data, "at least one Datum"),
}


@pytest.mark.parametrize(
    "change, words", BATCHES_REFUSED_WHILE_READ.values(), ids=BATCHES_REFUSED_WHILE_READ.keys()
)
def test_a_batch_refused_while_read_uses_up_its_seq_id(a, tokens, change, words):
    """Refused before the model was looked at, a batch once left its seq_id unused: the model's
    next op waited ~2 minutes for it and failed, and every later op after it."""
    _, model = _model(a)
    message = schema.ForwardBackwardRequest()
    message.ParseFromString(fb_request(model, 1, tokens))
    change(message)
    refused = a.forward_backward(message.SerializeToString())
    assert refused.status_code == 400 and words in refused.json()["detail"], refused.text[:300]
    answer = a.result(a.forward_backward(fb_request(model, 2, tokens)).json()["request_id"], timeout=20)
    assert read_fb_output(answer)[1]["loss:sum"] > 0


def test_settings_that_would_poison_a_model_are_400s_and_it_trains_after(a, tokens):
    """The Tinker routes apply the sess protocol's rules: optimizer settings (AdamParams), loss
    options (check_loss_fn) and sampling parameters (SamplingParams)."""
    session, model = _model(a)
    a.result(a.forward_backward(fb_request(model, 1, tokens)).json()["request_id"])
    seq = 2
    for adam, words in [
        ({"eps": 0.0}, "adam_params.eps: expected a value in 1e-20..inf"),
        ({"learning_rate": 1e30}, "adam_params.learning_rate: expected a value in 0.0..1.0"),
        ({"weight_decay": 1e30}, "adam_params.weight_decay"),
    ]:
        response = a.post("/optim_step", {"model_id": model, "seq_id": seq, "adam_params": adam})
        assert response.status_code == 400 and words in response.json()["detail"], response.text[:300]
        seq += 1
    for loss, config, words in [
        ("ppo", {"clip_low_threshold": 2.0, "clip_high_threshold": 0.5}, "clip_low_threshold <= 1 <="),
        ("dro", {"beta": -1.0}, "loss_fn_config.beta"),
    ]:
        response = a.forward_backward(fb_request(model, seq, tokens, loss, config=config))
        assert response.status_code == 400 and words in response.json()["detail"], response.text[:300]
        seq += 1
    step = a.ok("/optim_step", {"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": 1e-2}})
    assert a.result(step["request_id"], timeout=20)["metrics"]["step:max"] == 1
    answer = a.result(a.forward_backward(fb_request(model, seq + 1, tokens)).json()["request_id"], timeout=20)
    assert np.isfinite(read_fb_output(answer)[1]["loss:sum"])
    saved = a.ok(
        "/save_weights_for_sampler", {"model_id": model, "seq_id": seq + 2, "sampling_session_seq_id": 0}
    )
    sampler = a.result(saved["request_id"])["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": tokens[0]}]}
    for params, words in [
        ({"temperature": 1e39}, "sampling_params.temperature"),
        ({"top_k": 2**63}, "sampling_params.top_k"),
        ({"stop": [2**63]}, "sampling_params.stop"),
        ({"temperature": 10**400}, "body: an integer of 401 digits"),
    ]:
        body = {"sampling_session_id": sampler, "seq_id": seq, "prompt": prompt, "sampling_params": params}
        response = a.post("/asample", body)
        assert response.status_code == 400 and words in response.json()["detail"], response.text[:300]
        seq += 1


def test_both_protocols_share_sessions_per_key_and_hide_them_from_other_keys(a, b, keys, http_engine, tokens):
    url = http_engine["url"]
    session, model = _model(a)
    mine, theirs = ServiceClient(url, api_key=keys[0]), ServiceClient(url, api_key=keys[1])
    try:
        name = model.replace(":", ".")
        assert name in [s.name for s in mine.list_sessions()]
        assert name not in [s.name for s in theirs.list_sessions()]
        with pytest.raises(NotFound):
            theirs.get_training_client(name)
        # a session the sess SDK made is a training run to the Tinker routes, for its own key only
        tc = mine.create_lora_training_client("tiny-llama", rank=4, seed=0)
        state = tc.save_state(name="from-sess").result().path
        run = a.http.get(f"/training_runs/{tc.name}").json()
        assert (
            run["training_run_id"] == tc.name
            and run["last_checkpoint"]["tinker_path"] == f"tinker://{tc.name}/weights/from-sess"
        )
        assert b.http.get(f"/training_runs/{tc.name}").status_code == 404
        loaded = a.ok(
            "/load_weights",
            {
                "session_id": session,
                "model_seq_id": 1,
                "path": f"tinker://{tc.name}/weights/from-sess",
                "optimizer": True,
            },
        )
        assert a.result(loaded["request_id"])["model_id"] == f"{session}:train:1"
        # and a Tinker checkpoint is a sess:// path to the sess SDK of the same key
        saved = a.result(
            a.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "for-sess"})["request_id"]
        )
        clone = mine.create_training_client_from_state(f"sess://{name}/state/for-sess")
        datum = ce_datum(tokens[0])
        assert clone.forward([datum]).result().metrics["loss:sum"] > 0 and saved["path"].endswith(
            "/weights/for-sess"
        )
        listed = a.http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"]
        assert [c["checkpoint_id"] for c in listed] == ["weights/for-sess"]
        assert state.startswith("sess://")
        for client in (tc, clone):
            client.stop()
    finally:
        mine.close()
        theirs.close()


def test_exported_weights_download_through_signed_urls(a, http_engine, tmp_path):
    _, model = _model(a)
    export = a.result(
        a.ok("/save_weights_external", {"model_id": model, "seq_id": 1, "path": "dl"})["request_id"]
    )
    assert export["path"] == f"tinker://{model}/external_weights/dl"
    urls = a.http.get(f"/training_runs/{model}/checkpoints/external_weights/dl/external_weights_urls").json()
    assert {"adapter/adapter_model.safetensors", "config.json", "model.safetensors"} <= set(urls["urls"])
    import httpx

    got = httpx.get(urls["urls"]["adapter/adapter_config.json"])  # no key: the URL carries a signed token
    assert got.status_code == 200 and got.json()["r"] == 4
    forged = urls["urls"]["config.json"].replace("/checkpoint_files/", "/checkpoint_files/x")
    assert httpx.get(forged).status_code == 404
    assert (
        a.http.put(
            f"/training_runs/{model}/checkpoints/external_weights/dl/ttl", json={"ttl_seconds": 60}
        ).status_code
        == 200
    )
    assert a.http.delete(f"/training_runs/{model}/checkpoints/external_weights/dl").status_code == 200
    assert a.http.get(f"/training_runs/{model}/checkpoints").json()["checkpoints"] == []
    assert httpx.get(urls["urls"]["config.json"]).status_code == 404


def test_weights_info_runs_and_sessions_listing(a, tokens):
    session, model = _model(a)
    path = a.result(
        a.ok("/save_weights_for_sampler", {"model_id": model, "seq_id": 1, "path": "s"})["request_id"]
    )["path"]
    assert path == f"tinker://{model}/sampler_weights/s"
    info = a.ok("/weights_info", {"tinker_path": path})
    assert info == {
        "base_model": "tiny-llama",
        "is_lora": True,
        "lora_rank": 4,
        "train_unembed": True,
        "train_mlp": True,
        "train_attn": True,
    }
    runs = a.http.get("/training_runs", params={"limit": 100}).json()
    assert model in [r["training_run_id"] for r in runs["training_runs"]]
    assert a.http.get(f"/sessions/{session}").json()["training_run_ids"] == [model]
    sampler = a.ok(
        "/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 3, "model_path": path}
    )
    got = a.http.get(f"/samplers/{sampler['sampling_session_id']}").json()
    assert got["model_path"] == path and got["base_model"].endswith("tiny-llama")
    a.finish(session)
    assert a.post("/session_heartbeat", {"session_id": session}).status_code == 410


def test_local_key_is_a_tml_key_both_sdks_take(http_engine, sess_home):
    key = read_local_key(sess_home)
    assert key.startswith("tml-")
    client = TinkerHttp(http_engine["url"], key)
    assert client.ok("/client/config", {"sdk_version": "0.38.0"})
    client.close()


def test_lora_flags_and_loads_with_and_without_optimizer_state(a, keys, http_engine, tokens):
    session, model = _model(a)
    partial = a.create_model(session, seq=1, train_attn=False, train_unembed=False, rank=2)
    saved = a.result(a.ok("/save_weights", {"model_id": partial, "seq_id": 1, "path": "p"})["request_id"])
    flags = a.ok("/weights_info", {"tinker_path": saved["path"]})
    assert (flags["lora_rank"], flags["train_attn"], flags["train_mlp"], flags["train_unembed"]) == (
        2,
        False,
        True,
        False,
    )
    a.result(a.forward_backward(fb_request(model, 1, tokens)).json()["request_id"])
    a.result(
        a.ok("/optim_step", {"model_id": model, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}})[
            "request_id"
        ]
    )
    path = a.result(
        a.ok("/save_weights", {"model_id": model, "seq_id": 3, "path": "one-step"})["request_id"]
    )["path"]
    svc = ServiceClient(http_engine["url"], api_key=keys[0])
    try:
        steps = {}
        for seq, optimizer in ((2, True), (3, False)):
            body = {"session_id": session, "model_seq_id": seq, "path": path, "optimizer": optimizer}
            loaded = a.result(a.ok("/load_weights", body)["request_id"])
            assert loaded == {"path": path, "model_id": f"{session}:train:{seq}", "type": "load_weights"}
            steps[optimizer] = svc.transport.call("session_info", {"name": f"{session}.train.{seq}"})["step"]
        assert steps == {True: 1, False: 0}  # AdamW state (and its step count) only when asked for
        # the deprecated in-place load, ordered like any op of the model
        legacy = a.ok(
            "/load_weights", {"model_id": partial, "seq_id": 2, "path": saved["path"], "optimizer": True}
        )
        assert a.result(legacy["request_id"])["path"] == saved["path"]
        wrong = a.ok("/load_weights", {"model_id": partial, "seq_id": 3, "path": path, "optimizer": False})
        assert "rank" in a.result(wrong["request_id"])["error"]  # rank 4 weights into a rank 2 model
    finally:
        svc.close()


def test_routes_the_sdk_knows_but_sess_does_not_serve_are_400s_that_name_them(a):
    cases = [
        ("POST", "/auth/token", "not JWTs"),
        ("POST", "/retrieve_futures", "retrieve_future"),
        ("POST", "/join_sampling_session", "sampling client"),
        ("POST", "/sessions/search", ""),
        ("PATCH", "/no/such/route", ""),
    ]
    for method, path, why in cases:
        response = a.http.request(method, path)
        assert response.status_code == 400, (path, response.status_code, response.text[:200])
        detail = response.json()["detail"]
        assert f"{method} /api/v1{path} is not supported by this sess engine" in detail and why in detail
        assert response.headers["x-should-retry"] == "false"
    assert a.http.get("/healthz").json() == {"status": "ok"}  # and the engine keeps serving
