"""What the engine checks before it serves: its options, its address and port, its TLS pair and its
price table, each refused with one line naming the option (nothing has started yet)."""

from __future__ import annotations

import errno
import ipaddress
import math
import socket
import ssl
from pathlib import Path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Set by `sess engine up` in the foreground: the fd of the start lock (launcher.start_lock) it
# holds, so that no other start of this home's engine begins until this one has written engine.json.


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; SystemExit with one line when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted sockets only when it is explicit; without
    # it a response's header and body writes wait ~40 ms on the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"port {port} on {host} is in use (another engine? see `sess engine status`, or pick "
                "another --port; 0 takes a free one)"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise SystemExit(f"--host {host}: not an address of this machine") from None
        raise SystemExit(f"cannot listen on {host} port {port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def check_options(
    device: str,
    dtype: str | None,
    memory_budget: str | None,
    *,
    port: int | None = None,
    idle_timeout: float | None = None,
    max_sessions: int | None = None,
    prices: str | None = None,
    max_queued: int | None = None,
) -> str | None:
    """What is wrong with these engine options on this machine (None: nothing): a device it does
    not have, a precision the device cannot compute in, a budget that is not a size, a port out of
    range, a limit no session could live under, a price table that cannot be used. Options given as
    None are not checked."""
    import torch

    from sess.engine.protocol.prices import PriceError
    from sess.engine.runtime.memory.training_budget import parse_bytes
    from sess.engine.runtime.models.catalog import Dtypes

    if port is not None and not 0 <= port <= 65535:
        return f"--port: expected 1 to 65535 (or 0: any free port), got {port}"
    if max_queued is not None and max_queued < 1:
        return f"--max-queued: expected at least 1 queued op per key, got {max_queued}"
    if prices is not None:
        try:
            load_price_table(prices)
        except PriceError as exc:
            return f"--prices: {exc}"
    if max_sessions is not None and max_sessions < 1:
        return f"--max-sessions: expected at least 1 live session per key, got {max_sessions}"
    # inf would mean never, but it is no JSON number: /healthz could not report it
    if idle_timeout is not None and not (math.isfinite(idle_timeout) and idle_timeout > 0):
        return (
            f"--idle-timeout: expected a positive number of seconds, got {idle_timeout} "
            "(for sessions that practically never time out, give a large one such as 1e9)"
        )
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu"
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    try:
        Dtypes.parse(dtype).check(device)
    except ValueError as exc:
        return f"--dtype: {exc}"
    try:
        if memory_budget is not None:
            parse_bytes(memory_budget)
    except ValueError as exc:
        return f"--memory-budget: {exc}"
    return None


def load_price_table(path: str):
    """The price table of ``--prices``, every model in it checked against the catalog."""
    from sess.engine.protocol.prices import load_prices
    from sess.engine.runtime.models.catalog import ModelNotAvailable, resolve

    def known_model(name: str) -> str | None:
        try:
            resolve(name)
        except ModelNotAvailable as exc:
            return str(exc)
        return None

    return load_prices(path, known_model)


def check_tls(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """The (certificate, key) PEM paths to serve https with, or None for http; both or neither."""
    if not cert and not key:
        return None
    if not (cert and key):
        raise SystemExit("--tls-cert and --tls-key go together: give the certificate and its private key")
    for what, path in (("--tls-cert", cert), ("--tls-key", key)):
        if not Path(path).is_file():
            raise SystemExit(f"{what}: no file {path}")
    try:  # as uvicorn will load them, but here, before any model loads, with the files named
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise SystemExit(
            f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate (chain) and its unencrypted "
            f"private key ({getattr(exc, 'reason', None) or exc})"
        ) from None
    return str(Path(cert).resolve()), str(Path(key).resolve())
