"""What the Tinker front end records of each sampled sequence, for provenance spans and StableReinforce.

Every sequence a Tinker sampling session samples is kept under its ``sequence_id``
(``<request_id>.<i>``, the ids ``asample`` answers): its request's prompt, its sampled tokens and
each token's sampling logprob. A ``SamplingClient`` made with ``record_stability_info=True`` asks for
this; the engine records the others too, because the cookbook attaches provenance spans to every RL
datum whatever its loss (and records only for ``stable_reinforce``), and spans are checked against
the record. Training requests then name those
sequences in provenance spans (:mod:`.provenance`): the engine checks a datum's tokens against them
and ``stable_reinforce`` reads the recorded logprobs instead of trusting the client's copy.

A record lasts :data:`LIFETIME_S` (one day, as Tinker documents) after it was made or last used; each
use restarts its day. Records live in memory only (never on disk), per Tinker session, and go with
it (or, for a client that exited without finishing its session, a day after the session's last
sample or use: :meth:`SequenceRecords.stale`; an empty set whose samples are still running is not
stale); a session keeps at most :data:`MAX_TOKENS` tokens of records and a key :data:`MAX_KEY_TOKENS`
over all its sessions (:func:`bound_key`), dropping the least recently used first. The clock is a parameter so that tests can move it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LIFETIME_S = 24 * 3600.0
MAX_TOKENS = 1 << 22  # per session: prompt + sampled tokens of its records (about 50 MB at most)
MAX_KEY_TOKENS = 4 * MAX_TOKENS  # per key, over all its sessions (a key may open many)


@dataclass
class SequenceRecord:
    prompt: np.ndarray  # int32, the request's prompt (shared by the request's sequences)
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, each sampled token's logprob under the sampler
    used: float  # clock reading of its making or last use

    @property
    def size(self) -> int:
        return len(self.prompt) + len(self.tokens)


class SequenceRecords:
    """One Tinker session's recorded sequences, by ``sequence_id``, least recently used first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_tokens: int = MAX_TOKENS):
        self.clock, self.max_tokens = clock, max_tokens
        self._records: OrderedDict[str, SequenceRecord] = OrderedDict()
        self.tokens = 0
        self.touched = clock()  # made, or last sampled into or read

    def touch(self) -> None:
        """A sample request of the session is on its way here: keep the set for another day."""
        self.touched = self.clock()

    def stale(self) -> bool:
        """Empty and untouched for a day: its records expired and nothing samples into it any more.
        (A set made for a request whose samples are still running is empty but fresh.)"""
        self.expire()
        return not self._records and self.clock() - self.touched > LIFETIME_S

    def __len__(self) -> int:
        return len(self._records)

    def add(self, sequence_id: str, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
        self.expire()
        record = SequenceRecord(
            np.asarray(prompt, np.int32),
            np.asarray(tokens, np.int32),
            np.asarray(logprobs, np.float32),
            self.clock(),
        )
        self._drop(sequence_id)
        self._records[sequence_id] = record
        self.tokens += record.size
        self.touched = record.used
        while self.tokens > self.max_tokens and len(self._records) > 1:
            self._drop(next(iter(self._records)))

    def get(self, sequence_id: str) -> SequenceRecord | None:
        """The live record of ``sequence_id`` (its day restarted), or None: never recorded, expired
        or evicted."""
        self.expire()
        record = self._records.get(sequence_id)
        if record is not None:
            record.used = self.touched = self.clock()
            self._records.move_to_end(sequence_id)
        return record

    def oldest_use(self) -> float:
        """Clock reading of the least recently used record (infinity when empty)."""
        return next(iter(self._records.values())).used if self._records else float("inf")

    def drop_oldest(self) -> None:
        if self._records:
            self._drop(next(iter(self._records)))

    def expire(self) -> None:
        """Drop the records unused for over :data:`LIFETIME_S` (the oldest are first)."""
        now = self.clock()
        while self._records:
            sequence_id, record = next(iter(self._records.items()))
            if now - record.used <= LIFETIME_S:
                break
            self._drop(sequence_id)

    def _drop(self, sequence_id: str) -> None:
        record = self._records.pop(sequence_id, None)
        if record is not None:
            self.tokens -= record.size


def bound_key(sessions: list[SequenceRecords], limit: int = MAX_KEY_TOKENS) -> None:
    """Drop the least recently used records of one key's ``sessions`` until they hold ``limit``
    tokens or fewer."""
    total = sum(records.tokens for records in sessions)
    while total > limit:
        oldest = min(sessions, key=SequenceRecords.oldest_use)
        before = oldest.tokens
        oldest.drop_oldest()
        if oldest.tokens == before:
            return
        total -= before - oldest.tokens
