"""The network layer under the gateway's upstream transport: trio streams for httpcore that
send a whole request in one write (docs/front.md, "Performance").

httpcore writes a request as head, body and end-of-message separately; CoalescingStream holds
writes until the next read, so the request goes out in one send() and wakes the upstream
once instead of twice. CoalescingTrioBackend opens such streams. Neither applies httpcore's
``timeout`` arguments: the front's trio scopes bound the exchange (STYLE 3).
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpcore
import trio

__all__ = ["CoalescingStream", "CoalescingTrioBackend"]


class CoalescingStream(httpcore.AsyncNetworkStream):
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
            request = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            try:
                await self._stream.send_all(request)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise httpcore.WriteError(repr(exc)) from exc
        if self.before_wait is not None:
            await self.before_wait()
        try:
            data = await self._stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpcore.ReadError(repr(exc)) from exc
        self.last_read_at = trio.current_time()
        # trio's streams type this bytes | bytearray; a socket's and a TLS stream's are bytes,
        # which bytes() returns as they are (no copy).
        return bytes(data)

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
        return CoalescingStream(tls)

    def _socket(self) -> trio.socket.SocketType | None:
        stream = self._stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        # Always a SocketStream under the TLS layers: the backend below opens nothing else.
        return stream.socket if isinstance(stream, trio.SocketStream) else None

    def get_extra_info(self, info: str) -> Any:
        # httpcore asks "is_readable" of an idle pooled connection: readable means the server
        # closed it (or sent junk), so the pool drops it instead of reusing it.
        if info == "is_readable":
            sock = self._socket()
            return sock is not None and sock.is_readable()
        if info == "socket":
            return self._socket()
        return None


class CoalescingTrioBackend(httpcore.AsyncNetworkBackend):
    """Opens CoalescingStream connections; ignores httpcore's ``timeout`` like the stream."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,  # noqa: ASYNC109
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=local_address)
        except OSError as exc:
            raise httpcore.ConnectError(repr(exc)) from exc
        for option in socket_options or ():
            stream.setsockopt(*option)
        return CoalescingStream(stream)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,  # noqa: ASYNC109
                                  socket_options: Iterable[Any] | None = None) -> httpcore.AsyncNetworkStream:
        try:
            stream = await trio.open_unix_socket(path)
        except OSError as exc:
            raise httpcore.ConnectError(repr(exc)) from exc
        return CoalescingStream(stream)

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)
