"""Run under the tinker SDK's venv (tests/test_billing_tinker.py): training steps that run into the
key's budget (the SDK pauses on 402 and goes on once the budget is raised), then a burst of forward
passes past the key's queue limit (429: the SDK waits and re-sends), one sample (its
``prompt_cache_hit_tokens``), then the billing-usage report through ``AdminClient``."""

import json
import logging
import sys
from datetime import datetime, timedelta, timezone

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
handler = logging.FileHandler(spec["log"])
handler.setLevel(logging.WARNING)
logging.getLogger("tinker").addHandler(handler)

svc = tinker.ServiceClient()
tokens = spec["tokens"]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=0).result()
losses = []
for _ in range(spec["steps"]):
    losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
forwards = [tc.forward([datum], "cross_entropy") for _ in range(spec["burst"])]
burst = [f.result().metrics["loss:sum"] for f in forwards]
sampler = tc.save_weights_and_get_sampling_client()
params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=0)
sampled = sampler.sample(types.ModelInput.from_ints(tokens), num_samples=2, sampling_params=params).result()
hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
usage = tinker.AdminClient().get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=1))
events = usage.result().data
out = {
    "model_id": tc.model_id,
    "losses": losses,
    "burst": burst,
    "prompt_cache_hit_tokens": sampled.prompt_cache_hit_tokens,
    "sampled_tokens": sum(len(s.tokens) for s in sampled.sequences),
    "events": [
        {
            "type": e.event_info.type,
            "tokens": e.event_info.token_count,
            "cached": getattr(e.event_info, "cached", None),
            "cost": e.estimated_cost_usd,
            "rate": e.effective_rate_usd_per_million_tokens,
            "bucket_start": e.bucket_start.isoformat(),
        }
        for e in events
    ],
}
with open(spec["out"], "w") as f:
    json.dump(out, f)
