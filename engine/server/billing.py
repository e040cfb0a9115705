"""Billing of an engine: what each op costs, budgets checked at submit, queue limits, usage reports.

The engine prices an op once, when it is recorded (:meth:`Billing.cost`), by its base model's row of
the price table (:mod:`sess.engine.protocol.prices`) and what its tokens are billed as; the cost goes into
the op's registry row, its session's usage row and its owner's spend. A key's budget (``budget`` in
the table's currency, or ``token_budget`` in tokens, in ``keys.json``) is checked against that spend
when an op that does work is submitted: past it the submit is refused with 402, and work already
accepted finishes. Saves, and ops that only keep a session's order, are never refused, so no session
loses its state; raising the budget (``sess engine keys budget``, read at the next submit) lets the
same session go on. A key's ops queued or running are bounded: past the bound a submit gets 429 with
a ``Retry-After`` hint, before it takes a sequence number, so the client's retry is the same op.
"""

from __future__ import annotations

import threading
from typing import Any

from sess.engine.protocol.errors import SessError
from sess.engine.protocol.prices import PriceTable, format_cost, parse_amount, to_pico
from sess.engine.server.keys import LOCAL_OWNER, KeyStore
from sess.engine.server.sqlite_registry import Registry

TOKEN_FIELDS = ("prefill_tokens", "sampled_tokens", "training_tokens")
RETRY_AFTER_S = 1


class OverBudget(SessError):
    status = 402
    resend = True  # the same request may pass once the budget is raised


class Busy(SessError):
    """A full queue: come back after ``retry_after`` seconds (the HTTP answer's Retry-After)."""

    status = 429
    resend = True  # the same request passes once the queue has room

    def __init__(self, message: str, retry_after: int = RETRY_AFTER_S):
        super().__init__(message, status=429)
        self.retry_after = retry_after


def with_cached_prefill(row: dict) -> dict:
    """A usage row with ``cached_prefill_tokens``, the part of its prefill a prefix cache served:
    the ledger's count where it keeps one, else 0 (the registry's rows keep no such column yet; an
    op's cost, computed from its own usage as it finished, priced its cached tokens as such)."""
    return row | {"cached_prefill_tokens": int(row.get("cached_prefill_tokens") or 0)}


def spent_tokens(spend: dict) -> int:
    return sum(int(spend.get(k) or 0) for k in TOKEN_FIELDS)


class Billing:
    """Prices (None: the engine shows no cost), budgets from the key store, and per-key queue limits."""

    def __init__(
        self,
        registry: Registry,
        keys: KeyStore | None = None,
        prices: PriceTable | None = None,
        max_queued: int | None = None,
    ):
        self.registry, self.keys, self.prices, self.max_queued = registry, keys, prices, max_queued
        self._lock = threading.Lock()
        self._pending: dict[str, set[str]] = {}

    # cost ------------------------------------------------------------------------------------------
    def cost(self, model: str | None, op: str, usage: dict) -> int:
        return 0 if self.prices is None else self.prices.cost(model, op, usage)

    def money(self, pico: Any) -> str | None:
        """A cost for a report: a decimal string, or None when the engine has no prices."""
        return None if self.prices is None else format_cost(int(pico or 0))

    # budgets ---------------------------------------------------------------------------------------
    def key_of(self, owner: str) -> dict | None:
        if self.keys is None:
            return None
        entries = [e for e in self.keys.load().values() if e["owner"] == owner]
        budgeted = [e for e in entries if e.get("budget") is not None or e.get("token_budget") is not None]
        return (budgeted or entries or [None])[0]

    def over_budget(self, owner: str) -> OverBudget | None:
        """The refusal for ``owner``'s next costly op, or None while it is within its budget."""
        entry = self.key_of(owner)
        if entry is None or (entry.get("budget") is None and entry.get("token_budget") is None):
            return None
        spend = self.registry.spend(owner)
        raise_it = f"raise it with: sess engine keys budget {entry['id']} AMOUNT (on the engine's host)"
        if entry.get("budget") is not None:
            budget = parse_amount(entry["budget"], f"key {entry['id']} budget")
            if self.prices is None:
                return OverBudget(
                    f"budget: key {entry['id']} has a budget of {budget} but this engine has no prices "
                    "(sess engine up --prices FILE), so spend cannot be measured against it; give the "
                    f"key a token budget instead: sess engine keys budget {entry['id']} --tokens N"
                )
            if to_pico(budget) <= int(spend["cost_pu"] or 0):
                currency = self.prices.currency
                return OverBudget(
                    f"budget: key {entry['id']} has spent {format_cost(spend['cost_pu'])} {currency} of its "
                    f"budget of {budget} {currency}, so no new work is started (queued work finishes, "
                    f"sessions keep their state); {raise_it}"
                )
        token_budget = entry.get("token_budget")
        if token_budget is not None and int(token_budget) <= spent_tokens(spend):
            return OverBudget(
                f"budget: key {entry['id']} has used {spent_tokens(spend)} tokens of its token budget of "
                f"{token_budget}, so no new work is started (queued work finishes, sessions keep their "
                f"state); {raise_it.replace('AMOUNT', '--tokens N')}"
            )
        return None

    # queue limits ----------------------------------------------------------------------------------
    def check_queue(self, owner: str) -> None:
        if self.max_queued is None:
            return
        with self._lock:
            pending = len(self._pending.get(owner, ()))
        if pending >= self.max_queued:
            raise Busy(
                f"queue: this key has {pending} ops queued or running (limit {self.max_queued}); "
                f"retry after {RETRY_AFTER_S} s (the SDKs wait and retry by themselves)"
            )

    def accepted(self, owner: str, op: Any) -> None:
        """Count ``op`` as queued for its owner until :meth:`done` (unless it already finished)."""
        with self._lock:
            if not op.done.is_set():
                self._pending.setdefault(owner, set()).add(op.id)

    def done(self, owner: str, op_id: str) -> None:
        with self._lock:
            pending = self._pending.get(owner)
            if pending is not None:
                pending.discard(op_id)
                if not pending:
                    del self._pending[owner]

    # reports ---------------------------------------------------------------------------------------
    def priced(self, row: dict) -> dict:
        row = {k: v for k, v in row.items() if k != "cost_pu"} | {"cost": self.money(row.get("cost_pu"))}
        return with_cached_prefill(row)

    def report(self, owner: str, session: str | None, by: str, total: dict) -> dict:
        """``sess usage``'s report: rows per operation, session or key, each with its cost, and the
        total (its cost the exact sum of the rows')."""
        if by == "operation":
            rows = self.registry.usage_by_operation(owner, session)
        elif by == "session":
            rows = self.registry.usage_rows("session", owner)
            rows = {k: v for k, v in rows.items() if session is None or k == session}
        else:  # by key: the home's own key (the engine's operator) sees every key, others their own
            rows = self.registry.usage_rows("owner", None if owner == LOCAL_OWNER else owner)
            names = {e["owner"]: e["id"] for e in (self.keys.load().values() if self.keys else [])}
            rows = {names.get(o, o): v for o, v in rows.items()}
        cost = sum(int(r.get("cost_pu") or 0) for r in rows.values())
        if by != "operation":  # the total of these rows, whoever's sessions the runtime holds now
            total = {k: sum(r.get(k) or 0 for r in rows.values()) for k in (*TOKEN_FIELDS, "wall_time_s")}
            total["operations"] = sum(r.get("count") or 0 for r in rows.values())
        report = {
            "session": session,
            "by": by,
            "currency": self.prices.currency if self.prices else None,
            "usage": with_cached_prefill({**total, "cost": self.money(cost)}),
            "rows": {k: self.priced(v) for k, v in rows.items()},
        }
        if by == "operation":
            report["operations"] = report["rows"]
        return report
