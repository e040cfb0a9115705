"""Every request field that names a model, checkpoint or file, in all three protocols (the sess
wire, the Tinker routes, the OpenAI routes), walked by key B with paths, ``file://`` URLs,
traversal, key A's checkpoint directories and names, hub ids, and unicode or huge names: none gets
a 2xx, none a 5xx, and a model field answers the same text whatever exists on disk. The models a key
may name are the catalog's and those the operator adds with ``sess engine models add``.

A Tinker op that runs as a future answers its request with a request id; its outcome is the future's,
which must then be an error."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil

import httpx
import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ModelInput, SamplingParams, ServiceClient
from sess.engine.protocol import requests as rq
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import fields as tinker_fields
from sess.engine.server.tinker import ids

from helpers import SENTENCES, ce_datum
from tinker_helpers import TinkerHttp

runner = CliRunner()
NAMING = {"base_model", "model_path", "path", "source_path"}  # fields that name a model, checkpoint or file


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An engine of its own home; A (alice) has trained and saved, B (bob) probes."""
    home = tmp_path_factory.mktemp("tenant-home")
    keys = KeyStore(home)
    alice, bob = keys.add("alice")["key"], keys.add("bob")["key"]
    local = keys.ensure_local_key()
    info = start_engine(home)
    a, b = ServiceClient(info["url"], api_key=alice), ServiceClient(info["url"], api_key=bob)
    tc = a.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="alice-run")
    tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))]).result()
    tc.optim_step().result()
    saved = {
        "merged": tc.save_weights_for_sampler(name="m1", merge_weights=True).result().path,
        "weights": tc.save_weights_for_sampler(name="w1").result().path,
        "state": tc.save_state(name="st").result().path,
    }
    mine = b.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="bob-run")
    bob_state = mine.save_state(name="bst").result().path
    merged_dirs = sorted(str(p.parent) for p in (home / "checkpoints").rglob("config.json"))
    assert merged_dirs, "A's merged checkpoint is a transformers directory on disk"
    yield {
        "home": home,
        "url": info["url"],
        "keys": {"alice": alice, "bob": bob, "local": local},
        "saved": saved,
        "bob_state": bob_state,
        "merged_dir": merged_dirs[0],
        "bob": b,
        "bob_run": mine,
    }
    a.close()
    b.close()
    stop_engine(home)


def hostile(engine) -> tuple[list[str], list[str]]:
    """(path-like values, other values): every one names nothing B may use."""
    home, merged = engine["home"], engine["merged_dir"]
    run = ids.run_id("alice-run")
    paths = [
        "/",
        "/root",
        "/root/.ssh",
        "/etc/passwd",
        "/nonexistent/model",
        str(home),
        merged,
        merged + "/",
        str(home / "keys.json"),
        str(home / "registry.db"),
        str(home / "models" / "tiny-llama" / ".." / ".."),
        "file://" + merged,
        "file:///etc/passwd",
        "file://" + str(home / "models" / "tiny-llama"),
        "../x",
        "../../etc/passwd",
        "./m1",
        "~/.ssh",
        "tiny-llama/../../checkpoints",
        "org/name",
        "someorg/some-model",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ]
    others = [
        "",
        "alice-run",
        "m1",
        "tiny-llama\u200b",
        "ｔｉｎｙ-llama",
        "tiny\x00llama",
        "é" * 5000,
        "x" * 1025,
        "\U0001f600",
        *engine["saved"].values(),
        "sess://alice-run/merged/../../../keys.json",
        f"tinker://{run}/weights/st",
        f"tinker://{run}/sampler_weights/w1",
        f"tinker://{run}/sampler_weights/../../x",
    ]
    return paths, others


def refused(response: httpx.Response, where) -> str:
    """The refusal's text; fails on a 2xx or a 5xx."""
    assert 400 <= response.status_code < 500, (where, response.status_code, response.text[:300])
    return response.text


# --------------------------------------------------------------------------------------- sess wire
def sess_walk(http: httpx.Client, bob_run):
    """(request type, field) -> a function sending ``value`` in that field as the sess SDK does."""

    def call(name, args):
        return http.post("/api/call", json={"name": name, "args": args})

    def submit(name, args, session=None):
        body = {"name": name, "args": args}
        if session is not None:
            body |= {"session": session, "seq": bob_run.reserve_sequence_number()}
        answer = http.post("/api/submit", json=body)
        if answer.status_code != 200:
            return answer
        return http.post("/api/wait", json={"op_id": answer.json()["op_id"], "timeout": 60})

    def sample(target):
        return submit("sample", {"target": target, "prompt": [1, 2], "num_samples": 1})

    def files(v):
        return http.get("/api/checkpoints/files", params={"path": v})

    return {
        ("CreateSession", "base_model"): lambda v: call("create_session", {"base_model": v, "name": "bob-x"}),
        ("TokenizerFiles", "base_model"): lambda v: call("tokenizer_files", {"base_model": v}),
        ("ModelInfo", "base_model"): lambda v: call("model_info", {"base_model": v}),
        ("Target", "base_model"): lambda v: sample({"base_model": v}),
        ("Target", "model_path"): lambda v: sample({"model_path": v}),
        ("CreateSessionFromState", "path"): lambda v: call("create_session_from_state", {"path": v}),
        ("CheckpointPath", "path"): lambda v: [call("checkpoint_info", {"path": v}), files(v)],
        ("DeleteCheckpoint", "path"): lambda v: call("delete_checkpoint", {"path": v}),
        ("LoadState", "path"): lambda v: submit("load_state", {"path": v}, session="bob-run"),
    }


def test_every_sess_field_refuses_paths_and_other_keys_resources(engine):
    declared = {
        (cls.__name__, f.name)
        for cls in vars(rq).values()
        if isinstance(cls, type) and issubclass(cls, rq.Request) and dataclasses.is_dataclass(cls)
        for f in dataclasses.fields(cls)
        if f.name in NAMING
    }
    headers = {"authorization": f"Bearer {engine['keys']['bob']}"}
    with httpx.Client(base_url=engine["url"], headers=headers, timeout=120) as http:
        walk = sess_walk(http, engine["bob_run"])
        assert declared <= set(walk), (
            f"fields naming a model or file that the walk misses: {declared - set(walk)}"
        )
        paths, others = hostile(engine)
        for (cls, name), send in walk.items():
            texts = {}
            for value in paths + others:
                answers = send(value)
                for answer in answers if isinstance(answers, list) else [answers]:
                    texts[value] = refused(answer, (cls, name, value))
            if name == "base_model":  # no probe: the same answer whatever lies at the path
                assert len({texts[v] for v in paths}) == 1, (cls, {texts[v] for v in paths})
        # B's own checkpoint and the catalog still work through the same fields
        for name, args in [
            ("model_info", {"base_model": "tiny-llama"}),
            ("checkpoint_info", {"path": engine["bob_state"]}),
        ]:
            assert http.post("/api/call", json={"name": name, "args": args}).is_success, name


# -------------------------------------------------------------------------------------- Tinker routes
def test_every_tinker_field_refuses_paths_and_other_keys_resources(engine):
    declared = {
        (cls, name) for cls, honoured in tinker_fields.HONOURED.items() for name in honoured if name in NAMING
    }
    b = TinkerHttp(engine["url"], engine["keys"]["bob"])
    try:
        session = b.session()
        model = b.create_model(session, seq=0)
        own_state = ids.to_tinker_path(engine["bob_state"])
        seq, model_seq, sampler_seq = itertools.count(1), itertools.count(1), itertools.count(0)

        def future(response: httpx.Response, where) -> str:
            """A refusal now, or a request id whose future fails."""
            if response.status_code == 200 and "request_id" in response.json():
                answer = b.result(response.json()["request_id"])
                assert isinstance(answer, dict) and "error" in answer, (where, answer)
                return str(answer["error"])
            return refused(response, where)

        def new(path, body):
            return b.post(path, {"session_id": session, "model_seq_id": next(model_seq), **body})

        def sampler(body):
            return b.post(
                "/create_sampling_session",
                {"session_id": session, "sampling_session_seq_id": next(sampler_seq), **body},
            )

        def sample(body):
            return b.post(
                "/asample", {"prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]}, **body}
            )

        def save(route):
            return lambda v: b.post(route, {"model_id": model, "seq_id": next(seq), "path": v})

        walk = {
            ("CreateModelRequest", "base_model"): lambda v: new(
                "/create_model", {"base_model": v, "lora_config": {"rank": 4}}
            ),
            ("LoadWeightsRequest", "path"): lambda v: new("/load_weights", {"path": v, "optimizer": False}),
            ("LoadWeightsRequest", "base_model"): lambda v: new(
                "/load_weights", {"path": own_state, "optimizer": False, "base_model": v}
            ),
            ("SaveWeightsRequest", "path"): save("/save_weights"),
            ("SaveWeightsForSamplerRequest", "path"): save("/save_weights_for_sampler"),
            ("SaveWeightsExternalRequest", "path"): save("/save_weights_external"),
            ("CopyWeightsRequest", "source_path"): lambda v: b.post("/copy_weights", {"source_path": v}),
            ("CreateSamplingSessionRequest", "base_model"): lambda v: sampler({"base_model": v}),
            ("CreateSamplingSessionRequest", "model_path"): lambda v: sampler({"model_path": v}),
            ("SampleRequest", "base_model"): lambda v: sample({"base_model": v}),
            ("SampleRequest", "model_path"): lambda v: sample({"model_path": v}),
            ("WeightsInfoRequest", "tinker_path"): lambda v: b.post("/weights_info", {"tinker_path": v}),
        }
        assert declared <= set(walk), (
            f"fields naming a model or file that the walk misses: {declared - set(walk)}"
        )
        paths, others = hostile(engine)
        for (cls, name), send in walk.items():
            # a save's path is the name of B's own new checkpoint: a plain name is B's to use
            values = paths + [v for v in others if "Save" not in cls or not v.isascii() or "/" in v]
            texts = {value: future(send(value), (cls, name, value)) for value in values}
            if name == "base_model":
                assert len({texts[v] for v in paths}) == 1, (cls, {texts[v] for v in paths})
    finally:
        b.close()


# -------------------------------------------------------------------------------------- OpenAI routes
def test_openai_model_refuses_paths_and_other_keys_resources(engine):
    headers = {"authorization": f"Bearer {engine['keys']['bob']}"}
    paths, others = hostile(engine)
    with httpx.Client(base_url=engine["url"], headers=headers, timeout=120) as http:
        for route, body in [
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ]:
            texts = {
                v: refused(http.post(route, json={**body, "model": v}), (route, v)) for v in paths + others
            }
            # the answer names the model asked for, and depends on nothing else
            generic = {texts[v].replace(httpx.Response(200, json=v).text[1:-1], "MODEL") for v in paths}
            assert len(generic) == 1, generic
            assert http.post(route, json={**body, "model": "tiny-llama"}).is_success


# ------------------------------------------------------------------------------- operator's models
def test_operator_registered_models_serve_every_key_by_name_only(engine, tmp_path):
    home, bob = engine["home"], engine["bob"]
    directory = str(home / "models" / "tiny-llama")
    added = runner.invoke(app, ["engine", "models", "add", "house-llama", directory, "--home", str(home)])
    assert added.exit_code == 0, added.output
    listed = runner.invoke(app, ["engine", "models", "list", "--json", "--home", str(home)])
    assert {"name": "house-llama", "source": "local", "repo": directory, "registered": True} in json.loads(
        listed.stdout
    )
    assert {"house-llama", "tiny-llama"} <= set(bob.list_base_models())
    assert directory not in bob.list_base_models()
    with bob.create_lora_training_client("house-llama", rank=4, seed=0) as tc:
        assert tc.forward([ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))]).result().loss_fn_outputs
    assert (
        bob.create_sampling_client(base_model="house-llama")
        .sample(ModelInput.from_ints([1, 2]), num_samples=1, sampling_params=SamplingParams(max_tokens=2))
        .result()
        .sequences
    )
    # the directory it names is still no model for B; a path ending in a served name is that name
    headers = {"authorization": f"Bearer {engine['keys']['bob']}"}
    with httpx.Client(base_url=engine["url"], headers=headers, timeout=120) as http:

        def info(value):
            return http.post("/api/call", json={"name": "model_info", "args": {"base_model": value}})

        assert info(directory + "/..").status_code == 404
        assert info("/anywhere/house-llama").json()["result"]["base_model"] == "house-llama"
        assert info("/root/tiny-llama").json()["result"]["base_model"] == "tiny-llama"
        removed = runner.invoke(app, ["engine", "models", "remove", "house-llama", "--home", str(home)])
        assert removed.exit_code == 0, removed.output
        gone = info("house-llama")
        assert gone.status_code == 404 and gone.text == info("/root").text
    # the home's own key (the operator's) may still name a model directory of its own
    own = tmp_path / "my-model"
    shutil.copytree(directory, own)
    local = ServiceClient(engine["url"], api_key=engine["keys"]["local"])
    with local.create_lora_training_client(str(own), rank=4, seed=0) as tc:
        assert tc.forward([ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))]).result().loss_fn_outputs
    local.close()


def test_models_add_refuses_catalog_names_bad_names_and_non_models(tmp_path):
    home = str(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
    for args, message in [
        (["tiny-llama", str(tmp_path / "m")], "catalog model"),
        (["../x", str(tmp_path / "m")], "not a valid name"),
        (["ok", str(tmp_path)], "config.json"),
        (["ok", "/nonexistent/dir"], "neither a model directory"),
    ]:
        result = runner.invoke(app, ["engine", "models", "add", *args, "--home", home])
        assert result.exit_code == 1 and message in result.output, (args, result.output)
    assert (
        runner.invoke(app, ["engine", "models", "add", "ok", str(tmp_path / "m"), "--home", home]).exit_code
        == 0
    )
    again = runner.invoke(app, ["engine", "models", "add", "ok", "org/name", "--home", home])
    assert again.exit_code == 1 and "registered already" in again.output
    assert runner.invoke(app, ["engine", "models", "remove", "nope", "--home", home]).exit_code == 1


def test_concurrent_adds_keep_every_model(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from sess.engine.runtime.models.registered import register, registered

    names = [f"m{i}" for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda n: register(tmp_path, n, f"org/{n}", reserved=set()), names))
    assert sorted(registered(tmp_path, fresh=True)) == sorted(names)


def test_an_unreadable_models_file_is_the_engine_s_fault_and_names_the_file(tmp_path):
    from sess.engine.runtime.models.model_policy import model_name
    from sess.engine.runtime.models.registered import ModelsFileError

    for text in ("{not json", '{"models": []}', '{"models": {"x": {"source": "disk", "repo": "/"}}}'):
        (tmp_path / "models.json").write_text(text)
        with pytest.raises(ModelsFileError, match="models.json.*fix or remove it") as error:
            model_name(tmp_path, "bob", "x")
        assert error.value.status == 503
    listed = runner.invoke(app, ["engine", "models", "list", "--home", str(tmp_path)])
    assert listed.exit_code == 1 and "models.json" in listed.output
