"""Relaying an upstream response body: byte for byte, in as few pieces as it arrives in.

UpstreamBody hooks the upstream connection's CoalescingStream so that whatever one read
brought is handed on just before the connection reads again (one send to the client per
arrival, never one per event of a backlog).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import cast

import httpx

from gridd.gateway.coalescing_stream import CoalescingStream
from gridd.gateway.upstream_errors import broke_mid_body
from gridd.gateway.upstream_request import UpstreamTarget

__all__ = ["RELAY_GATHER_BYTES", "UpstreamBody"]

RELAY_GATHER_BYTES = 64 * 1024
"""Most body bytes UpstreamBody.relay gathers before handing them on, even if more are ready."""


class UpstreamBody:
    """The response body as raw bytes (no decoding: relayed byte for byte)."""

    __slots__ = ("response", "target", "_chunks")

    def __init__(self, response: httpx.Response, target: UpstreamTarget) -> None:
        self.response = response
        self.target = target
        stream = response.stream
        if not isinstance(stream, httpx.AsyncByteStream):
            raise TypeError("an async transport's response has an async body stream")
        # httpx's streams and ours iterate as async generators: closing one closes its connection.
        self._chunks = cast(AsyncGenerator[bytes, None], stream.__aiter__())

    async def relay(self, deliver: Callable[[bytes, bool], Awaitable[None]]) -> None:
        """Hand the body to ``deliver(data, last)`` in as few pieces as it arrives in.

        Everything the upstream connection already holds (what one read of up to 64 KiB
        brought, parsed by h11) goes in one call, made just before the connection reads again:
        a stream that arrives one event at a time is relayed one event at a time, a backlog
        (many events in one read) in one piece, never one send per event. The last call has
        ``last`` true, with whatever remains (maybe b"").
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
        hook = stream if isinstance(stream, CoalescingStream) else None
        if hook is not None:
            hook.before_wait = flush
        try:
            async for chunk in self._chunks:
                if chunk:
                    pending.append(chunk)
                    size += len(chunk)
                    if hook is None or size >= RELAY_GATHER_BYTES:
                        await flush()
        except httpx.TransportError as exc:
            broken: httpx.TransportError | None = exc
        else:
            broken = None
        finally:
            if hook is not None:
                hook.before_wait = None
        if broken is not None:
            await flush()  # what arrived before the break still reaches the client
            raise broke_mid_body(self.target.url, broken) from broken
        await deliver(b"".join(pending), True)

    async def aclose(self) -> None:
        """Close the body; an unfinished one closes its connection (the upstream sees EOF)."""
        try:
            await self._chunks.aclose()
        finally:
            await self.response.aclose()
