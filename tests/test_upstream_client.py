"""The forwarding client: its sans-IO parser table-driven and under random splits
(hypothesis), then the client over real loopback sockets against raw trio servers (the
bytes on the wire, framings, failures and their UpstreamError reasons, reuse, the unchecked
idle bound on a MockClock, TLS with trustme certificates, cancellation)."""

from __future__ import annotations

import functools
import socket
import ssl
import threading
import time

import h11
import pytest
import trio
import trio.testing
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st
from support import local

from gridd.gateway.upstream_client import UpstreamClient, make_upstream_client
from gridd.gateway.upstream_errors import UpstreamError
from gridd.gateway.upstream_parser import HEAD_MAX, MalformedResponse, ResponseParser
from gridd.gateway.upstream_request import upstream_target

BOUND_S = 10.0
JSON = [(b"content-type", b"application/json")]


# -- the parser ---------------------------------------------------------------------------------


def parse(*pieces: bytes, eof: bool = False) -> tuple[ResponseParser, bytes]:
    parser = ResponseParser()
    body = b""
    for piece in pieces:
        parser.feed(piece)
        body += parser.take_body()
    if eof:
        parser.feed_eof()
        body += parser.take_body()
    return parser, body


CHUNKED = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"
           b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n")

# (answer, eof after it, status, body, reusable)
FRAMINGS = [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", False, 200, b"hello", True),
    (b"HTTP/1.1 200 OK\ncontent-length: 5\n\nhello", False, 200, b"hello", True),  # bare LF lines
    (b"HTTP/1.1 201\r\nContent-Length: 0\r\n\r\n", False, 201, b"", True),  # no reason phrase
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\ncontent-length: 5\r\n\r\nhello", False, 200, b"hello",
     True),
    (CHUNKED, False, 200, b"hello world", True),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 99\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
     False, 200, b"abc", True),  # chunked wins over a Content-Length
    (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", True, 200, b"until the end", False),  # read to close
    (b"HTTP/1.1 204 No Content\r\n\r\n", False, 204, b"", True),
    (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 10\r\n\r\n", False, 304, b"", True),
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n"
     b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", False, 200, b"ok", True),  # 1xx skipped
    (b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ncontent-length: 2\r\n\r\nok", False, 200, b"ok",
     False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok", False, 200, b"ok", False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA", False, 200, b"ok", False),  # out of step
    (b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\n\r\nbusy", False, 503, b"busy", True),
]


@pytest.mark.parametrize(("answer", "eof", "status", "body", "reusable"), FRAMINGS)
def test_framings(answer, eof, status, body, reusable):
    parser, got = parse(answer, eof=eof)
    assert (parser.status, got, parser.done, parser.reusable) == (status, body, True, reusable)


def test_head_fields_are_lowercased_in_order_and_obs_fold_joins():
    parser, _ = parse(b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nX-Long: one\r\n  two\r\nSet-Cookie: c=1\r\n"
                      b"content-length: 0\r\n\r\n")
    assert parser.headers == [(b"content-type", b"a/b"), (b"x-long", b"one two"), (b"set-cookie", b"c=1"),
                              (b"content-length", b"0")]


@given(st.sampled_from([f for f in FRAMINGS]), st.data())
@settings(max_examples=300, deadline=None)
def test_any_split_of_the_bytes_parses_the_same(framing, data):
    answer, eof, status, body, reusable = framing
    cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=12)))
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
    parser, got = parse(*pieces, eof=eof)
    assert (parser.status, got, parser.done, parser.reusable) == (status, body, True, reusable)


@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8), st.data())
@settings(max_examples=200, deadline=None)
def test_any_chunking_and_any_split_relay_the_same_body(chunks, data):
    answer = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
              + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=20)))
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
    parser, got = parse(*pieces)
    assert got == b"".join(chunks) and parser.done and parser.reusable


def h11_read(answer: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """What h11 (the parser under httpx) reads from ``answer`` as a client after a POST."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(answer)
    status, headers, body = 0, [], b""
    while True:
        event = client.next_event()
        if isinstance(event, h11.Response):
            status, headers = event.status_code, [(n.lower(), v) for n, v in event.headers.raw_items()]
        elif isinstance(event, h11.Data):
            body += bytes(event.data)
        elif isinstance(event, h11.EndOfMessage) or event is h11.NEED_DATA:
            return status, headers, body


_NAMES = st.sampled_from([b"content-type", b"X-Request-Id", b"cache-control", b"set-cookie", b"server"])
_VALUES = st.from_regex(rb"\A[!-~]([ !-~]{0,20}[!-~])?\Z")


@given(st.sampled_from([200, 201, 400, 404, 429, 500, 503]), st.lists(st.tuples(_NAMES, _VALUES), max_size=5),
       st.lists(st.binary(max_size=64), max_size=6), st.booleans(), st.data())
@settings(max_examples=200, deadline=None)
def test_the_parser_reads_what_h11_reads(status, fields, pieces, chunked, data):
    server = h11.Connection(h11.SERVER)
    server.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    server.next_event()
    server.next_event()
    framing = [(b"transfer-encoding", b"chunked")] if chunked else [
        (b"content-length", b"%d" % sum(map(len, pieces)))]
    answer = server.send(h11.Response(status_code=status, headers=fields + framing))
    answer += b"".join(server.send(h11.Data(data=p)) for p in pieces if p) + server.send(h11.EndOfMessage())
    cuts = sorted(data.draw(st.lists(st.integers(0, len(answer)), max_size=6)))
    parser, body = parse(*[answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)])
    assert parser.done and (parser.status, parser.headers, body) == h11_read(answer)


MALFORMED = [
    (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
    (b"HTTP/2 200 OK\r\n\r\n", "status line"),
    (b"\r\nHTTP/1.1 200 OK\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\nx: a\x00b\r\n\r\n", "header line"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", "Transfer-Encoding"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
     "Transfer-Encoding"),
    (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "chunk-size"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n", "longer than its chunk-size"),
    (b"HTTP/1.1 200 OK\r\nx: " + b"a" * HEAD_MAX + b"\r\n\r\n", "over"),
    (b"HTTP/1.1 200 OK\r\nx: " + b"a" * (HEAD_MAX + 10), "over"),  # no end of head in sight
]


@pytest.mark.parametrize(("answer", "what"), MALFORMED)
def test_malformed_answers_raise_and_say_what(answer, what):
    with pytest.raises(MalformedResponse, match=what):
        parse(answer)


@pytest.mark.parametrize(("answer", "what"), [
    (b"", "without a response"),
    (b"HTTP/1.1 200 OK\r\ncontent-", "before a complete response head"),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel", "2 body bytes still expected"),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel", "inside a chunked body"),
])
def test_a_connection_closed_early_is_malformed(answer, what):
    with pytest.raises(MalformedResponse, match=what):
        parse(answer, eof=True)


def test_body_bytes_parsed_before_a_fault_stay_takeable():
    parser = ResponseParser()
    with pytest.raises(MalformedResponse):
        parser.feed(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nxyz\r\n")
    assert parser.take_body() == b"abc"


# -- the client over loopback ---------------------------------------------------------------------


class RawUpstream:
    """A trio TCP server answering each request with the next canned answer (bytes, or a list
    of bytes to send, float pauses, and None: wait for the client to close); records the
    requests as the first read of each brought them (one send per request: one read)."""

    def __init__(self, answers, *, close_after: bool = False) -> None:
        self.answers = list(answers)
        self.close_after = close_after
        self.first_reads: list[bytes] = []
        self.connections = 0
        self.closed = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    return
                self.first_reads.append(data)
                answer = self.answers.pop(0)
                for part in answer if isinstance(answer, list) else [answer]:
                    if part is None:  # hold the exchange open until the client ends it
                        while await stream.receive_some(65536):
                            pass
                        return
                    if isinstance(part, float):
                        await trio.sleep(part)
                    else:
                        await stream.send_all(part)
                if self.close_after:
                    return
        except trio.BrokenResourceError:
            return
        finally:
            await stream.aclose()
            self.closed.set()

    async def start(self, nursery) -> str:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self.handle, 0, host="127.0.0.1"))
        return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


def target_for(url: str, **fields):
    return upstream_target(local("a", "p", url, **fields), "/v1/chat/completions")


async def exchange(client, target, body: bytes = b"{}"):
    """(status, [(data, last) per deliver call]) of one request, its answer closed."""
    answer = await client.open(target, JSON, body, lambda: None)
    calls = []

    async def keep(data: bytes, last: bool) -> None:
        calls.append((data, last))

    try:
        await answer.relay(keep)
    finally:
        await answer.aclose()
    return answer.status, calls


async def test_the_request_goes_out_in_one_send_as_httpx_spelled_it(nursery):
    upstream = RawUpstream([b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"])
    url = await upstream.start(nursery)
    client = make_upstream_client()
    target = target_for(url, auth_scheme="bearer", api_key="sk-1", headers={"X-Custom": "v"})
    client_headers = [(b"Host", b"gw"), (b"Content-Type", b"application/json"), (b"Authorization", b"mine"),
                      (b"Connection", b"keep-alive, x-hop"), (b"X-Hop", b"1"), (b"x-custom", b"client's"),
                      (b"Accept", b"*/*")]
    connected = []
    with trio.fail_after(BOUND_S):
        answer = await client.open(target, client_headers, b'{"a":1}', lambda: connected.append(True))
        await answer.aclose()
    port = url.rpartition(":")[2]
    assert upstream.first_reads == [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:" + port.encode() + b"\r\n"
        b"content-type: application/json\r\naccept: */*\r\nx-custom: v\r\nauthorization: Bearer sk-1\r\n"
        b'Content-Length: 7\r\n\r\n{"a":1}']
    assert connected == [True] and client.pool_counts() == (1, 1)
    await client.aclose()


async def test_what_one_read_brought_is_one_deliver_and_the_last_ends_it(nursery):
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    upstream = RawUpstream([
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",  # all at once: one call
        [head + b"3\r\none\r\n3\r\ntwo\r\n", 0.05, b"5\r\nthree\r\n", 0.05, b"0\r\n\r\n"],
        [b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"],
    ])
    url = await upstream.start(nursery)
    async with make_upstream_client() as client:
        target = target_for(url)
        with trio.fail_after(BOUND_S):
            assert await exchange(client, target) == (200, [(b"hello", True)])
            assert await exchange(client, target) == (
                200, [(b"onetwo", False), (b"three", False), (b"", True)])
            assert await exchange(client, target) == (200, [(b"", True)])
        assert (upstream.connections, client.pool_counts(), client.idle_count()) == (1, (1, 3), 1)


async def test_a_read_to_close_answer_and_a_connection_close_one_are_not_pooled(nursery):
    upstream = RawUpstream([b"HTTP/1.1 200 OK\r\n\r\nto the end"], close_after=True)
    other = RawUpstream([b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"])
    async with make_upstream_client() as client:
        with trio.fail_after(BOUND_S):
            assert await exchange(client, target_for(await upstream.start(nursery))) == (
                200, [(b"to the end", False), (b"", True)])
            assert await exchange(client, target_for(await other.start(nursery))) == (200, [(b"ok", True)])
            await other.closed.wait()  # the client closed it
        assert client.idle_count() == 0


@pytest.mark.parametrize(("answers", "reason", "retryable"), [
    ([b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"], "dropped", True),  # a malformed head
    ([b"HTTP/1.1 200 OK\r\ncontent-"], "dropped", True),  # closed inside the head
    ([b""], "dropped", True),  # closed without a byte
])
async def test_failures_before_the_head_are_dropped_and_retryable(nursery, answers, reason, retryable):
    upstream = RawUpstream(answers, close_after=True)
    url = await upstream.start(nursery)
    async with make_upstream_client() as client:
        with trio.fail_after(BOUND_S), pytest.raises(UpstreamError) as caught:
            await client.open(target_for(url), JSON, b"{}", lambda: None)
        assert (caught.value.reason, caught.value.retryable) == (reason, retryable)
        assert client.idle_count() == 0


async def test_connect_failures_and_unsendable_targets(nursery):
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    async with make_upstream_client() as client:
        cases = [(target_for(f"http://127.0.0.1:{port}"), "connect", True),
                 (target_for("ftp://127.0.0.1:21"), "protocol", True),
                 (target_for("http://127.0.0.1:9", headers={"x-bad": "a\r\nb: c"}), "protocol", False)]
        for target, reason, retryable in cases:
            with trio.fail_after(BOUND_S), pytest.raises(UpstreamError) as caught:
                await client.open(target, JSON, b"{}", lambda: None)
            assert (caught.value.reason, caught.value.retryable) == (reason, retryable)
        assert client.pool_counts() == (0, 0)


async def test_a_break_mid_body_delivers_what_came_then_raises_stream_broken(nursery):
    upstream = RawUpstream([[b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n", 0.05,
                             b"3\r\ndefXX"]], close_after=True)
    url = await upstream.start(nursery)
    async with make_upstream_client() as client:
        answer = await client.open(target_for(url), JSON, b"{}", lambda: None)
        calls = []

        async def keep(data: bytes, last: bool) -> None:
            calls.append((data, last))

        with trio.fail_after(BOUND_S), pytest.raises(UpstreamError) as caught:
            await answer.relay(keep)
        await answer.aclose()
        assert (caught.value.reason, caught.value.retryable) == ("stream_broken", False)
        assert calls == [(b"abc", False), (b"def", False)]
        assert client.idle_count() == 0


async def test_cancelled_mid_body_the_connection_closes_at_once(nursery):
    upstream = RawUpstream([[b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npart", None]])
    url = await upstream.start(nursery)
    async with make_upstream_client() as client:
        answer = await client.open(target_for(url), JSON, b"{}", lambda: None)

        async def discard(data: bytes, last: bool) -> None:
            pass

        with trio.move_on_after(0.1) as scope:
            await answer.relay(discard)
        assert scope.cancelled_caught
        await answer.aclose()
        with trio.fail_after(1.0):
            await upstream.closed.wait()  # the upstream saw the connection end (frees its sequence)
        assert client.idle_count() == 0


async def test_a_connection_the_server_closed_is_polled_only_past_the_unchecked_bound(nursery, mock_clock):
    # The server answers, then closes the connection without saying so (no Connection: close).
    # Reused within UNCHECKED_IDLE_S (1 s) of the server's last bytes, the connection is not
    # polled: the request fails before any response byte, "dropped" and retryable (the front
    # retries it on the next candidate). From 1 s on, the pool polls it, sees the close and
    # opens a new connection: no error.
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    upstream = RawUpstream([ok] * 4, close_after=True)
    url = await upstream.start(nursery)
    target = target_for(url)
    async with make_upstream_client() as client:
        assert await exchange(client, target) == (200, [(b"ok", True)])
        await trio.testing.wait_all_tasks_blocked()  # the server closed its end
        mock_clock.jump(0.999)
        with pytest.raises(UpstreamError) as caught:
            await client.open(target, JSON, b"{}", lambda: None)
        assert (caught.value.reason, caught.value.retryable) == ("dropped", True)
        assert client.pool_counts() == (1, 2)

        assert await exchange(client, target) == (200, [(b"ok", True)])  # a new connection
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(1.0)
        assert await exchange(client, target) == (200, [(b"ok", True)])  # polled: closed, a new one
        assert client.pool_counts() == (3, 4)


def tls_pair() -> tuple[trustme.CA, ssl.SSLContext]:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    return ca, server_ctx


async def test_tls_with_the_given_context_and_default_verification(nursery):
    ca, server_ctx = tls_pair()
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"] * 2
    upstream = RawUpstream(answers)

    async def handle(stream):
        await upstream.handle(trio.SSLStream(stream, server_ctx, server_side=True))

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    url = f"https://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    async with make_upstream_client(verify=trusting) as client:
        with trio.fail_after(BOUND_S):
            for _ in range(2):
                assert await exchange(client, target_for(url)) == (200, [(b"ok", True)])
        assert (upstream.connections, client.pool_counts()) == (1, (1, 2))
    # httpx's default verification (its CA bundle) does not trust a trustme CA.
    async with make_upstream_client() as client:
        with trio.fail_after(BOUND_S), pytest.raises(UpstreamError) as caught:
            await client.open(target_for(url), JSON, b"{}", lambda: None)
        assert (caught.value.reason, caught.value.retryable) == ("connect", True)


async def test_max_idle_per_origin_and_expiry_from_the_servers_last_bytes(nursery, mock_clock):
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    upstream = RawUpstream([ok] * 4)
    url = await upstream.start(nursery)
    target = target_for(url)
    client = UpstreamClient(ssl_context=None, max_idle=2, keepalive_expiry_s=4.0)
    try:
        async with trio.open_nursery() as batch:  # three at once: three connections
            for _ in range(3):
                batch.start_soon(exchange, client, target)
        assert (client.pool_counts(), client.idle_count()) == ((3, 3), 2)  # the third one closed
        mock_clock.jump(4.0)
        assert await exchange(client, target) == (200, [(b"ok", True)])  # both expired: a new one
        assert (client.pool_counts(), client.idle_count()) == ((4, 4), 1)
    finally:
        await client.aclose()
    assert client.idle_count() == 0


async def test_an_answer_sent_before_the_request_was_taken_whole_is_still_read(nursery):
    # The upstream answers 413 after the head and closes without reading the 8 MiB body: the
    # send fails, and the answer that arrived is what the client gets (as httpcore read it).
    async def rejects_early(stream: trio.SocketStream) -> None:
        request = b""
        while b"\r\n\r\n" not in request:
            request += await stream.receive_some(65536)
        await stream.send_all(b"HTTP/1.1 413 Too Large\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbig")
        await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, rejects_early, 0, host="127.0.0.1"))
    url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
    async with make_upstream_client() as client:
        with trio.fail_after(BOUND_S):
            answer = await client.open(target_for(url), JSON, b"x" * (8 << 20), lambda: None)
            calls = []

            async def keep(data: bytes, last: bool) -> None:
                calls.append((data, last))

            await answer.relay(keep)
            await answer.aclose()
        assert (answer.status, calls, client.idle_count()) == (413, [(b"big", True)], 0)


async def test_an_upstream_flooding_interim_responses_cannot_hold_the_event_loop(nursery):
    # A thread floods 1xx heads faster than they are parsed, so a read always finds bytes: the
    # head loop still checkpoints, and the caller's bound ends the wait on time (a loop that
    # never yields would run until the flood stops, 5 s later, with every other task stalled).
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def flood() -> None:
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            interim = b"HTTP/1.1 100 Continue\r\n\r\n" * 2000
            stop = time.monotonic() + 5.0
            try:
                while time.monotonic() < stop:
                    connection.sendall(interim)
            except OSError:
                pass

    thread = threading.Thread(target=flood, daemon=True)
    thread.start()
    async with make_upstream_client() as client:
        started = time.monotonic()
        with trio.move_on_after(0.3) as bound:
            await client.open(target_for(f"http://127.0.0.1:{port}"), JSON, b"{}", lambda: None)
        assert bound.cancelled_caught and time.monotonic() - started < 1.0
    thread.join(6.0)
    server.close()
