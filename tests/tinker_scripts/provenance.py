"""Run under the tinker SDK's venv (tests/tinker/test_tinker_provenance.py): a sampler made with
record_stability_info samples two sequences; datums built with ``Datum.with_provenance`` train with
stable_reinforce (their ``logprobs`` deliberately wrong: the recorded ones are read) and with ppo,
and the same datums with one target changed are refused naming the span."""

import json
import sys

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
svc = tinker.ServiceClient()
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
prompt = spec["prompt"]
params = types.SamplingParams(max_tokens=5, seed=1, stop=[])
sampled = sc.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences


def datums(corrupt: bool) -> list[types.Datum]:
    data = []
    for s in sampled:
        tokens, p = list(s.tokens), len(prompt)
        full = prompt + tokens
        targets = full[1:]
        if corrupt:
            targets = targets[:-1] + [(targets[-1] + 1) % 100]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": targets,
                "logprobs": [-1.0] * (len(full) - 1),
                "advantages": [0.0] * (p - 1) + [1.0] * len(tokens),
            },
        )
        data.append(
            datum.with_provenance(
                model_input=[
                    types.PromptProvenanceSpan(sequence_id=s.sequence_id, length=p),
                    types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(tokens) - 1),
                ],
                loss_fn_inputs=[
                    types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=p - 1),
                    types.SampledProvenanceSpan(sequence_id=s.sequence_id, length=len(tokens)),
                ],
            )
        )
    return data


out = {"sequence_ids": [s.sequence_id for s in sampled]}
config = {"kl_coeff": 0.1}
out["stable_reinforce"] = tc.forward_backward(datums(False), "stable_reinforce", config).result().metrics
out["ppo"] = tc.forward_backward(datums(False), "ppo").result().metrics
try:
    tc.forward_backward(datums(True), "stable_reinforce").result()
    out["corrupt_error"] = None
except Exception as exc:  # what a user's script would see
    out["corrupt_error"] = f"{type(exc).__name__}: {exc}"
with open(spec["out"], "w") as f:
    json.dump(out, f)
