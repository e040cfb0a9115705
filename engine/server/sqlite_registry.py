"""The engine's registry: SQLite in the engine home (``registry.db``) that outlives the process.

Tables: ``sessions`` (one row per session, its status, step and usage), ``checkpoints`` (every
saved ``sess://`` path), ``operations`` (one row per op with its own token counts and wall time),
``usage`` (per session and op name, summed), ``spend`` (per owner, summed over every op it ever
ran: what its budget is checked against, kept when a session is deleted) and ``resumes`` (each time
a stopped session was continued under its own name: from which checkpoint, and the status and step
it had before, which its ``sessions`` row no longer shows), ``runs`` (a session's project and display
name, as a Tinker client gave them) and ``audit`` (who created, deleted, resumed, published a session
or checkpoint, changed a key or budget, and when). A checkpoint row carries its ``expires_at`` (None:
kept until deleted), ``user_metadata`` and whether it is ``public`` (readable by every key). Costs are integers of pico-units
(:mod:`sess.engine.protocol.prices`), 0 where the engine has no prices. A home from before costs,
checkpoint lifecycles or queue times gains the columns and the ``spend`` table (filled from its
operations) when opened. When an engine starts,
sessions the previous process
left ``Running`` become ``Interrupted``: their adapters died with it, their checkpoints did not.
A file SQLite cannot read raises :class:`~.registry_guard.RegistryUnreadable`, naming the file and
the fixes; :meth:`Registry.backup` writes ``registry.db.bak`` (:mod:`.registry_guard`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

from sess.engine.protocol.home import sess_home
from sess.engine.server import registry_guard
from sess.engine.server.registry_guard import RegistryUnreadable

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    name TEXT PRIMARY KEY, owner TEXT NOT NULL, base_model TEXT NOT NULL, status TEXT NOT NULL,
    created REAL, last_active REAL, step INTEGER, lora TEXT, user_metadata TEXT, usage TEXT
);
CREATE TABLE IF NOT EXISTS checkpoints (
    path TEXT PRIMARY KEY, session TEXT NOT NULL, owner TEXT NOT NULL, kind TEXT NOT NULL, created REAL,
    expires_at REAL, user_metadata TEXT, public INTEGER DEFAULT 0
);
CREATE TABLE IF NOT EXISTS operations (
    id TEXT PRIMARY KEY, session TEXT, owner TEXT NOT NULL, name TEXT NOT NULL, ok INTEGER,
    error TEXT, finished REAL, wall_time_s REAL, prefill_tokens INTEGER, sampled_tokens INTEGER,
    training_tokens INTEGER, cost_pu INTEGER DEFAULT 0, queue_s REAL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS operations_session ON operations(session);
CREATE TABLE IF NOT EXISTS usage (
    session TEXT NOT NULL, owner TEXT NOT NULL, operation TEXT NOT NULL, count INTEGER,
    prefill_tokens INTEGER, sampled_tokens INTEGER, training_tokens INTEGER, wall_time_s REAL,
    cost_pu INTEGER DEFAULT 0, PRIMARY KEY (session, operation)
);
CREATE TABLE IF NOT EXISTS resumes (
    session TEXT NOT NULL, owner TEXT NOT NULL, path TEXT NOT NULL, resumed REAL,
    status_before TEXT, step_before INTEGER, step INTEGER
);
CREATE TABLE IF NOT EXISTS runs (
    session TEXT PRIMARY KEY, owner TEXT NOT NULL, project_id TEXT, display_name TEXT
);
CREATE TABLE IF NOT EXISTS audit (time REAL NOT NULL, owner TEXT, event TEXT NOT NULL, details TEXT);
CREATE INDEX IF NOT EXISTS audit_time ON audit(time);
"""
# columns later versions added to a table: (table, column, declaration)
ADDED_COLUMNS = (
    ("operations", "cost_pu", "INTEGER DEFAULT 0"),
    ("usage", "cost_pu", "INTEGER DEFAULT 0"),
    ("operations", "queue_s", "REAL DEFAULT 0"),
    ("checkpoints", "expires_at", "REAL"),
    ("checkpoints", "user_metadata", "TEXT"),
    ("checkpoints", "public", "INTEGER DEFAULT 0"),
)
SPEND = """
CREATE TABLE spend (
    owner TEXT PRIMARY KEY, operations INTEGER, prefill_tokens INTEGER, sampled_tokens INTEGER,
    training_tokens INTEGER, cost_pu INTEGER
);
INSERT INTO spend SELECT owner, COUNT(*), SUM(COALESCE(prefill_tokens, 0)),
    SUM(COALESCE(sampled_tokens, 0)), SUM(COALESCE(training_tokens, 0)), SUM(COALESCE(cost_pu, 0))
    FROM operations GROUP BY owner;
"""
LIVE = ("Starting", "Running", "Stopping")
COUNTS = ("prefill_tokens", "sampled_tokens", "training_tokens", "wall_time_s")


class Registry:
    def __init__(self, home: str | os.PathLike | None = None):
        self.path = Path(sess_home(home)) / "registry.db"
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise RegistryUnreadable(registry_guard.unreadable(self.path.parent, exc)) from exc

    def _migrate(self) -> None:
        """Bring an older home up to this schema: the columns it lacks, then the spend table."""
        with self._lock:
            for table, column, declaration in ADDED_COLUMNS:
                columns = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
                if column not in columns:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            found = self._db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name='spend'")
            if found.fetchone() is None:
                self._db.executescript(f"BEGIN; {SPEND} COMMIT;")

    def _run(self, sql: str, params=()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    # sessions -------------------------------------------------------------------------------------
    def interrupt_live(self) -> list[str]:
        """Mark sessions a dead engine left live as Interrupted; return their names."""
        marks = ",".join("?" * len(LIVE))
        names = [r["name"] for r in self._run(f"SELECT name FROM sessions WHERE status IN ({marks})", LIVE)]
        self._run(f"UPDATE sessions SET status='Interrupted' WHERE status IN ({marks})", LIVE)
        return names

    def sessions(self) -> list[dict]:
        rows = self._run("SELECT * FROM sessions ORDER BY created")
        return [
            {
                **dict(r),
                "lora": json.loads(r["lora"] or "null"),
                "user_metadata": json.loads(r["user_metadata"] or "null"),
                "usage": json.loads(r["usage"] or "{}"),
            }
            for r in rows
        ]

    def save_session(self, summary: dict, owner: str) -> None:
        self._run(
            "INSERT OR REPLACE INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                summary["name"],
                owner,
                summary["base_model"],
                summary["status"],
                summary["created"],
                summary["last_active"],
                summary["step"],
                json.dumps(summary.get("lora")),
                json.dumps(summary.get("user_metadata")),
                json.dumps(summary["usage"]),
            ),
        )

    def session(self, name: str) -> dict | None:
        """Session ``name``'s row as last saved (``status``, ``step``, ...), or None."""
        rows = self._run("SELECT * FROM sessions WHERE name=?", (name,))
        return dict(rows[0]) if rows else None

    def forget_session(self, name: str) -> None:
        for table, column in (
            ("sessions", "name"),
            ("checkpoints", "session"),
            ("usage", "session"),
            ("resumes", "session"),
            ("runs", "session"),
        ):
            self._run(f"DELETE FROM {table} WHERE {column}=?", (name,))

    def add_resume(self, before: dict, path: str, step: int) -> None:
        """Session ``before["name"]`` (its row before) continued from ``path`` at ``step``."""
        self._run(
            "INSERT INTO resumes VALUES (?,?,?,?,?,?,?)",
            (before["name"], before["owner"], path, time.time(), before["status"], before["step"], step),
        )

    def resumes(self, name: str) -> list[dict]:
        return [dict(r) for r in self._run("SELECT * FROM resumes WHERE session=? ORDER BY resumed", (name,))]

    # checkpoints and operations -------------------------------------------------------------------
    def add_checkpoint(
        self,
        path: str,
        session: str,
        owner: str,
        kind: str,
        *,
        expires_at: float | None = None,
        user_metadata: dict | None = None,
    ) -> None:
        """A new checkpoint (one saved again under its name starts over: its own TTL, metadata, private)."""
        self._run(
            "INSERT OR REPLACE INTO checkpoints (path, session, owner, kind, created, expires_at, "
            "user_metadata, public) VALUES (?,?,?,?,?,?,?,0)",
            (path, session, owner, kind, time.time(), expires_at, _json_or_null(user_metadata)),
        )

    def checkpoint(self, path: str) -> dict | None:
        rows = self._run("SELECT * FROM checkpoints WHERE path=?", (path,))
        return _checkpoint_row(rows[0]) if rows else None

    def update_checkpoint(self, path: str, **fields) -> None:
        """Set ``expires_at``, ``public`` or ``user_metadata`` of a checkpoint's row."""
        fields = {k: _json_or_null(v) if k == "user_metadata" else v for k, v in fields.items()}
        assignments = ", ".join(f"{column}=?" for column in fields)  # names from this module only
        self._run(f"UPDATE checkpoints SET {assignments} WHERE path=?", (*fields.values(), path))

    def checkpoint_rows(
        self, *, expired_before: float | None = None, public: bool | None = None
    ) -> list[dict]:
        """Every checkpoint row, or those expired before a time, or the public ones."""
        where, params = [], []
        if expired_before is not None:
            where.append("expires_at IS NOT NULL AND expires_at<=?")
            params.append(expired_before)
        if public is not None:
            where.append("public=?")
            params.append(int(public))
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._run(f"SELECT * FROM checkpoints {clause} ORDER BY created", params)
        return [_checkpoint_row(r) for r in rows]

    def remove_checkpoint(self, path: str) -> None:
        self._run("DELETE FROM checkpoints WHERE path=?", (path,))

    def checkpoints(self, session: str) -> list[dict]:
        return [
            dict(r)
            for r in self._run("SELECT * FROM checkpoints WHERE session=? ORDER BY created", (session,))
        ]

    def record_operation(
        self,
        op_id: str,
        owner: str,
        name: str,
        session: str | None,
        error: str | None,
        counts: dict,
        cost_pu: int = 0,
        queue_s: float = 0.0,
    ) -> None:
        """One op's row (``queue_s``: how long it waited between submit and its run), added to its session's usage row and its owner's spend, in one transaction."""
        values = [counts.get(k, 0) for k in COUNTS]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO operations (id, session, owner, name, ok, error, finished, "
                    "wall_time_s, prefill_tokens, sampled_tokens, training_tokens, cost_pu, queue_s) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        op_id,
                        session,
                        owner,
                        name,
                        error is None,
                        error,
                        time.time(),
                        values[3],
                        *values[:3],
                        cost_pu,
                        queue_s,
                    ),
                )
                self._db.execute(
                    "INSERT INTO spend VALUES (?,1,?,?,?,?) ON CONFLICT(owner) DO UPDATE "
                    "SET operations=operations+1, prefill_tokens=prefill_tokens+excluded.prefill_tokens, "
                    "sampled_tokens=sampled_tokens+excluded.sampled_tokens, "
                    "training_tokens=training_tokens+excluded.training_tokens, cost_pu=cost_pu+excluded.cost_pu",
                    (owner, *values[:3], cost_pu),
                )
                if session is not None:
                    self._db.execute(
                        "INSERT INTO usage VALUES (?,?,?,1,?,?,?,?,?) ON CONFLICT(session, operation) DO UPDATE "
                        "SET count=count+1, prefill_tokens=prefill_tokens+excluded.prefill_tokens, "
                        "sampled_tokens=sampled_tokens+excluded.sampled_tokens, "
                        "training_tokens=training_tokens+excluded.training_tokens, "
                        "wall_time_s=wall_time_s+excluded.wall_time_s, cost_pu=cost_pu+excluded.cost_pu",
                        (session, owner, name, *values, cost_pu),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:  # SQLite may have rolled back already (a full disk)
                    self._db.execute("ROLLBACK")
                raise

    def usage_by_operation(self, owner: str, session: str | None = None) -> dict[str, dict]:
        """{operation name: {count, prefill_tokens, sampled_tokens, training_tokens, wall_time_s, cost_pu}}."""
        where, params = ("owner=? AND session=?", (owner, session)) if session else ("owner=?", (owner,))
        rows = self._run(
            "SELECT operation, SUM(count) AS count, SUM(prefill_tokens) AS prefill_tokens, "
            "SUM(sampled_tokens) AS sampled_tokens, SUM(training_tokens) AS training_tokens, "
            "SUM(wall_time_s) AS wall_time_s, SUM(cost_pu) AS cost_pu "
            f"FROM usage WHERE {where} GROUP BY operation",
            params,
        )
        return {r["operation"]: {k: r[k] for k in r.keys() if k != "operation"} for r in rows}

    def usage_rows(self, by: str, owner: str | None = None) -> dict[str, dict]:
        """Usage summed per ``session`` or per ``owner`` (of one owner, or all): {name: counts}."""
        column = {"session": "session", "owner": "owner"}[by]
        where, params = ("WHERE owner=?", (owner,)) if owner is not None else ("", ())
        rows = self._run(
            f"SELECT {column} AS name, SUM(count) AS count, SUM(prefill_tokens) AS prefill_tokens, "
            "SUM(sampled_tokens) AS sampled_tokens, SUM(training_tokens) AS training_tokens, "
            "SUM(wall_time_s) AS wall_time_s, SUM(cost_pu) AS cost_pu "
            f"FROM usage {where} GROUP BY {column}",
            params,
        )
        return {r["name"]: {k: r[k] for k in r.keys() if k != "name"} for r in rows}

    def spend(self, owner: str) -> dict:
        """What ``owner`` has spent over every op it ran (deleted sessions included)."""
        rows = self._run("SELECT * FROM spend WHERE owner=?", (owner,))
        if not rows:
            return {
                "operations": 0,
                "prefill_tokens": 0,
                "sampled_tokens": 0,
                "training_tokens": 0,
                "cost_pu": 0,
            }
        return {k: rows[0][k] for k in rows[0].keys() if k != "owner"}

    def operation_rows(self, owner: str, start: float, end: float) -> list[dict]:
        """``owner``'s ops that finished in [start, end), with their session's base model."""
        rows = self._run(
            "SELECT o.*, s.base_model AS base_model FROM operations o LEFT JOIN sessions s ON s.name=o.session "
            "WHERE o.owner=? AND o.finished>=? AND o.finished<? ORDER BY o.finished",
            (owner, start, end),
        )
        return [dict(r) for r in rows]

    def all_spend(self) -> list[dict]:
        return [dict(r) for r in self._run("SELECT * FROM spend ORDER BY owner")]

    def operations(self, session: str) -> list[dict]:
        return [
            dict(r)
            for r in self._run("SELECT * FROM operations WHERE session=? ORDER BY finished", (session,))
        ]

    # runs and the audit log ---------------------------------------------------------------------
    def tag_run(self, session: str, owner: str, project_id: str | None, display_name: str | None) -> None:
        self._run("INSERT OR REPLACE INTO runs VALUES (?,?,?,?)", (session, owner, project_id, display_name))

    def run_tags(self, owner: str) -> dict[str, dict]:
        """{session: {project_id, display_name}} of ``owner``'s tagged sessions."""
        rows = self._run("SELECT * FROM runs WHERE owner=?", (owner,))
        return {
            r["session"]: {"project_id": r["project_id"], "display_name": r["display_name"]} for r in rows
        }

    def add_audit(self, actor: str | None, event: str, **details) -> None:
        """One audit entry: the key owner ``actor`` did ``event`` (``<resource>_<action>``) now."""
        self._run(
            "INSERT INTO audit VALUES (?,?,?,?)",
            (time.time(), actor, event, json.dumps(details, default=str)),
        )

    def audit(self, start: float = 0.0, end: float = float("inf"), owner: str | None = None) -> list[dict]:
        """Audit entries in [start, end), oldest first (of one owner, or of every key)."""
        where, params = "time>=? AND time<?", [start, min(end, 1e18)]
        if owner is not None:
            where, params = where + " AND owner=?", [*params, owner]
        rows = self._run(f"SELECT * FROM audit WHERE {where} ORDER BY time, rowid", params)
        return [{**dict(r), "details": json.loads(r["details"] or "{}")} for r in rows]

    # safety copies -----------------------------------------------------------------------------
    def backup(self) -> Path:
        """Write ``registry.db.bak`` beside the registry (SQLite's online backup, renamed into place)."""
        with self._lock:
            return registry_guard.backup(self._db, self.path.parent)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _json_or_null(value) -> str | None:
    return None if value is None else json.dumps(value)


def _checkpoint_row(row: sqlite3.Row) -> dict:
    return {
        **dict(row),
        "user_metadata": json.loads(row["user_metadata"] or "null"),
        "public": bool(row["public"]),
    }
