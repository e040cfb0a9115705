"""The unmodified tinker SDK (0.38.0, in a venv of its own, as on a user's laptop) against the
engine: the same results as the sess SDK on one engine, prompt logprobs checked against forward,
save/resume, retries of lost answers running each op once, bad input and an untested SDK version
answered at once with a message, the SDK's schema, and ``tinker checkpoint download``. The same
train/sample/save/resume comparison runs on every other SDK release the engine serves (0.34.0,
0.35.0, 0.36.0), slow-marked: each is a venv of its own.

The venv is built once per test run and version (``pip install tinker==0.38.0``: about 40 s, from
pip's cache after the first time); each client script runs in tests/tinker_scripts. ``tinker
checkpoint download``, https through the SDK and the older SDKs are slow-marked
(``python -m pytest -m slow``)."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import descriptor_pb2
from safetensors.numpy import load_file

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from sess.engine.protocol.home import read_local_key
from sess.engine.sdk.local_engine import start_engine, stop_engine
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema

from helpers import SENTENCES
from tinker_helpers import (
    SDK_VERSIONS,
    TINKER_SDK,
    DroppingProxy,
    TinkerHttp,
    make_tinker_venv,
    run_client,
    self_signed_certificate,
)

STEPS, LR, K = 3, 2e-3, 3


@pytest.fixture(scope="session")
def tinker_venvs(tmp_path_factory):
    """version -> the python of a venv with that tinker SDK, each built on first use."""
    made: dict[str, Path] = {}

    def python(version: str) -> Path:
        if version not in made:
            made[version] = make_tinker_venv(tmp_path_factory.mktemp("tinker-sdk"), version)
        return made[version]

    return python


@pytest.fixture(scope="session")
def tinker_python(tinker_venvs) -> Path:
    return tinker_venvs(TINKER_SDK.split("==")[1])


@pytest.fixture(scope="module")
def key(sess_home) -> str:
    return KeyStore(sess_home).add("tinker-sdk")["key"]


@pytest.fixture(scope="module")
def svc(http_engine, key):
    client = ServiceClient(http_engine["url"], api_key=key)
    yield client
    client.close()


def _summary(proto: descriptor_pb2.FileDescriptorProto) -> dict:
    found = {}

    def fields(message, prefix: str) -> None:
        for f in message.field:
            oneof = message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            found[prefix + message.name + "." + f.name] = (
                f.number,
                f.type,
                f.label,
                f.type_name.split(".")[-1],
                oneof,
            )
        for nested in message.nested_type:
            fields(nested, prefix + message.name + ".")

    for message in proto.message_type:
        fields(message, "")
    for enum in proto.enum_type:
        found.update({f"{enum.name}.{v.name}": v.number for v in enum.value})
    return found


@pytest.fixture(scope="module")
def checks(tinker_python, http_engine, key, svc, sess_home, tmp_path_factory) -> dict:
    """tinker_scripts/checks.py's findings: the SDK's schema, bad input, an untested SDK version."""
    other = ServiceClient(http_engine["url"], api_key=KeyStore(sess_home).add("tinker-sdk-other")["key"])
    theirs = other.create_lora_training_client("tiny-llama", rank=4, seed=0)
    foreign = theirs.save_state(name="theirs").result().path  # sess://<session>/state/theirs
    theirs.stop()
    other.close()
    spec = {
        "out": str(tmp_path_factory.mktemp("checks") / "checks.json"),
        "tokens": svc.get_tokenizer("tiny-llama").encode(SENTENCES[1]),
        "vocab": svc.transport.call("model_info", {"base_model": "tiny-llama"})["vocab_size"],
        "foreign_path": foreign.replace("sess://", "tinker://").replace("/state/", "/weights/"),
        "version": "0.39.1",
    }
    return run_client(tinker_python, "checks.py", spec, url=http_engine["url"], key=key)


def test_the_engines_protobuf_schema_is_the_sdks(checks):
    theirs = descriptor_pb2.FileDescriptorProto()
    theirs.ParseFromString(base64.b64decode(checks["descriptor"]))
    ours, sdk = _summary(schema.file_descriptor()), _summary(theirs)
    assert len(sdk) > 80 and ours == sdk


@pytest.mark.parametrize(
    "version",
    [v if f"tinker=={v}" == TINKER_SDK else pytest.param(v, marks=pytest.mark.slow) for v in SDK_VERSIONS],
)
def test_same_results_through_both_sdks_on_one_engine(version, tinker_venvs, http_engine, key, svc, tmp_path):
    tinker_python = tinker_venvs(version)
    tok = svc.get_tokenizer("tiny-llama")
    sequences = [tok.encode(s) for s in SENTENCES[:3]]
    prompt = tok.encode(SENTENCES[3])
    spec = {"out": str(tmp_path / "parity.json"), "base_model": "tiny-llama", "sequences": sequences}
    spec.update(prompt=prompt, steps=STEPS, lr=LR, k=K, text=SENTENCES[4])
    tinker = run_client(tinker_python, "parity.py", spec, url=http_engine["url"], key=key)

    # the same steps through the sess SDK
    tc = svc.create_lora_training_client(
        "tiny-llama", rank=4, alpha=32, seed=0
    )  # Tinker's alpha at every rank
    data = [
        Datum(ModelInput.from_ints(t[:-1]), {"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)})
        for t in sequences
    ]
    losses, norms = [], []
    for _ in range(STEPS):
        fb = tc.forward_backward(data)
        opt = tc.optim_step(AdamParams(learning_rate=LR, eps=1e-8))
        losses.append(fb.result().metrics["loss:sum"])
        norms.append(opt.result().metrics["grad_norm"])
    forward = [o["logprobs"].tolist() for o in tc.forward(data).result().loss_fn_outputs]
    sc = tc.save_weights_and_get_sampling_client()
    sampled = sc.sample(prompt, 3, SamplingParams(max_tokens=8, seed=11, temperature=1.0)).result()
    scored = sc.sample(
        prompt, 1, SamplingParams(max_tokens=1, seed=1), include_prompt_logprobs=True, topk_prompt_logprobs=K
    ).result()
    tc.stop()

    assert tinker["losses"] == losses and tinker["grad_norms"] == norms  # equal, not merely close
    assert losses[-1] < losses[0]
    assert _max_diff(tinker["forward_logprobs"], forward) < 1e-5
    assert [s["tokens"] for s in tinker["samples"]] == [s.tokens for s in sampled.sequences]
    assert (
        _max_diff([s["logprobs"] for s in tinker["samples"]], [s.logprobs for s in sampled.sequences]) < 1e-5
    )
    assert len(set(tinker["sample_ids"])) == 3 and all(tinker["sample_ids"])
    # sampled logprobs equal compute_logprobs of the same tokens
    assert _max_diff([s["logprobs"] for s in tinker["samples"]], tinker["computed"]) < 1e-4
    # prompt logprobs and top-k prompt logprobs: the same in both SDKs, and forward's numbers
    assert tinker["prompt_logprobs"][0] is None and scored.prompt_logprobs[0] is None
    assert _max_diff([tinker["prompt_logprobs"][1:]], [scored.prompt_logprobs[1:]]) < 1e-5
    assert _max_diff([tinker["prompt_logprobs"][1:]], [tinker["prompt_forward"]]) < 1e-4
    assert tinker["topk"][0] is None and scored.topk_prompt_logprobs[0] is None
    for theirs, ours in zip(tinker["topk"][1:], scored.topk_prompt_logprobs[1:]):
        assert [t for t, _ in theirs] == [t for t, _ in ours]
        assert _max_diff([[v for _, v in theirs]], [[v for _, v in ours]]) < 1e-5
        assert len(theirs) == K and all(a[1] >= b[1] for a, b in zip(theirs, theirs[1:]))
    for j in range(K):
        assert _max_diff([[row[j][1] for row in tinker["topk"][1:]]], [tinker["topk_forward"][j]]) < 1e-4
    # save_state -> create_training_client_from_state_with_optimizer -> the next losses are the same
    assert max(abs(a - b) for a, b in zip(tinker["uninterrupted"], tinker["resumed"])) < 1e-6
    assert tinker["resumed_model"].endswith(":train:1") and tinker["state_path"].endswith("/weights/mid")
    assert "weights/mid" in tinker["checkpoints"]
    # get_info's tokenizer_id loads offline on the client, as the engine's own tokenizer
    assert tinker["tokenizer_ids"] == tok.encode(SENTENCES[4], add_special_tokens=False)


def _max_diff(a: list[list], b: list[list]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(float(np.max(np.abs(np.asarray(x, float) - np.asarray(y, float)))) for x, y in zip(a, b))


def test_a_post_whose_answer_was_lost_runs_once_when_the_sdk_sends_it_again(
    tinker_python, http_engine, key, svc, tmp_path
):
    drop = {
        f"/api/v1/{r}"
        for r in ("create_model", "forward_backward", "optim_step", "save_weights_for_sampler", "asample")
    }
    proxy = DroppingProxy(http_engine["url"], drop)
    try:
        spec = {
            "out": str(tmp_path / "retry.json"),
            "tokens": svc.get_tokenizer("tiny-llama").encode(SENTENCES[0]),
        }
        out = run_client(tinker_python, "retry.py", spec, url=proxy.url, key=key)
    finally:
        proxy.close()
    assert proxy.drop == set() and all(proxy.seen[path] == 2 for path in drop), proxy.seen
    name = out["model_id"].replace(":", ".")
    counts = {op: row["count"] for op, row in svc.transport.usage(name)["operations"].items()}
    assert counts == {
        "create_session": 1,
        "forward_backward": 1,
        "optim_step": 1,
        "save_weights": 1,
        "sample": 1,
    }
    assert out["step"] == 1 and len(out["sampled"]) == 3


def test_bad_input_through_the_sdk_is_an_error_at_once_and_the_client_keeps_working(checks):
    expected = {
        "out_of_vocab": ("BadRequestError", "outside the vocabulary"),
        "unsupported_loss": ("BadRequestError", "(required by stable_reinforce)"),  # lacks its inputs
        "foreign_checkpoint": ("NotFoundError", "not found"),
        "prompt_out_of_vocab": ("BadRequestError", "outside the vocabulary"),
    }
    for case, (kind, words) in expected.items():
        assert checks[case]["type"] == kind and words in checks[case]["message"], (case, checks[case])
        assert checks[case]["seconds"] < 15, (case, checks[case])  # refused, not retried for minutes
    assert checks["after"] > 0


def test_an_sdk_outside_the_tested_range_gets_one_clear_error(checks):
    version = checks["version"]
    assert version["type"] == "BadRequestError" and version["seconds"] < 10
    assert "tinker SDK 0.39.1 is not supported" in version["message"]
    assert "tinker>=0.34,<0.39" in version["message"]


@pytest.mark.slow
def test_tinker_cli_downloads_a_training_checkpoint(tinker_python, http_engine, key, svc, tmp_path):
    client = TinkerHttp(http_engine["url"], key)
    model = client.create_model(client.session())
    path = client.result(
        client.ok("/save_weights", {"model_id": model, "seq_id": 1, "path": "final"})["request_id"]
    )["path"]
    client.close()
    tinker = tinker_python.parent / "tinker"
    env = {
        **os.environ,
        "TINKER_API_KEY": key,
        "TINKER_BASE_URL": http_engine["url"],
        "TINKER_TELEMETRY": "0",
    }
    done = subprocess.run(
        [str(tinker), "checkpoint", "download", path, "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    target = tmp_path / path.replace("tinker://", "").replace("/", "_")
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    got = load_file(str(target / "adapter" / "adapter_model.safetensors"))
    svc.download_checkpoint(f"sess://{model.replace(':', '.')}/state/final", tmp_path / "sess")
    want = load_file(str(tmp_path / "sess" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    # the CLI exported through a temporary external_weights checkpoint and deleted it afterwards
    exports = [
        c for s in svc.list_sessions() for c in svc.list_checkpoints(s.name) if "/merged/" in c["path"]
    ]
    assert exports == []


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_the_sdk_reaches_an_https_engine_that_its_client_trusts(tinker_python, svc, tmp_path):
    cert = self_signed_certificate(tmp_path)
    home = tmp_path / "home"
    info = start_engine(home, extra_args=["--tls-cert", cert[0], "--tls-key", cert[1]])
    try:
        spec = {
            "out": str(tmp_path / "hello.json"),
            "tokens": svc.get_tokenizer("tiny-llama").encode(SENTENCES[2]),
        }
        key = read_local_key(home)
        out = run_client(
            tinker_python, "hello.py", spec, url=info["url"], key=key, env={"SSL_CERT_FILE": cert[0]}
        )
        assert info["url"].startswith("https://") and out["loss"] > 0
    finally:
        stop_engine(home)
