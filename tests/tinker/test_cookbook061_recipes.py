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
(smollm2-135m after a short SFT, graded by sess's sandbox). ``rl_loop`` is not here: it has no
renderer option and looks its renderer up by the hub name of the model, which a local model
directory is not."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cookbook_runs import SMALL_RL, code_rl_after_sft, run_recipe, tiny_options

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import ids

from cookbook_standins import write_standins
from helpers import sandbox_server
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
