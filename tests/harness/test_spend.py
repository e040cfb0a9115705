"""What a run is expected to spend and how it tracks: `sess run --dry-run --pilot N` says first what it
will load and cost, then gives the expected figure beside the bound; the run records both in
`forecast.json`, its spend so far and projected total each step, and `sess runs show` compares them
with what it used. SFT's trained tokens are expected exactly. The projection's arithmetic is exact for
steps of equal cost, even when the first one carries groups sampled ahead, and for steps that train
a share of their groups, the steps left at the share modelled as a walk in 0..1 (:mod:`.share`)."""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.harness.costs.dry_run import forecast_run
from sess.harness.costs.share import expected_share, shares_ahead
from sess.harness.costs.spend import SpendMeter
from sess.harness.records import read_jsonl

cli = CliRunner()
PRICES = "currency: USD\nmodels:\n  default: {prefill: 0.7, sampled: 1.9, trained: 2.3}\n"
TINY = ["model=tiny-llama", "data.eval_size=4", "loop.max_tokens=8", "loop.batch_size=2", "loop.steps=3"]
EXPECTED = re.compile(r"expect: (\d+) tokens \(prefill (\d+), sampled (\d+), trained (\d+)\)")
BOUND = re.compile(r"tokens: at most (\d+) ")
RANGE = re.compile(r"no learning assumed: (\d+)-(\d+) tokens as the share goes 0..1")


@pytest.fixture()
def fresh_engine(tmp_path):
    """A priced engine that has loaded no model yet."""
    (tmp_path / "prices.yaml").write_text(PRICES)
    home = tmp_path / "home"
    info = start_engine(home, extra_args=["--prices", str(tmp_path / "prices.yaml")])
    yield {"home": home, "url": info["url"], "env": {"SESS_HOME": str(home)}}
    stop_engine(home)


def _run_dir(runs: Path) -> Path:
    (found,) = [p for p in runs.iterdir() if (p / "meta.json").exists()]
    return found


def test_a_pilot_says_what_it_loads_then_the_run_records_its_forecast(fresh_engine, tmp_path):
    args = [
        "run",
        *TINY,
        "loop=grpo",
        "loop.group_size=4",
        "engine=remote",
        f"engine.url={fresh_engine['url']}",
    ]
    args.append(f"runs_dir={tmp_path / 'runs'}")
    assert cli.invoke(app, [*args, "--pilot", "1"], env=fresh_engine["env"]).exit_code == 2  # needs --dry-run
    dry = cli.invoke(app, [*args, "--dry-run", "--pilot", "1"], env=fresh_engine["env"])
    assert dry.exit_code == 0, dry.output
    notice = dry.output.index(f"pilot: the engine at {fresh_engine['url']} loads tiny-llama")
    assert notice < dry.output.index("expect:") and "cost at most" in dry.output[notice:]
    expected = [int(n) for n in EXPECTED.search(dry.output).groups()]
    bound = int(BOUND.search(dry.output).group(1))
    assert 0 < expected[0] <= bound and expected[0] == sum(expected[1:])
    assert "pilot of 1 prompt(s) x 4" in dry.output and "cost at most" in dry.output
    # the share of groups that train is the pilot's, for every step: the basis gives the range the run
    # spans as it goes 0..1
    low, high = (int(n) for n in RANGE.search(dry.output).groups())
    assert low <= expected[0] <= high <= bound

    ran = cli.invoke(app, args, env=fresh_engine["env"])
    assert ran.exit_code == 0, ran.output
    run_dir = _run_dir(tmp_path / "runs")
    forecast = json.loads((run_dir / "forecast.json").read_text())
    usage = json.loads((run_dir / "usage.json").read_text())
    actual = sum(usage[k] for k in ("prefill_tokens", "sampled_tokens", "training_tokens"))
    assert forecast["bound"]["tokens"] == bound >= actual
    assert low <= actual <= high  # whatever share of its groups the run trained
    assert Decimal(forecast["bound"]["cost"].split()[0]) >= Decimal(usage["cost"])
    assert forecast["expected"]["tokens"] == expected[0] and "pilot of 1" in forecast["basis"]
    assert forecast["expected"]["prefill"] == usage["prefill_tokens"]  # prompts are counted exactly
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    spent = [r["spend/tokens"] for r in train]
    assert len(train) == 3 and spent == sorted(spent) and spent[-1] < actual
    assert train[-1]["spend/trained_tokens"] == usage["training_tokens"]  # evaluations train nothing
    assert all(Decimal(r["spend/cost"]) <= Decimal(r["spend/projected_cost"]) for r in train)
    # after the last step only the end evaluation is left, projected at the start one's cost
    assert train[-1]["spend/projected_tokens"] == pytest.approx(actual, rel=0.1)
    shown = cli.invoke(app, ["runs", "show", str(run_dir)])
    assert shown.exit_code == 0, shown.output
    assert re.search(
        rf"bound: {bound} tokens, cost [0-9.]+ USD \(\+[0-9.]+ % against the actual {actual}\)", shown.output
    )
    assert f"expected: {expected[0]} tokens" in shown.output and "projected after step 2:" in shown.output

    svc = ServiceClient(fresh_engine["url"], home=fresh_engine["home"])
    try:  # the Python API: without a pilot an RL run has no expected figure, and says why
        found = forecast_run([*TINY, "loop=grpo"], tok=svc.get_tokenizer("tiny-llama"), svc=svc)
    finally:
        svc.close()
    assert found.bound.tokens > 0 and found.expected.figure is None
    assert "not available without a pilot" in found.expected.basis


def test_sft_is_expected_exactly_from_its_data(fresh_engine, tmp_path):
    args = ["run", *TINY, "loop=sft", "engine=remote", f"engine.url={fresh_engine['url']}"]
    ran = cli.invoke(app, [*args, f"runs_dir={tmp_path}"], env=fresh_engine["env"])
    assert ran.exit_code == 0, ran.output
    run_dir = _run_dir(tmp_path)
    forecast = json.loads((run_dir / "forecast.json").read_text())
    usage = json.loads((run_dir / "usage.json").read_text())
    assert forecast["expected"]["trained"] == usage["training_tokens"]
    assert forecast["expected"]["prefill"] == usage["prefill_tokens"]  # the evaluations' prompts
    assert "loop.max_tokens" in forecast["basis"]  # the evaluations' replies, with no pilot to measure them
    assert forecast["expected"]["sampled"] >= usage["sampled_tokens"]


class Usage:
    """What a session has used, as the engine reports it (the wire form), trained tokens priced at
    ``trained_price`` a token, the others free."""

    def __init__(self, trained_price: Decimal = Decimal(0)):
        self.tokens, self.trained_price = [0, 0, 0], trained_price

    def add(self, prefill=0, sampled=0, trained=0):
        self.tokens = [a + b for a, b in zip(self.tokens, (prefill, sampled, trained))]

    def read(self) -> dict:
        cost = format(self.tokens[2] * self.trained_price, "f")
        return dict(zip(("prefill_tokens", "sampled_tokens", "training_tokens"), self.tokens), cost=cost)


def _run(meter: SpendMeter, usage: Usage, steps: range, shares: list[float] | None = None) -> list[dict]:
    """The rows a run of equal steps (100 tokens each, the first also sampling 50 ahead) records,
    evaluating (50 tokens) at the start and after step 3, as the runner calls the meter. With
    ``shares``: step k trains ``shares[k - 1]`` of a full batch of 100 trained tokens (50 otherwise)."""

    def evaluate(done: int) -> dict:
        usage.add(prefill=40, sampled=10)
        return {"eval/reward": 0.0}

    rows = [] if steps.start > 1 else [{"kind": "eval", "step": 0, **SpendMeter.measure(meter, evaluate, 0)}]
    for done in steps:
        metrics = {} if shares is None else {"groups_with_signal": shares[done - 1]}
        usage.add(prefill=20, sampled=30, trained=50 if shares is None else round(100 * shares[done - 1]))
        if done == 1:
            usage.add(prefill=10, sampled=40)
        rows.append({"kind": "train", "step": done, **metrics, **meter.step_done(done, metrics)})
        if done == 3:
            rows.append({"kind": "eval", "step": 3, **SpendMeter.measure(meter, evaluate, 3)})
    return rows


def test_the_projection_leaves_out_evaluations_and_what_the_first_step_samples_ahead():
    usage = Usage()
    rows = _run(SpendMeter(usage.read, steps=6, eval_every=3), usage, range(1, 7))
    train = [r for r in rows if r["kind"] == "train"]
    whole = 50 + 6 * 100 + 50 + 50 + 50  # start, steps, ahead, evaluations at step 3 and at the end
    assert [r["spend/projected_tokens"] for r in train[1:]] == [whole] * 5
    assert train[-1]["spend/tokens"] + 50 == whole and train[0]["spend/projected_tokens"] > whole
    assert rows[0]["spend/evaluation_tokens"] == 50 and train[0]["spend/cost"] == "0"
    assert "spend/projected_share" not in train[0]  # no share reported: steps projected whole
    # resumed after step 4 in a new session (its usage from zero): the same figures as uninterrupted
    kept = [r for r in rows if r["step"] <= 4]
    fresh = Usage()
    resumed = SpendMeter(fresh.read, steps=6, eval_every=3, start_step=4, history=kept)
    assert _run(resumed, fresh, range(5, 7)) == rows[len(kept) :]


def test_the_projection_trains_the_steps_left_at_the_share_expected_of_them():
    shares = [1.0, 0.5, 0.75, 0.75, 0.25, 0.5]
    price = Decimal("2.3e-6")
    usage = Usage(price)
    meter = SpendMeter(usage.read, steps=6, eval_every=3, trained_price=price)
    rows = _run(meter, usage, range(1, 7), shares)
    train = [r for r in rows if r["kind"] == "train"]
    # after step 1 how the share moves is not known: 1/2 of the full batch (100) a step left
    assert train[0]["spend/projected_share"] == 0.5
    assert train[0]["spend/projected_tokens"] == 50 + 200 + 5 * (100 + 50) + 2 * 50
    # after step 2: 50 sampled and prefilled a step (step 1's ahead left out), 100 * the shares ahead
    ahead = shares_ahead([1.0, 0.5], 4)
    assert train[1]["spend/projected_tokens"] == round(50 + 200 + 100 + 4 * 50 + 100 * ahead + 2 * 50)
    assert train[1]["spend/projected_share"] == pytest.approx(ahead / 4, abs=1e-4)
    assert train[1]["spend/trained_tokens"] == 150
    # the trained part is priced by the trained price, the rest at the rate measured (here free)
    assert Decimal(train[1]["spend/projected_cost"]) == pytest.approx(price * Decimal(100 * ahead + 150))
    assert train[-1]["spend/projected_tokens"] == train[-1]["spend/tokens"] + 50  # the end evaluation
    kept = [r for r in rows if r["step"] <= 4]  # resumed: the same figures as uninterrupted
    fresh = Usage(price)
    resumed = SpendMeter(fresh.read, 6, 3, start_step=4, history=kept, trained_price=price)
    assert _run(resumed, fresh, range(5, 7), shares) == rows[len(kept) :]


def test_the_share_ahead_is_a_walk_between_0_and_1_at_the_rate_measured():
    assert shares_ahead([0.9], 4) == 2.0  # how it moves is not known: 1/2 a step
    assert shares_ahead([0.75, 0.75], 3) == 2.25  # it has not moved: it stays
    # a step from 0 moving by a standard deviation of 0.1: E|N(0, 0.1)| (the wall at 1 is far)
    assert expected_share(0.0, 0.01, 1) == pytest.approx(0.1 * math.sqrt(2 / math.pi), rel=1e-3)
    assert expected_share(0.8, 0.02, 5) == pytest.approx(1 - expected_share(0.2, 0.02, 5))
    assert 0.5 < expected_share(0.8, 0.02, 9) < expected_share(0.8, 0.02, 5) < 0.8  # tends to 1/2
    assert expected_share(1.0, 0.0625, 60) == pytest.approx(0.5, abs=1e-3)
