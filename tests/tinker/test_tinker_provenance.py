"""Provenance spans and record_stability_info over the Tinker routes (raw HTTP, as the SDK sends
them): a sampling session records each sequence (record_stability_info or not); a datum whose spans tile
it, name recorded sequences and claim the sampled tokens trains with any loss, and stable_reinforce
reads the recorded sampler logprobs; spans that contradict the datum are 400s naming the datum and
the span, after which the model keeps working. The records' day, with a clock the test moves."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema
from sess.engine.server.tinker.sequence_records import LIFETIME_S, SequenceRecords, bound_key

from helpers import SENTENCES
from tinker_helpers import TinkerHttp, make_tinker_venv, read_fb_output, run_client


@pytest.fixture(scope="module")
def key(sess_home) -> str:
    return KeyStore(sess_home).add("tinker-provenance")["key"]


@pytest.fixture()
def a(http_engine, key):
    client = TinkerHttp(http_engine["url"], key)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tok(http_engine, sess_home):
    svc = ServiceClient(http_engine["url"], home=sess_home)
    yield svc.get_tokenizer("tiny-llama")
    svc.close()


def test_a_record_lasts_a_day_unused_and_each_use_restarts_it():
    now = [1000.0]
    records = SequenceRecords(clock=lambda: now[0], max_tokens=20)
    records.add("r.0", [1, 2], [3, 4], [-0.5, -0.25])
    now[0] += LIFETIME_S - 1
    assert records.get("r.0").tokens.tolist() == [3, 4]  # used: its day starts again
    now[0] += LIFETIME_S - 1
    assert records.get("r.0") is not None
    now[0] += LIFETIME_S + 1
    assert records.get("r.0") is None and records.tokens == 0
    # bounded: past max_tokens the least recently used go first
    for i in range(8):  # 3 tokens each: the first two go
        records.add(f"s.{i}", [1], [2, 3], [-1.0, -1.0])
    assert records.tokens == 18 and len(records) == 6
    assert records.get("s.1") is None and records.get("s.2") is not None
    # and a key's sessions together: the least recently used go first, whichever session holds them
    other = SequenceRecords(clock=lambda: now[0], max_tokens=20)
    now[0] += 1
    other.add("t.0", [1], [2, 3], [-1.0, -1.0])
    bound_key([records, other], limit=12)
    assert records.tokens + other.tokens <= 12 and other.get("t.0") is not None


def test_a_sessions_record_set_stays_while_its_samples_run_and_goes_a_day_after_its_last_use():
    """The sweep that drops an exited client's records drops only stale sets: one made for a sample
    request whose samples are still running is empty, yet kept."""
    now = [0.0]
    records = SequenceRecords(clock=lambda: now[0])  # made for a request; its samples still running
    now[0] += LIFETIME_S - 1
    assert not records.stale()
    records.touch()  # another request of the session
    now[0] += LIFETIME_S - 1
    assert not records.stale()
    records.add("r.0", [1], [2], [-1.0])
    now[0] += LIFETIME_S + 1  # the record's day is over and nothing sampled into the set since
    assert records.stale() and len(records) == 0


def _sampled(a: TinkerHttp, session: str, prompt: list[int], record: bool, n: int = 2):
    started = _start_sample(a, session, prompt, record, n)
    out = schema.SampleResponse()
    out.ParseFromString(a.result(started["request_id"]))
    return started["sample_sequence_ids"], [np.frombuffer(s.tokens, "<i4").tolist() for s in out.sequences]


def _start_sample(
    a: TinkerHttp, session: str, prompt: list[int], record: bool, n: int, tokens: int = 6
) -> dict:
    sampler = a.ok(
        "/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"},
    )["sampling_session_id"]
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": n,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": tokens, "seed": 3, "stop": []},
        "record_stability_info": record,
    }
    return a.ok("/asample", body)


def _request(model: str, seq: int, loss_fn: str, datums: list[dict], config: dict | None = None) -> bytes:
    """A ForwardBackwardRequest whose datums carry (kind, sequence_id, offset, length) spans."""
    message = schema.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn=loss_fn)
    for name, value in (config or {}).items():
        message.loss_fn_config[name] = value
    for d in datums:
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(d["input"], "<i4").tobytes()
        for name, array in d["inputs"].items():
            tensor = datum.loss_fn_inputs[name]
            tensor.dense = array.tobytes()
            tensor.dtype = schema.DTYPE["DTYPE_INT64" if array.dtype.kind == "i" else "DTYPE_FLOAT32"]
            tensor.shape.append(len(array))
        for field in ("model_input_spans", "loss_fn_input_spans"):
            for kind, sequence_id, offset, length in d[field]:
                arm = getattr(getattr(datum, field).add(), kind)
                arm.sequence_id, arm.offset, arm.length = sequence_id, offset, length
    return message.SerializeToString()


def _rl_datum(prompt: list[int], sequence_id: str, sampled: list[int], logprob: float = -1.0) -> dict:
    """The cookbook's RL datum: input prompt + sampled[:-1], targets prompt[1:] + sampled."""
    full = prompt + sampled
    n, p = len(full) - 1, len(prompt)
    return {
        "input": full[:-1],
        "inputs": {
            "target_tokens": np.asarray(full[1:], "<i8"),
            "logprobs": np.full(n, logprob, "<f4"),
            "advantages": np.where(np.arange(n) >= p - 1, 1.0, 0.0).astype("<f4"),
        },
        "model_input_spans": [
            ("prompt_tokens", sequence_id, 0, p),
            ("sampled_tokens", sequence_id, 0, len(sampled) - 1),
        ],
        "loss_fn_input_spans": [
            ("prompt_tokens", sequence_id, 1, p - 1),
            ("sampled_tokens", sequence_id, 0, len(sampled)),
        ],
    }


def test_valid_spans_train_with_any_loss_and_stable_reinforce_reads_the_record(a, tok):
    session = a.session()
    prompt = tok.encode(SENTENCES[0])[:6]
    sequence_ids, sampled = _sampled(a, session, prompt, record=True)
    model = a.create_model(session)
    datums = [_rl_datum(prompt, s, t) for s, t in zip(sequence_ids, sampled)]
    seq = 0
    for loss_fn in ("ppo", "importance_sampling", "cispo", "stable_reinforce"):
        seq += 1
        started = a.forward_backward(_request(model, seq, loss_fn, datums, {}))
        assert started.status_code == 200, (loss_fn, started.text[:300])
        logprobs, metrics = read_fb_output(a.result(started.json()["request_id"]))
        assert len(logprobs) == 2
    # the datum says every sampler logprob is -1; the record holds the sampler's own, which the
    # fresh adapter (B = 0) reproduces: stable_reinforce's weights are 1 where ppo's ratios are not
    assert metrics["is_weight:mean"] == pytest.approx(1.0, abs=1e-3)
    assert metrics["is_weight_truncated:mean"] == 0.0 and metrics["kl_sampler_learner_k3:mean"] < 1e-5


def test_spans_that_contradict_the_datum_are_400s_naming_datum_and_span(a, tok):
    session = a.session()
    prompt = tok.encode(SENTENCES[1])[:5]
    (recorded, _), (first, _) = _sampled(a, session, prompt, record=True)
    model = a.create_model(session)
    good = _rl_datum(prompt, recorded, first)
    wrong_token = _rl_datum(prompt, recorded, first[:-1] + [(first[-1] + 1) % 100])
    past_end = {
        **good,
        "loss_fn_input_spans": [
            ("prompt_tokens", recorded, 1, len(prompt) - 1),
            ("sampled_tokens", recorded, 1, len(first)),
        ],
    }
    short = {**good, "model_input_spans": good["model_input_spans"][:1]}
    unknown = _rl_datum(prompt, "no-such.0", first)
    cases = [
        (wrong_token, "data[1].loss_fn_input_spans[1]: target_tokens["),
        (past_end, "data[1].loss_fn_input_spans[1]: offset 1 + length"),
        (short, "data[1].model_input_spans: the runs cover"),
        (unknown, "data[1].model_input_spans[0].sequence_id: 'no-such.0' is not a sequence"),
    ]
    for seq, (bad, words) in enumerate(cases, start=1):
        refused = a.forward_backward(_request(model, seq, "ppo", [good, bad]))
        assert refused.status_code == 400 and words in refused.json()["detail"], refused.text[:300]
    # a sampler without record_stability_info records its sequences too (the cookbook sends spans
    # whatever the loss, and records only for stable_reinforce): its spans are checked and train
    other = a.session()
    (unflagged, *_), (tokens, *_) = _sampled(a, other, prompt, record=False)
    other_model = a.create_model(other)
    started = a.forward_backward(_request(other_model, 1, "ppo", [_rl_datum(prompt, unflagged, tokens)]))
    assert started.status_code == 200, started.text[:300]
    bad = _rl_datum(prompt, unflagged, tokens[:-1] + [(tokens[-1] + 1) % 100])
    refused = a.forward_backward(_request(other_model, 2, "ppo", [bad]))
    assert refused.status_code == 400 and "data[0].loss_fn_input_spans[1]" in refused.json()["detail"]
    # nor is one session's record another's
    refused = a.forward_backward(_request(other_model, 3, "ppo", [good]))
    assert refused.status_code == 400 and "is not a sequence" in refused.json()["detail"]
    answer = a.result(a.forward_backward(_request(model, len(cases) + 1, "ppo", [good])).json()["request_id"])
    assert len(read_fb_output(answer)[0]) == 1


def test_two_clients_sampling_at_once_each_keep_their_records(http_engine, sess_home, a, tok):
    """Two recipes at once (here on two keys): B's sample request is still running when A's comes
    in; B's sequences are recorded all the same, and its datums' spans train."""
    b = TinkerHttp(http_engine["url"], KeyStore(sess_home).add("tinker-provenance-b")["key"])
    try:
        prompt = tok.encode(SENTENCES[2])[:6]
        mine, theirs = a.session(), b.session()
        running = _start_sample(b, theirs, prompt, record=False, n=8, tokens=96)
        other = _start_sample(a, mine, prompt, record=True, n=2)  # lands while B's samples run
        a.result(other["request_id"])
        out = schema.SampleResponse()
        out.ParseFromString(b.result(running["request_id"]))
        sampled = [np.frombuffer(s.tokens, "<i4").tolist() for s in out.sequences]
        model = b.create_model(theirs)
        datums = [_rl_datum(prompt, s, t) for s, t in zip(running["sample_sequence_ids"], sampled)]
        started = b.forward_backward(_request(model, 1, "ppo", datums))
        assert started.status_code == 200, started.text[:300]
        assert len(read_fb_output(b.result(started.json()["request_id"]))[0]) == 8
    finally:
        b.close()


def test_placeholder_targets_on_a_prompt_run_train_where_the_loss_leaves_them_out(a, tok):
    """cookbook 0.6.1's rl_loop sends target 0 at every prompt position, with advantage 0 there,
    under a prompt span: a placeholder the policy losses do not read, so it trains. Where the loss
    reads it (an advantage that is not 0; dro, whose penalty reads every target) it is refused."""
    session = a.session()
    prompt = tok.encode(SENTENCES[3])[:6]
    (recorded, *_), (sampled, *_) = _sampled(a, session, prompt, record=True)
    model = a.create_model(session)
    placeholders = _rl_datum(prompt, recorded, sampled)
    placeholders["inputs"]["target_tokens"][: len(prompt) - 1] = 0  # rl_loop: [0] * ob_len + sampled
    assert 0 not in prompt[1:]
    read = {**placeholders, "inputs": {**placeholders["inputs"]}}
    read["inputs"]["advantages"] = np.ones(len(prompt) + len(sampled) - 1, "<f4")
    cases = [
        ("stable_reinforce", placeholders, None),
        ("ppo", placeholders, None),
        ("dro", placeholders, "data[0].loss_fn_input_spans[0]: target_tokens[0] is token 0"),
        ("stable_reinforce", read, "data[0].loss_fn_input_spans[0]: target_tokens[0] is token 0"),
    ]
    for seq, (loss_fn, datum, refusal) in enumerate(cases, start=1):
        answer = a.forward_backward(_request(model, seq, loss_fn, [datum]))
        if refusal is None:
            assert answer.status_code == 200, (loss_fn, answer.text[:300])
            assert len(read_fb_output(a.result(answer.json()["request_id"]))[0]) == 1
        else:
            assert answer.status_code == 400 and refusal in answer.json()["detail"], answer.text[:300]


@pytest.mark.slow
def test_the_tinker_sdk_sends_spans_that_train_and_a_contradiction_is_refused(
    http_engine, key, tok, tmp_path
):
    python = make_tinker_venv(tmp_path)
    spec = {"out": str(tmp_path / "provenance.json"), "prompt": tok.encode(SENTENCES[2])[:5]}
    out = run_client(python, "provenance.py", spec, url=http_engine["url"], key=key)
    assert len(set(out["sequence_ids"])) == 2
    # the datums' logprobs say -1; the recorded ones are the sampler's, which the fresh adapter matches
    assert out["stable_reinforce"]["is_weight:mean"] == pytest.approx(1.0, abs=1e-3)
    assert out["stable_reinforce"]["kl_sampler_learner_k3:mean"] < 1e-5
    assert abs(out["ppo"]["ratio:mean"] - 1) > 0.3  # ppo reads the datum's -1 logprobs, as sent
    error = out["corrupt_error"]
    assert error.startswith("BadRequestError") and "data[0].loss_fn_input_spans[1]: target_tokens[" in error
