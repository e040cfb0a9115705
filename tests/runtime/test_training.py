"""Training ops: SFT learns, every built-in loss matches a plain-torch reference, custom losses, pipelining."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sess.engine import AdamParams, Datum, ModelInput

from helpers import (
    SENTENCES,
    ce_datum,
    clear_grads,
    engine_grads,
    max_diff,
    reference_grads,
    reference_logprobs,
    reference_model,
    train_steps,
)


def test_sft_loss_halves_within_30_steps(tc):
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(s)) for s in SENTENCES[:4]]
    losses = []
    for _ in range(30):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses


def _rl_batch(tok, model, rng):
    data = []
    for text in SENTENCES[:3]:
        d = ce_datum(tok.encode(text))
        lp = reference_logprobs(model, d).detach().numpy()
        n = d.model_input.length
        data.append(
            Datum(
                d.model_input,
                {
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    # sampler logprobs off by up to +-0.4 so some ratios leave every clip range
                    "logprobs": (lp + rng.uniform(-0.4, 0.4, n)).astype(np.float32),
                    "advantages": rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], n).astype(np.float32),
                },
            )
        )
    return data


def _reference_loss(
    name: str, config: dict, lp: torch.Tensor, inputs: dict[str, torch.Tensor]
) -> torch.Tensor:
    if name == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    adv, old = inputs["advantages"], inputs["logprobs"]
    ratio = torch.exp(lp - old)
    if name == "importance_sampling":
        return -(ratio * adv).sum()
    if name == "ppo":
        lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
    if name == "cispo":
        lo, hi = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv).sum()
    if name == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * adv - 0.5 * beta * (lp - old) ** 2).sum()
    raise AssertionError(name)


def _engine_and_reference(tc, runtime, model, data, name, config):
    """One engine forward_backward and the same loss in plain torch: (output, engine grads, loss, grads)."""
    clear_grads(runtime, tc.name)
    out = tc.forward_backward(data, name, loss_fn_config=config).result()
    got = engine_grads(runtime, tc.name)
    model.zero_grad(set_to_none=True)
    total = sum(
        _reference_loss(
            name,
            config or {},
            reference_logprobs(model, d),
            {k: v.to_torch() for k, v in d.loss_fn_inputs.items()},
        )
        for d in data
    )
    total.backward()
    return out, got, total, reference_grads(model)


LOSS_CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("cispo", None),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", None),
    ("dro", {"beta": 2.0}),
]


def test_builtin_losses_match_plain_torch(tc, runtime):
    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 1e-2)  # one step first so every adapter weight gets a gradient
    model = reference_model(runtime, tc.name)
    rng = np.random.default_rng(0)
    losses = {}
    for name, config in LOSS_CASES:
        data = (
            _rl_batch(tok, model, rng)
            if name != "cross_entropy"
            else [ce_datum(tok.encode(s)) for s in SENTENCES[:3]]
        )
        out, got, total, expected = _engine_and_reference(tc, runtime, model, data, name, config)
        assert abs(out.metrics["loss:sum"] - total.item()) < 1e-5, (name, config)
        assert max_diff(got, expected) < 1e-5, (name, config)
        for d, o in zip(data, out.loss_fn_outputs):
            assert len(o["logprobs"].tolist()) == d.model_input.length
        losses[(name, str(config))] = out.metrics["loss:sum"]
    clear_grads(runtime, tc.name)
    # loss_fn_config is honoured: other clip bounds / beta give another loss on the same kind of batch
    assert losses[("dro", "None")] != losses[("dro", str({"beta": 2.0}))]


def test_forward_backward_custom_dpo_matches_direct(tc, runtime):
    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 1e-2)
    pairs = [("Q: 2+2? A: 4", "Q: 2+2? A: 5"), ("The sky is blue.", "The sky is green.")]
    data = [ce_datum(tok.encode(t)) for pair in pairs for t in pair]  # chosen, rejected, chosen, rejected
    ref_lp = [-1.0, -1.5, -2.0, -0.5]
    beta = 0.1

    def dpo(datums, logprobs):
        seq = torch.stack([lp.sum() for lp in logprobs])
        margin = beta * ((seq[0::2] - torch.tensor(ref_lp[0::2])) - (seq[1::2] - torch.tensor(ref_lp[1::2])))
        loss = -torch.nn.functional.logsigmoid(margin).sum()
        return loss, {"margin": float(margin.mean().detach())}

    clear_grads(runtime, tc.name)
    out = tc.forward_backward_custom(data, dpo).result()
    got = engine_grads(runtime, tc.name)

    model = reference_model(runtime, tc.name)
    loss, _ = dpo(data, [reference_logprobs(model, d) for d in data])
    loss.backward()
    assert abs(out.metrics["loss:sum"] - loss.item()) < 1e-5
    assert "margin" in out.metrics
    assert max_diff(got, reference_grads(model)) < 1e-5
    clear_grads(runtime, tc.name)
    # the session's sequence numbers moved on by two and it keeps training
    assert tc.forward_backward(data[:1]).result().metrics["loss:sum"] > 0


def test_custom_loss_error_keeps_session_usable(tc):
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode("hello there"))]

    def broken(datums, logprobs):
        raise ValueError("user loss failed")

    with pytest.raises(ValueError, match="user loss failed"):
        tc.forward_backward_custom(data, broken).result()
    assert tc.forward_backward(data).result().metrics["loss:sum"] > 0


def _weights(svc, tc, tmp_path, tag):
    from safetensors.torch import load_file

    path = tc.save_weights_for_sampler(name=tag).result().path
    return load_file(str(svc.download_checkpoint(path, tmp_path / tag) / "adapter_model.safetensors"))


def test_pipelined_ops_equal_waited_ops(svc, tmp_path):
    tok = svc.get_tokenizer("tiny-llama")
    batches = [[ce_datum(tok.encode(s)) for s in SENTENCES[i : i + 2]] for i in (0, 2)]
    results = {}
    for mode in ("waited", "pipelined"):
        with svc.create_lora_training_client("tiny-llama", rank=4, seed=7) as tc:
            futures = []
            for batch in batches:
                fb = tc.forward_backward(batch)
                opt = tc.optim_step(AdamParams(learning_rate=5e-3))
                if mode == "waited":
                    fb.result(), opt.result()
                futures += [fb, opt]
            assert all(not isinstance(f.result(), Exception) for f in futures)
            results[mode] = _weights(svc, tc, tmp_path, mode)
    assert (
        max(float((results["waited"][k] - results["pipelined"][k]).abs().max()) for k in results["waited"])
        == 0.0
    )


def test_token_list_data_means_cross_entropy(tc):
    tok = tc.get_tokenizer()
    ids = tok.encode("Two plus three is five.")
    a = tc.forward([ids]).result().metrics["loss:sum"]
    b = tc.forward(ids).result().metrics["loss:sum"]
    c = tc.forward([ce_datum(ids)]).result().metrics["loss:sum"]
    assert a == b == c
    assert tc.forward([ModelInput.from_ints(ids)]).result().metrics["loss:sum"] == a


@pytest.mark.parametrize(
    "system, own, groups",
    [
        (20, 30, 2),  # a short common system line: each prompt keeps its own 50-token prefix
        (200, 3, 1),  # a long common system prompt, short questions: sharing it across prompts wins
    ],
)
def test_plan_groups_completions_where_sharing_saves_positions(system, own, groups):
    from sess.engine.runtime.batched_forward import plan

    rng = np.random.default_rng(0)
    head = list(rng.integers(10, 1000, system))
    data = []
    for prompt in range(2):
        question = [2000 + prompt] + list(rng.integers(10, 1000, own - 1))
        for _ in range(4):
            tokens = head + question + list(rng.integers(10, 1000, 12))
            data.append(Datum(ModelInput.from_ints(tokens), {"target_tokens": np.array(tokens)}))
    (batch,) = plan(data, 4096, share_prefixes=True)
    assert batch[0] == [] and len(batch[1]) == groups
    assert sorted(i for members, _ in batch[1] for i in members) == list(range(8))
    # every group shares at least what its members have in common up to their prompt
    assert all(shared >= (system + own if groups == 2 else system) for _, shared in batch[1])


def test_shared_root_is_the_common_start_of_enough_prompts():
    from sess.engine.runtime.batched_forward import MIN_ROOT_GROUPS, MIN_SHARED, shared_root

    start = list(range(100, 100 + MIN_SHARED + 4))
    prompts = [start + [1000 + i] * (i + 1) for i in range(MIN_ROOT_GROUPS)]
    assert shared_root(prompts) == len(start)
    assert shared_root(prompts[:-1]) == 0  # too few prompts to pay for a pass of its own
    assert shared_root([start[: MIN_SHARED - 1] + p[len(start) :] for p in prompts]) == 0  # too short
    # a prompt that is all common start still keeps its last token for its own pass
    assert shared_root([start] + prompts[1:]) == len(start) - 1


def test_completions_of_one_prompt_share_its_prefix_and_match_plain_torch(tc, runtime, monkeypatch):
    """RL batches (G completions of a prompt) run the prompt once, and the start all prompts share
    once too; numbers stay those of plain torch."""
    from sess.engine.runtime import batched_forward as forward
    from sess.engine.runtime.batched_forward import plan, shared_root

    monkeypatch.setattr(forward, "MIN_ROOT_GROUPS", 2)  # two prompts here; the engine waits for five

    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 1e-2)
    model = reference_model(runtime, tc.name)
    rng = np.random.default_rng(1)
    # both prompts begin with the same long system line, as chat templates make them
    system = "System: you are a careful assistant; answer briefly, show no working, end with a period.\n"
    prompts = [
        tok.encode(system + "Question: a farmer has twelve cows and buys thirty more; how many now? Answer:"),
        tok.encode(system + "Question: what is the capital city of France, and why is it famous? Answer:"),
    ]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert common >= 16  # long enough to share, so the plan must choose not to merge the prompts
    completions = [" 42 cows.", " Forty-two.", " He has 42 cows in all.", " 12 + 30 = 42", " Paris, for art."]
    data = []
    for prompt in prompts:
        for completion in completions:
            d = ce_datum(prompt + tok.encode(completion))
            n = d.model_input.length
            lp = reference_logprobs(model, d).detach().numpy()
            d.loss_fn_inputs["logprobs"] = d.loss_fn_inputs["weights"].__class__.from_numpy(
                (lp + rng.uniform(-0.3, 0.3, n)).astype(np.float32)
            )
            d.loss_fn_inputs["advantages"] = d.loss_fn_inputs["weights"].__class__.from_numpy(
                np.r_[
                    np.zeros(len(prompt) - 1), np.full(n - len(prompt) + 1, rng.choice([-1.0, 1.0]))
                ].astype(np.float32)
            )
            data.append(d)
    batches = plan(data, 4096, share_prefixes=True)
    assert [sorted(len(idx) for idx, _ in groups) for _, groups in batches] == [[5, 5]]  # both in one pass
    # each group shares its whole prompt, not just the system line both prompts begin with
    shared = sorted(shared for _, groups in batches for _, shared in groups)
    assert all(s >= len(p) for s, p in zip(shared, sorted(prompts, key=len))), shared
    # and the system line both prompts begin with runs once for the two of them
    assert shared_root([data[idx[0]].model_input.to_ints()[:s] for idx, s in batches[0][1]]) == common
    for name, config in [("ppo", None), ("cross_entropy", None), ("dro", {"beta": 1.0})]:
        out, got, total, expected = _engine_and_reference(tc, runtime, model, data, name, config)
        scale = max(1.0, max(float(g.abs().max()) for g in expected.values()))  # fp32 sums of ~250 tokens
        assert abs(out.metrics["loss:sum"] - total.item()) < 1e-5 * max(1.0, abs(total.item())), name
        assert max_diff(got, expected) < 1e-5 * scale, name
        for d, o in zip(data, out.loss_fn_outputs):
            assert (o["logprobs"].to_torch() - reference_logprobs(model, d).detach()).abs().max() < 1e-5
    clear_grads(runtime, tc.name)


def test_the_same_rl_batch_gives_the_same_gradients_to_the_bit(tc, runtime):
    """Whole runs repeat exactly on one machine only if a batch's gradients do. A GRPO-shaped batch
    (7 prompts x 8 completions, each prompt's KV repeated for its completions) used to give
    gradients differing in the last bits from one call to the next: the repeated rows' gradients were
    added up by several CPU threads in whatever order they came (batched_forward.repeat_rows)."""
    tok = tc.get_tokenizer()
    rng = np.random.default_rng(3)
    data = []
    for p in range(7):
        prompt = tok.encode(
            f"<|im_start|>user\nWhat is {7 * p + 3} plus {11 * p + 5}? Reply briefly.<|im_end|>\n"
        )
        for _ in range(8):
            completion = [int(t) for t in rng.integers(5, len(tok) - 1, int(rng.integers(6, 16)))]
            d = ce_datum(prompt + completion)
            n = d.model_input.length
            tensor = d.loss_fn_inputs["weights"].__class__.from_numpy
            d.loss_fn_inputs["logprobs"] = tensor(rng.uniform(-4, -1, n).astype(np.float32))
            d.loss_fn_inputs["advantages"] = tensor(
                np.r_[np.zeros(len(prompt) - 1), np.full(n - len(prompt) + 1, rng.normal())].astype(
                    np.float32
                )
            )
            data.append(d)
    train_steps(tc, SENTENCES, 1e-2)  # LoRA B off zero: every weight gets gradients
    runs = []
    for _ in range(6):
        clear_grads(runtime, tc.name)
        tc.forward_backward(data, "ppo").result()
        runs.append(engine_grads(runtime, tc.name))
    clear_grads(runtime, tc.name)
    for grads in runs[1:]:
        differing = [k for k in runs[0] if not torch.equal(grads[k], runs[0][k])]
        assert not differing, differing[:3]


def test_flat_gradients_and_moments_step_as_plain_adamw_and_leave_unreached_parameters_alone():
    """One rank keeps an adapter's gradients and AdamW moments in three flat buffers (Session.flat):
    the steps equal a plain AdamW's to the bit, including a parameter no gradient reaches (no grad,
    no weight decay), and nothing is allocated per parameter at a backward pass."""
    from sess.engine.runtime.session import FlatState

    torch.manual_seed(0)
    shapes = [(8, 5), (5,), (3, 5), (4, 4)]  # the last one no loss reaches
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    plain = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    flat = FlatState(ours)
    opt = torch.optim.AdamW(ours, lr=0.1, weight_decay=0.3, foreach=False)
    flat.init_adamw(opt)
    plain_opt = torch.optim.AdamW(plain, lr=0.1, weight_decay=0.3, foreach=False)

    def loss(params, x):
        w1, b1, w2, _ = params
        return (torch.tanh(x @ w1 + b1) @ w2.T).pow(2).sum()

    for step in range(3):
        xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + i)) for i in range(2)]
        with flat.accumulating():
            for x in xs:  # two micro-batches accumulate
                loss(ours, x).backward()
        for x in xs:
            loss(plain, x).backward()
        assert ours[3].grad is None and plain[3].grad is None
        flat_ptr = ours[0].grad.untyped_storage().data_ptr()  # one buffer, made for the backward pass
        assert all(p.grad.untyped_storage().data_ptr() == flat_ptr for p in ours[:3])
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours[:3], plain[:3]))
        opt.step()
        plain_opt.step()
        opt.zero_grad(set_to_none=True)
        plain_opt.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    moments = flat.exp_avg.untyped_storage().data_ptr()
    assert all(opt.state[p]["exp_avg"].untyped_storage().data_ptr() == moments for p in ours)
    assert float(opt.state[ours[0]]["step"]) == 3 and float(opt.state[ours[3]]["step"]) == 0
    assert torch.equal(ours[3], plain[3]) and ours[3] not in plain_opt.state


def test_a_session_accumulates_into_one_flat_gradient_buffer(tc, runtime):
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(t)) for t in SENTENCES[:2]]
    session = runtime.sessions[tc.name]
    tc.forward_backward(data, "cross_entropy").result()
    grads = [p.grad for p in session.params.values()]
    buffer = grads[0].untyped_storage()
    assert buffer.nbytes() == 4 * sum(g.numel() for g in grads)  # one buffer holds them all
    assert all(g.untyped_storage().data_ptr() == buffer.data_ptr() for g in grads)
    tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert all(p.grad is None for p in session.params.values())
    moments = session.flat.exp_avg_sq.untyped_storage().data_ptr()
    state = session.optimizer.state
    assert all(
        state[p]["exp_avg_sq"].untyped_storage().data_ptr() == moments for p in session.params.values()
    )
