"""The tools people point at an OpenAI endpoint, installed unmodified in venvs of their own, against
the engine's /v1 (slow: each builds its venv): LangChain's ChatOpenAI and OpenAI classes, and
lm-evaluation-harness's local-completions model on smollm2-135m, scored against lm-eval's own hf
model on the engine's converted weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sess.engine import ServiceClient

SCRIPTS = Path(__file__).parent / "openai_scripts"


def make_venv(root: Path, packages: list[list[str]]) -> Path:
    """A venv with ``packages`` installed in turn (pip runs from this interpreter): its python.
    ``SESS_TEST_VENV_<NAME>`` names a prebuilt one instead (name: the venv folder's)."""
    prebuilt = os.environ.get(f"SESS_TEST_VENV_{root.name.upper().replace('-', '_')}")
    if prebuilt:
        return Path(prebuilt) / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    for group in packages:
        subprocess.run(pip + group, check=True, capture_output=True, text=True)
    return python


def run(
    python: Path, args: list[str], timeout: float, env: dict | None = None
) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SESS_", "OPENAI_"))}
    environment.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    done = subprocess.run(
        [str(python), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**environment, **(env or {})},
    )
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


@pytest.fixture(scope="module")
def key(http_engine, sess_home) -> str:
    svc = ServiceClient(http_engine["url"], home=sess_home)
    yield svc.transport.api_key
    svc.close()


@pytest.mark.slow
def test_langchain_chat_and_completions(http_engine, key, tmp_path_factory):
    root = tmp_path_factory.mktemp("langchain")
    python = make_venv(root / "langchain-venv", [["langchain-openai"]])
    spec = {
        "model": "tiny-llama",
        "base_url": f"{http_engine['url']}/v1",
        "key": key,
        "out": str(root / "out.json"),
    }
    run(python, [str(SCRIPTS / "langchain_client.py"), json.dumps(spec)], timeout=300)
    seen = json.loads((root / "out.json").read_text())
    assert seen["short"]["usage"]["completion_tokens"] <= 3  # max_tokens arrives as max_completion_tokens
    assert isinstance(seen["invoke"], str) and len(seen["batch"]) == 2
    assert len(seen["stream"]) > 2 and "".join(seen["stream"]) == seen["invoke"]  # same seed, same text
    assert isinstance(seen["completion"], str) and seen["completions"][0] == seen["completion"]


QUESTIONS = [
    ("What is the capital of France?", ["Paris", "London", "Rome", "Madrid"], 0),
    ("What color is the sky on a clear day?", ["Green", "Blue", "Red", "Yellow"], 1),
    ("How many legs does a spider have?", ["Six", "Four", "Eight", "Ten"], 2),
    ("Which animal says moo?", ["Cat", "Dog", "Duck", "Cow"], 3),
    ("What is 2 + 2?", ["Four", "Five", "Three", "Two"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
]
TASKS = {
    "sess_mc": """task: sess_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list: [{{metric: acc}}]
""",
    "sess_gen": """task: sess_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs: {{until: ["\\n", "."], max_gen_toks: 8, do_sample: false, temperature: 0}}
metric_list: [{{metric: exact_match, ignore_case: true, ignore_punctuation: true}}]
filter_list: [{{name: strip, filter: [{{function: regex, regex_pattern: "\\\\s*(.*)"}}, {{function: take_first}}]}}]
""",
}


def _lm_eval(python: Path, root: Path, name: str, model_args: str, env: dict | None = None) -> dict:
    """One lm_eval run of both tasks: {task: (score, [per-request responses in doc order])}."""
    out = root / name
    run(
        python,
        [
            "-m",
            "lm_eval",
            "--model",
            "local-completions" if name == "sess" else "hf",
            "--model_args",
            model_args,
        ]
        + ["--tasks", "sess_mc,sess_gen", "--include_path", str(root / "tasks"), "--log_samples"]
        + ["--output_path", str(out), "--seed", "1234"],
        timeout=1200,
        env=env,
    )
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    found = {}
    for task, metric in (("sess_mc", "acc,none"), ("sess_gen", "exact_match,strip")):
        lines = next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()
        samples = sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])
        found[task] = (results[task][metric], [s["resps"] for s in samples])
    return found


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_its_hf_model(http_engine, key, sess_home, tmp_path_factory):
    from sess.engine.runtime.models.catalog import prepare

    root = tmp_path_factory.mktemp("lm-eval")
    python = make_venv(root / "lm-eval-venv", [["torch==2.13.0"], ["lm-eval[api,hf]==0.4.13"]])
    weights = prepare("smollm2-135m", sess_home, progress=False)  # the engine's converted model directory
    data = root / "questions.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS)
    )
    (root / "tasks").mkdir()
    for task, text in TASKS.items():
        (root / "tasks" / f"{task}.yaml").write_text(text.format(data=data))
    served = _lm_eval(
        python,
        root,
        "sess",
        f"model=smollm2-135m,base_url={http_engine['url']}/v1/completions,tokenizer={weights},max_retries=1",
        env={"OPENAI_API_KEY": key},
    )
    oracle = _lm_eval(python, root, "hf", f"pretrained={weights},dtype=float32")
    for task in TASKS:
        assert served[task][0] == oracle[task][0], (task, served[task][0], oracle[task][0])
    assert served["sess_mc"][0] >= 0.5  # the instruct model knows half of these or more
    ours = [r[0] for doc in served["sess_mc"][1] for r in doc]  # [loglikelihood, is_greedy] per choice
    theirs = [r[0] for doc in oracle["sess_mc"][1] for r in doc]
    assert len(ours) == len(theirs) == 4 * len(QUESTIONS)
    gap = max(abs(float(a[0]) - float(b[0])) for a, b in zip(ours, theirs))
    print(
        f"lm-eval on smollm2-135m: acc {served['sess_mc'][0]} (hf {oracle['sess_mc'][0]}), loglikelihood gap {gap:.2e}"
    )
    assert gap < 1e-4
    assert [a[1] for a in ours] == [b[1] for b in theirs]
    assert served["sess_gen"][1] == oracle["sess_gen"][1]  # the same greedy generations
