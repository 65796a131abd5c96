"""The front's Upstream over any httpx transport: tests inject mock and in-process ASGI
transports (httpx.MockTransport, httpx.ASGITransport through GatewayService's injection);
the daemon forwards with upstream_client instead.

httpx's failures are mapped into UpstreamError here (upstream_errors), as the front saw
them when it forwarded through httpx: the same reasons, the same retry rule.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

import httpx
import trio

from gridd.gateway.upstream_errors import broke_mid_body, failed_before_answer
from gridd.gateway.upstream_request import Deliver, Upstream, UpstreamTarget, request_headers

__all__ = ["CLOSE_S", "CONNECTED_EVENT", "HttpxUpstream", "as_upstream"]

CLOSE_S = 1.0
"""Bound on closing an answer (shielded from cancellation)."""

CONNECTED_EVENT = "http11.send_request_headers.started"
"""The httpx trace event that says a connection is ready and the request is going out (a
transport that sends no trace events leaves the connect bound over the whole wait)."""


class _HttpxAnswer:
    """An httpx response as an UpstreamAnswer: each body chunk the transport yields is
    handed on as it comes (the raw bytes, no decoding)."""

    __slots__ = ("status", "headers", "_response", "_url", "_chunks")

    def __init__(self, response: httpx.Response, url: httpx.URL) -> None:
        self.status = response.status_code
        self.headers = response.headers.raw
        self._response = response
        self._url = url
        stream = response.stream
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("an async transport's response has an async body stream")
        # httpx's streams iterate as async generators: closing one closes its connection.
        self._chunks = cast(AsyncGenerator[bytes, None], stream.__aiter__())

    async def relay(self, deliver: Deliver) -> None:
        try:
            async for chunk in self._chunks:
                if chunk:
                    await deliver(chunk, False)
        except httpx.TransportError as exc:
            raise broke_mid_body(self._url, exc) from exc
        await deliver(b"", True)

    async def aclose(self) -> None:
        # Shielded and bounded (UpstreamAnswer): a client that left must still free the backend.
        with trio.CancelScope(shield=True, deadline=trio.current_time() + CLOSE_S):
            try:
                await self._chunks.aclose()
            finally:
                await self._response.aclose()


class HttpxUpstream:
    """Forwards through ``transport`` (an httpx.AsyncBaseTransport); closing this closes it."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport

    async def open(self, target: UpstreamTarget, client_headers: list[tuple[bytes, bytes]], body: bytes,
                   on_connected: Callable[[], None]) -> _HttpxAnswer:
        connected = False

        async def trace(name: str, info: Any) -> None:
            nonlocal connected
            if name == CONNECTED_EVENT and not connected:
                connected = True
                on_connected()

        # No "timeout" extension: httpx's transports then apply none (the caller's scopes bound it).
        request = httpx.Request("POST", target.url, headers=request_headers(client_headers, target.headers),
                                content=body, extensions={"trace": trace})
        try:
            response = await self.transport.handle_async_request(request)
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            raise failed_before_answer(exc, target.url, connected=connected) from exc
        return _HttpxAnswer(response, target.url)

    async def aclose(self) -> None:
        await self.transport.aclose()


def as_upstream(given: object) -> Upstream:
    """``given`` as the front's Upstream: an httpx transport is wrapped in HttpxUpstream; an
    Upstream (upstream_client's) is used as it is. TypeError for anything else (an httpx
    client, say: the front needs none of a client's layers)."""
    if isinstance(given, httpx.AsyncBaseTransport):
        return HttpxUpstream(given)
    if not isinstance(given, Upstream):  # an httpx.AsyncClient has no open(): refused here
        raise TypeError("the front forwards through an upstream client (make_upstream_client()) or an "
                        f"httpx transport, not {type(given).__name__}")
    return given
