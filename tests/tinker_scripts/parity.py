"""Run under the tinker SDK's own venv (see tests/test_tinker_sdk.py): a short training, sampling and
resume script through the unmodified SDK; prints nothing, writes its numbers to spec["out"]. Runs on
every SDK version the engine serves: up to 0.36 the client-making methods return the client itself,
from 0.38 a future of it (which still works as the client, deprecated)."""

import json
import sys

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
svc = tinker.ServiceClient()


def ready(client):
    """The client itself, whether an SDK returned it or a future of it."""
    return client.result() if hasattr(client, "result") else client


def datum(tokens, targets=None):
    targets = targets if targets is not None else tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": list(targets), "weights": [1.0] * (len(tokens) - 1)},
    )


data = [datum(t) for t in spec["sequences"]]
adam = types.AdamParams(learning_rate=spec["lr"], eps=1e-8)
tc = ready(svc.create_lora_training_client(spec["base_model"], rank=4, seed=0))
out = {"model_id": tc.model_id, "losses": [], "grad_norms": []}
for _ in range(spec["steps"]):
    fb = tc.forward_backward(data, "cross_entropy")
    opt = tc.optim_step(adam)
    out["losses"].append(fb.result().metrics["loss:sum"])
    out["grad_norms"].append(opt.result().metrics["grad_norm:mean"])
out["forward_logprobs"] = [
    o["logprobs"].tolist() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs
]
out["tokenizer_ids"] = tc.get_tokenizer().encode(spec["text"], add_special_tokens=False)

# sampling: seeded samples, their logprobs against compute_logprobs, prompt logprobs and top-k
prompt = spec["prompt"]
sc = ready(tc.save_weights_and_get_sampling_client())
params = types.SamplingParams(max_tokens=8, seed=11, temperature=1.0)
result = sc.sample(types.ModelInput.from_ints(prompt), num_samples=3, sampling_params=params).result()
out["samples"] = [
    {"tokens": s.tokens, "logprobs": s.logprobs, "stop": s.stop_reason} for s in result.sequences
]
out["sample_ids"] = [s.sequence_id for s in result.sequences]
out["computed"] = [
    sc.compute_logprobs(types.ModelInput.from_ints(prompt + s.tokens)).result()[len(prompt) :]
    for s in result.sequences
]
scored = sc.sample(
    types.ModelInput.from_ints(prompt),
    num_samples=1,
    sampling_params=types.SamplingParams(max_tokens=1, seed=1),
    include_prompt_logprobs=True,
    topk_prompt_logprobs=spec["k"],
).result()
out["prompt_logprobs"] = scored.prompt_logprobs
out["topk"] = scored.topk_prompt_logprobs
# forward's logprobs of the prompt and of each top-k choice at each position (same weights)
out["prompt_forward"] = (
    tc.forward([datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
)
out["topk_forward"] = [
    tc.forward([datum(prompt, [row[j][0] for row in scored.topk_prompt_logprobs[1:]])], "cross_entropy")
    .result()
    .loss_fn_outputs[0]["logprobs"]
    .tolist()
    for j in range(spec["k"])
]

# save_state -> create_training_client_from_state_with_optimizer -> the next losses equal the
# uninterrupted run's
state = tc.save_state("mid").result().path
uninterrupted = [tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]]
tc.optim_step(adam).result()
uninterrupted.append(tc.forward(data, "cross_entropy").result().metrics["loss:sum"])
resumed_tc = ready(svc.create_training_client_from_state_with_optimizer(state))
resumed = [resumed_tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]]
resumed_tc.optim_step(adam).result()
resumed.append(resumed_tc.forward(data, "cross_entropy").result().metrics["loss:sum"])
out.update(state_path=state, resumed_model=resumed_tc.model_id, uninterrupted=uninterrupted, resumed=resumed)

rest = svc.create_rest_client()  # every version has it; tinker.RestClient() is 0.38 on
out["checkpoints"] = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
out["run_renderer"] = rest.get_training_run(tc.model_id).result().base_model
svc.close("success").result()
with open(spec["out"], "w") as f:
    json.dump(out, f)
