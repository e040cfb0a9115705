"""The loop modules by name: ``loop.name`` in a config picks one (an explicit dict, no plugin system)."""

from __future__ import annotations

from . import grpo, importance_sampling, kto, ppo, sft

LOOPS = {
    "sft": sft,
    "grpo": grpo,
    "ppo": ppo,
    "importance_sampling": importance_sampling,
    "kto": kto,
}
