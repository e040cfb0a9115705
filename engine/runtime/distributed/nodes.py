"""An engine over several hosts: the options that place a host in it, and each host's watch.

``--nnodes N --node-rank K --master HOST:PORT`` run one elastic agent per host (``sess engine up``
on each), joined by torch.distributed's static rendezvous at ``--master``: node K's ranks are
``K * nproc .. (K + 1) * nproc - 1``, so rank 0, which serves the API, is always on node 0. Node 0
hosts the rendezvous store (a TCPStore listening on the master's port).

Each agent runs a :class:`NodeWatch` beside its ranks: a thread that writes the node's heartbeat
(its host name, pid and a counter) into the store every half second and reads the others'. It
finds a host that never joins (node 0 waits ``--join-timeout`` seconds for every node's first
heartbeat before any rank starts, and names those missing; another node gives up on a master
that does not answer in that time), and a host that dies: its heartbeat stops (the agent and its
ranks gone: the host lost power or was killed) or its agent reports its ranks' failure in the
store. The watch then stops this agent's ranks (SIGTERM to the agent) and keeps the message
that names the node for the agent to print. A rank also finds a dead peer at once when a
collective fails (:class:`~sess.engine.runtime.distributed.ranks.RankFailed`); the heartbeat finds one
while the engine idles, and one whose connection hangs rather than closes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
import time
from datetime import timedelta

STOPPING = "sess/stopping"  # set in the store when the engine stops as asked
BEAT_S = 0.5  # how often each node writes its heartbeat
DEAD_AFTER_S = 10.0  # a node whose heartbeat has not moved for this long is dead
JOIN_TIMEOUT_S = 300.0  # default --join-timeout: every host must have started by then


@dataclasses.dataclass(frozen=True)
class Nodes:
    """This host's place among the engine's hosts."""

    count: int
    rank: int
    host: str
    port: int
    join_timeout: float = JOIN_TIMEOUT_S

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(
        cls, nnodes: int, node_rank: int, master: str | None, join_timeout: float = JOIN_TIMEOUT_S
    ) -> Nodes | None:
        """The nodes these options describe (None for one host); ValueError naming the option that is
        out of range or malformed. Checked before anything starts."""
        if nnodes < 1:
            raise ValueError(f"--nnodes: expected 1 or more hosts, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank: expected 0 to {nnodes - 1} (--nnodes {nnodes}), got {node_rank}")
        if not (join_timeout > 0 and join_timeout < float("inf")):
            raise ValueError(f"--join-timeout: expected a positive number of seconds, got {join_timeout}")
        if nnodes == 1:
            if master is not None:
                raise ValueError("--master: only for an engine of several hosts (--nnodes 2 or more)")
            return None
        if master is None:
            raise ValueError(f"--master: --nnodes {nnodes} needs the address of node 0, as HOST:PORT")
        host, sep, port_text = master.rpartition(":")
        host = host.strip("[]")  # [::1]:29500
        if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(
                f"--master: expected HOST:PORT (node 0's address and a free port, 1 to 65535), got {master!r}"
            )
        return cls(nnodes, node_rank, host, int(port_text), join_timeout)

    def name(self, node: int, seen: dict | None = None) -> str:
        """``node 1 of 2 (host gpu-b, pid 123)``, with what its heartbeat said when there was one."""
        about = (seen or {}).get(node)
        where = f" (host {about['host']}, agent pid {about['pid']})" if about else ""
        return f"node {node} of {self.count}{where}"


class NodeWatch:
    """This agent's heartbeat in the rendezvous store, and what it sees of the other nodes'."""

    def __init__(self, nodes: Nodes):
        self.nodes = nodes
        self.seen: dict[int, dict] = {}  # node -> its last heartbeat {host, pid, beat, at}
        self.failure: str | None = None  # why this node's ranks were stopped (a node named)
        self.ranks_running = False  # set by the agent while its ranks run: a failure then stops them
        self.stopping = False  # rank 0 said the engine stops (sess engine down): no failure after it
        self._stop = threading.Event()
        self._store = None
        self._thread: threading.Thread | None = None

    # starting -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Join: node 0 opens the store and waits for every node's first heartbeat, another node
        connects to it; RuntimeError naming the node(s) missing after ``--join-timeout``."""
        from torch.distributed import TCPStore

        nodes, timeout = self.nodes, timedelta(seconds=self.nodes.join_timeout)
        leader = nodes.rank == 0
        try:
            # multi_tenant: the rendezvous's own TCPStore on this port (node 0) shares this server
            self._store = TCPStore(
                nodes.host,
                nodes.port,
                is_master=leader,
                wait_for_workers=False,
                multi_tenant=True,
                timeout=timeout,
            )
        except RuntimeError as exc:
            if leader:
                raise RuntimeError(
                    f"--master {nodes.master}: node 0 cannot listen there ({str(exc).splitlines()[0][:160]}); "
                    "give an address of this host and a free port"
                ) from None
            raise RuntimeError(
                f"node 0 of {nodes.count} (--master {nodes.master}) did not answer within "
                f"{nodes.join_timeout:g} s (--join-timeout): start `sess engine up --nnodes {nodes.count} "
                f"--node-rank 0 --master {nodes.master}` on that host, and check that this host reaches it"
            ) from None
        self._beat()
        if leader:
            self._await_nodes()
        self._thread = threading.Thread(target=self._run, name="sess-node-watch", daemon=True)
        self._thread.start()

    def _await_nodes(self) -> None:
        deadline = time.monotonic() + self.nodes.join_timeout
        while True:
            self._read()
            missing = [n for n in range(1, self.nodes.count) if n not in self.seen]
            if not missing:
                return
            if time.monotonic() > deadline:
                names = ", ".join(f"node {n}" for n in missing)
                raise RuntimeError(
                    f"{names} of {self.nodes.count} did not join within {self.nodes.join_timeout:g} s "
                    f"(--join-timeout): start `sess engine up --nnodes {self.nodes.count} --node-rank "
                    f"{missing[0]} --master {self.nodes.master}` on {'that host' if len(missing) == 1 else 'each'}"
                    f"; {self.nodes.count - len(missing)} of {self.nodes.count} hosts joined"
                )
            time.sleep(BEAT_S / 2)

    # the heartbeat --------------------------------------------------------------------------------
    def _beat(self, count: int = 0) -> None:
        beat = {"host": socket.gethostname(), "pid": os.getpid(), "beat": count}
        self._store.set(f"sess/node/{self.nodes.rank}", json.dumps(beat))

    def _read(self) -> None:
        now = time.monotonic()
        for node in range(self.nodes.count):
            key = f"sess/node/{node}"
            if node == self.nodes.rank or not self._store.check([key]):
                continue
            beat = json.loads(self._store.get(key))
            last = self.seen.get(node)
            if last is None or last["beat"] != beat["beat"]:
                self.seen[node] = {**beat, "at": now}
            if not self.stopping and self._store.check([STOPPING]):
                self.stopping = True
            failed = f"sess/failed/{node}"
            if self._store.check([failed]) and self.failure is None:
                self._fail(f"{self.nodes.name(node, self.seen)} stopped: {self._store.get(failed).decode()}")

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(BEAT_S):
            count += 1
            try:
                self._beat(count)
                self._read()
            except (RuntimeError, ValueError) as exc:  # the store is gone: node 0's agent stopped
                if self.stopping:  # as asked: the agent may wait on the store in its exit barrier
                    if self.ranks_running:
                        os.kill(os.getpid(), signal.SIGTERM)
                    return
                if self.nodes.rank != 0 and not self._stop.wait(DEAD_AFTER_S):
                    self._fail(f"{self.nodes.name(0, self.seen)} stopped answering ({type(exc).__name__})")
                return
            now = time.monotonic()
            for node, beat in self.seen.items():
                if now - beat["at"] > DEAD_AFTER_S:
                    self._fail(
                        f"{self.nodes.name(node, self.seen)} stopped answering (no heartbeat for "
                        f"{now - beat['at']:.0f} s: the host or its engine died)"
                    )
                    return

    def _fail(self, message: str) -> None:
        """Stop this agent's ranks (SIGTERM: the elastic agent stops them) because of ``message``."""
        if self.failure is None and not self._stop.is_set():
            self.failure = message
            if self.ranks_running:
                os.kill(os.getpid(), signal.SIGTERM)

    # stopping -------------------------------------------------------------------------------------
    def announce_stop(self) -> None:
        """Node 0, stopped as asked: the other nodes' agents end without reporting a failure."""
        announce_stop(self.nodes.master)

    def report(self, message: str) -> None:
        """Tell the other nodes why this node's ranks stopped (best effort: the store may be gone)."""
        try:
            self._store.set(f"sess/failed/{self.nodes.rank}", message)
        except (RuntimeError, AttributeError):
            pass

    def diagnose(self, wait: float = DEAD_AFTER_S + 4 * BEAT_S) -> str | None:
        """Why another node stopped, waiting up to ``wait`` seconds for its report or for its heartbeat
        to go stale (this node's ranks ended without a failure of their own); None if none did."""
        deadline = time.monotonic() + wait
        while (
            self.failure is None and time.monotonic() < deadline and self._thread and self._thread.is_alive()
        ):
            time.sleep(BEAT_S / 2)
        return self.failure

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def announce_stop(master: str | None) -> None:
    """Mark the engine at ``master`` (the rendezvous store) as stopping as asked; best effort."""
    if not master:
        return
    from torch.distributed import TCPStore

    host, _, port = master.rpartition(":")
    try:
        store = TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=2)
        )
        store.set(STOPPING, "1")
    except (RuntimeError, ValueError):
        pass
