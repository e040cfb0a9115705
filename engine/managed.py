"""The engine as a server runs it: the executor of ``service.py`` plus registry, limits and idle stops.

:class:`ManagedEngine` records every session, checkpoint and op (with its own token counts) in the
SQLite registry, restores the sessions of a previous process as ``Interrupted`` (their checkpoints
stay usable), refuses a key's session beyond its live-session limit, and stops sessions whose
clients stopped heart-beating for ``idle_timeout`` seconds after saving their state. Waiters in an
asyncio loop (the HTTP server) are woken the moment their op finishes, without a thread each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from . import checkpoints as ckpt
from .registry import Registry
from .runtime import Runtime, Session
from .service import CONTROL_OPS, ORDERED_OPS, UNORDERED_OPS, Engine, Operation
from .types import InvalidRequest, NotFound, SessError, SessionStatus, Usage

log = logging.getLogger("sess.engine")
RECORDED_CONTROL = {"create_session", "create_session_from_state", "stop_session", "delete_session"}


class ManagedEngine(Engine):
    def __init__(
        self,
        home: str | Path | None = None,
        device: str = "cpu",
        *,
        idle_timeout: float = 600.0,
        max_sessions: int = 8,
        session_limits: Any = None,
    ):
        runtime = Runtime(home, device)
        self.registry = Registry(runtime.home)
        self.idle_timeout = idle_timeout
        self.max_sessions = max_sessions
        self.session_limits = session_limits  # owner -> limit or None (a callable)
        self.heartbeats: dict[str, float] = {}
        self.interrupted = self.registry.interrupt_live()
        for row in self.registry.sessions():
            runtime.sessions[row["name"]] = Session(
                name=row["name"],
                owner=row["owner"],
                base_model=row["base_model"],
                lora=row["lora"] or {},
                user_metadata=row["user_metadata"],
                status=SessionStatus(row["status"]),
                created=row["created"],
                last_active=row["last_active"],
                step=row["step"] or 0,
                usage=Usage.from_wire(row["usage"]) if row["usage"] else Usage(),
            )
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._waiters_lock = threading.Lock()
        super().__init__(runtime=runtime)
        self._idle_thread = threading.Thread(target=self._watch_idle, name="sess-idle", daemon=True)
        self._idle_thread.start()

    # asyncio long-poll -----------------------------------------------------------------------------
    async def wait_async(self, owner: str, op_id: str, timeout: float) -> Operation | None:
        op = self.wait(owner, op_id, 0)
        if op is not None:
            return op
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._waiters_lock:
            self._waiters.setdefault(op_id, []).append((loop, future))
        op = self._ops.get(op_id)
        if op is not None and op.done.is_set():
            return op
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            with self._waiters_lock:
                waiters = self._waiters.get(op_id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))
                if not waiters:
                    self._waiters.pop(op_id, None)
        return self._ops.get(op_id)

    def _wake(self, op_id: str) -> None:
        with self._waiters_lock:
            waiters = self._waiters.pop(op_id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(True))

    # internal ops (not reachable by clients) ---------------------------------------------------------
    def run_internal(self, owner: str, fn, *, wait: bool = True) -> Any:
        """Run ``fn(runtime)`` on the executor thread, between client ops."""
        op = Operation(id=uuid.uuid4().hex, owner=owner, name="_internal", args={"fn": fn})
        with self._cv:
            self._ready.append(op)
            self._cv.notify_all()
        if not wait:
            return op
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def submit(self, owner: str, name: str, args: dict, *, session=None, seq=None, client_token=None) -> str:
        # Another key's session must look absent, not busy: check before sequence ordering answers.
        if name in ORDERED_OPS and isinstance(session, str):
            found = self.runtime.sessions.get(session)
            if found is None or found.owner != owner:
                raise NotFound(f"session {session!r} not found")
        return super().submit(owner, name, args, session=session, seq=seq, client_token=client_token)

    def heartbeat(self, owner: str, sessions: list[str]) -> None:
        now = time.time()
        for name in sessions:
            session = self.runtime.sessions.get(name)
            if session is not None and session.owner == owner:
                self.heartbeats[name] = now

    def _limit_for(self, owner: str) -> int:
        limit = self.session_limits(owner) if self.session_limits else None
        return self.max_sessions if limit is None else limit

    # the executor hooks ----------------------------------------------------------------------------
    def _dispatch(self, op: Operation) -> Any:
        if op.name == "_internal":
            return op.args["fn"](self.runtime)
        if op.name in ("create_session", "create_session_from_state"):
            live = [
                s.name
                for s in self.runtime.sessions.values()
                if s.owner == op.owner and s.status == SessionStatus.Running
            ]
            limit = self._limit_for(op.owner)
            if len(live) >= limit:
                raise InvalidRequest(
                    f"session limit: this key already has {len(live)} live sessions (limit {limit}); "
                    f"stop one first (sess stop NAME): {', '.join(live)}",
                    status=429,
                )
        return super()._dispatch(op)

    def _execute(self, op: Operation) -> None:
        op.usage_before = self._usage(_session_of(op))  # synchronous ops: usage is the session's delta
        super()._execute(op)

    def _finished(self, op: Operation) -> None:
        # sample requests finish later, from the decode loop, with their own counts in op.usage
        self._wake(op.id)
        try:
            self._record(op, _session_of(op), getattr(op, "usage_before", None))
        except Exception:  # the registry must never take the executor down
            log.exception("registry: recording op %s failed", op.name)

    def _usage(self, name: str | None) -> Usage | None:
        session = self.runtime.sessions.get(name) if name else None
        return session.usage if session is not None else None

    def _record(self, op: Operation, name: str | None, before: Usage | None) -> None:
        recorded = op.name in ORDERED_OPS | UNORDERED_OPS | RECORDED_CONTROL and op.name != "noop"
        if not recorded:
            return
        if name is None and op.name in ("create_session", "create_session_from_state") and op.result:
            name = op.result["name"]
        session = self.runtime.sessions.get(name) if name else None
        if op.name == "delete_session" and op.error is None:
            self.registry.forget_session(name)
            session = None
        if session is not None and session.owner == op.owner:
            self.registry.save_session(session.summary(), session.owner)
            if op.error is None and op.name in ("save_weights", "save_state") and op.result:
                ref = ckpt.parse_path(op.result["path"])
                self.registry.add_checkpoint(ref.uri, ref.session, op.owner, ref.kind)
                for released in op.result.get("released", []):
                    self.registry.remove_checkpoint(released)
        counts = {}
        if op.usage is not None:
            counts = {k: v for k, v in op.usage.to_wire().items() if k not in ("wall_time_s", "operations")}
        elif session is not None and before is not None:
            after = session.usage
            counts = {k: getattr(after, k) - getattr(before, k) for k in Usage.__dataclass_fields__}
        self.registry.record_operation(
            op.id,
            op.owner,
            op.name,
            name if session is not None else None,
            str(op.error) if op.error is not None else None,
            counts,
        )

    # idle sessions ---------------------------------------------------------------------------------
    def _watch_idle(self) -> None:
        period = max(0.2, min(5.0, self.idle_timeout / 4))
        while not self._closed:
            time.sleep(period)
            for name in self._idle_sessions():
                session = self.runtime.sessions.get(name)
                if session is not None:
                    self.run_internal(session.owner, lambda rt, n=name: self._stop_idle(rt, n), wait=False)

    def _idle_sessions(self) -> list[str]:
        now = time.time()
        return [
            s.name
            for s in list(self.runtime.sessions.values())
            if s.status == SessionStatus.Running and now - self._last_seen(s) > self.idle_timeout
        ]

    def _last_seen(self, session: Session) -> float:
        return max(session.last_active, session.created, self.heartbeats.get(session.name, 0.0))

    def _stop_idle(self, runtime: Runtime, name: str) -> None:
        session = runtime.sessions.get(name)
        if session is None or session.status != SessionStatus.Running:
            return
        if time.time() - self._last_seen(session) <= self.idle_timeout:
            return  # an op or a heartbeat arrived while this stop waited in the queue
        try:
            path = runtime.save_state(session.owner, name, name=f"idle-step{session.step:06d}")["path"]
            self.registry.add_checkpoint(path, name, session.owner, "state")
        except SessError as exc:
            log.warning("idle session %s: saving its state failed: %s", name, exc)
        runtime.stop_session(session.owner, name)
        self.registry.save_session(session.summary(), session.owner)
        log.warning(
            "session %s was idle for over %.0f s: state saved, session stopped", name, self.idle_timeout
        )

    def close(self) -> None:
        super().close()
        self.registry.close()


def _session_of(op: Operation) -> str | None:
    """The session an op works on or is accounted to, if any."""
    if op.session:
        return op.session
    args = op.args
    target = args.get("target")
    if isinstance(target, dict):
        if isinstance(target.get("session"), str):
            return target["session"]
        if isinstance(target.get("model_path"), str):
            try:
                return ckpt.parse_path(target["model_path"]).session
            except SessError:
                return None
    if op.name in CONTROL_OPS and isinstance(args.get("name"), str):
        return args["name"]
    return None
