"""API keys for engines that face other machines: one tml- key for both SDKs, a key file of salted
hashes (old plaintext files migrated), list and revoke (a running engine refuses a revoked key at
its next request), and https with a certificate the clients verify."""

from __future__ import annotations

import json
import shutil
import ssl

import httpx
import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.protocol.errors import SessError
from sess.engine.protocol.home import read_local_key
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore

from helpers import SENTENCES, ce_datum
from tinker_helpers import TinkerHttp, self_signed_certificate

runner = CliRunner()


def test_the_key_file_keeps_salted_hashes_only(tmp_path):
    store = KeyStore(tmp_path)
    first, second = store.add("alice"), store.add("alice", max_sessions=2)
    assert first["key"].startswith(f"tml-{first['id']}-") and len(first["key"]) > 40
    text = store.path.read_text()
    assert first["key"] not in text and first["key"][13:] not in text and second["key"] not in text
    assert store.path.stat().st_mode & 0o777 == 0o600
    entries = json.loads(text)["keys"]
    assert {e["owner"] for e in entries} == {"alice"} and len({e["salt"] for e in entries}) == 2
    assert KeyStore(tmp_path).entry(second["key"])["max_sessions"] == 2
    for wrong in (
        first["key"] + "x",
        first["key"][:-1],
        f"tml-{first['id']}-guess",
        "",
        None,
        "tml-" + "a" * 600,
    ):
        assert KeyStore(tmp_path).entry(wrong) is None


def test_a_plaintext_key_file_is_migrated_and_its_keys_keep_working(tmp_path):
    legacy = "sess-" + "L" * 32
    (tmp_path / "keys.json").write_text(
        json.dumps({"keys": [{"key": legacy, "owner": "old", "created": 1.0, "max_sessions": 3}]})
    )
    (tmp_path / "api_key").write_text(legacy)
    store = KeyStore(tmp_path)
    assert store.entry(legacy)["owner"] == "old" and store.entry(legacy)["max_sessions"] == 3
    assert legacy not in store.path.read_text() and store.path.stat().st_mode & 0o777 == 0o600
    # the home's own key becomes a tml- key (one key for both SDKs); the plaintext one is revoked
    local = store.ensure_local_key()
    assert local.startswith("tml-") and read_local_key(tmp_path) == local
    assert store.entry(local)["owner"] == "local" and store.entry(legacy) is None
    assert store.ensure_local_key() == local


def test_keys_add_list_revoke_from_the_cli(tmp_path):
    home = str(tmp_path)
    added = runner.invoke(app, ["engine", "keys", "add", "--owner", "bob", "--home", home])
    key = added.stdout.strip()
    assert added.exit_code == 0 and key.startswith("tml-")
    key_id = KeyStore(home).entry(key)["id"]
    listed = runner.invoke(app, ["engine", "keys", "list", "--home", home, "--json"])
    assert json.loads(listed.stdout) == [
        {
            "id": key_id,
            "owner": "bob",
            "created": pytest.approx(KeyStore(home).entry(key)["created"]),
            "max_sessions": None,
            "local": False,
            "budget": None,
            "token_budget": None,
            "spent": "0",
            "spent_tokens": 0,
        }
    ]
    assert key not in listed.stdout
    assert "revoked" in runner.invoke(app, ["engine", "keys", "revoke", key_id, "--home", home]).stdout
    assert KeyStore(home).entry(key) is None
    again = runner.invoke(app, ["engine", "keys", "revoke", key_id, "--home", home])
    assert again.exit_code == 1 and "no key" in again.output
    assert "no keys in" in runner.invoke(app, ["engine", "keys", "list", "--home", home]).stdout


def test_revoking_the_homes_own_key_needs_force(tmp_path):
    """The CLI reaches the engine with the home's own key: revoking it locks the CLI out until the
    engine restarts, so it takes --force."""
    home = str(tmp_path)
    local = KeyStore(home).ensure_local_key()
    local_id = KeyStore(home).entry(local)["id"]
    refused = runner.invoke(app, ["engine", "keys", "revoke", local_id, "--home", home])
    assert refused.exit_code == 1 and "this home's own key" in refused.output and "--force" in refused.output
    assert KeyStore(home).entry(local) is not None
    forced = runner.invoke(app, ["engine", "keys", "revoke", local_id, "--force", "--home", home])
    assert forced.exit_code == 0 and "revoked" in forced.stdout and "restart the engine" in forced.output
    assert KeyStore(home).entry(local) is None


def test_one_key_for_both_sdks_and_a_revoked_key_is_refused_at_once(http_engine, sess_home):
    url = http_engine["url"]
    key = runner.invoke(
        app, ["engine", "keys", "add", "--owner", "carol", "--home", str(sess_home)]
    ).stdout.strip()
    svc, tinker = ServiceClient(url, api_key=key), TinkerHttp(url, key)
    try:
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
        assert (
            tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))])
            .result()
            .metrics["loss:sum"]
            > 0
        )
        assert tinker.ok("/client/config", {"sdk_version": "0.38.0"})
        assert tc.name in [
            r["training_run_id"] for r in tinker.http.get("/training_runs").json()["training_runs"]
        ]
        key_id = KeyStore(sess_home).entry(key)["id"]
        assert (
            runner.invoke(app, ["engine", "keys", "revoke", key_id, "--home", str(sess_home)]).exit_code == 0
        )
        # the running engine rereads the key file: the very next request is refused, on both protocols
        refused = tinker.post("/client/config", {"sdk_version": "0.38.0"})
        assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
        with pytest.raises(SessError, match="api key"):
            svc.list_sessions()
    finally:
        tinker.http.close()
        svc.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_an_engine_serves_https_and_clients_verify_its_certificate(tmp_path, monkeypatch):
    cert, key_file = self_signed_certificate(tmp_path)
    home = tmp_path / "home"
    half = runner.invoke(app, ["engine", "up", "--home", str(home), "--tls-cert", cert])
    assert half.exit_code == 1 and "go together" in half.output
    info = start_engine(home, extra_args=["--tls-cert", cert, "--tls-key", key_file])
    try:
        assert info["url"].startswith("https://127.0.0.1:")
        key = read_local_key(home)
        with pytest.raises(SessError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            ServiceClient(info["url"], api_key=key).list_sessions()  # not trusted without the bundle
        monkeypatch.setenv("SESS_CA_BUNDLE", cert)
        svc = ServiceClient(info["url"], api_key=key)
        with svc.create_lora_training_client("tiny-llama", rank=4, seed=0) as tc:
            assert (
                tc.forward([ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))]).result().metrics["loss:sum"]
                > 0
            )
        svc.close()
        trusted = ssl.create_default_context(cafile=cert)
        answer = httpx.post(
            f"{info['url']}/api/v1/client/config",
            json={"sdk_version": "0.38.0"},
            headers={"x-api-key": key},
            verify=trusted,
        )
        assert answer.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(info["url"].replace("https://", "http://") + "/healthz", timeout=5)
    finally:
        stop_engine(home)
