"""Run under the tinker SDK's venv (tests/test_tinker_sdk.py): bad input through the unmodified
SDK is an exception with the engine's message, at once, and the training client keeps working."""

import json
import sys
import time

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
svc = tinker.ServiceClient()
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()


def datum(tokens):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def outcome(call):
    started = time.monotonic()
    try:
        call()
    except Exception as exc:  # what a user's script would see
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    return {"type": None, "message": "", "seconds": time.monotonic() - started}


good = spec["tokens"]
out = {
    "out_of_vocab": outcome(
        lambda: tc.forward_backward([datum([1, 2, spec["vocab"] + 5])], "cross_entropy").result()
    ),
    "unsupported_loss": outcome(lambda: tc.forward_backward([datum(good)], "stable_reinforce").result()),
    "foreign_checkpoint": outcome(
        lambda: svc.create_training_client_from_state(spec["foreign_path"]).result()
    ),
    "prompt_out_of_vocab": outcome(
        lambda: (
            tc.save_weights_and_get_sampling_client()
            .sample(types.ModelInput.from_ints([1, spec["vocab"]]), 1, types.SamplingParams(max_tokens=2))
            .result()
        )
    ),
}
out["after"] = tc.forward_backward([datum(good)], "cross_entropy").result().metrics["loss:sum"]
with open(spec["out"], "w") as f:
    json.dump(out, f)
