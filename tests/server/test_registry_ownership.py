"""Ownership lives beside the files: every checkpoint directory holds a manifest (owner digest,
session, kind, name, base model); an engine refuses to start on a lost or unreadable registry while
checkpoints exist, naming the file and the fixes; ``sess engine repair`` gives each owner its
checkpoints back; the engine backs its registry up at each start; a session name never brings
another key's old files with it. Real engine processes over HTTP, real SQLite files."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import AdamParams, ServiceClient
from sess.engine.protocol.errors import NotFound, SessError
from sess.engine.runtime.checkpoints.manifest import MANIFEST_FILE, owner_digest
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.registry_guard import RegistryUnreadable
from sess.engine.server.sqlite_registry import Registry

from helpers import SENTENCES, ce_datum

runner = CliRunner()


def _keys(home):
    store = KeyStore(home)
    return store.add("owner-a")["key"], store.add("owner-b")["key"]


def _train_and_save(url: str, key: str, name: str) -> tuple[list[float], dict[str, str]]:
    """One step of session ``name``, a state and a sampler save: (a forward's logprobs, kind -> path)."""
    with ServiceClient(url, api_key=key) as svc:
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name=name)
        tokens = tc.get_tokenizer().encode(SENTENCES[0])
        tc.forward_backward([ce_datum(tokens)], "cross_entropy")
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        paths = {
            "state": tc.save_state(name="s1").result().path,
            "weights": tc.save_weights_for_sampler(name="w1").result().path,
        }
        logprobs = tc.forward([ce_datum(tokens)]).result().loss_fn_outputs[0]["logprobs"].tolist()
        tc.stop()
    return logprobs, paths


def _up(home) -> tuple[int, str]:
    result = runner.invoke(app, ["engine", "up", "--home", str(home)])
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.slow  # three engine starts
def test_a_lost_registry_stops_the_start_and_repair_gives_each_owner_its_checkpoints(tmp_path):
    home = tmp_path / "home"
    key_a, key_b = _keys(home)
    url = start_engine(home)["url"]
    try:
        before, paths = _train_and_save(url, key_a, "alice-secret")
    finally:
        stop_engine(home)
    # each checkpoint directory says whose it is (a digest, never the key) and what it is
    state_dir = home / "checkpoints" / "alice-secret" / "state" / "s1"
    manifest = json.loads((state_dir / MANIFEST_FILE).read_text())
    assert manifest["owner_sha256"] == owner_digest("owner-a")
    assert (manifest["session"], manifest["kind"], manifest["name"]) == ("alice-secret", "state", "s1")
    assert manifest["base_model"] == "tiny-llama"
    assert key_a not in (state_dir / MANIFEST_FILE).read_text()

    os.truncate(home / "registry.db", 0)
    code, output = _up(home)
    assert code == 1
    assert str(home / "registry.db") in output and "empty (0 bytes)" in output
    assert "sess engine repair" in output and "registry.db.bak" in output
    with pytest.raises(SessError, match="sess engine repair"):  # the engine process itself refuses
        start_engine(home)
    assert (home / "registry.db").stat().st_size == 0  # and left the file as it was

    result = runner.invoke(app, ["engine", "repair", "--home", str(home)])
    assert result.exit_code == 0, result.output
    assert "restored 1 sessions and 2 checkpoints" in result.output
    assert "usage and spend were not rebuilt" in result.output
    assert list(home.glob("registry.db.broken-*"))  # the broken file is kept aside

    url = start_engine(home)["url"]
    try:
        with ServiceClient(url, api_key=key_a) as a:
            assert sorted(c["path"] for c in a.list_checkpoints("alice-secret")) == sorted(paths.values())
            again = a.create_training_client_from_state_with_optimizer(paths["state"])
            tokens = again.get_tokenizer().encode(SENTENCES[0])
            after = again.forward([ce_datum(tokens)]).result().loss_fn_outputs[0]["logprobs"].tolist()
            assert after == pytest.approx(before, abs=1e-6)
            again.stop()
        with ServiceClient(url, api_key=key_b) as b:
            with pytest.raises(NotFound):
                b.list_checkpoints("alice-secret")
            with pytest.raises(NotFound):
                b.create_sampling_client(model_path=paths["weights"]).sample(
                    [1, 2], 1, {"max_tokens": 2}
                ).result()
    finally:
        stop_engine(home)


@pytest.mark.slow  # three engine starts
def test_a_name_reused_after_a_lost_registry_never_gets_the_old_files(tmp_path):
    """Files repair could not give back (their owner has no key now) stay nobody's: a new session
    of that name is a session of its own, never handed them."""
    home = tmp_path / "home"
    key_a, key_b = _keys(home)
    url = start_engine(home)["url"]
    try:
        _train_and_save(url, key_a, "alice-secret")
    finally:
        stop_engine(home)
    os.truncate(home / "registry.db", 0)
    store = KeyStore(home)
    store.revoke(next(i for i, e in store.load().items() if e["owner"] == "owner-a"))
    result = runner.invoke(app, ["engine", "repair", "--home", str(home)])
    assert result.exit_code == 0, result.output
    assert "2 checkpoint directories belong to owners no key of this home has" in result.output
    url = start_engine(home)["url"]
    try:
        with ServiceClient(url, api_key=key_b) as b:
            own = b.create_lora_training_client("tiny-llama", rank=4, training_session_name="alice-secret")
            assert own.name == "alice-secret" and b.list_checkpoints("alice-secret") == []
            with pytest.raises(NotFound):
                b.create_sampling_client(model_path="sess://alice-secret/state/s1")
            saved = own.save_state(name="s1").result().path
            assert saved == "sess://alice-secret/state/s1"  # its own files, beside the old ones
            assert [c["path"] for c in b.list_checkpoints("alice-secret")] == [saved]
            own.stop()
    finally:
        stop_engine(home)
    assert (home / "checkpoints" / "alice-secret" / "state" / "s1" / "optimizer.safetensors").is_file()


def test_a_corrupt_registry_is_refused_naming_the_file_and_both_fixes(tmp_path):
    home = tmp_path / "home"
    start_engine(home)
    stop_engine(home)  # a start leaves registry.db.bak
    for suffix in ("-wal", "-shm"):
        (home / f"registry.db{suffix}").unlink(missing_ok=True)
    (home / "registry.db").write_bytes(os.urandom(8192))
    with pytest.raises(RegistryUnreadable) as raised:
        Registry(home)
    message = str(raised.value)
    assert str(home / "registry.db") in message and "not a readable SQLite database" in message
    assert "sess engine repair" in message and f"cp {home / 'registry.db.bak'}" in message
    with pytest.raises(SessError) as refused:
        start_engine(home)
    assert str(home / "registry.db") in str(refused.value) and "sess engine repair" in str(refused.value)
    assert "Traceback" not in str(refused.value)


@pytest.mark.slow  # three engine starts
def test_the_engine_backs_its_registry_up_at_each_start_and_the_backup_restores(tmp_path):
    """Also: a start writes the manifests that checkpoints from before manifests lack."""
    home = tmp_path / "home"
    key_a, _ = _keys(home)
    url = start_engine(home)["url"]
    try:
        _train_and_save(url, key_a, "alice")
        with ServiceClient(url, api_key=key_a) as a:
            usage = a.get_usage("alice")
    finally:
        stop_engine(home)
    manifests = sorted(home.glob(f"checkpoints/*/*/*/{MANIFEST_FILE}"))
    assert len(manifests) == 2
    for manifest in manifests:  # as in a home from before manifests
        manifest.unlink()
    url = start_engine(home)["url"]  # this start backs up what the first one recorded
    stop_engine(home)
    # and labels the checkpoints that had no manifest from the registry, while it knows their owner
    assert sorted(home.glob(f"checkpoints/*/*/*/{MANIFEST_FILE}")) == manifests
    assert {json.loads(m.read_text())["owner_sha256"] for m in manifests} == {owner_digest("owner-a")}
    backup = home / "registry.db.bak"
    assert backup.stat().st_mode & 0o777 == 0o600
    with sqlite3.connect(backup) as db:
        assert [r[0] for r in db.execute("SELECT owner FROM sessions WHERE name='alice'")] == ["owner-a"]
        assert db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 2
    os.truncate(home / "registry.db", 0)
    for suffix in ("-wal", "-shm"):
        (home / f"registry.db{suffix}").unlink(missing_ok=True)
    shutil.copy(backup, home / "registry.db")
    url = start_engine(home)["url"]
    try:
        with ServiceClient(url, api_key=key_a) as a:
            assert len(a.list_checkpoints("alice")) == 2
            restored = a.get_usage("alice")
            assert restored.training_tokens == usage.training_tokens > 0
    finally:
        stop_engine(home)
