"""The memory budget of training: chunked output layer, micro-batches, activation checkpointing.

Losses, logprobs and gradients computed in chunks, in small micro-batches and with activation
checkpointing equal plain torch's unchunked ones; no [tokens x vocabulary] logits are ever held;
checkpointing turns on only when a micro-batch cannot fit otherwise; a datum too long even then is
refused before anything runs, and the session carries on.
"""

from __future__ import annotations

import gc
import re

import numpy as np
import pytest
import torch

from sess.engine import AdamParams, Datum, ModelInput
from sess.engine.runtime import output_layer, recompute
from sess.engine.runtime.memory import malloc_tuning as memory
from sess.engine.runtime.memory import training_budget as memory_budget
from sess.engine.runtime.ops import training_ops

from helpers import (
    budget,
    clear_grads,
    engine_grads,
    max_diff,
    reference_grads,
    reference_logprobs,
    reference_model,
)


@pytest.fixture()
def tc(svc):
    client = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=3)
    yield client
    client.stop()


def _batch(tok, rng, lengths, shared_prompt=0):
    """Datums of the given lengths with ppo inputs; the first ``shared_prompt`` tokens shared."""
    prompt = list(rng.integers(3, len(tok) - 1, shared_prompt))
    data = []
    for n in lengths:
        tokens = prompt + list(rng.integers(3, len(tok) - 1, n + 1 - shared_prompt))
        data.append(
            Datum(
                ModelInput.from_ints(tokens[:-1]),
                {
                    "target_tokens": np.array(tokens[1:]),
                    "weights": np.ones(n, np.float32),
                    "logprobs": rng.uniform(-6, -4, n).astype(np.float32),
                    "advantages": rng.choice([-1.0, 0.0, 1.0], n).astype(np.float32),
                },
            )
        )
    return data


def _logits_shapes(monkeypatch) -> list[tuple[int, int]]:
    """Record the shape of every chunk's logits the output layer computes (a list, filled as it goes)."""
    real, seen = output_layer.logits_of, []

    def recorded(head, hidden, cap):
        logits = real(head, hidden, cap)
        seen.append(tuple(logits.shape))
        return logits

    monkeypatch.setattr(output_layer, "logits_of", recorded)
    return seen


def _reference(model, data, loss_fn):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for d in data:
        lp = reference_logprobs(model, d)
        inputs = {k: v.to_torch() for k, v in d.loss_fn_inputs.items()}
        if loss_fn == "cross_entropy":
            total = total + -(lp * inputs["weights"]).sum()
        else:
            ratio = torch.exp(lp - inputs["logprobs"])
            adv = inputs["advantages"]
            total = total + -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
    total.backward()
    return float(total.detach()), reference_grads(model)


class Counter:
    """Counts calls of torch.utils.checkpoint.checkpoint made through the memory budget module."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = memory_budget.checkpoint

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(memory_budget, "checkpoint", counted)


def _budget_for(activations: float) -> int:
    """A memory budget that leaves ``activations`` bytes to a micro-batch's activations."""
    return int(activations / (1 - output_layer.LOGITS_SHARE)) + 1


def _prepared(tc, runtime):
    tok = tc.get_tokenizer()
    warm = _batch(tok, np.random.default_rng(9), [12, 9])
    tc.forward_backward(warm, "cross_entropy")
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()  # LoRA B off zero: every weight has a gradient
    return tok, reference_model(runtime, tc.name), runtime.hosts["tiny-llama"]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
@pytest.mark.parametrize("mode", ["fits", "micro-batches", "checkpointed"])
def test_chunked_and_checkpointed_training_equals_unchunked_torch(tc, runtime, monkeypatch, loss_fn, mode):
    tok, model, host = _prepared(tc, runtime)
    cost = host.activation_cost(host.peft)
    rng = np.random.default_rng(4)
    data = _batch(tok, rng, [40, 31, 24, 40, 17]) + _batch(tok, rng, [30, 28, 33], shared_prompt=20)
    # output layer chunks of 7 rows: every micro-batch's logprobs cross chunk edges
    monkeypatch.setattr(output_layer, "CHUNK_LOGITS", 7 * host.vocab_size)
    monkeypatch.setattr(output_layer, "MIN_CHUNK_ROWS", 1)
    counter = Counter(monkeypatch)
    trims = []
    monkeypatch.setattr(training_ops, "trim", lambda: trims.append(1))
    monkeypatch.setattr(training_ops, "resident_bytes", lambda: 1 << 30)  # the op's memory never grows
    value = {
        "fits": 1 << 40,
        "micro-batches": _budget_for(60 * cost.plain),  # two datums at most per micro-batch
        "checkpointed": _budget_for(20 * (cost.plain + cost.checkpointed)),  # 40-token datums: checkpointed
    }[mode]
    room = output_layer.activation_budget(value)
    assert mode != "checkpointed" or 40 * cost.checkpointed < room < 40 * cost.plain
    clear_grads(runtime, tc.name)
    with budget(runtime, value):
        out = tc.forward_backward(data, loss_fn).result()
    got = engine_grads(runtime, tc.name)
    total, expected = _reference(model, data, loss_fn)
    assert abs(out.metrics["loss:sum"] - total) < 1e-5 * max(1.0, abs(total))
    assert max_diff(got, expected) < 1e-5
    for d, o in zip(data, out.loss_fn_outputs):
        assert (o["logprobs"].to_torch() - reference_logprobs(model, d).detach()).abs().max() < 1e-5
    assert (counter.calls > 0) == (mode == "checkpointed"), counter.calls
    # on glibc, a checkpointed micro-batch trims the heap before its forward, output layer and
    # backward pass (one torch checkpoint per layer and micro-batch); one that fits does only where
    # the op's memory has grown past its budget (below), which it does not here
    per_micro_batch = 3 if memory.allocator() == "glibc" else 0
    assert len(trims) == per_micro_batch * counter.calls // host.layers, (len(trims), counter.calls)
    clear_grads(runtime, tc.name)


@pytest.mark.skipif(memory.allocator() != "glibc", reason="the trims are for glibc's heap")
def test_an_op_grown_past_its_budget_trims_before_each_next_phase_and_one_within_it_never(
    tc, runtime, monkeypatch
):
    """On glibc, a training op whose resident memory has grown by more than the memory budget since
    it began hands the heap's free pages back before each next phase of its micro-batches (forward,
    output layer, backward pass); an op that stays within its budget never trims. The resident
    memory is the test's, to make the growth exact."""
    tok, model, host = _prepared(tc, runtime)
    cost = host.activation_cost(host.peft)
    data = _batch(tok, np.random.default_rng(4), [40, 31, 24, 40, 17])
    value = _budget_for(60 * cost.plain)  # two datums at most per micro-batch
    trims: list[int] = []
    readings: list[int] = []
    monkeypatch.setattr(training_ops, "trim", lambda: trims.append(len(readings) - 1))

    def growing() -> int:  # half the budget more at each reading: over it from the third phase on
        readings.append(len(readings) * (value // 2))
        return readings[-1]

    monkeypatch.setattr(training_ops, "resident_bytes", growing)
    clear_grads(runtime, tc.name)
    with budget(runtime, value):
        grown = tc.forward_backward(data, "ppo").result()
    phases = len(readings) - 1  # the first reading is the op's start
    assert phases >= 6 and phases % 3 == 0, phases  # several micro-batches, three phases each
    assert trims == list(range(3, phases + 1)), (trims, phases)

    trims.clear()
    monkeypatch.setattr(training_ops, "resident_bytes", lambda: 1 << 30)
    clear_grads(runtime, tc.name)
    with budget(runtime, value):
        flat = tc.forward_backward(data, "ppo").result()
    assert trims == []
    assert grown.metrics["loss:sum"] == flat.metrics["loss:sum"]  # a trim changes no bit
    for a, b in zip(grown.loss_fn_outputs, flat.loss_fn_outputs):
        assert torch.equal(a["logprobs"].to_torch(), b["logprobs"].to_torch())
    clear_grads(runtime, tc.name)


def test_a_loss_outside_the_per_token_set_takes_two_passes_and_the_same_gradients(tc, runtime, monkeypatch):
    tok, model, host = _prepared(tc, runtime)
    data = _batch(tok, np.random.default_rng(5), [30, 22, 26])
    monkeypatch.setattr(training_ops, "PER_TOKEN_LOSSES", frozenset())
    monkeypatch.setattr(output_layer, "CHUNK_LOGITS", 11 * host.vocab_size)
    monkeypatch.setattr(output_layer, "MIN_CHUNK_ROWS", 1)
    seen = _logits_shapes(monkeypatch)
    clear_grads(runtime, tc.name)
    out = tc.forward_backward(data, "ppo").result()
    calls = [rows for rows, _ in seen]
    got = engine_grads(runtime, tc.name)
    total, expected = _reference(model, data, "ppo")
    assert abs(out.metrics["loss:sum"] - total) < 1e-5 * max(1.0, abs(total))
    assert max_diff(got, expected) < 1e-5
    positions = sum(d.model_input.length for d in data)
    assert sum(calls) == 2 * positions  # logprobs, then the output layer again with the loss's gradient
    clear_grads(runtime, tc.name)


def test_no_output_layer_call_sees_more_than_a_chunk_of_positions(tc, runtime, monkeypatch):
    """A batch's whole [tokens x vocabulary] logits never exist: the output layer runs on chunks
    (of 128 rows here: the tiny model's vocabulary is small, and the chunk is sized in logits)."""
    tok, _, host = _prepared(tc, runtime)
    monkeypatch.setattr(output_layer, "CHUNK_LOGITS", 128 * host.vocab_size)
    rows = output_layer.chunk_rows(host.vocab_size, runtime.memory_budget)
    data = _batch(tok, np.random.default_rng(6), [300] * 6)
    seen = _logits_shapes(monkeypatch)
    tc.forward_backward(data, "cross_entropy").result()
    tc.forward(data, "cross_entropy").result()
    clear_grads(runtime, tc.name)
    assert sum(shape[0] for shape in seen) == 2 * 6 * 300
    assert max(shape[0] for shape in seen) <= rows < 6 * 300


def test_output_layer_chunks_are_sized_by_the_memory_budget(tc, runtime, monkeypatch):
    """A micro-batch whose logits fit in the budget's share goes through the output layer at once;
    under a budget too small for that, in chunks of what the share holds."""
    tok, _, host = _prepared(tc, runtime)
    data = _batch(tok, np.random.default_rng(7), [100] * 3)
    share = output_layer.LOGITS_SHARE / output_layer.BYTES_PER_LOGIT
    seen = _logits_shapes(monkeypatch)
    for value, most in [(1 << 30, 300), (int(80 * host.vocab_size / share) + 24, 80)]:
        seen.clear()
        with budget(runtime, value):
            tc.forward_backward(data, "cross_entropy").result()
        clear_grads(runtime, tc.name)
        rows = [r for r, _ in seen]
        assert sum(rows) == 300 and max(rows) == most, (value, rows)


def test_a_chunk_of_the_output_layer_makes_its_logits_and_one_lora_tensor_with_the_same_bits(tc, runtime):
    """The output layer with its LoRA, log-softmax, the loss's gradient and the backward pass: of
    every tensor the ops make, [rows x vocabulary] are only the logits, the LoRA term added into
    them, and the gradient scaled for the LoRA's B (the logits become their own gradient; the
    log-softmax goes a few rows at a time). Logprobs and gradients equal, to the bit, those of
    peft's module, ``log_softmax`` and autograd over the whole chunk, rows shared by several
    pairs (an RL group's prompt) included."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    _, _, host = _prepared(tc, runtime)
    with host.activate(runtime.sessions[tc.name].adapter) as model:
        _, head, cap = output_layer.decoder_and_head(model)
        rows, vocab = 40, host.vocab_size
        gen = torch.Generator().manual_seed(4)
        hidden = torch.randn(rows, head.in_features, generator=gen, requires_grad=True)
        pair_rows = torch.cat([torch.arange(rows), torch.randint(0, rows, (20,), generator=gen)])
        pairs = output_layer.Pairs(
            hidden, pair_rows, torch.randint(0, vocab, pair_rows.shape, generator=gen), [slice(0, 60)]
        )
        weights = torch.rand(pair_rows.shape, generator=gen)
        made = []

        class Allocations(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                given = {
                    t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)
                }
                made.extend(
                    str(func)
                    for t in tree_leaves(out)
                    if torch.is_tensor(t)
                    and t.numel() >= rows * vocab
                    and t.untyped_storage().data_ptr() not in given
                )
                return out

        with Allocations():
            got, hidden_grad = output_layer.logprobs(
                head, cap, pairs, 1 << 30, loss_grad=lambda lp, pick: -weights[pick]
            )
        assert made == ["aten.mm.default", "aten.mm.default", "aten.mul.Tensor"], made
        lora = {n: p.grad.clone() for n, p in head.named_parameters() if p.requires_grad}
        assert lora and all(g.abs().max() > 0 for g in lora.values())
        for p in head.parameters():
            p.grad = None
        x = hidden.detach().requires_grad_(True)
        expected = head(x).float().log_softmax(-1)[pairs.rows, pairs.targets]
        (-(weights * expected).sum()).backward()
        assert torch.equal(got, expected.detach())
        assert torch.equal(hidden_grad, x.grad)
        assert all(
            torch.equal(g, p.grad) for n, p in head.named_parameters() if (g := lora.get(n)) is not None
        )
        for p in head.parameters():
            p.grad = None


def test_the_activation_probe_measures_checkpointing_as_cheaper(tc, runtime):
    _, _, host = _prepared(tc, runtime)
    cost = host.activation_cost(host.peft)
    hidden = host.model.config.hidden_size
    # every layer keeps many hidden-sized tensors per position; checkpointed, its input alone (plus
    # one layer's activations while that layer is recomputed)
    assert cost.layer > 8 * hidden * 4
    assert host.layers * hidden * 4 <= cost.checkpointed - cost.layer < cost.layer / 4
    # the recipes of recompute.py make a kept position cheaper than a running layer's all
    assert cost.plain < 0.8 * host.layers * cost.layer


def test_a_datum_too_long_even_with_checkpointing_is_refused_and_the_session_carries_on(tc, runtime):
    tok, _, host = _prepared(tc, runtime)
    cost = host.activation_cost(host.peft)
    data = _batch(tok, np.random.default_rng(7), [20, 200])
    before = {k: v.clone() for k, v in host.get_state(host.peft.active_adapter).items()}
    with budget(runtime, int(100 * cost.checkpointed)):
        with pytest.raises(
            Exception, match=r"data\[1\]: 200 tokens .* memory budget of .*--memory-budget"
        ) as err:
            tc.forward_backward(data, "cross_entropy").result()
        assert getattr(err.value, "status", 400) == 400
        # each figure in a unit that shows it (a budget of some hundred KB once read "0.00 GB")
        sizes = re.findall(r"(\d+(?:\.\d+)?) ([KMG]B)", str(err.value))
        assert len(sizes) == 4 and all(float(number) >= 1 for number, _ in sizes), str(err.value)
        assert all(p.grad is None for p in runtime.sessions[tc.name].params.values())  # nothing ran
        # the session carries on: a batch that fits trains
        assert tc.forward_backward(data[:1], "cross_entropy").result().metrics["loss:sum"] > 0
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    after = host.get_state(runtime.sessions[tc.name].adapter)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_the_probe_s_price_per_position_holds_for_a_long_row(tc, runtime):
    """The probe prices a position from 128 tokens; training's attention (SDPA) saves nothing that
    grows with T^2 (eager attention's [heads x T x T] probabilities would), so a row 4x longer than
    the probe saves about 4x as much (on tiny-llama 6 % less), as autograd counts it (measured on smollm2 too: 1194 KB a position
    at 128, 512 and 1024 tokens; benchmarks/README.md)."""
    _, _, host = _prepared(tc, runtime)
    model = host.peft
    cost = host.activation_cost(model)
    decoder, _, _ = output_layer.decoder_and_head(model)
    length = 4 * memory_budget.PROBE_TOKENS
    ids = torch.randint(3, host.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    device = torch.device("cpu")
    with torch.enable_grad():
        plain = memory_budget.saved_bytes(
            lambda: decoder(input_ids=ids, use_cache=False), model, device, recompute=True
        )
        with memory_budget.checkpointing(model, True):
            stored = memory_budget.saved_bytes(lambda: decoder(input_ids=ids, use_cache=False), model, device)
    # never under-priced; over-priced a little (the probe's fixed part, spread over fewer positions)
    assert 0.85 < plain / (length * cost.plain) <= 1.0
    assert stored <= length * cost.checkpointed


def test_shared_prefix_micro_batches_keep_their_saved_activations_within_the_budget(tc, runtime, monkeypatch):
    """An RL group's members each attend to a copy of the prompt's keys and values, which autograd
    keeps: the plan prices those copies (``ActivationCost.repeated``), so a micro-batch of groups
    saves no more than the budget allows (on smollm2 it saved 689 MiB on a 512 MiB budget before)."""
    tok, _, host = _prepared(tc, runtime)
    cost = host.activation_cost(host.peft)
    assert cost.repeated > 0
    # long prompts, short completions (as in RL): the copies are a good part of each micro-batch
    data = [
        d for g in range(6) for d in _batch(tok, np.random.default_rng(20 + g), [72] * 8, shared_prompt=64)
    ]
    saved, real = [], training_ops.shared_prefix_pairs

    def measured(decoder, groups):
        out = []
        saved.append(
            memory_budget.saved_bytes(
                lambda: out.append(real(decoder, groups)),
                host.peft,
                torch.device("cpu"),
                backward=True,
                recompute=True,  # as the training op saves them
            )
        )
        return out[0]

    monkeypatch.setattr(training_ops, "shared_prefix_pairs", measured)
    limit = int(300 * cost.plain)  # six groups of 8 x 72 tokens (64 shared) need several micro-batches
    with budget(runtime, limit):
        tc.forward_backward(data, "ppo").result()
    clear_grads(runtime, tc.name)
    assert len(saved) > 1
    room = output_layer.activation_budget(limit)  # the rest is the output layer's chunk
    assert max(saved) <= room * 1.05, [s / room for s in saved]  # the probe's price, to a few %


def _live_cpu_tensor_bytes() -> int:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, and some objects warn on any
        # attribute read (torch.distributed.reduce_op, deprecated)
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
            except (NotImplementedError, RuntimeError):  # an opaque tensor (the sampler's oneDNN copies)
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_the_probe_keeps_nothing_once_it_has_measured(tc, runtime):
    """The probe's graphs are never run backward; they must go when it returns (they once stayed
    for the engine's life, 348 MiB on smollm2, held by a reference cycle through C++)."""
    _, _, host = _prepared(tc, runtime)
    model = host.peft
    decoder, _, _ = output_layer.decoder_and_head(model)
    before = _live_cpu_tensor_bytes()
    cost = memory_budget.measure_cost(model, decoder, host.vocab_size)
    grown = _live_cpu_tensor_bytes() - before
    assert grown < 0.05 * cost.plain * memory_budget.PROBE_TOKENS, grown


def test_recipes_keep_fewer_activations_and_change_no_bit(tc, runtime):
    """The norms' outputs, the MLP's activation and its product are kept as recipes and made again
    in the backward pass (recompute.py): fewer bytes saved, the same hidden states and gradients to
    the bit."""
    _, _, host = _prepared(tc, runtime)
    model = host.peft
    decoder, _, _ = output_layer.decoder_and_head(model)
    ids = torch.randint(3, host.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))

    def run(on: bool):
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            with recompute.recomputing(on):
                hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            ((hidden**2).sum() + (hidden[:, 1:] * hidden[:, :-1]).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return hidden.detach(), grads

    (plain_hidden, plain_grads), (hidden, grads) = run(False), run(True)
    assert torch.equal(hidden, plain_hidden)
    assert grads.keys() == plain_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)

    def saved(on: bool) -> int:
        with torch.enable_grad():
            return memory_budget.saved_bytes(
                lambda: decoder(input_ids=ids, use_cache=False), model, torch.device("cpu"), recompute=on
            )

    # tiny-llama's layer (hidden 64, MLP 128): each norm output 64 of ~750 values, act and product 128 each
    assert saved(True) < 0.75 * saved(False)


def test_a_recipe_stands_in_only_for_its_own_unchanged_output():
    """A saved view of a recorded output unpacks as the recipe's value (made once); an output changed
    in place, or one gone whose memory another tensor now holds, is saved as it is."""
    recorded = recompute.Recorded()
    x = torch.randn(4, 6, requires_grad=True)
    made = []

    def twice():
        made.append(1)
        return x * 2

    y = x * 2
    recorded.record(y, recompute.Recipe(twice))
    view = y[1:].view(3, 2, 3)
    saved = recorded.pack(view)
    assert not isinstance(saved, torch.Tensor)
    assert torch.equal(recompute.unpack(saved), view) and torch.equal(recompute.unpack(saved), view)
    assert made == [1]  # once, however many nodes read it
    y.add_(1)
    assert recorded.pack(y) is y  # changed since it was recorded
    gone = x * 3
    recorded.record(gone, recompute.Recipe(lambda: x * 3))
    entry = recorded.outputs[gone.untyped_storage().data_ptr()]
    del gone
    other = torch.zeros(4, 6)  # as if the allocator gave the dead output's memory to another tensor
    recorded.outputs[other.untyped_storage().data_ptr()] = entry
    assert entry[0]() is None and recorded.pack(other) is other
