"""A training session: one LoRA adapter on a shared base model, its AdamW state and its counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sess.engine.sdk.types import SessionStatus, TrainingSessionSummary, Usage

if TYPE_CHECKING:
    from sess.engine.runtime.distributed_adapters import FlatShard


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
    saves: int = 0
    usage: Usage = field(default_factory=Usage)
    optimizer: torch.optim.AdamW | None = None
    params: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    shard: FlatShard | None = None  # several ranks: this rank's slice of the adapter, what AdamW steps

    @property
    def live(self) -> bool:
        return self.status == SessionStatus.Running

    def add_usage(self, usage: Usage) -> None:
        """Count one op of this session (see :mod:`.usage`)."""
        self.usage = self.usage.add(usage)
        self.last_active = time.time()

    def trainable(self) -> list[torch.nn.Parameter]:
        """What AdamW steps: the adapter's parameters, or with several ranks this rank's slice."""
        return [self.shard.param] if self.shard is not None else list(self.params.values())

    def new_optimizer(self) -> None:
        """A fresh AdamW over the adapter's parameters (its moments start at zero)."""
        self.optimizer = torch.optim.AdamW(self.trainable(), lr=1e-4, foreach=False)

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
