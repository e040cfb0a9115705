"""The errors an engine reports about a request; each carries the HTTP status it travels with."""

from __future__ import annotations


class SessError(Exception):
    """An error the engine reports about a request: the message names the field at fault."""

    status = 400

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class InvalidRequest(SessError):
    status = 400


class NotFound(SessError):
    status = 404


class WrongType(InvalidRequest):
    """A field of the wrong type (a union of types tries its next option on this one)."""
