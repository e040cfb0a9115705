"""Bad input gets an error that names the field (and datum index); the session keeps working."""

from __future__ import annotations

import json
import math
import uuid

import httpx
import numpy as np
import pytest

from sess.engine import (
    AdamParams,
    Datum,
    InvalidRequest,
    ModelInput,
    NotFound,
    SamplingParams,
    ServiceClient,
    SessError,
    TensorData,
)

from helpers import ce_datum


@pytest.fixture()
def tc(svc):
    client = svc.create_lora_training_client("tiny-llama", rank=4, seed=0)
    yield client
    client.stop()


def _rl(tokens, **overrides):
    n = len(tokens) - 1
    inputs = {
        "target_tokens": np.array(tokens[1:]),
        "logprobs": np.zeros(n, np.float32),
        "advantages": np.ones(n, np.float32),
    }
    inputs.update(overrides)
    return Datum(ModelInput.from_ints(tokens[:-1]), {k: v for k, v in inputs.items() if v is not None})


def _still_works(tc, tokens):
    out = tc.forward_backward([ce_datum(tokens)]).result()
    assert math.isfinite(out.metrics["loss:sum"])
    assert tc.optim_step(AdamParams(learning_rate=1e-3)).result().metrics["step"] >= 1


def test_client_side_checks_name_field_and_index(tc):
    tok = tc.get_tokenizer()
    good = tok.encode("one two three")
    cases = [
        ([_rl(good), _rl(good, advantages=None)], "ppo", r"data\[1\].*'advantages'"),
        ([_rl(good, logprobs=np.zeros(2, np.float32))], "ppo", r"data\[0\].*'logprobs'.*length"),
        (
            [_rl(good, advantages=np.full(len(good) - 1, np.nan, np.float32))],
            "importance_sampling",
            r"data\[0\].*'advantages'.*NaN",
        ),
        ([ce_datum(good)], "not_a_loss", r"loss_fn.*not_a_loss"),
        (
            [
                Datum(
                    ModelInput.from_ints(good[:-1]),
                    {"target_tokens": np.array(good[1:]), "weights": np.ones(len(good) - 1)},
                )
            ],
            "ppo",
            r"data\[0\].*'logprobs'",
        ),
    ]
    for data, loss, pattern in cases:
        with pytest.raises(InvalidRequest, match=pattern):
            tc.forward_backward(data, loss)
    with pytest.raises(InvalidRequest, match=r"loss_fn_config\.clip"):
        tc.forward_backward([_rl(good)], "ppo", loss_fn_config={"clip": 0.1})
    with pytest.raises(
        InvalidRequest, match=r"clip_low_threshold: expected a finite number"
    ):  # not OverflowError
        tc.forward_backward([_rl(good)], "ppo", loss_fn_config={"clip_low_threshold": 10**400})
    with pytest.raises(InvalidRequest, match="learning_rate"):
        tc.optim_step(AdamParams(learning_rate=float("nan")))
    sc = tc.create_sampling_client()
    with pytest.raises(InvalidRequest, match="num_samples"):
        sc.sample(good, num_samples=0)
    with pytest.raises(InvalidRequest, match="temperature"):
        sc.sample(good, sampling_params=SamplingParams(temperature=-1.0))
    _still_works(tc, good)


def test_engine_side_checks_keep_session_alive(svc, tc):
    tok = tc.get_tokenizer()
    good = tok.encode("one two three")
    vocab = len(tok)
    with pytest.raises(InvalidRequest, match=r"data\[0\]\.model_input.*token id"):
        tc.forward_backward([ce_datum([*good[:-1], vocab + 5, good[-1]])]).result()
    bad_target = Datum(
        ModelInput.from_ints(good[:-1]),
        {"target_tokens": np.array([*good[1:-1], 10**6]), "weights": np.ones(len(good) - 1)},
    )
    with pytest.raises(InvalidRequest, match=r"data\[0\].*target_tokens.*outside the vocabulary"):
        tc.forward(bad_target).result()
    sc = tc.create_sampling_client()
    with pytest.raises(InvalidRequest, match=r"prompt.*outside the vocabulary"):
        sc.sample([vocab + 1]).result()
    with pytest.raises(InvalidRequest, match=r"max_tokens.*context"):
        sc.sample(good, sampling_params=SamplingParams(max_tokens=10**7)).result()
    # the engine checks what a client would have: raw submissions that skip the SDK's checks
    transport = svc.transport
    raw = [
        (
            "forward_backward",
            {"data": [_rl(good, advantages=None).to_wire()], "loss_fn": "ppo"},
            r"data\[0\].*'advantages'",
        ),
        ("forward_backward", {"data": [ce_datum(good).to_wire()], "loss_fn": "nope"}, "loss_fn"),
        ("forward_backward", {"data": [{"model_input": {}}]}, r"data\[0\]"),
        ("optim_step", {"adam_params": {"learning_rate": -1}}, "learning_rate"),
        ("optim_step", {"adam_params": {"lr": 1}}, "adam_params"),
        ("save_weights", {"name": "x", "transient": True}, "transient"),
        ("save_weights", {"transient": "yes"}, "transient"),
    ]
    for name, args, pattern in raw:
        seq = tc.reserve_sequence_number()
        op = transport.submit(name, args, session=tc.name, seq=seq, client_token=f"raw-{seq}")
        with pytest.raises(SessError, match=pattern):
            while not transport.wait(op, 5)[0]:
                pass
    nan_adv = _rl(good, advantages=np.full(len(good) - 1, np.nan, np.float32)).to_wire()
    seq = tc.reserve_sequence_number()
    op = transport.submit("forward_backward", {"data": [nan_adv], "loss_fn": "ppo"}, session=tc.name, seq=seq)
    with pytest.raises(InvalidRequest, match=r"data\[0\].*advantages.*NaN"):
        transport.wait(op, 5)
    sample_op = transport.submit("sample", {"target": {"session": tc.name}, "prompt": good, "num_samples": 0})
    with pytest.raises(InvalidRequest, match="num_samples"):
        transport.wait(sample_op, 5)
    _still_works(tc, good)


def _refused(transport, name: str, args: dict, pattern: str, session=None, seq=None) -> None:
    """A raw submission (no SDK checks) is refused with an error matching ``pattern``."""
    with pytest.raises(SessError, match=pattern) as refused:
        op = transport.submit(name, args, session=session, seq=seq, client_token=uuid.uuid4().hex)
        while not transport.wait(op, 5)[0]:
            pass
    assert refused.value.status == 400, refused.value


POISON_ADAM = [
    ({"eps": 0.0}, r"adam_params\.eps: expected a value in 1e-20\.\.inf"),
    ({"eps": 1e-30}, r"adam_params\.eps"),
    ({"learning_rate": 1e30}, r"adam_params\.learning_rate: expected a value in 0\.0\.\.1\.0"),
    ({"weight_decay": 1e30}, r"adam_params\.weight_decay: expected a value in 0\.0\.\.1\.0"),
    ({"beta2": 1.0}, r"adam_params\.beta2: must be below 1"),
]


def test_optimizer_settings_that_would_poison_the_weights_are_refused(svc, tc):
    """eps 0 once put NaN into LoRA's A for good (its first gradient is zero: AdamW divides 0 by 0)."""
    good = tc.get_tokenizer().encode("one two three")
    tc.forward_backward([ce_datum(good)]).result()  # gradients for a poisoned step to apply
    with pytest.raises(InvalidRequest, match="learning_rate: expected a finite number"):
        tc.optim_step(AdamParams(learning_rate=10**400))  # too big for a float: once an OverflowError
    for settings, pattern in POISON_ADAM:
        with pytest.raises(InvalidRequest, match=pattern):  # the SDK's check
            tc.optim_step(AdamParams(**{"learning_rate": 1e-4, **settings}))
        seq = tc.reserve_sequence_number()  # the engine's, for clients without the SDK
        _refused(svc.transport, "optim_step", {"adam_params": settings}, pattern, tc.name, seq)
    _still_works(tc, good)
    again = tc.forward_backward([ce_datum(good)]).result()
    assert math.isfinite(again.metrics["loss:sum"])


def test_values_torch_cannot_hold_and_silent_nonsense_are_4xx_naming_what_was_sent(svc, tc):
    good = tc.get_tokenizer().encode("one two three")
    n, vocab = len(good) - 1, len(tc.get_tokenizer())
    ce = ce_datum(good).to_wire()
    shape = json.loads(json.dumps(ce))
    shape["loss_fn_inputs"]["weights"]["shape"] = [-n]  # numpy reads it as "all of them"
    negative = Datum(
        ModelInput.from_ints([-1, *good[1:-1]]), {"target_tokens": good[1:], "weights": [1.0] * n}
    )
    huge = ce_datum(good)
    huge.loss_fn_inputs["target_tokens"] = TensorData.from_numpy(np.full(n, 1e30, np.float32))
    rl = _rl(good).to_wire()
    ordered = [
        ({"data": [shape]}, r"data\[0\]: loss_fn_inputs\['weights'\]\.shape: \[-\d+\] does not hold"),
        ({"data": [negative.to_wire()]}, r"data\[0\]\.model_input: token id -1 is negative"),
        ({"data": [huge.to_wire()]}, r"'target_tokens'\]: token id 1e\+30 is outside the vocabulary"),
        (
            {
                "data": [rl],
                "loss_fn": "ppo",
                "loss_fn_config": {"clip_low_threshold": 2, "clip_high_threshold": 0.5},
            },
            r"clip_low_threshold <= 1 <= clip_high_threshold.*got 2 and 0\.5",
        ),
        ({"data": [rl], "loss_fn": "dro", "loss_fn_config": {"beta": -1}}, r"loss_fn_config\.beta.*got -1"),
    ]
    for args, pattern in ordered:
        seq = tc.reserve_sequence_number()
        _refused(svc.transport, "forward_backward", args, pattern, tc.name, seq)
    target = {"session": tc.name}
    for params, pattern in [
        ({"top_k": 2**63}, r"sampling_params\.top_k: expected a value in -1\.\.2147483647"),
        ({"top_k": 10**30}, r"sampling_params\.top_k"),
        ({"stop": [2**63]}, r"sampling_params\.stop: token id 9223372036854775808 is outside"),
        ({"stop": [vocab]}, rf"sampling_params\.stop: token id {vocab} is outside the vocabulary"),
        ({"temperature": 1e39}, r"sampling_params\.temperature: expected a value in 0\.0\.\.10000\.0"),
    ]:
        args = {"target": target, "prompt": good, "sampling_params": {"max_tokens": 2, **params}}
        _refused(svc.transport, "sample", args, pattern)
    _still_works(tc, good)


def test_a_loss_that_overflows_reads_back_as_inf_over_strict_json(svc, tc):
    """JSON has no Infinity: an overflowing metric travels as a string and reads back as a float."""
    good = tc.get_tokenizer().encode("one two three")
    datum = ce_datum(good)
    datum.loss_fn_inputs["weights"] = TensorData.from_numpy(np.full(len(good) - 1, 3e38, np.float32))
    out = tc.forward([datum]).result()
    assert math.isinf(out.metrics["loss:sum"]) and math.isinf(out.metrics["weights:sum"])
    url = getattr(svc.transport, "url", None)
    if url is None:  # in-process: no JSON on the way
        return
    headers = {"authorization": f"Bearer {svc.transport.api_key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        seq = tc.reserve_sequence_number()
        body = {"name": "forward", "args": {"data": [datum.to_wire()]}, "session": tc.name, "seq": seq}
        op_id = http.post("/api/submit", json=body).json()["op_id"]
        answer = http.post("/api/wait", json={"op_id": op_id, "timeout": 30})

    def not_json(constant):
        raise AssertionError(f"{constant} in a response: not JSON")

    assert json.loads(answer.text, parse_constant=not_json)["result"]["metrics"]["loss:sum"] == "inf"


def test_unknown_model_and_checkpoint_paths(svc, sess_home, tc):
    with pytest.raises(NotFound, match="base_model: 'no-such-model' is not a model this engine serves"):
        svc.create_lora_training_client("no-such-model")
    with pytest.raises(InvalidRequest, match="rank"):
        svc.create_lora_training_client("tiny-llama", rank=0)
    state = tc.save_state(name="mine").result().path
    for path, error, pattern in [
        (f"sess://{tc.name}/state/../../x", InvalidRequest, r"path.*sess://"),
        (f"sess://{tc.name}/../state", InvalidRequest, "path"),
        ("/etc/passwd", InvalidRequest, "path.*sess://"),
        (f"sess://{tc.name}/state/missing", NotFound, "not found"),
        ("sess://someone-else/state/x", NotFound, "not found"),
    ]:
        with pytest.raises(error, match=pattern):
            tc.load_state(path).result()
    # another key's session and checkpoints do not exist for this key
    other = ServiceClient("inproc", api_key="another-user", home=sess_home)
    other_tc = other.create_lora_training_client("tiny-llama", rank=4, seed=0)
    with pytest.raises(NotFound, match="not found"):
        other_tc.load_state(state).result()
    with pytest.raises(NotFound):
        other.create_training_client_from_state(state)
    with pytest.raises(NotFound):
        other.download_checkpoint(state, sess_home / "stolen")
    with pytest.raises(NotFound):
        other.get_training_client(tc.name)
    assert tc.name not in [s.name for s in other.list_sessions()]
    other_tc.stop()
    other.close()
    _still_works(tc, tc.get_tokenizer().encode("still here"))


def test_stopped_session_refuses_work_with_a_message(svc):
    tc = svc.create_lora_training_client("tiny-llama", rank=4)
    tc.stop()
    with pytest.raises(InvalidRequest, match="Stopped"):
        tc.forward([[1, 2, 3]]).result()
    assert svc.list_sessions(name_contains=tc.name)[0].status.value == "Stopped"
