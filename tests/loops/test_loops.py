"""Loop pieces and behaviours: data splits, rewards, rendering, KTO learning, wandb offline records."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sess.harness.records import RECORD_FILES, read_jsonl
from sess.tasks import files as data_files
from sess.tasks.arithmetic import rewards
from sess.tasks.arithmetic.problems import ArithmeticData, ArithmeticProblems

from run_helpers import TINY, run


def test_arithmetic_splits_never_overlap_and_are_seeded():
    gen = ArithmeticProblems(0, ArithmeticData(eval_size=64, min_value=1, max_value=9))
    held = {p.question for p in gen.eval_problems}
    train = [gen.train(k) for k in range(500)]
    assert not held & {p.question for p in train}
    assert [p.question for p in ArithmeticProblems(0, ArithmeticData(max_value=9)).eval_problems[:5]] == [
        p.question for p in gen.eval_problems[:5]
    ]
    assert ArithmeticProblems(1).train(0) != ArithmeticProblems(0).train(0)
    for p in train[:50]:
        a, op, b = p.solution.split(" ")[:3]
        assert str(eval(f"{a}{op}{b}")) == p.answer  # noqa: S307 - our own generated arithmetic


@pytest.mark.parametrize(
    "text,truth,expected",
    [
        ("12 + 30 = 42. Answer: 42", "42", 1.0),
        ("Answer: 41", "42", 0.0),
        ("the answer is 1,234.", "1234", 1.0),
        ("I think 3 then 42", "42", 1.0),
        ("no idea", "42", -0.1),
        ("Answer: 42.0", "42", 1.0),
    ],
)
def test_reward_is_exact_final_answer_with_a_parse_penalty(text, truth, expected):
    assert rewards.reward(text, truth, 0.1) == expected


def test_file_orders_are_seeded_and_epoch_shuffled():
    order = data_files.seeded_order(list(range(10)), seed=1)
    first = [order(k) for k in range(20)]
    again = [data_files.seeded_order(list(range(10)), 1)(k) for k in range(20)]
    assert first == again and sorted(first[:10]) == list(range(10)) and first[:10] != first[10:]
    assert [data_files.seeded_order(list(range(5)), 1, shuffle=False)(k) for k in range(6)] == [
        0,
        1,
        2,
        3,
        4,
        0,
    ]


def test_sft_weights_only_assistant_tokens(svc):
    from sess.rl import rendering

    tok = svc.get_tokenizer("tiny-llama")
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "Answer: 4"}]
    tokens, weights = rendering.chat_tokens(tok, chat)
    learnt = tok.decode([t for t, w in zip(tokens, weights) if w])
    assert learnt == "Answer: 4<|im_end|>\n"
    prompt = rendering.prompt_tokens(tok, chat[:1])
    assert tokens[: len(prompt)] == prompt and not any(weights[: len(prompt)])


def test_kto_raises_the_implied_reward_of_desirable_over_undesirable(sess_home, tmp_path):
    lines = []
    for i in range(24):
        a, b = i % 7 + 1, i % 5 + 2
        lines.append({"prompt": f"What is {a} + {b}?", "completion": f"Answer: {a + b}", "label": True})
        lines.append(
            {"prompt": f"What is {a} + {b}?", "completion": f"Answer: {a + b + 3} maybe", "label": False}
        )
    path = tmp_path / "feedback.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_dir = run(
        tmp_path / "runs",
        "loop=kto",
        "data=feedback_jsonl",
        f"data.path={path}",
        "data.eval_size=8",
        "loop.steps=8",
        "loop.batch_size=8",
        "loop.learning_rate=3e-3",
        "loop.beta=0.5",
    )
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    before, after = evals[0]["eval/margin"], evals[-1]["eval/margin"]
    assert before == pytest.approx(0.0, abs=1e-3)  # the policy starts as the reference
    assert after > before + 1.0, evals
    train = [r["margin"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train[-1] > train[0]


def test_wandb_offline_keeps_config_and_metrics(sess_home, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = run(tmp_path, "loop=sft", "loop.steps=2", "logger=wandb", "logger.project=sess-test")
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    (records,) = wandb_run.glob("run-*.wandb")  # what `wandb sync` uploads: config and history
    blob = records.read_bytes()
    assert b"tiny-llama" in blob and b"learning_rate" in blob  # the config
    assert b"loss" in blob and b"eval/accuracy" in blob  # the metrics
    assert json.loads((run_dir / "meta.json").read_text())["wandb"]["mode"] == "offline"


def test_a_loop_runs_as_a_bare_script_with_a_trivial_logger(sess_home, capsys):
    """The README's bare.py: grpo.train with PrintMetrics and no runner, no run record."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    (code,) = re.findall(r"```python\n(# bare\.py.*?)```", readme, re.S)
    namespace: dict = {}
    exec(compile(code, "bare.py", "exec"), namespace)  # noqa: S102 - the README's own example
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in rows] == ["step 1", "step 2"]
    assert all("loss" in line and "reward/mean" in line for line in rows)


def test_python_m_runs_a_loop_on_its_own(sess_home, tmp_path):
    """``python -m sess.harness loop=grpo ...`` composes like ``sess run loop=grpo`` and writes a run record."""
    overrides = [
        "loop=grpo",
        *TINY,
        "engine=inprocess",
        f"runs_dir={tmp_path / 'runs'}",
        "loop.steps=1",
        "loop.group_size=2",
    ]
    env = {**os.environ, "SESS_HOME": str(sess_home)}
    done = subprocess.run(
        [sys.executable, "-m", "sess.harness", *overrides],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-grpo-tiny-llama") and f"run finished: {run_dir}" in done.stdout
    assert sorted(p.name for p in run_dir.iterdir() if p.is_file()) == sorted(RECORD_FILES)
    assert [(r["kind"], r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl")] == [
        ("eval", 0),
        ("train", 1),
        ("eval", 1),
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing else written
    refused = subprocess.run(
        [sys.executable, "-m", "sess.harness", "loop=no_such_loop"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 1 and refused.stderr.startswith("error:") and "grpo" in refused.stderr


assert TINY  # shared overrides come from run_helpers
