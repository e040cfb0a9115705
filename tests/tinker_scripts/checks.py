"""Run under the tinker SDK's venv (tests/test_tinker_sdk.py), three checks in one process: the SDK's
own protobuf schema (serialized, to compare with the engine's); bad input through the unmodified
SDK is an exception with the engine's message, at once, and the training client keeps working; and
an SDK reporting a version outside the engine's tested range gets one clear error at its first call."""

import base64
import json
import sys
import time

import tinker
import tinker.lib.internal_client_holder as holder
from google.protobuf import descriptor_pb2
from tinker import types
from tinker.proto import tinker_public_pb2

spec = json.loads(sys.argv[1])
proto = descriptor_pb2.FileDescriptorProto()
tinker_public_pb2.DESCRIPTOR.CopyToProto(proto)
out = {"descriptor": base64.b64encode(proto.SerializeToString()).decode()}


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


svc = tinker.ServiceClient()
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
vocab, good = spec["vocab"], spec["tokens"]
out["out_of_vocab"] = outcome(
    lambda: tc.forward_backward([datum([1, 2, vocab + 5])], "cross_entropy").result()
)
out["unsupported_loss"] = outcome(lambda: tc.forward_backward([datum(good)], "stable_reinforce").result())
out["foreign_checkpoint"] = outcome(
    lambda: svc.create_training_client_from_state(spec["foreign_path"]).result()
)
sampler = tc.save_weights_and_get_sampling_client().result()
out["prompt_out_of_vocab"] = outcome(
    lambda: sampler.sample(
        types.ModelInput.from_ints([1, vocab]), 1, types.SamplingParams(max_tokens=2)
    ).result()
)
out["after"] = tc.forward_backward([datum(good)], "cross_entropy").result().metrics["loss:sum"]
svc.close("success").result()

holder.tinker_sdk_version = spec["version"]  # what a newer or older install would send
out["version"] = outcome(
    lambda: tinker.ServiceClient().create_lora_training_client("tiny-llama", rank=4).result()
)
with open(spec["out"], "w") as f:
    json.dump(out, f)
