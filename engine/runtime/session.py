"""A training session: one LoRA adapter on a shared base model, its AdamW state and its counters."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sess.engine.protocol.types import SessionStatus, TrainingSessionSummary, Usage


def adamw_step_dtype() -> torch.dtype:
    """The dtype of AdamW's ``step`` on CPU, as AdamW picks it at a parameter's first step."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def flat_views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut, in order, into views shaped as the tensors of ``like``."""
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in like]), like)]


class FlatState:
    """An adapter's gradients and AdamW moments, each in one flat buffer that the parameters' own
    tensors are views of, where autograd and AdamW would make one small tensor per parameter (420 on
    smollm2) at every backward pass and at the first step, scattered between the step's activations.
    On CPU, the heap that glibc keeps while the engine works was fragmented by those: an SFT step of
    4 x 1024 tokens after a GRPO step grew it to 1.66 GiB while at most 0.55 GiB of it was in use
    (benchmarks/README.md). A flat buffer is large enough to be mapped on its own, outside the heap.

    The moments are made when the session starts and kept (AdamW keeps them from its first step
    anyway); a gradient buffer is made for a backward pass and goes when the gradients are cleared
    (the parameters' ``grad`` views are all that hold it)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.total = sum(p.numel() for p in params)
        self.device = params[0].device if params else torch.device("cpu")
        self.exp_avg, self.exp_avg_sq = (self._zeros() for _ in range(2))

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(self.total, dtype=torch.float32, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return flat_views(flat, self.params)

    def init_adamw(self, optimizer: torch.optim.AdamW) -> None:
        """AdamW's state as it would make it at a parameter's first step, in the flat buffers."""
        for p, exp_avg, exp_avg_sq in zip(self.params, self.views(self.exp_avg), self.views(self.exp_avg_sq)):
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=adamw_step_dtype()),
                "exp_avg": exp_avg,
                "exp_avg_sq": exp_avg_sq,
            }

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """A backward pass accumulates into a gradient buffer (a new one for parameters without a
        gradient yet); a parameter no gradient reached is left without one (``grad`` None), as
        autograd leaves it."""
        fresh = {id(p) for p in self.params if p.grad is None and p.requires_grad}
        reached: set[int] = set()
        hooks = []
        if fresh:
            for p, grad in zip(self.params, self.views(self._zeros())):
                if id(p) in fresh:
                    p.grad = grad
                    hooks.append(p.register_post_accumulate_grad_hook(lambda p: reached.add(id(p))))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for p in self.params:
                if id(p) in fresh and id(p) not in reached:
                    p.grad = None


@dataclass
class Session:
    name: str
    owner: str
    base_model: str
    lora: dict
    adapter: str = ""  # peft adapter name: engine-chosen, since session names may hold '.' or 'lora'
    user_metadata: dict | None = None
    status: SessionStatus = SessionStatus.Running
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    step: int = 0
    saved_step: int | None = None  # the step of its newest save_state (None: none yet)
    saves: int = 0
    usage: Usage = field(default_factory=Usage)
    optimizer: torch.optim.AdamW | None = None
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    # several ranks: the adapter's FSDP2 unit, a distributed/adapter_shards.ShardedAdapter (AdamW steps its
    # shards); None in one process
    shard: Any = None
    flat: FlatState | None = None  # one rank: the adapter's gradients and AdamW moments, flat

    @property
    def live(self) -> bool:
        return self.status == SessionStatus.Running

    def add_usage(self, usage: Usage) -> None:
        """Count one op of this session (see :mod:`.usage`)."""
        self.usage = self.usage.add(usage)
        self.last_active = time.time()

    def trainable(self) -> list[torch.nn.Parameter]:
        """What AdamW steps: the adapter's parameters (with several ranks, their shards)."""
        return list(self.params.values())

    def new_optimizer(self) -> None:
        """A fresh AdamW over the adapter's parameters (its moments start at zero). With one rank,
        its moments and the gradients live in flat buffers (:class:`FlatState`); several ranks'
        shards are FSDP2's."""
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=1e-4, foreach=False)
        self.flat = None
        if self.shard is None:
            self.flat = FlatState(self.trainable())
            self.flat.init_adamw(self.optimizer)

    def accumulating(self) -> contextlib.AbstractContextManager:
        """Around a backward pass: see :meth:`FlatState.accumulating`."""
        return self.flat.accumulating() if self.flat is not None else contextlib.nullcontext()

    def summary(self) -> dict:
        return TrainingSessionSummary(
            name=self.name,
            base_model=self.base_model,
            status=self.status,
            created=self.created,
            last_active=self.last_active,
            step=self.step,
            usage=self.usage,
            user_metadata=self.user_metadata,
            lora=self.lora,
        ).to_wire()
