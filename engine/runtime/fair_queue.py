"""The executor's ready queue: ops served by fair share across keys, then sessions, not by arrival.

Each owner (API key) has a virtual time: the engine seconds its ops have taken. The next op comes
from the owner with the least virtual time that has one ready (ties: the earliest arrival), and
within that owner from its sessions in turn; inside a session ops keep the order they were queued
in (the executor queues a session's ordered ops in sequence-number order). An owner that was idle
starts from the virtual time of the last served owner, so idleness banks no credit, and a light
key's op waits for at most the op running now, whatever another key has queued. The engine's own
work (owner ``""``) goes first. Sample requests are taken out together (:meth:`ReadyQueue.take`)
to join the decode batch (on an idle batch, with the rest of their burst: :func:`take_burst`); their share of decode time is charged to their owners as they finish.
``fair=False`` serves in arrival order, as a baseline to measure against.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Any

ENGINE = ""  # the owner of the engine's own work
# A sample request reaching an idle decode batch waits for the rest of its burst (a loop's prompts,
# sent one after another) so that they prefill together: until none has come for BURST_QUIET_S, at
# most BURST_MAX_S. Joining a running batch later costs a prefill of its own and a copy of the cache.
BURST_QUIET_S = 0.003
BURST_MAX_S = 0.025


class ReadyQueue:
    def __init__(self, fair: bool = True):
        self.fair = fair
        # every op is held with its arrival stamp, as (stamp, op): the queue's own record of arrivals
        self._arrivals: deque = deque()  # arrival order (fair=False)
        self._owners: dict[str, OrderedDict[Any, deque]] = {}  # owner -> session -> (stamp, op) (fair)
        self._vtime: dict[str, float] = {}
        self._clock = 0.0  # virtual time of the owner served last
        self._count = 0
        self._order = itertools.count()  # arrival stamps for ties

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator:
        return iter([op for _, op in self._stamped()])

    def _stamped(self) -> list[tuple[int, Any]]:
        if not self.fair:
            return list(self._arrivals)
        return [entry for sessions in self._owners.values() for ops in sessions.values() for entry in ops]

    def append(self, op) -> None:
        self._count += 1
        entry = (next(self._order), op)
        if not self.fair:
            self._arrivals.append(entry)
            return
        owner = op.owner
        if owner not in self._owners:  # an owner (re)joining starts from now, not from its idle past
            self._owners[owner] = OrderedDict()
            self._vtime[owner] = max(self._vtime.get(owner, 0.0), self._clock)
        self._owners[owner].setdefault(op.session, deque()).append(entry)

    def popleft(self):
        if not self._count:
            raise IndexError("pop from an empty queue")
        self._count -= 1
        if not self.fair:
            return self._arrivals.popleft()[1]
        if ENGINE in self._owners:
            owner = ENGINE
        else:
            owner = min(
                self._owners,
                key=lambda o: (self._vtime[o], next(iter(self._owners[o].values()))[0][0]),
            )
        self._clock = max(self._clock, self._vtime.get(owner, 0.0))
        sessions = self._owners[owner]
        session, ops = next(iter(sessions.items()))
        _, op = ops.popleft()
        if ops:
            sessions.move_to_end(session)  # the owner's next op comes from its next session
        else:
            del sessions[session]
        if not sessions:
            del self._owners[owner]
        return op

    def take(self, wanted: Callable[[Any], bool]) -> list:
        """Remove and return every queued op ``wanted`` accepts, in arrival order."""
        taken = [entry for entry in self._stamped() if wanted(entry[1])]
        if not taken:
            return []
        if not self.fair:
            self._arrivals = deque(entry for entry in self._arrivals if not wanted(entry[1]))
        for owner, sessions in list(self._owners.items()):
            for session, ops in list(sessions.items()):
                kept = deque(entry for entry in ops if not wanted(entry[1]))
                if kept:
                    sessions[session] = kept
                else:
                    del sessions[session]
            if not sessions:
                del self._owners[owner]
        self._count -= len(taken)
        return [op for _, op in sorted(taken, key=lambda entry: entry[0])]

    def charge(self, owner: str, seconds: float) -> None:
        """Add ``seconds`` of the engine's time to ``owner``'s share."""
        if owner != ENGINE and seconds > 0:
            self._vtime[owner] = self._vtime.get(owner, self._clock) + seconds

    def shares(self) -> dict[str, float]:
        """Engine seconds charged per owner so far (for reports and tests)."""
        return dict(self._vtime)


def take_burst(
    queue: ReadyQueue, cv: threading.Condition, wanted: Callable[[Any], bool], closed: Callable[[], bool]
) -> list:
    """(Holding ``cv``, the queue's lock) the ops ``wanted`` accepts that arrive while they keep
    coming, one at most BURST_QUIET_S after another and BURST_MAX_S in all; submitters queue
    while it waits, as ``cv.wait`` releases the lock."""
    taken: list = []
    now = time.monotonic()
    end, quiet = now + BURST_MAX_S, now + BURST_QUIET_S
    while not closed() and (left := min(end, quiet) - now) > 0:
        cv.wait(timeout=left)
        now = time.monotonic()
        more = queue.take(wanted)
        if more:
            taken += more
            quiet = now + BURST_QUIET_S
    return taken
