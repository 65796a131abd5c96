"""Listening sockets: binds parsed, sockets opened and closed, and per listener the
bookkeeping of the connection cap (open connections, those waiting only on their client)
and the rate-limited log of refusals."""

from __future__ import annotations

import logging
import math
import os
import socket
from typing import Any, Literal, Protocol

import trio

__all__ = ["Listener", "WaitingConnection", "close_listeners", "open_listeners", "parse_bind"]

logger = logging.getLogger("gridd.http")

# Refusals (connection cap, accept() out of descriptors) are logged at most once per this
# long per listener, with the count since the last line, so an attack cannot flood the log.
_REFUSAL_LOG_EVERY_S = 10.0
# Listen backlog asked of the kernel (it caps this at net.core.somaxconn).
_LISTEN_BACKLOG = 65535


def parse_bind(bind: str) -> tuple[Literal["tcp", "unix"], str, int]:
    """Split a bind ("host:port", "[v6]:port" or "unix:/path") into (kind, host or path, port)."""
    if bind.startswith("unix:"):
        path = bind[len("unix:") :]
        if not path:
            raise ValueError(f"empty unix socket path in bind {bind!r}")
        return "unix", path, 0
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"bind {bind!r} is not host:port, [v6]:port or unix:/path")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or "[" in host or "]" in host:
        raise ValueError(f"bind {bind!r} has no usable host")
    return "tcp", host, int(port)


def _bound_url(sockname: Any, family: int) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockname}"
    host, port = sockname[0], sockname[1]
    if family == socket.AF_INET6:
        return f"http://[{host}]:{port}"
    return f"http://{host}:{port}"


class WaitingConnection(Protocol):
    """A connection as the cap sees it: marked ``evicted`` before its wait is cancelled."""

    evicted: bool


class Listener:
    """One listening socket, and the connections it admitted (the connection cap is per listener)."""

    __slots__ = ("sock", "listener", "url", "server", "unix_path", "open", "waiting", "refused", "_logged_at")

    def __init__(self, sock: socket.socket, url: str, server: tuple[Any, Any], unix_path: str | None):
        # The listening socket, non-blocking: accepted from directly, in batches
        # (h11_server's accept loop).
        self.sock = sock
        self.listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        self.url = url
        self.server = server
        self.unix_path = unix_path
        self.open = 0
        # Connections waiting only on their client (a request head, or body bytes), oldest
        # first, with the cancel scope of that wait: what the connection cap evicts.
        self.waiting: dict[WaitingConnection, trio.CancelScope] = {}
        self.refused: dict[str, int] = {}
        self._logged_at = -math.inf

    def evict_oldest_waiting(self) -> bool:
        for conn, scope in self.waiting.items():
            del self.waiting[conn]
            conn.evicted = True
            scope.cancel()
            return True
        return False

    def note_refusal(self, what: str, now: float) -> None:
        """Count a refusal; one log line per _REFUSAL_LOG_EVERY_S with the counts since."""
        self.refused[what] = self.refused.get(what, 0) + 1
        if now - self._logged_at >= _REFUSAL_LOG_EVERY_S:
            self._logged_at = now
            counts = ", ".join(f"{n} {w}" for w, n in sorted(self.refused.items()))
            logger.error("%s: refusing connections (%s in the last %g s at most)", self.url, counts,
                         _REFUSAL_LOG_EVERY_S)
            self.refused = {}


def _tcp_sockets(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Bound, listening, non-blocking TCP sockets for every address of ``host`` (as
    trio.open_tcp_listeners makes them, plus SO_REUSEPORT when asked)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                # Several processes bind the same address; the kernel spreads new connections
                # over them (docs/performance.md, "All cores").
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_LISTEN_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


async def open_listeners(binds: list[str], reuse_port: bool = False) -> list[Listener]:
    opened: list[Listener] = []
    try:
        for bind in binds:
            kind, host, port = parse_bind(bind)
            if kind == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(host)
                    sock.listen(_LISTEN_BACKLOG)
                    sock.setblocking(False)
                except BaseException:
                    sock.close()
                    raise
                opened.append(Listener(sock, f"unix:{host}", (host, None), host))
                continue
            for sock in await trio.to_thread.run_sync(_tcp_sockets, host, port, reuse_port):
                name = sock.getsockname()
                opened.append(Listener(sock, _bound_url(name, sock.family), (name[0], name[1]), None))
    except BaseException:
        await close_listeners(opened)
        raise
    return opened


async def close_listeners(listeners: list[Listener]) -> None:
    for entry in listeners:
        # SocketListener.aclose closes before its checkpoint, so this is safe under cancellation.
        with trio.CancelScope(shield=True):
            await entry.listener.aclose()
        if entry.unix_path is not None:
            try:
                os.unlink(entry.unix_path)
            except FileNotFoundError:
                pass
            entry.unix_path = None

