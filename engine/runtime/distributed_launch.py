"""Starting an engine of N ranks with torch.distributed's elastic agent, as ``torchrun`` does.

The process that runs :func:`run_ranks` is the agent: it starts N copies of the engine's command
line (``python -m sess.engine.server ...``) with the rendezvous environment set (RANK, WORLD_SIZE,
MASTER_ADDR, ...), watches them, and when one exits stops the others (no restarts: a new rank could
not rebuild the sessions' adapters). :func:`check_nproc` refuses more ranks than devices.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

RANKS_ENV = "SESS_ENGINE_RANKS"  # set for the ranks an engine agent starts: their world size


def device_limit(device: str) -> tuple[int, str]:
    """How many ranks ``device`` can run on this machine, and what they are."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.device_count(), "CUDA devices"
    return len(os.sched_getaffinity(0)), "CPU cores"


def check_nproc(nproc: int, device: str) -> None:
    """Raise ValueError, naming the limit, for a rank count this machine cannot run."""
    if nproc < 1:
        raise ValueError(f"--nproc: expected 1 or more ranks, got {nproc}")
    if nproc == 1:
        return
    if device not in ("cpu", "cuda"):
        raise ValueError(
            f"--nproc {nproc} needs --device cpu or cuda (each rank takes its own), not {device!r}"
        )
    limit, what = device_limit(device)
    if nproc > limit:
        raise ValueError(
            f"--nproc {nproc}: this machine has {limit} {what}, so at most --nproc {limit} (one rank each)"
        )


def run_ranks(nproc: int, argv: list[str]) -> str | None:
    """Run ``python -m sess.engine.server *argv`` as ``nproc`` ranks until they stop; None when they
    all exited cleanly, else a message naming the rank that failed first and how."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[RANKS_ENV] = str(nproc)
    # one OpenMP team per rank, sized to its share of the cores (torchrun would set 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(),
    )
    try:
        elastic_launch(config, sys.executable)("-m", "sess.engine.server", *argv)
    except ChildFailedError as exc:
        # The rank that failed of itself: the agent stops the others with SIGTERM, and a rank that
        # lost a peer exits with an error or aborts (SIGABRT from the collective library) after it,
        # in the same second. So a rank another signal killed (SIGKILL, the OOM killer, a crash) is
        # the cause before one that aborted, and that before one that exited with a code.
        own = {r: f for r, f in exc.failures.items() if f.exitcode != -signal.SIGTERM} or exc.failures

        def cause_first(item) -> tuple:
            code = item[1].exitcode
            kind = 2 if code >= 0 else 1 if code == -signal.SIGABRT else 0
            return kind, item[1].timestamp, item[0]

        rank, failure = min(own.items(), key=cause_first)
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        return f"rank {rank} of {nproc} died ({how}, pid {failure.pid})"
    return None
