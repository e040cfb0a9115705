"""Sessions' LoRA adapters sharded over the ranks with FSDP2, and their whole tensors when needed.

Every rank creates a session's adapter (``create_session`` is a followed op), then
:meth:`AdapterShards.shard` applies ``fully_shard`` to each of its LoRA modules (every
``lora_A``/``lora_B`` of the adapter): each rank holds 1/N of every adapter parameter, and AdamW,
built over those sharded (DTensor) parameters, holds 1/N of the moments. A training forward
all-gathers a LoRA module's weight as it runs; its backward reduce-scatters the gradient with a
plain sum (``set_gradient_divide_factor(1)`` and sum-only collectives, which gloo needs): token-sum
losses stay sums, nothing is divided by the world size.

Why one FSDP unit per LoRA module and not one per decoder layer: adapters come and go after the
base model's FSDP root has run (its lazy initialisation fixes which units it manages), so a unit
made later is its own root, and FSDP2 refuses a grouped ``fully_shard([...])`` as a root ("requires
a single root module"). A root does not reshard after forward, so :meth:`reshard` ends each
training op with every shard in place.

Whole tensors (checkpoints, merged models) are gathered with :meth:`full` (an all-gather every rank
joins in the same order: rank 0 announces each gather, :mod:`.distributed_follow`); a checkpoint read
from disk becomes this rank's share with :meth:`share` (no communication: every rank reads the file).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from sess.engine.sdk.errors import InvalidRequest

if TYPE_CHECKING:
    from sess.engine.runtime.distributed import Ranks
    from sess.engine.runtime.model_host import ModelHost


class AdapterShards:
    """The FSDP units of every session adapter on this rank (peft adapter name -> its LoRA modules)."""

    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.units: dict[str, list[torch.nn.Module]] = {}

    def shard(self, host: ModelHost, adapter: str) -> None:
        """Shard ``adapter``'s LoRA modules over the ranks (every rank, in the same followed op)."""
        from torch.distributed.fsdp import fully_shard

        modules = [
            holder[adapter]
            for module in host.peft.modules()
            for holder in (getattr(module, "lora_A", None), getattr(module, "lora_B", None))
            if isinstance(holder, torch.nn.ModuleDict) and adapter in holder
        ]
        for module in modules:
            fully_shard(module, mesh=self.ranks.mesh)
            module.set_gradient_divide_factor(1.0)  # token sums: the reduce-scatter sums, never averages
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        self.units[adapter] = modules
        self.ranks.modules += modules  # gathered with the base weights when rank 0 samples alone
        whole = [name for name, p in host.adapter_params(adapter).items() if not isinstance(p, DTensor)]
        if whole:  # e.g. embedding LoRA (parameter dicts, not modules): not sharded here
            self.forget(adapter)
            raise InvalidRequest(
                f"this LoRA layout has parameters an engine of several ranks cannot shard ({whole[0]}); "
                "train it on an engine of one rank"
            )

    def forget(self, adapter: str) -> None:
        """``adapter`` is being removed: its units leave the list of what gathers."""
        units = {id(m) for m in self.units.pop(adapter, [])}
        self.ranks.modules = [m for m in self.ranks.modules if id(m) not in units]

    def reshard(self, adapter: str) -> None:
        """Drop ``adapter``'s gathered weights (local): after a training op, only shards stay."""
        for module in self.units.get(adapter, []):
            module.reshard()

    @contextlib.contextmanager
    def gathered(self, adapter: str) -> Iterator[None]:
        """``adapter``'s modules with their whole weights registered inside the block (every rank
        enters it together, with every unit sharded: see :meth:`.Ranks.announce`)."""
        units = self.units.get(adapter, [])
        try:
            for module in units:
                self.ranks.collective("gathering an adapter", module.unshard)
            yield
        finally:
            for module in units:
                module.reshard()

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of ``tensor`` (an all-gather for a sharded one, which every rank must join)."""
        if isinstance(tensor, DTensor):
            return self.ranks.collective("gathering an adapter", tensor.full_tensor)
        return tensor

    def share(self, tensor: torch.Tensor) -> DTensor:
        """This rank's share of a whole adapter tensor, placed as FSDP2 places the parameters
        (``Shard(0)`` over the ranks); no communication."""
        return distribute_tensor(tensor, self.ranks.mesh, [Shard(0)], src_data_rank=None)


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this process's memory behind ``tensors`` (a sharded tensor's local share, padding
    included; shared storage counted once)."""
    storages = {}
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
