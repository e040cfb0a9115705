"""tinker-cookbook's recipes, unchanged, as a regression suite (slow: 40 minutes on 2 shared cores).

The cookbook 0.5.8 is installed once in a venv of its own (``tinker-cookbook[math-rl,multiplayer-rl]``,
transformers <= 5.5.4); the hub datasets the recipes load are replaced by small local stand-ins in the
hub's format (:mod:`cookbook_standins`), the recipes' working directory; one engine serves them all
on one key with the default limit of 8 live sessions (each exited recipe's model is released after
the heartbeat lapse, so a dozen recipes in a row fit). Each recipe runs as its module, as a user types
it, with ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` exported, on tiny-llama (the engine's directory
of it names the model, so the cookbook finds its tokenizer) with ``renderer_name=role_colon``: the
cookbook's renderer lookup knows only hub names. A recipe passes when it exits 0, writes its
metrics, and its output has no failed API call (the cookbook logs some failures as warnings and goes
on: those count). ``code_rl`` runs on smollm2-135m after a short SFT (the seeds' workload, graded by
sess's sandbox; its tool prompts need a renderer with tool calls, which ``role_colon`` is not), one
rollout at a time (``group_size=1 groups_per_batch=1``): two environments render their prompts at once
in threads with the one tokenizer they share (``rl/message_env.py:132`` → ``renderers/qwen3.py:287``,
"RuntimeError: Already borrowed"). ``sdft.train`` (self-distillation) runs on a SciKnowEval stand-in:
top-K prompt logprobs from the teacher, (N, K) ``cross_entropy`` targets for the student. Each
recipe's seconds per step are printed (``-s``) for docs/tinker.md's table."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from cookbook_runs import SMALL_RL, code_rl_after_sft, run_recipe, tiny_options

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import ids

from cookbook_standins import write_standins
from helpers import sandbox_server
from tinker_helpers import make_cookbook_venv, run_client

pytestmark = pytest.mark.slow

TIMES: dict[str, float] = {}  # recipe -> seconds per step, printed at the end of the module
RECIPES = [
    # (id, module, options, steps)
    (
        "math_rl-arithmetic-ppo",
        "math_rl.train",
        ["env=arithmetic", "loss_fn=ppo", "compute_post_kl=True", *SMALL_RL],
        2,
    ),
    ("math_rl-gsm8k-off-policy", "math_rl.train", ["env=gsm8k", "max_steps_off_policy=1", *SMALL_RL], 2),
    ("dpo-hhh", "preference.dpo.train", ["dataset=hhh", "batch_size=4", "max_length=128"], 2),
    (
        "text_arena",
        "multiplayer_rl.text_arena.train",
        [
            "batch_size=2",
            "num_train_datapoints=2",
            "num_test_datapoints=2",
            "max_tokens=8",
            "eval_every=0",
            "save_every=0",
        ],
        1,
    ),
    (
        "preference-shorter",
        "preference.shorter.train",
        ["batch_size=2", "group_size=2", "max_tokens=8", "eval_every=0"],
        1,
    ),
    (
        "rubric",
        "rubric.train",
        [
            "grader_llm_name={tiny}",  # the judge: a sampler of the base model beside the policy
            "grader_renderer_name=role_colon",
            "train_group_size=2",
            "groups_per_batch=2",
            "max_tokens=8",
            "lora_rank=8",
            "eval_every=0",
            "save_every=0",
        ],
        1,
    ),
]


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory) -> Path:
    """The cookbook venv's python: built under a temp dir, or (opt-in, to rerun quickly) the python
    of one this suite built before, named by ``SESS_TEST_COOKBOOK_PYTHON``."""
    prebuilt = os.environ.get("SESS_TEST_COOKBOOK_PYTHON")
    if prebuilt:
        return Path(prebuilt)
    return make_cookbook_venv(tmp_path_factory.mktemp("cookbook"), "math-rl,multiplayer-rl")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cookbook) -> Path:
    """The recipes' working directory: the dataset stand-ins, and the rubric recipe's data as its
    README makes it (``python -m tinker_cookbook.recipes.rubric.generate_data`` writes into
    ``tinker_cookbook/example_data/`` of the working directory, as in a checkout of the cookbook)."""
    root = write_standins(tmp_path_factory.mktemp("recipes"))
    (root / "tinker_cookbook" / "example_data").mkdir(parents=True)
    generate = [str(cookbook), "-m", "tinker_cookbook.recipes.rubric.generate_data"]
    subprocess.run(generate, cwd=root, check=True, capture_output=True, timeout=300)
    return root


@pytest.fixture(scope="module")
def engine(http_engine, sess_home):
    """(url, key, {catalog name: the engine's directory of it}, sess SDK client)."""
    key = KeyStore(sess_home).add("cookbook-recipes")["key"]
    svc = ServiceClient(http_engine["url"], api_key=key)
    models = {m: svc.transport.call("model_info", {"base_model": m})["directory"] for m in ("tiny-llama",)}
    yield http_engine["url"], key, models, svc
    print("\nseconds per step:", json.dumps(TIMES, indent=1))
    svc.close()


@pytest.fixture(scope="module")
def sandbox():
    """The code recipe's grader: sess's sandbox on SandboxFusion's route (the recipe's SANDBOX_URL)."""
    with sandbox_server(20) as url:  # above the recipe's 6 s per-test alarm, so its own alarm rules
        yield f"{url}/run_code"


@pytest.mark.parametrize("name,module,options,steps", RECIPES, ids=[r[0] for r in RECIPES])
def test_recipe_runs_to_its_end(cookbook, workdir, engine, tmp_path, name, module, options, steps):
    options = [
        *tiny_options(engine),
        *(o.format(tiny=engine[2]["tiny-llama"]) for o in options),
        f"max_steps={steps}",
    ]
    run = run_recipe(cookbook, workdir, engine, module, tmp_path / name, *options)
    assert [m["step"] for m in run["metrics"]] == list(range(steps))
    TIMES[name] = round(run["seconds"] / steps, 1)


def test_chat_sl_with_rolling_saves_then_from_its_checkpoint(cookbook, workdir, engine, tmp_path):
    data = next((cookbook.parent.parent / "lib").glob("python*/site-packages")) / "tinker_cookbook"
    options = [
        *tiny_options(engine),
        f"dataset={data / 'example_data' / 'conversations.jsonl'}",
        "batch_size=4",
    ]
    options += ["max_length=256", "lora_rank=8", "learning_rate=1e-3", "save_every=0", "eval_every=0"]
    options += ["infrequent_eval_every=0"]
    first = run_recipe(
        cookbook,
        workdir,
        engine,
        "chat_sl.train",
        tmp_path / "sl",
        *options,
        "max_steps=2",
        "rolling_save_every=1",
    )
    records = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    rolling = [r for r in records if r.get("rolling")]
    assert rolling and "Deleted rolling checkpoint" in first["output"]
    _, _, _, svc = engine
    kept = {c["path"] for c in svc.list_checkpoints(ids.sess_name(records[-1]["state_path"].split("/")[2]))}
    assert ids.to_sess_path(rolling[0]["state_path"]) not in kept  # the rolling save was deleted
    again = run_recipe(
        cookbook,
        workdir,
        engine,
        "chat_sl.train",
        tmp_path / "sl2",
        *options,
        "max_steps=1",
        f"load_checkpoint_path={records[-1]['state_path']}",
    )
    # from the trained state: its first loss is below the first run's first
    assert again["metrics"][0]["train_mean_nll"] < first["metrics"][0]["train_mean_nll"]
    TIMES["chat_sl"] = round(first["seconds"] / 2, 1)
    TIMES["chat_sl-from-checkpoint"] = round(again["seconds"], 1)


def test_on_policy_distillation_from_a_teacher_checkpoint(cookbook, workdir, engine, tmp_path):
    """The cookbook makes the teacher's sampler with both ``base_model`` and ``model_path``."""
    _, _, models, svc = engine
    teacher = svc.create_lora_training_client("tiny-llama", rank=8, seed=0)
    path = ids.to_tinker_path(teacher.save_weights_for_sampler("teacher").result().path)
    teacher.stop()
    options = [
        *tiny_options(engine),
        f"teacher_model={models['tiny-llama']}",
        f"teacher_checkpoint={path}",
        "dataset=deepmath",
    ]
    run = run_recipe(
        cookbook,
        workdir,
        engine,
        "distillation.on_policy_distillation",
        tmp_path / "distill",
        *options,
        *SMALL_RL,
        "max_steps=1",
    )
    assert [m["step"] for m in run["metrics"]] == [0]
    TIMES["on_policy_distillation"] = round(run["seconds"], 1)


def test_code_rl_after_a_short_sft_grades_on_sess_sandbox(cookbook, workdir, engine, sandbox, tmp_path):
    """A short SFT, then code_rl graded by sess's sandbox (:func:`cookbook_runs.code_rl_after_sft`)."""
    run = code_rl_after_sft(cookbook, workdir, engine, sandbox, tmp_path)
    TIMES["code_sft"] = run["sft_seconds_per_step"]
    TIMES["code_rl-after-sft"] = run["rl_seconds_per_step"]


def test_sdft_off_policy_distillation_with_top_k_targets(cookbook, workdir, engine, tmp_path):
    """``sdft.train`` on the SciKnowEval stand-in: the teacher (the base model's sampler, prompted
    with the golden answer) returns its top-K prompt logprobs over the student's completion, and the
    student trains on them as (N, K) ``cross_entropy`` targets; ``reverse=True`` trains the reverse
    KL over the same top-K set through ``forward_backward_custom``."""
    options = [*tiny_options(engine), "dataset=sciknoweval", "groups_per_batch=2", "group_size=1"]
    options += ["max_tokens=8", "lora_rank=8", "eval_every=0", "save_every=0"]
    forward = run_recipe(cookbook, workdir, engine, "sdft.train", tmp_path / "sdft", *options, "max_steps=2")
    assert [m["step"] for m in forward["metrics"]] == [0, 1]
    for m in forward["metrics"]:
        # every completion position got the teacher's 20 runners-up: none truncated, a spread-out
        # distribution (a random model's top 20 are far from one-hot)
        assert m["sdft/topk"] == 20 and m["sdft/num_datums"] == 2 and m["sdft/teacher_truncated_count"] == 0
        assert 0 < m["sdft/total_completion_tokens"] <= 16 and m["sdft/mean_teacher_entropy"] > 0.1
    reverse = run_recipe(
        cookbook,
        workdir,
        engine,
        "sdft.train",
        tmp_path / "sdft-reverse",
        *options,
        "reverse=True",
        "max_steps=1",
    )
    (m,) = reverse["metrics"]
    # teacher and student are one model here, told apart only by the teacher's golden answer: their
    # top-K distributions are close, and the loss is the KL the recipe reports
    assert 0 <= m["sdft/reverse_kl_mean"] < 0.01 and m["sdft/reverse_kl_positions"] > 0
    assert abs(m["sdft/student_entropy_mean"] - m["sdft/mean_teacher_entropy"]) < 0.05
    TIMES["sdft"] = round(forward["seconds"] / 2, 1)
    TIMES["sdft-reverse"] = round(reverse["seconds"], 1)


def test_off_policy_distillation_library_loop(cookbook, workdir, engine, tmp_path):
    """``distillation.train_off_policy`` (no recipe module: configured in Python as its docstring
    shows, tests/tinker_scripts/off_policy_distill.py) on the cookbook's example chats, the teacher a
    saved sampler of the base model: each chat's top-K prompt logprobs, renormalised, become (N, K)
    ``cross_entropy`` targets whose weights sum to 1 at every trained position."""
    url, key, models, svc = engine
    teacher = svc.create_lora_training_client("tiny-llama", rank=8, seed=0)
    path = ids.to_tinker_path(teacher.save_weights_for_sampler("teacher").result().path)
    teacher.stop()
    data = next((cookbook.parent.parent / "lib").glob("python*/site-packages")) / "tinker_cookbook"
    spec = {"model_name": models["tiny-llama"], "renderer_name": "role_colon", "teacher_checkpoint": path}
    spec |= {"data": str(data / "example_data" / "conversations.jsonl"), "max_length": 256, "batch_size": 4}
    spec |= {"learning_rate": 1e-3, "lora_rank": 8, "topk": 8, "max_steps": 2}
    spec |= {"log_path": str(tmp_path / "opd"), "out": str(tmp_path / "opd.json")}
    started = time.monotonic()
    rows = run_client(cookbook, "off_policy_distill.py", spec, url=url, key=key, timeout=1200)
    vocabulary = json.loads((Path(models["tiny-llama"]) / "config.json").read_text())["vocab_size"]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        positions = row["train/weights:sum"]  # one per trained position: the K weights sum to 1
        assert positions > 20 and abs(positions - round(positions)) < 1e-3, row
        # the student's cross-entropy on the teacher's top 8 (the teacher's likeliest tokens, and
        # student and teacher start as one model): below a uniform guess's over the vocabulary
        assert 0 < row["train/loss:sum"] / positions < math.log(vocabulary), row
    TIMES["off_policy_distillation"] = round((time.monotonic() - started) / 2, 1)
