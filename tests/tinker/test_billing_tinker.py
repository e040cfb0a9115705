"""Budgets, back-pressure and billing usage through the unmodified tinker SDK (0.38.0, in a venv of
its own), and back-pressure through the sess SDK: an engine with USD prices and a queue limit of 2
ops per key. The tinker client trains into its budget (402: the SDK logs the engine's message and
pauses) and goes on after `sess engine keys budget` raises it; a burst of forward passes past the
queue limit (429 + Retry-After) is re-sent by the SDK and each op runs once; its billing-usage
report (``AdminClient.get_billing_usage``) carries the same tokens and cost as `sess usage`, with
cached prefill apart (0 tokens: the engine keeps no prefix cache, and says so)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore

from helpers import SENTENCES, ce_datum
from tinker_helpers import make_tinker_venv

runner = CliRunner()
PRICES = (
    "currency: USD\nmodels:\n  default: {prefill: 1.5, cached_prefill: 0.25, sampled: 2.5, trained: 3.5}\n"
)
QUEUE_LIMIT = 2


@pytest.fixture(scope="module")
def limited_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limited")
    (tmp / "prices.yaml").write_text(PRICES)
    home = tmp / "home"
    info = start_engine(
        home, extra_args=["--prices", str(tmp / "prices.yaml"), "--max-queued", str(QUEUE_LIMIT)]
    )
    yield {"home": home, "url": info["url"]}
    stop_engine(home)


def _usage(url: str, key: str) -> dict:
    svc = ServiceClient(url, api_key=key)
    try:
        return svc.transport.usage(None)
    finally:
        svc.close()


def test_the_sess_sdk_waits_out_a_full_queue_and_each_op_runs_once(limited_engine, caplog):
    caplog.set_level(logging.INFO, "sess.engine")
    key = KeyStore(limited_engine["home"]).add("burst")["key"]
    svc = ServiceClient(limited_engine["url"], api_key=key)
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
    data = [ce_datum(tc.get_tokenizer().encode(SENTENCES[0]))]
    futures = [tc.forward(data) for _ in range(12)]  # 12 at once against a limit of 2
    losses = [f.result().metrics["loss:sum"] for f in futures]
    assert len(losses) == 12 and max(losses) - min(losses) < 1e-4
    report = _usage(limited_engine["url"], key)
    assert report["operations"]["forward"]["count"] == 12  # no op lost, none run twice
    assert "engine busy (/api/submit): retrying" in caplog.text  # the limit was met, and waited out
    tc.stop()
    svc.close()


def test_tinker_sdk_pauses_at_the_budget_resumes_when_raised_and_waits_out_a_full_queue(
    limited_engine, tmp_path_factory
):
    home, url = limited_engine["home"], limited_engine["url"]
    python = make_tinker_venv(tmp_path_factory.mktemp("tinker-billing"))
    entry = KeyStore(home).add("tinker-budget", budget="0.0001")
    tmp = tmp_path_factory.mktemp("tinker-run")
    svc = ServiceClient(url, api_key=entry["key"])
    tokens = svc.get_tokenizer("tiny-llama").encode(SENTENCES[1])
    svc.close()
    spec = {
        "out": str(tmp / "out.json"),
        "log": str(tmp / "sdk.log"),
        "tokens": tokens,
        "steps": 6,
        "burst": 8,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "SESS_"))}
    env.update(TINKER_API_KEY=entry["key"], TINKER_BASE_URL=url, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
    script = Path(__file__).parent.parent / "tinker_scripts" / "billing.py"
    client = subprocess.Popen([str(python), str(script), json.dumps(spec)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    log = Path(spec["log"])
    deadline = time.monotonic() + 240
    while not (log.exists() and "budget" in log.read_text()):  # the SDK paused on the 402
        assert client.poll() is None, client.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the budget never stopped the tinker client"
        time.sleep(0.5)
    paused = log.read_text()
    assert "paused due to billing status" in paused and "budget of 0.0001 USD" in paused
    assert f"sess engine keys budget {entry['id']}" in paused
    raised = runner.invoke(app, ["engine", "keys", "budget", entry["id"], "5", "--home", str(home)])
    assert raised.exit_code == 0, raised.output
    output = client.communicate(timeout=300)[0]
    assert client.returncode == 0, output[-3000:]
    out = json.loads(Path(spec["out"]).read_text())
    assert len(out["losses"]) == 6 and out["losses"][-1] < out["losses"][0]  # the same model went on
    assert len(out["burst"]) == 8
    report = _usage(url, entry["key"])
    ops = report["operations"]
    assert ops["forward_backward"]["count"] == 6 and ops["forward"]["count"] == 8  # each op once
    # the billing-usage route: the same tokens and cost as sess usage, hourly, with the table's rates
    events = out["events"]
    trained = sum(e["tokens"] for e in events if e["type"] == "training")
    prefill = [e for e in events if e["type"] == "sampling_prefill"]
    sampled = sum(e["tokens"] for e in events if e["type"] == "sampling_sample")
    assert trained == ops["forward_backward"]["training_tokens"]
    assert sum(e["tokens"] for e in prefill) == (
        ops["forward"]["training_tokens"] + ops["sample"]["prefill_tokens"]
    )
    assert {e["cached"] for e in prefill} == {False}  # no prefix cache: every prompt token computed
    assert out["prompt_cache_hit_tokens"] == 0 and ops["sample"]["cached_prefill_tokens"] == 0
    assert ops["sample"]["prefill_tokens"] == len(tokens)  # the prompt, once for its 2 samples
    assert sampled == ops["sample"]["sampled_tokens"] == out["sampled_tokens"] > 0
    rates = {e["type"]: e["rate"] for e in events}
    assert rates == {"training": 3.5, "sampling_prefill": 1.5, "sampling_sample": 2.5}
    assert all(e["bucket_start"].endswith(":00:00+00:00") for e in events)
    cost = sum(Decimal(str(e["cost"])) for e in events)
    assert abs(cost - Decimal(report["usage"]["cost"])) < Decimal("1e-12")
