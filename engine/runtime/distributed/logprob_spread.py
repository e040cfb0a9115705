"""``compute_logprobs`` on every rank: rank 0 hands whole requests to the ranks, each scores its share.

With several ranks the executor takes the ``compute_logprobs`` requests waiting together
(:func:`run_group`). Rank 0 checks each one (its target resolved: a checkpoint's adapter is
loaded on every rank as for sampling), gathers the whole weights on every rank
(:meth:`~sess.engine.runtime.distributed.ranks.Ranks.full_weights`, kept for sampling too), and hands each request to the
rank with the fewest prompt tokens in this group, ties to the rank that has scored the fewest
tokens in all (so requests that come one at a time take turns; the lower rank on a tie). When
another rank got one, rank 0 broadcasts the group
(``{"logprobs": [...]}``, JSON: id, rank, base model, prompt and target as
:mod:`sess.engine.runtime.distributed.sample_spread` sends them), every rank scores its own requests with the same
function as one rank (:func:`~.batched_forward.prompt_logprobs` on the same weights), and the
results come back to rank 0 in one all-gather (:func:`sess.engine.runtime.distributed.sample_spread.exchange`), each put
back in its request's place. The requests and prompt tokens each rank scored are counted for
``/healthz`` (``sampling_ranks``).

Every rank runs forward passes through the FSDP2 units here (rank 0 alone did before): each rank
then drops what FSDP2 recorded of them before the next followed op
(:meth:`~sess.engine.runtime.distributed.ranks.Ranks.forget_forward_order`), so their backward passes prefetch alike.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sess.engine.protocol.errors import SessError
from sess.engine.runtime.batched_forward import prompt_logprobs
from sess.engine.runtime.distributed.ranks import RankFailed
from sess.engine.runtime.distributed.sample_spread import adapter_of, exchange

if TYPE_CHECKING:
    from sess.engine.protocol import requests as rq
    from sess.engine.runtime.distributed.ranks import Ranks
    from sess.engine.runtime.runtime import Runtime


class Scored:
    """Per rank: the ``compute_logprobs`` requests and prompt tokens it scored (rank 0's count)."""

    def __init__(self, world: int):
        self.requests = [0] * world
        self.tokens = [0] * world


def scored(ranks: Ranks) -> Scored:
    if ranks.scored is None:
        ranks.scored = Scored(ranks.world)
    return ranks.scored


def run_group(runtime: Runtime, items: list[tuple[str, rq.ComputeLogprobs]]) -> list[tuple]:
    """Rank 0: score ``items`` ((owner, request) pairs) over the ranks. Returns, per item in order,
    ``(result, error, seconds)``: the op's result dict or None, a SessError or None, and the seconds
    its scoring took (0.0 for one refused before)."""
    from sess.engine.runtime.ops.sampling_ops import check_prompt, resolve_target
    from sess.engine.runtime.samplers import target_wire

    ranks: Ranks = runtime.placement
    outcomes: list = [None] * len(items)
    jobs = []  # (index, host, adapter, request)
    for index, (owner, request) in enumerate(items):
        try:
            host, adapter, _ = resolve_target(runtime, owner, request.target)
            check_prompt(request.prompt, host.vocab_size)
        except SessError as exc:
            outcomes[index] = (None, exc, 0.0)
            continue
        jobs.append((index, host, adapter, request))
    if not jobs:
        return outcomes
    runtime.full_weights()  # every rank: loading a checkpoint's adapter may have dropped them
    loads = [0] * ranks.world
    counts = scored(ranks)
    handed, mine = [], []
    for index, host, adapter, request in jobs:
        rank = min(range(ranks.world), key=lambda r: (loads[r], counts.tokens[r], r))
        loads[rank] += len(request.prompt)
        counts.requests[rank] += 1
        counts.tokens[rank] += len(request.prompt)
        if rank == 0:
            mine.append((index, host, adapter, request))
        else:
            handed.append(
                {
                    "id": index,
                    "rank": rank,
                    "base_model": host.name,
                    "prompt": list(request.prompt),
                    "target": target_wire(request.target, host.name),
                }
            )
    if handed:
        ranks.send({"logprobs": handed})
    for index, host, adapter, request in mine:
        outcomes[index] = _score(runtime, host, adapter, request.prompt)
    if handed:
        for message in exchange(ranks, {})[1:]:
            for done in message["done"]:
                if "error" in done:
                    error = SessError(done["error"], status=done.get("status", 500))
                    outcomes[done["id"]] = (None, error, done["seconds"])
                else:
                    outcomes[done["id"]] = ({"logprobs": done["logprobs"]}, None, done["seconds"])
    return outcomes


def _score(runtime: Runtime, host, adapter: str | None, prompt: list[int]) -> tuple:
    started = time.perf_counter()
    try:
        with host.activate(adapter) as model:
            logprobs, _ = prompt_logprobs(model, prompt, None, runtime.memory_budget)
    except (RankFailed, KeyboardInterrupt):
        raise
    except SessError as exc:
        return None, exc, time.perf_counter() - started
    except Exception as exc:  # as the executor: the request fails, not the engine
        error = SessError(f"compute_logprobs failed inside the engine: {type(exc).__name__}: {exc}")
        return None, error, time.perf_counter() - started
    return {"logprobs": logprobs}, None, time.perf_counter() - started


def follow_group(runtime: Runtime, message: dict) -> None:
    """A follower: score the requests of ``message["logprobs"]`` handed to this rank, then send the
    results to rank 0 (every rank joins the all-gather, with or without requests of its own)."""
    ranks: Ranks = runtime.placement
    done = []
    for wire in message["logprobs"]:
        if wire["rank"] != ranks.rank:
            continue
        host = runtime.hosts[wire["base_model"]]
        try:
            adapter = adapter_of(runtime, host, wire["target"])
        except SessError as exc:
            result, error, seconds = None, exc, 0.0
        else:
            result, error, seconds = _score(runtime, host, adapter, wire["prompt"])
        entry: dict = {"id": wire["id"], "seconds": seconds}
        if error is not None:
            entry.update(error=str(error), status=getattr(error, "status", 500))
        else:
            entry["logprobs"] = result["logprobs"]
        done.append(entry)
    exchange(ranks, {"done": done})


def report(ranks: Ranks) -> dict:
    counts = scored(ranks)
    return {"logprob_requests": list(counts.requests), "logprob_tokens": list(counts.tokens)}
