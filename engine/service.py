"""The engine's executor: one thread owns torch and runs every op of the runtime.

Transports (in-process, HTTP) only call :meth:`Engine.submit`, :meth:`Engine.wait` and
:meth:`Engine.call`. A session's training ops carry the sequence number its client stamped at call
time and run strictly in that order (an early arrival waits for the ones before it); a resubmitted
op with the same client token returns the first op instead of running twice. Sample requests carry
no sequence number and run as they come.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .memory import keep_freed_memory
from .runtime import Runtime
from .types import InvalidRequest, NotFound, SessError

log = logging.getLogger("sess.engine")

ORDERED_OPS = {
    "forward",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_state",
    "load_state",
    "noop",
}
UNORDERED_OPS = {"sample", "compute_logprobs"}
CONTROL_OPS = {
    "create_session",
    "create_session_from_state",
    "stop_session",
    "delete_session",
    "list_sessions",
    "get_usage",
    "list_base_models",
    "tokenizer_files",
    "checkpoint_files",
    "list_checkpoints",
    "session_info",
}
T = TypeVar("T")
LOCAL_OP = "__local__"  # run_local's callables: never a name a client can send
SEQUENCE_WAIT_S = 120.0  # how long an op may wait for an earlier sequence number to arrive
KEEP_RESULTS = 20_000


@dataclass
class Operation:
    id: str
    owner: str
    name: str
    args: dict
    session: str | None = None
    seq: int | None = None
    created: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: SessError | None = None
    usage: Any = None  # the op's own token counts, when the runtime reports them (sample)

    def finish(self, result: Any = None, error: SessError | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Engine:
    """Queues, orders and runs ops on one executor thread around a :class:`Runtime`."""

    def __init__(self, home: str | Path | None = None, device: str = "cpu", runtime: Runtime | None = None):
        keep_freed_memory()  # before the executor thread's first allocation: see memory.py
        self.runtime = runtime or Runtime(home, device)
        self._cv = threading.Condition()
        self._ready: deque[Operation] = deque()
        self._ops: OrderedDict[str, Operation] = OrderedDict()
        self._tokens: dict[tuple[str, str], str] = {}
        self._next_seq: dict[str, int] = {}
        self._parked: dict[str, dict[int, Operation]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sess-executor", daemon=True)
        self._thread.start()

    # entry points ----------------------------------------------------------------------------------
    def submit(
        self,
        owner: str,
        name: str,
        args: dict,
        *,
        session: str | None = None,
        seq: int | None = None,
        client_token: str | None = None,
    ) -> str:
        """Queue an op and return its id at once; its result comes from :meth:`wait`."""
        if name not in ORDERED_OPS | UNORDERED_OPS:
            raise InvalidRequest(f"op: unknown operation {name!r}")
        if not isinstance(args, dict):
            raise InvalidRequest("args: expected an object")
        with self._cv:
            if client_token is not None and (owner, client_token) in self._tokens:
                return self._tokens[(owner, client_token)]
            op = Operation(id=uuid.uuid4().hex, owner=owner, name=name, args=args, session=session, seq=seq)
            if name in ORDERED_OPS:
                self._order(op)
            else:
                self._ready.append(op)
            self._remember(op, client_token)
            self._cv.notify_all()
            return op.id

    def wait(self, owner: str, op_id: str, timeout: float | None = None) -> Operation | None:
        """The finished op, or None if it is still pending after ``timeout`` seconds."""
        with self._cv:
            op = self._ops.get(op_id)
        if op is None or op.owner != owner:
            raise NotFound(f"operation {op_id!r} not found")
        return op if op.done.wait(timeout) else None

    def call(self, owner: str, name: str, args: dict | None = None) -> Any:
        """Run a control op (create/list/stop sessions, ...) on the executor and return its result."""
        if name not in CONTROL_OPS:
            raise InvalidRequest(f"op: unknown control operation {name!r}")
        op = Operation(id=uuid.uuid4().hex, owner=owner, name=name, args=dict(args or {}))
        with self._cv:
            self._ready.append(op)
            self._cv.notify_all()
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def run_local(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the executor thread, between ops, and return its result or raise its
        exception (in-process engines only: nothing over HTTP can name this op).

        For code in the engine's process that does heavy torch work of its own, such as a baseline
        model in a benchmark: torch kernels run on an OpenMP thread team of the calling thread, and a
        second team in the process makes every parallel region of both wait for woken workers on a
        small machine. Run here, the work shares the engine's team."""
        box: dict[str, Any] = {}

        def run() -> dict:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc
            return {}

        op = Operation(id=uuid.uuid4().hex, owner="", name=LOCAL_OP, args={"fn": run})
        with self._cv:
            self._ready.append(op)
            self._cv.notify_all()
        op.done.wait()
        if "error" in box:
            raise box["error"]
        return box["result"]

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ordering --------------------------------------------------------------------------------------
    def _order(self, op: Operation) -> None:
        if not isinstance(op.session, str) or not isinstance(op.seq, int) or isinstance(op.seq, bool):
            raise InvalidRequest(f"{op.name}: needs a session name and an integer sequence number")
        expected = self._next_seq.get(op.session, 1)
        if op.seq < expected or op.seq in self._parked.get(op.session, {}):
            raise InvalidRequest(
                f"seq: sequence number {op.seq} of session {op.session!r} was already used "
                f"(next expected {expected}); resubmit with the same client token to fetch its result",
                status=409,
            )
        self._parked.setdefault(op.session, {})[op.seq] = op
        parked = self._parked[op.session]
        while expected in parked:
            self._ready.append(parked.pop(expected))
            expected += 1
        self._next_seq[op.session] = expected

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for session, parked in self._parked.items():
            for seq, op in list(parked.items()):
                if now - op.created > SEQUENCE_WAIT_S:
                    del parked[seq]
                    expected = self._next_seq.get(session, 1)
                    op.finish(
                        error=InvalidRequest(
                            f"seq: op {seq} of session {session!r} waited for {expected}, which never arrived",
                            status=409,
                        )
                    )

    def _remember(self, op: Operation, client_token: str | None) -> None:
        self._ops[op.id] = op
        if client_token is not None:
            self._tokens[(op.owner, client_token)] = op.id
        while len(self._ops) > KEEP_RESULTS:
            old_id, old = self._ops.popitem(last=False)
            if not old.done.is_set():  # never drop a pending op
                self._ops[old_id] = old
                self._ops.move_to_end(old_id, last=False)
                break
        if len(self._tokens) > 2 * KEEP_RESULTS:
            self._tokens = {k: v for k, v in self._tokens.items() if v in self._ops}

    # the executor ----------------------------------------------------------------------------------
    def _run(self) -> None:
        """Interleave ops with decode steps: new sample requests join the running batch, then one
        other op runs, then every running row decodes one token; a training op waits one step at most."""
        while True:
            with self._cv:
                while not self._ready and not self.runtime.decoding and not self._closed:
                    self._cv.wait(timeout=1.0)
                    self._expire_parked()
                if self._closed:
                    return
                samples = [op for op in self._ready if op.name == "sample"]
                if samples:
                    self._ready = deque(op for op in self._ready if op.name != "sample")
                op = self._ready.popleft() if self._ready else None
            for sample in samples:
                self._start_sample(sample)
            if op is not None:
                self._execute(op)
            if self.runtime.decoding:
                try:
                    self.runtime.decode_step()
                except Exception as exc:  # a failed step ends the requests in it, never the executor
                    log.error("decode step failed:\n%s", traceback.format_exc())
                    self.runtime.fail_decoding(
                        SessError(
                            f"sampling failed inside the engine: {type(exc).__name__}: {exc}", status=500
                        )
                    )

    def _start_sample(self, op: Operation) -> None:
        def done(result, error, usage) -> None:
            op.usage = usage
            op.finish(result=result, error=error)
            self._finished(op)

        try:
            args = dict(op.args)
            inspect.signature(self.runtime.start_sample).bind(op.owner, done, **args)
            self.runtime.start_sample(op.owner, done, **args)
        except TypeError as exc:
            op.finish(error=InvalidRequest(f"sample: {exc}"))
            self._finished(op)
        except SessError as exc:
            op.finish(error=exc)
            self._finished(op)
        except Exception as exc:
            log.error("op sample failed:\n%s", traceback.format_exc())
            op.finish(
                error=SessError(f"sample failed inside the engine: {type(exc).__name__}: {exc}", status=500)
            )
            self._finished(op)

    def _execute(self, op: Operation) -> None:
        try:
            op.finish(result=self._dispatch(op))
        except SessError as exc:
            op.finish(error=exc)
        except Exception as exc:  # an engine bug or a torch failure must not end the executor
            log.error("op %s failed:\n%s", op.name, traceback.format_exc())
            op.finish(
                error=SessError(
                    f"{op.name} failed inside the engine: {type(exc).__name__}: {exc}", status=500
                )
            )
        self._finished(op)

    def _finished(self, op: Operation) -> None:
        """Called on the executor thread once ``op`` has its result or error (a hook for subclasses)."""

    def _dispatch(self, op: Operation) -> Any:
        runtime, args = self.runtime, op.args
        if op.name == "noop":
            return {}
        if op.name == LOCAL_OP and callable(args.get("fn")):  # only run_local builds these
            return args["fn"]()
        if op.name == "session_info":
            summary = runtime.session(op.owner, args["name"], live=False).summary()
            return {**summary, "next_seq": self._next_seq.get(args["name"], 1)}
        if op.name in ORDERED_OPS:
            args = {**args, "session": op.session}
        method = getattr(runtime, op.name)
        try:
            inspect.signature(method).bind(op.owner, **args)
        except TypeError as exc:
            raise InvalidRequest(f"{op.name}: {exc}") from None
        return method(op.owner, **args)
