"""The gateway's forwarding client: HTTP/1.1 POSTs over pooled keep-alive connections.

A forwarded request needs one thing from HTTP: send a POST and relay the answer as it
arrives. This client does that and nothing else (docs/front.md, "Upstream connections"): the
request is built as bytes (UpstreamTarget caches its request line, Host and the target's
headers) and goes out in one send; the response is read by upstream_parser (sans-IO); what
one socket read brought is handed on in one ``deliver`` call. No timeouts here (STYLE 3):
the front's trio scopes bound every phase. Failures are mapped here, at the layer edge
(STYLE 4), to UpstreamError reasons (upstream_errors): ``connect`` (no connection, TLS
failure), ``dropped`` (the connection failed or answered garbage before a whole response
head), ``protocol`` (a request that cannot be sent), ``stream_broken`` (after the head).

Syscalls per request on a reused plain connection: one send, then a wait for readability
and one recv (the answer is never there as the request leaves, so trying the recv first
would only fail with EAGAIN), plus one recv per further arrival. A pooled connection idle
for less than UNCHECKED_IDLE_S is reused without polling its socket (module constant below).

The pool: per origin a stack of idle connections, the most recently used on top; no cap on
connections (never a hidden queue, STYLE 8); at most ``max_idle`` idle ones per origin;
a connection is trusted for ``keepalive_expiry_s`` from the last bytes the server sent.
"""

from __future__ import annotations

import select
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

import httpx
import trio

from gridd.gateway.upstream_errors import UpstreamError
from gridd.gateway.upstream_parser import MalformedResponse, ResponseParser
from gridd.gateway.upstream_request import (
    Deliver,
    Upstream,
    UpstreamAnswer,
    UpstreamTarget,
    request_header_block,
)
from gridd.http import sockio

__all__ = [
    "RECEIVE_BYTES",
    "SWEEP_EVERY_S",
    "UNCHECKED_IDLE_S",
    "SwappableUpstream",
    "UpstreamClient",
    "close_expired_forever",
    "make_upstream_client",
]

RECEIVE_BYTES = 64 * 1024
"""Bytes asked of the socket per read: the most one ``deliver`` call hands on at once."""
UNCHECKED_IDLE_S = 1.0
"""A pooled connection whose server sent its last bytes less than this long ago is reused
without polling its socket for a close (one poll syscall saved on nearly every request
under load). Servers close idle keep-alive connections after seconds (uvicorn, hypercorn and
ours 5 s, nginx 75 s), and the pool itself stops trusting one after ``keepalive_expiry_s``
(4 s), so a close inside this second is a server going away; that request then fails
before any response byte, reason ``dropped``, and the front retries it on the next
candidate, as it does today when a close races the reuse. Past this bound the socket is
polled as before."""
SWEEP_EVERY_S = 1.0
"""How often idle upstream connections past their keep-alive are closed when no request
comes to close them (a quiet gateway must not hold sockets its backends already closed)."""
_CLOSE_S = 1.0
"""Bound on a TLS connection's close (its close_notify), shielded from cancellation."""
_WRITE_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)
_READ_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, MalformedResponse)

Origin = tuple[str, str, int]


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


class _Connection:
    """One upstream connection. A plain one is a non-blocking socket this module drives
    itself (trio waits for readability, no per-call checkpoints); a TLS one a trio.SSLStream."""

    __slots__ = ("sock", "tls", "probe", "last_read_at", "expires_at")

    def __init__(self, sock: socket.socket | None, tls: trio.SSLStream[trio.SocketStream] | None,
                 probe: _HasFileno) -> None:
        self.sock = sock
        """The plain socket, or None under TLS."""
        self.tls = tls
        self.probe = probe
        """The TCP socket (under TLS too), polled for a close while idle."""
        self.last_read_at = trio.current_time()
        """When the server last sent something: its keep-alive clock starts about then."""
        self.expires_at = 0.0

    async def send_all(self, data: bytes) -> None:
        if self.tls is not None:
            await self.tls.send_all(data)
            return
        sock = self.sock
        assert sock is not None  # a plain connection
        await sockio.send_all(sock, data)

    async def receive(self, *, wait_first: bool) -> bytes:
        """The next bytes from the server (b"" once it closed). ``wait_first``: wait for
        readability before the first recv (the answer to a request just sent)."""
        if self.tls is not None:
            # Typed bytes | bytearray; an SSLStream's are bytes, which bytes() returns as they are.
            data = bytes(await self.tls.receive_some(RECEIVE_BYTES))
        else:
            sock = self.sock
            assert sock is not None  # a plain connection
            data = await sockio.receive(sock, RECEIVE_BYTES, wait_first=wait_first)
        self.last_read_at = trio.current_time()
        return data

    def closed_by_peer(self) -> bool:
        """Whether the idle socket reads as readable: the server closed it (or sent junk)."""
        poll = select.poll()
        poll.register(self.probe, select.POLLIN)
        return bool(poll.poll(0))

    async def aclose(self) -> None:
        """Close at once (a plain socket) or within _CLOSE_S (TLS close_notify), shielded: a
        client that left must still free the backend."""
        if self.tls is not None:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _CLOSE_S):
                await self.tls.aclose()
            return
        sock = self.sock
        assert sock is not None  # a plain connection
        trio.lowlevel.notify_closing(sock)
        sock.close()


class _Answer:
    """An open response: its head, and its body relayed as it arrives (UpstreamAnswer)."""

    __slots__ = ("status", "headers", "_url", "_client", "_origin", "_connection", "_parser", "_reusable",
                 "_closed")

    def __init__(self, url: httpx.URL, client: UpstreamClient, origin: Origin, connection: _Connection,
                 parser: ResponseParser, *, reusable: bool) -> None:
        self.status = parser.status
        self.headers = parser.headers
        self._url = url
        self._client = client
        self._origin = origin
        self._connection = connection
        self._parser = parser
        self._reusable = reusable
        """False when the request did not go out whole: the connection is out of step."""
        self._closed = False

    async def relay(self, deliver: Deliver) -> None:
        """Hand the body to ``deliver(data, last)``: what each read brought in one call, made
        before the connection reads again (a stream arriving one event at a time is relayed
        one event at a time, a backlog in one piece). The last call has ``last`` true, with
        whatever remains (maybe b""). A failure delivers what arrived before it, then raises
        UpstreamError (stream_broken); what ``deliver`` raises passes through unchanged."""
        parser = self._parser
        connection = self._connection
        try:
            while not parser.done:
                data = parser.take_body()
                if data:
                    await deliver(data, False)  # a checkpoint: the client's send
                # After a read that brought no body (framing only), wait before reading again:
                # a checkpoint, so no upstream can keep this loop from yielding.
                received = await connection.receive(wait_first=not data)
                if received:
                    parser.feed(received)
                else:
                    parser.feed_eof()
        except _READ_ERRORS as exc:
            data = parser.take_body()
            if data:
                await deliver(data, False)  # what arrived before the break still reaches the client
            raise UpstreamError(f"{self._url} broke mid-body: {exc!r}",
                                reason="stream_broken", retryable=False) from exc
        await deliver(parser.take_body(), True)

    async def aclose(self) -> None:
        """Back to the pool after a complete exchange, else closed (the upstream sees EOF).
        Never cut short by cancellation: a plain socket closes without a checkpoint, a TLS one
        within a shielded _CLOSE_S."""
        if self._closed:
            return
        self._closed = True
        await self._client._release(self._origin, self._connection, self._reusable and self._parser.reusable)


class UpstreamClient:
    """The pooled forwarding client (module docstring): ``open`` a request, relay and close
    its answer. ``opened`` and ``requests`` count connections opened and requests sent
    (``pool_counts``: benchmarks, tests, grid_gateway_upstream_*)."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None, max_idle: int, keepalive_expiry_s: float,
                 unchecked_idle_s: float = UNCHECKED_IDLE_S) -> None:
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._keepalive_expiry_s = keepalive_expiry_s
        self._unchecked_idle_s = unchecked_idle_s
        self._idle: dict[Origin, deque[_Connection]] = {}
        self._closed = False
        self.opened = 0
        self.requests = 0

    async def __aenter__(self) -> UpstreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def idle_count(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    def pool_counts(self) -> tuple[int, int]:
        """(connections opened, requests sent)."""
        return self.opened, self.requests

    async def open(self, target: UpstreamTarget, client_headers: list[tuple[bytes, bytes]], body: bytes,
                   on_connected: Callable[[], None]) -> _Answer:
        """POST ``body`` to ``target`` and return the answer once its head is in (its body not
        read: relay it, then close it). ``on_connected()`` runs when a connection (new or
        pooled) is ready and the request is about to go out."""
        if self._closed:
            raise RuntimeError("the upstream client is closed")
        origin = target.origin
        block = request_header_block(client_headers, target.header_names)
        if target.request_head is None or block is None:
            raise UpstreamError(f"request to {target.url} cannot be sent: a header holds CR, LF or NUL",
                                reason="protocol", retryable=False)
        request = b"".join((target.request_head, block, target.header_block, b"Content-Length: ",
                            b"%d" % len(body), b"\r\n\r\n", body))
        connection = await self._acquire(origin, target.url)
        self.requests += 1
        on_connected()
        parser = ResponseParser()
        unsent: BaseException | None = None
        try:
            try:
                try:
                    await connection.send_all(request)
                except _WRITE_ERRORS as exc:
                    # The upstream may have answered before taking the whole request (a 413,
                    # say) and closed: what it sent is still read, as httpx read it.
                    unsent = exc
                received = await connection.receive(wait_first=True)
                while True:
                    if received:
                        parser.feed(received)
                    else:
                        parser.feed_eof()
                    if parser.status:
                        break
                    received = await connection.receive(wait_first=True)  # 1xx or a split head
            except _READ_ERRORS as exc:
                # Nothing of an answer reached the client: the next candidate may serve (a dead
                # upstream, or a pooled connection the server closed as it was reused).
                raise UpstreamError(f"{target.url} dropped the request before answering: {unsent or exc!r}",
                                    reason="dropped", retryable=True) from exc
        except BaseException:
            await connection.aclose()
            raise
        return _Answer(target.url, self, origin, connection, parser, reusable=unsent is None)

    async def _acquire(self, origin: Origin, url: httpx.URL) -> _Connection:
        stack = self._idle.get(origin)
        if stack:
            now = trio.current_time()
            while stack:
                connection = stack.pop()
                if connection.expires_at > now and (now - connection.last_read_at < self._unchecked_idle_s
                                                    or not connection.closed_by_peer()):
                    return connection
                await connection.aclose()
        return await self._connect(origin, url)

    async def _connect(self, origin: Origin, url: httpx.URL) -> _Connection:
        scheme, host, port = origin
        if scheme not in ("http", "https"):
            raise UpstreamError(f"request to {url} failed: unsupported URL scheme {scheme!r}",
                                reason="protocol", retryable=True)
        try:
            stream = await trio.open_tcp_stream(host, port)
        except (OSError, ValueError) as exc:  # ValueError, UnicodeError: a host name IDNA refuses
            raise UpstreamError(f"cannot connect to {url}: {exc!r}", reason="connect",
                                retryable=True) from exc
        tls = None
        if scheme == "https":
            context = self._ssl_context
            if context is None:
                # httpx's default verification (its CA bundle), built once, on first use.
                context = self._ssl_context = httpx.create_ssl_context(verify=True, trust_env=False)
            tls = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
            try:
                await tls.do_handshake()
            except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
                await trio.aclose_forcefully(stream)
                raise UpstreamError(f"cannot connect to {url}: {exc!r}", reason="connect",
                                    retryable=True) from exc
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            connection = _Connection(None, tls, stream.socket)
        else:
            # The plain socket is driven here: taken out of trio's socket object (no checkpoint
            # per call), non-blocking, TCP_NODELAY already set by open_tcp_stream.
            plain = socket.socket(fileno=stream.socket.detach())
            plain.setblocking(False)
            connection = _Connection(plain, None, plain)
        self.opened += 1
        return connection

    async def _release(self, origin: Origin, connection: _Connection, reusable: bool) -> None:
        """After an answer closed: keep the connection if the exchange completed cleanly,
        else close it."""
        if not reusable or self._closed:
            await connection.aclose()
            return
        stack = self._idle.setdefault(origin, deque())
        now = trio.current_time()
        while stack and stack[0].expires_at <= now:
            await stack.popleft().aclose()
        expires_at = connection.last_read_at + self._keepalive_expiry_s
        if len(stack) >= self._max_idle or expires_at <= now:
            await connection.aclose()
            return
        connection.expires_at = expires_at
        stack.append(connection)

    async def close_expired(self) -> int:
        """Close every idle connection past its keep-alive; how many were closed."""
        now = trio.current_time()
        expired: list[_Connection] = []
        # Taken off their stacks first, with no await in between: a request or a release may
        # use the same stacks (and add an origin) while the connections close below.
        for stack in self._idle.values():
            # Mostly oldest first, but a response relayed slowly is released late with an
            # early expiry: look at each one.
            if any(connection.expires_at <= now for connection in stack):
                kept = [connection for connection in stack if connection.expires_at > now]
                expired.extend(connection for connection in stack if connection.expires_at <= now)
                stack.clear()
                stack.extend(kept)
        for connection in expired:
            await connection.aclose()
        return len(expired)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close with their answers."""
        self._closed = True
        for stack in self._idle.values():
            while stack:
                await stack.pop().aclose()


def make_upstream_client(*, verify: ssl.SSLContext | bool = True, max_idle: int = 1024,
                         keepalive_expiry_s: float = 4.0) -> UpstreamClient:
    """The one pooled client the front forwards with (reuse it; close it with aclose()).

    No connection cap, so the pool is never a hidden queue (STYLE 8); idle keep-alive
    connections are capped at ``max_idle`` per origin (the front's own connection cap, so a
    burst of that many concurrent requests finds its connections again). ``keepalive_expiry_s``
    4 s sits under the usual 5 s server keep-alive (ours, uvicorn's, hypercorn's), so a pooled
    connection is dropped before the server closes it. HTTP/1.1 only; no proxy from the
    environment; no retries. ``verify``: an ssl.SSLContext for the grid CA and the gateway's
    client certificate when this client goes to other sites' ingress; True: httpx's default
    verification; False: none (tests only).
    """
    if isinstance(verify, ssl.SSLContext):
        context: ssl.SSLContext | None = verify
    elif verify:
        context = None  # built on the first https connection (loading CAs takes a while)
    else:
        context = httpx.create_ssl_context(verify=False, trust_env=False)
    return UpstreamClient(ssl_context=context, max_idle=max_idle, keepalive_expiry_s=keepalive_expiry_s)


class SwappableUpstream:
    """An upstream whose inner one a committed reload can replace (a rotated client
    certificate for other sites' ingress). Requests in flight finish on the one they started
    on; retired ones are closed with this one."""

    def __init__(self, inner: Upstream) -> None:
        self.inner = inner
        self._retired: list[Upstream] = []

    async def __aenter__(self) -> SwappableUpstream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self, target: UpstreamTarget, client_headers: list[tuple[bytes, bytes]], body: bytes,
                   on_connected: Callable[[], None]) -> UpstreamAnswer:
        return await self.inner.open(target, client_headers, body, on_connected)

    def pool_counts(self) -> tuple[int, int]:
        """(connections opened, requests sent) over the inner clients, retired ones included."""
        pools = [u for u in (self.inner, *self._retired) if isinstance(u, UpstreamClient)]
        return sum(u.opened for u in pools), sum(u.requests for u in pools)

    async def close_expired(self) -> int:
        closed = 0
        for upstream in (self.inner, *self._retired):
            if isinstance(upstream, UpstreamClient):
                closed += await upstream.close_expired()
        return closed

    def swap(self, inner: Upstream) -> None:
        self._retired.append(self.inner)
        self.inner = inner

    async def aclose(self) -> None:
        for upstream in (self.inner, *self._retired):
            await upstream.aclose()
        self._retired.clear()


async def close_expired_forever(upstreams: Iterable[object]) -> None:
    """Every SWEEP_EVERY_S, close the idle connections past their keep-alive in each of our
    clients (other upstreams, e.g. httpx transports injected by tests, are left alone)."""
    ours = [u for u in upstreams if isinstance(u, (UpstreamClient, SwappableUpstream))]
    if not ours:
        return
    while True:
        await trio.sleep(SWEEP_EVERY_S)
        for upstream in ours:
            await upstream.close_expired()
