"""One channel connection: a WebSocket over mutual TLS carrying gridd.wire frames.

Operators serve the channel (gridd/link/serve.py); peer operators and the operator's own
gateways dial it (gridd/link/dial.py). Every WebSocket message is one binary gridd.wire
frame. This module holds what both sides share: the socket that sends and receives frames,
the workarounds for trio-websocket's reader, and the error mapping.

Callers own timeouts (STYLE 3): nothing here takes a timeout; the only bound applied
inside is the bounded, shielded close.

Errors are mapped here, at the layer edge (STYLE 4): every failure a caller sees is a
``ChannelError`` whose ``reason`` is one of CHANNEL_ERROR_REASONS, a metric label.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar

import trio
import trio_websocket

from gridd.errors import GriddError
from gridd.tls import PeerIdentity, peer_auth_error
from gridd.wire import MAX_FRAME_BYTES, Message, WireDecodeError, WireEncodeError, decode, encode

__all__ = [
    "CHANNEL_ERROR_REASONS",
    "CLOSE_BOUND_S",
    "WS_MAX_MESSAGE_BYTES",
    "ChannelError",
    "ChannelSession",
    "ChannelSocket",
    "ReaderHost",
    "TransportWatch",
    "closed_error",
    "one_error",
    "tls_failure",
    "unless_reader_ends",
]

T = TypeVar("T")

# The bounded label set of ChannelError.reason:
#   timeout   the caller's budget ran out (set by callers that own the budget)
#   connect   TCP connect failed, or the connection was lost or closed mid-exchange
#   tls       the TLS handshake failed (untrusted, expired, or refused certificate)
#   identity  the server's verified certificate names someone other than expected
#   protocol  an unexpected reply, another protocol major version, an unusable URL
#   decode    a frame that is not a wire message (malformed, unknown tag, oversize)
#   refused   the peer answered Error (forbidden, identity ...) or rejected the upgrade
CHANNEL_ERROR_REASONS: Final = ("timeout", "connect", "tls", "identity", "protocol", "decode", "refused")


# trio-websocket closes a connection (code 1009) on a message larger than its
# max_message_size, whose default is 1 MiB. One byte over the wire limit lets a frame of
# exactly MAX_FRAME_BYTES + 1 reach gridd.wire.decode, which refuses it by name; anything
# larger ends in 1009, mapped to "decode" as well.
WS_MAX_MESSAGE_BYTES: Final = MAX_FRAME_BYTES + 1

# A WebSocket close is a two-way handshake; a peer that never answers it must not hold
# the closing task longer than this.
CLOSE_BOUND_S: Final = 1.0


class ChannelError(GriddError):
    """A channel failure. ``reason`` is one of CHANNEL_ERROR_REASONS.

    peer_reason: the ``Error.reason`` the peer sent, when it refused (for logs).
    """

    reason = "connect"

    def __init__(self, message: str, *, reason: str, peer_reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.peer_reason = peer_reason


# --- plumbing shared by both sides ---------------------------------------------------


def _lone(exc: BaseException) -> BaseException | None:
    """The single leaf of a chain of one-member exception groups, else None."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


@contextmanager
def one_error() -> Iterator[None]:
    """Let the one error of a nursery that exists only for background readers reach the
    caller as itself (a ChannelError, or the caller's own exception from the body of one
    of the context managers here), not wrapped in an ExceptionGroup. Several errors at
    once stay grouped."""
    try:
        yield
    except BaseExceptionGroup as group:
        lone = _lone(group)
        if lone is None:
            raise
        raise lone from None


class TransportWatch(trio.abc.Stream):
    """The TLS stream as trio-websocket sees it, remembering the first transport failure.

    trio-websocket swallows a broken stream (it records an abnormal closure), which would
    lose the ssl.SSLError that says *why*: under TLS 1.3 a server that refuses the client
    certificate says so only after the client's handshake returned, during the first read.
    """

    def __init__(self, stream: trio.SSLStream[Any]) -> None:
        self.stream = stream
        self.failure: BaseException | None = None

    def _note(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.stream.send_all(data)
        except trio.BrokenResourceError as exc:
            self._note(exc)
            raise

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            return await self.stream.receive_some(max_bytes)
        except trio.BrokenResourceError as exc:
            self._note(exc)
            raise

    async def aclose(self) -> None:
        await self.stream.aclose()


class ReaderHost:
    """Stands in for the nursery trio-websocket's ``wrap_*_stream`` start their reader in.

    Two library behaviours make this necessary: a reader that ends during the opening
    handshake (peer gone, TLS alert) leaves ``wrap_*_stream`` waiting forever, and an
    HTTP rejection is raised *inside* the reader task, which would crash the nursery.
    Here the reader's end is an event the handshake races against, and its exception is
    kept for the error mapping instead of propagating.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.ended = trio.Event()
        self.error: Exception | None = None

    def start_soon(self, async_fn: Callable[..., Awaitable[object]], *args: object,
                   name: object = None) -> None:
        self._nursery.start_soon(self._run, async_fn, args, name=name or "ws-reader")

    async def _run(self, async_fn: Callable[..., Awaitable[object]], args: tuple[object, ...]) -> None:
        try:
            await async_fn(*args)
        except Exception as exc:
            self.error = exc
        finally:
            self.ended.set()


async def unless_reader_ends(host: ReaderHost, handshake: Callable[[], Awaitable[T]]) -> T | None:
    """Run a WebSocket handshake step; None if the reader ended (connection gone) first."""
    result: T | None = None

    async def step() -> None:
        nonlocal result
        result = await handshake()
        race.cancel_scope.cancel()

    async def watch() -> None:
        await host.ended.wait()
        race.cancel_scope.cancel()

    with one_error():
        async with trio.open_nursery() as race:
            race.start_soon(step)
            race.start_soon(watch)
    return result


def tls_failure(where: str, exc: BaseException | None) -> ChannelError | None:
    """A ChannelError("tls") when an ssl.SSLError is behind ``exc``, else None."""
    if exc is None:
        return None
    auth = peer_auth_error(exc)
    if auth is None:
        return None
    return ChannelError(f"{where}: TLS failed ({auth.reason}): {auth}", reason="tls")


def closed_error(where: str, close: trio_websocket.CloseReason | None, watch: TransportWatch) -> ChannelError:
    if close is not None and close.code == 1009:
        return ChannelError(f"{where}: frame over the {MAX_FRAME_BYTES}-byte limit (close 1009)",
                            reason="decode")
    tls = tls_failure(where, watch.failure)
    if tls is not None:
        return tls
    if close is None or close.code == 1006:
        how = "lost"
    else:
        how = f"closed (code {close.code} {close.reason or ''})"
    return ChannelError(f"{where}: connection {how.rstrip()}", reason="connect")


class ChannelSocket:
    """One open WebSocket carrying wire frames; the shared half of session and connection."""

    def __init__(
        self,
        ws: trio_websocket.WebSocketConnection,
        watch: TransportWatch,
        identity: PeerIdentity,
        where: str,
    ) -> None:
        self._ws = ws
        self._watch = watch
        self.identity = identity
        self.where = where
        self.last_received_at = trio.current_time()

    @property
    def closed(self) -> bool:
        return self._ws.closed is not None

    async def send(self, msg: Message) -> None:
        try:
            frame = encode(msg)
        except WireEncodeError as exc:
            raise ChannelError(f"{self.where}: {exc}", reason="protocol") from exc
        await self.send_frame(frame)

    async def send_frame(self, frame: bytes) -> None:
        """A message the caller already encoded (gridd.wire.encode)."""
        try:
            await self._ws.send_message(frame)
        except trio_websocket.ConnectionClosed as exc:
            raise closed_error(self.where, exc.reason, self._watch) from None

    async def receive(self) -> Message:
        """The next message. ChannelError("decode") for a frame that does not decode,
        ChannelError("connect"/"tls") once the connection is closed or lost."""
        try:
            frame = await self._ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise closed_error(self.where, exc.reason, self._watch) from None
        self.last_received_at = trio.current_time()
        if isinstance(frame, str):  # a WebSocket text message: never a wire frame
            raise ChannelError(f"{self.where}: undecodable frame: frame is str, not bytes", reason="decode")
        try:
            return decode(frame)
        except WireDecodeError as exc:
            raise ChannelError(f"{self.where}: undecodable frame: {exc}", reason="decode") from exc

    async def aclose(self) -> None:
        """Close: with the WebSocket close handshake (bounded) when we can, else abruptly."""
        if trio.current_effective_deadline() != -math.inf:
            with trio.move_on_after(CLOSE_BOUND_S):
                await self._ws.aclose()
        # Cancelled (shutdown, a poller being replaced, an expired exchange budget): the
        # reader that would read the peer's close reply may be cancelled as well, and the
        # caller's time is up, so the transport is shut without ceremony. After a close
        # handshake the transport is shut already and this is a no-op.
        await trio.aclose_forcefully(self._watch)



class ChannelSession(ChannelSocket):
    """The server's side of one accepted connection, handed to the handler.

    identity: the client's verified identity (the handler authorizes it).
    remote: "host:port" of the client, for logs.
    """

    def __init__(self, ws: trio_websocket.WebSocketConnection, watch: TransportWatch,
                 identity: PeerIdentity, remote: str) -> None:
        super().__init__(ws, watch, identity, f"{identity.uri} from {remote}")
        self.remote = remote
