"""Issue-level Tinker features over the Tinker routes: distillation targets ((N, K) cross_entropy),
the sampling options (stop=[], topk_sample_logprobs, prompt_logprobs_last_n, target_prompt_logprobs
dense and sparse, prompt_alt_tokens_k) and what is refused (K = 0, mismatched shapes, malformed
provenance spans, a non-bool record_stability_info, image-pointer chunks, the dimuon optimizer,
unknown fields), each a
400 naming the field after which the model keeps working. Raw HTTP here (cheap); the same through
the unmodified tinker 0.38 SDK in its own venv is slow-marked."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import ServiceClient
from sess.engine.server.keys import KeyStore
from sess.engine.server.tinker import schema

from helpers import SENTENCES
from tinker_helpers import TinkerHttp, fb_request, make_tinker_venv, read_fb_output, run_client

K = 3


@pytest.fixture(scope="module")
def key(sess_home) -> str:
    return KeyStore(sess_home).add("tinker-ops")["key"]


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


def _multi_request(model: str, seq: int, tokens: list[int], targets, weights, forward_only=True) -> bytes:
    message = schema.ForwardBackwardRequest(
        model_id=model, seq_id=seq, loss_fn="cross_entropy", forward_only=forward_only
    )
    datum = message.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, "<i4").tobytes()
    for name, array, dtype in (
        ("target_tokens", targets, "DTYPE_INT64"),
        ("weights", weights, "DTYPE_FLOAT32"),
    ):
        tensor = datum.loss_fn_inputs[name]
        tensor.dense, tensor.dtype = array.tobytes(), schema.DTYPE[dtype]
        tensor.shape.extend(array.shape)
    return message.SerializeToString()


def test_k_targets_per_position_over_the_tinker_route(a, tok):
    model = a.create_model(a.session())
    tokens = tok.encode(SENTENCES[0])[:12]
    n = len(tokens)
    rng = np.random.default_rng(1)
    targets = rng.integers(0, 200, (n, K)).astype("<i8")
    weights = rng.uniform(0, 1, (n, K)).astype("<f4")
    answer = a.result(
        a.forward_backward(_multi_request(model, 1, tokens, targets, weights)).json()["request_id"]
    )
    out = schema.ForwardBackwardOutput()
    out.ParseFromString(answer)
    field = out.loss_fn_outputs[0].fields["logprobs"]
    assert list(field.trailing_shape) == [K]
    got = np.frombuffer(field.data, "<f4").reshape(n, K)
    loss = dict(out.metrics)["loss:sum"]
    summed = 0.0
    for j in range(K):
        column = (targets[:, j].copy(), weights[:, j].copy())
        raw = a.result(a.forward_backward(_multi_request(model, 2 + j, tokens, *column)).json()["request_id"])
        logprobs, metrics = read_fb_output(raw)
        np.testing.assert_allclose(got[:, j], logprobs[0], atol=1e-5)
        summed += metrics["loss:sum"]
    assert abs(loss - summed) < 1e-5 * max(1.0, abs(summed))


def test_bad_target_shapes_are_400s_naming_both_and_the_model_keeps_working(a, tok):
    model = a.create_model(a.session())
    tokens = tok.encode(SENTENCES[1])[:8]
    n = len(tokens)
    cases = [
        (np.zeros((n, 0), "<i8"), np.zeros((n, 0), "<f4"), [f"shape ({n}, 0)", "K = 0"]),
        (np.ones((n, 3), "<i8"), np.ones((n, 2), "<f4"), [f"({n}, 3)", f"({n}, 2)", "target_tokens"]),
        (np.ones((n, 3), "<i8"), np.ones(n, "<f4"), [f"({n}, 3)", f"({n},)"]),
    ]
    for seq, (targets, weights, words) in enumerate(cases, start=1):
        refused = a.forward_backward(_multi_request(model, seq, tokens, targets, weights, forward_only=False))
        assert refused.status_code == 400, refused.text[:300]
        assert all(w in refused.json()["detail"] for w in words), refused.json()["detail"]
    spans = schema.ForwardBackwardRequest()
    spans.ParseFromString(fb_request(model, len(cases) + 1, [tokens]))
    spans.data[0].model_input_spans.add().prompt_tokens.length = n
    refused = a.forward_backward(spans.SerializeToString())
    assert refused.status_code == 400 and "data[0].model_input_spans" in refused.json()["detail"]
    answer = a.result(a.forward_backward(fb_request(model, len(cases) + 2, [tokens])).json()["request_id"])
    assert read_fb_output(answer)[1]["loss:sum"] > 0


def _sample(a: TinkerHttp, body: dict):
    out = schema.SampleResponse()
    out.ParseFromString(a.result(a.ok("/asample", body)["request_id"]))
    return out


def test_sampling_options_over_the_tinker_route(a, tok):
    session = a.session()
    sampler = a.ok(
        "/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"},
    )["sampling_session_id"]
    prompt = tok.encode(SENTENCES[2])[:10]
    base = {
        "sampling_session_id": sampler,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
    }
    full = np.frombuffer(
        _sample(
            a, {**base, "seq_id": 0, "prompt_logprobs": True, "sampling_params": {"max_tokens": 1}}
        ).prompt_logprobs,
        "<f4",
    )
    # sparse CSR target ids: row i lists column 0 (= the prompt's next token) and, on even rows, column 2
    rows = [[0, 2] if i % 2 == 0 else [0] for i in range(len(prompt) - 1)]
    crow = np.cumsum([0] + [len(r) for r in rows]).tolist()
    data = [prompt[i + 1] if c == 0 else 7 for i, r in enumerate(rows) for c in r]
    target = {
        "data": data,
        "dtype": "int64",
        "shape": [len(prompt) - 1, 3],
        "sparse_crow_indices": crow,
        "sparse_col_indices": [c for r in rows for c in r],
    }
    out = _sample(
        a,
        {
            **base,
            "seq_id": 1,
            "sampling_params": {"max_tokens": 3, "seed": 5, "stop": []},
            "prompt_logprobs": True,
            "prompt_logprobs_last_n": 2,
            "topk_sample_logprobs": 4,
            "target_prompt_logprobs": target,
            "prompt_alt_tokens_k": 2,
        },
    )
    last = np.frombuffer(out.prompt_logprobs, "<f4")
    assert np.isnan(last[:-2]).all()
    np.testing.assert_allclose(last[-2:], full[-2:], atol=1e-5)
    csr = out.target_prompt_logprobs.sparse_csr
    assert list(out.target_prompt_logprobs.shape) == [len(prompt) - 1, 3]
    assert np.frombuffer(csr.crow_indices, "<i8").tolist() == crow
    values = np.frombuffer(csr.values, "<f4")
    np.testing.assert_allclose(values[np.asarray(crow[:-1])], full[1:], atol=1e-5)  # column 0 of each row
    sequence = out.sequences[0]
    assert len(np.frombuffer(sequence.tokens, "<i4")) == 3  # stop=[]: no EOS stop either
    topk = sequence.topk_sampled_logprobs
    assert (topk.k, topk.length) == (4, 3)
    first = np.frombuffer(topk.logprobs, "<f4").reshape(3, 4)
    assert np.all(np.diff(first, axis=1) <= 0)
    alt = out.prompt_alt_tokens
    assert list(alt.tokens.shape) == list(alt.logprobs.shape) == [len(prompt) - 1, 2]
    alt_ids = np.frombuffer(alt.tokens.dense, "<i8").reshape(-1, 2)
    alt_lp = np.frombuffer(alt.logprobs.dense, "<f4").reshape(-1, 2)
    check = _sample(
        a,
        {
            **base,
            "seq_id": 2,
            "sampling_params": {"max_tokens": 1},
            "target_prompt_logprobs": {
                "data": alt_ids.ravel().tolist(),
                "dtype": "int64",
                "shape": list(alt_ids.shape),
            },
        },
    )
    dense = np.frombuffer(check.target_prompt_logprobs.dense, "<f4").reshape(alt_ids.shape)
    np.testing.assert_allclose(dense, alt_lp, atol=1e-5)


def test_refused_sample_and_optimizer_fields_are_400s_naming_them(a):
    session = a.session()
    sampler = a.ok(
        "/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-llama"},
    )["sampling_session_id"]
    base = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 1,
        "sampling_params": {"max_tokens": 1},
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
    }
    seq = 0
    pointer = {"chunks": [{"type": "image_asset_pointer", "format": "png", "location": "a.png"}]}
    for body, words in [
        ({**base, "record_stability_info": "yes"}, "record_stability_info: expected bool"),
        ({**base, "surprise": 1}, "surprise: not a field of SampleRequest"),
        ({**base, "prompt": pointer}, "image_asset_pointer chunk: this engine runs text models"),
        ({**base, "prompt_logprobs_last_n": 5, "prompt_logprobs": True}, "prompt_logprobs_last_n"),
        ({**base, "target_prompt_logprobs": {"data": [], "dtype": "int64", "shape": [2, 0]}}, "K >= 1"),
        ({**base, "topk_sample_logprobs": -2}, "topk_sample_logprobs"),
    ]:
        seq += 1  # a seq_id's answer is kept (a re-sent request gets it again): one per case
        refused = a.post("/asample", {**body, "seq_id": seq})
        assert refused.status_code == 400 and words in refused.json()["detail"], refused.text[:300]
    assert len(_sample(a, {**base, "seq_id": seq + 1}).sequences) == 1
    one_token = {"chunks": [{"type": "encoded_text", "tokens": [4]}]}
    alone = _sample(a, {**base, "seq_id": seq + 2, "prompt": one_token, "prompt_alt_tokens_k": 2})
    assert alone.HasField("prompt_alt_tokens") and alone.prompt_alt_tokens.tokens.shape[0] == 0
    dimuon = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "tiny-llama",
        "lora_config": {"rank": 4},
        "optimizer_config": {"type": "dimuon", "version": 1},
    }
    refused = a.post("/create_model", dimuon)
    assert refused.status_code == 400 and "dimuon optimizer is not supported" in refused.json()["detail"]
    model = a.create_model(session, seq=1)
    refused = a.post("/optim_step", {"model_id": model, "seq_id": 1, "optimizer_params": {"type": "dimuon"}})
    assert (
        refused.status_code == 400 and "optimizer_params: this engine runs AdamW" in refused.json()["detail"]
    )


@pytest.mark.slow
def test_the_tinker_sdk_gets_the_same(http_engine, key, tok, tmp_path):
    python = make_tinker_venv(tmp_path)
    spec = {
        "out": str(tmp_path / "ops.json"),
        "tokens": tok.encode(SENTENCES[0])[:10],
        "prompt": tok.encode("Stop here"),
        "eos": tok.eos_token_id,
    }
    out = run_client(python, "ops.py", spec, url=http_engine["url"], key=key, timeout=600)
    n = len(spec["tokens"]) - 1
    assert out["multi_shape"] == [n, K]
    np.testing.assert_allclose(
        np.asarray(out["multi_logprobs"]), np.asarray(out["single_logprobs"]).T, atol=1e-5
    )
    assert abs(out["multi_loss"] - sum(out["single_losses"])) < 1e-5 * max(1.0, abs(out["multi_loss"]))
    assert abs(out["multi_fb_loss"] - out["multi_loss"]) < 1e-5 * max(1.0, abs(out["multi_loss"]))
    assert "K = 0" in out["k0_error"] and "target_tokens" in out["k0_error"]
    assert f"({n}, 3)" in out["mismatch_error"] and f"({n}, 2)" in out["mismatch_error"]
    assert "missing 'logprobs' (required by stable_reinforce)" in out["stable_reinforce_error"]
    assert "model_input_spans[0].sequence_id: 's' is not a sequence" in out["spans_error"]
    assert out["after_errors_loss"] > 0
    assert out["stop_none"] == {"tokens": [spec["eos"]], "reason": "stop"}
    assert len(out["stop_empty"]["tokens"]) == 6 and out["stop_empty"]["reason"] == "length"
    last, full = out["last_n"], out["full"]
    assert last[:-3] == [None] * (len(full) - 3)
    np.testing.assert_allclose(last[-3:], full[-3:], atol=1e-5)
    assert out["sample_last_n"][:-2] == [None] * (len(full) - 2)
    np.testing.assert_allclose(out["sample_last_n"][-2:], full[-2:], atol=1e-5)
    assert len(out["topk_sample"]["rows"]) == len(out["topk_sample"]["tokens"]) == 3
    # the taught model puts the runners-up 28-35 nats down, where fp32's spacing is 3.8e-6: relative
    assert all(abs(got - want) < 1e-5 * max(1.0, abs(want)) for got, want in out["topk_sample"]["checks"])
    values, ids = np.asarray(out["target"]["values"]), np.asarray(out["target"]["ids"])
    # the same: some targets sit ~66 nats down, where fp32's spacing is 7.6e-6 (relative, as above)
    np.testing.assert_allclose(values[:, 0], full[1:], rtol=1e-5, atol=1e-5)
    assert values[1, 1] == 0.0 and ids[1, 1] == -1
    assert np.asarray(out["alt"]["tokens"]).shape == (len(full) - 1, 2)
    assert all(abs(got - want) < 1e-5 * max(1.0, abs(want)) for got, want in out["alt"]["checks"])
    assert out["stability_sequences"] == 1
    assert out["after_sampling_errors"] == 1
    flight = out["inflight"]
    assert flight["snapshot_after"] == flight["snapshot_before"]  # five newer saves later, its own weights
    assert flight["old_inflight"] == flight["newest"] != flight["snapshot_before"]
    assert "kind" in out["kind_error"]
