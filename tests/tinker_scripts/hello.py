"""Run under the tinker SDK's venv (tests/test_tinker_sdk.py): the smallest round trip, one model
and one forward pass, for checking a connection (such as https with SSL_CERT_FILE)."""

import json
import sys

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
tc = tinker.ServiceClient().create_lora_training_client("tiny-llama", rank=4, seed=0).result()
tokens = spec["tokens"]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
with open(spec["out"], "w") as f:
    json.dump({"loss": tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]}, f)
