"""Tinker sessions whose client is gone, and what a recipe's clients are given: ten short tinker
clients in a row on one key each get their session with the engine's default settings (at the limit,
the sessions whose clients missed their beats go first), and ten short tinker processes too (an
exited client's models are released after the heartbeat lapse, state saved, resumable, usage
counted once); a sampler made with both
``base_model`` and ``model_path`` samples the checkpoint when they agree and is refused naming both
when they don't; Tinker's LoRA scale (alpha 32) and the tokenizer id ``get_tokenizer`` loads."""

from __future__ import annotations

import json
import time

import pytest

from sess.engine import ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import ids
from sess.engine.server.tinker.session_room import MAX_WAIT_S
from sess.engine.server.tinker.state import Tinker

from helpers import SENTENCES
from tinker_helpers import TinkerHttp, make_tinker_venv, run_client


@pytest.fixture(scope="module")
def key(sess_home):
    return KeyStore(sess_home).add("tinker-sessions")["key"]


def test_sampler_with_base_model_and_model_path_and_lora_alpha(http_engine, key, tmp_path):
    client = TinkerHttp(http_engine["url"], key)
    try:
        session = client.session()
        model = client.create_model(session)
        saved = client.ok("/save_weights_for_sampler", {"model_id": model, "seq_id": 1, "path": "both"})
        path = client.result(saved["request_id"])["path"]
        make = {"session_id": session, "sampling_session_seq_id": 0, "model_path": path}
        sampler = client.ok("/create_sampling_session", {**make, "base_model": "tiny-llama"})
        got = client.http.get(f"/samplers/{sampler['sampling_session_id']}").json()
        assert got["model_path"] == path
        sample = {
            "sampling_session_id": sampler["sampling_session_id"],
            "seq_id": 0,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 2, "seed": 1},
        }
        assert client.result(client.ok("/asample", sample)["request_id"])  # protobuf answer
        refused = [
            client.post(
                "/create_sampling_session", {**make, "sampling_session_seq_id": 1, "base_model": "tiny-qwen3"}
            ),
            client.post("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 2}),
        ]
        assert refused[0].status_code == 400
        assert "base_model, model_path" in refused[0].json()["detail"]
        assert "tiny-qwen3" in refused[0].json()["detail"] and path in refused[0].json()["detail"]
        assert refused[1].status_code == 400 and "model_path, base_model" in refused[1].json()["detail"]
        # Tinker's LoRA scale: alpha 32 whatever the rank (the cookbook's hyper-parameters assume it)
        with ServiceClient(http_engine["url"], api_key=key) as svc:
            where = svc.download_checkpoint(ids.to_sess_path(path), tmp_path / "adapter")
            config = json.loads((where / "adapter_config.json").read_text())
            assert (config["r"], config["lora_alpha"]) == (4, 32)
            # the sess SDK takes both too, and refuses them when they disagree
            sess_path = ids.to_sess_path(path)
            assert (
                svc.create_sampling_client(model_path=sess_path, base_model="tiny-llama").base_model
                == "tiny-llama"
            )
            with pytest.raises(Exception, match="base_model, model_path"):
                svc.create_sampling_client(model_path=sess_path, base_model="tiny-qwen3")
    finally:
        client.close()


def test_tokenizer_id_is_loadable_where_the_client_runs():
    """A bare catalog name gives its tokenizer's public hub id (loadable on any machine); a name the
    client gave as a path or hub id comes back as given; a random tiny model's tokenizer exists only
    in the engine's directory."""
    tinker = Tinker(None, None, 0)
    facts = {"directory": "/engine/models/smollm2-135m", "tokenizer": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    summary = {"base_model": "smollm2-135m"}
    assert tinker.tokenizer_id("m1", summary, facts) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tinker.model_names["m2"] = "/home/me/smollm2-135m"
    assert tinker.tokenizer_id("m2", summary, facts) == "/home/me/smollm2-135m"
    tiny = {"directory": "/engine/models/tiny-llama", "tokenizer": None}
    assert tinker.tokenizer_id("m3", {"base_model": "tiny-llama"}, tiny) == "/engine/models/tiny-llama"


def test_ten_recipes_back_to_back_with_the_default_settings(http_engine, sess_home):
    """The engine's defaults (8 live sessions a key, a 60 s heartbeat lapse): ten recipe-like clients
    in a row on one key, each making a model and a sampler, beating once and going silent as an
    exited process does. The 9th and 10th get their models by releasing the two oldest, whose clients
    missed their beats (silent over two 10 s beat periods), state saved; no later one is touched."""
    key = KeyStore(sess_home).add("back-to-back")["key"]
    started, models, waits = time.monotonic(), [], []
    for _ in range(10):
        client = TinkerHttp(http_engine["url"], key)
        session = client.session()
        begun = time.monotonic()
        models.append(client.create_model(session))
        waits.append(time.monotonic() - begun)
        make = {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"}
        client.ok("/create_sampling_session", make)
        client.ok("/session_heartbeat", {"session_id": session})
        client.http.close()  # the process exits: no finish, no more beats
    assert time.monotonic() - started < 60
    assert max(waits[:8]) < 5 and max(waits[8:]) <= MAX_WAIT_S + 5, waits
    names = [ids.sess_name(m) for m in models]
    with ServiceClient(http_engine["url"], api_key=key) as svc:
        status = {s.name: s.status.value for s in svc.list_sessions()}
        assert [status[n] for n in names] == ["Stopped"] * 2 + ["Running"] * 8, status
        assert any(c["kind"] == "state" for c in svc.list_checkpoints(names[0]))  # resumable


@pytest.mark.slow
def test_ten_short_processes_in_a_row_each_get_their_session(tmp_path, monkeypatch):
    """Two live sessions a key and a 2 s heartbeat lapse: ten recipe-like processes, one after the
    other, each get their model, since each exited one is released; each released model resumes
    from the state saved at release, and each op is counted once."""
    monkeypatch.setenv("SESS_HEARTBEAT_LAPSE_S", "2")
    home = tmp_path / "home"
    info = start_engine(home, extra_args=["--max-sessions", "2"])
    try:
        key = KeyStore(home).add("recipes")["key"]
        python = make_tinker_venv(tmp_path)
        with ServiceClient(info["url"], api_key=key) as svc:
            tokens = svc.get_tokenizer("tiny-llama").encode(SENTENCES[0])
            runs = []
            for index in range(10):
                spec = {"tokens": tokens, "index": index, "out": str(tmp_path / f"run{index}.json")}
                runs.append(
                    run_client(python, "short_client.py", spec, url=info["url"], key=key, timeout=180)
                )
            names = [ids.sess_name(run["model_id"]) for run in runs]
            deadline = time.monotonic() + 30
            while {s.status.value for s in svc.list_sessions()} != {"Stopped"}:
                assert time.monotonic() < deadline, [(s.name, s.status.value) for s in svc.list_sessions()]
                time.sleep(0.3)
            assert sorted(s.name for s in svc.list_sessions()) == sorted(names)
            assert len({run["loss"] for run in runs}) == 1  # the same seed and data: the same model
            by_session = svc.transport.usage(by="session")["rows"]
            for name, run in zip(names, runs):
                assert by_session[name]["training_tokens"] == len(tokens) - 1
                # the tokens each sampler returned: 3, or fewer where it drew EOS (stop=None stops there)
                assert 1 <= len(run["sampled"]) <= 3
                assert by_session[name]["sampled_tokens"] == len(run["sampled"])
            state = next(c for c in svc.list_checkpoints(names[0]) if c["kind"] == "state")
            resumed = svc.create_training_client_from_state_with_optimizer(
                state["path"], training_session_name=names[0]
            )
            assert svc.list_sessions(name_contains=names[0])[0].step == 1
            resumed.stop()
            after = svc.transport.usage(by="session")["rows"][names[0]]
            tokens_of = ("prefill_tokens", "sampled_tokens", "training_tokens")
            # resume and stop are two more operations; the tokens are those counted before, once
            assert after["count"] == by_session[names[0]]["count"] + 2
            assert [after[k] for k in tokens_of] == [by_session[names[0]][k] for k in tokens_of]
    finally:
        stop_engine(home)
