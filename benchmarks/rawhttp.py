"""A minimal keep-alive HTTP/1.1 load generator on trio, shared by the benchmarks.

It measures servers, not a client library: each request is written at once and the answer
parsed just enough (status, headers, Content-Length or chunked body) to time it. Every
phase is bounded in count (connections x requests) and in time (PHASE_CAP_S).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import trio

CONNECT_CAP_S = 5.0
PHASE_CAP_S = 60.0


class Closed(Exception):
    pass


class RawConnection:
    """Minimal HTTP/1.1 client: Content-Length or chunked responses, keep-alive."""

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise Closed
        self.buf += data

    async def _head(self) -> tuple[int, dict[bytes, bytes]]:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            await self._fill()
        lines = bytes(self.buf[:end]).split(b"\r\n")
        del self.buf[: end + 4]
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    async def _line(self) -> bytes:
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[: end + 2]
                return line
            await self._fill()

    async def _exact(self, n: int) -> None:
        while len(self.buf) < n:
            await self._fill()
        del self.buf[:n]

    async def exchange(self, request: bytes) -> tuple[float, float, bool]:
        """Send one request; (seconds to first body byte, seconds total, server asked to close)."""
        start = time.perf_counter()
        await self.stream.send_all(request)
        status, headers = await self._head()
        if status != 200:
            raise RuntimeError(f"unexpected status {status}")
        first = None
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await self._line()).split(b";")[0], 16)
                if size == 0:
                    await self._line()
                    break
                await self._exact(size + 2)
                if first is None:
                    first = time.perf_counter()
        else:
            await self._exact(int(headers[b"content-length"]))
            first = time.perf_counter()
        end = time.perf_counter()
        close = headers.get(b"connection", b"").lower() == b"close"
        return (first or end) - start, end - start, close


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


async def run_phase(host: str, port: int, request: bytes, concurrency: int, per_conn: int) -> PhaseResult:
    result = PhaseResult()

    async def worker():
        done = 0
        conn = None
        while done < per_conn:
            if conn is None:
                with trio.fail_after(CONNECT_CAP_S):
                    conn = RawConnection(await trio.open_tcp_stream(host, port))
            first, total, close = await conn.exchange(request)
            result.first_s.append(first)
            result.total_s.append(total)
            done += 1
            if close:
                await conn.stream.aclose()
                conn = None
        if conn is not None:
            await conn.stream.aclose()

    start = time.perf_counter()
    with trio.move_on_after(PHASE_CAP_S) as scope:
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
    result.wall_s = time.perf_counter() - start
    result.capped = scope.cancelled_caught
    return result


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

