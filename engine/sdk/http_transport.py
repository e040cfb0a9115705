"""The HTTP transport: the four transport verbs over keep-alive HTTP(S) to an engine server.

One pooled ``httpx`` client with TCP_NODELAY (a request's header and body go out as separate writes;
Nagle plus delayed ACKs would add ~40 ms to each). Transient failures (connection refused or reset,
503) are retried with exponential backoff; a 4xx never is. A submitted op always carries a client
token, so a retry after a lost answer returns the first op instead of running it twice. An engine
whose queue for this key is full answers 429 with ``Retry-After``: the request is sent again after
that wait (up to ``SESS_BUSY_DEADLINE_S``, 10 minutes by default), the same op with the same client
token and sequence number, so nothing is lost or run twice. Live
training sessions of this client are kept alive by a heartbeat thread, so the engine's idle timeout
only stops sessions whose client went away. https certificates are verified, against
``SESS_CA_BUNDLE`` when set (an engine's own certificate, say); an untrusted one fails at once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from sess.engine.protocol import calls
from sess.engine.protocol.errors import InvalidRequest, NotFound, SessError
from sess.engine.protocol.home import read_local_key

log = logging.getLogger("sess.engine")
RETRY_DEADLINE_S = float(os.environ.get("SESS_RETRY_DEADLINE_S", 60.0))
BUSY_DEADLINE_S = float(os.environ.get("SESS_BUSY_DEADLINE_S", 600.0))


class EngineUnavailable(SessError):
    status = 503


def error_from(response: httpx.Response) -> SessError:
    try:
        message = response.json()["error"]["message"]
    except Exception:
        message = response.text[:500] or response.reason_phrase
    status = response.status_code
    if status == 404:
        return NotFound(message)
    if 400 <= status < 500:
        return InvalidRequest(message, status=status)
    return SessError(message, status=status)


def _retry_after(response: httpx.Response) -> float | None:
    """The wait a 429 with ``Retry-After`` (seconds) asks for; None for any other answer."""
    if response.status_code != 429:
        return None
    try:
        return min(max(float(response.headers.get("retry-after", "")), 0.05), 60.0)
    except ValueError:
        return None


def tls_verification() -> ssl.SSLContext | bool:
    """https certificates are always checked: against ``SESS_CA_BUNDLE`` (a PEM file, e.g. the
    self-signed certificate of your own engine) when set, else the system's trusted CAs."""
    bundle = os.environ.get("SESS_CA_BUNDLE")
    if not bundle:
        return True
    if not Path(bundle).is_file():
        raise SessError(f"SESS_CA_BUNDLE: no file {bundle} (a PEM file of the CA certificates to trust)")
    return ssl.create_default_context(cafile=bundle)


def _tls_failure(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, ssl.SSLError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class HttpTransport:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        home: str | os.PathLike | None = None,
        gone: Callable[[], str | None] | None = None,
    ):
        """``gone``: says why the engine can no longer answer (its process exited), or None; a
        connection failure then ends at once instead of retrying for ``SESS_RETRY_DEADLINE_S``."""
        self.url = url.rstrip("/")
        self.gone = gone
        self.api_key = api_key or os.environ.get("SESS_API_KEY") or read_local_key(home)
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        # public: one connection pool for every request (tests stand in for its transport)
        self.client = httpx.Client(
            base_url=self.url,
            headers=headers,
            transport=httpx.HTTPTransport(
                verify=tls_verification(),
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
                limits=httpx.Limits(max_connections=128, max_keepalive_connections=64),
            ),
            timeout=httpx.Timeout(60.0, connect=10.0),
        )
        self._live: set[str] = set()
        self._live_lock = threading.Lock()
        self._heartbeat_every = 10.0
        self._closed = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # plumbing -------------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotent: bool,
        timeout: float | None = None,
        **kw,
    ) -> httpx.Response:
        """Send with retries on transient failures; raise the engine's error for any 4xx/5xx."""
        content = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        deadline, delay = time.monotonic() + RETRY_DEADLINE_S, 0.05
        busy_until = time.monotonic() + BUSY_DEADLINE_S
        while True:
            try:
                response = self.client.request(
                    method, path, content=content, timeout=timeout or httpx.USE_CLIENT_DEFAULT, **kw
                )
                wait = _retry_after(response)
                if wait is not None and time.monotonic() + wait <= busy_until:
                    log.info("engine busy (%s): retrying in %.1f s", path, wait)
                    time.sleep(wait)
                    continue
                if response.status_code != 503:
                    break
                failure: Exception = error_from(response)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # nothing reached the engine
                if _tls_failure(exc):  # a certificate not trusted here stays so: no point retrying
                    raise EngineUnavailable(
                        f"cannot verify the https certificate of the engine at {self.url} ({exc}); "
                        "trust it with SESS_CA_BUNDLE=/path/to/ca-or-cert.pem"
                    ) from None
                failure = exc
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
                if not idempotent:
                    raise EngineUnavailable(
                        f"lost the connection to the engine at {self.url}: {exc}"
                    ) from None
                failure = exc
            why = self.gone() if self.gone is not None and not isinstance(failure, SessError) else None
            if why:
                raise EngineUnavailable(f"cannot reach the engine at {self.url}: {why}") from None
            if time.monotonic() + delay > deadline:
                if isinstance(failure, SessError):
                    raise failure
                raise EngineUnavailable(f"cannot reach the engine at {self.url}: {failure}") from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        if response.status_code >= 400:
            raise error_from(response)
        return response

    def _post(self, path: str, body: dict, *, idempotent: bool, timeout: float | None = None) -> dict:
        return self.request("POST", path, body, idempotent=idempotent, timeout=timeout).json()

    # transport verbs ------------------------------------------------------------------------------
    def call(self, name: str, args: dict | None = None) -> Any:
        row = calls.row(name)
        result = self._post(
            "/api/call", {"name": name, "args": args or {}}, idempotent=row.reads_only, timeout=600
        )["result"]
        if row.keeps_alive and isinstance(result, dict) and result.get("status") == "Running":
            self.keep_alive(result["name"])
        elif row.ends_session and args:
            self.forget(args.get("name"))
        return result

    def submit(self, name, args, *, session=None, seq=None, client_token=None) -> str:
        body = {
            "name": name,
            "args": args,
            "session": session,
            "seq": seq,
            "client_token": client_token or uuid.uuid4().hex,  # makes the retry below safe
        }
        return self._post("/api/submit", body, idempotent=True)["op_id"]

    def wait(self, op_id: str, timeout: float) -> tuple[bool, Any]:
        answer = self._post(
            "/api/wait", {"op_id": op_id, "timeout": timeout}, idempotent=True, timeout=timeout + 30
        )
        return (True, answer["result"]) if answer["done"] else (False, None)

    def download(self, path: str, dest_dir: Path) -> Path:
        listing = self.request("GET", "/api/checkpoints/files", idempotent=True, params={"path": path}).json()
        dest_dir = Path(dest_dir)
        for relative, _size in listing["files"]:
            target = dest_dir / relative
            if not target.resolve().is_relative_to(dest_dir.resolve()):
                raise InvalidRequest(f"checkpoint file {relative!r} escapes the destination")
            target.parent.mkdir(parents=True, exist_ok=True)
            with self.client.stream(
                "GET", "/api/checkpoints/file", params={"path": path, "file": relative}, timeout=600
            ) as response:
                if response.status_code >= 400:
                    response.read()
                    raise error_from(response)
                with open(target, "wb") as f:
                    for chunk in response.iter_bytes(1 << 20):
                        f.write(chunk)
        return dest_dir

    def usage(self, name: str | None = None, by: str = "operation") -> dict:
        params = {"name": name, "by": by} if name else {"by": by}
        return self.request("GET", "/api/usage", idempotent=True, params=params).json()

    # heartbeats -----------------------------------------------------------------------------------
    def keep_alive(self, session: str) -> None:
        with self._live_lock:
            self._live.add(session)
            if self._heartbeat is None:
                self._heartbeat = threading.Thread(target=self._beat, name="sess-heartbeat", daemon=True)
                self._heartbeat.start()

    def forget(self, session: str | None) -> None:
        with self._live_lock:
            self._live.discard(session)

    def _beat(self) -> None:
        while not self._closed.is_set():
            with self._live_lock:
                sessions = sorted(self._live)
            if sessions:
                try:
                    answer = self._post("/api/heartbeat", {"sessions": sessions}, idempotent=True, timeout=10)
                    # four beats per lapse: one lost or late beat never stops a live client's session
                    silence = min(float(answer["idle_timeout"]), float(answer.get("heartbeat_lapse", 1e9)))
                    self._heartbeat_every = max(0.2, min(30.0, silence / 4))
                except Exception as exc:  # the engine may be restarting; the next beat retries
                    log.debug("heartbeat failed: %s", exc)
            self._closed.wait(self._heartbeat_every)

    def close(self) -> None:
        self._closed.set()
        self.client.close()
