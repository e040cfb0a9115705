"""Checkpoint lifecycles through the sess SDK, the CLI and raw HTTP against a real engine process:
TTLs kept, listed, cleared and swept (files and registry rows); metadata; publishing to other keys
(readable, not writable); copies with their own TTL; session traces; storage; the audit log; and an
old registry migrated in place."""

from __future__ import annotations

import json
import os
import sqlite3
import time

import httpx
import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.sqlite_registry import Registry

from helpers import SENTENCES, ce_datum

runner = CliRunner()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An engine of its own home that sweeps expired checkpoints every 0.3 s, with keys of two owners."""
    home = tmp_path_factory.mktemp("lifecycle-home")
    keys = KeyStore(home)
    alice, bob = keys.add("alice")["key"], keys.add("bob")["key"]
    local = keys.ensure_local_key()
    os.environ["SESS_CHECKPOINT_SWEEP_S"] = "0.3"
    try:
        info = start_engine(home)
    finally:
        os.environ.pop("SESS_CHECKPOINT_SWEEP_S", None)
    clients = {
        name: ServiceClient(info["url"], api_key=key) for name, key in (("alice", alice), ("bob", bob))
    }
    yield {"home": home, "url": info["url"], "keys": {"alice": alice, "bob": bob, "local": local}, **clients}
    for client in clients.values():
        client.close()
    stop_engine(home)


@pytest.fixture(scope="module")
def trained(engine):
    tc = engine["alice"].create_lora_training_client(
        "tiny-llama", rank=4, seed=0, training_session_name="alice-run"
    )
    tc.forward_backward([ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))]).result()
    tc.optim_step().result()
    return tc


def registry_row(home, path: str):
    with sqlite3.connect(home / "registry.db") as db:
        db.row_factory = sqlite3.Row
        row = db.execute("SELECT * FROM checkpoints WHERE path=?", (path,)).fetchone()
    return dict(row) if row else None


def listed(svc, session: str, path: str) -> dict | None:
    return next((c for c in svc.list_checkpoints(session) if c["path"] == path), None)


def test_ttl_and_metadata_are_kept_listed_cleared_and_expired_ones_swept(engine, trained):
    alice, home = engine["alice"], engine["home"]
    before = time.time()
    state = (
        trained.save_state(name="kept", ttl_seconds=3600, user_metadata={"step": "1", "tag": "a"})
        .result()
        .path
    )
    entry = listed(alice, "alice-run", state)
    assert before + 3600 <= entry["expires_at"] <= time.time() + 3600
    assert entry["user_metadata"] == {"step": "1", "tag": "a"} and entry["public"] is False
    assert alice.set_checkpoint_ttl(state, None)["expires_at"] is None
    assert listed(alice, "alice-run", state)["expires_at"] is None
    row = alice.set_checkpoint_ttl(state, 7200)
    assert row["expires_at"] == pytest.approx(time.time() + 7200, abs=5)

    short = trained.save_weights_for_sampler(name="short", ttl_seconds=1).result().path
    directory = parse_path(short).directory(home)
    assert directory.exists() and registry_row(home, short)["expires_at"] is not None
    deadline = time.monotonic() + 15
    while listed(alice, "alice-run", short) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert listed(alice, "alice-run", short) is None
    assert not directory.exists() and registry_row(home, short) is None
    assert parse_path(state).directory(home).exists()  # its TTL is two hours off: kept
    expired = [e for e in alice.audit_log() if e["event"] == "checkpoint_expired"]
    assert [e["details"]["path"] for e in expired] == [short] and expired[0]["owner"] == "alice"


@pytest.mark.parametrize("ttl", [-1, 0, 10**12, 1.5, "soon", True])
def test_out_of_range_ttls_are_refused_naming_the_field_and_change_nothing(engine, trained, ttl):
    path = trained.save_weights_for_sampler(name="bad-ttl").result().path
    http = httpx.Client(
        base_url=engine["url"], headers={"authorization": f"Bearer {engine['keys']['alice']}"}
    )
    answer = http.post("/api/checkpoints/ttl", json={"path": path, "ttl_seconds": ttl})
    assert answer.status_code == 400 and "ttl_seconds" in answer.json()["error"]["message"]
    assert listed(engine["alice"], "alice-run", path)["expires_at"] is None
    with pytest.raises(InvalidRequest, match="ttl_seconds"):
        engine["alice"].set_checkpoint_ttl(path, ttl)
    with pytest.raises(InvalidRequest, match="ttl_seconds"):
        trained.save_state(name="bad-save", ttl_seconds=ttl)
    http.close()


def test_a_published_checkpoint_is_readable_by_every_key_and_writable_only_by_its_owner(
    engine, trained, tmp_path
):
    alice, bob = engine["alice"], engine["bob"]
    weights = trained.save_weights_for_sampler(name="shared").result().path
    state = trained.save_state(name="shared-state").result().path
    with pytest.raises(NotFound):
        bob.create_sampling_client(model_path=weights)
    with pytest.raises(NotFound, match="shared"):
        bob.publish_checkpoint(weights)  # another key's private checkpoint: not found, nothing changed
    assert registry_row(engine["home"], weights)["public"] == 0

    assert alice.publish_checkpoint(weights)["public"] is True
    alice.publish_checkpoint(state)
    prompt = trained.get_tokenizer().encode(SENTENCES[1])[:6]
    mine = alice.create_sampling_client(model_path=weights).compute_logprobs(prompt).result()
    theirs = bob.create_sampling_client(model_path=weights).compute_logprobs(prompt).result()
    assert theirs == mine  # the same adapter, read through the published path
    files = bob.download_checkpoint(weights, tmp_path / "dl")
    assert (files / "adapter_model.safetensors").stat().st_size == (
        parse_path(weights).directory(engine["home"]) / "adapter_model.safetensors"
    ).stat().st_size
    resumed = bob.create_training_client_from_state(state, training_session_name="bob-from-alice")
    assert resumed.name == "bob-from-alice"
    bob.delete_session("bob-from-alice", stop_if_active=True)
    for change in (
        lambda: bob.set_checkpoint_ttl(weights, 3600),
        lambda: bob.unpublish_checkpoint(weights),
        lambda: bob.transport.call("delete_checkpoint", {"path": weights}),
    ):
        with pytest.raises(SessError, match="shared|not found") as refused:
            change()
        assert refused.value.status in (403, 404)
    row = registry_row(engine["home"], weights)
    assert row["public"] == 1 and row["expires_at"] is None
    assert parse_path(weights).directory(engine["home"]).exists()

    copy = bob.copy_checkpoint(weights, ttl_seconds=3600)
    copy_ref = parse_path(copy)
    assert copy_ref.kind == "weights" and copy_ref.name == "shared" and copy_ref.session != "alice-run"
    copied = listed(bob, copy_ref.session, copy)
    assert copied["expires_at"] == pytest.approx(time.time() + 3600, abs=5) and copied["public"] is False
    assert listed(alice, "alice-run", weights)["expires_at"] is None  # the source keeps its own
    assert bob.create_sampling_client(model_path=copy).compute_logprobs(prompt).result() == mine

    assert alice.unpublish_checkpoint(weights)["public"] is False
    with pytest.raises(NotFound):
        bob.create_sampling_client(model_path=weights)
    events = {(e["owner"], e["event"]) for e in alice.audit_log()}
    assert {("alice", "checkpoint_published"), ("alice", "checkpoint_unpublished")} <= events
    assert ("bob", "checkpoint_copied") in {(e["owner"], e["event"]) for e in bob.audit_log()}
    assert not any(e["owner"] == "alice" for e in bob.audit_log())  # a key sees its own entries


def test_a_trace_has_one_slice_per_op_with_its_queue_wait_run_time_and_tokens(engine, trained, tmp_path):
    alice, home = engine["alice"], engine["home"]
    trace = alice.export_trace("alice-run", tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    with sqlite3.connect(home / "registry.db") as db:
        ops = db.execute(
            "SELECT id, name, wall_time_s, queue_s, training_tokens FROM operations WHERE session='alice-run' "
            "ORDER BY finished"
        ).fetchall()
    assert [s["args"]["op_id"] for s in slices] == [op[0] for op in ops] and len(ops) >= 4
    for piece, (_, name, run_s, queue_s, training) in zip(slices, ops):
        assert (
            piece["name"] == name
            and piece["args"]["run_s"] == run_s
            and piece["args"]["queue_wait_s"] == queue_s
        )
        assert (
            piece["dur"] == pytest.approx((run_s + queue_s) * 1e6, abs=1)
            and piece["args"]["training_tokens"] == training
        )
    fb = next(s for s in slices if s["name"] == "forward_backward")
    assert fb["args"]["training_tokens"] == len(trained.get_tokenizer().encode(SENTENCES[0])) - 1
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {"alice-run"}
    with pytest.raises(NotFound):
        engine["bob"].export_trace("alice-run")
    result = runner.invoke(
        app, ["trace", "alice-run", "-o", str(tmp_path / "cli.json")], env=_env(engine, "alice")
    )
    assert result.exit_code == 0, result.output
    cli_slices = [e for e in json.loads((tmp_path / "cli.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert [s["args"]["op_id"] for s in cli_slices][: len(slices)] == [s["args"]["op_id"] for s in slices]


def test_storage_per_key_and_session_and_the_operators_audit_log(engine, trained):
    home = engine["home"]
    on_disk = sum(f.stat().st_size for f in (home / "checkpoints" / "alice-run").rglob("*") if f.is_file())
    mine = {r["session"]: r for r in engine["alice"].storage_usage()}
    assert mine["alice-run"]["bytes"] == on_disk and mine["alice-run"]["owner"] == "alice"
    assert all(r["owner"] == "bob" for r in engine["bob"].storage_usage())
    operator = ServiceClient(engine["url"], api_key=engine["keys"]["local"])
    try:
        owners = {r["owner"] for r in operator.storage_usage()}
        assert "alice" in owners
        events = [(e["owner"], e["event"]) for e in operator.audit_log()]
        assert ("alice", "session_created") in events and ("local", "key_created") in events
        KeyStore(home).set_budget(engine["keys"]["bob"], token_budget=10**9)
        budget = [e for e in operator.audit_log() if e["event"] == "key_budget_set"]
        assert budget[-1]["details"]["owner"] == "bob" and budget[-1]["details"]["token_budget"] == 10**9
    finally:
        operator.close()
    result = runner.invoke(app, ["engine", "audit"], env=_env(engine, "local"))
    assert result.exit_code == 0 and "key_budget_set" in result.output and "session_created" in result.output


def test_creating_stopping_resuming_and_deleting_a_session_are_audited(engine):
    alice = engine["alice"]
    tc = alice.create_lora_training_client("tiny-llama", rank=4, seed=1, training_session_name="audited")
    state = tc.save_state(name="s").result().path
    alice.stop_session("audited")
    alice.create_training_client_from_state(state, training_session_name="audited")  # continues it
    alice.delete_session("audited", stop_if_active=True)
    events = [
        (e["event"], e["details"]) for e in alice.audit_log() if e["details"].get("session") == "audited"
    ]
    assert [event for event, _ in events] == ["session_created", "session_resumed", "session_deleted"]
    assert events[1][1]["path"] == state and events[0][1]["base_model"] == "tiny-llama"


def test_the_cli_lists_expiry_and_metadata_and_publishes(engine, trained):
    path = trained.save_state(name="cli-state", ttl_seconds=3600, user_metadata={"note": "cli"}).result().path
    env = _env(engine, "alice")
    listing = runner.invoke(app, ["checkpoints", "alice-run", "--json"], env=env)
    entry = next(c for c in json.loads(listing.output) if c["path"] == path)
    assert entry["user_metadata"] == {"note": "cli"} and entry["expires_at"] > time.time() + 3500
    table = runner.invoke(app, ["checkpoints", "alice-run"], env=env).output
    line = next(line for line in table.splitlines() if line.startswith(path))
    assert "note=cli" in line and time.strftime("%Y-%m-%d", time.localtime(entry["expires_at"])) in line
    published = runner.invoke(app, ["checkpoints", "publish", path], env=env)
    assert published.exit_code == 0 and "published" in published.output
    assert registry_row(engine["home"], path)["public"] == 1
    refused = runner.invoke(app, ["checkpoints", "unpublish", path], env=_env(engine, "bob"))
    assert refused.exit_code == 1 and "another key" in refused.output
    cleared = runner.invoke(app, ["checkpoints", "ttl", path, "--ttl", "none"], env=env)
    assert cleared.exit_code == 0 and "expires never" in cleared.output
    assert registry_row(engine["home"], path)["expires_at"] is None
    assert runner.invoke(app, ["checkpoints", "unpublish", path], env=env).exit_code == 0


def test_an_old_registry_gains_the_new_columns_and_keeps_its_rows(tmp_path):
    with sqlite3.connect(tmp_path / "registry.db") as db:
        db.executescript(
            "CREATE TABLE checkpoints (path TEXT PRIMARY KEY, session TEXT NOT NULL, owner TEXT NOT NULL, "
            "kind TEXT NOT NULL, created REAL);"
            "INSERT INTO checkpoints VALUES ('sess://old/state/s1', 'old', 'alice', 'state', 1.0);"
            "CREATE TABLE operations (id TEXT PRIMARY KEY, session TEXT, owner TEXT NOT NULL, name TEXT NOT NULL, "
            "ok INTEGER, error TEXT, finished REAL, wall_time_s REAL, prefill_tokens INTEGER, "
            "sampled_tokens INTEGER, training_tokens INTEGER);"
            "INSERT INTO operations VALUES ('op1', 'old', 'alice', 'optim_step', 1, NULL, 2.0, 0.5, 0, 0, 0);"
        )
    registry = Registry(tmp_path)
    try:
        row = registry.checkpoint("sess://old/state/s1")
        assert row["owner"] == "alice" and row["expires_at"] is None and row["public"] is False
        registry.update_checkpoint("sess://old/state/s1", expires_at=5.0, user_metadata={"k": "v"})
        assert [r["path"] for r in registry.checkpoint_rows(expired_before=6.0)] == ["sess://old/state/s1"]
        assert registry.checkpoint("sess://old/state/s1")["user_metadata"] == {"k": "v"}
        registry.record_operation("op2", "alice", "forward", "old", None, {"training_tokens": 3}, 0, 0.25)
        assert [(o["id"], o["queue_s"]) for o in registry.operations("old")] == [("op1", 0), ("op2", 0.25)]
    finally:
        registry.close()


def _env(engine, who: str) -> dict:
    return {
        "SESS_ENGINE_URL": engine["url"],
        "SESS_API_KEY": engine["keys"][who],
        "SESS_HOME": str(engine["home"]),
    }
