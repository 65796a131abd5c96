"""The lean scrape client over real loopback sockets (gridd.operator.http1).

A plain-TCP connection is read and written on its own socket, not through trio's
SocketStream (docs/scaling.md: a third of the client's CPU per scrape). Each test runs the
same exchanges both ways, on that socket and through the trio stream (an injected
``open_stream`` that hides the SocketStream), and asserts the same answers: bodies of every
size and framing, keep-alive, the retry of a connection the provider closed while idle,
and every failure class with its detail. Real sockets, so real time (STYLE 13): the timing
rules themselves are asserted on the MockClock in tests/test_scrape.py.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scrape import read_request

from gridd.operator.http1 import ResponseParser, ScrapeClient
from gridd.operator.scrape import ScrapeTarget, scrape_one

CAP = 1024 * 1024
SAMPLE = (Path(__file__).parent / "data" / "samples" / "epp-healthy.prom").read_bytes()
LARGE = b"".join(b"line_%d 1\n" % i for i in range(60_000))  # ~640 KB: several 256 KiB reads
OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"

Serve = Callable[[trio.SocketStream], Awaitable[None]]


async def open_trio_stream(host: str, port: int) -> trio.abc.Stream:
    """The connection as trio's SocketStream reads it (the path before plain sockets), in a
    wrapper that is not a SocketStream, so the client keeps it a stream."""
    stream = await trio.open_tcp_stream(host, port)
    return trio.StapledStream(stream, stream)


PATHS = {"socket": trio.open_tcp_stream, "trio stream": open_trio_stream}


@contextlib.asynccontextmanager
async def provider(serve: Serve) -> AsyncIterator[int]:
    """A provider on 127.0.0.1 running ``serve`` for each connection; yields its port."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def content_length(body: bytes) -> bytes:
    return OK_HEAD + b"content-length: %d\r\n\r\n" % len(body) + body


def chunked(body: bytes) -> bytes:
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)]
    return (OK_HEAD + b"transfer-encoding: chunked\r\n\r\n"
            + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")


RESPONSES = {
    b"/sample": content_length(SAMPLE),
    b"/large": content_length(LARGE),
    b"/chunked": chunked(SAMPLE),
    b"/empty": content_length(b""),
}
BODIES = {b"/sample": SAMPLE, b"/large": LARGE, b"/chunked": SAMPLE, b"/empty": b""}


@pytest.mark.parametrize("path", PATHS)
async def test_bodies_of_every_size_and_framing_arrive_whole_over_one_kept_connection(path):
    async def serve(stream: trio.SocketStream) -> None:
        while (request := await read_request(stream)) is not None:
            raw = RESPONSES[request.split(b" ")[1]]
            # In three pieces with pauses, so reads both wait and find bytes already there.
            third = len(raw) // 3
            for piece in (raw[:third], raw[third : 2 * third], raw[2 * third :]):
                await stream.send_all(piece)
                await trio.sleep(0.002)

    async with provider(serve) as port, ScrapeClient(open_stream=PATHS[path]) as client:
        for _ in range(2):
            for target in RESPONSES:
                url = f"http://127.0.0.1:{port}{target.decode()}"
                assert await client.get_capped(url, {}, CAP) == (BODIES[target], None, "")
        assert (client.connections_opened, client.reused) == (1, 7)
        # The plain connection is the client's own socket; the wrapped stream stays a stream.
        (kept,) = client._idle.values()
        assert [connection.sock is not None for connection in kept] == [path == "socket"]


@pytest.mark.parametrize("path", PATHS)
async def test_a_connection_the_provider_closed_while_idle_is_retried_once_on_a_new_one(path):
    async def serve(stream: trio.SocketStream) -> None:
        # One answer per connection, then close (a provider's keep-alive timeout).
        if await read_request(stream) is not None:
            await stream.send_all(content_length(SAMPLE))

    async with provider(serve) as port, ScrapeClient(open_stream=PATHS[path]) as client:
        for _ in range(3):
            assert await client.get_capped(f"http://127.0.0.1:{port}/m", {}, CAP) == (SAMPLE, None, "")
            await trio.sleep(0.02)  # the provider's close arrives while the connection is idle
        assert (client.connections_opened, client.reused) == (3, 2)


FAILING = {
    b"/status": b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",
    b"/truncated": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial",
    b"/huge": b"HTTP/1.1 200 OK\r\ncontent-length: 10485760\r\n\r\n",
    b"/chunked-huge": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    b"/garbage": b"<html>not http</html>\r\n\r\n",
}


async def scrape_failures(open_stream: Callable[[str, int], Awaitable[trio.abc.Stream]]) -> dict:
    """Each failing answer once, from a fresh client; (class, detail) and whether the
    provider saw its connection closed."""
    closed: list[bytes] = []
    all_closed = trio.Event()  # every connection the client was left to close

    async def serve(stream: trio.SocketStream) -> None:
        request = await read_request(stream)
        assert request is not None
        target = request.split(b" ")[1]
        if target == b"/reset":
            # An abortive close (RST) before any answer.
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        try:
            if target != b"/hang":
                await stream.send_all(FAILING[target])
            if target == b"/truncated":
                return  # closed by the provider, mid-body
            if target == b"/chunked-huge":
                chunk = b"10000\r\n" + b"#" * 0x10000 + b"\r\n"
                for _ in range(160):  # 10 MiB in 64 KiB chunks, while the client reads
                    await stream.send_all(chunk)
            while await stream.receive_some() != b"":  # until the client closes
                pass
        except trio.BrokenResourceError:
            pass  # closed by the client while this was sending
        closed.append(target)
        if len(closed) == len(FAILING):  # all but the one cut mid-body and the reset one
            all_closed.set()

    got = {}
    async with provider(serve) as port, ScrapeClient(open_stream=open_stream) as client:
        for target in [*FAILING, b"/reset", b"/hang"]:
            name = target.decode()
            result = await scrape_one(client, ScrapeTarget(name, f"http://127.0.0.1:{port}{name}", 0.5), CAP)
            got[name] = (result.failure_class, result.detail)
        with trio.fail_after(5):
            await all_closed.wait()
        assert client.connections_opened == len(got) and client.reused == 0
    return got


async def test_failures_are_classified_and_worded_alike_on_both_paths_and_close_the_connection():
    on_socket = await scrape_failures(trio.open_tcp_stream)
    assert on_socket == {
        "/status": ("http_status", "HTTP 503"),
        "/truncated": ("connect", "malformed response: connection closed with 93 body bytes still expected"),
        "/huge": ("body_cap", f"body over {CAP} bytes"),
        "/chunked-huge": ("body_cap", f"body over {CAP} bytes"),
        "/garbage": ("connect", "malformed response: malformed status line b'<html>not http</html>'"),
        "/reset": (
            "connect",
            "BrokenResourceError: socket connection broken: [Errno 104] Connection reset by peer",
        ),
        "/hang": ("timeout", "no answer within 0.5 s"),
    }
    assert await scrape_failures(open_trio_stream) == on_socket


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_parser_keeps_nothing_of_a_reused_read_buffer(data):
    # The client reads every plain connection into one buffer and hands the parser views of
    # it: fed views of a buffer that is overwritten after each read, the parser answers as
    # it does for the same bytes whole.
    raw = data.draw(st.sampled_from([*RESPONSES.values(), *FAILING.values()]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))

    def outcome(pieces) -> tuple:
        parser = ResponseParser(CAP)
        try:
            for piece in pieces:
                parser.receive_data(piece)
            if not parser.done:
                parser.receive_eof()
        except Exception as exc:  # the parser's own errors, compared by type and text
            return type(exc).__name__, str(exc)
        return parser.status, parser.body(), parser.reusable

    def views():
        buffer = bytearray(len(raw) + 1)
        view = memoryview(buffer)
        for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True):
            buffer[: b - a] = raw[a:b]
            yield view[: b - a]
            buffer[:] = b"\xff" * len(buffer)  # the next read overwrites it

    assert outcome(views()) == outcome([raw])
