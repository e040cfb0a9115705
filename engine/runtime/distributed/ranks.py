"""Several ranks of one engine on torch.distributed: rank 0 serves and leads, the others follow.

Rank 0's executor runs every op as a single-process engine does; before an op that changes what
all ranks hold (the op table's ``followed`` column: sessions, training, loading state) it broadcasts the op's typed
request as JSON (``to_wire``; never pickle) and the other ranks run the same handler on it
(:mod:`sess.engine.runtime.distributed.follower`). Each base model is sharded with FSDP2 ``fully_shard`` (each decoder
layer, then the whole model); each session's LoRA adapter is one FSDP2 unit of its own, and its
AdamW moments are sharded as its parameters are (:mod:`sess.engine.runtime.distributed.adapter_shards`), so a rank holds 1/N
of the base weights, of every adapter and of its AdamW state. Every rank computes its share of a
batch's datums (:meth:`Ranks.plan`) with the adapter gathered for the op; the adapter's gradients
are reduce-scattered as sums once, after the op's last backward pass (token-sum losses stay sums,
nothing is divided by the world size), each rank's AdamW steps its shards, and
``grad_clip_norm`` uses the norm of the whole adapter (:meth:`Ranks.combined_norm`).

Sampling runs on every rank with every weight gathered (:meth:`Ranks.full_weights`, one
all-gather every rank joins and keeps until the next followed op): rank 0 hands whole sample
requests to the ranks and gathers back what they finished (:mod:`sess.engine.runtime.distributed.sample_spread`); the
sampler's batch invariance makes that exactly what one rank gives for the same seed.
``compute_logprobs`` requests waiting together are handed out the same way, whole, on the same
gathered weights (:mod:`sess.engine.runtime.distributed.logprob_spread`). Checkpoints
(adapter, AdamW moments, merged models) are written by rank 0 from whole tensors that every rank
helps gather (:meth:`Ranks.announce`, then ``checkpoint_ops.whole_adapter`` on every rank): the
same files as one process writes, and loading one gives each rank its share.

A collective that fails (a rank died) raises :class:`RankFailed`; the launcher
(:mod:`sess.engine.runtime.distributed.launch`) then stops the engine and its sessions become Interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from sess.engine.libraries import torch_internals
from sess.engine.protocol.errors import SessError
from sess.engine.protocol.requests import Request
from sess.engine.protocol.types import Datum
from sess.engine.runtime.batched_forward import plan as plan_batches
from sess.engine.runtime.checkpoints.checkpoint_files import read_state
from sess.engine.runtime.distributed.adapter_shards import AdapterShards, gathered
from sess.engine.runtime.distributed.sample_spread import Spread
from sess.engine.runtime.ops.checkpoint_ops import checkpoint_dir
from sess.engine.runtime.ops.session_ops import default_name
from sess.engine.runtime.ops.table import OPS

log = logging.getLogger("sess.engine")

# A follower waits in a broadcast for rank 0's next op for as long as the engine idles, so the
# collectives' timeout must not end an idle engine; a dead rank is found by the agent (its process
# exited) and by the broken connection (the collective fails at once), not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(days=365)


class RankFailed(SessError):
    """A collective failed: another rank died or stopped answering. The engine cannot continue."""

    def __init__(self, what: str, exc: BaseException):
        super().__init__(
            f"rank {dist.get_rank()} of {dist.get_world_size()}: {what} failed ({type(exc).__name__}: "
            f"{str(exc)[:200]}); another rank died or stopped answering. The engine is stopping; its "
            "sessions become Interrupted: start it again and resume them from their last saved state",
            status=503,
        )


class Ranks:
    """This process's place among the engine's ranks (from the environment the elastic agent sets):
    the runtime's :class:`~sess.engine.runtime.placement.Placement` on an engine of several ranks."""

    def __init__(self, device: str = "cpu"):
        cuda = device.startswith("cuda")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = f"cuda:{local_rank}" if cuda else "cpu"
        self.comm_device = torch.device(self.device)
        self.mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        pids = torch.zeros(self.world, dtype=torch.long, device=self.comm_device)
        pids[self.rank] = os.getpid()
        self.collective("startup", lambda: dist.all_reduce(pids))
        self.pids = [int(p) for p in pids.tolist()]
        self.modules: list[Any] = []  # every FSDP module of every base model, in load order
        self.adapters = AdapterShards(self)
        self.spreads: list = []  # rank 0: each base model's sample requests over the ranks (distributed_sampling)
        self.scored = None  # rank 0: compute_logprobs requests and tokens per rank (distributed_logprobs)
        self.samplers_sent: dict[
            str, set[str]
        ] = {}  # rank 0: base model -> checkpoint adapters the followers hold
        self.gathered = False  # rank 0 holds the base weights gathered
        self.announced: dict | None = None  # a follower's pending host announcement
        self.closing = False
        self.failed = False  # a collective failed: another rank is gone

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Rank 0: tell the followers to stop; every rank: leave the process group."""
        self.closing = True
        try:
            if self.leader:
                from sess.engine.runtime.distributed.launch import MASTER_ENV
                from sess.engine.runtime.distributed.nodes import announce_stop

                if not self.failed:  # other hosts' agents: a stop as asked, not a failure
                    announce_stop(os.environ.get(MASTER_ENV))
                self.send({"stop": True})
            dist.destroy_process_group()
        except (RuntimeError, RankFailed):  # a rank already gone: nothing left to tell
            pass

    # messages --------------------------------------------------------------------------------------
    def collective(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except RuntimeError as exc:  # gloo/NCCL report a lost peer as RuntimeError (DistBackendError)
            self.failed = True
            if self.leader and not self.closing:  # stop serving (gracefully), so the agent stops every rank
                os.kill(os.getpid(), signal.SIGTERM)
            raise RankFailed(what, exc) from exc

    def send(self, message: dict) -> None:
        """Rank 0: broadcast ``message`` (JSON) to the followers."""
        data = json.dumps(message).encode()
        size = torch.tensor([len(data)], dtype=torch.long, device=self.comm_device)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.comm_device)
        self.collective("sending an op", lambda: (dist.broadcast(size, 0), dist.broadcast(payload, 0)))

    def receive(self) -> dict:
        """A follower: the next message rank 0 broadcasts."""
        size = torch.zeros(1, dtype=torch.long, device=self.comm_device)
        self.collective("receiving an op", lambda: dist.broadcast(size, 0))
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self.comm_device)
        self.collective("receiving an op", lambda: dist.broadcast(payload, 0))
        return json.loads(payload.cpu().numpy().tobytes().decode())

    # what rank 0 does before an op -----------------------------------------------------------------
    def prepare(self, runtime, name: str, owner: str, request: Request | None) -> Request | None:
        """Rank 0, before running op ``name``: followed ops go to every rank (sharded weights), with
        the choices a handler would make at random made here (:func:`_decided`). Returns the
        request to run. (Ops on the base weights alone gather them where they use them: decode
        steps and ``compute_logprobs`` call :meth:`full_weights`.)"""
        if not self.leader:
            return request
        if OPS[name].followed:
            request = _decided(runtime, name, owner, request)
            self.sharded()
            self.forget_forward_order()
            wire = request.to_wire() if request is not None else {}
            wire.update({field: getattr(request, field) for field in getattr(request, "envelope", ())})
            self.send({"op": name, "owner": owner, "request": wire})
        return request

    # sharding --------------------------------------------------------------------------------------
    def load_host(self, name: str, make: Callable[[], Any], missing: type[Exception]) -> Any:
        """Load base model ``name`` on every rank (rank 0 first, so one process builds a cache) and
        shard it. Rank 0 announces the outcome; a follower takes it from a pending announcement
        (its loop) or receives it here (inside a followed op)."""
        if self.leader:
            was_gathered = self.gathered
            self.sharded()
            try:
                host = make()
            except missing:
                self.send({"host": name, "ok": False})
                raise
            self.send({"host": name, "ok": True})
        else:
            message, self.announced = self.announced or self.receive(), None
            if message.get("host") != name:
                raise RankFailed("following rank 0", RuntimeError(f"expected model {name}, got {message}"))
            if not message["ok"]:
                raise missing(f"{name} could not be loaded on rank 0")
            host = make()
        self.shard(host.model)
        host.shares_prefixes = False  # every rank runs the same number of model calls: see plan()
        if self.leader and was_gathered:
            self.full_weights()
        return host

    def shard(self, model: torch.nn.Module) -> None:
        """FSDP2: each decoder layer its own unit (its weights gathered only while it runs), then the
        rest (embeddings, final norm, output layer) as the root."""
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None) or []
        units = [fully_shard(layer, mesh=self.mesh) for layer in layers]
        units.append(fully_shard(model, mesh=self.mesh))
        self.modules += units
        # FSDP picks its root at the first forward through it: make that the whole model's (every
        # rank, in the same op), since training runs the decoder and the output layer apart
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.comm_device))
        model.reshard()

    def full_weights(self) -> None:
        """Rank 0: gather every base model's weights for work of its own (the followers join the
        all-gather and drop their copies at once). Gathered weights stay until :meth:`sharded`, or
        until a state dict is read or loaded (peft does, for adapter weights): FSDP then registers
        the shards again, and the next call gathers anew. peft reads and loads the whole model's
        state dict, so a base unit's shards show it; the adapters' units get theirs back with
        them."""
        if not self.modules or (self.gathered and not self._any_sharded()):
            return
        self.sharded()
        self.send({"gather": True})
        self._unshard()
        self.adapters.gather_all()
        self.gathered = True

    def join_gather(self) -> None:
        """A follower: take part in rank 0's gather, and keep the whole weights as rank 0 does: it
        decodes its share of the sample requests on them (:mod:`sess.engine.runtime.distributed.sample_spread`) until the
        next message that needs the shards (:meth:`sharded` first, as rank 0 before sending it)."""
        self.sharded()
        self._unshard()
        self.adapters.gather_all()
        self.gathered = True

    def sharded(self) -> None:
        """Drop the gathered weights (local), so the next forward all-gathers with the others."""
        if self.gathered:
            self._reshard()
            self.adapters.release_all()
            self.gathered = False

    def forget_forward_order(self) -> None:
        """Every rank, before a followed op: drop what FSDP2 recorded of the forward passes since the
        last backward pass. It prefetches a backward pass's all-gathers in the reverse order of the
        forward passes it recorded, and ranks run forward passes through the units that the others do not
        (``compute_logprobs`` requests on the gathered weights), so without this the ranks' next backward
        passes would prefetch different units and their all-gathers would not pair (rank 0 hung
        in an idle round's prefetch while rank 1 reduce-scattered)."""
        units = self.modules + [shard.unit for shard in self.adapters.shards.values()]
        for unit in units:
            torch_internals.fsdp_forget_forward_order(unit)

    def _any_sharded(self) -> bool:
        return any(isinstance(p, DTensor) for module in self.modules for p in module.parameters())

    def _unshard(self) -> None:
        for module in self.modules:
            self.collective("gathering weights", module.unshard)
            module.set_reshard_after_forward(False, recurse=False)

    def _reshard(self) -> None:
        for module in self.modules:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)

    # a batch across ranks --------------------------------------------------------------------------
    def share(self, count: int, rank: int | None = None) -> range:
        """The datum indices rank ``rank`` (this one by default) computes: a contiguous share."""
        rank = self.rank if rank is None else rank
        return range(count * rank // self.world, count * (rank + 1) // self.world)

    def plan(
        self, datums: list[Datum], max_positions: int, *, share_prefixes: bool, repeat_cost: float
    ) -> list[tuple[list[int], list]]:
        """This rank's micro-batches (global datum indices, at most ``max_positions`` positions each:
        the memory budget's), plus empty ``([], [])`` rounds up to the largest rank's count: every
        rank must make the same model calls, as each one all-gathers weights (forward and backward)
        with the others, so none shares a prefix (``share_prefixes``, ``repeat_cost`` do not apply)."""
        plans = []
        for rank in range(self.world):
            mine = list(self.share(len(datums), rank))
            local = (
                plan_batches([datums[i] for i in mine], max_positions, share_prefixes=False) if mine else []
            )
            plans.append([([mine[i] for i in padded], []) for padded, _ in local])
        rounds = max(len(p) for p in plans)
        return plans[self.rank] + [([], [])] * (rounds - len(plans[self.rank]))

    def checked_first(self, datums: list[Datum]) -> list[int]:
        """The whole batch's longest datum: every rank refuses a backward op on it alike, or none does."""
        return [max(range(len(datums)), key=lambda i: datums[i].model_input.length)]

    def idle_round(self, decoder: torch.nn.Module, backward: bool, run: Callable) -> None:
        """A decoder call (and its backward) on one token for a rank with fewer micro-batches: it
        joins the others' weight gathers (the decoder layers'; the root's are held for the op, see
        :meth:`root_gathered`) and, through ``run`` (the adapter's FSDP2 unit, as a real
        micro-batch's decoder pass), adds exact zeros to the adapter's gradients (and, in the op's
        last round, joins their reduce-scatter)."""
        device = decoder.get_input_embeddings().weight.device
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        hidden = run(lambda: decoder(input_ids=ids).last_hidden_state)
        if backward and hidden.requires_grad:  # as a real micro-batch's backward_from
            (hidden.float().sum() * 0.0).backward()

    @contextlib.contextmanager
    def root_gathered(self, model: torch.nn.Module) -> Iterator[None]:
        """``model``'s root FSDP unit (embeddings, final norm, output layer) gathered inside the block
        (every rank enters it in the same op): training calls the decoder and the output layer
        apart, not the root's forward that would gather them. The decoder layers gather their own
        weights as they run. Nothing to do while rank 0 holds every weight gathered already.

        The root stays gathered through every micro-batch of the op: FSDP2's callback at the end of
        a backward pass reshards each unit of the tree, the root included by default, and the next
        micro-batch's embedding would then meet the root's shards."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(model, FSDPModule) or not isinstance(model.get_input_embeddings().weight, DTensor):
            yield
            return
        self.collective("gathering weights", model.unshard)
        model.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            model.set_reshard_after_backward(True, recurse=False)
            model.reshard()

    def gather_logprobs(self, logprobs: list[torch.Tensor | None], datums: list[Datum]) -> list[torch.Tensor]:
        """Every datum's logprobs on every rank: each rank fills its own, zeros elsewhere, summed."""
        lengths = [d.model_input.length for d in datums]
        flat = torch.zeros(sum(lengths), dtype=torch.float32, device=self.comm_device)
        start = 0
        for lp, length in zip(logprobs, lengths):
            if lp is not None:
                flat[start : start + length] = lp.detach().float().to(self.comm_device)
            start += length
        self.collective("gathering logprobs", lambda: dist.all_reduce(flat))
        return [part.cpu() if self.device == "cpu" else part for part in flat.split(lengths)]

    # sessions' adapters ----------------------------------------------------------------------------
    def add_adapter(self, session, host) -> None:
        """Every rank shards a new adapter (a followed op): 1/N of it on each; AdamW steps the shards."""
        session.shard = self.adapters.add(session.adapter, session.params, host.peft)
        session.params = dict(zip(session.params, session.shard.params))

    def forget_adapter(self, adapter: str) -> None:
        self.adapters.forget(adapter)

    def adapter_gathered(self, session) -> contextlib.AbstractContextManager[None]:
        return gathered(session.shard)  # every rank gathers the adapter for the block

    @contextlib.contextmanager
    def collecting(self, session, *, optimizer: bool, merge: bool) -> Iterator[Callable]:
        """Whole tensors of ``session`` for a checkpoint: rank 0 announces the gather, every rank joins
        each all-gather in the same order (followers from their loop); a merge gathers the adapter."""
        self.announce({"collect": session.name, "optimizer": optimizer, "merge": merge})
        with gathered(session.shard) if merge else contextlib.nullcontext():
            yield self.adapters.full

    def spread_decoding(self, batch, base_model: str) -> None:
        """Rank 0's decode batch of ``base_model`` hands requests to the other ranks (sample_spread.py)."""
        if batch.spread is None:
            batch.spread = Spread(self, base_model)

    def share_samplers(self, host) -> None:
        """Rank 0: after its set of checkpoint adapters for sampling (``host.checkpoint_adapters``)
        changed, give every follower the same set (``{"samplers", "base_model"}``; a follower loads
        what it lacks from the shared home and drops what rank 0 dropped), so any rank handed a
        request for a checkpoint (named, transient or opened by path) can serve it. Every rank
        reshards first: loading an adapter reads the model's state dict, which hands FSDP2 units
        their shards back, and the next gather must find every rank alike."""
        uris = list(host.checkpoint_adapters)
        if not self.leader or self.samplers_sent.get(host.name, set()) == set(uris):
            return
        self.sharded()
        self.send({"samplers": uris, "base_model": host.name})
        self.samplers_sent[host.name] = set(uris)

    def announce(self, message: dict) -> None:
        """Rank 0: tell the followers to join a gather of whole tensors (``{"collect": ...}``, see
        :func:`sess.engine.runtime.ops.checkpoint_ops.whole_adapter`), every FSDP unit sharded first so that all ranks
        start it from the same state."""
        if self.leader:
            self.sharded()
            self.send(message)

    def combined_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm of a vector sharded over the ranks, from each rank's norm of its share."""
        squares = (norm.float() ** 2).reshape(1).to(self.comm_device)
        self.collective("combining gradient norms", lambda: dist.all_reduce(squares))
        return squares[0].sqrt().cpu()


def _decided(runtime, name: str, owner: str, request: Request) -> Request:
    """``request`` with what its handler would pick at random (a session's default name, its LoRA
    seed) picked once here, so every rank creates the same session."""
    if name == "create_session" and (request.name is None or request.seed is None):
        return dataclasses.replace(
            request,
            name=request.name or default_name(request.base_model),
            seed=secrets.randbits(31) if request.seed is None else request.seed,
        )
    if name == "create_session_from_state" and request.name is None:
        try:
            meta = read_state(checkpoint_dir(runtime, owner, request.path))[3]
        except (SessError, OSError, ValueError):
            return request  # every rank's handler refuses it alike
        return dataclasses.replace(request, name=default_name(meta["base_model"]))
    return request
