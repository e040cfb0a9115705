"""loop=code_rl on the engine: streamed sub-batches add up to the one-batch gradient, runs record staleness and
failures and resume, the grader choice (local or a SandboxFusion server), and the MLflow logger."""

from __future__ import annotations

import json

import pytest
import yaml

from sess.engine import SamplingParams
from sess.harness import config, hooks, runner
from sess.harness.records import read_jsonl
from sess.rl import rollouts
from sess.rl.env import Env, StepResult
from sess.tasks import sources as datasets
from sess.tasks.code.code_env import CodeEnv

from env_helpers import ADD_TWO, RIGHT, WRONG, readme_env
from helpers import clear_grads, engine_grads, max_diff, sandbox_server, train_steps
from run_helpers import TINY, run


class Vowels(Env):
    """Reward: the share of vowels in the reply, so a group's rewards differ (a gradient signal)."""

    def initial_observation(self):
        return [{"role": "user", "content": "Say a word."}]

    def step(self, message):
        return StepResult(sum(c in "aeiou" for c in message) / max(len(message), 1), done=True)


def test_streamed_sub_batches_give_the_one_batch_gradient(svc, runtime):
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
    try:
        train_steps(tc, ["warm the adapter up", "so that every weight has gradients"], 1e-2)
        tok, sc = tc.get_tokenizer(), tc.save_weights_and_get_sampling_client()
        params = SamplingParams(max_tokens=12, temperature=1.0)
        groups = rollouts.rollout_groups(
            sc, tok, [[Vowels() for _ in range(4)] for _ in range(3)], params, [1, 2, 3]
        )
        sub_batches = [rollouts.group_datums(g, batch_size=len(groups)) for g in groups]
        assert all(len(b) == 4 for b in sub_batches)  # every group has signal

        clear_grads(runtime, tc.name)
        whole = tc.forward_backward([d for b in sub_batches for d in b], loss_fn="cispo").result()
        one_batch = engine_grads(runtime, tc.name)
        clear_grads(runtime, tc.name)
        passes = [tc.forward_backward(b, loss_fn="cispo") for b in sub_batches]  # all in flight at once
        streamed_loss = sum(p.result().metrics["loss:sum"] for p in passes)
        streamed = engine_grads(runtime, tc.name)
        clear_grads(runtime, tc.name)

        scale = max(float(g.abs().max()) for g in one_batch.values())
        assert scale > 0
        assert max_diff(one_batch, streamed) < 1e-5 * scale
        assert streamed_loss == pytest.approx(whole.metrics["loss:sum"], rel=1e-5, abs=1e-7)
    finally:
        tc.stop()


ENV_FILE = '''
import random
from sess.rl.env import Env, StepResult


class Flaky(Env):
    """A third of the problems' envs raise, a third answer NaN; the others score vowels."""

    def __init__(self, rng: random.Random):
        self.kind = rng.randrange(3)

    def initial_observation(self):
        return [{"role": "user", "content": f"Say a word ({self.kind})."}]

    def step(self, message):
        if self.kind == 0:
            raise ValueError("flaky env")
        if self.kind == 1:
            return StepResult(float("nan"), done=True)
        return StepResult(sum(c in "aeiou" for c in message) / max(len(message), 1), done=True)
'''


def test_code_rl_streams_records_staleness_and_survives_bad_envs(sess_home, tmp_path):
    env_file = tmp_path / "flaky.py"
    env_file.write_text(ENV_FILE)
    run_dir = runner.start(
        [
            *TINY,
            "engine=inprocess",
            f"runs_dir={tmp_path / 'runs'}",
            "loop=code_rl",
            "data=env",
            f"data.env={env_file}:Flaky",
            "loop.steps=3",
            "loop.batch_size=4",
            "loop.group_size=3",
            "loop.max_steps_off_policy=1",
        ],
        show_progress=False,
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for row in train:
        assert len(row["group_staleness"]) == 4 and set(row["group_staleness"]) <= {0, 1}
        assert row["off_policy_steps"] == pytest.approx(sum(row["group_staleness"]) / 4)
        assert 0 <= row["sub_batches"] <= 4 and row["datums"] <= 3 * row["sub_batches"]
    assert sum(r["sub_batches"] for r in train) > 0 and any(r["loss"] != 0 for r in train)
    assert sum(r["group_staleness"].count(1) for r in train) + sum(r["stale_groups"] for r in train) > 0
    # The flaky envs ended their own episodes with a reason; the run went on to the end.
    reasons = [reason for r in train for reason in r.get("failures", [])]
    assert any("ValueError: flaky env" in r for r in reasons) and any("nan" in r for r in reasons)
    assert json.loads((run_dir / "meta.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("loop", ["importance_sampling", "code_rl"])
def test_the_rl_loops_run_the_readme_environment(sess_home, tmp_path, loop):
    """grpo runs it in test_envs; the overlapped loops take any environment too."""
    env = readme_env(tmp_path)
    run_dir = run(
        tmp_path / "runs",
        f"loop={loop}",
        "data=env",
        f"data.env={env}:GuessNumber",
        "loop.steps=2",
        "loop.group_size=2",
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert all(r["tokens"] > 0 for r in rows if r["kind"] == "train") and "eval/solved" in rows[0]


def test_code_rl_discards_groups_older_than_allowed(sess_home, tmp_path):
    """max_steps_off_policy=0 with stale_policy=discard: every group trained on comes from the current
    policy; the ones the workers sampled ahead from the previous one are counted and dropped."""
    env_file = tmp_path / "flaky.py"
    env_file.write_text(ENV_FILE)
    run_dir = runner.start(
        [
            *TINY,
            "engine=inprocess",
            f"runs_dir={tmp_path / 'runs'}",
            "loop=code_rl",
            "data=env",
            f"data.env={env_file}:Flaky",
            "loop.steps=3",
            "loop.group_size=2",
            "loop.max_steps_off_policy=0",
            "loop.stale_policy=discard",
        ],
        show_progress=False,
    )
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["group_staleness"] for r in train] == [[0, 0]] * 3
    assert sum(r["stale_groups"] for r in train) > 0


def test_code_rl_defaults_to_generated_tasks_and_resumes(sess_home, tmp_path):
    overrides = [
        *TINY,
        "engine=inprocess",
        "loop=code_rl",
        "loop.steps=2",
        "save_every=1",
        "loop.group_size=2",
    ]
    cfg = config.compose(overrides)
    assert (cfg.data.name, cfg.grader.name, cfg.loop.loss, cfg.loop.max_turns) == (
        "code_tasks",
        "local",
        "cispo",
        1,
    )
    assert config.compose([*overrides, "data=arithmetic"]).data.name == "arithmetic"

    def kill(done: int) -> None:
        if done == 1:
            raise runner.RunInterrupted()

    with pytest.raises(runner.RunInterrupted):
        runner.start([*overrides, f"runs_dir={tmp_path}"], on_step=kill, show_progress=False)
    (run_dir,) = tmp_path.iterdir()
    runner.resume(run_dir, show_progress=False)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    assert rows[0]["eval/n"] == 4 and "eval/accuracy/generated" in rows[0] and "eval/has_code" in rows[-1]
    # Held-out also sampled: eval_samples answers a problem at the loop's temperature.
    assert rows[0]["eval/sampled/n"] == 4 * cfg.eval_samples and "eval/sampled/accuracy" in rows[-1]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["resumes"][0]["step"] == 1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["grader"]["name"] == "local"


def test_grader_choice_sandbox_fusion_grades_through_the_server(tmp_path):
    with pytest.raises(config.ConfigError, match="grader.url"):
        config.compose(["loop=code_rl", "grader=sandbox_fusion"])
    with sandbox_server(5) as url:
        cfg = config.compose(
            ["loop=code_rl", "grader=sandbox_fusion", f"grader.url={url}", "data.eval_size=2"]
        )
        data = datasets.load(cfg.data, 0, cfg.grader)
        grader = data.envs.train(0)().grader
        assert [CodeEnv(ADD_TWO, grader).step(reply).reward for reply in (RIGHT, WRONG)] == [1.0, 0.0]
        assert type(grader.backend).__name__ == "SandboxFusionGrader" and grader.backend.url == url


def test_mlflow_logger_keeps_params_metrics_and_config_offline(sess_home, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = runner.start(
        [*TINY, "engine=inprocess", f"runs_dir={tmp_path}", "loop=sft", "loop.steps=2", "logger=mlflow"],
        show_progress=False,
    )
    meta = json.loads((run_dir / "meta.json").read_text())["mlflow"]
    assert meta["tracking_uri"] == f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=meta["tracking_uri"])
    run = client.get_run(meta["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert run.data.params["loop.steps"] == "2" and run.data.params["model.name"] == "tiny-llama"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1, 2]
    evals = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert [m.step for m in evals] == [0, 2]
    local = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == pytest.approx(
        [r["loss"] for r in local]
    )
    artifacts = run_dir / "mlartifacts"
    (config_file,) = artifacts.rglob("config.yaml")
    assert yaml.safe_load(config_file.read_text())["loop"]["steps"] == 2


@pytest.mark.slow
def test_code_rl_on_smollm2_short_run(sess_home, tmp_path):
    """A short code_rl run on the real model: the generated tasks sit where it can learn (neither
    solved nor hopeless greedily), sampled groups carry signal, and the sandbox grades every answer."""
    run_dir = runner.start(
        ["engine=inprocess", f"runs_dir={tmp_path}", "loop=code_rl", "loop.steps=2", "data.eval_size=16"],
        show_progress=False,
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if r["kind"] == "eval"]
    train = [r for r in rows if r["kind"] == "train"]
    assert 0.2 <= evals[0]["eval/accuracy/generated"] <= 0.9 and evals[0]["eval/has_code"] > 0.8
    assert all(r["groups_with_signal"] > 0 and r["sub_batches"] > 0 for r in train)
    assert all(0.0 < r["accuracy"] < 1.0 for r in train)


def test_the_sampled_held_out_evaluation_draws_the_same_seeds_at_every_step(sess_home):
    """Two sampled evaluations of the same weights agree exactly whatever the step (the seeds depend on
    the run's seed and the env only), so a change between evaluations is the weights' alone; another
    run seed draws other answers."""
    from sess.engine import ServiceClient

    overrides = [*TINY, "engine=inprocess", "loop=code_rl", "eval_samples=3", "loop.max_tokens=6"]
    cfg = config.compose(overrides)
    tc = ServiceClient("inproc").create_lora_training_client("tiny-llama", rank=4, seed=0)
    envs = [Vowels] * 3
    first, later = (hooks.env_evaluation(cfg, tc, envs, done, cfg.loop.max_turns) for done in (0, 7))
    assert first["eval/sampled/n"] == 9 and first["eval/n"] == 3
    assert first["eval/sampled/reward"] == later["eval/sampled/reward"]
    other = config.compose([*overrides, "seed=1"])
    assert hooks.env_evaluation(other, tc, envs, 0, 1)["eval/sampled/reward"] != first["eval/sampled/reward"]
    tc.stop()
