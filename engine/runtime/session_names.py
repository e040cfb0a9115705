"""Session names are per key: the name a client gives, and the session the engine files it under.

Two keys may each have a session called ``alice-secret``. The engine keeps one session id per
session, unique engine-wide, for its session table, ordering, registry and checkpoint directories:
the name itself when no other key holds it, else the name qualified by the owner, ``<name>@<8 hex
of the owner's digest>`` (:func:`~sess.engine.runtime.checkpoints.manifest.owner_digest`); a client's
name never holds ``@``, so the two forms cannot meet. A client's name and paths resolve within its
own sessions (:func:`engine_args`), and what it gets back names its sessions as it named them
(:func:`client_view`): a key learns nothing of another key's names.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from sess.engine.protocol import requests as rq
from sess.engine.runtime.checkpoints.manifest import foreign_files, owner_digest

if TYPE_CHECKING:
    from sess.engine.runtime.runtime import Runtime
    from sess.engine.runtime.session import Session

# the requests whose ``name`` is an existing session's (elsewhere it names a checkpoint or a new session)
NAMES_A_SESSION = (rq.SessionName, rq.DeleteSession, rq.GetUsage)


def owner_tag(owner: str) -> str:
    """What qualifies ``owner``'s session name where another key holds the plain one."""
    return "@" + owner_digest(owner)[:8]


def find(sessions: dict[str, Session], owner: str, name: str) -> Session | None:
    """``owner``'s session named ``name`` by its client (or by its engine id), or None."""
    if not isinstance(name, str):
        return None
    for candidate in (name, name + owner_tag(owner)):
        session = sessions.get(candidate)
        if session is not None and session.owner == owner:
            return session
    return None


def new_id(runtime: Runtime, owner: str, name: str) -> str:
    """The engine id of ``owner``'s new session ``name``: the name itself while no other key holds
    it (no session, no files on disk another owner's manifests claim), else the owner-qualified form."""
    if name not in runtime.sessions and not foreign_files(runtime.home, name, owner):
        return name
    return name + owner_tag(owner)


def engine_name(runtime: Runtime, owner: str, name: Any) -> Any:
    """The engine id of ``owner``'s session ``name``; a name ``owner`` has no session of stays as it is
    (and is then not found, whoever else holds it)."""
    if not isinstance(name, str):
        return name
    session = find(runtime.sessions, owner, name)
    return session.name if session is not None else name


def engine_path(runtime: Runtime, owner: str, path: Any) -> Any:
    """A ``sess://`` path whose session part is ``owner``'s name of it, with the engine id instead."""
    if not isinstance(path, str) or not path.startswith("sess://"):
        return path
    session, sep, rest = path[len("sess://") :].partition("/")
    mapped = engine_name(runtime, owner, session)
    return f"sess://{mapped}{sep}{rest}"


def engine_args(runtime: Runtime, owner: str, request: type | None, args: Any) -> Any:
    """``args`` of a request of type ``request`` with every session name and ``sess://`` path
    resolved within ``owner``'s sessions."""
    if not isinstance(args, dict):
        return args
    args = dict(args)
    if "session" in args:
        args["session"] = engine_name(runtime, owner, args["session"])
    if request in NAMES_A_SESSION and "name" in args:
        args["name"] = engine_name(runtime, owner, args["name"])
    for key in ("path", "model_path"):
        if key in args:
            args[key] = engine_path(runtime, owner, args[key])
    if isinstance(args.get("target"), dict):
        args["target"] = engine_args(runtime, owner, rq.Target, args["target"])
    return args


def client_view(owner: str, value: Any) -> Any:
    """``value`` (a result: dicts, lists, strings) with ``owner``'s session ids as its client names them."""
    tag = owner_tag(owner)
    return _strip(value, tag, re.compile(re.escape(tag) + r"(?=/|$)"))


def _strip(value: Any, tag: str, pattern: re.Pattern) -> Any:
    if isinstance(value, str):
        return pattern.sub("", value) if tag in value else value
    if isinstance(value, dict):
        return {_strip(k, tag, pattern): _strip(v, tag, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if not any(isinstance(v, str | dict | list | tuple) for v in value):
            return value  # numbers (a sample's tokens and logprobs): nothing to map, nothing to copy
        return type(value)(_strip(v, tag, pattern) for v in value)
    return value


def client_message(owner: str, message: str) -> str:
    """An error message with ``owner``'s session ids as its client names them."""
    return message.replace(owner_tag(owner), "")
