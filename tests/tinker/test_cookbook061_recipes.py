"""tinker-cookbook 0.6.1's recipes, unchanged, beside 0.5.8's (:mod:`test_cookbook_recipes`; slow).

0.6.1 asks for ``tml-renderers>=0.4.1``, which the registry does not serve, so it is installed the one
way it installs (``tinker_helpers.make_cookbook061_venv``: tinker 0.38.0 and tml-renderers 0.2.1,
then the cookbook with ``--no-deps``, then its other listed dependencies). The recipes run as in the
0.5.8 suite: as their modules, in the stand-ins' directory, on tiny-llama with
``renderer_name=role_colon``, passing when they exit 0, write metrics and make no failed API call.
0.6.1's RL recipes default to the ``stable_reinforce`` loss, sample with ``record_stability_info``
and attach provenance spans to every datum; they log the tokens of each step
(``tokens/prefill_cached`` among them, from ``SampleResponse.prompt_cache_hit_tokens``: the
sampler's prefix cache serves a group's repeated prompt). ``code_rl`` runs as in the 0.5.8 suite
(smollm2-135m after a short SFT, graded by sess's sandbox). ``rl_loop`` has no renderer option: it
takes its renderer from the cookbook's table of hub ids and its tokenizer from the hub, both by
``model_name``. It runs with ``model_name=Qwen/Qwen3-4B-Instruct-2507`` (in the table:
``qwen3_instruct``, ChatML), which an engine of its own serves offline from a filled Hugging Face
cache, added as an operator adds a hub model (``sess engine models add``); the recipe reads its
tokenizer from the same cache. What the cache holds under that id is sess's tiny-qwen3 (ChatML
special tokens), fine-tuned on the engine and merged so that it answers the first four GSM8K
stand-ins right half the time: each group's rewards differ, so both steps train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cookbook_runs import SMALL_RL, code_rl_after_sft, run_recipe, tiny_options

from sess.engine import AdamParams, Datum, ModelInput, ServiceClient
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import ids

from cookbook_standins import GSM8K, write_standins
from helpers import fill_hub_cache, sandbox_server
from tinker_helpers import make_cookbook061_venv

pytestmark = pytest.mark.slow
TIMES: dict[str, float] = {}  # recipe -> seconds per step, printed at the end of the module


@pytest.fixture(scope="module")
def cookbook(tmp_path_factory) -> Path:
    """The 0.6.1 venv's python (``SESS_TEST_COOKBOOK061_PYTHON``: one built before, to rerun)."""
    prebuilt = os.environ.get("SESS_TEST_COOKBOOK061_PYTHON")
    if prebuilt:
        return Path(prebuilt)
    return make_cookbook061_venv(tmp_path_factory.mktemp("cookbook061"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, cookbook) -> Path:
    """The stand-ins, and the rubric recipe's data as its README makes it (as in the 0.5.8 suite)."""
    root = write_standins(tmp_path_factory.mktemp("recipes061"))
    (root / "tinker_cookbook" / "example_data").mkdir(parents=True)
    generate = [str(cookbook), "-m", "tinker_cookbook.recipes.rubric.generate_data"]
    subprocess.run(generate, cwd=root, check=True, capture_output=True, timeout=300)
    return root


@pytest.fixture(scope="module")
def sandbox():
    """The code recipe's grader: sess's sandbox on SandboxFusion's route (the recipe's SANDBOX_URL)."""
    with sandbox_server(20) as url:
        yield f"{url}/run_code"


@pytest.fixture(scope="module")
def engine(http_engine, sess_home):
    """(url, key, {catalog name: the engine's directory of it}, sess SDK client)."""
    key = KeyStore(sess_home).add("cookbook061-recipes")["key"]
    svc = ServiceClient(http_engine["url"], api_key=key)
    models = {"tiny-llama": svc.transport.call("model_info", {"base_model": "tiny-llama"})["directory"]}
    yield http_engine["url"], key, models, svc
    print("\nseconds per step:", json.dumps(TIMES, indent=1))
    svc.close()


def _rl_steps(metrics: list[dict], steps: int) -> None:
    """0.6.1's RL trainer logs a row per step with its tokens as its cost estimator counts them
    (sampled, trained, prompt tokens cached and uncached: the cached ones are what each
    ``prompt_cache_hit_tokens`` reports, the sampler's prefix cache serving a group's repeated
    prompt), then a closing row at step ``steps`` with the cumulative counts, each the sum of the
    steps' (counted once)."""
    *rows, closing = metrics
    assert [m["step"] for m in rows] == list(range(steps)) and closing["step"] == steps
    for row in rows:
        assert row["tokens/sampled"] > 0 and row["tokens/prefill_uncached"] > 0
        assert row["tokens/prefill_cached"] >= 0
    assert closing["tokens/cumulative/prefill_cached"] > 0  # the prefix cache served repeated prompts
    for kind in ("sampled", "prefill_cached", "prefill_uncached", "trained"):
        assert closing[f"tokens/cumulative/{kind}"] == sum(m[f"tokens/{kind}"] for m in rows), kind


RL_RECIPES = [
    # (id, module, options, steps): each with 0.6.1's default loss, stable_reinforce
    ("math_rl-arithmetic-default-loss", "math_rl.train", ["env=arithmetic", *SMALL_RL], 2),
    ("math_rl-arithmetic-async", "math_rl.train", ["env=arithmetic", "max_steps_off_policy=1", *SMALL_RL], 2),
    (
        "rubric",
        "rubric.train",
        [
            "grader_llm_name={tiny}",
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


@pytest.mark.parametrize("name,module,options,steps", RL_RECIPES, ids=[r[0] for r in RL_RECIPES])
def test_061_rl_recipe_runs_with_its_default_loss(
    cookbook, workdir, engine, tmp_path, name, module, options, steps
):
    options = [
        *tiny_options(engine),
        *(o.format(tiny=engine[2]["tiny-llama"]) for o in options),
        f"max_steps={steps}",
    ]
    run = run_recipe(cookbook, workdir, engine, module, tmp_path / name, *options)
    _rl_steps(run["metrics"], steps)
    TIMES[name] = round(run["seconds"] / steps, 1)


def test_061_chat_sl(cookbook, workdir, engine, tmp_path):
    data = next((cookbook.parent.parent / "lib").glob("python*/site-packages")) / "tinker_cookbook"
    options = [
        *tiny_options(engine),
        f"dataset={data / 'example_data' / 'conversations.jsonl'}",
        "batch_size=4",
    ]
    options += ["max_length=256", "lora_rank=8", "learning_rate=1e-3", "save_every=0", "eval_every=0"]
    options += ["infrequent_eval_every=0", "max_steps=2"]
    run = run_recipe(cookbook, workdir, engine, "chat_sl.train", tmp_path / "sl", *options)
    assert [m["step"] for m in run["metrics"]] == [0, 1]
    assert run["metrics"][-1]["train_mean_nll"] < run["metrics"][0]["train_mean_nll"]
    TIMES["chat_sl"] = round(run["seconds"] / 2, 1)


def test_061_on_policy_distillation_from_a_teacher_checkpoint(cookbook, workdir, engine, tmp_path):
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


def test_061_code_rl_after_a_short_sft_grades_on_sess_sandbox(cookbook, workdir, engine, sandbox, tmp_path):
    """0.6.1's code_rl (default loss ``stable_reinforce``) after a short SFT, as in the 0.5.8 suite
    (:func:`cookbook_runs.code_rl_after_sft`)."""
    run = code_rl_after_sft(cookbook, workdir, engine, sandbox, tmp_path)
    TIMES["code_sft"] = run["sft_seconds_per_step"]
    TIMES["code_rl-after-sft"] = run["rl_seconds_per_step"]


# rl_loop's model: a hub id the cookbook's table maps to a renderer (qwen3_instruct: ChatML, the
# tokenizer of sess's tiny models), and its prompt (rl_loop.py, main): a worked example, then the
# question with this suffix; an answer scores 1 when its \boxed{} holds the GSM8K answer
HUB_ID = "Qwen/Qwen3-4B-Instruct-2507"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
EXAMPLE = [
    {"role": "user", "content": "How many r's are in strawberry?" + SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
        "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]


def _half_right_model(svc, questions: list[tuple[str, str]], home: Path) -> Path:
    """tiny-qwen3 taught (LoRA, then merged: a transformers directory under ``home``) to answer each
    of ``questions`` as rl_loop asks it with ``\\boxed{ANSWER}`` or ``\\boxed{0}``, half each: a group
    of its samples then holds rewards 1 and 0, so rl_loop's advantages are not all zero and it trains
    (a random model never writes a box and rl_loop skips every step)."""
    tc = svc.create_lora_training_client("tiny-qwen3", rank=32, seed=0)
    tok = tc.get_tokenizer()
    data = []
    for question, answer in questions:
        convo = [*EXAMPLE, {"role": "user", "content": question + SUFFIX}]
        prompt = list(
            tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        for reply in (answer, "1" if answer == "0" else "0"):
            tokens = prompt + tok.encode(f"\\boxed{{{reply}}}<|im_end|>", add_special_tokens=False)
            weights = np.array([0.0] * (len(prompt) - 1) + [1.0] * (len(tokens) - len(prompt)), np.float32)
            inputs = {"target_tokens": np.array(tokens[1:]), "weights": weights}
            data.append(Datum(ModelInput.from_ints(tokens[:-1]), inputs))
    for _ in range(120):
        loss = tc.forward_backward(data).result().metrics["loss:sum"]
        tc.optim_step(AdamParams(learning_rate=3e-3)).result()
    # each chat's least loss is ln 2 (0.69): the coin between the two answers; the rest is learnt
    assert loss / len(data) < 1.0, loss
    path = tc.save_weights_for_sampler(name="half-right", merge_weights=True).result().path
    tc.stop()
    return parse_path(path).directory(home)


def test_061_rl_loop_on_a_hub_id_served_from_a_filled_hf_cache(cookbook, workdir, tmp_path, monkeypatch):
    """rl_loop has no renderer option: it looks up the renderer and loads the tokenizer by its
    ``model_name``, a hub id. An engine of its own (``HF_HUB_CACHE`` a filled cache,
    ``HF_HUB_OFFLINE=1``) serves :data:`HUB_ID` from that cache, added as the operator adds one
    (``sess engine models add``); the recipe loads its tokenizer from the same cache. The model there
    is tiny-qwen3 taught to answer the first four GSM8K stand-ins right half the time
    (:func:`_half_right_model`), so both steps train with rl_loop's default loss, stable_reinforce,
    on the provenance spans it attaches (its prompt targets are 0s under a zero advantage, which the
    engine takes as placeholders: :mod:`sess.engine.server.tinker.provenance`)."""
    home, cache = tmp_path / "home", tmp_path / "hf-cache"
    home.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    url = start_engine(home)["url"]
    key = KeyStore(home).add("rl-loop")["key"]
    svc = ServiceClient(url, api_key=key)
    try:
        gsm8k = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines()[:4]]
        questions = [(row["question"], row["answer"].split("####")[-1].strip()) for row in gsm8k]
        fill_hub_cache(cache, HUB_ID, _half_right_model(svc, questions, home))
        sess = Path(sys.executable).parent / "sess"
        added = [str(sess), "engine", "models", "add", "qwen3-4b-instruct", HUB_ID, "--home", str(home)]
        subprocess.run(added, check=True, capture_output=True, timeout=120)
        options = [
            "batch_size=2",
            "group_size=8",
            "max_tokens=12",
            "lora_rank=8",
            "save_every=0",
            "max_steps=2",
        ]
        run = run_recipe(
            cookbook,
            workdir,
            (url, key, {}, svc),
            "rl_loop",
            tmp_path / "rl_loop",
            f"model_name={HUB_ID}",
            *options,
            env={"HF_HUB_CACHE": str(cache)},
            fresh_log=False,
        )
    finally:
        svc.close()
        stop_engine(home)
    assert "Using renderer: qwen3_instruct" in run["output"]
    rows = run["metrics"]
    print("\nrl_loop rows:", json.dumps(rows))
    assert [m["step"] for m in rows] == [0, 1]
    # every step trained (the optimizer's metrics come back only from an optim_step) on groups of
    # mixed rewards: a batch's mean reward strictly between 0 and 1
    assert [m["step:max"] for m in rows] == [1, 2]
    assert all(m["grad_norm:mean"] > 0 and 0 < m["reward/total"] < 1 for m in rows), rows
    final = json.loads((tmp_path / "rl_loop" / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    assert final["sampler_path"].startswith("tinker://")
    TIMES["rl_loop"] = round(run["seconds"] / 2, 1)
    print(f"rl_loop: {run['seconds']:.1f} s for 2 steps, the process's start included")
