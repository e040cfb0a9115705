"""Prices, cost and budgets: a price table's checks, exact costs per op kind over HTTP, `sess usage`
with costs, and a key's budget refusing new work (402) until it is raised, its session going on."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import SamplingParams, ServiceClient
from sess.engine.protocol.errors import SessError
from sess.engine.protocol.prices import PriceError, PriceTable, billed_tokens, format_cost, load_prices
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.options import EngineOptions, load_price_table

from helpers import SENTENCES, ce_datum

runner = CliRunner()
PRICES = """
currency: EUR
models:
  default: {prefill: 0.5, sampled: 0.5, trained: 0.5}
  tiny-llama: {prefill: 1.25, sampled: 2.5, trained: 3.000001}
"""


def write(tmp_path, text: str, name: str = "prices.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, named",
    [
        ("currency: USD\nmodels: {default: {prefill: 1, sampled: 1, trained: [1}", "not valid YAML"),
        (
            "currency: USD\nmodels:\n  default: {prefill: -1, sampled: 1, trained: 1}",
            "models.default.prefill",
        ),
        (
            "currency: USD\nmodels:\n  default: {prefill: .nan, sampled: 1, trained: 1}",
            "models.default.prefill",
        ),
        (
            "currency: USD\nmodels:\n  default: {prefill: 1, sampled: .inf, trained: 1}",
            "models.default.sampled",
        ),
        ("currency: USD\nmodels:\n  default: {prefill: 1, sampled: 1}", "models.default.trained: missing"),
        (
            "currency: USD\nmodels:\n  default: {prefill: 1, sampled: 1, trained: 1, tax: 2}",
            "models.default.tax",
        ),
        ("currency: USD\nmodels:\n  tiny-lama: {prefill: 1, sampled: 1, trained: 1}", "models.default"),
        (
            "currency: USD\nmodels:\n  default: {prefill: 1, sampled: 1, trained: 1}\n"
            "  tiny-lama: {prefill: 1, sampled: 1, trained: 1}",
            "models.tiny-lama: unknown model",
        ),
        ("currency: USD\nmodels:\n  default: {prefill: 0.0000001, sampled: 1, trained: 1}", "6 decimals"),
        ("models:\n  default: {prefill: 1, sampled: 1, trained: 1}", "currency"),
        ("[1, 2]", "expected a mapping"),
    ],
)
def test_a_bad_price_table_is_refused_naming_the_entry(tmp_path, text, named):
    path = write(tmp_path, text)
    with pytest.raises(PriceError, match=named.replace(".", r"\.")):
        load_price_table(path)
    problem = EngineOptions(prices=path).check()
    assert problem.startswith("--prices: ") and named in problem


def test_engine_up_refuses_a_bad_table_before_it_serves(tmp_path):
    path = write(tmp_path, "currency: USD\nmodels:\n  default: {prefill: -2, sampled: 1, trained: 1}")
    home = tmp_path / "home"
    result = runner.invoke(app, ["engine", "up", "--home", str(home), "--prices", path])
    assert result.exit_code == 1 and "models.default.prefill" in result.output
    assert not (home / "engine.json").exists()


def test_costs_are_exact_per_op_kind(tmp_path):
    table = load_prices(write(tmp_path, PRICES))
    usage = {"prefill_tokens": 3, "sampled_tokens": 7, "training_tokens": 1000}
    # forward_backward trains its tokens; forward reads them at the prefill price
    assert table.cost("tiny-llama", "forward_backward", {"training_tokens": 1000}) == 3_000_001 * 1000
    assert format_cost(table.cost("tiny-llama", "forward", {"training_tokens": 1000})) == "0.00125"
    expected = Decimal("3") * Decimal("1.25") + 7 * Decimal("2.5") + 1000 * Decimal("3.000001")
    assert Decimal(format_cost(table.cost("tiny-llama", "sample", usage))) == expected / 10**6
    assert table.cost("some/other", "sample", {"sampled_tokens": 2}) == 2 * 500_000
    assert load_prices(
        write(tmp_path, "currency: X\nmodels: {default: {prefill: 0, sampled: 0, trained: 0}}")
    )


def test_cached_prefill_has_its_own_price_and_defaults_to_the_prefill_one(tmp_path):
    table = load_prices(
        write(
            tmp_path,
            "currency: USD\nmodels:\n  default: {prefill: 0.5, sampled: 1, trained: 1}\n"
            "  tiny-llama: {prefill: 2, cached_prefill: 0.25, sampled: 1, trained: 1}\n",
        )
    )
    usage = {"prefill_tokens": 10, "cached_prefill_tokens": 4}
    # 4 of the 10 prompt tokens came from a cache: 6 at the prefill price, 4 at the cached one
    assert billed_tokens("sample", usage) == {"prefill": 6, "cached_prefill": 4, "sampled": 0, "trained": 0}
    assert table.cost("tiny-llama", "sample", usage) == 6 * 2_000_000 + 4 * 250_000
    assert table.cost("other", "sample", usage) == 10 * 500_000  # unpriced: cached costs prefill
    assert billed_tokens("sample", {"prefill_tokens": 3})["cached_prefill"] == 0
    wire = table.to_wire()["models"]
    assert wire["tiny-llama"]["cached_prefill"] == "0.25" and wire["default"]["cached_prefill"] == "0.5"
    assert PriceTable.from_wire(table.to_wire()).models == table.models
    with pytest.raises(PriceError, match=r"models\.default\.cached_prefill"):
        load_prices(write(tmp_path, "currency: USD\nmodels:\n  default: {prefill: 1, cached_prefill: -1, "
                                    "sampled: 1, trained: 1}\n"))  # fmt: skip


@pytest.fixture(scope="module")
def priced_engine(tmp_path_factory):
    """An engine with a price table and a small queue limit, in a home of its own."""
    tmp = tmp_path_factory.mktemp("priced")
    home = tmp / "home"
    info = start_engine(home, extra_args=["--prices", write(tmp, PRICES)])
    yield {"home": home, "url": info["url"], "env": {"SESS_HOME": str(home), "SESS_ENGINE_URL": info["url"]}}
    stop_engine(home)


def _cli(env, *args):
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result.output


def test_usage_cost_per_op_kind_sums_to_the_total(priced_engine):
    env = priced_engine["env"]
    svc = ServiceClient(priced_engine["url"], home=priced_engine["home"])
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="priced")
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(s)) for s in SENTENCES[:2]]
    tokens = sum(d.model_input.length for d in data)
    tc.forward(data).result()
    tc.forward_backward(data).result()
    tc.optim_step().result()
    sc = tc.create_sampling_client()
    prompt = tok.encode("one two three")
    sampled = sum(
        len(s.tokens)
        for s in sc.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=5, seed=2))
        .result()
        .sequences
    )
    pico_per = {"prefill": 1_250_000, "sampled": 2_500_000, "trained": 3_000_001}
    expected = {
        "forward": tokens * pico_per["prefill"],
        "forward_backward": tokens * pico_per["trained"],
        "optim_step": 0,
        "sample": len(prompt) * pico_per["prefill"] + sampled * pico_per["sampled"],
    }
    report = json.loads(_cli(env, "usage", "priced", "--json"))
    assert report["currency"] == "EUR"
    for op, pico in expected.items():
        assert Decimal(report["operations"][op]["cost"]) == Decimal(pico) / 10**12, op
    rows = sum(Decimal(r["cost"]) for r in report["operations"].values())
    assert Decimal(report["usage"]["cost"]) == rows == Decimal(sum(expected.values())) / 10**12
    usage = svc.get_usage("priced")  # the SDK's usage call carries the same cost
    assert Decimal(usage.cost) == rows and usage.currency == "EUR"
    by_session = json.loads(_cli(env, "usage", "--json", "--by", "session"))
    assert Decimal(by_session["rows"]["priced"]["cost"]) == rows
    by_key = json.loads(_cli(env, "usage", "--json", "--by", "key"))
    assert sum(Decimal(r["cost"]) for r in by_key["rows"].values()) == Decimal(by_key["usage"]["cost"])
    assert report["operations"]["sample"]["cached_prefill_tokens"] == 0  # no prefix cache: none served
    assert report["usage"]["cached_prefill_tokens"] == 0
    table = _cli({**env, "COLUMNS": "200"}, "usage", "priced")
    assert "cost (EUR)" in table and report["usage"]["cost"] in table and "cached" in table
    tc.stop()
    svc.close()


def test_without_prices_no_cost_is_shown(http_engine, sess_home):
    env = {"SESS_HOME": str(sess_home), "SESS_ENGINE_URL": http_engine["url"]}
    report = json.loads(_cli(env, "usage", "--json"))
    assert report["currency"] is None and report["usage"]["cost"] is None
    assert all(row["cost"] is None for row in report["operations"].values())
    assert "cost" not in _cli(env, "usage")


def test_a_budget_refuses_new_work_and_raising_it_lets_the_session_go_on(priced_engine):
    home, url = priced_engine["home"], priced_engine["url"]
    added = runner.invoke(
        app, ["engine", "keys", "add", "--owner", "dora", "--budget", "0.0001", "--home", str(home)]
    )
    assert added.exit_code == 0, added.output
    key = added.stdout.strip()
    key_id = key.split("-")[1]
    svc = ServiceClient(url, api_key=key)
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0, training_session_name="dora-1")
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(s)) for s in SENTENCES[:3]]
    steps = 0
    with pytest.raises(SessError) as refused:
        while steps < 50:  # each costs ~ tokens * 3e-6 EUR: the budget runs out in a few
            tc.forward_backward(data).result()
            tc.optim_step().result()
            steps += 1
    message = str(refused.value)
    assert refused.value.status == 402 and steps >= 1
    assert "budget of 0.0001 EUR" in message and f"sess engine keys budget {key_id}" in message
    listed = json.loads(_cli({}, "engine", "keys", "list", "--home", str(home), "--json"))
    [row] = [r for r in listed if r["id"] == key_id]
    assert row["budget"] == "0.0001" and Decimal(row["spent"]) >= Decimal("0.0001")
    # state is kept: a save goes through past the budget
    saved = tc.save_state().result()
    assert saved.path.startswith("sess://dora-1/")
    # the raw HTTP answer is a 402 with the same message
    raw = httpx.post(
        f"{url}/api/submit",
        headers={"authorization": f"Bearer {key}"},
        json={"name": "compute_logprobs", "args": {"target": {"session": "dora-1"}, "prompt": [1, 2, 3]}},
    )
    assert raw.status_code == 402 and "budget" in raw.json()["error"]["message"]
    _cli({}, "engine", "keys", "budget", key_id, "1", "--home", str(home))
    out = tc.forward_backward(data).result()  # the same session, the same client, goes on
    assert out.metrics["loss:sum"] > 0
    tc.optim_step().result()
    tc.stop()
    svc.close()


def test_budget_options_are_checked(tmp_path):
    home = str(tmp_path)
    for args, named in (
        (["--budget", "-1"], "--budget"),
        (["--budget", "nan"], "--budget"),
        (["--token-budget", "-5"], "--token-budget"),
    ):
        result = runner.invoke(app, ["engine", "keys", "add", "--home", home, *args])
        assert result.exit_code == 1 and named in result.output, result.output
    key = runner.invoke(app, ["engine", "keys", "add", "--home", home, "--token-budget", "10"]).stdout.strip()
    key_id = key.split("-")[1]
    result = runner.invoke(app, ["engine", "keys", "budget", key_id, "inf", "--home", home])
    assert result.exit_code == 1 and "finite" in result.output
    listed = json.loads(_cli({}, "engine", "keys", "list", "--home", home, "--json"))
    assert [r["token_budget"] for r in listed if r["id"] == key_id] == [10]


def test_a_home_from_before_costs_is_migrated(tmp_path):
    import sqlite3

    from sess.engine.server.sqlite_registry import Registry

    old = sqlite3.connect(tmp_path / "registry.db")
    old.executescript(
        "CREATE TABLE operations (id TEXT PRIMARY KEY, session TEXT, owner TEXT NOT NULL, name TEXT NOT NULL,"
        " ok INTEGER, error TEXT, finished REAL, wall_time_s REAL, prefill_tokens INTEGER,"
        " sampled_tokens INTEGER, training_tokens INTEGER);"
        "CREATE TABLE usage (session TEXT NOT NULL, owner TEXT NOT NULL, operation TEXT NOT NULL, count INTEGER,"
        " prefill_tokens INTEGER, sampled_tokens INTEGER, training_tokens INTEGER, wall_time_s REAL,"
        " PRIMARY KEY (session, operation));"
        "INSERT INTO operations VALUES ('a', 's', 'ann', 'forward_backward', 1, NULL, 1.0, 0.5, 0, 0, 40);"
        "INSERT INTO operations VALUES ('b', 's', 'ann', 'sample', 1, NULL, 2.0, 0.5, 5, 7, 0);"
    )
    old.commit()
    old.close()
    registry = Registry(tmp_path)
    spend = registry.spend("ann")
    assert (
        spend["operations"],
        spend["prefill_tokens"],
        spend["sampled_tokens"],
        spend["training_tokens"],
    ) == (
        2,
        5,
        7,
        40,
    )
    assert spend["cost_pu"] == 0  # no cost was recorded before prices: none is made up
    registry.record_operation("c", "ann", "forward_backward", "s", None, {"training_tokens": 10}, cost_pu=123)
    assert registry.spend("ann")["cost_pu"] == 123 and registry.spend("ann")["training_tokens"] == 50
    registry.forget_session("s")  # a deleted session's spend stays with its owner
    assert registry.spend("ann")["training_tokens"] == 50
    registry.close()


def test_runs_show_and_compare_show_cost(tmp_path):
    for name, cost in (("run-a", "0.0125"), ("run-b", None)):
        run = tmp_path / name
        run.mkdir()
        (run / "meta.json").write_text(json.dumps({"status": "completed", "created": "now", "session": name}))
        (run / "config.yaml").write_text("loop: {name: sft, steps: 1}\nmodel: {name: tiny-llama}\n")
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 1.0}) + "\n")
        usage = {
            "prefill_tokens": 3,
            "sampled_tokens": 4,
            "training_tokens": 5,
            "wall_time_s": 1.0,
            "operations": 2,
        }
        if cost:
            usage |= {"cost": cost, "currency": "EUR"}
        (run / "usage.json").write_text(json.dumps(usage))
    env = {"COLUMNS": "200"}
    shown = _cli(env, "runs", "show", "run-a", "--dir", str(tmp_path))
    assert "usage 12 tokens" in shown and "cost 0.0125 EUR" in shown
    assert "cost" not in _cli(env, "runs", "show", "run-b", "--dir", str(tmp_path))
    compared = _cli(env, "runs", "compare", "run-a", "run-b", "--dir", str(tmp_path))
    assert "total tokens" in compared and "0.0125 EUR" in compared


def test_the_tinker_billing_route_refuses_a_bad_window_naming_the_parameter(priced_engine):
    key = (priced_engine["home"] / "api_key").read_text().strip()
    route = f"{priced_engine['url']}/api/v1/billing/usage/events"
    for params, named in (
        ({"ending_before": "2026-01-01T00:00:00Z"}, "starting_on: missing"),
        ({"starting_on": "yesterday", "ending_before": "2026-01-01T00:00:00Z"}, "starting_on: expected"),
        ({"starting_on": "2026-01-01T00:30:00Z", "ending_before": "2026-01-02T00:00:00Z"}, "hour boundary"),
        ({"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-02-01T00:00:00Z"}, "14 days"),
    ):
        answer = httpx.get(route, params=params, headers={"x-api-key": key})
        assert answer.status_code == 400 and named in answer.json()["detail"], answer.text
    window = {"starting_on": "2020-01-01T00:00:00Z", "ending_before": "2020-01-02T00:00:00Z"}
    assert httpx.get(route, params=window, headers={"x-api-key": key}).json()["data"] == []
