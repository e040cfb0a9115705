"""``sess engine models``: the models an engine serves to every key: the catalog's, and those the
operator adds (add, list, remove).

A request names a model by name only: a path, URL or hub id from a client is refused, whatever lies
on disk; the operator gives one a name here. A running engine sees an added model at its next
request, and refuses a removed one to every request that names it.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console

from sess.cli.app import fail
from sess.cli.engine_cmds import HOME, engine_app
from sess.cli.output import out

models_app = typer.Typer(help="Models the engine serves to every key.", no_args_is_help=True)
engine_app.add_typer(models_app, name="models")


@models_app.command("add")
def models_add(
    name: str = typer.Argument(..., help="The name requests use (letters, digits, '.', '_', '-')."),
    source: str = typer.Argument(
        ..., help="A transformers model directory, or a Hugging Face hub id org/name."
    ),
    home: str = HOME,
) -> None:
    """Serve the model at SOURCE to every key of the engine, as NAME.

    A directory must hold the model's config.json (its absolute path is recorded); a hub id is
    fetched by the engine at first use (network or a filled HF cache)."""
    from sess.engine.runtime.models.catalog import CATALOG
    from sess.engine.runtime.models.registered import models_file, register

    try:
        entry = register(home, name, source, reserved=set(CATALOG))
    except ValueError as exc:
        fail(str(exc))
    Console(stderr=True, soft_wrap=True).print(
        f"model {name!r} ({entry['source']}: {entry['repo']}) added to {models_file(home)}", highlight=False
    )


@models_app.command("list")
def models_list(
    home: str = HOME,
    as_json: bool = typer.Option(False, "--json", help="As JSON: [{name, source, repo, registered}]."),
) -> None:
    """List the models every key may name: the catalog's, then those added with `models add`."""
    from sess.engine.runtime.models.catalog import CATALOG
    from sess.engine.runtime.models.registered import registered

    try:
        added = registered(home)
    except ValueError as exc:
        fail(str(exc))
    rows = [
        {"name": s.name, "source": s.source, "repo": s.repo, "registered": False} for s in CATALOG.values()
    ]
    rows += [
        {"name": n, "source": e["source"], "repo": e["repo"], "registered": True} for n, e in added.items()
    ]
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    for row in rows:
        where = f"{row['source']}: {row['repo']}" if row["repo"] else row["source"]
        out.print(f"{row['name']:<24} {where}{'  (added)' if row['registered'] else ''}", highlight=False)


@models_app.command("remove")
def models_remove(
    name: str = typer.Argument(..., help="A model added with `models add`."), home: str = HOME
) -> None:
    """Stop serving an added model (its files are left where they are); stop the sessions on it first."""
    from sess.engine.runtime.models.registered import models_file, unregister

    try:
        unregister(home, name)
    except ValueError as exc:
        fail(str(exc))
    Console(stderr=True, soft_wrap=True).print(
        f"model {name!r} removed from {models_file(home)}", highlight=False
    )
