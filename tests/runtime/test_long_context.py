"""Long sequences: every loss computed through the chunked output layer equals the unchunked one,
logits never held beyond a chunk however long the sequence, the default memory ceiling lets a datum
too long for the planned micro-batches train checkpointed, and each model's context window is
stated (catalog, Tinker's capabilities) and enforced with a refusal naming the prompt's length.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sess.engine import AdamParams, Datum, InvalidRequest, ModelInput, SamplingParams
from sess.engine.protocol.loss_registry import LOSSES
from sess.engine.runtime import output_layer
from sess.engine.runtime.memory import training_budget
from sess.engine.runtime.models.catalog import CATALOG, context_window

from helpers import budget, clear_grads, engine_grads, max_diff, reference_logprobs, reference_model


@pytest.fixture()
def tc(svc):
    client = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=3)
    yield client
    client.stop()


def _data(vocab: int, lengths: list[int], seed: int) -> list[Datum]:
    """Datums with every input a registry loss reads (cross-entropy's and the policy losses')."""
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        tokens = rng.integers(3, vocab - 1, n + 1)
        inputs = {
            "target_tokens": tokens[1:],
            "weights": rng.uniform(0.5, 1.0, n).astype(np.float32),
            "logprobs": rng.uniform(-6, -4, n).astype(np.float32),
            "advantages": rng.choice([-1.0, 0.5, 1.0], n).astype(np.float32),
        }
        data.append(Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs))
    return data


def _chunk_rows(monkeypatch) -> list[int]:
    """The rows of each chunk of logits the output layer computes from now on, in order."""
    seen: list[int] = []
    real = output_layer.logits_of

    def recorded(head, hidden, cap):
        seen.append(hidden.shape[0])
        return real(head, hidden, cap)

    monkeypatch.setattr(output_layer, "logits_of", recorded)
    return seen


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_every_registry_loss_chunked_equals_unchunked(tc, runtime, monkeypatch, loss_fn):
    """Output-layer chunks of 5 rows in micro-batches of about two datums give the loss, logprobs
    and gradients of one unchunked pass (a budget no batch comes near), to 1e-5."""
    vocab = runtime.hosts["tiny-llama"].vocab_size
    tc.forward_backward(_data(vocab, [9], 0), "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()  # LoRA B off zero: every weight has a gradient
    data = _data(vocab, [37, 21, 30, 12], 1)
    answers = []
    for chunk_logits, value in [(None, 1 << 40), (5 * vocab, 4 << 20)]:
        monkeypatch.setattr(output_layer, "CHUNK_LOGITS", chunk_logits)
        monkeypatch.setattr(output_layer, "MIN_CHUNK_ROWS", 1 if chunk_logits else 64)
        clear_grads(runtime, tc.name)
        with budget(runtime, value):
            out = tc.forward_backward(data, loss_fn).result()
            logprobs = tc.forward(data, loss_fn).result()
        answers.append((out, logprobs, engine_grads(runtime, tc.name)))
    (whole, whole_fwd, whole_grads), (chunked, chunked_fwd, chunked_grads) = answers
    total = whole.metrics["loss:sum"]
    assert abs(chunked.metrics["loss:sum"] - total) <= 1e-5 * max(1.0, abs(total))
    assert max_diff(chunked_grads, whole_grads) < 1e-5
    model = reference_model(runtime, tc.name)
    for d, a, b, c in zip(data, whole.loss_fn_outputs, chunked.loss_fn_outputs, chunked_fwd.loss_fn_outputs):
        plain = reference_logprobs(model, d).detach()  # torch's log_softmax over the whole logits
        for got in (a, b, c):
            assert (got["logprobs"].to_torch() - plain).abs().max() < 1e-5
    assert abs(chunked_fwd.metrics["loss:sum"] - whole_fwd.metrics["loss:sum"]) <= 1e-5 * max(1.0, abs(total))
    clear_grads(runtime, tc.name)


def test_a_custom_loss_gets_the_same_logprobs_and_gradients_chunked(tc, runtime, monkeypatch):
    """``forward_backward_custom``: the logprobs a client's loss sees and the gradients its loss
    sends back through the output layer are those of one unchunked pass, to 1e-5."""
    vocab = runtime.hosts["tiny-llama"].vocab_size
    tc.forward_backward(_data(vocab, [9], 0), "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    data = _data(vocab, [37, 21, 30], 5)

    def pairwise(datums, logprobs):  # a DPO-like margin between sequences: not a per-token loss
        seq = torch.stack(
            [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(datums, logprobs)]
        )
        seen.append([lp.detach().clone() for lp in logprobs])
        return -torch.nn.functional.logsigmoid(0.1 * (seq[0] - seq[1]) + 0.05 * seq[2]), {}

    answers = []
    for chunk_logits, value in [(None, 1 << 40), (5 * vocab, 4 << 20)]:
        monkeypatch.setattr(output_layer, "CHUNK_LOGITS", chunk_logits)
        monkeypatch.setattr(output_layer, "MIN_CHUNK_ROWS", 1 if chunk_logits else 64)
        clear_grads(runtime, tc.name)
        seen = []
        with budget(runtime, value):
            out = tc.forward_backward_custom(data, pairwise).result()
        answers.append((out.metrics["loss:sum"], seen[0], engine_grads(runtime, tc.name)))
    (whole, whole_lp, whole_grads), (chunked, chunked_lp, chunked_grads) = answers
    assert abs(chunked - whole) <= 1e-5 * max(1.0, abs(whole))
    assert max(float((a - b).abs().max()) for a, b in zip(whole_lp, chunked_lp)) < 1e-5
    assert max_diff(chunked_grads, whole_grads) < 1e-5
    model = reference_model(runtime, tc.name)
    for d, got in zip(data, chunked_lp):
        assert (got - reference_logprobs(model, d).detach()).abs().max() < 1e-5
    clear_grads(runtime, tc.name)


@pytest.mark.slow  # a 4,000-token reference forward besides the engine's
def test_a_sequence_whose_logits_exceed_the_budget_trains_within_it(tc, runtime, monkeypatch):
    """One 4,000-token datum on tiny-llama whose whole logits (fp32 and their gradient) are more
    than the engine's memory budget leaves them trains under that budget (checkpointed: its
    activations take the rest): no output-layer chunk holds more than the logits' share, and the
    logprobs are torch's unchunked ones."""
    host = runtime.hosts["tiny-llama"]
    vocab, length = host.vocab_size, 4000
    cost = host.activation_cost(host.peft)
    value = int(1.2 * length * cost.checkpointed / (1 - output_layer.LOGITS_SHARE))
    assert length * vocab * output_layer.BYTES_PER_LOGIT > output_layer.chunk_bytes(value)
    seen = _chunk_rows(monkeypatch)
    data = _data(vocab, [length], 6)
    with budget(runtime, value):
        out = tc.forward_backward(data, "cross_entropy").result()
    assert max(seen) * vocab * output_layer.BYTES_PER_LOGIT <= output_layer.chunk_bytes(value)
    assert sum(seen) >= length and len(seen) > 1
    plain = reference_logprobs(reference_model(runtime, tc.name), data[0]).detach()
    assert (out.loss_fn_outputs[0]["logprobs"].to_torch() - plain).abs().max() < 1e-5
    clear_grads(runtime, tc.name)


def test_logprobs_of_a_sequence_whose_logits_exceed_the_budget_stay_within_its_chunks(monkeypatch):
    """2,000 positions over a 20,000-token vocabulary: 160 MB of fp32 logits; under a 64 MB budget
    no chunk holds more than its share (16 MB), and the logprobs and both gradients equal torch's
    unchunked ones."""
    torch.manual_seed(0)
    rows, vocab, width, value = 2000, 20000, 16, 64 << 20
    head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(rows, width, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,))
    grad = torch.randn(rows)
    seen = _chunk_rows(monkeypatch)
    pairs = output_layer.Pairs(hidden, torch.arange(rows), targets, [slice(0, rows)])
    got, hidden_grad = output_layer.logprobs(head, None, pairs, value, grad=grad)
    head_grad = head.weight.grad.clone()
    assert rows * vocab * 4 > value * 2  # the whole logits: more than twice the budget
    assert (
        max(seen) * vocab * output_layer.BYTES_PER_LOGIT <= output_layer.chunk_bytes(value)
        and sum(seen) == rows
    )
    head.weight.grad = None
    expected = head(hidden).log_softmax(-1)[torch.arange(rows), targets]
    expected.backward(grad)
    assert (got - expected.detach()).abs().max() < 1e-5
    assert (hidden_grad - hidden.grad).abs().max() < 1e-5
    assert (head_grad - head.weight.grad).abs().max() < 1e-5


def test_the_default_ceiling_trains_a_datum_the_planned_micro_batches_cannot_hold(tc, runtime, monkeypatch):
    """Without a budget given, micro-batches are planned in the default budget and a datum too long
    for it even checkpointed runs checkpointed within the machine-sized ceiling, to the same
    logprobs; a ceiling too small for it refuses it, naming the ceiling."""
    host = runtime.hosts["tiny-llama"]
    vocab = host.vocab_size
    cost = host.activation_cost(host.peft)
    data = _data(vocab, [60], 2)
    small = int(30 * cost.checkpointed / (1 - output_layer.LOGITS_SHARE))  # 30 positions checkpointed
    monkeypatch.setattr(runtime, "_memory_budget", None)  # the default, not a budget given
    monkeypatch.setattr(runtime, "_default_budget", small)
    monkeypatch.setattr(runtime, "_default_ceiling", small + int(200 * cost.checkpointed))
    out = tc.forward_backward(data, "cross_entropy").result()
    plain = reference_logprobs(reference_model(runtime, tc.name), data[0]).detach()
    assert (out.loss_fn_outputs[0]["logprobs"].to_torch() - plain).abs().max() < 1e-5
    monkeypatch.setattr(runtime, "_default_ceiling", small)
    with pytest.raises(InvalidRequest, match=r"data\[0\]: 60 tokens need about .* --memory-budget"):
        tc.forward_backward(data, "cross_entropy").result()
    clear_grads(runtime, tc.name)


def test_catalog_windows_are_the_loaded_models_configs(runtime, svc):
    for name in ("tiny-llama", "tiny-qwen3"):
        assert context_window(name) == CATALOG[name].max_context == runtime.host(name).max_context
    assert context_window("smollm2-135m") == 8192
    windows = svc.get_context_windows()  # the SDK's view: every served model, loaded or not
    assert windows["tiny-llama"] == 4096 and windows["smollm2-135m"] == 8192
    assert windows["tiny-qwen3-32k"] == context_window("tiny-qwen3-32k") == 32768


def test_a_request_over_the_window_is_refused_naming_the_prompt_length(svc, tc):
    """tiny-llama's window is 4,096 tokens: a longer datum or prompt is refused as too long; a
    prompt that fits but not with max_tokens is refused naming both; the session carries on."""
    assert svc.get_context_windows()["tiny-llama"] == 4096  # over each transport
    vocab = len(tc.get_tokenizer())
    over = _data(vocab, [4097], 3)
    with pytest.raises(InvalidRequest, match=r"data\[0\]: the datum is too long: 4097 tokens.* 4096"):
        tc.forward_backward(over, "cross_entropy").result()
    sc = tc.create_sampling_client()
    long_prompt = ModelInput.from_ints([5] * 4097)
    with pytest.raises(InvalidRequest, match=r"prompt: the prompt is too long: 4097 tokens.* 4096"):
        sc.sample(long_prompt, sampling_params=SamplingParams(max_tokens=1)).result()
    with pytest.raises(InvalidRequest, match=r"prompt is too long: 4097 tokens"):
        sc.compute_logprobs(long_prompt).result()
    fits = ModelInput.from_ints([5] * 4000)
    with pytest.raises(InvalidRequest, match=r"a prompt of 4000 tokens plus max_tokens 200 is 4200 tokens"):
        sc.sample(fits, sampling_params=SamplingParams(max_tokens=200)).result()
    out = tc.forward_backward(_data(vocab, [12], 4), "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_the_default_ceiling_is_sized_from_the_machine_and_the_planning_budget_is_unchanged(monkeypatch):
    """The default budget (micro-batch planning, so the default run's split) stays 384 MB on CPU;
    the ceiling is a quarter of the memory available: on a 24 GiB machine with ~20 GiB available,
    room for smollm2's whole window checkpointed (8,191 tokens at 109 KB, the engine's measured
    price), which 384 MB refused."""
    assert training_budget.default_budget("cpu") == training_budget.CPU_BUDGET == 384 << 20
    monkeypatch.setattr(training_budget, "available_memory", lambda: 20 << 30)
    ceiling = training_budget.default_ceiling("cpu")
    assert ceiling == 5 << 30
    needed = 8191 * 109 * 1024
    assert needed > output_layer.activation_budget(training_budget.CPU_BUDGET)
    assert needed < ceiling - output_layer.chunk_bytes(training_budget.CPU_BUDGET)
    monkeypatch.setattr(training_budget, "available_memory", lambda: None)  # no /proc: the budget
    assert training_budget.default_ceiling("cpu") == training_budget.CPU_BUDGET
