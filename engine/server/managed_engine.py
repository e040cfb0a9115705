"""The engine as a server runs it: the executor plus registry records, session limits and idle stops.

:class:`ManagedEngine` records every session, checkpoint and op (with its own token counts) in the
SQLite registry, restores the sessions of a previous process as ``Interrupted`` (their checkpoints
stay usable), refuses a key's session beyond its live-session limit, and stops sessions whose
clients sent no op or heartbeat for ``idle_timeout`` seconds, or whose clients heart-beat and then
fell silent for ``heartbeat_lapse`` seconds (the client process is gone), after saving their
state: a stopped session no longer counts against its key's limit and resumes from that state. Its
:class:`~sess.engine.server.billing.Billing` prices each op as it is recorded, and refuses a submit
past the key's budget (402) or its queue limit (429) before the op takes a sequence number. Its
:class:`~sess.engine.server.lifecycle.Lifecycle` keeps checkpoint TTLs, metadata and publishing,
sweeps expired checkpoints from the idle thread, and writes the audit log.
"""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sess.engine.protocol import requests as rq
from sess.engine.protocol.checkpoint_paths import parse_path
from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.protocol.types import SessionStatus, Usage
from sess.engine.runtime import session_names
from sess.engine.runtime.executor import Executor, Operation
from sess.engine.runtime.memory.malloc_tuning import IDLE_TRIM_S, allocator, keep_freed_memory, trim
from sess.engine.runtime.ops import checkpoint_ops, session_ops
from sess.engine.runtime.ops.table import OPS
from sess.engine.runtime.runtime import Runtime
from sess.engine.runtime.session import Session
from sess.engine.runtime.usage import Unrecorded, session_of
from sess.engine.server.billing import Billing
from sess.engine.server.lifecycle import SWEEP_S, Lifecycle
from sess.engine.server.settings import HEARTBEAT_LAPSE_S, IDLE_TIMEOUT_S, MAX_SESSIONS
from sess.engine.server.sqlite_registry import Registry

log = logging.getLogger("sess.engine")


def request_type(op: object) -> type | None:
    """The request type of op ``op``, None for a name that is no op (refused when it is read)."""
    spec = OPS.get(op) if isinstance(op, str) else None
    return spec.request if spec is not None else None


def client_error(owner: str, error: SessError) -> SessError:
    """``error`` with ``owner``'s session ids named as its client names them."""
    message = session_names.client_message(owner, str(error))
    if message != str(error):
        error.args = (message,)
    return error


def client_op(owner: str, op: Operation | None) -> Operation | None:
    """A finished op as ``owner`` sees it: its result and error name sessions as ``owner`` does."""
    if op is None or not op.done.is_set():
        return op
    error = client_error(owner, op.error) if op.error is not None else None
    return dataclasses.replace(op, result=session_names.client_view(owner, op.result), error=error)


class ManagedEngine(Executor):
    idle_after_s = IDLE_TRIM_S  # then idle() hands memory back: see memory.py

    def __init__(
        self,
        home: str | Path | None = None,
        device: str = "cpu",
        *,
        idle_timeout: float = IDLE_TIMEOUT_S,
        heartbeat_lapse: float = HEARTBEAT_LAPSE_S,
        max_sessions: int = MAX_SESSIONS,
        session_limits: Callable[[str], int | None] | None = None,
        runtime: Runtime | None = None,
        billing: Callable[[Registry], Billing] | None = None,
        fair: bool = True,
    ):
        keep_freed_memory(device)  # a CPU engine process keeps freed memory for its next step: see memory.py
        log.info("malloc: %s", allocator())
        runtime = runtime or Runtime(home, device)
        self.registry = Registry(runtime.home)
        self.billing = billing(self.registry) if billing else Billing(self.registry)
        self.idle_timeout = idle_timeout
        self.heartbeat_lapse = heartbeat_lapse
        self.max_sessions = max_sessions
        self.session_limits = session_limits  # owner -> its limit, or None for the engine's
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
        super().__init__(runtime=runtime, fair=fair)
        # front ends' hooks: the sess:// paths their samplers hold, which the TTL sweep keeps
        self.checkpoint_users: list[Callable[[], set[str]]] = []
        self.lifecycle = Lifecycle(self)
        self._idle_thread = threading.Thread(target=self._watch_idle, name="sess-idle", daemon=True)
        self._idle_thread.start()

    def submit(
        self,
        owner: str,
        name: str,
        args,
        *,
        session=None,
        seq=None,
        client_token=None,
        hold_seq: bool = False,
        progress=None,
    ) -> str:
        """Queue an op (see Executor.submit). Past the key's budget a costly op is refused (402) and
        its sequence number used up, so the session's later ops run; ``hold_seq`` leaves the number
        free instead, for a client that re-sends the same op until the budget is raised (tinker)."""
        args = session_names.engine_args(self.runtime, owner, request_type(name), args)
        session = session_names.engine_name(self.runtime, owner, session)
        # Another key's session must look absent, not busy: check before sequence ordering answers.
        if isinstance(session, str) and self.runtime.find_session(owner, session) is None:
            raise NotFound(f"session {session!r} not found")
        # The op a session's parked ops wait for is never held back by the queue limit, since those
        # parked ops fill the queue until it arrives; nor is a noop, which only keeps an order moving.
        if name != "noop" and not (isinstance(session, str) and self.unblocks(session, seq)):
            self.billing.check_queue(owner)
        # A costly op's tokens are paid for (the op table's column); the rest (optim_step, saves,
        # loads, noop) cost nothing and keep a session's state and order whole.
        spec = OPS.get(name) if isinstance(name, str) else None
        refusal = self.billing.over_budget(owner) if spec is not None and spec.costly else None
        if refusal is not None:
            if (
                not hold_seq
                and isinstance(session, str)
                and isinstance(seq, int)
                and not isinstance(seq, bool)
            ):
                try:  # its sequence number is used up, so the session's later ops still run
                    super().submit(owner, "noop", {}, session=session, seq=seq)
                except SessError:
                    pass  # already used (a resubmission): nothing waits for it
            raise refusal
        op_id = super().submit(
            owner, name, args, session=session, seq=seq, client_token=client_token, progress=progress
        )
        self.billing.accepted(owner, self._owned(owner, op_id))
        if isinstance(session, str) and session in self.heartbeats:
            self.heartbeats[session] = time.time()  # its client is alive, however long the op queues
        return op_id

    def call(self, owner: str, name: str, args=None):
        """Run a control op; its names and paths, and its answer's, are ``owner``'s own
        (:mod:`sess.engine.runtime.session_names`)."""
        try:
            return session_names.client_view(owner, self._call(owner, name, args))
        except SessError as exc:
            raise client_error(owner, exc) from None

    def run(self, fn, *, owner: str = "", wait: bool = True):
        """Run the engine's own ``fn`` on the executor; an error for ``owner`` names sessions as
        ``owner`` does."""
        try:
            return super().run(fn, owner=owner, wait=wait)
        except SessError as exc:
            raise (client_error(owner, exc) if owner else exc) from None

    def wait(self, owner: str, op_id: str, timeout: float | None = None) -> Operation | None:
        return client_op(owner, super().wait(owner, op_id, timeout))

    async def wait_async(self, owner: str, op_id: str, timeout: float) -> Operation | None:
        return client_op(owner, await super().wait_async(owner, op_id, timeout))

    def _call(self, owner: str, name: str, args=None):
        args = session_names.engine_args(self.runtime, owner, request_type(name), args)
        result = super().call(owner, name, args)
        if name == "list_checkpoints":
            result = self.lifecycle.describe(owner, result)
        if name == "get_usage" and isinstance(result, dict) and self.billing.prices is not None:
            session = (args or {}).get("name")  # already the engine's id of it
            rows = self.registry.usage_by_operation(owner, session)
            cost = sum(int(r.get("cost_pu") or 0) for r in rows.values())
            result = {**result, "cost": self.billing.money(cost), "currency": self.billing.prices.currency}
        return result

    def heartbeat(self, owner: str, sessions: list[str]) -> None:
        now = time.time()
        for name in sessions:
            session = self.runtime.find_session(owner, name)
            if session is not None:
                self.heartbeats[session.name] = now

    # observing ops ---------------------------------------------------------------------------------
    def admit(self, op: Operation) -> None:
        if OPS[op.name].starts_session:
            live = [s.name for s in self.runtime.sessions.values() if s.owner == op.owner and s.live]
            limit = self._limit_for(op.owner)
            if len(live) >= limit:
                raise InvalidRequest(
                    f"session limit: this key already has {len(live)} live sessions (limit {limit}); "
                    f"stop one first (sess stop NAME): {', '.join(live)}",
                    status=429,
                )

    def finished(self, op: Operation) -> None:
        self.billing.done(op.owner, op.id)
        if OPS[op.name].accounted:
            self._record(op)

    def _limit_for(self, owner: str) -> int:
        limit = self.session_limits(owner) if self.session_limits else None
        return self.max_sessions if limit is None else limit

    def _record(self, op: Operation) -> None:
        """The op in the registry, with the usage its session was just given (one source for both,
        so a session's total is the sum of its per-operation rows). The ledger row goes first: if it
        cannot be written the op is answered :class:`Unrecorded` (and the rest is not written); a
        later registry write that fails answers a 507 too, the op billed."""
        name = session_of(op.session, op.request, op.result)
        session = self.runtime.find_session(op.owner, name) if name else None
        spec = OPS[op.name]
        forgets = spec.forgets_session and op.error is None
        usage = (op.usage or Usage(operations=1)).to_wire()
        error = str(op.error) if op.error is not None else None
        target = getattr(op.request, "target", None)
        billed_to = None if forgets else session
        model = billed_to.base_model if billed_to is not None else getattr(target, "base_model", None)
        cost = self.billing.cost(model, op.name, usage)
        queue_s = max(0.0, time.monotonic() - op.created - float(usage.get("wall_time_s") or 0.0))
        try:
            self.registry.record_operation(
                op.id, op.owner, op.name, name if billed_to else None, error, usage, cost, queue_s
            )
        except sqlite3.Error as exc:
            raise Unrecorded(
                f"ledger: the engine could not record this {op.name} in its registry "
                f"({self.registry.path}: {exc}), so its result is withheld and it is not billed; the "
                "engine's operator must free disk space in the engine home, then send the op again"
            ) from exc
        try:
            self._record_state(op, name, session, spec)
        except sqlite3.Error as exc:
            raise SessError(
                f"registry: this {op.name} ran and is billed, but the engine could not record the "
                f"session's state in its registry ({self.registry.path}: {exc}); the engine's "
                "operator must free disk space in the engine home",
                status=507,
            ) from exc

    def _record_state(self, op: Operation, name: str | None, session: Session | None, spec) -> None:
        """What ``op`` changed besides the ledger: sessions, checkpoints, the audit log."""
        if spec.forgets_session and op.error is None:
            self.registry.forget_session(name)
            self.registry.add_audit(op.owner, "session_deleted", session=name)
            # a later session of the same name must not find its checkpoints published
            self.runtime.published -= {p for p in self.runtime.published if p.startswith(f"sess://{name}/")}
            session = None
        if spec.removes_checkpoint and op.error is None:
            self.registry.add_audit(op.owner, "checkpoint_deleted", path=op.result["path"])
            self.runtime.published.discard(op.result["path"])
            self.registry.remove_checkpoint(op.result["path"])
        if session is not None and not session.live:
            self._forget_gone_checkpoints(name)
        if session is None:
            return
        before = self.registry.session(name) if op.name == "create_session_from_state" else None
        if before is not None and op.error is None:  # a stopped session continued under its name
            self.registry.add_resume(before, op.request.path, session.step)
            self.registry.add_audit(op.owner, "session_resumed", session=name, path=op.request.path)
        elif spec.starts_session and op.error is None:
            self.registry.add_audit(op.owner, "session_created", session=name, base_model=session.base_model)
        self.registry.save_session(session.summary(), session.owner)
        if op.saved:
            self.registry.add_checkpoint(op.saved, name, op.owner, "state")
        if op.error is None and spec.adds_checkpoint:
            ref = parse_path(op.result["path"])
            self.registry.add_checkpoint(ref.uri, ref.session, op.owner, ref.kind)
            self.runtime.published.discard(ref.uri)  # saved again under its name: private again
            self.lifecycle.saved(op)
            for released in op.result.get("released", []):
                self.registry.remove_checkpoint(released)

    # room at the live-session limit --------------------------------------------------------------
    def at_limit(self, owner: str) -> bool:
        live = [s for s in self.runtime.sessions.values() if s.owner == owner and s.live]
        return len(live) >= self._limit_for(owner)

    def silent_for(self, owner: str, among: set[str]) -> list[tuple[float, str]]:
        """(seconds silent, name) of ``owner``'s live sessions in ``among`` whose client heart-beats,
        longest first."""
        now = time.time()
        found = [
            (now - self._last_seen(s), s.name)
            for s in list(self.runtime.sessions.values())
            if s.owner == owner and s.live and s.name in self.heartbeats and s.name in among
        ]
        return sorted(found, reverse=True)

    def release_silent(self, owner: str, silent_s: float, among: set[str], most: int = 1) -> list[str]:
        """Stop (state saved, as the heartbeat lapse would) at most ``most`` of ``owner``'s sessions in
        ``among`` whose heart-beating client has been silent over ``silent_s`` (it missed its beats, so
        it has exited), the longest silent first; the others are left to the lapse."""
        names = [name for silent, name in self.silent_for(owner, among) if silent > silent_s][:most]

        def stop(runtime: Runtime) -> list[str]:
            return [name for name in names if self._stop_idle(runtime, name, silent_s)]

        return self.run(stop, owner=owner) if names else []

    def _forget_gone_checkpoints(self, session: str) -> None:
        """Registry rows of ``session``'s checkpoints whose files are gone (a stopped session's
        transient samplers)."""
        for row in self.registry.checkpoints(session):
            if not parse_path(row["path"]).directory(self.runtime.home).exists():
                self.registry.remove_checkpoint(row["path"])

    def idle(self) -> None:
        """No work for a while: drop sampling's packed weight copies and hand free memory back (the
        host heap's, and on CUDA the caching allocator's free blocks)."""
        for host in self.runtime.hosts.values():
            host.release_sampling_memory()
        trim()
        if self.runtime.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    # idle sessions ---------------------------------------------------------------------------------
    def _watch_idle(self) -> None:
        """Stop idle sessions (and those whose client stopped heart-beating), and sweep expired
        checkpoints every SWEEP_S seconds."""
        period = max(0.2, min(5.0, self.idle_timeout / 4, self.heartbeat_lapse / 4, SWEEP_S))
        next_sweep = time.monotonic() + SWEEP_S
        while not self._closed:
            time.sleep(period)
            for name in self._idle_sessions():
                self.run(lambda runtime, n=name: self._stop_idle(runtime, n), wait=False)
            if time.monotonic() >= next_sweep and not self._closed:
                next_sweep = time.monotonic() + SWEEP_S
                try:
                    self.lifecycle.sweep()
                except Exception:  # the next sweep tries again; serving goes on
                    log.exception("the checkpoint sweep failed")

    def _idle_sessions(self) -> list[str]:
        now = time.time()
        return [
            s.name
            for s in list(self.runtime.sessions.values())
            if s.live and now - self._last_seen(s) > self._timeout(s)
        ]

    def _timeout(self, session: Session) -> float:
        """How long ``session`` may stay silent: the idle timeout, or the shorter heartbeat lapse
        once its client has heart-beat (a silent heart-beating client has exited or lost the
        engine)."""
        if session.name in self.heartbeats:
            return min(self.idle_timeout, self.heartbeat_lapse)
        return self.idle_timeout

    def _last_seen(self, session: Session) -> float:
        return max(session.last_active, session.created, self.heartbeats.get(session.name, 0.0))

    def _stop_idle(self, runtime: Runtime, name: str, timeout: float | None = None) -> bool:
        session = runtime.sessions.get(name)
        if session is None or not session.live:
            return False
        timeout = self._timeout(session) if timeout is None else timeout
        if time.time() - self._last_seen(session) <= timeout:
            return False  # an op or a heartbeat arrived while this stop waited in the queue
        owner = session.owner
        silent = "its client stopped heart-beating" if name in self.heartbeats else "it was idle"
        self._save_state(runtime, session, "idle")
        stop = rq.SessionName(name=name)
        runtime.prepare("stop_session", owner, stop)  # other ranks stop it too
        session_ops.stop_session(runtime, owner, stop)
        self.registry.save_session(session.summary(), owner)
        self._forget_gone_checkpoints(name)
        self.heartbeats.pop(name, None)  # resumed, it starts on the idle timeout again
        log.warning("session %s: %s for over %.0f s: state saved, session stopped", name, silent, timeout)
        return True

    def _save_state(self, runtime: Runtime, session: Session, reason: str) -> None:
        """``session``'s state before it stops (:func:`sess.engine.runtime.ops.checkpoint_ops.save_unsaved_state`), in
        the registry too; a failure is logged: the session stops anyway, without those steps."""
        try:
            path = checkpoint_ops.save_unsaved_state(runtime, session.owner, session.name, reason)
        except (SessError, OSError) as exc:
            log.warning("session %s: saving its state failed: %s", session.name, exc)
            return
        if path:
            self.registry.add_checkpoint(path, session.name, session.owner, "state")

    def _save_live_sessions(self, runtime: Runtime) -> None:
        for session in list(runtime.sessions.values()):
            if session.live:
                self._save_state(runtime, session, "shutdown")

    def close(self) -> None:
        """Stop serving. A one-rank engine first saves the state of every live session that
        trained since its last save (they become Interrupted, resumable from it). Several ranks
        stop together on the signal, so their sessions keep only the states saved before."""
        if self.runtime.placement.world == 1 and not self._closed:
            try:
                self.run(self._save_live_sessions)
            except Exception:  # stopping must not fail on it
                log.exception("saving the live sessions' state at shutdown failed")
        super().close()
        self.registry.close()
