"""Helpers shared by the benchmark scripts.

Why baselines run on the engine's executor thread: torch's CPU kernels run on an OpenMP thread
team that belongs to the calling thread, and a team's workers stay after the call. The
in-process engine computes on its executor thread; a baseline run on any other thread of the same
process starts a second team, and on a small machine (2 cores here) every parallel region of
either then waits for sleeping workers to be woken: measured, both sides ran 1.3-2x slower than
alone, so a ratio would depend on which side ran first. ``Executor.run`` runs the baseline
between engine ops on the executor thread, so both sides share one team.

Why scripts start again under :func:`as_engine_process`: an engine process (``sess engine up``,
``sess run``) runs with malloc settings that keep freed memory for the next step, and the
in-process engines of these scripts stand in for one.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from sess.engine.runtime.memory.malloc_tuning import exec_as_engine

T = TypeVar("T")


_clock = time.perf_counter


def clock() -> float:
    """Seconds on the scripts' clock: wall time, or the calling thread's CPU time after
    :func:`use_cpu_time`."""
    return _clock()


def use_cpu_time() -> None:
    """Time with the calling thread's CPU time from now on: on a machine other work shares, a
    script run with one thread (every kernel on the engine's thread) then measures its own work,
    not the time the scheduler gave the other processes. Ratios of such figures compare work; the
    bandwidth they are set against is measured the same way."""
    global _clock
    _clock = time.thread_time


def on_engine(svc, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on the executor thread of ``svc``'s in-process engine."""
    return svc.transport.engine.run(lambda runtime: fn(*args, **kwargs))


def in_process_client(
    home=None, device: str = "cpu", dtype: str | None = None, memory_budget: str | None = None
):
    """A ServiceClient on this process's engine for ``home``, on ``device``, its base models in
    ``dtype``, training under ``memory_budget`` (the engine's ``--device``, ``--dtype`` and
    ``--memory-budget``; None: the engine's defaults)."""
    from sess.engine import ServiceClient
    from sess.engine.runtime.inprocess import shared_engine
    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes

    runtime = shared_engine(home, device=device).runtime
    runtime.dtypes = Dtypes.parse(dtype)
    runtime.memory_budget = parse_bytes(memory_budget) if memory_budget else None
    return ServiceClient("inproc", home=home)


def memory_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS (resident now) and VmHWM (the peak) of process ``pid`` in bytes (Linux ``/proc``)."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def add_device_options(parser) -> None:
    parser.add_argument("--device", default="cpu", help="the engine's device: cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype", default=None, help="base model precision, float32 or bfloat16 (default: the device's)"
    )
    parser.add_argument(
        "--memory-budget", default=None, help="the engine's training memory budget, e.g. 512M"
    )


def as_engine_process(device: str = "cpu") -> None:
    """Run this script with the malloc settings of an engine process (engine/memory.py): glibc
    reads them at start, so the script starts again with them if they are missing. Baselines in
    the same process run with them too, which can only help them."""
    exec_as_engine([sys.executable, *sys.argv], device)


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> tuple[float, float]:
    """This machine's memory bandwidth in bytes/s, on the calling thread's OpenMP team (as torch's
    kernels see it): a read (the sum of a ``megabytes`` fp32 tensor, far larger than any cache) and
    a copy (bytes read plus bytes written), the median of ``repeats`` each."""
    import statistics

    import torch

    source = torch.ones(megabytes << 18)  # 4-byte elements
    target = torch.empty_like(source)
    reads, copies = [], []
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = clock()
        source.sum()
        middle = clock()
        target.copy_(source)
        end = clock()
        reads.append(middle - start)
        copies.append(end - middle)
    size = source.numel() * 4
    return size / statistics.median(reads[1:]), 2 * size / statistics.median(copies[1:])


def weight_bytes(host, adapter) -> tuple[int, int]:
    """Bytes of the base weights a decode step reads (every projection and the lm_head) and of the
    adapter's LoRA weights it reads besides (none where the sampler merges them into copies of the
    weights they change, which it reads instead)."""
    merged = getattr(host.decoder, "merges_lora", lambda: False)()
    base = lora = 0
    for name, p in host.model.named_parameters():
        if "lora_" in name:
            lora += p.numel() * p.element_size() if f".{adapter}." in name and not merged else 0
        elif "embed_tokens" not in name and "norm" not in name:
            base += p.numel() * p.element_size()
    if host.model.config.tie_word_embeddings:
        base += host.model.get_input_embeddings().weight.numel() * 4
    return base, lora


@contextlib.contextmanager
def patched(changes: Iterable[tuple[object, str, object]]):
    """Set each ``(owner, name, value)`` of ``changes`` (an attribute of a class or module) while
    the block runs, then put the originals back."""
    changes = list(changes)
    originals = [(owner, name, vars(owner)[name]) for owner, name, _ in changes]
    for owner, name, value in changes:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


class CallTimes:
    """Seconds and calls per part of functions timed by wrapping them in this process
    (:meth:`wrap`, installed with :func:`patched`). A wrapped call made inside another counts
    under ``"outer/inner"``, as part of the outer one, not beside it."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._open: list[str] = []

    def wrap(self, part: str, fn: Callable, sub: tuple[str, Callable[..., bool]] | None = None) -> Callable:
        """``fn`` timed as ``part``; with ``sub = (name, test)``, a call whose arguments pass
        ``test`` also counts under ``part + "/" + name``."""

        def timed(*args, **kwargs):
            key = "/".join([*self._open, part])
            self._open.append(part)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                self._open.pop()
                self.seconds[key] += spent
                self.calls[key] += 1
                if sub is not None and sub[1](*args):
                    self.seconds[f"{key}/{sub[0]}"] += spent

        return timed
