"""The engine's executor: one thread owns torch and runs every op of the runtime.

Transports (in-process, HTTP) call :meth:`Executor.submit`, :meth:`Executor.wait` (or
:meth:`Executor.wait_async`) and :meth:`Executor.call`. Each reads the op's request with its type
from the ops table (:mod:`sess.engine.runtime.ops.table`) on the caller's thread, so bad input is refused before anything is
queued. A session's ordered ops carry the sequence number its client stamped at call time and run
strictly in that order (an early arrival waits for the ones before it); a resubmitted op with the
same client token returns the first op instead of running twice. Sample requests join their base
model's decode batch; the loop interleaves one other op with each decode step. Which op runs next
is the ready queue's choice (:mod:`.fair_queue`): fair share across keys, then sessions. Every
op taken, its client token and the long-polls waiting on it are kept in the book (:mod:`.op_book`).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.protocol.types import Usage
from sess.engine.runtime.fair_queue import ReadyQueue, take_burst
from sess.engine.runtime.op_book import OpBook
from sess.engine.runtime.ops import checkpoint_ops
from sess.engine.runtime.ops.operation import Operation, internal_error
from sess.engine.runtime.ops.table import OPS, Kind
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.sequence_order import SequenceOrder
from sess.engine.runtime.usage import Unrecorded, session_of, usage_of

log = logging.getLogger("sess.engine")
T = TypeVar("T")


class Executor:
    """Queues, orders and runs ops on one thread around a :class:`Runtime`. Subclasses observe ops
    through :meth:`admit` (before one runs) and :meth:`finished` (after, before the op is answered:
    a :class:`~sess.engine.protocol.errors.SessError` it raises becomes the op's answer)."""

    def __init__(
        self,
        home: str | Path | None = None,
        device: str = "cpu",
        runtime: Runtime | None = None,
        *,
        fair: bool = True,
    ):
        self.runtime = runtime or Runtime(home, device)
        self._cv = threading.Condition()
        self._ready = ReadyQueue(fair)  # fair=False: arrival order
        self.book = OpBook(self._cv)  # every op by id, client tokens, long-poll waiters
        self.order = SequenceOrder()  # each session's sequence numbers and parked ops (under _cv)
        self._closed = False
        self._last_work = time.monotonic()
        self._idle_since_work = False  # whether idle() ran since the last op or decode step
        self._thread = threading.Thread(target=self._loop, name="sess-executor", daemon=True)
        self._thread.start()

    # entry points ----------------------------------------------------------------------------------
    def submit(
        self,
        owner: str,
        name: str,
        args: Any,
        *,
        session: str | None = None,
        seq: int | None = None,
        client_token: str | None = None,
        progress: Any = None,
    ) -> str:
        """Queue an op and return its id at once; its result comes from :meth:`wait`, and so does an
        error in its arguments (found here, before it is queued). ``progress``: a sample op's
        listener of its tokens as they are drawn (:class:`SampleJob`'s ``progress``)."""
        spec = OPS.get(name) if isinstance(name, str) else None
        if spec is None or spec.kind is Kind.CONTROL:
            raise InvalidRequest(f"name: unknown operation {str(name)[:64]!r}")
        if not isinstance(args, dict):
            raise InvalidRequest(f"args: expected an object, got {type(args).__name__}")
        if spec.kind is Kind.ORDERED:
            if not isinstance(session, str) or isinstance(seq, bool) or not isinstance(seq, int):
                raise InvalidRequest(f"{name}: needs a session name and an integer sequence number")
            args = {**args, "session": session}
        with self._cv:
            if (known := self.book.known(owner, client_token)) is not None:
                return known
        op = Operation(uuid.uuid4().hex, owner, name, session=session, seq=seq, progress=progress)
        try:
            op.request = spec.request.from_wire(args)
        except InvalidRequest as exc:  # answered at once, and still takes its place in the order
            op.refused = True
            op.finish(error=exc)
        with self._cv:
            if (known := self.book.known(owner, client_token)) is not None:
                return known  # the same op, sent twice at once
            if spec.kind is Kind.ORDERED:
                for ready in self.order.arrive(op):
                    self._ready.append(ready)
            else:
                self._ready.append(op)
            self.book.remember(op, client_token)
            self._cv.notify_all()
        return op.id

    def wait(self, owner: str, op_id: str, timeout: float | None = None) -> Operation | None:
        """The finished op, or None if it is still pending after ``timeout`` seconds."""
        op = self._owned(owner, op_id)
        return op if op.done.wait(timeout) else None

    async def wait_async(self, owner: str, op_id: str, timeout: float) -> Operation | None:
        """:meth:`wait` for an asyncio server: the waiter is woken the moment the op finishes,
        without a thread of its own."""
        return await self.book.wait_async(self._owned(owner, op_id), timeout)

    def call(self, owner: str, name: str, args: Any = None) -> Any:
        """Run a control op (create/list/stop sessions, ...) on the executor and return its result."""
        spec = OPS.get(name) if isinstance(name, str) else None
        if spec is None or spec.kind is not Kind.CONTROL:
            raise InvalidRequest(f"name: unknown control operation {str(name)[:64]!r}")
        op = Operation(uuid.uuid4().hex, owner, name, spec.request.from_wire(args or {}))
        return self._run_and_wait(op)

    def run(self, fn: Callable[[Runtime], T], *, owner: str = "", wait: bool = True) -> T | Operation:
        """Run ``fn(runtime)`` on the executor thread, between ops, and return its result (or raise
        its error); ``wait=False`` queues it and returns at once.

        For the engine's own work (idle stops, preparing an OpenAI request) and for code in the
        engine's process that does heavy torch work of its own, such as a baseline model in a
        benchmark: torch kernels run on an OpenMP thread team of the calling thread, and a second
        team in the process makes every parallel region of both wait for woken workers on a small
        machine. Run here, the work shares the engine's team."""
        op = Operation(uuid.uuid4().hex, owner, "", fn=fn)
        if not wait:
            self._enqueue(op)
            return op
        return self._run_and_wait(op)

    def next_seq(self, session: str) -> int:
        """The sequence number the session's next ordered op must carry."""
        with self._cv:
            return self.order.next_seq(session)

    def queued(self) -> int:
        """Ops waiting for the executor thread: queued, or parked until an earlier sequence number."""
        with self._cv:
            return len(self._ready) + self.order.waiting()

    def unblocks(self, session: str, seq: Any) -> bool:
        """Whether an op with sequence number ``seq`` is the one the session's parked ops wait for."""
        with self._cv:
            return self.order.unblocks(session, seq)

    @property
    def idled(self) -> bool:
        """Whether :meth:`idle` has run since the last op or decode step."""
        return self._idle_since_work

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # observers (subclasses) ------------------------------------------------------------------------
    def admit(self, op: Operation) -> None:
        """Called on the executor thread before ``op`` runs; raise a SessError to refuse it."""

    def finished(self, op: Operation) -> None:
        """Called on the executor thread once ``op`` has its result or error."""

    idle_after_s: float | None = None  # seconds without work before idle() runs (None: never)

    def idle(self) -> None:
        """Called on the executor thread once it has had no op or decode step for ``idle_after_s``."""

    # queueing --------------------------------------------------------------------------------------
    def _owned(self, owner: str, op_id: Any) -> Operation:
        return self.book.owned(owner, op_id)

    def _enqueue(self, op: Operation) -> None:
        with self._cv:
            self._ready.append(op)
            self._cv.notify_all()

    def _run_and_wait(self, op: Operation) -> Any:
        self._enqueue(op)
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    # the executor thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        """Interleave ops with decode steps: new sample requests join the running batch, then one
        other op runs, then every running row decodes one token; a training op waits one step at most."""
        while True:
            with self._cv:
                while not self._ready and not self.runtime.decoding and not self._closed:
                    if self._idle_due():
                        break
                    self._cv.wait(timeout=1.0)
                    for expired, error in self.order.expire():
                        self._finish(expired, error=error)
                if self._closed:
                    return
                idle = self._idle_due()
                samples = self._ready.take(_is_sample)
                if samples and not self.runtime.decoding:
                    samples += take_burst(self._ready, self._cv, _is_sample, lambda: self._closed)
                op = self._ready.popleft() if self._ready else None
                if op is not None and op.name == "compute_logprobs" and self.runtime.placement.world > 1:
                    op = [op, *self._ready.take(lambda other: other.name == "compute_logprobs")]
            if idle:
                self._idle_since_work = True
                try:
                    self.idle()
                except Exception:  # an observer must never take the executor down
                    log.exception("the idle observer failed")
                continue
            for sample in samples:
                self._guarded(sample, self._start_sample)
            if isinstance(op, list):  # several ranks score them at once
                self._score_over_ranks(op)
            elif op is not None:
                started = time.perf_counter()
                self._guarded(op, self._execute)
                with self._cv:  # the owner's share of the engine: what its next op waits behind
                    self._ready.charge(op.owner, time.perf_counter() - started)
            if self.runtime.decoding:
                try:
                    self.runtime.decode_step()
                except Exception as exc:  # a failed step ends the requests in it, never the executor
                    log.error("decode step failed:\n%s", traceback.format_exc())
                    message = f"sampling failed inside the engine: {type(exc).__name__}: {exc}"
                    self.runtime.fail_decoding(SessError(message, status=500))
            self._idle_since_work, self._last_work = False, time.monotonic()

    def _idle_due(self) -> bool:
        """(Under the lock) whether idle() should run now: nothing to do, long enough."""
        if self.idle_after_s is None or self._idle_since_work or self._ready or self.runtime.decoding:
            return False
        return time.monotonic() - self._last_work >= self.idle_after_s

    def _guarded(self, op: Operation, run: Callable[[Operation], None]) -> None:
        """Run ``op``; its failure (a SessError, or an engine bug as a 500) is its result, never the
        executor's end. An op refused at submit only reaches its observers."""
        if op.done.is_set():
            op.usage = Usage(operations=1)
            self._observe(op)
            return
        started = time.perf_counter()
        try:
            if op.name:
                self.admit(op)
            run(op)
        except SessError as exc:
            op.usage = usage_of(op.request, None, time.perf_counter() - started)
            self._finish(op, error=exc)
        except Exception as exc:
            op.usage = usage_of(op.request, None, time.perf_counter() - started)
            self._finish(op, error=internal_error(op, exc))

    def _execute(self, op: Operation) -> None:
        if op.fn is not None:
            try:
                result = op.fn(self.runtime)
            except Exception as exc:  # the engine's own callable: its caller gets the error as it is
                self._finish(op, error=exc)
                return
            self._finish(op, result=result)
            return
        started = time.perf_counter()
        spec = OPS[op.name]
        if spec.saves_first:  # a stop keeps the training: its state first, on every rank
            op.saved = checkpoint_ops.save_before_stop(self.runtime, op.owner, op.request.name)
        op.request = self.runtime.prepare(op.name, op.owner, op.request)
        result = spec.handler(self.runtime, op.owner, op.request)
        if spec.answers_next_seq:  # the executor's ordering state belongs in the answer
            result = {**result, "next_seq": self.next_seq(op.request.name)}
        elif spec.forgets_session:
            self._forget_order(op.request.name)
        elif spec.restarts_order:  # a stopped session continued: its client starts at 1
            self._forget_order(result["name"])
        op.usage = usage_of(op.request, result, time.perf_counter() - started)
        self._finish(op, result=result)

    def _score_over_ranks(self, ops: list[Operation]) -> None:
        """Several ranks: the ``compute_logprobs`` requests waiting together, split over the ranks
        (:mod:`sess.engine.runtime.distributed.logprob_spread`); each owner is charged its own requests' seconds."""
        from sess.engine.runtime.distributed.logprob_spread import run_group

        admitted = []
        for op in ops:
            try:
                if not op.done.is_set():  # refused at submit: only its observers, below
                    self.admit(op)
                    admitted.append(op)
                    continue
            except SessError as exc:
                op.finish(error=exc)
            self._guarded(op, lambda _: None)
        try:
            outcomes = run_group(self.runtime, [(op.owner, op.request) for op in admitted])
        except Exception as exc:  # a rank failed: every request of the group ends with it
            error = exc if isinstance(exc, SessError) else internal_error(admitted[0], exc)
            outcomes = [(None, error, 0.0)] * len(admitted)
        for op, (result, error, seconds) in zip(admitted, outcomes):
            op.usage = usage_of(op.request, result, seconds)
            self._finish(op, result=result, error=error)
            with self._cv:
                self._ready.charge(op.owner, seconds)

    def _start_sample(self, op: Operation) -> None:
        def done(result, error, usage) -> None:
            op.usage = usage
            if error is not None and not isinstance(error, SessError):  # a bug of the engine's own
                error = internal_error(op, error)
            self._finish(op, result=result, error=error)

        op.request = self.runtime.prepare(op.name, op.owner, op.request)
        OPS[op.name].handler(self.runtime, op.owner, op.request, done, progress=op.progress)

    def _forget_order(self, session: str) -> None:
        """A deleted session's ordering ends with it; ops still parked for it are refused."""
        with self._cv:
            parked = self.order.forget(session)
        for op, error in parked:
            self._finish(op, error=error)

    def _finish(self, op: Operation, result: Any = None, error: SessError | None = None) -> None:
        # counted and recorded before its answer is out: a client that reads the answer and then
        # loses the engine (kill -9) finds the op in the registry, counted once; an op that could
        # not be recorded is answered with that error instead (see :mod:`.usage`)
        op.result, op.error = result, error
        self._observe(op, wake=False)
        op.finish(op.result, op.error)
        self._wake(op)

    def _observe(self, op: Operation, wake: bool = True) -> None:
        if op.name and OPS[op.name].kind is Kind.BATCHED and op.usage is not None:
            with self._cv:  # a sample's share of the decode steps it was part of
                self._ready.charge(op.owner, op.usage.wall_time_s)
        session = None
        if op.name and OPS[op.name].accounted and op.usage is not None:
            name = session_of(op.session, op.request, op.result)
            session = self.runtime.find_session(op.owner, name) if name else None
            if session is not None:
                before = session.usage
                session.add_usage(op.usage)
        if op.name:
            try:
                self.finished(op)
            except SessError as exc:  # not recorded: the answer is the error, not the result
                log.error("op %s %s of key %s: %s", op.name, op.id, op.owner[:12], exc)
                if isinstance(exc, Unrecorded) and session is not None:
                    session.usage = before  # not billed, so not counted either
                if not op.done.is_set() and op.error is None:  # a failed op keeps its own error
                    op.result, op.error = None, exc
            except Exception:  # an observer must never take the executor down
                log.exception("observing op %s failed", op.name)
        if wake:
            self._wake(op)

    def _wake(self, op: Operation) -> None:
        """Answer the long-polls waiting on ``op``."""
        self.book.wake(op)


def _is_sample(op: Operation) -> bool:
    """Whether ``op`` joins a decode batch (its base model's sample requests)."""
    return bool(op.name) and OPS[op.name].kind is Kind.BATCHED
