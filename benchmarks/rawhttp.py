"""A minimal keep-alive HTTP/1.1 load generator, shared by the benchmarks.

It measures servers, not a client library: each request is written at once and the answer
parsed just enough (status, headers, Content-Length or chunked body) to time it. Every
phase is bounded in count (connections x requests) and in time (PHASE_CAP_S).

The load runs in one thread on a plain epoll loop over non-blocking sockets (no event-loop
library): on a 2-core host the load generator shares a core with the server it measures, so
its own CPU per request is kept as small as Python allows (about a quarter of what the same
client cost on trio), and it is reported with every phase (PhaseResult.client_cpu_s) so a
reader can see what it took from that core.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass, field

import trio

CONNECT_CAP_S = 5.0
PHASE_CAP_S = 60.0
_RECV_BYTES = 64 * 1024


class Closed(Exception):
    pass


@dataclass(frozen=True)
class Phase:
    key: str
    request: bytes
    concurrency: int
    per_conn: int


@dataclass
class PhaseResult:
    first_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    capped: bool = False
    client_cpu_s: float = 0.0
    """CPU time of the load generator over the phase (its thread, user + system)."""


class _Conn:
    """One keep-alive connection's exchange in progress: the response parsed as it arrives."""

    __slots__ = ("sock", "buf", "done", "start", "first", "state", "remaining", "close")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.done = 0
        self.start = 0.0
        self.first = 0.0
        self.state = "head"  # head | length | chunk_size | chunk_data | trailer
        self.remaining = 0
        self.close = False

    def begin(self, request: bytes) -> None:
        self.start = time.perf_counter()
        self.first = 0.0
        self.state = "head"
        self.sock.sendall(request)  # a request is far below the socket buffer: never blocks

    def feed(self, data: bytes) -> bool:
        """Take bytes; True once the response is complete."""
        buf = self.buf
        buf += data
        while True:
            state = self.state
            if state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return False
                lines = bytes(buf[:end]).split(b"\r\n")
                del buf[: end + 4]
                status = int(lines[0].split(b" ", 2)[1])
                if status != 200:
                    raise RuntimeError(f"unexpected status {status}")
                chunked = False
                length = -1
                self.close = False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    value = value.strip().lower()
                    if name == b"transfer-encoding" and value == b"chunked":
                        chunked = True
                    elif name == b"content-length":
                        length = int(value)
                    elif name == b"connection" and value == b"close":
                        self.close = True
                if chunked:
                    self.state = "chunk_size"
                elif length >= 0:
                    self.state, self.remaining = "length", length
                else:
                    raise RuntimeError("a response with neither Content-Length nor chunked")
            elif state == "length":
                if len(buf) < self.remaining:
                    return False
                del buf[: self.remaining]
                self.first = time.perf_counter()
                return True
            elif state == "chunk_size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return False
                size = int(bytes(buf[:end]).split(b";")[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.state, self.remaining = "chunk_data", size + 2
            elif state == "chunk_data":
                if len(buf) < self.remaining:
                    return False
                del buf[: self.remaining]
                if not self.first:
                    self.first = time.perf_counter()
                self.state = "chunk_size"
            else:  # trailer: the empty line that ends a chunked body (no trailer fields sent)
                end = buf.find(b"\r\n")
                if end < 0:
                    return False
                del buf[: end + 2]
                return True


def _connect(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=CONNECT_CAP_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


def _run_phase_blocking(host: str, port: int, request: bytes, concurrency: int, per_conn: int,
                        cap_s: float) -> PhaseResult:
    result = PhaseResult()
    cpu0 = time.thread_time()
    start = time.perf_counter()
    deadline = start + cap_s
    poller = select.epoll()
    conns: dict[int, _Conn] = {}
    try:
        for _ in range(concurrency):
            conn = _Conn(_connect(host, port))
            conns[conn.sock.fileno()] = conn
            poller.register(conn.sock.fileno(), select.EPOLLIN)
        for conn in conns.values():
            conn.begin(request)
        first_s, total_s = result.first_s, result.total_s
        active = len(conns)
        while active:
            now = time.perf_counter()
            if now >= deadline:
                result.capped = True
                break
            for fd, _ in poller.poll(min(1.0, deadline - now)):
                conn = conns[fd]
                try:
                    data = conn.sock.recv(_RECV_BYTES)
                except BlockingIOError:
                    continue
                if not data:
                    raise Closed(f"the server closed a connection after {conn.done} requests")
                if not conn.feed(data):
                    continue
                end = time.perf_counter()
                first_s.append((conn.first or end) - conn.start)
                total_s.append(end - conn.start)
                conn.done += 1
                if conn.done >= per_conn:
                    poller.unregister(fd)
                    active -= 1
                    continue
                if conn.close:  # the server asked to close: next request on a new connection
                    poller.unregister(fd)
                    conn.sock.close()
                    del conns[fd]
                    fresh = _Conn(_connect(host, port))
                    fresh.done = conn.done
                    conns[fresh.sock.fileno()] = fresh
                    poller.register(fresh.sock.fileno(), select.EPOLLIN)
                    conn = fresh
                conn.begin(request)
    finally:
        for conn in conns.values():
            conn.sock.close()
        poller.close()
    result.wall_s = time.perf_counter() - start
    result.client_cpu_s = time.thread_time() - cpu0
    return result


async def run_phase(host: str, port: int, request: bytes, concurrency: int, per_conn: int) -> PhaseResult:
    """``concurrency`` keep-alive connections, each sending ``request`` ``per_conn`` times one
    after another; bounded by PHASE_CAP_S (then ``capped``)."""
    return await trio.to_thread.run_sync(_run_phase_blocking, host, port, request, concurrency, per_conn,
                                         PHASE_CAP_S)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0
