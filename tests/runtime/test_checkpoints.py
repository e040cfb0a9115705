"""Checkpoints: PEFT and merged files reload to the engine's numbers; state resumes exactly."""

from __future__ import annotations

import json
import sqlite3

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from sess.engine import AdamParams, InvalidRequest, NotFound, SamplingParams
from sess.engine.runtime.models.catalog import load_model

from helpers import SENTENCES, ce_datum, forward_logprobs, train_steps


def _train(tc, steps=2, lr=2e-2):
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(s)) for s in SENTENCES]
    for _ in range(steps):
        tc.forward_backward(data)
        tc.optim_step(AdamParams(learning_rate=lr, weight_decay=0.01))
    return data


def _logprobs(model, datum):
    ids = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().long()
    return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("base_model", ["tiny-llama", "tiny-qwen3"])
def test_peft_and_merged_checkpoints_reload_to_engine_logprobs(svc, sess_home, tmp_path, base_model):
    with svc.create_lora_training_client(base_model, rank=4, seed=2) as tc:
        data = _train(tc)
        engine = [o["logprobs"].to_torch() for o in tc.forward(data).result().loss_fn_outputs]
        adapter_path = tc.save_weights_for_sampler().result().path
        merged_path = tc.save_weights_for_sampler(merge_weights=True).result().path
    assert adapter_path.startswith("sess://") and "/weights/" in adapter_path and "/merged/" in merged_path

    adapter_dir = svc.download_checkpoint(adapter_path, tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in adapter_dir.iterdir()}
    base, _, _ = load_model(base_model, home=sess_home)
    peft_model = PeftModel.from_pretrained(base, adapter_dir).eval()

    merged_dir = svc.download_checkpoint(merged_path, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    for datum, expected in zip(data, engine):
        assert (_logprobs(peft_model, datum) - expected).abs().max() < 1e-4
        assert (_logprobs(merged, datum) - expected).abs().max() < 1e-4


def test_state_resume_equals_uninterrupted(svc, tmp_path):
    def final_weights(tc, tag):
        path = tc.save_weights_for_sampler(name=tag).result().path
        return load_file(str(svc.download_checkpoint(path, tmp_path / tag) / "adapter_model.safetensors"))

    tok = svc.get_tokenizer("tiny-llama")
    data = [ce_datum(tok.encode(s)) for s in SENTENCES]
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)

    with svc.create_lora_training_client("tiny-llama", rank=4, seed=9) as tc:
        for _ in range(2):
            tc.forward_backward(data)
            tc.optim_step(adam)
        state = tc.save_state(name="after-two").result().path
        tc.forward_backward(data)
        tc.optim_step(adam)
        straight_loss = tc.forward(data).result().metrics["loss:sum"]
        straight = final_weights(tc, "straight")
        straight_step = svc.list_sessions(name_contains=tc.name)[0].step

    resumed_tc = svc.create_training_client_from_state_with_optimizer(state)
    with resumed_tc as tc:
        tc.forward_backward(data)
        assert tc.optim_step(adam).result().metrics["step"] == straight_step == 3
        resumed_loss = tc.forward(data).result().metrics["loss:sum"]
        resumed = final_weights(tc, "resumed")
    assert abs(resumed_loss - straight_loss) < 1e-6
    assert max(float((straight[k] - resumed[k]).abs().max()) for k in straight) < 1e-6

    # weights only: same starting weights, but the optimizer starts fresh, so the step differs
    with svc.create_training_client_from_state(state) as tc:
        tc.forward_backward(data)
        assert tc.optim_step(adam).result().metrics["step"] == 1
        fresh = final_weights(tc, "fresh")
    assert max(float((straight[k] - fresh[k]).abs().max()) for k in straight) > 1e-6

    # load_state_with_optimizer into an existing session of the same layout continues the same way
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=123) as tc:
        tc.load_state_with_optimizer(state).result()
        tc.forward_backward(data)
        tc.optim_step(adam).result()
        assert abs(tc.forward(data).result().metrics["loss:sum"] - straight_loss) < 1e-6


def test_state_checkpoint_files_are_safetensors_and_json(svc, tmp_path):
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=1) as tc:
        _train(tc, steps=1)
        path = tc.save_state().result().path
    files = {p.name for p in svc.download_checkpoint(path, tmp_path / "s").iterdir()}
    assert files == {
        "adapter_model.safetensors",
        "adapter_config.json",
        "optimizer.safetensors",
        "state.json",
    }
    meta = json.loads((tmp_path / "s" / "state.json").read_text())
    assert meta["step"] == 1 and meta["base_model"] == "tiny-llama"
    moments = load_file(str(tmp_path / "s" / "optimizer.safetensors"))
    assert any(k.endswith(".exp_avg_sq") for k in moments)


@pytest.mark.parametrize("damage", ["optimizer.safetensors", "state.json", "cut short"])
def test_a_state_checkpoint_not_whole_is_refused_naming_what_is_wrong(svc, sess_home, damage):
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=1) as tc:
        _train(tc, steps=1)
        path = tc.save_state().result().path
    session, kind, name = path.removeprefix("sess://").split("/")
    directory = sess_home / "checkpoints" / session / kind / name
    if damage == "cut short":
        data = (directory / "optimizer.safetensors").read_bytes()
        (directory / "optimizer.safetensors").write_bytes(data[: len(data) // 2])
    else:
        (directory / damage).unlink()
    before = {s.name for s in svc.list_sessions()}
    with pytest.raises(InvalidRequest) as refused:
        svc.create_training_client_from_state_with_optimizer(path)
    assert refused.value.status == 400
    said = str(refused.value)
    assert (
        f"state checkpoint {name} is "
        + ("damaged" if damage == "cut short" else f"not whole: {damage} missing")
        in said
    )
    assert {s.name for s in svc.list_sessions()} == before  # no half-made session left behind


def test_checkpoint_listing_and_no_partial_directories(svc, sess_home):
    with svc.create_lora_training_client("tiny-llama", rank=4) as tc:
        tc.save_weights_for_sampler(name="one").result()
        tc.save_state(name="two").result()
        listed = svc.list_checkpoints(tc.name)
    assert [c["path"] for c in listed] == [f"sess://{tc.name}/weights/one", f"sess://{tc.name}/state/two"]
    for c, kind, name in zip(listed, ("weights", "state"), ("one", "two")):
        files = (sess_home / "checkpoints" / tc.name / kind / name).iterdir()
        assert c["bytes"] == sum(f.stat().st_size for f in files) > 0
    leftovers = [p for p in (sess_home / "checkpoints" / tc.name).rglob(".*")]
    assert leftovers == []


def test_transient_sampler_saves_serve_their_own_weights_while_the_session_lives(svc, sess_home):
    """save_weights_and_get_sampling_client without a name writes a `sampler` save. Every one serves
    the weights of its own save for as long as the session lives, however many newer ones exist
    (the oldest loads again from disk, into an adapter slot reused from a newer save); when the
    session stops they are deleted (files, listing and registry), and a sampler of one says so."""
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=3) as tc:
        tok = tc.get_tokenizer()
        prompt = tok.encode("Question: what is 3 + 4? Answer:")
        target = tok.encode(" seven")
        samplers, expected = [], []
        for step in range(6):
            train_steps(tc, SENTENCES, 2e-2)
            samplers.append(tc.save_weights_and_get_sampling_client())
            expected.append(forward_logprobs(tc, prompt, target))
            got = samplers[-1].compute_logprobs(prompt + target).result()[len(prompt) :]
            assert max(abs(a - b) for a, b in zip(got, expected[-1])) < 1e-5, f"save {step}"
        named = tc.save_weights_and_get_sampling_client(name="kept")
        for step in (0, 2):  # older than the newest three: still there, with their own weights
            got = samplers[step].compute_logprobs(prompt + target).result()[len(prompt) :]
            assert max(abs(a - b) for a, b in zip(got, expected[step])) < 1e-5, f"save {step} again"
        listed = [c["path"] for c in svc.list_checkpoints(tc.name)]
        paths = [sc.model_path for sc in samplers]
        assert all(f"sess://{tc.name}/sampler/" in p for p in paths)
        assert named.model_path == f"sess://{tc.name}/weights/kept"
        assert listed == paths + [named.model_path]
    # the stop saved the state of the six steps taken since the session's last save_state (none)
    stopped = [c["path"] for c in svc.list_checkpoints(tc.name)]
    assert stopped == [named.model_path, f"sess://{tc.name}/state/stop-step000006-008"]
    assert list((sess_home / "checkpoints" / tc.name / "sampler").iterdir()) == []
    with pytest.raises(NotFound, match="transient sampler save"):
        samplers[-1].sample(prompt, sampling_params=SamplingParams(max_tokens=2)).result()
    named.sample(prompt, sampling_params=SamplingParams(max_tokens=2)).result()
    if not hasattr(svc.transport, "engine"):  # the server's registry lists what is on disk
        with sqlite3.connect(sess_home / "registry.db") as db:
            rows = db.execute("SELECT path FROM checkpoints WHERE session=?", (tc.name,)).fetchall()
        assert sorted(r[0] for r in rows) == sorted(stopped)


def test_only_the_newest_transient_save_stays_in_memory_and_older_ones_load_again(svc):
    """An RL loop publishes a sampler every step: the engine keeps only the newest in memory (each
    held adapter costs its weights and the sampler's copies); an older save still on disk is loaded
    again when asked for, with its own weights."""
    with svc.create_lora_training_client("tiny-llama", rank=4, seed=6) as tc:
        tok = tc.get_tokenizer()
        prompt, target = tok.encode("Question: what is 3 + 4? Answer:"), tok.encode(" seven")
        samplers, first_answers = [], []
        for _ in range(3):
            train_steps(tc, SENTENCES, 2e-2)
            samplers.append(tc.save_weights_and_get_sampling_client())
            first_answers.append(samplers[-1].compute_logprobs(prompt + target).result()[len(prompt) :])
        if hasattr(svc.transport, "engine"):
            host = svc.transport.engine.runtime.hosts[tc.base_model]
            held = [uri for uri in host.checkpoint_adapters if f"sess://{tc.name}/" in uri]
            assert held == [samplers[-1].model_path]
            assert len(host.spare_adapters) <= 1
            # a spare keeps its modules but no weights; a held sampler's weights are one buffer
            for spare in host.spare_adapters:
                assert all(p.untyped_storage().nbytes() <= 4 for p in host.adapter_params(spare).values())
            weights = host.adapter_params(host.checkpoint_adapters[held[0]]).values()
            assert len({p.untyped_storage().data_ptr() for p in weights}) == 1
        again = samplers[0].compute_logprobs(prompt + target).result()[len(prompt) :]
    assert first_answers[0] != first_answers[-1]  # training moved the weights between saves
    assert max(abs(a - b) for a, b in zip(again, first_answers[0])) < 1e-6


def test_a_transient_save_in_use_when_its_session_stops_finishes_its_request(svc):
    """The stop deletes the session's transient saves; a request sampling from one finishes from
    memory, and newer saves never release it while it runs."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=4)
    tok = tc.get_tokenizer()
    prompt = tok.encode("Once upon a time")
    first = tc.save_weights_and_get_sampling_client()
    running = first.sample(
        prompt, num_samples=8, sampling_params=SamplingParams(max_tokens=400, temperature=1.0, seed=1)
    )
    for _ in range(4):
        tc.save_weights_and_get_sampling_client()
    still = [c["path"] for c in svc.list_checkpoints(tc.name)]
    tc.stop()
    result = running.result()
    after = [c["path"] for c in svc.list_checkpoints(tc.name)]
    assert first.model_path in still and len(still) == 5
    assert len(result.sequences) == 8 and all(s.tokens for s in result.sequences)
    assert [p for p in after if "/sampler/" in p] == []


def test_a_deleted_sessions_name_can_be_used_again_from_sequence_number_one(svc):
    """The new session's client numbers its ops from 1; the engine once kept the old session's
    count and refused them ("sequence number 1 ... was already used")."""
    losses = []
    for _ in range(2):
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=5, training_session_name="reused")
        data = _train(tc, steps=2)
        losses.append(tc.forward(data, "cross_entropy").result().metrics["loss:sum"])
        svc.delete_session(tc.name, stop_if_active=True)
    assert losses[0] == losses[1]  # the same seed from scratch: nothing of the first one is left


def test_deleting_a_session_deletes_its_checkpoint_files(svc, sess_home):
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=5)
    _train(tc, steps=1)
    kept = tc.save_weights_for_sampler(name="w").result().path
    tc.save_state().result()
    sampler = tc.save_weights_and_get_sampling_client()
    sampler.sample([1, 2, 3], sampling_params=SamplingParams(max_tokens=2)).result()
    assert len(svc.list_checkpoints(tc.name)) == 3
    svc.delete_session(tc.name, stop_if_active=True)
    assert not (sess_home / "checkpoints" / tc.name).exists()
    with pytest.raises(NotFound):
        svc.list_checkpoints(tc.name)
    with pytest.raises(NotFound):
        sampler.sample([1, 2], sampling_params=SamplingParams(max_tokens=1)).result()
    with pytest.raises(NotFound):
        svc.create_sampling_client(model_path=kept)


def test_a_stop_whose_save_fails_keeps_the_session_live_and_says_so(sess_home, monkeypatch):
    """A full disk at the save before a stop: the stop is refused (507) and nothing is lost; the
    session trains on and stops once its state can be saved."""
    from sess.engine import ServiceClient, SessError
    from sess.engine.runtime.ops import checkpoint_ops

    save_state = checkpoint_ops.save_state

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with ServiceClient("inproc", home=sess_home) as svc:
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=6)
        _train(tc, steps=1)
        monkeypatch.setattr(checkpoint_ops, "save_state", disk_full)
        with pytest.raises(SessError, match="was not stopped") as refused:
            tc.stop()
        assert refused.value.status == 507
        _train(tc, steps=1)  # still live, its state in memory
        monkeypatch.setattr(checkpoint_ops, "save_state", save_state)
        tc.stop()
        saved = [c["path"] for c in svc.list_checkpoints(tc.name)]
    assert any("/stop-step000002-" in path for path in saved), saved


def test_a_stop_runs_after_the_ops_its_client_sent_before_it(svc):
    """Steps whose futures nobody read are the session's training: a stop (or a ``with`` block's
    end) saves their state, and none of them fails for a session that stopped under it."""
    tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=7)
    data = [ce_datum(tc.get_tokenizer().encode(s)) for s in SENTENCES]
    with tc:
        futures = []
        for _ in range(3):
            futures += [tc.forward_backward(data), tc.optim_step(AdamParams(learning_rate=1e-2))]
    assert [f.result().metrics["step"] for f in futures[1::2]] == [1, 2, 3]
    saved = [c["path"] for c in svc.list_checkpoints(tc.name)]
    assert [path.rsplit("/", 1)[1] for path in saved] == ["stop-step000003-001"]
