"""Run under the tinker SDK's venv (tests/tinker/test_tinker_lifecycle.py): checkpoint lifecycles as a
Tinker user drives them. Key A saves with TTLs and metadata, lists, sets and clears TTLs, lets one
expire, holds a sampler on another, tags runs with a project; publishes a checkpoint that key B
samples, downloads and copies but cannot change; exports a session trace; reads the AdminClient's
storage and audit log. Each value goes into the output JSON for the test to check."""

import json
import sys
import time
import urllib.request

import tinker
from tinker import types

spec = json.loads(sys.argv[1])
out = {}


def outcome(call):
    try:
        value = call()
    except Exception as exc:  # what a user's script would see
        return {"error": type(exc).__name__, "message": str(exc), "status": getattr(exc, "status_code", None)}
    return {"error": None, "value": value}


def checkpoints(rest, run):
    found = rest.list_checkpoints(run).result().checkpoints
    return {
        c.tinker_path: {
            "expires_at": c.expires_at.timestamp() if c.expires_at else None,
            "user_metadata": c.user_metadata,
            "public": c.public,
            "size_bytes": c.size_bytes,
        }
        for c in found
    }


def datum(tokens):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


a = tinker.ServiceClient(project_id="proj-a", display_name="lifecycle run", user_metadata={"who": "a"})
tc = a.create_lora_training_client("tiny-llama", rank=4, seed=0, user_metadata={"run": "r1"}).result()
tc.forward_backward([datum(spec["tokens"])], "cross_entropy").result()
tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
run = tc.model_id
out["run"] = run
out["session_id"] = a.holder._session_id
rest = a.create_rest_client()

before = time.time()
state = tc.save_state("st", ttl_seconds=7200, user_metadata={"k": "v"}).result().path
kept = tc.save_weights_for_sampler("sw", ttl_seconds=3600, user_metadata={"stage": "rl"}).result().path
out["before"], out["state"], out["kept"] = before, state, kept
out["listed"] = checkpoints(rest, run)
rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
out["cleared"] = checkpoints(rest, run)[state]
rest.set_checkpoint_ttl_from_tinker_path(state, 86400).result()
out["reset"] = checkpoints(rest, run)[state]
out["bad_ttls"] = {
    str(ttl): outcome(lambda t=ttl: rest.set_checkpoint_ttl_from_tinker_path(state, t).result())
    for ttl in (-5, 0, 10**11)
}
out["after_bad"] = checkpoints(rest, run)[state]
out["bad_save_ttl"] = outcome(lambda: tc.save_state("bad", ttl_seconds=-1).result())

# one expires unheld; one is held by a sampler of this (unfinished) session
gone = tc.save_weights_for_sampler("gone").result().path
held = tc.save_weights_for_sampler("held").result().path
held_sampler = a.create_sampling_client(model_path=held).result()
held_logprobs = held_sampler.compute_logprobs(types.ModelInput.from_ints(spec["prompt"])).result()
for path in (gone, held):
    rest.set_checkpoint_ttl_from_tinker_path(path, 1).result()
out["gone"], out["held"] = gone, held
deadline = time.time() + 15
while gone in checkpoints(rest, run) and time.time() < deadline:
    time.sleep(0.3)
time.sleep(1.0)  # a few sweeps more
listed = checkpoints(rest, run)
out["gone_listed"], out["held_listed"] = gone in listed, held in listed
out["held_still_samples"] = (
    held_sampler.compute_logprobs(types.ModelInput.from_ints(spec["prompt"])).result() == held_logprobs
)

# runs: metadata, project filter, display name; a different base model on load is refused
out["run_metadata"] = rest.get_training_run(run).result().user_metadata
out["project_a"] = [
    r.training_run_id for r in rest.list_training_runs(project_id="proj-a").result().training_runs
]
out["project_b"] = [
    r.training_run_id for r in rest.list_training_runs(project_id="proj-b").result().training_runs
]
out["display_name"] = rest.get_session(out["session_id"]).result().display_name
out["other_base"] = outcome(
    lambda: a.create_training_client_from_state(state, base_model="tiny-qwen3").result()
)
same = a.create_training_client_from_state(
    state, base_model="tiny-llama", user_metadata={"from": "st"}
).result()
out["loaded_metadata"] = rest.get_training_run(same.model_id).result().user_metadata

# sharing
shared = tc.save_weights_for_sampler("shared").result().path
private = tc.save_state("private").result().path
out["shared"], out["private"] = shared, private
mine = (
    a.create_sampling_client(model_path=shared)
    .result()
    .compute_logprobs(types.ModelInput.from_ints(spec["prompt"]))
    .result()
)
b = tinker.ServiceClient(api_key=spec["key_b"], project_id="proj-b")
rest_b = b.create_rest_client()
out["b_before_publish"] = outcome(
    lambda: (
        b.create_sampling_client(model_path=shared)
        .result()
        .compute_logprobs(types.ModelInput.from_ints(spec["prompt"]))
        .result()
    )
)
rest.publish_checkpoint_from_tinker_path(shared).result()
out["published_listed"] = checkpoints(rest, run)[shared]["public"]
theirs = (
    b.create_sampling_client(model_path=shared)
    .result()
    .compute_logprobs(types.ModelInput.from_ints(spec["prompt"]))
    .result()
)
out["b_samples_same"] = theirs == mine
out["b_weights_info"] = rest_b.get_weights_info_by_tinker_path(shared).result().base_model
external = tc.save_weights_external("shared-ext").result().path
out["external"] = external
rest.publish_checkpoint_from_tinker_path(external).result()
urls = rest_b.get_external_weights_urls(external).result().urls
with urllib.request.urlopen(urls["adapter/adapter_model.safetensors"]) as response:
    out["b_download_bytes"] = len(response.read())
out["b_delete"] = outcome(lambda: rest_b.delete_checkpoint_from_tinker_path(shared).result())
out["b_unpublish"] = outcome(lambda: rest_b.unpublish_checkpoint_from_tinker_path(shared).result())
out["b_ttl"] = outcome(lambda: rest_b.set_checkpoint_ttl_from_tinker_path(shared, 3600).result())
out["b_publish_private"] = outcome(lambda: rest_b.publish_checkpoint_from_tinker_path(private).result())
out["after_b"] = checkpoints(rest, run)[shared]
copy = b.copy_weights(shared, ttl_seconds=7200).result()
out["copy"] = copy
copy_run = copy.split("/")[2]
out["copy_listed"] = checkpoints(rest_b, copy_run)
out["copy_in_project_b"] = copy_run in [
    r.training_run_id for r in rest_b.list_training_runs(project_id="proj-b").result().training_runs
]
out["copy_samples_same"] = (
    b.create_sampling_client(model_path=copy)
    .result()
    .compute_logprobs(types.ModelInput.from_ints(spec["prompt"]))
    .result()
    == mine
)
out["b_load_private"] = outcome(lambda: b.create_training_client_from_state(state).result().model_id)
rest.publish_checkpoint_from_tinker_path(state).result()
loaded = b.create_training_client_from_state(state).result()
out["b_loaded_run"] = loaded.model_id
out["b_loaded_loss"] = (
    loaded.forward_backward([datum(spec["tokens"])], "cross_entropy").result().metrics["loss:sum"]
)
out["a_loss"] = tc.forward([datum(spec["tokens"])], "cross_entropy").result().metrics["loss:sum"]
rest.unpublish_checkpoint_from_tinker_path(state).result()
rest.unpublish_checkpoint_from_tinker_path(shared).result()
out["b_after_unpublish"] = outcome(lambda: rest_b.get_weights_info_by_tinker_path(shared).result())

# operations
url = rest.export_session_trace(out["session_id"]).result()
with urllib.request.urlopen(url) as response:
    out["trace"] = json.loads(response.read())
out["b_trace"] = outcome(lambda: rest_b.export_session_trace(out["session_id"]).result())
admin = tinker.AdminClient()
usage = admin.get_current_checkpoint_storage_usage().result()
out["storage"] = [item.model_dump() for item in usage.data]
listed_now = rest.list_user_checkpoints(limit=1000).result().checkpoints
out["listed_bytes"] = sum(c.size_bytes for c in listed_now)
out["listed_count"] = len(listed_now)
out["storage_b"] = [
    item.model_dump()
    for item in tinker.AdminClient(api_key=spec["key_b"]).get_current_checkpoint_storage_usage().result().data
]
audit = admin.get_audit_log().result()
out["audit"] = [
    {"event": e.event, "details": e.event_details, "tinker_path": e.tinker_path} for e in audit.entries
]
out["audit_checkpoints"] = [e.event for e in admin.get_audit_log(event_type="checkpoints").result().entries]
b.close("success").result()
a.close("success").result()
with open(spec["out"], "w") as f:
    json.dump(out, f)
