"""Sampling on every rank: rank 0 hands whole sample requests to the ranks, each decodes its share.

Each base model's decode batch on rank 0 has a :class:`Spread`. Before each decode step it assigns
the requests waiting to join to ranks, each to the rank with the fewest rows (rank 0 counts its own
running and waiting rows and the rows it handed to each other rank that have not come back), and
broadcasts the step with the requests for the other ranks (``{"decode": base model, "jobs":
[...]}``, JSON: prompt, samples, sampling params, stop settings, and the target: a live session by
name, a checkpoint by its path, or the base model). Every rank then runs one step of its own
decode batch, with the whole weights gathered on every rank (FSDP2 unshard,
:meth:`~sess.engine.runtime.distributed.ranks.Ranks.full_weights`), and the requests finished on the other ranks come back
to rank 0 in one all-gather, where each one's callback runs as for a request decoded there. A
step is broadcast only while another rank has rows or gets new ones.

A request keeps its rows together (its prompt is prefilled once, on one rank), and the llama
decoder gives a row the same bits in any batch (:mod:`sess.engine.sampling.row_invariant`), so a
seeded request returns the tokens and logprobs it returns on one rank, whichever rank decodes it.
Each rank's KV cache holds only its own rows. Every rank holds the checkpoint adapters rank 0 holds
(``{"samplers"}``, sent whenever rank 0's set changes: a transient save, a checkpoint opened for
sampling, a release or a delete; before the request that needs one is handed out), so every rank's
FSDP2 units change alike (peft's state-dict load gives them their shards back).
"""

from __future__ import annotations

import json
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import SessError
from sess.engine.protocol.types import SampledSequence, SamplingParams
from sess.engine.runtime.ops.checkpoint_ops import checkpoint_sampler
from sess.engine.sampling.decode_batch import DecodeBatch, SampleJob
from sess.engine.sampling.token_choice import StopChecker

if TYPE_CHECKING:
    from sess.engine.runtime.distributed.ranks import Ranks
    from sess.engine.runtime.runtime import Runtime


class Spread:
    """Rank 0's side for one base model's decode batch: which rank decodes which request."""

    def __init__(self, ranks: Ranks, base_model: str):
        self.ranks, self.base_model = ranks, base_model
        self.elsewhere: dict[int, tuple[int, SampleJob]] = {}  # request id -> (rank, job)
        self._next = 0
        self.rows = [0] * ranks.world  # rows each rank has decoded (requests x samples handed to it)
        self.peak_cache = [0] * ranks.world  # the most bytes each rank's KV cache held after a step
        ranks.spreads.append(self)

    def before(self, batch: DecodeBatch) -> None:
        """Hand the waiting requests out and, if another rank decodes this step, broadcast it."""
        loads = [0] * self.ranks.world
        loads[0] = batch.rows
        for rank, job in self.elsewhere.values():
            loads[rank] += job.num_samples
        keep, handed = [], []
        for job in batch.waiting:
            rank = min(range(self.ranks.world), key=lambda r: (loads[r], r))
            loads[rank] += job.num_samples
            if rank == 0 or job.target is None:
                self.rows[0] += job.num_samples
                keep.append(job)
                continue
            self.rows[rank] += job.num_samples
            self._next += 1
            self.elsewhere[self._next] = (rank, job)
            handed.append({"id": self._next, "rank": rank, **_job_wire(job)})
        batch.waiting = keep
        self.stepping = bool(self.elsewhere)
        if self.stepping:
            self.ranks.send({"decode": self.base_model, "jobs": handed})

    stepping = False

    def after(self, batch: DecodeBatch) -> None:
        """The requests the other ranks finished this step, to their callbacks here."""
        self.peak_cache[0] = max(self.peak_cache[0], cache_bytes(batch))
        if not self.stepping:
            return
        for rank, message in enumerate(exchange(self.ranks, {})[1:], start=1):
            self.peak_cache[rank] = max(self.peak_cache[rank], message["cache_bytes"])
            for done in message["done"]:
                if done["id"] not in self.elsewhere:  # ended here already (fail_adapter)
                    continue
                rank, job = self.elsewhere.pop(done["id"])
                job.seconds = done["seconds"]
                if done.get("prompt_result") is not None:
                    logprobs, top = done["prompt_result"]
                    top = None if top is None else [None if t is None else [tuple(p) for p in t] for t in top]
                    job.prompt_result = (logprobs, top)
                if done.get("error") is not None:
                    job.on_done(None, SessError(done["error"], status=done.get("status", 500)))
                else:
                    sequences = [SampledSequence(**s) for s in done["sequences"]]
                    job.on_done(sequences, None)

    def fail_adapter(self, adapter: str, error: BaseException) -> None:
        """End the requests of ``adapter`` handed out (their session stopped; the rank decoding one
        stops it too, and what it sends back for it is dropped)."""
        for key in [k for k, (_, job) in self.elsewhere.items() if job.adapter == adapter]:
            self.elsewhere.pop(key)[1].on_done(None, error)

    def fail_all(self, error: BaseException) -> None:
        for _, job in self.elsewhere.values():
            job.on_done(None, error)
        self.elsewhere.clear()


def adapter_of(runtime: Runtime, host, target: dict) -> str | None:
    """The adapter of a request's target on this rank: a live session's (followed, so here too), a
    checkpoint's (loaded here when rank 0 loaded it: never alone, which would leave this rank's
    FSDP2 units unlike the others'), or None for the base model."""
    if "session" in target:
        session = runtime.sessions.get(target["session"])
        if session is None or not session.live:
            raise SessError(
                f"session {target['session']} is not live on rank {runtime.placement.rank}", status=409
            )
        return session.adapter
    if "model_path" in target:
        adapter = host.checkpoint_adapters.get(target["model_path"])
        if adapter is None:
            raise SessError(
                f"{target['model_path']} is not loaded on rank {runtime.placement.rank}", status=500
            )
        return adapter
    return None


def follow_samplers(runtime: Runtime, message: dict) -> None:
    """A follower: hold the checkpoint adapters rank 0 holds for base model ``message["base_model"]``
    (:meth:`~sess.engine.runtime.distributed.ranks.Ranks.share_samplers`): drop the others, load the missing ones from the
    shared home. Rank 0 never drops one a request still samples from on any rank (its decode
    batch pins the requests handed out too), and this rank evicts nothing on its own: its set is
    rank 0's, at most as large."""
    host = runtime.hosts[message["base_model"]]
    wanted = message["samplers"]
    for uri in [u for u in host.checkpoint_adapters if u not in wanted]:
        host.release_checkpoint(uri)
    host.max_checkpoint_adapters = max(host.max_checkpoint_adapters, len(wanted))
    for uri in wanted:
        checkpoint_sampler(runtime, host, parse_path(uri))


def _nothing(*args) -> None:
    pass


def _job_wire(job: SampleJob) -> dict:
    return {
        "prompt": job.prompt,
        "num_samples": job.num_samples,
        "params": job.params.to_wire(),
        "target": job.target,
        "prompt_logprobs": job.prompt_logprobs,
    }


class Decoding:
    """A follower's side: the requests rank 0 handed it, decoded in its own batches."""

    def __init__(self, runtime: Runtime, ranks: Ranks):
        self.runtime, self.ranks = runtime, ranks
        self.outbox: list[dict] = []

    def step(self, message: dict) -> None:
        """One decode step of base model ``message["decode"]`` with the requests handed to this
        rank joining it; then the requests finished here go to rank 0."""
        runtime = self.runtime
        host = runtime.hosts[message["decode"]]
        batch = runtime.batch(host)
        for wire in message["jobs"]:
            if wire["rank"] != self.ranks.rank:
                continue
            try:
                adapter = adapter_of(runtime, host, wire["target"])
            except SessError as exc:
                self._done(wire["id"], None, None, exc)
                continue
            params = SamplingParams.from_wire(wire["params"])
            job = SampleJob(
                prompt=wire["prompt"],
                num_samples=wire["num_samples"],
                params=params,
                adapter=adapter,
                stopper=StopChecker(params.stop, host.eos_ids, host.tokenizer.decode),
                on_done=_nothing,
                prompt_logprobs=wire["prompt_logprobs"],
            )
            job.on_done = partial(self._done, wire["id"], job)
            batch.submit(job)
        if batch.active:
            try:
                with runtime.sampling():
                    batch.step()
            except Exception as exc:  # as rank 0's executor: the step's requests fail, not the engine
                batch.fail_all(SessError(f"sampling failed inside the engine: {type(exc).__name__}: {exc}"))
        outbox, self.outbox = self.outbox, []
        exchange(self.ranks, {"done": outbox, "cache_bytes": cache_bytes(batch)})

    def _done(self, id: int, job: SampleJob | None, sequences, error) -> None:
        entry: dict = {"id": id, "seconds": job.seconds if job else 0.0}
        if error is not None:
            entry.update(error=str(error), status=getattr(error, "status", 500))
        else:
            entry["sequences"] = [
                {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason} for s in sequences
            ]
            entry["prompt_result"] = job.prompt_result
        self.outbox.append(entry)


def cache_bytes(batch: DecodeBatch) -> int:
    """Bytes of ``batch``'s KV cache now (the llama decoder's block buffers; 0 for another cache)."""
    cache = batch.cache
    tensors = (getattr(cache, "keys", None) or []) + (getattr(cache, "values", None) or [])
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def report(ranks: Ranks) -> dict:
    """Per rank, over every base model: the rows it decoded and its KV cache's peak bytes."""
    rows, peak = [0] * ranks.world, [0] * ranks.world
    for spread in ranks.spreads:
        rows = [a + b for a, b in zip(rows, spread.rows)]
        peak = [max(a, b) for a, b in zip(peak, spread.peak_cache)]
    return {"rows_decoded": rows, "peak_kv_cache_bytes": peak}


def exchange(ranks: Ranks, mine) -> list:
    """Every rank's ``mine`` (JSON), in rank order, on every rank: one all-gather of the sizes, one
    of the payloads padded to the largest."""
    data = json.dumps(mine).encode()
    device = ranks.comm_device
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(ranks.world)]
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    ranks.collective("gathering samples", lambda: dist.all_gather(sizes, size))
    longest = max(int(s.item()) for s in sizes)
    payload = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(ranks.world)]
    ranks.collective("gathering samples", lambda: dist.all_gather(parts, payload))
    return [
        json.loads(part[: int(n.item())].cpu().numpy().tobytes().decode()) for part, n in zip(parts, sizes)
    ]
