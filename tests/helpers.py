"""Test helpers: small batches, a plain-torch reference copy of a session's model, and a Hugging
Face hub cache filled with a local model."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch
from peft import get_peft_model
from peft.utils import set_peft_model_state_dict

from sess.engine import AdamParams, Datum, ModelInput
from sess.engine.runtime.models.catalog import load_model

SENTENCES = [
    "The cat sat on the mat.",
    "Two plus three is five.",
    "Paris is the capital of France.",
    "12 + 30 = 42",
    "A quick brown fox jumps.",
    "Seven times six is 42.",
]


def train_steps(tc, texts: list[str], learning_rate: float, steps: int = 1) -> None:
    """``steps`` cross-entropy steps of ``tc`` on ``texts``, waited for: moves LoRA B off its zero
    init so every adapter weight gets gradients and samplers differ from the base model."""
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(t)) for t in texts]
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy")
        done = tc.optim_step(AdamParams(learning_rate=learning_rate))
    done.result()


def forward_logprobs(tc, prompt: list[int], tokens: list[int]) -> list[float]:
    """``forward``'s logprobs of ``tokens`` after ``prompt`` under ``tc``'s current weights."""
    full = prompt + tokens
    datum = Datum(
        ModelInput.from_ints(full[:-1]), {"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)}
    )
    return tc.forward([datum]).result().loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :]


def ce_datum(tokens: list[int]) -> Datum:
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:]),
            "weights": np.ones(len(tokens) - 1, np.float32),
        },
    )


def reference_model(runtime, session: str):
    """An independent copy of the session's base model + adapter, in plain peft/torch."""
    state = runtime.sessions[session]
    host = runtime.hosts[state.base_model]
    base, _, _ = load_model(state.base_model, home=runtime.home)
    config = copy.deepcopy(host.peft.peft_config[state.adapter])
    model = get_peft_model(base, config)
    set_peft_model_state_dict(model, host.get_state(state.adapter))
    model.eval()
    return model


def reference_logprobs(model, datum: Datum) -> torch.Tensor:
    ids = torch.tensor([datum.model_input.to_ints()])
    logits = model(input_ids=ids).logits[0].float()
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().long()
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


def engine_grads(runtime, session: str) -> dict[str, torch.Tensor]:
    state = runtime.sessions[session]
    return {
        n.replace(f".{state.adapter}.", ".default."): p.grad.clone()
        for n, p in state.params.items()
        if p.grad is not None
    }


def reference_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def clear_grads(runtime, session: str) -> None:
    for p in runtime.sessions[session].params.values():
        p.grad = None


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def sandbox_server(limit_s: int):
    """``python -m sess.sandbox.server`` on a free port with ``limit_s`` wall and CPU seconds a run;
    yields its URL once it answers ``/ping`` (a route only sess's server has), stops it after."""
    port = free_port()
    limits = ["--wall-s", str(limit_s), "--cpu-s", str(limit_s)]
    server = subprocess.Popen(
        [sys.executable, "-m", "sess.sandbox.server", "--port", str(port), *limits],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/ping", timeout=1).read()
                break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, "the sandbox server did not start"
                time.sleep(0.1)
        yield url
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=10)


def decode_plan(decoder, tok, plan: list[tuple]) -> list[tuple[list[int], list[float]]]:
    """Drive a decode batch step by step so each composition surely happens: ``plan`` holds
    (step, name, prompt, num_samples, adapter) items, each submitted at its step (seed 5, T=1, 20
    tokens). Returns the tokens and logprobs of the item named "x"."""
    from sess.engine import SamplingParams
    from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
    from sess.engine.sampling.token_choice import StopChecker

    plan = list(plan)
    batch, results, step = DecodeBatch(decoder), {}, 0
    while plan or batch.active:
        for item in [p for p in plan if p[0] == step]:
            _, name, prompt, samples, adapter = item
            batch.submit(
                SampleJob(
                    prompt=prompt,
                    num_samples=samples,
                    params=SamplingParams(max_tokens=20, temperature=1.0, seed=5),
                    adapter=adapter,
                    stopper=StopChecker(None, set(), tok.decode),
                    on_done=lambda seqs, error, name=name: results.__setitem__(name, (seqs, error)),
                )
            )
            plan.remove(item)
        batch.step()
        step += 1
    seqs, error = results["x"]
    assert error is None
    return [(s.tokens, s.logprobs) for s in seqs]


@contextlib.contextmanager
def budget(runtime, value: int):
    """The in-process ``runtime``'s memory budget set to ``value`` bytes for the block."""
    before = runtime.memory_budget if runtime.budget_given else None  # None: the default again
    runtime.memory_budget = value
    try:
        yield
    finally:
        runtime.memory_budget = before


def batch_invariance(svc) -> dict:
    """What the engine behind ``svc`` reports of batch invariance on this machine (its calibration
    of the sampling kernels): in-process from the runtime, over HTTP from ``/healthz``."""
    engine = getattr(svc.transport, "engine", None)
    if engine is not None:
        return engine.runtime.batch_invariance()
    with urllib.request.urlopen(f"{svc.transport.url}/healthz", timeout=10) as answer:
        return json.loads(answer.read())["batch_invariant"]


def assert_same_samples(svc, got, alone) -> None:
    """``got`` (a request's sequences among others) equals ``alone`` (the same request alone) to
    the bit where the engine reports batch invariance; where it reports kernels that are not
    row-invariant, it names them and the logprobs agree to 1e-5."""
    invariance = batch_invariance(svc)
    if invariance["exact"]:
        assert [s.tokens for s in got] == [s.tokens for s in alone]
        assert [s.logprobs for s in got] == [s.logprobs for s in alone]
        return
    assert invariance["inexact"], invariance
    for a, b in zip(got, alone):
        same = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        assert max((abs(x - y) for x, y in zip(a.logprobs[:same], b.logprobs[:same])), default=0) < 1e-5


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (reaping it first if it is this process's exited child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fill_hub_cache(cache: Path, hub_id: str, model_dir: Path) -> Path:
    """Put the model files of ``model_dir`` (its top-level files but sess's own markers) into the
    Hugging Face hub cache ``cache`` as ``hub_id``'s ``main``, in the layout a download leaves:
    ``models--Org--Name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` linking to its blob and
    ``refs/main`` naming the commit. Its snapshot directory."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("sess"))
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    commit = hashlib.sha1(json.dumps(digests, sort_keys=True).encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in files:
        (repo / "blobs" / digests[path.name]).write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(Path("..", "..", "blobs", digests[path.name]))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
