"""The gateway's pooled upstream transport: an httpx transport over httpcore's public API
(``httpcore.AsyncHTTP11Connection`` over coalescing_stream's trio streams).

The front is injected an httpx *transport* (one pool for the process), not a client: a proxy
needs none of the client's layers (cookie jar, redirects, auth, default headers), and skipping
them saves about a quarter of a millisecond per request (docs/front.md, "Performance").
SwappableTransport lets a reload replace the transport for other sites' ingress;
close_expired_forever closes idle connections past their keep-alive when no request does.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpcore
import httpx
import trio

from gridd.gateway.coalescing_stream import CoalescingStream, CoalescingTrioBackend

__all__ = [
    "SWEEP_EVERY_S",
    "SwappableTransport",
    "UpstreamTransport",
    "close_expired_forever",
    "make_upstream_transport",
]


# httpcore's exceptions as httpx's (the front, and any httpx transport, speak httpx's): the
# same names in both libraries, most specific first.
_HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
)
_HTTPCORE_ERRORS = tuple(core for core, _ in _HTTPX_ERRORS)


def _as_httpx(exc: Exception) -> httpx.TransportError:
    for core, mapped in _HTTPX_ERRORS:
        if isinstance(exc, core):
            return mapped(str(exc))
    return httpx.TransportError(str(exc))


_DEFAULT_PORTS = {b"http": 80, b"https": 443}


class _Idle:
    """A pooled connection waiting for its next request, and when the pool stops trusting it."""

    __slots__ = ("connection", "expires_at")

    def __init__(self, connection: httpcore.AsyncHTTP11Connection, expires_at: float) -> None:
        self.connection = connection
        self.expires_at = expires_at


class UpstreamTransport(httpx.AsyncBaseTransport):
    """An httpx transport of our own: HTTP/1.1 connections from httpcore's public API
    (``httpcore.AsyncHTTP11Connection`` over CoalescingTrioBackend streams), pooled here.

    httpx's own transport goes through httpcore's connection pool, which rescans every
    connection it holds (and polls each idle socket) on every request and every response
    close: at 64 concurrent requests that scan was a third of the gateway's CPU
    (docs/performance.md). This pool costs O(1) per request: per origin, a stack of idle
    connections, the most recently used on top (it is the one least likely to have been closed
    by the server); a connection goes back on the stack when its response is closed after the
    whole exchange, and is closed otherwise.

    Keep-alive: an idle connection is trusted for ``keepalive_expiry_s`` (below the backends'
    own keep-alive, so the server never closes a connection we are about to reuse) counted
    from the last bytes the server sent, which is when the server's own clock starts (a
    response relayed to a slow client is released well after that), and never when its
    socket reads as closed (the server hung up: httpcore's ``has_expired``). Expired
    connections are closed when the pool is next used (the bottom of each stack is the
    oldest) and by ``close_expired`` (the gateway calls it every second). No cap on connections: the
    pool is never a hidden queue (STYLE 8), it grows to the concurrency the front sees; at most
    ``max_idle`` idle connections are kept per origin.

    ``opened`` and ``requests`` count connections opened and requests sent (benchmarks,
    tests: ``opened / requests`` is the reuse the gateway achieves)."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None, max_idle: int,
                 keepalive_expiry_s: float) -> None:
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._keepalive_expiry_s = keepalive_expiry_s
        self._backend = CoalescingTrioBackend()
        self._idle: dict[tuple[bytes, bytes, int], deque[_Idle]] = {}
        self._closed = False
        self.opened = 0
        self.requests = 0

    def idle_count(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    def pool_counts(self) -> tuple[int, int]:
        """(connections opened, requests sent)."""
        return self.opened, self.requests

    async def _connect(self, scheme: bytes, host: bytes, port: int) -> httpcore.AsyncHTTP11Connection:
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(f"unsupported URL scheme {scheme.decode('latin-1')!r}")
        name = host.decode("ascii")
        stream = await self._backend.connect_tcp(name, port)
        if scheme == b"https":
            context = self._ssl_context
            if context is None:
                # httpx's default verification (its CA bundle), built once, on first use.
                context = self._ssl_context = httpx.create_ssl_context(verify=True, trust_env=False)
            stream = await stream.start_tls(context, server_hostname=name)
        self.opened += 1
        return httpcore.AsyncHTTP11Connection(httpcore.Origin(scheme, host, port), stream)

    async def _acquire(self, key: tuple[bytes, bytes, int]) -> httpcore.AsyncHTTP11Connection:
        stack = self._idle.get(key)
        if stack:
            now = trio.current_time()
            while stack:
                idle = stack.pop()
                # has_expired: the socket reads as closed (httpcore's own keep-alive clock is off).
                if idle.expires_at > now and not idle.connection.has_expired():
                    return idle.connection
                await idle.connection.aclose()
        return await self._connect(*key)

    async def _release(self, key: tuple[bytes, bytes, int], connection: httpcore.AsyncHTTP11Connection,
                       stream: Any) -> None:
        """After a response closed: keep the connection if the exchange completed, else close it.
        ``stream``: the connection's network stream (the response's ``network_stream``)."""
        if not connection.is_idle():
            return  # httpcore closed it (response cut short, or Connection: close)
        stack = self._idle.setdefault(key, deque())
        now = trio.current_time()
        while stack and stack[0].expires_at <= now:
            await stack.popleft().connection.aclose()
        idle_since = min(now, stream.last_read_at) if isinstance(stream, CoalescingStream) else now
        expires_at = idle_since + self._keepalive_expiry_s
        if self._closed or len(stack) >= self._max_idle or expires_at <= now:
            await connection.aclose()
            return
        stack.append(_Idle(connection, expires_at))

    async def close_expired(self) -> int:
        """Close every idle connection past its keep-alive; how many were closed."""
        now = trio.current_time()
        expired: list[_Idle] = []
        # Taken off their stacks first, with no await in between: a request or a release may
        # use the same stacks (and add an origin) while the connections close below.
        for stack in self._idle.values():
            # Mostly oldest first, but a response relayed slowly is released late with an
            # early expiry: look at each one.
            if any(idle.expires_at <= now for idle in stack):
                kept = [idle for idle in stack if idle.expires_at > now]
                expired.extend(idle for idle in stack if idle.expires_at <= now)
                stack.clear()
                stack.extend(kept)
        for idle in expired:
            await idle.connection.aclose()
        return len(expired)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._closed:
            raise RuntimeError("the upstream transport is closed")
        url = request.url
        scheme = url.raw_scheme
        key = (scheme, url.raw_host, url.port or _DEFAULT_PORTS.get(scheme, 0))
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=scheme, host=url.raw_host, port=url.port, target=url.raw_path),
            headers=request.headers.raw, content=request.stream,
            extensions=request.extensions)
        try:
            connection = await self._acquire(key)
            self.requests += 1
            try:
                response = await connection.handle_async_request(core_request)
            except BaseException:
                await self._release(key, connection, None)  # httpcore closed it already on a failure
                raise
        except _HTTPCORE_ERRORS as exc:
            raise _as_httpx(exc) from exc
        return httpx.Response(status_code=response.status, headers=response.headers,
                              stream=_ResponseStream(self, key, connection, response),
                              extensions=response.extensions)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close with their responses."""
        self._closed = True
        for stack in self._idle.values():
            while stack:
                await stack.pop().connection.aclose()


class _ResponseStream(httpx.AsyncByteStream):
    """A pooled response's body: httpcore's errors as httpx's, the connection back to the pool
    (or closed) when the response is closed."""

    __slots__ = ("_pool", "_key", "_connection", "_stream", "_network_stream", "_closed")

    def __init__(self, pool: UpstreamTransport, key: tuple[bytes, bytes, int],
                 connection: httpcore.AsyncHTTP11Connection, response: httpcore.Response) -> None:
        self._pool = pool
        self._key = key
        self._connection = connection
        self._stream: Any = response.stream
        self._network_stream = response.extensions.get("network_stream")
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except _HTTPCORE_ERRORS as exc:
            raise _as_httpx(exc) from exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()
        finally:
            await self._pool._release(self._key, self._connection, self._network_stream)


def make_upstream_transport(*, verify: ssl.SSLContext | bool = True, max_idle: int = 1024,
                            keepalive_expiry_s: float = 4.0) -> UpstreamTransport:
    """The one pooled transport the front forwards with (reuse it; close it with aclose()).

    No connection cap, so the pool is never a hidden queue (STYLE 8); idle keep-alive
    connections are capped at ``max_idle`` per origin (the front's own connection cap, so a
    burst of that many concurrent requests finds its connections again). ``keepalive_expiry_s``
    4 s sits under the usual 5 s server keep-alive (ours, uvicorn's, hypercorn's), so a pooled
    connection is dropped before the server closes it. HTTP/1.1 only; no proxy from the
    environment; no retries. ``verify``: an ssl.SSLContext for the grid CA and the gateway's
    client certificate when this transport goes to other sites' ingress; True: httpx's default
    verification; False: none (tests only).
    """
    if isinstance(verify, ssl.SSLContext):
        context: ssl.SSLContext | None = verify
    elif verify:
        context = None  # built on the first https connection (loading CAs takes a while)
    else:
        context = httpx.create_ssl_context(verify=False, trust_env=False)
    return UpstreamTransport(ssl_context=context, max_idle=max_idle, keepalive_expiry_s=keepalive_expiry_s)


class SwappableTransport(httpx.AsyncBaseTransport):
    """A transport whose inner transport a committed reload can replace (a rotated client
    certificate for other sites' ingress). Requests in flight finish on the transport they
    started on; retired ones are closed with this one."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self._retired: list[httpx.AsyncBaseTransport] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)

    def pool_counts(self) -> tuple[int, int]:
        """(connections opened, requests sent) over the inner transports, retired ones included."""
        pools = [t for t in (self.inner, *self._retired) if isinstance(t, UpstreamTransport)]
        return sum(t.opened for t in pools), sum(t.requests for t in pools)

    async def close_expired(self) -> int:
        closed = 0
        for transport in (self.inner, *self._retired):
            if isinstance(transport, UpstreamTransport):
                closed += await transport.close_expired()
        return closed

    def swap(self, inner: httpx.AsyncBaseTransport) -> None:
        self._retired.append(self.inner)
        self.inner = inner

    async def aclose(self) -> None:
        for transport in (self.inner, *self._retired):
            await transport.aclose()
        self._retired.clear()


SWEEP_EVERY_S = 1.0
"""How often idle upstream connections past their keep-alive are closed when no request
comes to close them (a quiet gateway must not hold sockets its backends already closed)."""


async def close_expired_forever(transports: Iterable[httpx.AsyncBaseTransport]) -> None:
    """Every SWEEP_EVERY_S, close the idle connections past their keep-alive in each of our
    transports (other httpx transports, e.g. injected by tests, are left alone)."""
    ours = [t for t in transports if isinstance(t, (UpstreamTransport, SwappableTransport))]
    if not ours:
        return
    while True:
        await trio.sleep(SWEEP_EVERY_S)
        for transport in ours:
            await transport.close_expired()
