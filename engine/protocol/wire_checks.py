"""Field-by-field checks of wire data against a dataclass's annotations, with errors naming the field.

:func:`check_fields` reads a JSON object (or the attributes of an instance) against the fields of a
dataclass: each value must have its annotated type (``bool``, ``int``, ``float``, ``str``, ``dict``,
``list[X]``, ``X | None``, a ``Literal``, or a nested wire type with ``from_wire``), numbers must be
finite and within the bounds a field declares with :func:`bounded`, lists and strings no longer than
their limits, and no field may be unknown or missing. A bad value raises
:class:`~sess.engine.protocol.types.InvalidRequest` whose message starts with the field's path
(``sampling_params.temperature: expected a number, got 'hot'``), so a client sees what to fix and
the engine never runs an op on malformed input.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

from sess.engine.protocol.errors import InvalidRequest, SessError, WrongType

MAX_STRING = 4096  # characters of a name, path or loss option, unless a field says otherwise
MAX_ITEMS = 1 << 20  # items of a list field, unless a field says otherwise
MAX_DEPTH = 16  # nesting of a free-form object field (user metadata)


def bounded(default: Any = dataclasses.MISSING, lo: float | None = None, hi: float | None = None, **meta):
    """A dataclass field with bounds: ``lo``/``hi`` for numbers (inclusive), ``max_items`` for lists,
    ``max_length`` for strings, ``above`` for an exclusive lower bound."""
    meta.update({k: v for k, v in (("lo", lo), ("hi", hi)) if v is not None})
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    if callable(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(cls: type, wire: Any, where: str = "") -> dict[str, Any]:
    """The checked keyword arguments of ``cls`` from the JSON object ``wire``."""
    label = where or "args"
    if not isinstance(wire, dict):
        raise _error(where or "args", "an object", wire)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in wire if key not in fields]
    if unknown:
        raise _invalid(f"{label}: unknown field {str(unknown[0])[:64]!r} (fields: {', '.join(fields)})")
    hints = _hints(cls)
    checked = {}
    for name, spec in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in wire:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise _invalid(f"{path}: missing")
            continue
        checked[name] = check_value(wire[name], hints[name], path, spec.metadata)
    return checked


def check_instance(obj: Any, where: str = "") -> None:
    """The same checks on an instance built in Python (the SDK checks what it is about to send)."""
    hints = _hints(type(obj))
    for spec in dataclasses.fields(obj):
        path = f"{where}.{spec.name}" if where else spec.name
        check_value(getattr(obj, spec.name), hints[spec.name], path, spec.metadata)


def check_value(value: Any, kind: Any, where: str, meta: Any = None) -> Any:
    """``value`` read as ``kind`` (nested wire objects are built with their ``from_wire``)."""
    meta = meta or {}
    origin = get_origin(kind)
    if origin in (Union, types.UnionType):
        options = get_args(kind)
        if value is None and type(None) in options:
            return None
        for option in (o for o in options if o is not type(None)):
            try:
                return check_value(value, option, where, meta)
            except WrongType:
                pass
        raise _error(where, " or ".join(_name(o) for o in options), value)
    if origin is Literal:
        if value not in get_args(kind):
            raise _invalid(
                f"{where}: expected one of {', '.join(map(str, get_args(kind)))}, got {_show(value)}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _error(where, _name(kind), value)
        limit = meta.get("max_items", MAX_ITEMS)
        if len(value) > limit:
            raise _invalid(f"{where}: {len(value)} items is over the limit of {limit}")
        if len(value) < meta.get("min_items", 0):
            raise _invalid(f"{where}: expected at least {meta['min_items']} item(s)")
        (item,) = get_args(kind)
        if item is int and all(type(v) is int for v in value):  # token ids: the common, long case
            return value
        return [check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is bool:
        if not isinstance(value, bool):
            raise _error(where, "true or false", value)
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(where, "an integer", value)
        return _in_bounds(value, where, meta)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise _error(where, "a finite number", value)
        return _in_bounds(float(value), where, meta)
    if kind is str:
        if not isinstance(value, str):
            raise _error(where, "a string", value)
        limit = meta.get("max_length", MAX_STRING)
        if len(value) > limit:
            raise _invalid(f"{where}: {len(value)} characters is over the limit of {limit}")
        return check_text(value, where)
    if kind is dict:
        if not isinstance(value, dict):
            raise _error(where, "an object", value)
        if _depth(value, MAX_DEPTH + 1) > MAX_DEPTH:
            raise _invalid(f"{where}: nested more than {MAX_DEPTH} levels deep")
        return value
    if isinstance(kind, type) and hasattr(kind, "from_wire"):
        if isinstance(value, kind):
            if hasattr(value, "check"):
                value.check(where)
            return value
        if not isinstance(value, dict):
            raise _error(where, "an object", value)
        return kind.from_wire(value, where) if _takes_where(kind) else _from_wire(kind, value, where)
    raise TypeError(f"wire_checks: no check for {kind!r} at {where}")  # a programming error here


def check_text(value: str, where: str) -> str:
    """``value`` if it is text a tokenizer or a file name can take: valid Unicode, no NUL."""
    if "\x00" in value:
        raise _invalid(f"{where}: contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _invalid(f"{where}: not valid Unicode text (a lone surrogate)") from None
    return value


def _depth(value: Any, limit: int) -> int:
    """How deeply ``value`` nests objects and lists, counted up to ``limit``."""
    if limit <= 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)


def _from_wire(kind: type, value: dict, where: str) -> Any:
    try:
        return kind.from_wire(value)
    except SessError as exc:
        raise _invalid(f"{where}: {exc}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _invalid(f"{where}: malformed ({type(exc).__name__}: {str(exc)[:200]})") from None


@cache
def _takes_where(kind: type) -> bool:
    import inspect

    return "where" in inspect.signature(kind.from_wire).parameters


def _in_bounds(value: float, where: str, meta) -> float:
    lo, hi, above = meta.get("lo"), meta.get("hi"), meta.get("above")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"{lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}"
        raise _invalid(f"{where}: expected a value in {span}, got {value!r}")
    if above is not None and value <= above:
        raise _invalid(f"{where}: expected a value above {above}, got {value!r}")
    return value


def _invalid(message: str) -> InvalidRequest:
    return InvalidRequest(message)


def _error(where: str, expected: str, value: Any) -> WrongType:
    return WrongType(f"{where}: expected {expected}, got {_show(value)}")


def _show(value: Any) -> str:
    if isinstance(value, str | int | float | bool) or value is None:
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return type(value).__name__


def _name(kind: Any) -> str:
    origin = get_origin(kind)
    if origin is list:
        return f"a list of {_name(get_args(kind)[0])}"
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(kind)))
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object"}
    if kind in names:
        return names[kind]
    if kind is type(None):
        return "null"
    return f"a {getattr(kind, '__name__', kind)}"


def finite(value: int | float) -> bool:
    """Whether ``value`` is a finite float64 (an int too big for one, such as 10**400, is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
