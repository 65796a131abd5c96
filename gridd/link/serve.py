"""The serving side of the channel: accept, authenticate, upgrade, hand over, close.

Per connection (``ChannelServer.serve_stream``; ``serve_channel`` runs it for every TCP
connection accepted on a listen address):

    TLS handshake (client certificate from the grid CA required)
        -> verified spiffe identity read from the client certificate
        -> WebSocket handshake -> handler(ChannelSession) -> close

The TLS and WebSocket handshakes are each bounded by ``ChannelLimits.handshake_s``; a
connection that receives no message for ``ChannelLimits.idle_s`` is closed. A connection
refused before the handler runs is reported to ``on_refused(reason)`` with one of
SERVER_REFUSAL_REASONS.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import msgspec
import trio
import trio_websocket

from gridd.link.session import (
    WS_MAX_MESSAGE_BYTES,
    ChannelError,
    ChannelSession,
    ReaderHost,
    TransportWatch,
    unless_reader_ends,
)
from gridd.tls import IdentityError, peer_auth_error, peer_identity

__all__ = [
    "REFUSAL_LOG_EVERY_S",
    "SERVER_REFUSAL_REASONS",
    "ChannelLimits",
    "ChannelServer",
    "serve_channel",
    "split_bind",
]

log = logging.getLogger("gridd.link.serve")

# Reasons the server reports to on_refused, before any handler runs.
#   tls        TLS handshake failed (no, untrusted or expired client certificate)
#   handshake  the TLS or WebSocket handshake did not finish within handshake_s, or the
#              WebSocket upgrade was malformed
#   identity   the verified certificate carries no valid spiffe identity
SERVER_REFUSAL_REASONS: Final = ("tls", "handshake", "identity")

REFUSAL_LOG_EVERY_S: Final = 10.0
"""Connections refused before a session exists (TLS, handshake, identity) are logged at most
once per this long per listener, with counts since the last line: anyone who can reach the
port can fail a handshake, and must not be able to flood the log (docs/security.md)."""

Handler = Callable[[ChannelSession], Awaitable[None]]


class ChannelLimits(msgspec.Struct, frozen=True):
    """The server's per-connection policy (docs/signals-channel.md).

    handshake_s: bound on the TLS handshake, and separately on the WebSocket handshake.
    idle_s: a connection that receives no message for this long is closed. The operator
        sets it to 3x the longest poll interval it knows (peer and gateway).
    """

    handshake_s: float = 5.0
    idle_s: float = 15.0


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


class ChannelServer:
    """Serves the channel on streams handed to it (one listener's worth of state).

    ssl_context_getter: read for every new connection, so a committed reload's
        certificates apply to new connections while open ones keep theirs.
    handler: runs once per authenticated connection; the connection closes when it
        returns. It authorizes ``session.identity`` itself.
    limits: read for every new connection (so a reload's poll intervals apply).
    on_refused: called with one of SERVER_REFUSAL_REASONS per connection refused here.
    """

    def __init__(
        self,
        ssl_context_getter: Callable[[], ssl.SSLContext],
        handler: Handler,
        *,
        limits: Callable[[], ChannelLimits] = ChannelLimits,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.ssl_context_getter = ssl_context_getter
        self.handler = handler
        self.limits = limits
        self.on_refused = on_refused
        self._refusal_log = _RefusalLog()

    def _refused(self, remote: str, reason: str, detail: str) -> None:
        self._refusal_log.note(remote, reason, detail)
        if self.on_refused is not None:
            self.on_refused(reason)

    async def serve_stream(self, stream: trio.abc.Stream, remote: str) -> None:
        """Serve one accepted transport stream (TCP, or a memory stream in tests); it is
        closed on return."""
        try:
            await self._serve(stream, remote, self.limits())
        except Exception:
            # One connection's bug must not take the listener (and every other peer) down.
            log.exception("signals connection from %s failed unexpectedly", remote)
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve(self, stream: trio.abc.Stream, remote: str, limits: ChannelLimits) -> None:
        def refuse(reason: str, detail: str) -> None:
            self._refused(remote, reason, detail)

        tls = trio.SSLStream(stream, self.ssl_context_getter(), server_side=True, https_compatible=True)
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

        watch = TransportWatch(tls)
        async with trio.open_nursery() as connection:
            host = ReaderHost(connection)
            ws: trio_websocket.WebSocketConnection | None = None
            with trio.move_on_after(limits.handshake_s):
                # ReaderHost stands in for the nursery (its docstring says why); trio-websocket
                # only calls start_soon on it.
                wrap = partial(trio_websocket.wrap_server_stream,
                               host,  # type: ignore[arg-type]  # ReaderHost: a nursery's start_soon
                               watch, max_message_size=WS_MAX_MESSAGE_BYTES)
                request = await unless_reader_ends(host, wrap)
                if request is not None:
                    ws = await request.accept()
            if ws is None:
                if host.ended.is_set():
                    refuse("handshake", f"{identity.uri} closed the connection before a WebSocket upgrade")
                else:
                    refuse("handshake",
                           f"no WebSocket upgrade from {identity.uri} within {limits.handshake_s:g} s")
                connection.cancel_scope.cancel()
                return
            session = ChannelSession(ws, watch, identity, remote)
            # The idle bound cancels the handler only: the reader keeps running, so the close
            # handshake below can complete.
            handler_scope = trio.CancelScope()
            connection.start_soon(_close_when_idle, session, limits.idle_s, handler_scope)
            try:
                with handler_scope:
                    await self.handler(session)
            finally:
                await session.aclose()
                connection.cancel_scope.cancel()


async def _close_when_idle(session: ChannelSession, idle_s: float, scope: trio.CancelScope) -> None:
    # Re-armed from the last received message: a connection is idle when the *client*
    # has said nothing for idle_s (our own replies do not keep it open).
    while True:
        deadline = session.last_received_at + idle_s
        if trio.current_time() >= deadline:
            log.debug("signals connection %s idle for %g s: closing", session.where, idle_s)
            scope.cancel()
            return
        await trio.sleep_until(deadline)


async def serve_channel(
    bind: str,
    ssl_context_getter: Callable[[], ssl.SSLContext],
    handler: Handler,
    *,
    limits: Callable[[], ChannelLimits] = ChannelLimits,
    on_refused: Callable[[str], None] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the channel on TCP ``bind`` until cancelled (see ChannelServer for the rest).

    task_status.started() gets the bound "host:port" (port 0 picks a free one).
    """
    host, port = split_bind(bind)
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ChannelError(f"cannot listen for the signals channel on {bind}: {exc}",
                           reason="connect") from exc
    bound = _format_address(listeners[0].socket.getsockname())
    server = ChannelServer(ssl_context_getter, handler, limits=limits, on_refused=on_refused)

    async def serve_connection(stream: trio.SocketStream) -> None:
        await server.serve_stream(stream, _remote_of(stream))

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, serve_connection, listeners)
        task_status.started(bound)
