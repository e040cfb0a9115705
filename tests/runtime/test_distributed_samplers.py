"""Every kind of sampler on a two-rank engine: each rank that is handed a request can serve it.

A sampler is a live session's current weights, a named sampler save, a transient one (what
``save_weights_and_get_sampling_client()`` returns each step of an RL loop, the newest and older
ones), a weights checkpoint opened by path, or the base model. Requests to each kind go out
together, more of them than ranks, so rank 1 decodes some of every kind; the tokens and logprobs
equal a one-rank engine's for the same seeds.
"""

from __future__ import annotations

from sess.engine import AdamParams, SamplingParams, ServiceClient
from sess.engine.sdk.local_engine import start_engine, stop_engine

from helpers import SENTENCES, ce_datum

ADAM = AdamParams(learning_rate=2e-3)
REQUESTS_PER_KIND = 3


def _every_kind(url: str, home) -> dict:
    svc = ServiceClient(url, home=home)
    try:
        tc = svc.create_lora_training_client("tiny-llama", rank=4, seed=11)
        tok = tc.get_tokenizer()
        datums = [ce_datum(tok.encode(s)) for s in SENTENCES]
        samplers = {}
        for step in range(3):  # three steps, a transient sampler each, as an RL loop makes them
            tc.forward_backward(datums).result()
            tc.optim_step(ADAM).result()
            samplers[f"transient{step}"] = tc.save_weights_and_get_sampling_client()
        samplers["live"] = tc.create_sampling_client()
        samplers["named"] = tc.save_weights_and_get_sampling_client(name="kinds")
        path = tc.save_weights_for_sampler().result().path
        samplers["path"] = svc.create_sampling_client(model_path=path)
        samplers["base"] = svc.create_sampling_client(base_model="tiny-llama")
        prompts = [tok.encode(s) for s in SENTENCES]
        futures = {
            kind: [
                client.sample(
                    prompts[i % len(prompts)], num_samples=2, sampling_params=SamplingParams(max_tokens=6, seed=i)
                )
                for i in range(REQUESTS_PER_KIND)
            ]
            for kind, client in samplers.items()
        }
        results = {kind: [f.result() for f in fs] for kind, fs in futures.items()}
        return {
            kind: [[(s.tokens, s.logprobs) for s in r.sequences] for r in rs] for kind, rs in results.items()
        } | {"_health": _health(url)}
    finally:
        svc.close()


def _health(url: str) -> dict:
    import httpx

    return httpx.get(f"{url}/healthz", timeout=10).json()


def test_every_kind_of_sampler_serves_on_two_ranks_like_one(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    records = []
    for nproc in ("1", "2"):
        engine = start_engine(home, extra_args=["--nproc", nproc])
        try:
            records.append(_every_kind(engine["url"], home))
        finally:
            stop_engine(home)
    one, two = records
    spread = two.pop("_health")["sampling_ranks"]
    one.pop("_health")
    assert all(rows > 0 for rows in spread["rows_decoded"]), spread
    for kind in one:
        tokens_one = [[t for t, _ in r] for r in one[kind]]
        tokens_two = [[t for t, _ in r] for r in two[kind]]
        assert tokens_two == tokens_one, kind
        diff = max(
            abs(a - b)
            for r1, r2 in zip(one[kind], two[kind])
            for (_, l1), (_, l2) in zip(r1, r2)
            for a, b in zip(l1, l2)
        )
        assert diff < 1e-5, (kind, diff)
