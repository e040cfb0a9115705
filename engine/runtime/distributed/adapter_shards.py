"""Sessions' LoRA adapters sharded over the ranks with FSDP2: each rank holds 1/N of every adapter
and of its AdamW state.

Every rank creates a session's adapter (``create_session`` is a followed op); :meth:`AdapterShards.add`
then puts the adapter's LoRA modules under one :class:`AdapterUnit` (a second parent: peft's layers
keep calling them) and applies FSDP2 ``fully_shard`` to it, so each of the adapter's parameters
becomes a DTensor sharded on its first dimension and the whole adapter is one FSDP2 unit: one
all-gather, one reduce-scatter. AdamW steps the sharded parameters (its moments are sharded alike),
and ``grad_clip_norm`` uses the norm of the whole adapter (the shards' squared norms summed over the
ranks).

A training op gathers the unit (:meth:`ShardedAdapter.gather`, every rank at the op's start) and
keeps it whole through the op: it is not resharded after a forward or a backward pass. Each
micro-batch's decoder pass runs inside the unit's forward (:meth:`ShardedAdapter.forward`). The
op's micro-batches accumulate whole gradients on each rank without communication (FSDP2's gradient
sync is off for them), and FSDP2's hook at the end of the last one's backward pass reduce-scatters
the sum into the shards' gradients, adding to what earlier ops left. The reduction is a plain sum
(gradient divide factor 1): token-sum losses stay sums, nothing is divided by the world size.

Why one unit per adapter, gathered for the whole op, rather than FSDP2's usual gather per module in
the forward and backward hooks: the ranks' collectives must pair, and a rank's model calls differ in
order from another's when one runs a checkpointed micro-batch (its backward pass recomputes the
layers' forwards) while the other runs a plain one or an idle round. One unit per LoRA module, as
first tried, let those orders differ (seen with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: rank 0
all-gathering a decoder layer, 18,496 values, while rank 1 all-gathered a LoRA shard, 128 values).
Here the adapter's collectives happen at fixed points, the same on every rank whatever its share of
the batch: the gather at the op's start, and one reduce-scatter at the end of the last round's
backward pass, which every rank runs (a rank with fewer micro-batches joins with idle rounds, so all
ranks have the same rounds). FSDP2 reduce-scatters the parameters that have a gradient; every
parameter gets one before the op's first backward pass (:meth:`ShardedAdapter.backward_round`), so
the ranks' reduce-scatters are the same size even where a rank ran only idle rounds, whose backward
passes reach no LoRA of the output layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

if TYPE_CHECKING:
    from sess.engine.runtime.distributed.ranks import Ranks

T = TypeVar("T")


class AdapterUnit(torch.nn.Module):
    """One adapter's LoRA modules as one FSDP2 unit. They stay where peft put them; this module is
    a second parent, whose forward runs a micro-batch's decoder pass (``run``) so that FSDP2's
    hooks see that pass's output."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__()
        self.lora = torch.nn.ModuleList(modules)

    def forward(self, run: Callable[[], T]) -> T:
        return run()


class ShardedAdapter:
    """One session's adapter sharded with FSDP2. ``params`` are the sharded parameters (DTensors, in
    peft's order): what AdamW steps. While gathered, peft's modules hold whole parameters instead."""

    def __init__(self, ranks: Ranks, params: dict[str, torch.nn.Parameter], model: torch.nn.Module):
        from torch.distributed.fsdp import fully_shard

        self.ranks = ranks
        modules = dict(model.named_modules())
        self.places: list[tuple[torch.nn.Module, str]] = []
        for name in params:
            owner, attr = name.rsplit(".", 1)
            self.places.append((modules[owner], attr))
        owners = list(dict.fromkeys(module for module, _ in self.places))
        if sum(len(list(m.parameters(recurse=False))) for m in owners) != len(params):
            raise ValueError("an adapter's LoRA modules hold parameters of another adapter")
        self.unit = AdapterUnit(owners)
        fully_shard(self.unit, mesh=ranks.mesh, reshard_after_forward=False)
        self.unit.set_reshard_after_backward(False)
        self.unit.set_gradient_divide_factor(1.0)  # sums: token-sum losses stay sums
        self.unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied one)
        self.params = self.current()

    def current(self) -> list[torch.nn.Parameter]:
        """The parameters peft's modules hold now: the shards, or the whole ones while gathered."""
        return [getattr(module, attr) for module, attr in self.places]

    @property
    def gathered(self) -> bool:
        """Whether peft's modules hold the whole parameters. Reading or loading a state dict that
        reaches them gives them their shards back (FSDP2's state-dict hooks), gathered or not."""
        return not any(isinstance(p, DTensor) for p in self.current())

    def gather(self) -> None:
        """The whole adapter into peft's modules (every rank, in the same order)."""
        self.ranks.collective("gathering an adapter", self.unit.unshard)
        # FSDP2 writes the gathered values into the same whole parameters each time and keeps their
        # version counters; what reads the weights through a cache keyed on (identity, version) must
        # see new values: the lean decoder's LoRA plans (llama_decoder._versions) would otherwise
        # sample a live session with the weights of the first gather it saw.
        torch.autograd.graph.increment_version(self.current())

    def release(self) -> None:
        """Drop the whole copy (local): peft's modules hold the shards again."""
        self.unit.reshard()

    def forward(self, run: Callable[[], T]) -> T:
        """A micro-batch's decoder pass through the unit: at the end of its backward pass, FSDP2
        reduce-scatters the adapter's gradients into the shards' (summed over the ranks)."""
        return self.unit(run)

    def backward_round(self, last: bool) -> None:
        """Before a round's backward pass (every rank, each round of an op): a zero gradient for
        every whole parameter without one, so that every rank reduce-scatters all of them (FSDP2
        takes the parameters that have a gradient); the gradients are synced only after the
        ``last`` round's, and until then add up in the whole parameters' gradients."""
        for param in self.current():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        self.unit.set_requires_gradient_sync(last, recurse=False)

    def parts(self, state: dict[str, torch.Tensor], like: dict[str, DTensor]) -> dict[str, torch.Tensor]:
        """A state dict of whole tensors as this rank's parts, each sharded as the parameter of its
        key in ``like`` (for peft to load: FSDP2's hooks load them into the shards); a key of no
        parameter stays as it is, for the load to refuse."""
        return {key: self.mine(value, like[key]) if key in like else value for key, value in state.items()}

    def mine(self, whole: torch.Tensor, like: DTensor) -> DTensor:
        """This rank's part of a whole tensor, sharded as ``like`` (a parameter), as a DTensor
        (local: every rank has the whole tensor)."""
        return distribute_tensor(
            whole.detach().float(), like.device_mesh, like.placements, src_data_rank=None
        )


@contextlib.contextmanager
def gathered(shard: ShardedAdapter | None) -> Iterator[None]:
    """The adapter whole in peft's modules for the block (every rank gathers it), only this rank's
    shards again after it; one rank (``shard`` None): nothing to do."""
    if shard is None:
        yield
        return
    shard.gather()
    try:
        yield
    finally:
        shard.release()


class AdapterShards:
    """Every session adapter's :class:`ShardedAdapter` on this rank (peft adapter name -> it)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.shards: dict[str, ShardedAdapter] = {}

    def add(
        self, adapter: str, params: dict[str, torch.nn.Parameter], model: torch.nn.Module
    ) -> ShardedAdapter:
        """Shard a new adapter (every rank, in the same followed op)."""
        self.shards[adapter] = ShardedAdapter(self.ranks, params, model)
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
        """A sharded tensor whole (a base weight, an adapter's weight or AdamW moment: an FSDP2
        shard's all-gather, which every rank must join); any other tensor as it is."""
        if isinstance(tensor, DTensor):
            return self.ranks.collective("gathering weights", tensor.full_tensor)
        return tensor
