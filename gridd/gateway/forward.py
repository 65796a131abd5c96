"""Forwarding one OpenAI request upstream with httpx, streamed.

Upstream is either one of this site's providers (its OpenAI base ``.../v1`` and the
credentials our own operator sent) or another site's gateways (its ingress URL, with
PIN_HEADER naming that site so it serves the request locally and never re-routes it).

The pure half builds targets and filters headers. The IO half opens the upstream request
and reads its body, and maps every httpx failure into UpstreamError (STYLE 4), whose
``reason`` is a metric label and whose ``retryable`` says whether the front may try the
next candidate: true only while nothing of this attempt's answer has been relayed.

The front is injected an httpx *transport* (one pool for the process), not a client: a proxy
needs none of the client's layers (cookie jar, redirects, auth, default headers), and skipping
them saves about a quarter of a millisecond per request. make_upstream_transport builds httpx's
HTTP transport over a network backend that sends each request in one write
(docs/front.md, "Performance").

No timeouts live here (STYLE 3): requests carry no httpx timeout and the front bounds every
phase with trio cancel scopes. ``open_upstream`` reports the moment the connection is
established (``on_connected``), so the caller can move one deadline from the connect bound to
the time-to-headers bound.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpcore
import httpx
import trio

from gridd.core.decisions import PIN_HEADER, Forward
from gridd.errors import GriddError

__all__ = [
    "HOP_BY_HOP",
    "UpstreamBody",
    "UpstreamError",
    "UpstreamTarget",
    "UpstreamTransport",
    "close_expired_forever",
    "make_upstream_transport",
    "open_upstream",
    "request_headers",
    "response_headers",
    "upstream_target",
]

_PIN = PIN_HEADER.encode("ascii")

# RFC 9110 7.6.1: meaningful for one connection only, never forwarded in either direction.
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade",
})

# Client request headers the gateway drops on top of the hop-by-hop ones:
# - host, content-length: httpx writes them for the upstream request;
# - authorization, cookie: the client's credentials are for this gateway; providers get the
#   provider credentials our operator configured, remote sites their own;
# - expect: 100-continue is answered by our HTTP server, the body is already read;
# - PIN_HEADER: set by this gateway only, for a remote site.
_DROPPED_REQUEST = HOP_BY_HOP | {
    b"host", b"content-length", b"authorization", b"cookie", b"expect", _PIN,
}
# Response headers rebuilt by our server: framing (transfer-encoding is hop-by-hop already).
_DROPPED_RESPONSE = HOP_BY_HOP


class UpstreamError(GriddError):
    """An upstream attempt that produced nothing the front could relay (or broke mid-body).

    reason (metric label): connect (no connection), dropped (connection lost before any
    response byte), connect_timeout, header_timeout, first_byte_timeout, status (answered
    5xx), protocol (an unusable request or answer), stream_broken (the body failed after
    headers).
    """

    reason = "upstream"

    def __init__(self, message: str, *, reason: str, retryable: bool, status: int | None = None) -> None:
        super().__init__(message, reason=reason)
        self.retryable = retryable
        self.status = status


@dataclass(frozen=True, slots=True)
class UpstreamTarget:
    """Where one attempt goes and what it adds to the client's headers."""

    site: str
    provider: str
    url: httpx.URL
    headers: tuple[tuple[bytes, bytes], ...] = field(repr=False)
    """Target headers (auth, provider custom headers, PIN_HEADER); they override client ones.
    They carry the provider's credentials, so they stay out of repr() and logs."""
    timeout_s: float | None
    """The provider's own bound on time to response headers; None for a remote site."""
    remote: bool


def upstream_target(forward: Forward, path: str, query: bytes = b"") -> UpstreamTarget:
    """The URL and headers for ``forward`` of a request to ``path`` (``/v1/...``).

    Local provider: its OpenAI base (``.../v1``) plus the path after ``/v1``, with its auth:
    ``bearer`` sends ``Authorization: Bearer <api_key>``; ``header`` arrives from the operator
    already placed in ``headers`` under the configured name; custom headers are sent verbatim.
    Remote site: its ingress URL plus the whole path, with ``PIN_HEADER: <site>``.
    """
    suffix = path + ("?" + query.decode("latin-1") if query else "")
    local = forward.local
    if local is not None:
        base = local.endpoint_url.rstrip("/")
        rest = suffix[3:] if suffix.startswith("/v1") else suffix
        headers: list[tuple[bytes, bytes]] = [
            (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in local.headers.items()
        ]
        if local.auth_scheme == "bearer" and local.api_key:
            headers = [h for h in headers if h[0] != b"authorization"]
            headers.append((b"authorization", b"Bearer " + local.api_key.encode("latin-1")))
        return UpstreamTarget(forward.site, forward.provider, httpx.URL(base + rest), tuple(headers),
                              local.timeout_s, remote=False)
    if forward.ingress_url is None:
        raise ValueError(f"Forward to {forward.site}/{forward.provider} has neither a provider nor an ingress")
    return UpstreamTarget(forward.site, forward.provider, httpx.URL(forward.ingress_url.rstrip("/") + suffix),
                          ((_PIN, forward.site.encode("latin-1")),), None, remote=True)


def _connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    listed = set()
    for name, value in headers:
        if name.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b","))
    return frozenset(listed)


def request_headers(client: list[tuple[bytes, bytes]],
                    target: tuple[tuple[bytes, bytes], ...]) -> list[tuple[bytes, bytes]]:
    """Client headers to send upstream, then the target's (which win on a shared name).

    Everything the client sent passes (content-type, accept, accept-encoding, user-agent,
    x-request-id, llm-d's x-llm-d-inference-fairness-id, ...) except hop-by-hop headers,
    headers the client's Connection header lists, and _DROPPED_REQUEST. Nothing is added
    but the target's headers (an httpx transport sets only Host and Content-Length), so the
    upstream is asked for exactly the encodings the client accepts and its bytes can be
    relayed unchanged.
    """
    listed = _connection_listed(client)
    target_names = {name for name, _ in target}
    out: list[tuple[bytes, bytes]] = []
    for name, value in client:
        lowered = name.lower()
        if lowered in _DROPPED_REQUEST or lowered in target_names or (listed and lowered in listed):
            continue
        out.append((lowered, value))
    out.extend(target)
    return out


def response_headers(upstream: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], int]:
    """Upstream response headers to relay (all but hop-by-hop and Connection-listed ones) and
    the body length they declare (-1 when none or unreadable).

    Content-Length and Content-Encoding pass: the body is relayed byte for byte."""
    listed = _connection_listed(upstream)
    out = []
    length = -1
    for name, value in upstream:
        lowered = name.lower()
        if lowered in _DROPPED_RESPONSE or (listed and lowered in listed):
            continue
        if lowered == b"content-length":
            length = int(value) if value.isdigit() else -1
        out.append((lowered, value))
    return out, length


# ---------------------------------------------------------------------------------------------
# IO


class _CoalescingStream(httpcore.AsyncNetworkStream):
    """A trio stream for httpcore that holds writes until the next read.

    httpcore writes a request as head, body and end-of-message separately; an HTTP/1.1
    client always reads after writing a request, so sending everything at that read puts
    the whole request into one send() and wakes the upstream once instead of twice. No
    timeouts and no cancel scopes per operation: the front's scopes bound the exchange."""

    __slots__ = ("_stream", "_pending", "before_wait", "last_read_at")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._pending: list[bytes] = []
        self.before_wait: Callable[[], Awaitable[None]] | None = None
        """Awaited before each read from the peer: the relay of a response body hands on what
        it gathered (UpstreamBody.relay)."""
        self.last_read_at = trio.current_time()
        """When the peer last sent something: the server's keep-alive clock starts about then."""

    # httpcore's interface carries ``timeout``; it is always None here (requests carry no
    # timeout extension) and ignored: callers bound the exchange with trio scopes (STYLE 3).
    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        if buffer:
            self._pending.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self._pending:
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise httpcore.WriteError(repr(exc)) from exc
        if self.before_wait is not None:
            await self.before_wait()
        try:
            data = await self._stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(repr(exc)) from exc
        self.last_read_at = trio.current_time()
        return data

    async def aclose(self) -> None:
        self._pending.clear()
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:  # noqa: ASYNC109
        tls = trio.SSLStream(self._stream, ssl_context, server_hostname=server_hostname,
                             https_compatible=True)
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, ssl.SSLError, OSError) as exc:
            await self._stream.aclose()
            raise httpcore.ConnectError(repr(exc)) from exc
        return _CoalescingStream(tls)

    def _socket(self) -> Any:
        stream = self._stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        return stream.socket  # type: ignore[attr-defined]

    def get_extra_info(self, info: str) -> Any:
        # httpcore asks "is_readable" of an idle pooled connection: readable means the server
        # closed it (or sent junk), so the pool drops it instead of reusing it.
        if info == "is_readable":
            return self._socket().is_readable()
        if info == "socket":
            return self._socket()
        return None


class _CoalescingTrioBackend(httpcore.AsyncNetworkBackend):
    """Opens _CoalescingStream connections; ignores httpcore's ``timeout`` like the stream."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=local_address)
        except OSError as exc:
            raise httpcore.ConnectError(repr(exc)) from exc
        for option in socket_options or ():
            stream.setsockopt(*option)
        return _CoalescingStream(stream)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            raise httpcore.ConnectError(repr(exc)) from exc
        return _CoalescingStream(stream)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


# httpcore's exceptions as httpx's (the front, and any httpx transport, speak httpx's): the
# same names in both libraries, most specific first.
_HTTPX_ERRORS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = tuple(
    (getattr(httpcore, name), getattr(httpx, name)) for name in (
        "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException",
        "ConnectError", "ReadError", "WriteError", "NetworkError",
        "RemoteProtocolError", "LocalProtocolError", "ProtocolError", "UnsupportedProtocol"))
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
    (``httpcore.AsyncHTTP11Connection`` over _CoalescingTrioBackend streams), pooled here.

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

    def __init__(self, *, ssl_context: ssl.SSLContext | None, max_idle: int, keepalive_expiry_s: float) -> None:
        self._ssl_context = ssl_context
        self._max_idle = max_idle
        self._keepalive_expiry_s = keepalive_expiry_s
        self._backend = _CoalescingTrioBackend()
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
        idle_since = min(now, stream.last_read_at) if isinstance(stream, _CoalescingStream) else now
        expires_at = idle_since + self._keepalive_expiry_s
        if self._closed or len(stack) >= self._max_idle or expires_at <= now:
            await connection.aclose()
            return
        stack.append(_Idle(connection, expires_at))

    async def close_expired(self) -> int:
        """Close every idle connection past its keep-alive; how many were closed."""
        now = trio.current_time()
        expired: list[_Idle] = []
        for stack in self._idle.values():
            # Mostly oldest first, but a response relayed slowly is released late with an
            # early expiry: look at each one.
            if any(idle.expires_at <= now for idle in stack):
                expired += [idle for idle in stack if idle.expires_at <= now]
                kept = [idle for idle in stack if idle.expires_at > now]
                # In place and before any await: requests take from and release into these
                # stacks while a close yields (mutating a deque under iteration crashed the
                # gateway in the soak, docs/reliability.md).
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
            headers=request.headers.raw, content=request.stream,  # type: ignore[arg-type]
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
                              stream=_ResponseStream(self, key, connection, response),  # type: ignore[arg-type]
                              extensions=response.extensions)

    async def aclose(self) -> None:
        """Close the idle connections; those in use close with their responses."""
        self._closed = True
        for stack in list(self._idle.values()):  # a release during a close may add a stack
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


_CONNECTED_EVENT = "http11.send_request_headers.started"


async def open_upstream(transport: httpx.AsyncBaseTransport, target: UpstreamTarget,
                        headers: list[tuple[bytes, bytes]], body: bytes,
                        on_connected: Callable[[], None]) -> httpx.Response:
    """POST ``body`` to ``target`` and return the open response once its headers arrived.

    ``on_connected`` runs when a connection (new or pooled) is ready and the request starts
    going out. The response body is not read: wrap it in UpstreamBody and close it. A 5xx
    answer is closed here and raised as a retryable UpstreamError (nothing was relayed).
    """
    connected = False

    async def trace(name: str, info: Any) -> None:
        nonlocal connected
        if name == _CONNECTED_EVENT and not connected:
            connected = True
            on_connected()

    # No "timeout" extension: httpcore then applies none (the caller's scopes bound it).
    request = httpx.Request("POST", target.url, headers=headers, content=body, extensions={"trace": trace})
    try:
        response = await transport.handle_async_request(request)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise UpstreamError(f"cannot connect to {target.url}: {exc!r}", reason="connect",
                            retryable=True) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        # Dropped before any response byte: a dead upstream, or a pooled connection the server
        # closed as we reused it. Nothing reached the client, so the next candidate may serve.
        raise UpstreamError(f"{target.url} dropped the request before answering: {exc!r}",
                            reason="dropped", retryable=True) from exc
    except (httpx.TransportError, httpx.InvalidURL) as exc:
        raise UpstreamError(f"request to {target.url} failed: {exc!r}", reason="protocol",
                            retryable=not connected) from exc
    if response.status_code >= 500:
        await response.aclose()
        raise UpstreamError(f"{target.url} answered {response.status_code}", reason="status",
                            retryable=True, status=response.status_code)
    return response


RELAY_GATHER_BYTES = 64 * 1024
"""Most body bytes UpstreamBody.relay gathers before handing them on, even if more are ready."""


class UpstreamBody:
    """The response body as raw bytes (no decoding: relayed byte for byte)."""

    __slots__ = ("response", "target", "_chunks")

    def __init__(self, response: httpx.Response, target: UpstreamTarget) -> None:
        self.response = response
        self.target = target
        self._chunks = response.stream.__aiter__()  # type: ignore[union-attr]

    async def relay(self, deliver: Callable[[bytes, bool], Awaitable[None]]) -> None:
        """Hand the body to ``deliver(data, last)`` in as few pieces as it arrives in.

        Everything the upstream connection already holds (what one read of up to 64 KiB
        brought, parsed by h11) goes in one call, made just before the connection reads again:
        a stream that arrives one event at a time is relayed one event at a time, a backlog
        (many events in one read) in one piece, never one send per event. The last call has ``last`` true, with whatever remains (maybe b"").
        An upstream failure delivers what arrived before it, then raises UpstreamError
        (stream_broken); whatever ``deliver`` raises passes through unchanged."""
        pending: list[bytes] = []
        size = 0

        async def flush() -> None:
            nonlocal size
            if pending:
                data = pending[0] if len(pending) == 1 else b"".join(pending)
                pending.clear()
                size = 0
                await deliver(data, False)

        stream = (self.response.extensions or {}).get("network_stream")
        hooked = isinstance(stream, _CoalescingStream)
        if hooked:
            stream.before_wait = flush
        try:
            async for chunk in self._chunks:
                if chunk:
                    pending.append(chunk)
                    size += len(chunk)
                    if not hooked or size >= RELAY_GATHER_BYTES:
                        await flush()
        except httpx.TransportError as exc:
            broken: httpx.TransportError | None = exc
        else:
            broken = None
        finally:
            if hooked:
                stream.before_wait = None
        if broken is not None:
            await flush()  # what arrived before the break still reaches the client
            raise UpstreamError(f"{self.target.url} broke mid-body: {broken!r}", reason="stream_broken",
                                retryable=False) from broken
        await deliver(b"".join(pending), True)

    async def aclose(self) -> None:
        """Close the body; an unfinished one closes its connection (the upstream sees EOF)."""
        try:
            await self._chunks.aclose()  # type: ignore[attr-defined]
        finally:
            await self.response.aclose()


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
