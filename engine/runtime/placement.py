"""Where the engine's work runs: in this one process, or over several ranks of torch.distributed.

The runtime holds one :class:`Placement`, chosen when it starts (:class:`~.runtime.Runtime`): a
:class:`SingleProcess` by default, or the :class:`~sess.engine.runtime.distributed.ranks.Ranks` of
an engine started with ``--nproc``/``--nnodes``. The ops call its methods wherever the ranks have a
part to play (the base weights and adapters sharded with FSDP2, a batch's datums shared out, the
checkpoint adapters every rank holds for sampling, a sample request decoded on another rank), and
never ask which placement it is: in one process each method does what a single process does,
mostly nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from sess.engine.runtime.batched_forward import plan

if TYPE_CHECKING:
    from sess.engine.protocol.requests import Request
    from sess.engine.protocol.types import Datum
    from sess.engine.runtime.models.model_host import ModelHost
    from sess.engine.runtime.runtime import Runtime
    from sess.engine.runtime.session import Session
    from sess.engine.sampling.decode_batch import DecodeBatch

MicroBatches = list[tuple[list[int], list]]  # batched_forward.plan's: (padded indices, groups) each


class Placement(Protocol):
    """What the runtime and its ops ask of the processes they run on."""

    rank: int  # this process's rank (0 in one process)
    world: int  # how many ranks the engine has

    @property
    def leader(self) -> bool:
        """Whether this process serves, writes the files and leads the others (rank 0)."""
        ...

    # the runtime -----------------------------------------------------------------------------------
    def load_host(self, name: str, make: Callable[[], Any], missing: type[Exception]) -> Any:
        """Base model ``name`` in memory, made by ``make`` (``missing``: its refusal)."""
        ...

    def prepare(self, runtime: Runtime, name: str, owner: str, request: Request | None) -> Request | None:
        """Before op ``name`` runs: the request to run."""
        ...

    def full_weights(self) -> None:
        """This process is about to use every base weight alone (a decode step, ``compute_logprobs``)."""
        ...

    # sessions and checkpoints ----------------------------------------------------------------------
    def add_adapter(self, session: Session, host: ModelHost) -> None:
        """``session``'s new adapter (``session.params`` set) placed where it trains."""
        ...

    def forget_adapter(self, adapter: str) -> None:
        """A stopped session's adapter is gone."""
        ...

    def share_samplers(self, host: ModelHost) -> None:
        """``host``'s set of checkpoint adapters held for sampling changed."""
        ...

    def adapter_gathered(self, session: Session) -> AbstractContextManager[None]:
        """``session``'s whole adapter in peft's modules inside the block."""
        ...

    def collecting(
        self, session: Session, *, optimizer: bool, merge: bool
    ) -> AbstractContextManager[Callable[[torch.Tensor], torch.Tensor]]:
        """The block reads ``session``'s adapter as whole tensors for a checkpoint (AdamW's moments
        too: ``optimizer``; a merged model: ``merge``); it gets what makes a tensor whole."""
        ...

    # training --------------------------------------------------------------------------------------
    def plan(
        self, datums: list[Datum], max_positions: int, *, share_prefixes: bool, repeat_cost: float
    ) -> MicroBatches:
        """This process's micro-batches of ``datums`` (:func:`.batched_forward.plan`); an empty
        ``([], [])`` is a round this process joins without datums of its own (:meth:`idle_round`)."""
        ...

    def checked_first(self, datums: list[Datum]) -> list[int]:
        """Datums a backward op checks against the memory budget before its micro-batches, so that
        every process refuses it alike."""
        ...

    def root_gathered(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        """``model``'s embeddings, final norm and output layer whole inside a training op."""
        ...

    def idle_round(self, decoder: torch.nn.Module, backward: bool, run: Callable) -> None:
        """A round of a training op with no datums here: join the others' collectives."""
        ...

    def gather_logprobs(self, logprobs: list[torch.Tensor | None], datums: list[Datum]) -> list[torch.Tensor]:
        """Every datum's logprobs, from each process's share."""
        ...

    def combined_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The whole adapter's gradient norm from this process's norm of its part."""
        ...

    # sampling --------------------------------------------------------------------------------------
    def spread_decoding(self, batch: DecodeBatch, base_model: str) -> None:
        """``batch`` (``base_model``'s decode batch) is about to take a request."""
        ...


class SingleProcess:
    """The whole engine in this process: every weight, adapter and datum is here."""

    rank = 0
    world = 1

    @property
    def leader(self) -> bool:
        return True

    def load_host(self, name: str, make: Callable[[], Any], missing: type[Exception]) -> Any:
        return make()

    def prepare(self, runtime: Runtime, name: str, owner: str, request: Request | None) -> Request | None:
        return request

    def full_weights(self) -> None:
        pass

    def add_adapter(self, session: Session, host: ModelHost) -> None:
        pass

    def forget_adapter(self, adapter: str) -> None:
        pass

    def share_samplers(self, host: ModelHost) -> None:
        pass

    def adapter_gathered(self, session: Session) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def collecting(
        self, session: Session, *, optimizer: bool, merge: bool
    ) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
        yield lambda tensor: tensor

    def plan(
        self, datums: list[Datum], max_positions: int, *, share_prefixes: bool, repeat_cost: float
    ) -> MicroBatches:
        return plan(datums, max_positions, share_prefixes=share_prefixes, repeat_cost=repeat_cost)

    def checked_first(self, datums: list[Datum]) -> list[int]:
        return []  # each micro-batch is checked as it is planned

    def root_gathered(self, model: torch.nn.Module) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def idle_round(self, decoder: torch.nn.Module, backward: bool, run: Callable) -> None:
        pass  # one process plans no empty rounds

    def gather_logprobs(self, logprobs: list[torch.Tensor | None], datums: list[Datum]) -> list[torch.Tensor]:
        return logprobs

    def combined_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def spread_decoding(self, batch: DecodeBatch, base_model: str) -> None:
        pass


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this process's memory behind ``tensors`` (shared storage counted once; a DTensor's
    local shard)."""
    storages = {}
    for tensor in tensors:
        storage = local(tensor).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
