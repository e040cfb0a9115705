"""Where the engine listens: whether an address is this machine's own (loopback), and the socket bound
to it, refused with one line naming the address when it cannot be had."""

from __future__ import annotations

import errno
import ipaddress
import socket


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
