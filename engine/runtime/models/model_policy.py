"""Which model a request may name: the one resolver every request field that names a base model
goes through (sess ops, the Tinker routes, OpenAI ``model``).

Every key may use the models the engine serves: the catalog's and those the operator registered
(``sess engine models add``, :mod:`.registered`). A request names one by its name, by the hub id it
comes from, or by any path whose last part is its name (a client's tokenizer directory of it, as
the Tinker cookbook sends): such a path is read as a name and never opened. Anything else (another
path, a ``file://`` URL, a hub id the operator did not register) is refused with one message that
names no file and depends on nothing on disk, so the answer tells a client nothing about the
engine's file system.

The home's own key (owner ``local``: the key the local engine writes to the home, and the in-process
transport, both the operator's own) may also name a local model directory or any hub id, as the
operator's command line can.
"""

from __future__ import annotations

import os
from pathlib import Path

from sess.engine.protocol.errors import NotFound
from sess.engine.protocol.home import sess_home
from sess.engine.runtime.models.catalog import CATALOG, ModelNotAvailable, list_models, resolve
from sess.engine.runtime.models.registered import registered

OPERATOR = "local"  # the owner of the home's own key (sess.engine.server.keys.LOCAL_OWNER)


def refusal(home: str | os.PathLike | None, field: str = "base_model", named: str | None = None) -> NotFound:
    """The one answer to a model name that is not served, whatever the name and whatever exists
    (``named``: the name as sent, quoted back to the operator, whose own command it was)."""
    what = f"{named[:200]!r} is " if named is not None else ""
    return NotFound(
        f"{field}: {what}not a model this engine serves; name one of {', '.join(list_models(home))} "
        "(a path, URL or hub id is not a model name here: the engine's operator registers more with "
        "`sess engine models add NAME DIR|HUB_ID`)"
    )


def model_name(home: str | os.PathLike | None, owner: str, name: object, field: str = "base_model") -> str:
    """The served model ``name`` names, as the runtime knows it; for the operator (``OPERATOR``) also
    a model directory or hub id, as given. Anything else raises :func:`refusal`."""
    if not isinstance(name, str) or not name or len(name) > 1024 or "\x00" in name:
        raise refusal(home, field)
    served = list_models(home)
    if name in served:
        return name
    sources = [(s.name, s.repo) for s in CATALOG.values() if s.source == "hf"]
    sources += [(model, entry["repo"]) for model, entry in registered(home).items()]
    for model, repo in sources:
        if repo == name:
            return model
    if owner == OPERATOR and _operator_model(home, name):
        return name
    last = name.rstrip("/").rsplit("/", 1)[-1]
    if "/" in name and "://" not in name and last in served:
        return last
    raise refusal(home, field, name if owner == OPERATOR else None)


def _operator_model(home: str | os.PathLike | None, name: str) -> bool:
    """Whether the operator's ``name`` is a model directory of its own (the engine's cache of a
    served model is that model) or a hub id."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path.resolve() != (sess_home(home) / "models" / path.name).resolve()
    try:
        return resolve(name, home).source == "hf"
    except ModelNotAvailable:  # not a model at all: refused as any other name
        return False
