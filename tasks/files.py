"""Reading a task's JSONL files and the seeded order their items are visited in.

Every reader names the file and line of a bad record and the key it lacks. A training set is walked
endlessly, each epoch in a fresh permutation seeded by (seed, epoch), so item k is a pure function of
(seed, k) and a resumed run sees the same order; ``shuffle=False`` keeps file order.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path


def read_jsonl(path: str | Path, parse: Callable) -> list:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"data.path: no such file {str(path)!r}")
    items = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
                items.append(parse(record, f"{path}:{n}"))
    if not items:
        raise ValueError(f"data.path: {path} holds no examples")
    return items


def train_and_held_out(cfg, parse: Callable) -> tuple[list, list]:
    """``cfg.path``'s items, less the last ``eval_size`` held out (or ``cfg.eval_path``'s first ones)."""
    items = read_jsonl(cfg.path, parse)
    if cfg.eval_path:
        return items, read_jsonl(cfg.eval_path, parse)[: cfg.eval_size]
    if len(items) <= cfg.eval_size:
        raise ValueError(
            f"data.eval_size: {cfg.path} has {len(items)} examples, not enough to hold out {cfg.eval_size}; "
            "lower data.eval_size or give data.eval_path"
        )
    return items[: -cfg.eval_size], items[-cfg.eval_size :]


def seeded_order(items: list, seed: int, shuffle: bool = True) -> Callable[[int], object]:
    """Item k of an endless walk over ``items``: a fresh seeded shuffle per epoch (or file order)."""
    perms: dict[int, list[int]] = {}

    def get(k: int):
        epoch, i = divmod(k, len(items))
        if epoch not in perms:
            perm = list(range(len(items)))
            if shuffle:
                random.Random(f"{seed}/epoch/{epoch}").shuffle(perm)
            perms[epoch] = perm
        return items[perms[epoch][i]]

    return get
