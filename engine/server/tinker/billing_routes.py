"""The Tinker billing-usage route: ``GET /api/v1/billing/usage/events``, what the tinker SDK's
``AdminClient.get_billing_usage`` (and the deprecated ``RestClient.get_billing_usage``) reads.

It answers from the same registry rows as ``sess usage``: one event per UTC hour, session and kind
of token (``training`` for forward_backward, ``sampling_prefill`` for prompts and for forward and
compute_logprobs, with ``cached`` true for the prompt tokens a prefix cache served and false for
the rest, ``sampling_sample`` for sampled tokens), with the price table's rate and cost
when its currency is USD (the only currency the schema has: another currency leaves them null,
never converted). Query: ``starting_on`` and ``ending_before``, hour-aligned UTC, at most 14 days
apart, as the SDK sends them; anything else is a 400 naming the parameter.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi import Request
from fastapi.responses import Response

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.prices import PER_TOKENS, PICO, billed_tokens
from sess.engine.server.tinker.state import Tinker, json_response

MAX_WINDOW = timedelta(days=14)
EVENT_KINDS = (
    ("trained", "training"),
    ("prefill", "sampling_prefill"),
    ("cached_prefill", "sampling_prefill"),
    ("sampled", "sampling_sample"),
)


def _instant(request: Request, name: str) -> datetime:
    text = request.query_params.get(name)
    if not text:
        raise InvalidRequest(f"{name}: missing (an hour-aligned UTC time, e.g. 2026-01-01T00:00:00Z)")
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{name}: expected an ISO 8601 time, got {text[:64]!r}") from None
    value = value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    if value.minute or value.second or value.microsecond:
        raise InvalidRequest(f"{name}: expected a time on a UTC hour boundary, got {text[:64]!r}")
    return value


def billing_events(tinker: Tinker, owner: str, start: datetime, end: datetime) -> dict:
    """The BillingUsageResponse of ``owner``'s ops that finished in [start, end)."""
    engine = tinker.engine
    prices = engine.billing.prices
    usd = prices is not None and prices.currency.upper() == "USD"
    rows = engine.registry.operation_rows(owner, start.timestamp(), end.timestamp())
    buckets: dict[tuple, int] = {}
    models: dict[str | None, str | None] = {}
    for row in rows:
        hour = int(row["finished"] // 3600) * 3600
        for kind, count in billed_tokens(row["name"], row).items():
            if count:
                key = (hour, row["session"], row["base_model"], kind)
                buckets[key] = buckets.get(key, 0) + count
        models[row["session"]] = row["base_model"]
    events = []
    for (hour, session, model, kind), count in sorted(buckets.items(), key=lambda kv: (kv[0][0], -kv[1])):
        rate = cost = None
        if usd:
            pico_per_token = getattr(prices.prices_for(model), kind)
            rate = pico_per_token * PER_TOKENS / PICO
            cost = pico_per_token * count / PICO
        info = {"type": dict(EVENT_KINDS)[kind], "token_count": count}
        if kind in ("prefill", "cached_prefill"):
            info["cached"] = kind == "cached_prefill"
        events.append(
            {
                "bucket_start": datetime.fromtimestamp(hour, timezone.utc).isoformat(),
                "bucket_end": datetime.fromtimestamp(hour + 3600, timezone.utc).isoformat(),
                "base_model": model,
                "session_id": session,
                "estimated_cost_usd": cost,
                "effective_rate_usd_per_million_tokens": rate,
                "event_info": info,
            }
        )
    sessions = {e["session_id"]: {"user_metadata": None} for e in events if e["session_id"]}
    return {"data": events, "sessions": sessions, "cost_data_through": None}


def add_routes(route, tinker: Tinker) -> None:
    @route("GET", "/billing/usage/events")
    async def billing_usage(request: Request) -> Response:
        owner = tinker.owner(request)
        start, end = _instant(request, "starting_on"), _instant(request, "ending_before")
        if end <= start or end - start > MAX_WINDOW:
            raise InvalidRequest(
                "ending_before: expected after starting_on and at most 14 days after it "
                f"(got {start.isoformat()} to {end.isoformat()})"
            )
        return json_response(billing_events(tinker, owner, start, end))
