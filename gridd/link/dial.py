"""The dialing side of the channel: one connection, or a persistent dialer that re-dials.

    transport (a stream factory: TCP connect by default, a trio memory stream in tests)
        -> TLS handshake (server_hostname=None: the server is authenticated by identity,
           not host name) -> require the expected identity
        -> WebSocket handshake at the URL's path -> exchanges

Callers own timeouts (STYLE 3): nothing here takes a timeout; wrap ``exchange`` (which
includes any re-dial) in ``trio.move_on_after``. Every failure is a ChannelError
(gridd/link/session.py).
"""

from __future__ import annotations

import math
import random
import ssl
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Final, NamedTuple

import msgspec
import trio
import trio_websocket

from gridd.link.session import (
    WS_MAX_MESSAGE_BYTES,
    ChannelError,
    ChannelSocket,
    ReaderHost,
    TransportWatch,
    one_error,
    tls_failure,
    unless_reader_ends,
)
from gridd.tls import IdentityError, PeerIdentity, Role, peer_identity, require_identity
from gridd.wire import (
    Batches,
    Error,
    FeedbackAck,
    FeedbackReport,
    Message,
    Poll,
    ServingConfig,
    protocol_refusal,
)

__all__ = [
    "DEFAULT_BACKOFF",
    "Backoff",
    "ChannelConnection",
    "ChannelDialer",
    "ChannelTarget",
    "ExpectedPeer",
    "OpenStream",
    "open_channel_connection",
    "open_channel_dialer",
    "open_tcp",
    "parse_channel_url",
]

OpenStream = Callable[[str, int], Awaitable[trio.abc.Stream]]
"""A stream factory: (host, port) -> an open transport stream, on which the dialer runs
TLS and the WebSocket. OSError from it is a "connect" failure."""


async def open_tcp(host: str, port: int) -> trio.abc.Stream:
    """The default stream factory: a TCP connection."""
    return await trio.open_tcp_stream(host, port)


class ExpectedPeer(NamedTuple):
    """Who the client requires the server to be (its verified certificate's identity)."""

    trust_domain: str
    site: str
    role: Role



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


# What ends an exchange, per request kind; and what may come before it (a gateway's
# Poll is answered with a ServingConfig first whenever the config changed).
_TERMINAL: Final[dict[type, type]] = {Poll: Batches, FeedbackReport: FeedbackAck}
_PRELUDE: Final[dict[type, tuple[type, ...]]] = {Poll: (ServingConfig,), FeedbackReport: ()}


class ChannelTarget(NamedTuple):
    host: str
    port: int
    host_header: str
    resource: str


def parse_channel_url(url: str) -> ChannelTarget:
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
    return ChannelTarget(parts.hostname, port, parts.netloc, resource)


class ChannelConnection(ChannelSocket):
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
    nursery: trio.Nursery,
    url: str,
    ssl_context: ssl.SSLContext,
    expected: ExpectedPeer,
    open_stream: OpenStream,
) -> ChannelConnection:
    """Dial one connection whose WebSocket reader runs in ``nursery``."""
    target = parse_channel_url(url)
    try:
        transport = await open_stream(target.host, target.port)
    except OSError as exc:
        raise ChannelError(f"{url}: cannot connect: {exc}", reason="connect") from exc
    tls = trio.SSLStream(transport, ssl_context, server_hostname=None, https_compatible=True)
    watch = TransportWatch(tls)
    try:
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError as exc:
            raise (tls_failure(url, exc) or ChannelError(f"{url}: connection lost during the TLS handshake",
                                                          reason="connect")) from exc
        try:
            identity = require_identity(peer_identity(tls), trust_domain=expected.trust_domain,
                                        site=expected.site, role=expected.role)
        except IdentityError as exc:
            raise ChannelError(f"{url}: {exc}", reason="identity") from exc
        host = ReaderHost(nursery)
        # ReaderHost stands in for the nursery and TransportWatch for the TLS stream (their
        # docstrings say why); trio-websocket uses only start_soon and the Stream methods.
        wrap = partial(trio_websocket.wrap_client_stream,
                       host,  # type: ignore[arg-type]  # ReaderHost: a nursery's start_soon
                       watch,  # type: ignore[arg-type]  # TransportWatch: a trio Stream over TLS
                       target.host_header, target.resource, max_message_size=WS_MAX_MESSAGE_BYTES)
        ws = await unless_reader_ends(host, wrap)
        if ws is None:
            if isinstance(host.error, trio_websocket.ConnectionRejected):
                raise ChannelError(f"{url}: WebSocket upgrade rejected with HTTP {host.error.status_code}",
                                   reason="refused")
            raise (tls_failure(url, watch.failure)
                   or ChannelError(f"{url}: connection closed during the WebSocket handshake",
                                   reason="connect"))
    except BaseException:
        await trio.aclose_forcefully(tls)
        raise
    return ChannelConnection(ws, watch, identity, f"{identity.uri} at {url}")


@asynccontextmanager
async def open_channel_connection(
    url: str, ssl_context: ssl.SSLContext, expected: ExpectedPeer, *, open_stream: OpenStream = open_tcp
) -> AsyncIterator[ChannelConnection]:
    """One connection, closed on exit. Bound it with the caller's own timeout."""
    with one_error():
        async with trio.open_nursery() as nursery:
            conn = await _connect(nursery, url, ssl_context, expected, open_stream)
            try:
                yield conn
            finally:
                await conn.aclose()
                nursery.cancel_scope.cancel()


class ChannelDialer:
    """A persistent connection to one operator, re-dialed when broken.

    Use through ``open_channel_dialer``. ``exchange`` is serialized (one request on the
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
        open_stream: OpenStream = open_tcp,
    ) -> None:
        self.url = url
        self.open_stream = open_stream
        self.ssl_context = ssl_context
        self.expected = expected
        self.backoff = backoff
        self._nursery = nursery
        self._rng = rng if rng is not None else random.Random()
        self._conn: ChannelConnection | None = None
        self._lock = trio.StrictFIFOLock()
        self._failures = 0
        self._next_dial_at = -math.inf
        self.last_error: ChannelError | None = None
        self.identity: PeerIdentity | None = None
        self.connections_opened = 0

    async def exchange(self, msg: Poll | FeedbackReport) -> list[Message]:
        """One request, its replies (see ChannelConnection.exchange); raises ChannelError."""
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

    async def _dial(self) -> ChannelConnection:
        if trio.current_time() < self._next_dial_at:
            if self._next_dial_at >= trio.current_effective_deadline():
                last = self.last_error
                raise ChannelError(
                    f"{self.url}: backing off for {self._next_dial_at - trio.current_time():.2f} s "
                    f"after: {last}", reason=last.reason if last is not None else "connect")
            await trio.sleep_until(self._next_dial_at)
        try:
            conn = await _connect(self._nursery, self.url, self.ssl_context, self.expected, self.open_stream)
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
async def open_channel_dialer(
    url: str,
    ssl_context: ssl.SSLContext,
    expected: ExpectedPeer,
    *,
    rng: random.Random | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
    open_stream: OpenStream = open_tcp,
) -> AsyncIterator[ChannelDialer]:
    """A ChannelDialer whose connections live (and are closed) within this context."""
    with one_error():
        async with trio.open_nursery() as nursery:
            dialer = ChannelDialer(nursery, url, ssl_context, expected, rng=rng, backoff=backoff,
                                   open_stream=open_stream)
            try:
                yield dialer
            finally:
                await dialer.aclose()
                nursery.cancel_scope.cancel()
