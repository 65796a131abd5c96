"""Serving gridd's ASGI apps (simulator, providers API, OpenAI front, /metrics).

serve_asgi(app, binds, *, task_status) serves until cancelled; task_status.started()
receives the bound addresses ("http://host:port", "http://[::1]:port", "unix:/path"), so
port 0 works in tests. Two backends sit behind it:

- "h11" (default): a small HTTP/1.1 server written here on h11 + trio. One trio task per
  connection; the app runs inside that task, so a request costs no extra task or queue. It was
  chosen by measurement (docs/http-serving.md, benchmarks/http_server.py).
- "hypercorn": hypercorn's trio worker, kept for HTTP/2 or whenever a second opinion is wanted.

Both backends share the limits below and the drain contract: when `stop_accepting` is set the
listeners close, in-flight requests finish, idle keep-alive connections close, and serve_asgi
returns once no connection is left. The caller bounds that grace period with move_on_after.
"""

from __future__ import annotations

import email.utils
import errno
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import unquote

import h11
import trio

__all__ = [
    "ASGIApp",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "answer_lifespan",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "ClientDisconnected",
    "parse_bind",
    "serve_asgi",
]

logger = logging.getLogger("gridd.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# How long a keep-alive connection may sit without a complete request head before the server
# closes it. Same as hypercorn's default; clients' pools (httpx: 5 s) expire at about the same age.
DEFAULT_KEEP_ALIVE_S = 5.0
DEFAULT_BODY_IDLE_S = 10.0
"""A request body that stalls this long between reads is abandoned (408)."""
DEFAULT_BODY_DEADLINE_S = 30.0
"""A request body not complete this long after its head arrived is abandoned (408), however
steadily it trickles: the idle bound alone restarts on every byte."""
DEFAULT_MAX_CONNECTIONS = 1024
"""Open connections per listener. Past it, a new connection evicts the longest-waiting one
that is only waiting on its client (for a request head or body bytes); when every one is
busy in the app, the new one gets 503 and is closed."""
DEFAULT_MAX_BUFFERED_BYTES = 16 * 1024 * 1024
"""Bytes of request bodies still arriving, across every connection of one server: a body's
bytes count from their arrival until the body is complete (or its request ends). A complete
body is the app's, bounded by the app's own work (the front: the upstream's time); an
incomplete one only by its client. A chunk that would pass the cap ends the request whose
body has been arriving longest (503): a slow uploader loses its place, not a new request."""
# Largest request body handed to the app. OpenAI-style chat requests with long contexts stay well
# under this; anything bigger is refused with 413.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
# Largest request head (request line + headers), h11's own default. Over it: 431.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024

# After an error response sent while the client may still be uploading (413, 400, an app that
# answered without reading the body), the server half-closes and discards what still arrives for
# at most this long / this many bytes, so the client reads the response instead of a reset.
_LINGER_S = 2.0
_LINGER_MAX_BYTES = 32 * 1024 * 1024
_READ_BYTES = 64 * 1024
# accept() errors that mean "out of descriptors/memory": wait and retry instead of dying.
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_RETRY_S = 0.1
# accept() errors about one queued connection only (it was reset before we took it): skip it.
_ACCEPT_GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
# Most connections taken from the listen queue per wake-up of the accept loop.
_ACCEPT_BATCH = 256
# Refusals (connection cap, accept() out of descriptors) are logged at most once per this
# long per listener, with the count since the last line, so an attack cannot flood the log.
_REFUSAL_LOG_EVERY_S = 10.0
# A refused connection gets this long to take its 503 before it is closed.
_REFUSE_SEND_S = 1.0
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"content-length: 24\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
                  b"503 Service Unavailable\n")


class ClientDisconnected(OSError):
    """Raised by send() once the client is gone (ASGI spec 2.4: an OSError subclass)."""


# ---------------------------------------------------------------------------------------------
# Binds


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


class _Listener:
    __slots__ = ("sock", "listener", "url", "server", "unix_path", "open", "waiting", "refused", "_logged_at")

    def __init__(self, sock: socket.socket, url: str, server: tuple[Any, Any], unix_path: str | None):
        # The listening socket, non-blocking: accepted from directly, in batches (_accept_loop).
        self.sock = sock
        self.listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        self.url = url
        self.server = server
        self.unix_path = unix_path
        self.open = 0
        # Connections waiting only on their client (a request head, or body bytes), oldest
        # first, with the cancel scope of that wait: what the connection cap evicts.
        self.waiting: dict[_H11Connection, trio.CancelScope] = {}
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


# Listen backlog asked of the kernel (it caps this at net.core.somaxconn).
_LISTEN_BACKLOG = 65535


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


async def _open_listeners(binds: list[str], reuse_port: bool = False) -> list[_Listener]:
    opened: list[_Listener] = []
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
                opened.append(_Listener(sock, f"unix:{host}", (host, None), host))
                continue
            for sock in await trio.to_thread.run_sync(_tcp_sockets, host, port, reuse_port):
                name = sock.getsockname()
                opened.append(_Listener(sock, _bound_url(name, sock.family), (name[0], name[1]), None))
    except BaseException:
        await _close_listeners(opened)
        raise
    return opened


async def _close_listeners(listeners: list[_Listener]) -> None:
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


# ---------------------------------------------------------------------------------------------
# The h11 backend


class _ServerState:
    """What every connection of one serve_asgi call shares."""

    __slots__ = ("draining", "idle_scopes", "buffered_bytes", "uploading", "_date_second", "_date_value")

    def __init__(self) -> None:
        self.draining = False
        # Cancel scopes of connections waiting for a request head; drain cancels them.
        self.idle_scopes: set[trio.CancelScope] = set()
        # Bytes of request bodies still arriving (DEFAULT_MAX_BUFFERED_BYTES).
        self.buffered_bytes = 0
        # Requests whose body is still arriving, oldest first (DEFAULT_MAX_BUFFERED_BYTES).
        self.uploading: dict[_RequestCycle, None] = {}
        self._date_second = -1
        self._date_value = b""

    def date_header(self) -> bytes:
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date_value = email.utils.formatdate(now, usegmt=True).encode("ascii")
        return self._date_value

    def start_drain(self) -> None:
        self.draining = True
        for scope in list(self.idle_scopes):
            scope.cancel()


class _Limits:
    __slots__ = ("keep_alive_s", "max_body_bytes", "max_header_bytes", "body_idle_s", "body_deadline_s",
                 "max_connections", "max_buffered_bytes")

    def __init__(self, keep_alive_s: float, max_body_bytes: int, max_header_bytes: int,
                 body_idle_s: float = DEFAULT_BODY_IDLE_S, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES) -> None:
        self.keep_alive_s = keep_alive_s
        self.body_idle_s = body_idle_s
        self.body_deadline_s = body_deadline_s
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes


def _only_disconnects(exc: BaseException) -> bool:
    if isinstance(exc, ClientDisconnected):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(ClientDisconnected)
        return rest is None
    return False


def _head_size(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """Bytes of a request head as sent (request line, "name: value\\r\\n" lines, blank line).

    h11 only bounds an *incomplete* head, so a head that arrives whole in one read would pass its
    check at any size up to the read size; this is the exact bound applied afterwards."""
    size = len(method) + len(target) + len(b"  HTTP/1.1\r\n\r\n")
    for name, value in headers:
        size += len(name) + len(value) + 4
    return size


def _has_both_framings(headers: Any) -> bool:
    """Content-Length and Transfer-Encoding together: RFC 9112 6.1 lets a server reject the
    request and requires it to close the connection either way (a request-smuggling shape)."""
    names = {name for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def _declared_length(headers: Any) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            return int(value)  # h11 has already rejected non-digit or conflicting values
    return None


def _missing_headers(headers: list[tuple[bytes, bytes]]) -> tuple[bool, bool]:
    """(no Content-Length/Transfer-Encoding given, no Date given) for an app's response headers."""
    framing = date = False
    for name, _ in headers:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            framing = True
        elif lowered == b"date":
            date = True
    return not framing, not date


class _H11Connection:
    """One client connection: a loop of request/response cycles on one h11.Connection."""

    __slots__ = ("stream", "app", "limits", "state", "conn", "client", "server", "listener", "evicted")

    def __init__(
        self,
        stream: trio.SocketStream,
        app: ASGIApp,
        limits: _Limits,
        state: _ServerState,
        listener: _Listener,
    ) -> None:
        self.stream = stream
        self.app = app
        self.limits = limits
        self.state = state
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.server = listener.server
        self.listener = listener
        self.evicted = False
        self.client: tuple[str, int] | None = None
        if stream.socket.family in (socket.AF_INET, socket.AF_INET6):
            try:
                peer = stream.socket.getpeername()
                self.client = (peer[0], peer[1])
            except OSError:
                self.client = None

    async def run(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                outcome = await self._cycle(request)
                if outcome == "linger":
                    await self._linger()
                    return
                if outcome == "close":
                    return
                self.conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            logger.exception("HTTP connection handler failed")
        finally:
            self.listener.waiting.pop(self, None)
            self.listener.open -= 1
            await self.stream.aclose()

    async def receive_bytes(self) -> bytes:
        """b"" on EOF, reset or a locally closed stream."""
        try:
            return await self.stream.receive_some(_READ_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _next_request(self) -> h11.Request | None:
        # The keep-alive bound covers the whole wait for a complete request head, which also
        # bounds a client trickling a head byte by byte.
        conn = self.conn
        with trio.move_on_after(self.limits.keep_alive_s) as scope:
            self.state.idle_scopes.add(scope)
            self.listener.waiting[self] = scope
            try:
                if self.state.draining or self.evicted:
                    return None
                while True:
                    try:
                        event = conn.next_event()
                    except h11.RemoteProtocolError as exc:
                        await self._send_error(exc.error_status_hint, head_only=False)
                        await self._linger()
                        return None
                    if event is h11.NEED_DATA:
                        conn.receive_data(await self.receive_bytes())
                        continue
                    if type(event) is h11.Request:
                        return event
                    return None  # ConnectionClosed
            finally:
                self.state.idle_scopes.discard(scope)
                self.listener.waiting.pop(self, None)
        return None

    async def _cycle(self, request: h11.Request) -> str:
        """Run the app for one request; "keep", "close" or "linger" (close after draining input)."""
        headers = list(request.headers)
        if _head_size(request.method, request.target, headers) > self.limits.max_header_bytes:
            await self._send_error(431, head_only=request.method == b"HEAD")
            return "linger"
        if _has_both_framings(headers):
            await self._send_error(400, head_only=request.method == b"HEAD")
            return "close"
        declared = _declared_length(headers)
        if declared is not None and declared > self.limits.max_body_bytes:
            await self._send_error(413, head_only=request.method == b"HEAD")
            return "linger"

        raw_path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server,
        }
        cycle = _RequestCycle(self, request.method == b"HEAD")
        try:
            try:
                await self.app(scope, cycle.receive, cycle.send)
            finally:
                cycle.release_buffered()
        except Exception as exc:
            if not (cycle.disconnected and _only_disconnects(exc)):
                logger.exception("ASGI app raised on %s %s", scope["method"], scope["path"])
            return await self._after_failed_cycle(cycle, 500)

        if cycle.disconnected or self.evicted:
            return "close"
        if cycle.over_limit:
            return await self._after_failed_cycle(cycle, 413)
        if cycle.over_budget:
            return await self._after_failed_cycle(cycle, 503)
        if cycle.body_timed_out:
            return await self._after_failed_cycle(cycle, 408)
        if cycle.pipeline_overflow:
            return "close"  # the pipelined requests it sent were discarded: close, never serve half
        if not cycle.complete:
            logger.error(
                "ASGI app returned without completing the response to %s %s", scope["method"], scope["path"]
            )
            return await self._after_failed_cycle(cycle, 500)

        conn = self.conn
        if conn.our_state is not h11.DONE or self.state.draining:
            return "close"
        if conn.their_state is not h11.DONE and not self._finish_body_from_buffer():
            return "linger"
        return "keep"

    async def _after_failed_cycle(self, cycle: _RequestCycle, status: int) -> str:
        if cycle.disconnected or cycle.head_sent or self.conn.our_state is not h11.SEND_RESPONSE:
            # Mid-response: the client sees a truncated body and a closed connection.
            return "close"
        await self._send_error(status, head_only=cycle.is_head)
        return "linger" if self.conn.their_state is not h11.DONE else "close"

    def _finish_body_from_buffer(self) -> bool:
        """The app answered without reading all of the body: consume what is already buffered."""
        conn = self.conn
        while conn.their_state is h11.SEND_BODY:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return False
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return False
        return conn.their_state is h11.DONE

    async def _send_error(self, status: int, *, head_only: bool) -> None:
        """A plain-text error response that closes the connection."""
        conn = self.conn
        body = f"{status} {_reason(status)}\n".encode("ascii")
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
            (b"date", self.state.date_header()),
        ]
        try:
            out = conn.send(
                h11.Response(status_code=status, headers=headers, reason=_reason(status).encode())
            )
            if not head_only:
                out += conn.send(h11.Data(data=body))
            out += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        try:
            await self.stream.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _linger(self) -> None:
        """Half-close, then discard input for a bounded time so the client can read our answer."""
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        discarded = 0
        with trio.move_on_after(_LINGER_S):
            while discarded < _LINGER_MAX_BYTES:
                data = await self.receive_bytes()
                if not data:
                    return
                discarded += len(data)


class _RequestCycle:
    """receive/send for one request. receive() reads the socket itself, on demand; no extra task."""

    __slots__ = (
        "c",
        "conn",
        "is_head",
        "body_done",
        "body_bytes",
        "disconnected",
        "over_limit",
        "body_timed_out",
        "over_budget",
        "pipeline_overflow",
        "body_deadline",
        "buffered",
        "wait_scope",
        "started",
        "status",
        "headers",
        "head_sent",
        "complete",
    )

    def __init__(self, connection: _H11Connection, is_head: bool) -> None:
        self.c = connection
        self.conn = connection.conn
        self.is_head = is_head
        self.body_done = False
        self.body_bytes = 0
        self.disconnected = False
        self.over_limit = False
        self.body_timed_out = False
        self.over_budget = False
        self.pipeline_overflow = False
        # The whole body must have arrived by then (DEFAULT_BODY_DEADLINE_S).
        self.body_deadline = trio.current_time() + connection.limits.body_deadline_s
        self.buffered = 0  # this request's share of _ServerState.buffered_bytes
        self.wait_scope: trio.CancelScope | None = None  # while waiting for body bytes
        self.started = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_sent = False
        self.complete = False

    def release_buffered(self) -> None:
        self.c.state.buffered_bytes -= self.buffered
        self.buffered = 0
        self.c.state.uploading.pop(self, None)

    def _make_room(self) -> bool:
        """Over the buffered-bytes cap: end the oldest uploads (this one included, if it is
        the oldest) until the bytes fit. True if this request may go on."""
        state, cap = self.c.state, self.c.limits.max_buffered_bytes
        while state.buffered_bytes > cap:
            oldest = next(iter(state.uploading))
            oldest.over_budget = True
            oldest.release_buffered()
            if oldest is self:
                return False
            if oldest.wait_scope is not None:
                oldest.wait_scope.cancel()
        return True

    async def receive(self) -> Message:
        if self.disconnected or self.over_limit or self.over_budget or self.body_timed_out or self.complete:
            return {"type": "http.disconnect"}
        if not self.body_done:
            return await self._receive_body()
        # Body fully read, response not finished: the only thing left to report is the client
        # going away. Reading here (EOF or reset) is what lets a streaming app stop at once.
        # Pipelined requests that arrive meanwhile are buffered in h11, up to the head limit;
        # past it, what arrives is discarded (still read, so a hang-up is seen) and the
        # connection closes after this response.
        conn = self.conn
        while True:
            data = await self.c.receive_bytes()
            if not data:
                self.disconnected = True
                return {"type": "http.disconnect"}
            if self.pipeline_overflow or len(conn.trailing_data[0]) + len(data) > self.c.limits.max_header_bytes:
                self.pipeline_overflow = True
                continue
            conn.receive_data(data)

    async def _receive_body(self) -> Message:
        conn = self.conn
        if conn.they_are_waiting_for_100_continue:
            await self._send_bytes(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        limit = self.c.limits.max_body_bytes
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                # Bad chunk framing or EOF mid-body: the request can't be completed.
                self.disconnected = True
                return {"type": "http.disconnect"}
            event_type = type(event)
            if event_type is h11.Data:
                data = bytes(event.data)
                self.body_bytes += len(data)
                state = self.c.state
                state.buffered_bytes += len(data)
                self.buffered += len(data)
                state.uploading.setdefault(self, None)
                if self.body_bytes > limit:
                    # Chunked body over the limit: the app sees the request vanish; the server
                    # answers 413 if the app had not started a response.
                    self.over_limit = True
                    return {"type": "http.disconnect"}
                if state.buffered_bytes > self.c.limits.max_buffered_bytes and not self._make_room():
                    # Every incomplete body together over the server's budget, and this one
                    # the oldest: it ends (503 if no response started), the process stays put.
                    return {"type": "http.disconnect"}
                chunks.append(data)
            elif event_type is h11.EndOfMessage:
                self.body_done = True
                self.release_buffered()  # complete: no longer the client's to hold back
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            elif event is h11.NEED_DATA:
                # Hand over what is buffered before blocking on the socket.
                if chunks:
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                # A client that announced a body must keep sending it: a stall of body_idle_s,
                # or the whole body not in by body_deadline_s after the head, ends the request
                # (408 if no response started), so a trickle cannot hold a task. While it
                # waits here the connection may be evicted by the connection cap.
                data = None
                listener = self.c.listener
                with trio.CancelScope(deadline=min(trio.current_time() + self.c.limits.body_idle_s,
                                                   self.body_deadline)) as wait:
                    listener.waiting[self.c] = self.wait_scope = wait
                    try:
                        data = await self.c.receive_bytes()
                    finally:
                        listener.waiting.pop(self.c, None)
                        self.wait_scope = None
                if self.over_budget:
                    return {"type": "http.disconnect"}  # ended by _make_room for a newer upload
                if data is None:
                    if self.c.evicted:
                        self.disconnected = True
                    else:
                        self.body_timed_out = True
                    return {"type": "http.disconnect"}
                if not data:
                    self.disconnected = True
                    return {"type": "http.disconnect"}
                conn.receive_data(data)
            else:
                self.disconnected = True
                return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.disconnected or self.over_limit or self.over_budget:
            raise ClientDisconnected("client disconnected")
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.complete:
                raise RuntimeError("http.response.body outside a started, unfinished response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            conn = self.conn
            if self.head_sent:
                out = b""
            else:
                # The head goes out with the first body message (ASGI: not before), so a small
                # response is one write. A single-message response gets a Content-Length;
                # otherwise h11 picks chunked for HTTP/1.1 (or close-delimited for 1.0).
                headers = self.headers
                status = self.status
                no_framing, no_date = _missing_headers(headers)
                if (
                    no_framing
                    and not more
                    and (body or not self.is_head)
                    and status >= 200
                    and status not in (204, 304)
                ):
                    headers.append((b"content-length", str(len(body)).encode("ascii")))
                if no_date:
                    headers.append((b"date", self.c.state.date_header()))
                if self.c.state.draining:
                    headers.append((b"connection", b"close"))
                out = conn.send(h11.Response(status_code=status, headers=headers))
                self.head_sent = True
            if body and not self.is_head:
                out += conn.send(h11.Data(data=body))
            if not more:
                out += conn.send(h11.EndOfMessage())
                self.complete = True
            if out:
                await self._send_bytes(out)
            return
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = [(bytes(name), bytes(value)) for name, value in message.get("headers", ())]
            return
        raise RuntimeError(f"unexpected ASGI message type {kind!r}")

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.c.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.disconnected = True
            raise ClientDisconnected("client disconnected") from exc


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


async def _accept_loop(
    entry: _Listener,
    app: ASGIApp,
    limits: _Limits,
    state: _ServerState,
    connections: trio.Nursery,
) -> None:
    # Every connection waiting in the listen queue is taken at each wake-up (up to
    # _ACCEPT_BATCH, and below the connection cap). One accept per scheduler pass, as trio's
    # SocketListener does, admits one connection per pass over every busy task, which under
    # a thousand streams left clients queued for tens of seconds (docs/http-serving.md,
    # "Accepting").
    sock = entry.sock
    while True:
        await trio.lowlevel.wait_readable(sock)
        for _ in range(_ACCEPT_BATCH):
            try:
                accepted, _ = sock.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _ACCEPT_GONE_ERRNOS:
                    continue  # the client gave up while queued
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                entry.note_refusal(f"accept() {errno.errorcode.get(exc.errno, exc.errno)}", trio.current_time())
                await trio.sleep(_ACCEPT_RETRY_S)
                break
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(accepted))
            # The connection cap (DEFAULT_MAX_CONNECTIONS): make room by evicting the connection
            # that has waited longest on its client; if every one is busy in the app, refuse.
            at_cap = entry.open >= limits.max_connections
            admit = not at_cap or entry.evict_oldest_waiting()
            if not admit:
                # Connections admitted in this batch have not run yet, so they wait on nothing
                # yet: let them reach their first wait (where they can be evicted) first.
                await _after_next_pass()
                admit = entry.evict_oldest_waiting()
            if admit:
                entry.open += 1
                connections.start_soon(_H11Connection(stream, app, limits, state, entry).run)
            else:
                entry.note_refusal("over the connection cap", trio.current_time())
                connections.start_soon(_refuse_busy, stream)
            if at_cap:
                # The evicted or refused connection closes in its task's next step, in the
                # next scheduler pass: take the next connection only after that pass, so
                # descriptors stay at the cap.
                await _after_next_pass()
                break


async def _after_next_pass() -> None:
    """Return once every task made runnable before this call has run a step: tasks woken in
    this pass run in the next one, in any order, so two checkpoints land after it."""
    await trio.lowlevel.checkpoint()
    await trio.lowlevel.checkpoint()


async def _refuse_busy(stream: trio.SocketStream) -> None:
    """A clear 503 (the connection cap is reached), then close; bounded in time."""
    with trio.move_on_after(_REFUSE_SEND_S):
        try:
            await stream.send_all(_BUSY_RESPONSE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await trio.aclose_forcefully(stream)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _serve_h11(
    app: ASGIApp,
    binds: list[str],
    *,
    stop_accepting: trio.Event | None,
    limits: _Limits,
    reuse_port: bool,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    listeners = await _open_listeners(binds, reuse_port)
    state = _ServerState()
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptors:
                for entry in listeners:
                    acceptors.start_soon(_accept_loop, entry, app, limits, state, connections)
                if stop_accepting is not None:
                    acceptors.start_soon(_cancel_when_set, stop_accepting, acceptors.cancel_scope)
                task_status.started([entry.url for entry in listeners])
            # Drain: refuse new connections, close idle ones, let in-flight requests finish.
            await _close_listeners(listeners)
            state.start_drain()
    finally:
        await _close_listeners(listeners)


# ---------------------------------------------------------------------------------------------
# The hypercorn backend


async def answer_lifespan(receive: Receive, send: Send) -> None:
    """Acknowledge the ASGI lifespan protocol (gridd's apps keep no start-up state in it)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _send_plain(send: Send, status: int) -> None:
    body = f"{status} {_reason(status)}\n".encode("ascii")
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode("ascii")),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _HypercornAdapter:
    """Gives hypercorn the h11 backend's contract: no lifespan reaches the app, the same head
    limit (431), the same body limit (413 on a declared or streamed excess, http.disconnect to the
    app for the latter) and ClientDisconnected from send() once the request is abandoned."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_header_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        raw_target = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
        if _head_size(scope["method"].encode("ascii"), raw_target, scope["headers"]) > self.max_header_bytes:
            await _send_plain(send, 431)
            return
        declared = _declared_length(scope["headers"])
        if declared is not None and declared > limit:
            await _send_plain(send, 413)
            return
        received = 0
        over_limit = False
        disconnected = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, over_limit, disconnected
            if over_limit or disconnected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over_limit = True
                    return {"type": "http.disconnect"}
            elif message["type"] == "http.disconnect":
                disconnected = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            # hypercorn drops sends after a disconnect silently; the contract is to raise.
            if over_limit or disconnected:
                raise ClientDisconnected("client disconnected")
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception as exc:
            if not ((over_limit or disconnected) and _only_disconnects(exc)):
                raise
        if over_limit and not started:
            await _send_plain(send, 413)


def _normalize_hypercorn_url(url: str) -> str:
    # hypercorn reports a unix socket as "http://unix:/path".
    _, _, rest = url.partition("://")
    return rest if rest.startswith("unix:") else url


async def _serve_hypercorn(
    app: ASGIApp,
    binds: list[str],
    *,
    stop_accepting: trio.Event | None,
    limits: _Limits,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    for bind in binds:
        parse_bind(bind)  # same accepted syntax as the h11 backend
    config = Config()
    config.bind = list(binds)
    config.accesslog = None
    config.errorlog = logger
    config.keep_alive_timeout = limits.keep_alive_s
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.include_server_header = False
    # The caller bounds the drain with move_on_after; hypercorn must not impose its own.
    config.graceful_timeout = math.inf
    shutdown_trigger = stop_accepting.wait if stop_accepting is not None else None
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(
                serve,
                _HypercornAdapter(app, limits.max_body_bytes, limits.max_header_bytes),
                config,
                shutdown_trigger=shutdown_trigger,
                mode="asgi",
            )
        )
        task_status.started([_normalize_hypercorn_url(url) for url in urls])


# ---------------------------------------------------------------------------------------------


async def serve_asgi(
    app: ASGIApp,
    binds: list[str],
    *,
    server: Literal["h11", "hypercorn"] = "h11",
    stop_accepting: trio.Event | None = None,
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
    body_idle_s: float = DEFAULT_BODY_IDLE_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` (ASGI 3, http scopes only) on `binds` until cancelled or drained.

    binds: "host:port", "[v6]:port" or "unix:/path". task_status.started() gets the bound
    addresses once every listener accepts. stop_accepting: when set, stop accepting, let
    in-flight requests finish, close idle connections, then return (bound it with
    move_on_after). keep_alive_s is a per-connection policy, not a bound on this call: how long
    a connection may wait for its next complete request head. max_body_bytes: larger bodies get
    413 and never reach the app (declared Content-Length) or end in http.disconnect (chunked).
    max_header_bytes: larger request heads get 431. body_idle_s / body_deadline_s: a body
    stalled that long, or not complete that long after its head, gets 408. max_connections
    (per listener) and max_buffered_bytes (request bodies held across connections): see
    DEFAULT_MAX_CONNECTIONS and DEFAULT_MAX_BUFFERED_BYTES; the hypercorn backend has neither.
    reuse_port: bind TCP listeners with SO_REUSEPORT, so other processes may serve the same
    address (h11 backend only).
    """
    limits = _Limits(keep_alive_s, max_body_bytes, max_header_bytes, body_idle_s, body_deadline_s,
                     max_connections, max_buffered_bytes)
    if server == "h11":
        await _serve_h11(app, binds, stop_accepting=stop_accepting, limits=limits, reuse_port=reuse_port,
                         task_status=task_status)
    elif server == "hypercorn":
        if reuse_port:
            raise ValueError("reuse_port needs the h11 backend")
        await _serve_hypercorn(
            app, binds, stop_accepting=stop_accepting, limits=limits, task_status=task_status
        )
    else:
        raise ValueError(f"unknown HTTP server backend {server!r}")
