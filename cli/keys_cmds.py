"""``sess engine keys``: the engine home's API keys: add, list (with budgets and what each owner has
spent), revoke, and budget.

A budget is in the currency of the engine's price table (``--budget``/AMOUNT) or in tokens
(``--tokens``, for an engine without prices); a running engine reads it at the key's next submit.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console

from sess.cli.app import fail
from sess.cli.engine_cmds import HOME, keys_app
from sess.cli.output import out


@keys_app.command("add")
def keys_add(
    owner: str = typer.Option(None, help="Owner id the key acts as (default: a new one)."),
    max_sessions: int = typer.Option(
        None, help="Live sessions for this key, at least 1 (default: the engine's --max-sessions)."
    ),
    budget: str = typer.Option(
        None, help="What the key may spend, in the currency of the engine's --prices table."
    ),
    token_budget: int = typer.Option(
        None, "--token-budget", help="Tokens the key may use (for an engine without prices)."
    ),
    home: str = HOME,
) -> None:
    """Create an API key and print it: the one time it is shown (the home keeps only its hash).

    The key (tml-<id>-<secret>) works for the sess SDK (api_key= or SESS_API_KEY) and the tinker
    SDK (TINKER_API_KEY) alike, and sees only its owner's sessions and checkpoints."""
    from sess.engine.server.keys import KeyStore

    if max_sessions is not None and max_sessions < 1:
        fail(f"--max-sessions: expected at least 1 live session for the key, got {max_sessions}")
    store = KeyStore(home)
    try:
        entry = store.add(owner, max_sessions=max_sessions, budget=budget, token_budget=token_budget)
    except ValueError as exc:
        fail(f"--{str(exc).replace('_', '-')}")
    print(entry["key"])
    Console(stderr=True, soft_wrap=True).print(
        f"key {entry['id']} for owner {entry['owner']!r} added to {store.path}"
    )


@keys_app.command("list")
def keys_list(
    home: str = HOME,
    as_json: bool = typer.Option(
        False,
        "--json",
        help="As JSON: [{id, owner, created, max_sessions, local, budget, token_budget, spent, "
        "spent_tokens}] (spent: a decimal string in the engine's currency).",
    ),
) -> None:
    """List keys by id and owner, with their budgets and what each owner has spent.

    The keys themselves are not stored, only their hashes. Spend counts every op the owner ran,
    deleted sessions included."""
    import time

    from sess.cli.spend import spend_by_owner
    from sess.engine.protocol.prices import format_cost
    from sess.engine.server.billing import spent_tokens
    from sess.engine.server.keys import KeyStore

    store = KeyStore(home)
    spend, currency = spend_by_owner(home)
    entries = []
    for e in store.load().values():
        row = {
            k: e.get(k) for k in ("id", "owner", "created", "max_sessions", "local", "budget", "token_budget")
        }
        used = spend.get(e["owner"], {})
        row["spent"] = format_cost(int(used.get("cost_pu") or 0))
        row["spent_tokens"] = spent_tokens(used)
        entries.append(row)
    if as_json:
        print(json.dumps(entries))
        return
    if not entries:
        out.print(
            f"no keys in {store.path} (the engine makes the home's own key when it starts; "
            "sess engine keys add makes one for another user)"
        )
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["created"])) if e["created"] else "?"
        local = "  (this home's own key, in api_key)" if e["local"] else ""
        money = f" {currency}" if currency else ""
        budget = f"  budget={e['budget']}{money} spent={e['spent']}{money}" if e["budget"] is not None else ""
        if e["token_budget"] is not None:
            budget += f"  token_budget={e['token_budget']} spent_tokens={e['spent_tokens']}"
        out.print(
            f"{e['id']}  owner={e['owner']}  created={created}  max_sessions={e['max_sessions']}{budget}{local}"
        )


@keys_app.command("revoke")
def keys_revoke(
    key: str = typer.Argument(..., help="The key's id (sess engine keys list) or the key."),
    home: str = HOME,
    force: bool = typer.Option(
        False, "--force", help="Revoke the home's own key too (the engine makes a new one at its next start)."
    ),
) -> None:
    """Revoke a key: a running engine refuses it from its next request on."""
    from sess.engine.server.keys import KeyStore

    store = KeyStore(home)
    entry = store.find(key)
    if entry is None:
        fail(f"no key {key[:16]!r} in {store.path} (see sess engine keys list)")
    if entry.get("local") and not force:
        fail(
            f"key {entry['id']} is this home's own key (in {store.home / 'api_key'}), which sess "
            "commands use to reach the engine: revoked, they are refused until the engine restarts "
            "and makes a new one. To do that anyway (say, to replace a leaked key): --force, then "
            "sess engine down and up"
        )
    store.revoke(entry["id"])
    out.print(f"key {entry['id']} of owner {entry['owner']!r} revoked")
    if entry.get("local"):
        Console(stderr=True, soft_wrap=True).print(
            "warning: that was this home's own key: restart the engine (sess engine down, then up) "
            "for a new one"
        )


@keys_app.command("budget")
def keys_budget(
    key: str = typer.Argument(..., help="The key's id (sess engine keys list) or the key."),
    amount: str = typer.Argument(
        None, help="The new budget, in the currency of the engine's --prices table ('none': no budget)."
    ),
    tokens: int = typer.Option(None, "--tokens", help="A token budget instead (engine without prices)."),
    home: str = HOME,
) -> None:
    """Set a key's budget (in the price table's currency, or --tokens).

    A running engine applies it from the key's next submit, so sessions refused with 402 go on
    where they stopped."""
    from sess.engine.server.keys import KeyStore

    if amount is None and tokens is None:
        fail("give the new budget: sess engine keys budget ID AMOUNT (or --tokens N; AMOUNT none: no budget)")
    budget = None if amount is None or amount.lower() == "none" else amount
    store = KeyStore(home)
    try:
        entry = store.set_budget(key, budget, tokens)
    except ValueError as exc:
        fail(str(exc).replace("token_budget", "--tokens"))
    if entry is None:
        fail(f"no key {key[:16]!r} in {store.path} (see sess engine keys list)")
    shown = entry["budget"] if entry["budget"] is not None else "none"
    tokens_shown = entry["token_budget"] if entry["token_budget"] is not None else "none"
    out.print(f"key {entry['id']} of owner {entry['owner']!r}: budget {shown}, token budget {tokens_shown}")
