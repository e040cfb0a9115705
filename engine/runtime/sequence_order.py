"""A session's ordered ops run in the order its client stamped them: each carries a sequence number,
an early arrival waits (parked) for the ones before it, and one that waits too long is refused.

:class:`SequenceOrder` holds that state for every session; the executor owns one and calls it under
its own lock (the order itself takes none).
"""

from __future__ import annotations

import time

from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.runtime.ops.operation import Operation

SEQUENCE_WAIT_S = 120.0  # how long an op may wait for an earlier sequence number to arrive


class SequenceOrder:
    """Each session's next expected sequence number and the ops parked until the ones before them
    arrive."""

    def __init__(self, wait_s: float = SEQUENCE_WAIT_S):
        self.wait_s = wait_s
        self._next_seq: dict[str, int] = {}
        self._parked: dict[str, dict[int, Operation]] = {}

    def arrive(self, op: Operation) -> list[Operation]:
        """Take ``op`` (which carries ``session`` and ``seq``) and return the ops that may run now,
        in sequence order: ``op`` and the parked ones it unblocks, or none while an earlier number
        is missing. A number already used is refused (409)."""
        expected = self._next_seq.get(op.session, 1)
        if op.seq < expected or op.seq in self._parked.get(op.session, {}):
            raise InvalidRequest(
                f"seq: sequence number {op.seq} of session {op.session!r} was already used "
                f"(next expected {expected}); resubmit with the same client token to fetch its result",
                status=409,
            )
        parked = self._parked.setdefault(op.session, {})
        parked[op.seq] = op
        ready = []
        while expected in parked:
            ready.append(parked.pop(expected))
            expected += 1
        self._next_seq[op.session] = expected
        return ready

    def next_seq(self, session: str) -> int:
        """The sequence number the session's next ordered op must carry."""
        return self._next_seq.get(session, 1)

    def unblocks(self, session: str, seq: int) -> bool:
        """Whether an op with ``seq`` is the one the session's parked ops wait for."""
        return bool(self._parked.get(session)) and seq == self.next_seq(session)

    def waiting(self) -> int:
        """Ops parked until an earlier sequence number arrives, over all sessions."""
        return sum(len(parked) for parked in self._parked.values())

    def forget(self, session: str) -> list[tuple[Operation, SessError]]:
        """A deleted session's ordering ends with it: a new session of the same name starts at
        sequence number 1. Returns the ops still parked for the old one, each with its refusal."""
        self._next_seq.pop(session, None)
        parked = self._parked.pop(session, {})
        return [
            (op, NotFound(f"session {session!r} was deleted before op {op.seq} could run"))
            for op in parked.values()
        ]

    def expire(self) -> list[tuple[Operation, SessError]]:
        """Remove the ops that waited longer than ``wait_s`` for an earlier number; each comes back
        with its refusal."""
        now, expired = time.monotonic(), []
        for session, parked in self._parked.items():
            for seq, op in list(parked.items()):
                if now - op.created > self.wait_s:
                    del parked[seq]
                    expected = self._next_seq.get(session, 1)
                    error = InvalidRequest(
                        f"seq: op {seq} of session {session!r} waited for {expected}, which never arrived",
                        status=409,
                    )
                    expired.append((op, error))
        return expired
