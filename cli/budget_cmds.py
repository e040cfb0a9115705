"""``sess engine keys budget``: set a key's budget (``keys list`` shows it with the spend).

A budget is in the currency of the engine's price table (``--budget``/AMOUNT) or in tokens
(``--tokens``, for an engine without prices); a running engine reads it at the key's next submit.
"""

from __future__ import annotations

import typer

from sess.cli.app import fail
from sess.cli.engine_cmds import HOME, keys_app
from sess.cli.output import out


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
