"""The ledger is written before the answer: an engine whose home fills up (a small tmpfs) answers 507
for every op it cannot record, never a success without its row, and once space is freed every
key's spend equals the sum of its operation rows and every session's usage the sum of its rows."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time

import pytest

from sess.engine import SamplingParams, ServiceClient
from sess.engine.protocol.errors import SessError
from sess.engine.sdk.local_engine import start_engine, stop_engine

from helpers import SENTENCES, ce_datum

TOKENS = ("prefill_tokens", "sampled_tokens", "training_tokens")


@pytest.fixture()
def small_home(tmp_path):
    """A 160 MB tmpfs as the engine home (skipped where mounting is not allowed)."""
    home = tmp_path / "home"
    home.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(home)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"needs a small tmpfs, and mount is not permitted here: {mounted.stderr.strip()}")
    yield home
    subprocess.run(["umount", "-l", str(home)], check=False)


def fill(path) -> None:
    """Write ``path`` until the file system is full."""
    try:
        with open(path, "wb") as out:
            while True:
                out.write(b"\0" * (1 << 16))
                out.flush()
    except OSError:
        pass
    # and the last pages a small write could still take
    for i in range(64):
        try:
            with open(f"{path}.{i}", "wb") as out:
                out.write(b"\0" * 512)
        except OSError:
            break


def run_ops(tc, sampler, tok, answered: dict) -> list[SessError]:
    """One forward_backward, one sample and one compute_logprobs; count each success by op name."""
    errors = []
    prompt = tok.encode("The cat")
    calls = {
        "forward_backward": lambda: tc.forward_backward(
            [ce_datum(tok.encode(SENTENCES[0]))], "cross_entropy"
        ),
        "sample": lambda: sampler.sample(prompt, 1, SamplingParams(max_tokens=4, seed=1)),
        "compute_logprobs": lambda: sampler.compute_logprobs(prompt),
    }
    for name, call in calls.items():
        try:
            call().result()
        except SessError as exc:
            errors.append(exc)
        else:
            answered[name] = answered.get(name, 0) + 1
    return errors


def ledger(home) -> sqlite3.Connection:
    db = sqlite3.connect(home / "registry.db")
    db.row_factory = sqlite3.Row
    return db


def test_a_full_disk_never_answers_an_op_it_did_not_bill(small_home):
    info = start_engine(small_home)
    filler = small_home / "filler"
    try:
        client = ServiceClient(info["url"], home=small_home)
        tc = client.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=0)
        tok = tc.get_tokenizer()
        sampler = tc.save_weights_and_get_sampling_client("before-full")
        answered: dict[str, int] = {}
        assert run_ops(tc, sampler, tok, answered) == []

        fill(filler)
        started = time.monotonic()
        with pytest.raises(SessError, match="No space left on device"):  # a save fails at once, whole
            tc.save_state("on-a-full-disk").result()
        assert time.monotonic() - started < 2.0
        refused = []
        for _ in range(6):
            refused += run_ops(tc, sampler, tok, answered)

        for path in small_home.glob("filler*"):
            path.unlink()
        assert run_ops(tc, sampler, tok, answered) == []
        session = tc.name

        db = ledger(small_home)
        rows = db.execute(
            "SELECT name, COUNT(*) AS n FROM operations WHERE ok=1 AND session=? GROUP BY name", (session,)
        )
        recorded = {r["name"]: r["n"] for r in rows}
        for name, count in answered.items():  # every answer that came back has its row
            assert recorded.get(name) == count, (name, recorded, answered)
        assert refused, "the full disk refused no op: the tmpfs did not fill"
        for exc in refused:
            assert exc.status == 507 and "ledger" in str(exc) and "registry.db" in str(exc), str(exc)
        for owner in [r["owner"] for r in db.execute("SELECT DISTINCT owner FROM operations")]:
            spend = dict(db.execute("SELECT * FROM spend WHERE owner=?", (owner,)).fetchone())
            ops = db.execute(
                "SELECT COUNT(*) AS n, "
                + ", ".join(f"SUM({k}) AS {k}" for k in TOKENS)
                + " FROM operations WHERE owner=?",
                (owner,),
            ).fetchone()
            assert spend["operations"] == ops["n"]
            assert all(spend[k] == (ops[k] or 0) for k in TOKENS), (dict(ops), spend)
        usage_rows = db.execute(
            "SELECT "
            + ", ".join(f"SUM({k}) AS {k}" for k in TOKENS)
            + ", SUM(count) AS n FROM usage WHERE session=?",
            (session,),
        ).fetchone()
        op_rows = db.execute(
            "SELECT "
            + ", ".join(f"SUM({k}) AS {k}" for k in TOKENS)
            + ", COUNT(*) AS n FROM operations WHERE session=?",
            (session,),
        ).fetchone()
        assert dict(usage_rows) == dict(op_rows)
        total = client.get_usage(session)  # the session's own counters, as a client reads them
        assert all(getattr(total, k) == usage_rows[k] for k in TOKENS), (total, dict(usage_rows))
        assert total.operations == usage_rows["n"]
        saved = json.loads(db.execute("SELECT usage FROM sessions WHERE name=?", (session,)).fetchone()[0])
        assert all(saved.get(k, 0) == usage_rows[k] for k in TOKENS), (saved, dict(usage_rows))
        client.close()
    finally:
        for path in small_home.glob("filler*"):
            path.unlink()
        stop_engine(small_home)
        os.sync()
