"""What each owner of an engine home has spent, and in which currency: ``keys list`` shows it beside
the budgets."""

from __future__ import annotations


def spend_by_owner(home) -> tuple[dict, str | None]:
    """(owner -> spend, currency) of the home: what keys list shows beside the budgets."""
    from sess.engine.protocol.home import sess_home
    from sess.engine.sdk.local_engine import engine_info
    from sess.engine.server.sqlite_registry import Registry

    home_path = sess_home(home)
    spend = {}
    if (home_path / "registry.db").exists():
        registry = Registry(home_path)
        try:
            spend = {row["owner"]: row for row in registry.all_spend()}
        finally:
            registry.close()
    currency = None
    prices = ((engine_info(home_path) or {}).get("options") or {}).get("prices")
    if prices:
        from sess.engine.protocol.prices import PriceError, load_prices

        try:
            currency = load_prices(prices).currency
        except PriceError:
            pass
    return spend, currency
