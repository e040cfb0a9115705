"""Starting an engine of N ranks with torch.distributed's elastic agent, as ``torchrun`` does.

The process that runs :func:`run_ranks` is the agent: it starts N copies of the engine's command
line (``python -m sess.engine.server ...``) with the rendezvous environment set (RANK, WORLD_SIZE,
MASTER_ADDR, ...), watches them, and when one exits stops the others (no restarts: a new rank could
not rebuild the sessions' adapters). :func:`check_nproc` refuses more ranks than devices.

Over several hosts (``nodes``, :mod:`sess.engine.runtime.distributed.nodes`) each host runs an agent for its own
ranks; the agents meet in torch.distributed's static rendezvous at node 0's ``--master`` address,
so node K's agent starts ranks ``K * nproc ..`` and rank 0 is node 0's first.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sess.engine.runtime.distributed.nodes import Nodes

RANKS_ENV = "SESS_ENGINE_RANKS"  # set for the ranks an engine agent starts: their world size
MASTER_ENV = "SESS_ENGINE_MASTER"  # and, over several hosts, the rendezvous store's HOST:PORT


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


def run_ranks(nproc: int, argv: list[str], nodes: Nodes | None = None) -> str | None:
    """Run ``python -m sess.engine.server *argv`` as ``nproc`` ranks (of this host, among ``nodes``)
    until they stop; None when they all exited cleanly, else a message naming the rank (or host)
    that failed first and how. A stop by signal (``sess engine down``) raises the agent's
    SignalException, unless this host's watch stopped the ranks because another host died."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ[RANKS_ENV] = str(nproc * (nodes.count if nodes else 1))
    # one OpenMP team per rank, sized to its share of the cores (torchrun would set 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // nproc)))
    rendezvous = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0", "run_id": uuid.uuid4().hex}
    watch = None
    if nodes is not None:
        from sess.engine.runtime.distributed.nodes import NodeWatch

        os.environ[MASTER_ENV] = nodes.master
        watch = NodeWatch(nodes)
        watch.start()  # RuntimeError naming the host that did not join
        rendezvous = {
            "rdzv_backend": "static",
            "rdzv_endpoint": nodes.master,
            "rdzv_configs": {"rank": nodes.rank, "timeout": int(nodes.join_timeout) + 1},
            "run_id": "sess-engine",
        }
    config = LaunchConfig(
        min_nodes=nodes.count if nodes else 1,
        max_nodes=nodes.count if nodes else 1,
        nproc_per_node=nproc,
        max_restarts=0,
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(),
        **rendezvous,
    )
    try:
        if watch is not None:
            watch.ranks_running = True
        elastic_launch(config, sys.executable)("-m", "sess.engine.server", *argv)
        if watch is not None:  # ours ended of themselves: a rank elsewhere failed, or a clean stop
            watch.ranks_running = False
            if nodes.rank:
                return None  # rank 0 told ours to stop (had it died, ours would have failed)
            return watch.diagnose() or (
                "rank 0 stopped: a rank on another host failed or stopped answering (see each host's log)"
            )
    except SignalException:
        if watch is not None:
            if watch.failure:
                return watch.failure
            if watch.stopping:  # node 0 stopped as asked, and with it the store ours waited on
                return None
            if nodes.rank == 0:
                watch.announce_stop()
        raise
    except ChildFailedError as exc:
        message = _failed_rank(exc, nproc * (nodes.count if nodes else 1))
        if watch is not None:
            watch.report(f"{message} on {nodes.name(nodes.rank, None)}")
            if watch.failure or (nodes.rank and watch.diagnose(wait=4.0)):
                return watch.failure  # another host died first and ours stopped on it
            return f"{message} on {nodes.name(nodes.rank, None)}"
        return message
    finally:
        if watch is not None:
            watch.ranks_running = False
            watch.stop()
    return None


def _failed_rank(exc, world: int) -> str:
    """The rank that failed first, and how, from the agent's ChildFailedError."""
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
    return f"rank {rank} of {world} died ({how}, pid {failure.pid})"
