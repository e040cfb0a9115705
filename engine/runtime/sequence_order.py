"""A session's ordered ops run in the order its client stamped them: each carries a sequence number,
an early arrival waits (parked) for the ones before it, and one that waits too long is refused."""

from __future__ import annotations

import time

from sess.engine.runtime.ops.operation import Operation
from sess.engine.sdk.errors import InvalidRequest, NotFound

SEQUENCE_WAIT_S = 120.0  # how long an op may wait for an earlier sequence number to arrive


class SequenceOrder:
    """The executor's ordering of each session's ops (a mixin of :class:`.executor.Executor`, whose
    ``_cv``, ``_ready``, ``_next_seq``, ``_parked`` and ``_finish`` it uses)."""

    def _order(self, op: Operation) -> None:
        expected = self._next_seq.get(op.session, 1)
        if op.seq < expected or op.seq in self._parked.get(op.session, {}):
            raise InvalidRequest(
                f"seq: sequence number {op.seq} of session {op.session!r} was already used "
                f"(next expected {expected}); resubmit with the same client token to fetch its result",
                status=409,
            )
        parked = self._parked.setdefault(op.session, {})
        parked[op.seq] = op
        while expected in parked:
            self._ready.append(parked.pop(expected))
            expected += 1
        self._next_seq[op.session] = expected

    def _forget_order(self, session: str) -> None:
        """A deleted session's ordering ends with it: a new session of the same name starts at
        sequence number 1, and ops still parked for the old one are refused."""
        with self._cv:
            self._next_seq.pop(session, None)
            parked = self._parked.pop(session, {})
        for op in parked.values():
            self._finish(op, error=NotFound(f"session {session!r} was deleted before op {op.seq} could run"))

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for session, parked in self._parked.items():
            for seq, op in list(parked.items()):
                if now - op.created > SEQUENCE_WAIT_S:
                    del parked[seq]
                    expected = self._next_seq.get(session, 1)
                    error = InvalidRequest(
                        f"seq: op {seq} of session {session!r} waited for {expected}, which never arrived",
                        status=409,
                    )
                    self._finish(op, error=error)
