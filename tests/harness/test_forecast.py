"""`sess run --dry-run`'s forecast is an upper bound: grpo, sft and code_rl runs on tiny-llama against a
priced engine use at most the forecast tokens of each kind, and cost at most the forecast cost;
code_rl also with every group sampled ahead going stale (requeued up to twice, or dropped). The run
records that bound in its forecast.json, and its spend so far and projected total each step."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sess.cli.main import app
from sess.engine import ServiceClient
from sess.engine.protocol.prices import billed_tokens
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.harness import config
from sess.harness.costs.expected import expected
from sess.harness.costs.forecast import evaluations, forecast, prompt_size
from sess.harness.costs.pilot import Pilot, PilotGroup
from sess.harness.records import read_jsonl

cli = CliRunner()
PRICES = "currency: USD\nmodels:\n  default: {prefill: 0.7, sampled: 1.9, trained: 2.3}\n"
TINY = ["model=tiny-llama", "data.eval_size=4", "loop.max_tokens=8", "loop.batch_size=2", "loop.steps=2"]
CODE_RL = ["loop=code_rl", "loop.group_size=2", "loop.rollout_workers=2"]
STALE = [*CODE_RL, "loop.max_steps_off_policy=0"]  # what the workers sample ahead goes stale
LOOPS = {
    "sft": ["loop=sft"],
    "grpo": ["loop=grpo", "loop.group_size=4"],
    "code_rl": CODE_RL,
    "code_rl-requeue": [*STALE, "loop.max_requeues=2"],
    "code_rl-discard": [*STALE, "loop.stale_policy=discard"],
}
FORECAST = re.compile(r"tokens: at most (\d+) \(prefill (\d+), sampled (\d+), trained (\d+)\)")


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forecast")
    (tmp / "prices.yaml").write_text(PRICES)
    home = tmp / "home"
    info = start_engine(home, extra_args=["--prices", str(tmp / "prices.yaml")])
    yield {"home": home, "url": info["url"], "env": {"SESS_HOME": str(home)}}
    stop_engine(home)


@pytest.mark.parametrize(
    ("loop", "field", "bad"),
    [
        ("code_rl", "max_requeues", -1),
        ("grpo", "max_observation_tokens", 0),
        ("code_rl", "max_observation_tokens", -5),
    ],
)
def test_the_limits_the_bound_rests_on_are_checked(loop, field, bad):
    cfg = config.compose(["model=tiny-llama", f"loop={loop}", f"loop.{field}={bad}"])
    with pytest.raises(ValueError, match=f"loop.{field}: expected an integer"):
        forecast(cfg, tok=None)


def test_the_expected_figure_takes_the_share_the_pilot_measured_and_its_range_spans_0_to_1():
    """No learning is assumed: a pilot with no rewards recorded counts its groups with signal; a share
    of 1 or 0 does not move (no sampling noise) and 1/2 stays 1/2; the range runs from no group
    trained to every group of every step trained (share up to 1)."""
    from transformers import AutoTokenizer

    from sess.engine.runtime.models.catalog import prepare
    from sess.tasks import sources

    cfg = config.compose(["model=tiny-llama", "loop=grpo", "loop.group_size=4", *TINY[1:4], "loop.steps=6"])
    tok = AutoTokenizer.from_pretrained(prepare("tiny-llama"))
    data = sources.load(cfg.data, int(cfg.seed), cfg.grader)
    prompt = prompt_size(tok, data.envs.train(0))[0]
    mixed = PilotGroup(prompt=prompt, episodes=4, sampled=28, tail=28, trained=4 * (prompt - 1) + 28)
    equal = PilotGroup(prompt=prompt, episodes=4, sampled=28, tail=28, trained=0)
    every = expected(cfg, tok, data, Pilot(1, 4, [mixed]))
    half = expected(cfg, tok, data, Pilot(2, 4, [mixed, equal]))
    none = expected(cfg, tok, data, Pilot(1, 4, [equal]))
    # a pilot whose every group had signal: all 12 groups of the 6 steps expected to train
    every_group = sum(4 * (prompt_size(tok, data.envs.train(k))[0] - 1) + 28 for k in range(12))
    assert every.figure.trained == every_group and every.figure.tokens == every.high
    assert none.figure.trained == 0 and none.figure.tokens == none.low
    assert abs(half.figure.trained - every_group / 2) <= 1
    # the range is what the run can do, whatever the pilot measured: share 0 to share 1 at every step
    assert every.low == half.low == none.low and every.high == half.high == none.high
    assert none.high - none.low == every_group
    assert "no learning assumed" in half.basis and f"{half.low}-{half.high} tokens" in half.basis


def test_the_share_walks_from_the_chance_the_pilots_rewards_give_at_the_rate_of_its_sampling_noise():
    """A group whose rewards are 0, 0, 0, 1 has signal again with chance 1 - (3/4)^4 - (1/4)^4; the
    expected share starts there and drifts toward 1/2 by the noise of a step's 2 groups; rewards that
    all differ (or a share of 1 or 0) do not move."""
    from transformers import AutoTokenizer

    from sess.engine.runtime.models.catalog import prepare
    from sess.harness.costs.share import expected_share, noise_rate, signal_chance
    from sess.tasks import sources

    cfg = config.compose(["model=tiny-llama", "loop=grpo", "loop.group_size=4", *TINY[1:4], "loop.steps=6"])
    tok = AutoTokenizer.from_pretrained(prepare("tiny-llama"))
    data = sources.load(cfg.data, int(cfg.seed), cfg.grader)
    prompt = prompt_size(tok, data.envs.train(0))[0]
    trained = 4 * (prompt - 1) + 28
    group = PilotGroup(prompt=prompt, episodes=4, sampled=28, tail=28, trained=trained, rewards=[0, 0, 0, 1])
    chance = 1 - 0.75**4 - 0.25**4
    assert signal_chance(group.rewards) == pytest.approx(chance)
    assert signal_chance([-0.1, 0.0, 1.0, 0.5]) == pytest.approx(1 - 4 * 0.25**4)
    assert signal_chance([1.0, 1.0]) == 0.0
    rate = noise_rate(chance, 2)
    assert rate == pytest.approx(chance * (1 - chance))
    step_tokens = [
        sum(4 * (prompt_size(tok, data.envs.train(2 * s + i))[0] - 1) + 28 for i in range(2)) for s in range(6)
    ]
    walk = expected(cfg, tok, data, Pilot(1, 4, [group]))
    want = sum(expected_share(chance, rate, s) * t for s, t in enumerate(step_tokens))
    assert walk.figure.trained == round(want)
    shares = [expected_share(chance, rate, s) for s in range(6)]
    assert shares[0] == chance and all(0.5 < b < a for a, b in zip(shares, shares[1:]))
    assert walk.high - walk.low == sum(step_tokens) and "chance of signal 0.68" in walk.basis
    # the same pilot read back from its JSON (as a kept forecast is) gives the same figure
    again = expected(cfg, tok, data, Pilot.from_json(Pilot(1, 4, [group]).to_json()))
    assert again.figure.trained == walk.figure.trained


def test_evaluations_follow_the_runner():
    assert evaluations(2, 10) == 2 and evaluations(20, 10) == 3 and evaluations(5, 0) == 2


@pytest.mark.parametrize("loop", LOOPS)
def test_a_runs_usage_is_within_its_forecast(priced, tmp_path, loop):
    engine = ["engine=remote", f"engine.url={priced['url']}", f"runs_dir={tmp_path}"]
    args = ["run", *TINY, *LOOPS[loop], *engine]
    dry = cli.invoke(app, [*args, "--dry-run"], env=priced["env"])
    assert dry.exit_code == 0, dry.output
    assert "assumes" not in dry.output  # a bound by construction, with no caveat
    total, prefill, sampled, trained = map(int, FORECAST.search(dry.output).groups())
    cost = Decimal(re.search(r"cost: at most ([0-9.]+) USD", dry.output).group(1))
    ran = cli.invoke(app, args, env=priced["env"])
    assert ran.exit_code == 0, ran.output
    (run_dir,) = [p for p in Path(tmp_path).iterdir() if (p / "meta.json").exists()]
    usage = json.loads((run_dir / "usage.json").read_text())
    session = json.loads((run_dir / "meta.json").read_text())["session"]
    svc = ServiceClient(priced["url"], home=priced["home"])
    report = svc.transport.usage(session)
    svc.close()
    actual = {"prefill": 0, "sampled": 0, "trained": 0}
    for op, row in report["operations"].items():
        for kind, count in billed_tokens(op, row).items():  # the forecast's prefill: cached or not
            actual["prefill" if kind == "cached_prefill" else kind] += count
    assert (
        actual["sampled"] > 0 if loop != "sft" else actual["trained"] > 0
    )  # code_rl's tiny policy may train nothing
    assert all(
        actual[k] <= v for k, v in (("prefill", prefill), ("sampled", sampled), ("trained", trained))
    ), (actual, dry.output)
    assert sum(actual.values()) <= total
    if loop in ("code_rl-requeue", "code_rl-discard"):  # the stale groups this case is about happened
        train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
        assert sum(r["stale_groups"] for r in train) > 0
    assert Decimal(usage["cost"]) <= cost and usage["currency"] == "USD"
    recorded = json.loads((run_dir / "forecast.json").read_text())  # the run keeps its bound
    assert recorded["bound"] == {
        **dict(zip(("tokens", "prefill", "sampled", "trained"), (total, prefill, sampled, trained))),
        "cost": f"{cost} USD",
    }
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train[-1]["spend/tokens"] <= sum(actual.values()) and all(
        r["spend/projected_tokens"] for r in train
    )
