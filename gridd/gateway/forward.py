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
from collections.abc import Callable, Iterable
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

    __slots__ = ("_stream", "_pending")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self._stream = stream
        self._pending: list[bytes] = []

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
        try:
            return await self._stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(repr(exc)) from exc

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


class UpstreamTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport over httpcore's pool, with _CoalescingTrioBackend underneath.

    Everything httpx does (request and response models, exception mapping, the pool's
    keep-alive rules) is unchanged; only the network backend differs. httpx takes no backend
    argument, so the pool it built is replaced by the same pool with ours (``_pool`` is the
    one attribute of httpx this relies on; tests/test_front.py exercises it)."""

    def __init__(self, *, verify: ssl.SSLContext | bool, limits: httpx.Limits) -> None:
        super().__init__(verify=verify, http1=True, http2=False, trust_env=False, retries=0, limits=limits)
        ssl_context = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(
            verify=verify, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context, max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry, http1=True, http2=False, retries=0,
            network_backend=_CoalescingTrioBackend(),
        )


def make_upstream_transport(*, verify: ssl.SSLContext | bool = True, max_keepalive: int = 256,
                            keepalive_expiry_s: float = 4.0) -> UpstreamTransport:
    """The one pooled transport the front forwards with (reuse it; close it with aclose()).

    No connection cap, so the pool is never a hidden queue (STYLE 8); idle keep-alive
    connections are capped at ``max_keepalive``. ``keepalive_expiry_s`` 4 s sits under the
    usual 5 s server keep-alive (ours, uvicorn's, hypercorn's), so a pooled connection is
    dropped before the server closes it. HTTP/1.1 only (h2 off); no proxy from the environment;
    no transport-level retries. ``verify``: an ssl.SSLContext for the grid CA and the
    gateway's client certificate when this transport goes to other sites' ingress.
    """
    return UpstreamTransport(verify=verify, limits=httpx.Limits(
        max_connections=None, max_keepalive_connections=max_keepalive, keepalive_expiry=keepalive_expiry_s))


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


class UpstreamBody:
    """The response body as raw chunks (no decoding: relayed byte for byte)."""

    __slots__ = ("response", "target", "_chunks")

    def __init__(self, response: httpx.Response, target: UpstreamTarget) -> None:
        self.response = response
        self.target = target
        self._chunks = response.stream.__aiter__()  # type: ignore[union-attr]

    async def next_chunk(self) -> bytes | None:
        """The next non-empty chunk; None at the end of the body."""
        try:
            while True:
                chunk = await self._chunks.__anext__()
                if chunk:
                    return chunk
        except StopAsyncIteration:
            return None
        except httpx.TransportError as exc:
            raise UpstreamError(f"{self.target.url} broke mid-body: {exc!r}", reason="stream_broken",
                                retryable=False) from exc

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

    def swap(self, inner: httpx.AsyncBaseTransport) -> None:
        self._retired.append(self.inner)
        self.inner = inner

    async def aclose(self) -> None:
        for transport in (self.inner, *self._retired):
            await transport.aclose()
        self._retired.clear()
