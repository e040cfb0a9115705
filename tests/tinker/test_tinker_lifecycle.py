"""Checkpoint lifecycles, sharing and operations through the unmodified tinker 0.38 SDK (its own venv)
against an engine process that sweeps expired checkpoints every 0.3 s: TTLs listed, cleared and
swept (files and registry rows) except while a sampler holds one; metadata on checkpoints and runs;
project filters; a different base model on load refused naming both; a published checkpoint read
by a second key, which cannot change it, and copied with its own TTL; a session trace; the
AdminClient's storage and audit log. Slow: a venv of its own (about 40 s from pip's cache)."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import ids

from helpers import SENTENCES
from tinker_helpers import make_tinker_venv, run_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    home = tmp_path_factory.mktemp("tinker-lifecycle-home")
    keys = KeyStore(home)
    key_a, key_b = keys.add("alice")["key"], keys.add("bob")["key"]
    python = make_tinker_venv(tmp_path_factory.mktemp("tinker-sdk"))
    os.environ["SESS_CHECKPOINT_SWEEP_S"] = "0.3"
    try:
        info = start_engine(home)
    finally:
        os.environ.pop("SESS_CHECKPOINT_SWEEP_S", None)
    try:
        from sess.engine import ServiceClient

        with ServiceClient(info["url"], api_key=key_a) as svc:
            tokenizer = svc.get_tokenizer("tiny-llama")
        spec = {
            "out": str(home / "lifecycle.json"),
            "key_b": key_b,
            "tokens": tokenizer.encode(SENTENCES[0]),
            "prompt": tokenizer.encode(SENTENCES[1])[:6],
        }
        out = run_client(python, "lifecycle.py", spec, url=info["url"], key=key_a, timeout=400)
        # the sampler that held "held" went with its session: the next sweeps delete it
        held = ids.to_sess_path(out["held"])
        directory = home / "checkpoints" / held[len("sess://") :]
        deadline = time.monotonic() + 15
        while directory.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["held_gone_after_release"] = not directory.exists() and _row(home, held) is None
        yield {**out, "home": home, "trained_tokens": len(spec["tokens"]) - 1}
    finally:
        stop_engine(home)


def _row(home, path: str):
    with sqlite3.connect(home / "registry.db") as db:
        return db.execute("SELECT expires_at, public FROM checkpoints WHERE path=?", (path,)).fetchone()


def test_ttls_are_kept_listed_set_cleared_and_swept(outcome):
    state, kept = outcome["state"], outcome["kept"]
    listed = outcome["listed"]
    assert outcome["before"] + 7200 <= listed[state]["expires_at"] <= outcome["before"] + 7200 + 60
    assert outcome["before"] + 3600 <= listed[kept]["expires_at"] <= outcome["before"] + 3600 + 60
    assert listed[state]["user_metadata"] == {"k": "v"} and listed[kept]["user_metadata"] == {"stage": "rl"}
    assert outcome["cleared"]["expires_at"] is None
    assert outcome["reset"]["expires_at"] == pytest.approx(outcome["before"] + 86400, abs=120)
    for ttl, refused in outcome["bad_ttls"].items():
        assert refused["status"] == 400 and "ttl_seconds" in refused["message"], (ttl, refused)
    assert outcome["after_bad"] == outcome["reset"]  # nothing changed
    assert "ttl_seconds" in outcome["bad_save_ttl"]["message"]
    # expired and unheld: gone from the listing, the disk and the registry
    gone = ids.to_sess_path(outcome["gone"])
    assert outcome["gone_listed"] is False and _row(outcome["home"], gone) is None
    assert not (outcome["home"] / "checkpoints" / gone[len("sess://") :]).exists()
    # expired while a sampler of a live session held it: kept and sampling, deleted once released
    assert outcome["held_listed"] is True and outcome["held_still_samples"] is True
    assert outcome["held_gone_after_release"] is True


def test_run_metadata_projects_and_the_base_model_on_load(outcome):
    assert outcome["run_metadata"] == {"run": "r1"}
    assert outcome["run"] in outcome["project_a"] and outcome["project_b"] == []
    assert outcome["display_name"] == "lifecycle run"
    refused = outcome["other_base"]
    assert (
        refused["status"] == 400 and "tiny-qwen3" in refused["message"] and "tiny-llama" in refused["message"]
    )
    assert outcome["loaded_metadata"] == {"from": "st"}


def test_a_published_checkpoint_is_read_by_another_key_and_changed_only_by_its_owner(outcome):
    assert outcome["b_before_publish"]["status"] == 404
    assert outcome["published_listed"] is True
    assert outcome["b_samples_same"] is True and outcome["b_weights_info"] == "tiny-llama"
    external = ids.to_sess_path(outcome["external"])
    on_disk = (
        outcome["home"] / "checkpoints" / external[len("sess://") :] / "adapter" / "adapter_model.safetensors"
    )
    assert outcome["b_download_bytes"] == on_disk.stat().st_size
    for change in ("b_delete", "b_unpublish", "b_ttl"):
        assert outcome[change]["status"] == 403 and "another key" in outcome[change]["message"], change
    assert (
        outcome["b_publish_private"]["status"] == 404 and "private" in outcome["b_publish_private"]["message"]
    )
    assert outcome["after_b"]["public"] is True and outcome["after_b"]["expires_at"] is None
    copy = outcome["copy_listed"][outcome["copy"]]
    assert outcome["before"] + 7200 <= copy["expires_at"] <= outcome["before"] + 7200 + 300
    assert copy["public"] is False
    assert outcome["copy_in_project_b"] is True and outcome["copy_samples_same"] is True
    assert outcome["b_after_unpublish"]["status"] == 404
    # a published training state loads into a run of bob's own: the weights alice saved
    assert outcome["b_load_private"]["status"] == 404
    assert outcome["b_loaded_run"].startswith("tk-") and outcome["b_loaded_run"] != outcome["run"]
    assert outcome["b_loaded_loss"] == pytest.approx(outcome["a_loss"], rel=1e-5)


def test_the_session_trace_has_one_slice_per_op_and_others_cannot_read_it(outcome):
    events = outcome["trace"]["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    names = [s["name"] for s in slices]
    assert names.count("forward_backward") == 1 and names.count("optim_step") == 1
    assert names.count("save_state") == 3 and names.count("save_weights") == 5
    # alice's three scorings of her own checkpoints; bob's of the published one are his, not her run's
    assert names.count("sample") == 3 and names.count("create_session_from_state") == 1
    for piece in slices:
        args = piece["args"]
        assert piece["dur"] == pytest.approx((args["queue_wait_s"] + args["run_s"]) * 1e6, abs=1)
        assert args["queue_wait_s"] >= 0 and args["run_s"] >= 0
    fb = slices[names.index("forward_backward")]
    assert fb["args"]["training_tokens"] == outcome["trained_tokens"]
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} >= {
        outcome["run"].replace(":", ".")
    }
    assert outcome["b_trace"]["status"] == 404


def test_admin_storage_and_audit_log(outcome):
    alice = [item for item in outcome["storage"] if item["org_user_urn"] == "alice"]
    # the bytes of every checkpoint alice's key lists, read just after the storage report
    assert sum(item["size_bytes"] for item in alice) == outcome["listed_bytes"] > 0
    assert sum(item["checkpoint_count"] for item in alice) == outcome["listed_count"] >= 5
    assert {item["org_user_urn"] for item in outcome["storage_b"]} == {"bob"}
    events = [e["event"] for e in outcome["audit"]]
    for event in ("session_created", "checkpoint_ttl_set", "checkpoint_expired", "checkpoint_published"):
        assert event in events, event
    published = next(e for e in outcome["audit"] if e["event"] == "checkpoint_published")
    assert published["tinker_path"] == outcome["shared"] and published["details"]["owner"] == "alice"
    assert set(outcome["audit_checkpoints"]) == {e for e in events if e.startswith("checkpoint_")}
