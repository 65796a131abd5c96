"""The h11 backend (the default): a small HTTP/1.1 server on h11 + trio.

One accept task per listener takes connections in batches; one trio task per connection
runs its request/response cycles, and the app runs inside that task (h11_request), so a
request costs no extra task or queue. It was chosen by measurement (docs/http-serving.md,
benchmarks/http_server.py). Drain: when ``stop_accepting`` is set the listeners close,
in-flight requests finish, idle keep-alive connections close, and serve_h11 returns once no
connection is left.
"""

from __future__ import annotations

import errno
import logging
import socket
from typing import Literal
from urllib.parse import unquote

import h11
import trio

from gridd.http import sockio
from gridd.http.asgi import ASGIApp, only_disconnects, reason_phrase
from gridd.http.h1_request import (
    HEAD_END,
    PlainRequest,
    PlainRequestConnection,
    RequestConnection,
    parse_plain_request,
)
from gridd.http.h11_request import RequestCycle, ServerState
from gridd.http.limits import ServerLimits, declared_length, has_both_framings, head_size
from gridd.http.listeners import Listener, close_listeners, open_listeners

__all__ = ["H11Connection", "serve_h11"]

logger = logging.getLogger("gridd.http")

# After an error response sent while the client may still be uploading (413, 400, an app that
# answered without reading the body), the server half-closes and discards what still arrives for
# at most this long / this many bytes, so the client reads the response instead of a reset.
_LINGER_S = 2.0
_LINGER_MAX_BYTES = 32 * 1024 * 1024
_READ_BYTES = 64 * 1024
# A connection whose reads and writes complete at once passes the scheduler after this many of
# them (trio's stream passes it on every call): no connection holds the event loop for long,
# and a request of the front (one read, one to a dozen writes) rarely pays for a pass.
_IO_CALLS_PER_PASS = 16
# accept() errors that mean "out of descriptors/memory": wait and retry instead of dying.
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
_ACCEPT_RETRY_S = 0.1
# accept() errors about one queued connection only (it was reset before we took it): skip it.
_ACCEPT_GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
# Most connections taken from the listen queue per wake-up of the accept loop.
_ACCEPT_BATCH = 256
# A refused connection gets this long to take its 503 before it is closed.
_REFUSE_SEND_S = 1.0
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                  b"content-length: 24\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
                  b"503 Service Unavailable\n")


class H11Connection:
    """One client connection: a loop of request/response cycles on one h11.Connection."""

    __slots__ = ("stream", "sock", "app", "limits", "state", "conn", "client", "server", "listener",
                 "evicted", "sending", "unyielded")

    def __init__(
        self,
        stream: trio.SocketStream,
        sock: socket.socket,
        app: ASGIApp,
        limits: ServerLimits,
        state: ServerState,
        listener: Listener,
    ) -> None:
        self.stream = stream
        self.sock = sock  # stream's own (non-blocking) socket: receive_bytes and send_all use it
        self.app = app
        self.limits = limits
        self.state = state
        self.conn: RequestConnection = h11.Connection(h11.SERVER,
                                                      max_incomplete_event_size=limits.max_header_bytes)
        self.server = listener.server
        self.listener = listener
        self.evicted = False
        self.sending = False  # a write is waiting for the socket (send_all)
        self.unyielded = 0  # reads and writes done at once since the last scheduler pass
        self.client: tuple[str, int] | None = None
        if stream.socket.family in (socket.AF_INET, socket.AF_INET6):
            try:
                peer = stream.socket.getpeername()
                self.client = (peer[0], peer[1])
            except OSError:
                self.client = None

    async def run(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    return
                outcome = await self._cycle(request)
                if outcome == "linger":
                    await self._linger()
                    return
                if outcome == "close":
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            logger.exception("HTTP connection handler failed")
        finally:
            self.listener.waiting.pop(self, None)
            self.listener.open -= 1
            await self.stream.aclose()

    # The connection's own reads and writes go to the socket itself rather than through
    # trio.SocketStream: bytes already waiting are read, and a write the kernel takes whole is
    # done, without the scheduler pass and the context managers trio's stream adds to every
    # call; a wait passes the scheduler, and so does every _IO_CALLS_PER_PASS-th call done at
    # once. They check for cancellation first, as trio's calls do.

    async def _pass_now_and_then(self) -> None:
        self.unyielded += 1
        if self.unyielded >= _IO_CALLS_PER_PASS:
            self.unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_bytes(self, wait_first: bool = False) -> bytes:
        """The bytes waiting in the socket, else the next that arrive; b"" on EOF or reset.
        wait_first: the caller expects nothing to be waiting (skip the read that would fail)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        sock = self.sock
        if wait_first:
            await trio.lowlevel.wait_readable(sock)
            self.unyielded = 0
        while True:
            try:
                data = sock.recv(_READ_BYTES)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                self.unyielded = 0
                continue
            except OSError:
                data = b""
            await self._pass_now_and_then()
            return data

    async def send_all(self, data: bytes) -> None:
        """Write all of ``data``; trio.BrokenResourceError once the client is gone, and
        trio.BusyResourceError if another task's write is waiting (as trio's stream does:
        bytes of two writes must not interleave)."""
        if self.sending:
            raise trio.BusyResourceError("another task is writing to this connection")
        await trio.lowlevel.checkpoint_if_cancelled()
        # Busy for the whole write: only its waits let another task in, and none may write
        # between two of its sends.
        self.sending = True
        try:
            waited = await sockio.send_all(self.sock, data)
        except OSError as exc:
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        finally:
            self.sending = False
        if waited:
            self.unyielded = 0  # it passed through the scheduler while it waited
        await self._pass_now_and_then()

    def _recv_now(self) -> bytes | None:
        """What is waiting in the socket (b"" at EOF or reset), None if nothing is."""
        try:
            return self.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _take(self, data: bytes, closed: bool) -> PlainRequest | None:
        """``data`` (and EOF if ``closed``) starts the next request: a plain one is read here
        (h1_request), any other is given to a fresh h11.Connection for _h11_request."""
        plain = parse_plain_request(data)
        if plain is not None:
            request, head_end, length = plain
            self.conn = PlainRequestConnection(data[:head_end], length, data[head_end:],
                                               self.limits.max_header_bytes)
            if closed:
                self.conn.receive_data(b"")
            return request
        # h11 never saw the previous response (RequestCycle wrote it), so its own
        # start_next_cycle does not apply: a new connection in its first cycle is that state.
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.conn = conn
        if data:
            conn.receive_data(data)
        if closed:
            conn.receive_data(b"")
        return None

    def _h11_request(self) -> h11.Request | h11.RemoteProtocolError | Literal["wait", "closed"]:
        """Without waiting, from h11: the next request if it is here (or the error that makes
        it malformed), "closed" if the client closed, "wait" if more bytes are needed."""
        conn = self.conn
        assert isinstance(conn, h11.Connection)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                return exc
            if event is h11.NEED_DATA:
                data = self._recv_now()
                if data is None:
                    return "wait"
                conn.receive_data(data)
                continue
            if type(event) is h11.Request:
                return event
            return "closed"  # ConnectionClosed

    async def _next_request(self) -> h11.Request | PlainRequest | None:
        if self.state.draining or self.evicted:
            return None
        # What the client sent after the previous request, and what is waiting in the socket.
        # A request already here (a busy client's next one usually is) needs no keep-alive
        # scope, and runs at once.
        data, closed = self.conn.trailing_data
        if not closed and HEAD_END not in data:
            more = self._recv_now()
            if more is not None:
                data += more
                closed = not more
        untouched = not data and not closed
        if not untouched:
            plain = self._take(data, closed)
            ready = plain if plain is not None else self._h11_request()
            if isinstance(ready, h11.RemoteProtocolError):
                await self._send_error(ready.error_status_hint, head_only=False)
                await self._linger()
                return None
            if ready == "closed":
                return None
            if ready != "wait":
                await self._pass_now_and_then()
                return ready
        # The keep-alive bound covers the whole wait for a complete request head, which also
        # bounds a client trickling a head byte by byte.
        wait_first = True
        with trio.move_on_after(self.limits.keep_alive_s) as scope:
            self.state.idle_scopes.add(scope)
            self.listener.waiting[self] = scope
            try:
                if self.state.draining or self.evicted:
                    return None
                while True:
                    if untouched:  # the first bytes of the request: plain, or h11's
                        data = await self.receive_bytes(wait_first)
                        wait_first = untouched = False
                        if (plain := self._take(data, not data)) is not None:
                            return plain
                        continue
                    conn = self.conn
                    try:
                        event = conn.next_event()
                    except h11.RemoteProtocolError as exc:
                        await self._send_error(exc.error_status_hint, head_only=False)
                        await self._linger()
                        return None
                    if event is h11.NEED_DATA:
                        conn.receive_data(await self.receive_bytes(wait_first))
                        wait_first = False
                        continue
                    if type(event) is h11.Request:
                        return event
                    return None  # ConnectionClosed
            finally:
                self.state.idle_scopes.discard(scope)
                self.listener.waiting.pop(self, None)
        return None

    async def _cycle(self, request: h11.Request | PlainRequest) -> str:
        """Run the app for one request; "keep", "close" or "linger" (close after draining input)."""
        headers = list(request.headers)
        if head_size(request.method, request.target, headers) > self.limits.max_header_bytes:
            await self._send_error(431, head_only=request.method == b"HEAD")
            return "linger"
        if has_both_framings(headers):
            await self._send_error(400, head_only=request.method == b"HEAD")
            return "close"
        declared = declared_length(headers)
        if declared is not None and declared > self.limits.max_body_bytes:
            await self._send_error(413, head_only=request.method == b"HEAD")
            return "linger"

        raw_path, _, query = request.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": request.http_version.decode("ascii"),
            "method": request.method.decode("ascii"),
            "scheme": "http",
            "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server,
        }
        cycle = RequestCycle(self, request, headers)
        try:
            try:
                await self.app(scope, cycle.receive, cycle.send)
            finally:
                cycle.release_buffered()
        except Exception as exc:
            if not (cycle.disconnected and only_disconnects(exc)):
                logger.exception("ASGI app raised on %s %s", scope["method"], scope["path"])
            return await self._after_failed_cycle(cycle, 500)

        if cycle.disconnected or self.evicted:
            return "close"
        if cycle.over_limit:
            return await self._after_failed_cycle(cycle, 413)
        if cycle.over_budget:
            return await self._after_failed_cycle(cycle, 503)
        if cycle.body_timed_out:
            return await self._after_failed_cycle(cycle, 408)
        if cycle.pipeline_overflow:
            return "close"  # the pipelined requests it sent were discarded: close, never serve half
        if not cycle.complete:
            logger.error(
                "ASGI app returned without completing the response to %s %s", scope["method"], scope["path"]
            )
            return await self._after_failed_cycle(cycle, 500)

        if not cycle.keeps_alive or self.state.draining:
            return "close"
        if self.conn.their_state is not h11.DONE and not self._finish_body_from_buffer():
            return "linger"
        return "keep"

    async def _after_failed_cycle(self, cycle: RequestCycle, status: int) -> str:
        if cycle.disconnected or cycle.head_sent or self.conn.our_state is not h11.SEND_RESPONSE:
            # Mid-response: the client sees a truncated body and a closed connection.
            return "close"
        await self._send_error(status, head_only=cycle.is_head)
        return "linger" if self.conn.their_state is not h11.DONE else "close"

    def _finish_body_from_buffer(self) -> bool:
        """The app answered without reading all of the body: consume what is already buffered."""
        conn = self.conn
        while conn.their_state is h11.SEND_BODY:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return False
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return False
        return conn.their_state is h11.DONE

    async def _send_error(self, status: int, *, head_only: bool) -> None:
        """A plain-text error response that closes the connection."""
        conn = self.conn
        body = f"{status} {reason_phrase(status)}\n".encode("ascii")
        headers = [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"connection", b"close"),
            (b"date", self.state.date_header()),
        ]
        try:
            out = conn.send(
                h11.Response(status_code=status, headers=headers, reason=reason_phrase(status).encode())
            )
            if not head_only:
                out += conn.send(h11.Data(data=body))
            out += conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            return
        try:
            await self.send_all(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _linger(self) -> None:
        """Half-close, then discard input for a bounded time so the client can read our answer."""
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
        discarded = 0
        with trio.move_on_after(_LINGER_S):
            while discarded < _LINGER_MAX_BYTES:
                data = await self.receive_bytes()
                if not data:
                    return
                discarded += len(data)


async def _accept_loop(
    entry: Listener,
    app: ASGIApp,
    limits: ServerLimits,
    state: ServerState,
    connections: trio.Nursery,
) -> None:
    # Every connection waiting in the listen queue is taken at each wake-up (up to
    # _ACCEPT_BATCH, and below the connection cap). One accept per scheduler pass, as trio's
    # SocketListener does, admits one connection per pass over every busy task, which under
    # a thousand streams left clients queued for tens of seconds (docs/http-serving.md,
    # "Accepting").
    sock = entry.sock
    while True:
        await trio.lowlevel.wait_readable(sock)
        for _ in range(_ACCEPT_BATCH):
            try:
                accepted, _ = sock.accept()
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in _ACCEPT_GONE_ERRNOS:
                    continue  # the client gave up while queued
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                name = errno.errorcode.get(exc.errno, exc.errno)
                entry.note_refusal(f"accept() {name}", trio.current_time())
                await trio.sleep(_ACCEPT_RETRY_S)
                break
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(accepted))  # non-blocking now
            # The connection cap (DEFAULT_MAX_CONNECTIONS): make room by evicting the connection
            # that has waited longest on its client; if every one is busy in the app, refuse.
            at_cap = entry.open >= limits.max_connections
            admit = not at_cap or entry.evict_oldest_waiting()
            if not admit:
                # Connections admitted in this batch have not run yet, so they wait on nothing
                # yet: let them reach their first wait (where they can be evicted) first.
                await _after_next_pass()
                admit = entry.evict_oldest_waiting()
            if admit:
                entry.open += 1
                connections.start_soon(H11Connection(stream, accepted, app, limits, state, entry).run)
            else:
                entry.note_refusal("over the connection cap", trio.current_time())
                connections.start_soon(_refuse_busy, stream)
            if at_cap:
                # The evicted or refused connection closes in its task's next step, in the
                # next scheduler pass: take the next connection only after that pass, so
                # descriptors stay at the cap.
                await _after_next_pass()
                break


async def _after_next_pass() -> None:
    """Return once every task made runnable before this call has run a step: tasks woken in
    this pass run in the next one, in any order, so two checkpoints land after it."""
    await trio.lowlevel.checkpoint()
    await trio.lowlevel.checkpoint()


async def _refuse_busy(stream: trio.SocketStream) -> None:
    """A clear 503 (the connection cap is reached), then close; bounded in time."""
    with trio.move_on_after(_REFUSE_SEND_S):
        try:
            await stream.send_all(_BUSY_RESPONSE)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await trio.aclose_forcefully(stream)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def serve_h11(
    app: ASGIApp,
    binds: list[str],
    *,
    stop_accepting: trio.Event | None,
    limits: ServerLimits,
    reuse_port: bool,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    listeners = await open_listeners(binds, reuse_port)
    state = ServerState()
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as acceptors:
                for entry in listeners:
                    acceptors.start_soon(_accept_loop, entry, app, limits, state, connections)
                if stop_accepting is not None:
                    acceptors.start_soon(_cancel_when_set, stop_accepting, acceptors.cancel_scope)
                task_status.started([entry.url for entry in listeners])
            # Drain: refuse new connections, close idle ones, let in-flight requests finish.
            await close_listeners(listeners)
            state.start_drain()
    finally:
        await close_listeners(listeners)
