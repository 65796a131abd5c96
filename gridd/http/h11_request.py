"""One request on an h11 connection as the ASGI app sees it (the ASGI adapter of the h11
backend): RequestCycle's receive() reads the socket itself, on demand, and its send() writes
the response straight to it; no extra task, queue or event per request. ServerState is what
every connection of one serve_asgi call shares (drain, the bytes of bodies still arriving,
the Date header)."""

from __future__ import annotations

import email.utils
import time
from typing import Protocol

import h11
import trio

from gridd.http.asgi import ClientDisconnected, Message
from gridd.http.h1_request import PlainRequest, RequestConnection
from gridd.http.h1_response import ResponseWriter, request_keeps_alive
from gridd.http.limits import ServerLimits
from gridd.http.listeners import Listener

__all__ = ["CycleConnection", "RequestCycle", "ServerState"]


class ServerState:
    """What every connection of one serve_asgi call shares."""

    __slots__ = ("draining", "idle_scopes", "buffered_bytes", "uploading", "_date_second", "_date_value")

    def __init__(self) -> None:
        self.draining = False
        # Cancel scopes of connections waiting for a request head; drain cancels them.
        self.idle_scopes: set[trio.CancelScope] = set()
        # Bytes of request bodies still arriving (DEFAULT_MAX_BUFFERED_BYTES).
        self.buffered_bytes = 0
        # Requests whose body is still arriving, oldest first (DEFAULT_MAX_BUFFERED_BYTES).
        self.uploading: dict[RequestCycle, None] = {}
        self._date_second = -1
        self._date_value = b""

    def date_header(self) -> bytes:
        now = int(time.time())
        if now != self._date_second:
            self._date_second = now
            self._date_value = email.utils.formatdate(now, usegmt=True).encode("ascii")
        return self._date_value

    def start_drain(self) -> None:
        self.draining = True
        for scope in list(self.idle_scopes):
            scope.cancel()


class CycleConnection(Protocol):
    """What a request cycle uses of its connection (h11_server.H11Connection)."""

    conn: RequestConnection
    limits: ServerLimits
    state: ServerState
    listener: Listener
    evicted: bool

    async def receive_bytes(self, wait_first: bool = False) -> bytes: ...

    async def send_all(self, data: bytes) -> None: ...


def _missing_headers(headers: list[tuple[bytes, bytes]]) -> tuple[bool, bool]:
    """(no Content-Length/Transfer-Encoding given, no Date given) for an app's response headers."""
    framing = date = False
    for name, _ in headers:
        lowered = name.lower()
        if lowered == b"content-length" or lowered == b"transfer-encoding":
            framing = True
        elif lowered == b"date":
            date = True
    return not framing, not date


class RequestCycle:
    """receive/send for one request. receive() reads the socket itself, on demand; no extra task."""

    __slots__ = (
        "c",
        "conn",
        "is_head",
        "body_done",
        "body_bytes",
        "disconnected",
        "over_limit",
        "body_timed_out",
        "over_budget",
        "pipeline_overflow",
        "body_deadline",
        "buffered",
        "wait_scope",
        "started",
        "status",
        "headers",
        "head_sent",
        "complete",
        "writer",
    )

    def __init__(self, connection: CycleConnection, request: h11.Request | PlainRequest,
                 headers: list[tuple[bytes, bytes]]) -> None:
        self.c = connection
        self.conn = connection.conn
        self.is_head = request.method == b"HEAD"
        self.body_done = False
        self.body_bytes = 0
        self.disconnected = False
        self.over_limit = False
        self.body_timed_out = False
        self.over_budget = False
        self.pipeline_overflow = False
        # The whole body must have arrived by then (DEFAULT_BODY_DEADLINE_S).
        self.body_deadline = trio.current_time() + connection.limits.body_deadline_s
        self.buffered = 0  # this request's share of ServerState.buffered_bytes
        self.wait_scope: trio.CancelScope | None = None  # while waiting for body bytes
        self.started = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_sent = False
        self.complete = False
        # The app's response is written by this, not by self.conn (h1_response: same bytes).
        self.writer = ResponseWriter(request.method, request.http_version,
                                     request_keeps_alive(request.http_version, headers))

    @property
    def keeps_alive(self) -> bool:
        """The response is complete and the connection may carry the next request."""
        return self.complete and self.writer.keep_alive

    def release_buffered(self) -> None:
        self.c.state.buffered_bytes -= self.buffered
        self.buffered = 0
        self.c.state.uploading.pop(self, None)

    def _make_room(self) -> bool:
        """Over the buffered-bytes cap: end the oldest uploads (this one included, if it is
        the oldest) until the bytes fit. True if this request may go on."""
        state, cap = self.c.state, self.c.limits.max_buffered_bytes
        while state.buffered_bytes > cap:
            oldest = next(iter(state.uploading))
            oldest.over_budget = True
            oldest.release_buffered()
            if oldest is self:
                return False
            if oldest.wait_scope is not None:
                oldest.wait_scope.cancel()
        return True

    async def receive(self) -> Message:
        if self.disconnected or self.over_limit or self.over_budget or self.body_timed_out or self.complete:
            return {"type": "http.disconnect"}
        if not self.body_done:
            return await self._receive_body()
        # Body fully read, response not finished: the only thing left to report is the client
        # going away. Reading here (EOF or reset) is what lets a streaming app stop at once.
        # Pipelined requests that arrive meanwhile are buffered in h11, up to the head limit;
        # past it, what arrives is discarded (still read, so a hang-up is seen) and the
        # connection closes after this response.
        # Nothing is expected (a client waits for its answer): wait for the socket before
        # reading, so that a watch that ends with the response costs no failed read.
        conn = self.conn
        wait_first = True
        while True:
            data = await self.c.receive_bytes(wait_first)
            wait_first = False
            if not data:
                self.disconnected = True
                return {"type": "http.disconnect"}
            held = len(conn.trailing_data[0])
            if self.pipeline_overflow or held + len(data) > self.c.limits.max_header_bytes:
                self.pipeline_overflow = True
                continue
            conn.receive_data(data)

    async def _receive_body(self) -> Message:
        conn = self.conn
        if conn.they_are_waiting_for_100_continue:
            await self._send_bytes(conn.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        limit = self.c.limits.max_body_bytes
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                # Bad chunk framing or EOF mid-body: the request can't be completed.
                self.disconnected = True
                return {"type": "http.disconnect"}
            if type(event) is h11.Data:
                data = bytes(event.data)
                self.body_bytes += len(data)
                state = self.c.state
                state.buffered_bytes += len(data)
                self.buffered += len(data)
                state.uploading.setdefault(self, None)
                if self.body_bytes > limit:
                    # Chunked body over the limit: the app sees the request vanish; the server
                    # answers 413 if the app had not started a response.
                    self.over_limit = True
                    return {"type": "http.disconnect"}
                if state.buffered_bytes > self.c.limits.max_buffered_bytes and not self._make_room():
                    # Every incomplete body together over the server's budget, and this one
                    # the oldest: it ends (503 if no response started), the process stays put.
                    return {"type": "http.disconnect"}
                chunks.append(data)
            elif type(event) is h11.EndOfMessage:
                self.body_done = True
                self.release_buffered()  # complete: no longer the client's to hold back
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            elif event is h11.NEED_DATA:
                # Hand over what is buffered before blocking on the socket.
                if chunks:
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                # A client that announced a body must keep sending it: a stall of body_idle_s,
                # or the whole body not in by body_deadline_s after the head, ends the request
                # (408 if no response started), so a trickle cannot hold a task. While it
                # waits here the connection may be evicted by the connection cap.
                data = None
                listener = self.c.listener
                with trio.CancelScope(deadline=min(trio.current_time() + self.c.limits.body_idle_s,
                                                   self.body_deadline)) as wait:
                    listener.waiting[self.c] = self.wait_scope = wait
                    try:
                        data = await self.c.receive_bytes()
                    finally:
                        listener.waiting.pop(self.c, None)
                        self.wait_scope = None
                if self.over_budget:
                    return {"type": "http.disconnect"}  # ended by _make_room for a newer upload
                if data is None:
                    if self.c.evicted:
                        self.disconnected = True
                    else:
                        self.body_timed_out = True
                    return {"type": "http.disconnect"}
                if not data:
                    self.disconnected = True
                    return {"type": "http.disconnect"}
                conn.receive_data(data)
            else:
                self.disconnected = True
                return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.disconnected or self.over_limit or self.over_budget:
            raise ClientDisconnected("client disconnected")
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.complete:
                raise RuntimeError("http.response.body outside a started, unfinished response")
            body = message.get("body", b"")
            more = message.get("more_body", False)
            writer = self.writer
            if self.head_sent:
                out = b""
            else:
                # The head goes out with the first body message (ASGI: not before), so a small
                # response is one write. A single-message response gets a Content-Length;
                # otherwise h11 picks chunked for HTTP/1.1 (or close-delimited for 1.0).
                headers = self.headers
                status = self.status
                no_framing, no_date = _missing_headers(headers)
                if (
                    no_framing
                    and not more
                    and (body or not self.is_head)
                    and status >= 200
                    and status not in (204, 304)
                ):
                    headers.append((b"content-length", str(len(body)).encode("ascii")))
                if no_date:
                    headers.append((b"date", self.c.state.date_header()))
                if self.c.state.draining:
                    headers.append((b"connection", b"close"))
                out = writer.head(status, headers)
                self.head_sent = True
            if body and not self.is_head:
                out += writer.data(body)
            if not more:
                out += writer.end()
                self.complete = True
            if out:
                await self._send_bytes(out)
            return
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = [(bytes(name), bytes(value)) for name, value in message.get("headers", ())]
            return
        raise RuntimeError(f"unexpected ASGI message type {kind!r}")

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.c.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.disconnected = True
            raise ClientDisconnected("client disconnected") from exc
