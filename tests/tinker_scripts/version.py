"""Run under the tinker SDK's venv (tests/test_tinker_sdk.py): an SDK that reports a version outside
the engine's tested range gets one clear error at its first call, not a retry loop."""

import json
import sys
import time

import tinker
import tinker.lib.internal_client_holder as holder

spec = json.loads(sys.argv[1])
holder.tinker_sdk_version = spec["version"]  # what a newer or older install would send
started = time.monotonic()
try:
    tinker.ServiceClient().create_lora_training_client("tiny-llama", rank=4).result()
    out = {"type": None, "message": ""}
except Exception as exc:
    out = {"type": type(exc).__name__, "message": str(exc)}
out["seconds"] = time.monotonic() - started
with open(spec["out"], "w") as f:
    json.dump(out, f)
