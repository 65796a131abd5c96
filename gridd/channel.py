"""The signals channel's transport: one persistent WebSocket over mutual TLS.

Operators serve it; peer operators and the operator's own gateways dial it. Every
WebSocket message is one binary gridd.wire frame. docs/signals-channel.md has the whole
lifecycle and the timeout policy; in short:

Server, per connection (``serve_signals``):

    TCP accept -> TLS handshake (client certificate from the grid CA required)
               -> verified spiffe identity read from the client certificate
               -> WebSocket handshake -> handler(SignalsSession) -> close

    The TLS and WebSocket handshakes are each bounded by ``ChannelLimits.handshake_s``;
    a connection that receives no message for ``ChannelLimits.idle_s`` is closed. A
    connection refused before the handler runs is reported to ``on_refused(reason)``
    with one of SERVER_REFUSAL_REASONS.

Client (``open_signals_connection`` for one connection, ``SignalsDialer`` for the
persistent one a poller keeps):

    TCP connect -> TLS handshake (server_hostname=None: the server is authenticated by
                   identity, not host name) -> require the expected identity
                -> WebSocket handshake at the URL's path -> exchanges

Callers own timeouts (STYLE 3): nothing here takes a timeout; wrap ``exchange`` (which
includes any re-dial) in ``trio.move_on_after``. The only bounds applied inside are the
server's own per-connection policy (handshake, idle) and the bounded, shielded close.

Errors are mapped here, at the layer edge (STYLE 4): every failure a caller sees is a
``ChannelError`` whose ``reason`` is one of CHANNEL_ERROR_REASONS, a metric label.
"""

from __future__ import annotations

import logging
import math
import random
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import Any, Final, NamedTuple, TypeVar

import msgspec
import trio
import trio_websocket

from gridd.errors import GriddError
from gridd.tls import IdentityError, PeerIdentity, Role, peer_auth_error, peer_identity, require_identity
from gridd.wire import (
    MAX_FRAME_BYTES,
    Batches,
    Error,
    FeedbackAck,
    FeedbackReport,
    Message,
    Poll,
    ServingConfig,
    WireDecodeError,
    WireEncodeError,
    decode,
    encode,
    protocol_refusal,
)

__all__ = [
    "CHANNEL_ERROR_REASONS",
    "DEFAULT_BACKOFF",
    "SERVER_REFUSAL_REASONS",
    "WS_MAX_MESSAGE_BYTES",
    "Backoff",
    "ChannelError",
    "ChannelLimits",
    "ExpectedPeer",
    "SignalsConnection",
    "SignalsDialer",
    "SignalsSession",
    "open_signals_connection",
    "open_signals_dialer",
    "parse_signals_url",
    "serve_signals",
    "split_bind",
]

log = logging.getLogger("gridd.channel")

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

# Reasons serve_signals reports to on_refused, before any handler runs.
#   tls        TLS handshake failed (no, untrusted or expired client certificate)
#   handshake  the TLS or WebSocket handshake did not finish within handshake_s, or the
#              WebSocket upgrade was malformed
#   identity   the verified certificate carries no valid spiffe identity
SERVER_REFUSAL_REASONS: Final = ("tls", "handshake", "identity")

# trio-websocket closes a connection (code 1009) on a message larger than its
# max_message_size, whose default is 1 MiB. One byte over the wire limit lets a frame of
# exactly MAX_FRAME_BYTES + 1 reach gridd.wire.decode, which refuses it by name; anything
# larger ends in 1009, mapped to "decode" as well.
WS_MAX_MESSAGE_BYTES: Final = MAX_FRAME_BYTES + 1

# A WebSocket close is a two-way handshake; a peer that never answers it must not hold
# the closing task longer than this.
CLOSE_BOUND_S: Final = 1.0


class ChannelError(GriddError):
    """A signals-channel failure. ``reason`` is one of CHANNEL_ERROR_REASONS.

    peer_reason: the ``Error.reason`` the peer sent, when it refused (for logs).
    """

    reason = "connect"

    def __init__(self, message: str, *, reason: str, peer_reason: str | None = None) -> None:
        super().__init__(message, reason=reason)
        self.peer_reason = peer_reason


class ExpectedPeer(NamedTuple):
    """Who the client requires the server to be (its verified certificate's identity)."""

    trust_domain: str
    site: str
    role: Role


class ChannelLimits(msgspec.Struct, frozen=True):
    """The server's per-connection policy (docs/signals-channel.md).

    handshake_s: bound on the TLS handshake, and separately on the WebSocket handshake.
    idle_s: a connection that receives no message for this long is closed. The operator
        sets it to 3x the longest poll interval it knows (peer and gateway).
    """

    handshake_s: float = 5.0
    idle_s: float = 15.0


class Backoff(msgspec.Struct, frozen=True):
    """Re-dial delays: full jitter over an exponential ceiling (base doubling to cap)."""

    base_s: float = 0.2
    cap_s: float = 10.0

    def delay(self, failures: int, rng: random.Random) -> float:
        """The wait before the next dial after ``failures`` consecutive failures (>= 1)."""
        # Capped exponent: 2**60 is far past any cap and keeps the float finite.
        ceiling = min(self.cap_s, self.base_s * 2.0 ** min(max(failures - 1, 0), 60))
        return rng.uniform(0.0, ceiling)


DEFAULT_BACKOFF: Final = Backoff()


# --- plumbing shared by both sides ---------------------------------------------------


def _lone(exc: BaseException) -> BaseException | None:
    """The single leaf of a chain of one-member exception groups, else None."""
    while isinstance(exc, BaseExceptionGroup):
        if len(exc.exceptions) != 1:
            return None
        exc = exc.exceptions[0]
    return exc


@contextmanager
def _one_error() -> Iterator[None]:
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


class _TransportWatch(trio.abc.Stream):
    """The TLS stream as trio-websocket sees it, remembering the first transport failure.

    trio-websocket swallows a broken stream (it records an abnormal closure), which would
    lose the ssl.SSLError that says *why*: under TLS 1.3 a server that refuses the client
    certificate says so only after the client's handshake returned, during the first read.
    """

    def __init__(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
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


class _ReaderHost:
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

    def start_soon(self, async_fn: Callable[..., Awaitable[object]], *args: object, name: object = None) -> None:
        self._nursery.start_soon(self._run, async_fn, args, name=name or "ws-reader")

    async def _run(self, async_fn: Callable[..., Awaitable[object]], args: tuple[object, ...]) -> None:
        try:
            await async_fn(*args)
        except Exception as exc:
            self.error = exc
        finally:
            self.ended.set()


async def _unless_reader_ends(host: _ReaderHost, handshake: Callable[[], Awaitable[T]]) -> T | None:
    """Run a WebSocket handshake step; None if the reader ended (connection gone) first."""
    result: T | None = None

    async def step() -> None:
        nonlocal result
        result = await handshake()
        race.cancel_scope.cancel()

    async def watch() -> None:
        await host.ended.wait()
        race.cancel_scope.cancel()

    with _one_error():
        async with trio.open_nursery() as race:
            race.start_soon(step)
            race.start_soon(watch)
    return result


def _tls_failure(where: str, exc: BaseException | None) -> ChannelError | None:
    """A ChannelError("tls") when an ssl.SSLError is behind ``exc``, else None."""
    if exc is None:
        return None
    auth = peer_auth_error(exc)
    if auth is None:
        return None
    return ChannelError(f"{where}: TLS failed ({auth.reason}): {auth}", reason="tls")


def _closed_error(where: str, close: trio_websocket.CloseReason | None, watch: _TransportWatch) -> ChannelError:
    if close is not None and close.code == 1009:
        return ChannelError(f"{where}: frame over the {MAX_FRAME_BYTES}-byte limit (close 1009)", reason="decode")
    tls = _tls_failure(where, watch.failure)
    if tls is not None:
        return tls
    how = "lost" if close is None or close.code == 1006 else f"closed (code {close.code} {close.reason or ''})"
    return ChannelError(f"{where}: connection {how.rstrip()}", reason="connect")


class _Socket:
    """One open WebSocket carrying wire frames; the shared half of session and connection."""

    def __init__(
        self, ws: trio_websocket.WebSocketConnection, watch: _TransportWatch, identity: PeerIdentity, where: str
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
            raise _closed_error(self.where, exc.reason, self._watch) from None

    async def receive(self) -> Message:
        """The next message. ChannelError("decode") for a frame that does not decode,
        ChannelError("connect"/"tls") once the connection is closed or lost."""
        try:
            frame = await self._ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise _closed_error(self.where, exc.reason, self._watch) from None
        self.last_received_at = trio.current_time()
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


# --- server -------------------------------------------------------------------------


class SignalsSession(_Socket):
    """The server's side of one accepted connection, handed to the handler.

    identity: the client's verified identity (the handler authorizes it).
    remote: "host:port" of the client, for logs.
    """

    def __init__(self, ws: trio_websocket.WebSocketConnection, watch: _TransportWatch,
                 identity: PeerIdentity, remote: str) -> None:
        super().__init__(ws, watch, identity, f"{identity.uri} from {remote}")
        self.remote = remote


def split_bind(bind: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port)."""
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ChannelError(f"signals listen address {bind!r} is not host:port", reason="connect")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ChannelError(f"signals listen address {bind!r} has no host", reason="connect")
    return host, int(port)


def _format_address(sockname: Any) -> str:
    host, port = sockname[0], sockname[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _remote_of(stream: trio.SocketStream) -> str:
    try:
        return _format_address(stream.socket.getpeername())
    except OSError:
        return "?"


REFUSAL_LOG_EVERY_S: Final = 10.0
"""Connections refused before a session exists (TLS, handshake, identity) are logged at most
once per this long per listener, with counts since the last line: anyone who can reach the
port can fail a handshake, and must not be able to flood the log (docs/security.md)."""


class _RefusalLog:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.logged_at = -math.inf

    def note(self, remote: str, reason: str, detail: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = trio.current_time()
        if now - self.logged_at < REFUSAL_LOG_EVERY_S:
            return
        self.logged_at = now
        counts = ", ".join(f"{n} {r}" for r, n in sorted(self.counts.items()))
        log.info("signals connections refused (%s in the last %g s at most); latest from %s (%s): %s",
                 counts, REFUSAL_LOG_EVERY_S, remote, reason, detail)
        self.counts = {}


async def serve_signals(
    bind: str,
    ssl_context_getter: Callable[[], ssl.SSLContext],
    handler: Callable[[SignalsSession], Awaitable[None]],
    *,
    limits: Callable[[], ChannelLimits] = ChannelLimits,
    on_refused: Callable[[str], None] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the signals channel on ``bind`` until cancelled.

    ssl_context_getter: read for every new connection, so a committed reload's
        certificates apply to new connections while open ones keep theirs.
    handler: runs once per authenticated connection; the connection closes when it
        returns. It authorizes ``session.identity`` itself.
    limits: read for every new connection (so a reload's poll intervals apply).
    on_refused: called with one of SERVER_REFUSAL_REASONS per connection refused here.
    task_status.started() gets the bound "host:port" (port 0 picks a free one).
    """
    host, port = split_bind(bind)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ChannelError(f"cannot listen for the signals channel on {bind}: {exc}", reason="connect") from exc
    bound = _format_address(listeners[0].socket.getsockname())
    count_refused = on_refused or (lambda reason: None)
    refusal_log = _RefusalLog()

    def refused(remote: str, reason: str, detail: str) -> None:
        refusal_log.note(remote, reason, detail)
        count_refused(reason)

    async def serve_connection(stream: trio.SocketStream) -> None:
        remote = _remote_of(stream)
        try:
            await _serve_connection(stream, remote, ssl_context_getter, handler, limits(), refused)
        except Exception:
            # One connection's bug must not take the listener (and every other peer) down.
            log.exception("signals connection from %s failed unexpectedly", remote)
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, serve_connection, listeners)
        task_status.started(bound)


async def _serve_connection(
    stream: trio.SocketStream,
    remote: str,
    ssl_context_getter: Callable[[], ssl.SSLContext],
    handler: Callable[[SignalsSession], Awaitable[None]],
    limits: ChannelLimits,
    refused: Callable[[str, str, str], None],
) -> None:
    def refuse(reason: str, detail: str) -> None:
        refused(remote, reason, detail)

    tls = trio.SSLStream(stream, ssl_context_getter(), server_side=True, https_compatible=True)
    with trio.move_on_after(limits.handshake_s) as handshake:
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            auth = peer_auth_error(exc)
            if auth is None:
                refuse("handshake", f"connection lost during the TLS handshake: {exc}")
            else:
                refuse("tls", f"{auth.reason}: {auth}")
            return
    if handshake.cancelled_caught:
        refuse("handshake", f"TLS handshake not finished within {limits.handshake_s:g} s")
        return
    try:
        identity = peer_identity(tls)
    except IdentityError as exc:
        refuse("identity", str(exc))
        return

    watch = _TransportWatch(tls)
    async with trio.open_nursery() as connection:
        host = _ReaderHost(connection)
        ws: trio_websocket.WebSocketConnection | None = None
        with trio.move_on_after(limits.handshake_s):
            request = await _unless_reader_ends(
                host,
                partial(trio_websocket.wrap_server_stream, host, watch, max_message_size=WS_MAX_MESSAGE_BYTES),
            )
            if request is not None:
                ws = await request.accept()
        if ws is None:
            if host.ended.is_set():
                refuse("handshake", f"{identity.uri} closed the connection before a WebSocket upgrade")
            else:
                refuse("handshake", f"no WebSocket upgrade from {identity.uri} within {limits.handshake_s:g} s")
            connection.cancel_scope.cancel()
            return
        session = SignalsSession(ws, watch, identity, remote)
        # The idle bound cancels the handler only: the reader keeps running, so the close
        # handshake below can complete.
        handler_scope = trio.CancelScope()
        connection.start_soon(_close_when_idle, session, limits.idle_s, handler_scope)
        try:
            with handler_scope:
                await handler(session)
        finally:
            await session.aclose()
            connection.cancel_scope.cancel()


async def _close_when_idle(session: SignalsSession, idle_s: float, scope: trio.CancelScope) -> None:
    # Re-armed from the last received message: a connection is idle when the *client*
    # has said nothing for idle_s (our own replies do not keep it open).
    while True:
        deadline = session.last_received_at + idle_s
        if trio.current_time() >= deadline:
            log.debug("signals connection %s idle for %g s: closing", session.where, idle_s)
            scope.cancel()
            return
        await trio.sleep_until(deadline)


# --- client -------------------------------------------------------------------------

# What ends an exchange, per request kind; and what may come before it (a gateway's
# Poll is answered with a ServingConfig first whenever the config changed).
_TERMINAL: Final[dict[type, type]] = {Poll: Batches, FeedbackReport: FeedbackAck}
_PRELUDE: Final[dict[type, tuple[type, ...]]] = {Poll: (ServingConfig,), FeedbackReport: ()}


class _Target(NamedTuple):
    host: str
    port: int
    host_header: str
    resource: str


def parse_signals_url(url: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or 443
    except ValueError as exc:
        raise ChannelError(f"{url}: not a usable signals URL: {exc}", reason="protocol") from exc
    if parts.scheme not in ("wss", "https") or not parts.hostname:
        raise ChannelError(f"{url}: the signals channel needs a wss://host:port/path URL", reason="protocol")
    resource = parts.path or "/"
    if parts.query:
        resource += f"?{parts.query}"
    return _Target(parts.hostname, port, parts.netloc, resource)


class SignalsConnection(_Socket):
    """One client connection to an operator. ``identity`` is the server's, as verified."""

    async def exchange(self, msg: Poll | FeedbackReport) -> list[Message]:
        """Send one request and read replies up to its terminal one.

        Poll -> [ServingConfig?, Batches]; FeedbackReport -> [FeedbackAck]. An Error
        reply raises ChannelError("refused", or "protocol" for a version refusal); any
        other reply, or a reply in another protocol major version, ChannelError("protocol").
        """
        terminal, prelude = _TERMINAL[type(msg)], _PRELUDE[type(msg)]
        await self.send(msg)
        replies: list[Message] = []
        while True:
            reply = await self.receive()
            if isinstance(reply, Error):
                reason = "protocol" if reply.reason == "protocol" else "refused"
                raise ChannelError(f"{self.where}: refused ({reply.reason}): {reply.detail}",
                                   reason=reason, peer_reason=reply.reason)
            if isinstance(reply, terminal):
                if isinstance(reply, Batches) and (refusal := protocol_refusal(reply.protocol)) is not None:
                    raise ChannelError(f"{self.where}: {refusal.detail}", reason="protocol")
                replies.append(reply)
                return replies
            if not isinstance(reply, prelude) or len(replies) >= len(prelude):
                raise ChannelError(
                    f"{self.where}: unexpected {type(reply).__name__} answering {type(msg).__name__}",
                    reason="protocol",
                )
            replies.append(reply)


async def _connect(
    nursery: trio.Nursery, url: str, ssl_context: ssl.SSLContext, expected: ExpectedPeer
) -> SignalsConnection:
    """Dial one connection whose WebSocket reader runs in ``nursery``."""
    target = parse_signals_url(url)
    try:
        tcp = await trio.open_tcp_stream(target.host, target.port)
    except OSError as exc:
        raise ChannelError(f"{url}: cannot connect: {exc}", reason="connect") from exc
    tls = trio.SSLStream(tcp, ssl_context, server_hostname=None, https_compatible=True)
    watch = _TransportWatch(tls)
    try:
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            raise (_tls_failure(url, exc) or ChannelError(f"{url}: connection lost during the TLS handshake",
                                                          reason="connect")) from exc
        try:
            identity = require_identity(peer_identity(tls), trust_domain=expected.trust_domain,
                                        site=expected.site, role=expected.role)
        except IdentityError as exc:
            raise ChannelError(f"{url}: {exc}", reason="identity") from exc
        host = _ReaderHost(nursery)
        ws = await _unless_reader_ends(
            host,
            partial(trio_websocket.wrap_client_stream, host, watch, target.host_header, target.resource,
                    max_message_size=WS_MAX_MESSAGE_BYTES),
        )
        if ws is None:
            if isinstance(host.error, trio_websocket.ConnectionRejected):
                raise ChannelError(f"{url}: WebSocket upgrade rejected with HTTP {host.error.status_code}",
                                   reason="refused")
            raise (_tls_failure(url, watch.failure)
                   or ChannelError(f"{url}: connection closed during the WebSocket handshake", reason="connect"))
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    return SignalsConnection(ws, watch, identity, f"{identity.uri} at {url}")


@asynccontextmanager
async def open_signals_connection(
    url: str, ssl_context: ssl.SSLContext, expected: ExpectedPeer
) -> AsyncIterator[SignalsConnection]:
    """One connection, closed on exit. Bound it with the caller's own timeout."""
    with _one_error():
        async with trio.open_nursery() as nursery:
            conn = await _connect(nursery, url, ssl_context, expected)
            try:
                yield conn
            finally:
                await conn.aclose()
                nursery.cancel_scope.cancel()


class SignalsDialer:
    """A persistent connection to one operator, re-dialed when broken.

    Use through ``open_signals_dialer``. ``exchange`` is serialized (one request on the
    wire at a time), dials when there is no live connection, and re-dials once at once
    when a connection that served before turns out dead (the server restarted or closed
    it as idle). After a failure, dials wait out a jittered exponential backoff; a wait
    that would outlast the caller's deadline fails fast with the last failure's reason,
    so the budget is never spent sleeping.

    Status for gridctl: ``connections_opened``, ``identity`` (of the last server dialed),
    ``last_error``.
    """

    def __init__(
        self,
        nursery: trio.Nursery,
        url: str,
        ssl_context: ssl.SSLContext,
        expected: ExpectedPeer,
        *,
        rng: random.Random | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.url = url
        self.ssl_context = ssl_context
        self.expected = expected
        self.backoff = backoff
        self._nursery = nursery
        self._rng = rng if rng is not None else random.Random()
        self._conn: SignalsConnection | None = None
        self._lock = trio.StrictFIFOLock()
        self._failures = 0
        self._next_dial_at = -math.inf
        self.last_error: ChannelError | None = None
        self.identity: PeerIdentity | None = None
        self.connections_opened = 0

    async def exchange(self, msg: Poll | FeedbackReport) -> list[Message]:
        """One request, its replies (see SignalsConnection.exchange); raises ChannelError."""
        async with self._lock:
            retried = False
            while True:
                conn = self._conn
                fresh = conn is None or conn.closed
                if conn is None or fresh:
                    await self._drop()
                    conn = self._conn = await self._dial()
                try:
                    replies = await conn.exchange(msg)
                except ChannelError as exc:
                    await self._drop()
                    if not fresh and not retried and exc.reason == "connect":
                        retried = True  # a kept connection died while idle: re-dial now
                        continue
                    self._note_failure(exc)
                    raise
                except BaseException:
                    # Cancelled mid-exchange (the caller's budget): a late reply would be
                    # read as the next exchange's, so this connection is finished.
                    await self._drop()
                    raise
                self._failures = 0
                self.last_error = None
                return replies

    async def _dial(self) -> SignalsConnection:
        if trio.current_time() < self._next_dial_at:
            if self._next_dial_at >= trio.current_effective_deadline():
                last = self.last_error
                raise ChannelError(
                    f"{self.url}: backing off for {self._next_dial_at - trio.current_time():.2f} s "
                    f"after: {last}", reason=last.reason if last is not None else "connect")
            await trio.sleep_until(self._next_dial_at)
        try:
            conn = await _connect(self._nursery, self.url, self.ssl_context, self.expected)
        except ChannelError as exc:
            self._note_failure(exc)
            raise
        self.connections_opened += 1
        self.identity = conn.identity
        return conn

    def _note_failure(self, exc: ChannelError) -> None:
        self._failures += 1
        self.last_error = exc
        self._next_dial_at = trio.current_time() + self.backoff.delay(self._failures, self._rng)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.aclose()

    async def aclose(self) -> None:
        await self._drop()


@asynccontextmanager
async def open_signals_dialer(
    url: str,
    ssl_context: ssl.SSLContext,
    expected: ExpectedPeer,
    *,
    rng: random.Random | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> AsyncIterator[SignalsDialer]:
    """A SignalsDialer whose connections live (and are closed) within this context."""
    with _one_error():
        async with trio.open_nursery() as nursery:
            dialer = SignalsDialer(nursery, url, ssl_context, expected, rng=rng, backoff=backoff)
            try:
                yield dialer
            finally:
                await dialer.aclose()
                nursery.cancel_scope.cancel()
