"""Sessions' LoRA adapters sharded over the ranks: each rank holds 1/N of every adapter and its AdamW.

Every rank creates a session's adapter (``create_session`` is a followed op); :meth:`AdapterShards.add`
then flattens its parameters (fp32, in peft's order) into one vector padded to a multiple of N and
keeps this rank's contiguous slice as the session's only trainable parameter (:class:`FlatShard`):
AdamW, built over that slice, holds 1/N of the moments, and the peft parameters hold nothing
between ops. A training op gathers the adapter (one all-gather) into the peft parameters, runs its
micro-batches, reduce-scatters the gradients with a plain sum into the slice's gradient (token-sum
losses stay sums; nothing is divided by the world size) and drops the whole copy again. AdamW is
elementwise, so each rank stepping its slice is the one-rank step; ``grad_clip_norm`` uses the norm
of the whole adapter (the slices' squared norms summed over the ranks).

Why not FSDP2 ``fully_shard`` over the LoRA modules (as for the base weights): adapters come and
go after the base model's FSDP root has run, so each unit made later is its own root, and FSDP2
refuses a grouped ``fully_shard([...])`` as a root ("requires a single root module"). One unit per
LoRA module does train on two ranks equal to one, until a rank runs an idle round (a rank without a
datum joins the others' model calls on one token): FSDP2 then issues the LoRA units' all-gathers
and reduce-scatters from autograd hooks in each rank's own backward order, and the ranks' collectives
no longer pair (seen with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: rank 0 all-gathering a decoder layer,
18,496 values, while rank 1 all-gathers a LoRA shard, 128 values). Here the adapter's collectives
happen at fixed points of an op, the same on every rank whatever its share of the batch.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from sess.engine.runtime.distributed import Ranks


class FlatShard:
    """This rank's slice of one adapter (``param``, AdamW's parameter) and the adapter's peft
    parameters, which hold the whole weights only between :meth:`gather` and :meth:`release`."""

    def __init__(self, ranks: Ranks, params: list[torch.nn.Parameter]):
        self.ranks, self.params = ranks, params
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.total = sum(self.sizes)
        self.size = -(-self.total // ranks.world)  # ceil: the slices are padded to equal sizes
        self.param = torch.nn.Parameter(self.mine(params))
        self.gathered = False
        self.release()

    def _padded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(
            self.size * self.ranks.world, dtype=torch.float32, device=torch.device(self.ranks.device)
        )
        flat[: self.total] = torch.cat(parts).to(flat.device)
        return flat

    def whole(self, local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slice of a flat tensor laid out as ``param`` (the parameter itself, or an
        AdamW moment) put together and cut into the adapter's parameters' shapes (an all-gather
        every rank joins)."""
        full = torch.empty(self.size * self.ranks.world, dtype=local.dtype, device=local.device)
        self.ranks.collective(
            "gathering an adapter", lambda: dist.all_gather_into_tensor(full, local.detach().contiguous())
        )
        return [part.view(shape) for part, shape in zip(full[: self.total].split(self.sizes), self.shapes)]

    def mine(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """This rank's slice of whole tensors laid out as the adapter's parameters (no communication)."""
        flat = self._padded([t.detach().reshape(-1).float() for t in tensors])
        start = self.ranks.rank * self.size
        return flat[start : start + self.size].clone()

    def gather(self) -> None:
        """The whole adapter into its peft parameters (every rank, in the same order)."""
        for p, part in zip(self.params, self.whole(self.param)):
            p.data = part.to(p.dtype)
        # Assigning ``.data`` swaps the storage but keeps the version counter, and what reads the
        # weights through a cache keyed on (identity, version) must see new values: the lean
        # decoder's LoRA plans (llama_decoder._versions) would otherwise sample a live session with
        # the weights of the first gather it saw.
        torch.autograd.graph.increment_version(self.params)
        self.gathered = True

    def reduce_grads(self) -> None:
        """Sum the peft parameters' gradients over the ranks into this slice's gradient (added to
        what earlier ops accumulated); a rank without one adds zeros."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._padded([g.reshape(-1).float() for g in grads])
        mine = torch.empty(self.size, dtype=torch.float32, device=flat.device)
        self.ranks.collective(
            "summing gradients", lambda: dist.reduce_scatter_tensor(mine, flat, op=dist.ReduceOp.SUM)
        )
        self.param.grad = mine if self.param.grad is None else self.param.grad + mine

    def release(self) -> None:
        """Drop the whole copy (local): the peft parameters hold nothing until the next gather."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
        torch.autograd.graph.increment_version(self.params)  # as in gather()
        self.gathered = False


@contextlib.contextmanager
def gathered(shard: FlatShard | None):
    """The adapter whole in its peft parameters for the block (every rank gathers it), only this
    rank's slice again after it; one rank (``shard`` None): nothing to do."""
    if shard is None:
        yield
        return
    shard.gather()
    try:
        yield
    finally:
        shard.release()


class AdapterShards:
    """Every session adapter's :class:`FlatShard` on this rank (peft adapter name -> its shard)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.shards: dict[str, FlatShard] = {}

    def add(self, adapter: str, params: dict[str, torch.nn.Parameter]) -> FlatShard:
        """Shard a new adapter (every rank, in the same followed op)."""
        self.shards[adapter] = FlatShard(self.ranks, list(params.values()))
        return self.shards[adapter]

    def forget(self, adapter: str) -> None:
        self.shards.pop(adapter, None)

    def gather_all(self) -> None:
        """Every adapter whole (rank 0 about to sample alone; the followers join, then drop theirs)."""
        for shard in self.shards.values():
            if not shard.gathered:
                shard.gather()

    def release_all(self) -> None:
        for shard in self.shards.values():
            if shard.gathered:
                shard.release()

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A base weight whole (an FSDP2 shard's all-gather, which every rank must join)."""
        if isinstance(tensor, DTensor):
            return self.ranks.collective("gathering weights", tensor.full_tensor)
        return tensor


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this process's memory behind ``tensors`` (shared storage counted once)."""
    storages = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
