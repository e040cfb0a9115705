"""MoE: a tiny gpt_oss session with train_mlp puts LoRA on the expert weights, and they learn."""

from __future__ import annotations

from sess.engine import AdamParams, SamplingParams

from helpers import SENTENCES, ce_datum


def test_gpt_oss_expert_lora_gets_gradients_and_loss_falls(svc, runtime):
    tc = svc.create_lora_training_client(
        "tiny-gpt-oss", rank=4, alpha=8, seed=0, train_attn=False, train_unembed=False, train_mlp=True
    )
    tok = tc.get_tokenizer()
    data = [ce_datum(tok.encode(s)) for s in SENTENCES[:4]]
    params = runtime.sessions[tc.name].params
    expert_names = [n for n in params if "experts" in n]
    assert expert_names, sorted(params)[:5]

    first = tc.forward_backward(data).result().metrics["loss:sum"]
    # LoRA B starts at zero, so the first step's gradient reaches B only; after one step A's too
    assert all(float(params[n].grad.abs().sum()) > 0 for n in expert_names if "lora_B" in n)
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward(data).result()
    assert all(params[n].grad is not None and float(params[n].grad.abs().sum()) > 0 for n in expert_names)
    tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    losses = [first]
    for _ in range(15):
        losses.append(tc.forward_backward(data).result().metrics["loss:sum"])
        tc.optim_step(AdamParams(learning_rate=1e-2))
    # expert-only rank-4 LoRA on a random MoE learns slowly but steadily (253 -> ~207 here)
    assert losses[-1] < 0.9 * losses[0], losses
    tc.stop()


def test_gpt_oss_sampling_parity_and_merged_save(svc):
    with svc.create_lora_training_client("tiny-gpt-oss", rank=4, seed=1) as tc:
        tok = tc.get_tokenizer()
        tc.forward_backward([ce_datum(tok.encode(s)) for s in SENTENCES])
        tc.optim_step(AdamParams(learning_rate=1e-2))
        prompt = tok.encode("Two plus")
        sc = tc.save_weights_and_get_sampling_client()
        seq = (
            sc.sample(prompt, num_samples=2, sampling_params=SamplingParams(max_tokens=10, seed=0))
            .result()
            .sequences[0]
        )
        full = prompt + seq.tokens
        computed = sc.compute_logprobs(full).result()[len(prompt) :]
        assert max(abs(a - b) for a, b in zip(computed, seq.logprobs)) < 1e-4
        assert tc.save_weights_for_sampler(merge_weights=True).result().path.startswith("sess://")
