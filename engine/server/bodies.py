"""Reading request bodies, for every protocol the server speaks: a size limit checked while the body
streams in, and JSON objects whose integers no field could hold are refused as 400s, not 500s.

The sess routes (:mod:`.http_app`), the OpenAI routes and the Tinker protocol (:mod:`.tinker`) all read
bodies here, so a bad body gets the same answer everywhere.
"""

from __future__ import annotations

import json

from fastapi import Request

from sess.engine.protocol.errors import InvalidRequest, SessError
from sess.engine.server.settings import MAX_BODY_BYTES


class HttpError(SessError):
    pass


def json_integer(text: str) -> int:
    """An integer of a JSON body: JSON sets no size limit, but one of 309 digits or more is past
    every field's bounds and overflows float() wherever it meets one, so it is refused here."""
    digits = len(text.lstrip("-"))
    if digits > 308:
        raise InvalidRequest(f"body: an integer of {digits} digits is beyond any field's range")
    return int(text)


async def read_body(request: Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A request's body, refused (413) past ``max_bytes`` before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(f"body: {int(declared)} bytes is over the limit of {max_bytes}", status=413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HttpError(f"body: over the limit of {max_bytes} bytes", status=413)
    return bytes(body)


def parse_json(raw: bytes) -> dict:
    """A JSON object body (empty: ``{}``); anything else is a 400 that says what it is."""
    try:
        data = json.loads(raw or b"{}", parse_int=json_integer)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body: malformed JSON ({exc})") from None
    except RecursionError:  # the decoder recurses per nesting level; no request of ours nests deeply
        raise InvalidRequest("body: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"body: expected a JSON object, got {type(data).__name__}")
    return data


async def read_json(request: Request, max_bytes: int = MAX_BODY_BYTES) -> dict:
    return parse_json(await read_body(request, max_bytes))
