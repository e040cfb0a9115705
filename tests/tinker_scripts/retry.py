"""Run under the tinker SDK's venv against a proxy that drops answers (tests/test_tinker_sdk.py):
one training step and one sample; the SDK re-sends each POST whose answer was lost."""

import json
import sys

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
svc = tinker.ServiceClient()
tokens = spec["tokens"]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
fb = tc.forward_backward([datum], "cross_entropy")
opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
out = {
    "model_id": tc.model_id,
    "loss": fb.result().metrics["loss:sum"],
    "step": opt.result().metrics["step:max"],
}
sc = tc.save_weights_and_get_sampling_client().result()
sample = sc.sample(
    types.ModelInput.from_ints(tokens[:3]), 1, types.SamplingParams(max_tokens=3, seed=1)
).result()
out["sampled"] = sample.sequences[0].tokens
with open(spec["out"], "w") as f:
    json.dump(out, f)
