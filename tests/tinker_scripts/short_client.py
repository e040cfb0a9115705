"""Run under the tinker SDK's venv (tests/test_tinker_sessions.py): a short recipe that opens a
training client and a sampler, trains one step, samples its saved weights through a sampler made
with both ``base_model`` and ``model_path`` (as tinker-cookbook's teacher sampler is), and exits
without closing anything, as a recipe process that ends does."""

import json
import sys

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
svc = tinker.ServiceClient()
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
tokens = spec["tokens"]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
loss = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
path = tc.save_weights_for_sampler(f"s{spec['index']}").result().path
sampler = svc.create_sampling_client(base_model="tiny-llama", model_path=path)
sampled = sampler.sample(
    types.ModelInput.from_ints(tokens[:4]), 1, types.SamplingParams(max_tokens=3)
).result()
with open(spec["out"], "w") as f:
    json.dump(
        {"model_id": tc.model_id, "path": path, "loss": loss, "sampled": sampled.sequences[0].tokens}, f
    )
