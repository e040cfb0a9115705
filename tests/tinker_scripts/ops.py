"""Run under the tinker SDK's venv (tests/tinker/test_tinker_ops.py): distillation targets ((N, K)
cross_entropy) against K one-target calls, the sampling options (stop=[], topk_sample_logprobs,
prompt_logprobs_last_n, target_prompt_logprobs, prompt_alt_tokens_k) against compute_logprobs, and
what is refused (K = 0, mismatched shapes, spans naming an unrecorded sequence, stable_reinforce
without its inputs, an image chunk), a record_stability_info sampler's sample: the errors' messages, and the client still working after them."""

import json
import sys

import numpy as np
import tinker
from tinker import types

spec = json.loads(sys.argv[1])
out = {}
K = 3


def error_of(call):
    try:
        call()
    except Exception as exc:  # what a user's script would see
        return f"{type(exc).__name__}: {exc}"
    return None


svc = tinker.ServiceClient()
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
rng = np.random.default_rng(0)
tokens = spec["tokens"]
n = len(tokens) - 1
targets = rng.integers(0, 200, (n, K)).astype(np.int64)
targets[:, 0] = tokens[1:]
weights = rng.uniform(0.0, 1.0, (n, K)).astype(np.float32)
model_input = types.ModelInput.from_ints(tokens[:-1])

# distillation targets: one (N, K) datum against K one-column datums
multi = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights})
singles = [
    types.Datum(
        model_input=model_input, loss_fn_inputs={"target_tokens": targets[:, j], "weights": weights[:, j]}
    )
    for j in range(K)
]
forward = tc.forward([multi], "cross_entropy").result()
alone = [tc.forward([d], "cross_entropy").result() for d in singles]
out["multi_shape"] = list(forward.loss_fn_outputs[0]["logprobs"].to_numpy().shape)
out["multi_logprobs"] = forward.loss_fn_outputs[0]["logprobs"].to_numpy().tolist()
out["single_logprobs"] = [a.loss_fn_outputs[0]["logprobs"].to_numpy().tolist() for a in alone]
out["multi_loss"] = forward.metrics["loss:sum"]
out["single_losses"] = [a.metrics["loss:sum"] for a in alone]
out["multi_fb_loss"] = tc.forward_backward([multi], "cross_entropy").result().metrics["loss:sum"]
zero = types.Datum(
    model_input=model_input,
    loss_fn_inputs={"target_tokens": np.zeros((n, 0), np.int64), "weights": np.zeros((n, 0), np.float32)},
)
out["k0_error"] = error_of(lambda: tc.forward([zero], "cross_entropy").result())
mismatched = types.Datum(
    model_input=model_input, loss_fn_inputs={"target_tokens": targets, "weights": weights[:, :2].copy()}
)
out["mismatch_error"] = error_of(lambda: tc.forward_backward([mismatched], "cross_entropy").result())
out["stable_reinforce_error"] = error_of(
    lambda: tc.forward_backward(singles[:1], "stable_reinforce").result()
)
spans = singles[0].with_provenance(
    model_input=[types.PromptProvenanceSpan(sequence_id="s", length=n)],
    loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s", length=n)],
)
out["spans_error"] = error_of(lambda: tc.forward_backward([spans], "cross_entropy").result())
out["after_errors_loss"] = tc.forward(singles[:1], "cross_entropy").result().metrics["loss:sum"]

# stop=[]: a model taught to answer EOS at once stops there with stop=None and runs on with []
eos, prompt = spec["eos"], spec["prompt"]
teach = types.Datum(
    model_input=types.ModelInput.from_ints(prompt),
    loss_fn_inputs={"target_tokens": prompt[1:] + [eos], "weights": [0.0] * (len(prompt) - 1) + [1.0]},
)
for _ in range(15):
    tc.forward_backward([teach], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2))
sc = tc.save_weights_and_get_sampling_client().result()
p = types.ModelInput.from_ints(prompt)
greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
kept = sc.sample(p, 1, greedy).result().sequences[0]
off = sc.sample(p, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result().sequences[0]
out["stop_none"] = {"tokens": kept.tokens, "reason": kept.stop_reason}
out["stop_empty"] = {"tokens": off.tokens, "reason": off.stop_reason}

# the sampling options, checked against compute_logprobs
full = sc.compute_logprobs(p).result()
out["full"] = full
out["last_n"] = sc.compute_logprobs(p, prompt_logprobs_last_n=3).result()
params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=11, stop=[])  # it answers EOS first
sampled = sc.sample(p, 1, params, topk_sample_logprobs=4).result().sequences[0]
checks = []
for i, row in enumerate(sampled.topk_logprobs):
    for token, lp in row[:2]:
        context = types.ModelInput.from_ints(prompt + sampled.tokens[:i] + [token])
        checks.append([lp, sc.compute_logprobs(context).result()[-1]])
out["topk_sample"] = {"tokens": sampled.tokens, "rows": sampled.topk_logprobs, "checks": checks}
ids = np.stack([np.asarray(prompt[1:]), rng.integers(0, 200, len(prompt) - 1)], axis=1).astype(np.int64)
ids[1, 1] = -1
scored = sc.sample(
    p,
    1,
    params,
    include_prompt_logprobs=True,
    prompt_logprobs_last_n=2,
    target_prompt_logprobs=types.TensorData.from_numpy(ids),
    prompt_alt_tokens_k=2,
).result()
alt = scored.prompt_alt_tokens
alt_tokens, alt_logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
out["sample_last_n"] = scored.prompt_logprobs
out["target"] = {"ids": ids.tolist(), "values": scored.target_prompt_logprobs.to_numpy().tolist()}
out["alt"] = {"tokens": alt_tokens.tolist(), "logprobs": alt_logprobs.tolist(), "checks": []}
for i in (0, len(prompt) - 2):
    for j in range(2):
        context = types.ModelInput.from_ints(prompt[: i + 1] + [int(alt_tokens[i, j])])
        out["alt"]["checks"].append([float(alt_logprobs[i, j]), sc.compute_logprobs(context).result()[-1]])
stability = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
out["stability_sequences"] = len(stability.sample(p, 1, greedy).result().sequences)
out["after_sampling_errors"] = len(sc.sample(p, 1, greedy).result().sequences)
# kind="inflight" follows each newer inflight save; a snapshot keeps its weights however many newer
# saves follow (and stays usable while its session lives)
probe = types.ModelInput.from_ints(prompt)
inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
snapshot = tc.save_weights_and_get_sampling_client().result()
before = snapshot.compute_logprobs(probe).result()
for _ in range(5):  # five newer saves, each after a step
    tc.forward_backward([teach], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newest = tc.save_weights_and_get_sampling_client(kind="inflight").result()
out["inflight"] = {
    "snapshot_before": before,
    "snapshot_after": snapshot.compute_logprobs(probe).result(),
    "old_inflight": inflight.compute_logprobs(probe).result(),
    "newest": newest.compute_logprobs(probe).result(),
}
out["kind_error"] = error_of(lambda: tc.save_weights_and_get_sampling_client(kind="rolling").result())
with open(spec["out"], "w") as f:
    json.dump(out, f)
