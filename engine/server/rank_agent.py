"""An engine of several ranks: the agent process that starts them, and what each rank runs.

``python -m sess.engine.server --nproc N`` (or ``sess engine up --nproc N``) runs
:func:`run_agent`: torch.distributed's elastic agent starts N ranks of the same command line
(:mod:`sess.engine.runtime.distributed.launch`). Rank 0 serves the API (:func:`serve` with its
:class:`~sess.engine.runtime.distributed.ranks.Ranks`); the others run :func:`follow_rank`. When a rank dies
the agent stops the rest, marks the sessions the engine had live as Interrupted in the registry
(resumable from their saved state, as after any engine crash) and exits with a message naming the
rank.

Over several hosts (``--nnodes``, :mod:`sess.engine.runtime.distributed.nodes`) every host runs
an agent for its ranks, all with the same ``--home`` on a filesystem they share: node 0's rank 0
serves, writes the registry, ``engine.json`` and every checkpoint there, and the other hosts' ranks
read checkpoints from it (a saved state they load) and write nothing. Node 0's agent marks the
sessions Interrupted when any host dies; another host's agent only reports.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from sess.engine.protocol.home import sess_home

log = logging.getLogger("sess.engine")


def run_agent(nproc: int, argv: list[str], home: str | Path | None, nodes=None) -> int:
    """Run the engine as ``nproc`` ranks of ``python -m sess.engine.server *argv`` (this host's, of
    ``nodes``: :class:`~sess.engine.runtime.distributed.nodes.Nodes`); the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from sess.engine.runtime.distributed.launch import run_ranks
    from sess.engine.server.sqlite_registry import Registry

    try:
        failure = run_ranks(nproc, argv, nodes)
    except SignalException:  # stopped (sess engine down): the agent stopped the ranks
        return 0
    except RuntimeError as exc:  # a host did not join: nothing started
        print(f"sess engine: {exc}", file=sys.stderr, flush=True)
        return 1
    if failure is None:
        return 0
    if nodes is not None and nodes.rank != 0:  # node 0 keeps the registry and reports the sessions
        print(f"sess engine: {failure}; the engine stopped.", file=sys.stderr, flush=True)
        return 1
    registry = Registry(sess_home(home))
    try:
        interrupted = registry.interrupt_live()
    finally:
        registry.close()
    names = ", ".join(interrupted) if interrupted else "none"
    print(
        f"sess engine: {failure}; the engine stopped. Sessions now Interrupted: {names}. Start the "
        "engine again and resume each from its last saved state (sess resume NAME, or "
        "create_training_client_from_state).",
        file=sys.stderr,
        flush=True,
    )
    return 1


def follow_rank(
    home: str | Path | None, ranks, dtype: str | None = None, memory_budget: str | None = None
) -> None:
    """A rank other than 0: hold its share of the weights and run rank 0's ops until told to stop.
    ``dtype`` and ``memory_budget`` are the engine's options (every rank gets the same command line)."""
    from sess.engine.runtime.distributed.follower import follow
    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes
    from sess.engine.runtime.runtime import Runtime

    runtime = Runtime(
        home,
        ranks.device,
        dtypes=Dtypes.parse(dtype),
        memory_budget=parse_bytes(memory_budget) if memory_budget else None,
        placement=ranks,
    )
    try:
        follow(runtime, ranks)
    finally:
        ranks.close()


def start_node(home: Path, host: str, port: int, device: str, extra: list[str], detach: bool) -> str:
    """``sess engine up`` on a host other than node 0: its agent and ranks, in the foreground (this
    process becomes the agent) or, with ``detach``, in the background
    with their output in HOME/engine-node-K.log. What to print."""
    import subprocess

    from sess.engine.protocol.home import server_command
    from sess.engine.runtime.memory.malloc_tuning import engine_env

    command = server_command(home, host, port, device, extra)
    if detach:
        log_path = home / f"engine-node-{extra[extra.index('--node-rank') + 1]}.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                env=engine_env(device=device),
            )
        return f"engine node started (agent pid {process.pid}, log {log_path}); node 0 serves the engine"
    os.execve(command[0], command, engine_env(device=device))  # this process becomes the node's agent
