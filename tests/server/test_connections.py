"""What a client abandons is closed: idle, half-sent and slowly dripped requests end after the read
timeout, a client past its connection cap is closed at once, a dropped upload writes one log line
(no traceback), and engine.log rotates past its size limit. 127.0.0.1 only, short timeouts."""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

from sess.engine.sdk.local_engine import start_engine, stop_engine

READ_TIMEOUT_S, KEEP_ALIVE_S, CAP, LOG_LIMIT = 2.0, 2.0, 24, 64_000


SETTINGS = {
    "SESS_READ_TIMEOUT_S": READ_TIMEOUT_S,
    "SESS_KEEP_ALIVE_S": KEEP_ALIVE_S,
    "SESS_MAX_CLIENT_CONNECTIONS": CAP,
    "SESS_LOG_MAX_BYTES": LOG_LIMIT,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine with short timeouts, a small per-client cap and a small log limit (its environment)."""
    saved = {name: os.environ.get(name) for name in SETTINGS}
    os.environ.update({name: str(value) for name, value in SETTINGS.items()})
    home = tmp_path_factory.mktemp("connections") / "home"
    try:
        info = start_engine(home)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    info["home"] = home
    info["key"] = (home / "api_key").read_text().strip()
    yield info
    stop_engine(home)


def connect(info) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", info["port"]), timeout=30)
    return sock


def closed_after(socks: list[socket.socket], limit_s: float) -> list[float]:
    """Seconds until the server closed each socket (inf: still open after ``limit_s``)."""
    start, times = time.monotonic(), []
    for sock in socks:
        sock.settimeout(max(0.01, start + limit_s - time.monotonic()))
        try:
            while sock.recv(4096):
                pass
            times.append(time.monotonic() - start)
        except TimeoutError:
            times.append(float("inf"))
        except ConnectionResetError:
            times.append(time.monotonic() - start)
        finally:
            sock.close()
    return times


def head(info, length: int | None = None) -> bytes:
    lines = [b"POST /api/call HTTP/1.1", b"Host: 127.0.0.1", f"Authorization: Bearer {info['key']}".encode()]
    if length is not None:
        lines += [b"Content-Type: application/json", f"Content-Length: {length}".encode()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def test_abandoned_connections_are_closed_after_the_read_timeout(engine):
    idle = [connect(engine) for _ in range(6)]
    half_head = [connect(engine) for _ in range(6)]
    for sock in half_head:
        sock.sendall(head(engine)[:30])
    half_body = [connect(engine) for _ in range(6)]
    for sock in half_body:
        sock.sendall(head(engine, 1000) + b'{"name": "list_')
    kept_alive = connect(engine)
    kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
    drip = connect(engine)  # a head sent one byte at a time, never ending
    started = time.monotonic()
    for byte in head(engine):
        try:
            drip.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.25)
        if time.monotonic() - started > READ_TIMEOUT_S + 3:
            break
    dripped_for = time.monotonic() - started
    assert dripped_for < READ_TIMEOUT_S + 2, f"a dripping head stayed open {dripped_for:.1f} s"

    times = closed_after(idle + half_head + half_body + [kept_alive], READ_TIMEOUT_S + 6)
    assert all(t < READ_TIMEOUT_S + 4 for t in times), times
    # and the engine still answers a whole request at once
    answer = httpx.post(
        f"{engine['url']}/api/call",
        json={"name": "list_sessions"},
        headers={"authorization": f"Bearer {engine['key']}"},
    )
    assert answer.status_code == 200


def test_a_client_past_its_connection_cap_is_closed_at_once(engine):
    held = [connect(engine) for _ in range(CAP)]
    time.sleep(0.2)
    extra = [connect(engine) for _ in range(4)]
    assert all(t < 1.0 for t in closed_after(extra, 1.5))
    # another client (another source address) is served meanwhile
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    assert other.get(f"{engine['url']}/healthz").status_code == 200
    other.close()
    for sock in held:
        sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{engine['url']}/healthz").status_code == 200  # its slots are back


def drop_uploads(info, count: int) -> None:
    for _ in range(count):
        sock = connect(info)
        sock.sendall(head(info, 100_000) + b'{"name": "list_sessions", "args": {"x": "')
        sock.close()


def settle(info, log, before: int, count: int) -> list[str]:
    """The log lines written since offset ``before``, once ``count`` dropped uploads have each
    written theirs (or 20 s have passed); /healthz from another address shows the engine serving."""
    deadline = time.monotonic() + 20
    while True:
        lines = log.read_bytes()[before:].decode().splitlines()
        if len(lines) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.5)  # and nothing more comes
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        assert other.get(f"{info['url']}/healthz").status_code == 200
    return log.read_bytes()[before:].decode().splitlines()


def test_dropped_uploads_write_one_line_each_and_the_log_rotates(engine):
    log = engine["home"] / "engine.log"
    before = log.stat().st_size
    drop_uploads(engine, 300)
    lines = settle(engine, log, before, 300)
    grown = log.stat().st_size - before
    assert "Traceback" not in log.read_text()
    # one line each: the handler's (the client left mid-body), or the accept's past the per-client cap
    assert len(lines) == 300, lines[:5]
    left = "the client left before its body was read"
    assert all(left in line or "per client" in line for line in lines), lines[:5]
    assert any(left in line for line in lines)
    assert grown < 300 * 200, f"{grown} bytes for 300 dropped uploads"

    drop_uploads(engine, 700)  # 1,000 in all: past the 64 kB limit, the log rotates
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
        deadline = time.monotonic() + 20
        while not (engine["home"] / "engine.log.1").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert other.get(f"{engine['url']}/healthz").status_code == 200
    rotated = engine["home"] / "engine.log.1"
    assert rotated.exists()
    assert log.stat().st_size <= LOG_LIMIT + 500 and rotated.stat().st_size <= LOG_LIMIT + 500
    logs = [log, rotated, engine["home"] / "engine.log.2"]
    assert sum(p.stat().st_size for p in logs if p.exists()) <= 3 * (LOG_LIMIT + 500)
    assert not (engine["home"] / "engine.log.3").exists()
