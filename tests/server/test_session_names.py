"""Session names are per key: a second key may have its own session of a name the first key uses,
learns nothing of the first key's, and every name or path it sends (``sess://``, ``tinker://``,
OpenAI ``model=``, session ops, usage, checkpoints, downloads) resolves within its own sessions;
the first key's session stays as it was. A real engine over HTTP, two keys of its home."""

from __future__ import annotations

import secrets

import httpx
import openai
import pytest
from safetensors.numpy import load_file

from sess.engine import AdamParams, ServiceClient
from sess.engine.protocol.errors import NotFound, SessError
from sess.engine.runtime.session_names import owner_tag
from sess.engine.server.keys import KeyStore

from helpers import SENTENCES, ce_datum
from tinker_helpers import TinkerHttp


def _logprobs(tc, tokens: list[int]) -> list[float]:
    return tc.forward([ce_datum(tokens)]).result().loss_fn_outputs[0]["logprobs"].tolist()


def _adapter(directory) -> dict:
    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.fixture()
def two_keys(http_engine, sess_home):
    suffix = secrets.token_hex(4)
    store = KeyStore(sess_home)
    return (
        http_engine["url"],
        (store.add(f"alice-{suffix}")["key"], f"alice-{suffix}"),
        (store.add(f"bob-{suffix}")["key"], f"bob-{suffix}"),
    )


def test_a_second_key_gets_its_own_session_of_a_name_the_first_key_uses(two_keys, tmp_path):
    url, (key_a, owner_a), (key_b, owner_b) = two_keys
    name = f"alice-secret-{secrets.token_hex(3)}"
    a, b = ServiceClient(url, api_key=key_a), ServiceClient(url, api_key=key_b)
    try:
        tc_a = a.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
        tokens = tc_a.get_tokenizer().encode(SENTENCES[0])
        untrained = _logprobs(tc_a, tokens)
        tc_a.forward_backward([ce_datum(tokens)], "cross_entropy")
        tc_a.optim_step(AdamParams(learning_rate=1e-2)).result()
        trained_a = _logprobs(tc_a, tokens)
        assert trained_a != pytest.approx(untrained, abs=1e-4)
        path_a = tc_a.save_weights_for_sampler(name="w1").result().path
        state_a = tc_a.save_state(name="s1").result().path
        assert path_a == f"sess://{name}/weights/w1"
        trained_tokens_a = a.get_usage(name).training_tokens

        # B creates the same name: its own, fresh session (no error, nothing of A's)
        tc_b = b.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
        assert tc_b.name == name
        assert [s.name for s in b.list_sessions()] == [name]
        assert b.list_checkpoints(name) == []
        assert b.get_usage(name).training_tokens == 0
        assert _logprobs(tc_b, tokens) == pytest.approx(untrained, abs=1e-5)  # B's weights, not A's
        with pytest.raises(NotFound):
            b.create_sampling_client(model_path=path_a)
        with pytest.raises(NotFound) as refused:
            b.download_checkpoint(state_a, tmp_path / "stolen")
        assert owner_tag(owner_a) not in str(refused.value) and "@" not in str(refused.value)

        # B's own checkpoint of the same path name: B's weights, shown under B's name
        tc_b.forward_backward([ce_datum(tokens[::-1])], "cross_entropy")
        tc_b.optim_step(AdamParams(learning_rate=1e-2)).result()
        path_b = tc_b.save_weights_for_sampler(name="w1").result().path
        assert path_b == path_a  # the same name, each key's own files
        assert [c["path"] for c in b.list_checkpoints(name)] == [path_b]
        own_b = b.download_checkpoint(path_b, tmp_path / "b")
        own_a = a.download_checkpoint(path_a, tmp_path / "a")
        weights_a, weights_b = _adapter(own_a), _adapter(own_b)
        assert any(not (weights_a[k] == weights_b[k]).all() for k in weights_a)
        prompt = tokens[:4]
        greedy = {"max_tokens": 3, "temperature": 0.0}
        sample_a = a.create_sampling_client(model_path=path_a).sample(prompt, 1, greedy).result()
        sample_b = b.create_sampling_client(model_path=path_b).sample(prompt, 1, greedy).result()
        assert sample_a.sequences[0].logprobs != pytest.approx(sample_b.sequences[0].logprobs, abs=1e-5)

        # usage by name is each key's own; names in every answer are the client's
        assert a.get_usage(name).training_tokens == trained_tokens_a  # B's ops are not A's
        assert 0 < b.get_usage(name).training_tokens < trained_tokens_a  # B ran fewer than A
        report = httpx.get(
            f"{url}/api/usage", params={"name": name, "by": "session"}, headers={"x-api-key": key_b}
        ).json()
        assert owner_tag(owner_b) not in str(report)
        assert (
            b.create_training_client_from_state(
                tc_b.save_state(name="s1").result().path, training_session_name=f"{name}-2"
            ).name
            == f"{name}-2"
        )

        # A's session, checkpoints and downloads are as they were
        assert [s.name for s in a.list_sessions()] == [name]
        assert sorted(c["path"] for c in a.list_checkpoints(name)) == sorted([path_a, state_a])
        assert _logprobs(a.get_training_client(name), tokens) == pytest.approx(trained_a, abs=1e-6)
        with pytest.raises(SessError, match="already exists"):  # its own name, taken by itself
            a.create_lora_training_client("tiny-llama", rank=4, training_session_name=name)

        # B deletes its session: A's stays
        b.delete_session(name, stop_if_active=True)
        assert sorted(c["path"] for c in a.list_checkpoints(name)) == sorted([path_a, state_a])
        assert a.create_sampling_client(model_path=path_a).sample(prompt, 1, greedy).result().sequences[
            0
        ].logprobs == pytest.approx(sample_a.sequences[0].logprobs, abs=1e-5)
        with pytest.raises(NotFound):
            b.list_checkpoints(name)
    finally:
        a.close()
        b.close()


def test_names_resolve_per_key_through_the_tinker_and_openai_routes(two_keys):
    url, (key_a, owner_a), (key_b, owner_b) = two_keys
    name = f"alice-secret-{secrets.token_hex(3)}"
    a, b = ServiceClient(url, api_key=key_a), ServiceClient(url, api_key=key_b)
    tinker_a, tinker_b = TinkerHttp(url, key_a), TinkerHttp(url, key_b)
    try:
        tc_a = a.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
        tokens = tc_a.get_tokenizer().encode(SENTENCES[1])
        tc_a.forward_backward([ce_datum(tokens)], "cross_entropy")
        tc_a.optim_step(AdamParams(learning_rate=1e-2)).result()
        tc_a.save_state(name="s1").result()
        tc_a.save_weights_for_sampler(name="w1").result()
        tc_b = b.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
        tc_b.save_weights_for_sampler(name="w2").result()

        # Tinker: the run's checkpoints are each key's own; A's paths are absent for B
        runs_b = tinker_b.http.get("/training_runs").json()["training_runs"]
        assert [r["training_run_id"] for r in runs_b] == [name]
        listed_b = tinker_b.http.get(f"/training_runs/{name}/checkpoints").json()["checkpoints"]
        assert [c["tinker_path"] for c in listed_b] == [f"tinker://{name}/sampler_weights/w2"]
        listed_a = tinker_a.http.get(f"/training_runs/{name}/checkpoints").json()["checkpoints"]
        assert sorted(c["tinker_path"] for c in listed_a) == [
            f"tinker://{name}/sampler_weights/w1",
            f"tinker://{name}/weights/s1",
        ]
        for path in (f"tinker://{name}/weights/s1", f"tinker://{name}/sampler_weights/w1"):
            refused = tinker_b.post("/weights_info", {"tinker_path": path})
            assert refused.status_code == 404, refused.text
            assert owner_tag(owner_a) not in refused.text and "@" not in refused.text
            assert tinker_a.ok("/weights_info", {"tinker_path": path})["lora_rank"] == 4
        assert tinker_b.ok("/weights_info", {"tinker_path": f"tinker://{name}/sampler_weights/w2"})
        urls = tinker_b.http.get(
            f"/training_runs/{name}/checkpoints/sampler_weights/w2/external_weights_urls"
        )
        assert urls.status_code == 200 and "adapter_model.safetensors" in urls.json()["urls"]
        stolen = tinker_b.http.get(
            f"/training_runs/{name}/checkpoints/sampler_weights/w1/external_weights_urls"
        )
        assert stolen.status_code == 404

        # OpenAI: model=<name> samples the caller's own session; A's checkpoint path is absent for B
        client_a = openai.OpenAI(base_url=f"{url}/v1", api_key=key_a, max_retries=0)
        client_b = openai.OpenAI(base_url=f"{url}/v1", api_key=key_b, max_retries=0)
        models_b = sorted(m.id for m in client_b.models.list().data if name in m.id)
        assert models_b == sorted([name, f"sess://{name}/weights/w2"])
        models_a = sorted(m.id for m in client_a.models.list().data if name in m.id)
        assert models_a == sorted([name, f"sess://{name}/weights/w1"])
        with pytest.raises(openai.NotFoundError) as missing:
            client_b.completions.create(model=f"sess://{name}/weights/w1", prompt=[1, 2, 3], max_tokens=2)
        assert owner_tag(owner_a) not in str(missing.value) and "@" not in str(missing.value)
        for client in (client_a, client_b):
            for model in (name, f"sess://{name}/weights/" + ("w1" if client is client_a else "w2")):
                done = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2, seed=1)
                assert done.choices[0].finish_reason in ("stop", "length")
        b.delete_session(name, stop_if_active=True)
        assert sorted(m.id for m in client_a.models.list().data if name in m.id) == models_a
    finally:
        for client in (tinker_a, tinker_b):
            client.http.close()
        a.close()
        b.close()
