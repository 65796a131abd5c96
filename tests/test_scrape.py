"""The scrape pool on trio's MockClock: the 16-at-once bound, per-provider timeouts, the
body cap, failure classes, and pass scheduling (no overlap, start-to-start interval)."""

from __future__ import annotations

import contextlib
import gzip
import logging
import ssl
import zlib

import httpx
import pytest
import trio
import trio.testing
import trustme
from hypothesis import given, settings
from hypothesis import strategies as st

from gridd.operator.http1 import (
    HEAD_MAX,
    BodyCapExceeded,
    ProtocolError,
    ResponseParser,
    ScrapeClient,
    UndecodableBody,
)
from gridd.operator.scrape import ScrapePool, ScrapeResult, ScrapeTarget, overrunning_after, scrape_one

CAP = 1024 * 1024


def transport(delays: dict[str, float], bodies: dict[str, bytes] | None = None, fail: dict | None = None):
    bodies = bodies or {}
    fail = fail or {}

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in fail:
            raise fail[host]
        delay = delays.get(host, 0.0)
        if delay == float("inf"):
            await trio.sleep_forever()
        await trio.sleep(delay)
        if host.startswith("status"):
            return httpx.Response(503, content=b"busy")
        return httpx.Response(200, content=bodies.get(host, b"up 1\n"))

    return httpx.MockTransport(handler)


def targets(*hosts: str, timeout_s: float = 2.0) -> list[ScrapeTarget]:
    return [ScrapeTarget(h, f"http://{h}/metrics", timeout_s) for h in hosts]


async def test_seventeen_slow_providers_run_at_most_sixteen_at_once(autojump_clock):
    hosts = [f"p{i}" for i in range(17)]
    results = []
    async with httpx.AsyncClient(transport=transport({h: 1.5 for h in hosts})) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=results.append)
        start = trio.current_time()
        duration = await pool.run_pass(targets(*hosts))
    assert pool.max_in_flight_seen == 16
    # 16 finish at 1.5 s; the 17th waits for a slot, starts at 1.5 s and ends at 3.0 s.
    assert sorted(r.finished_at - start for r in results) == [1.5] * 16 + [3.0]
    assert duration == 3.0
    assert all(r.failure_class is None for r in results)


async def test_a_hanging_provider_does_not_delay_the_others(autojump_clock):
    results = {}
    async with httpx.AsyncClient(transport=transport({"hang": float("inf"), "a": 0.1, "b": 0.2})) as client:
        pool = ScrapePool(
            client, concurrency=16, body_cap=CAP, on_result=lambda r: results.__setitem__(r.provider, r)
        )
        start = trio.current_time()
        duration = await pool.run_pass(targets("hang", "a", "b", timeout_s=2.0))
    assert results["a"].finished_at - start == 0.1 and results["b"].finished_at - start == 0.2
    assert results["hang"].failure_class == "timeout"
    assert results["hang"].finished_at - start == 2.0
    # the pass waits for its slowest scrape, bounded by that provider's timeout
    assert duration == 2.0


@pytest.mark.parametrize(
    ("size", "failure"),
    [(CAP, None), (CAP + 1, "body_cap"), (10 * CAP, "body_cap"), (0, None)],
)
async def test_body_cap_counts_decoded_bytes(size, failure):
    async with httpx.AsyncClient(transport=transport({}, bodies={"x": b"#" * size})) as client:
        result = await scrape_one(client, ScrapeTarget("x", "http://x/metrics", 5.0), CAP)
    assert result.failure_class == failure
    assert (result.body is None) == (failure is not None)


async def test_failure_classes():
    tls_error = httpx.ConnectError("handshake failed")
    tls_error.__cause__ = ssl.SSLCertVerificationError("certificate verify failed")
    fail = {
        "refused": httpx.ConnectError("connection refused"),
        "tls": tls_error,
        "slow": httpx.ReadTimeout("read timed out"),
        "reset": httpx.RemoteProtocolError("peer closed connection"),
    }
    async with httpx.AsyncClient(transport=transport({}, fail=fail)) as client:
        got = {}
        for host in ("refused", "tls", "slow", "reset", "status5xx"):
            got[host] = (
                await scrape_one(client, ScrapeTarget(host, f"http://{host}/m", 5.0), CAP)
            ).failure_class
    assert got == {
        "refused": "connect",
        "tls": "tls",
        "slow": "timeout",
        "reset": "connect",
        "status5xx": "http_status",
    }


async def test_one_worker_bounds_each_scrape_by_its_own_timeout_through_timeouts_and_late_answers(
    autojump_clock,
):
    # A pass on one slot: each scrape's timeout runs from its own start, whatever the scrapes
    # before it did on the same worker: an answer that arrives after its deadline passed
    # without cancelling it (shielded here) stands, a hang times out exactly, and the next
    # scrapes keep their own full timeouts.
    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host == "late":
            with trio.CancelScope(shield=True):
                await trio.sleep(3.0)
        elif host == "hang":
            await trio.sleep_forever()
        else:
            await trio.sleep(1.5)
        return httpx.Response(200, content=host.encode())

    results = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        pool = ScrapePool(client, concurrency=1, body_cap=CAP, on_result=results.append)
        start = trio.current_time()
        duration = await pool.run_pass(targets("late", "hang", "a", "hang", "b", timeout_s=2.0))
    assert [(r.provider, r.finished_at - start, r.duration_s, r.failure_class, r.body) for r in results] == [
        ("late", 3.0, 3.0, None, b"late"),
        ("hang", 5.0, 2.0, "timeout", None),
        ("a", 6.5, 1.5, None, b"a"),
        ("hang", 8.5, 2.0, "timeout", None),
        ("b", 10.0, 1.5, None, b"b"),
    ]
    assert duration == 10.0 and pool.max_in_flight_seen == 1


@pytest.mark.parametrize("lean", [False, True], ids=["httpx", "lean"])
async def test_a_result_handler_is_never_cut_by_a_deadline_and_never_holds_up_the_scrapes(
    autojump_clock, lean
):
    # One slot, each provider answering after 1.5 s, timeouts 2 s. The handler of "a" returns
    # nothing (it waited for nothing); those of "b" and "c" wait 3 s, past their scrapes'
    # deadlines. None is cut, nothing times out, each scrape keeps its own full timeout from
    # its own start, and the worker scrapes on while the results are handled: b starts when
    # a ends, c when b ends. A waiting handler holds up only the handing on of the results
    # after it; the pass ends once the last one is handled.
    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.sleep(1.5)
        return httpx.Response(200, content=request.url.host.encode())

    async def serve(stream, host):
        while await read_request(stream) is not None:
            await trio.sleep(1.5)
            await stream.send_all(answer(host.encode()))

    results, handled = [], []

    async def slow_handling(result: ScrapeResult) -> None:
        await trio.sleep(3.0)
        handled.append((result.provider, trio.current_time() - start))

    def on_result(result: ScrapeResult):
        results.append(result)
        if result.provider == "a":
            handled.append(("a", trio.current_time() - start))
            return None
        return slow_handling(result)

    async with trio.open_nursery() as nursery:
        client = (ScrapeClient(open_stream=FakeProviders(nursery, serve).open_stream) if lean
                  else httpx.AsyncClient(transport=httpx.MockTransport(handler)))
        async with client:
            pool = ScrapePool(client, concurrency=1, body_cap=CAP, on_result=on_result)
            start = trio.current_time()
            duration = await pool.run_pass(targets("a", "b", "c", timeout_s=2.0))
        nursery.cancel_scope.cancel()
    assert [(r.provider, r.finished_at - start, r.duration_s, r.failure_class, r.body) for r in results] == [
        ("a", 1.5, 1.5, None, b"a"),
        ("b", 3.0, 1.5, None, b"b"),
        ("c", 4.5, 1.5, None, b"c"),
    ]
    # b is handed on at 3.0 (its handler ends at 6.0), c, which waited, at 6.0.
    assert handled == [("a", 1.5), ("b", 6.0), ("c", 9.0)]
    assert duration == 9.0 and pool.result_errors == 0


async def test_results_are_handed_on_in_finishing_order_at_most_one_round_every_hand_on_every_s(
    autojump_clock,
):
    # All six scrapes start at 0. The first result after a quiet spell goes at once (p1, p4);
    # one finishing within 50 ms of the last round waits for the next round, with whatever
    # finished meanwhile (p2 and p3 at 0.15, p5 at 0.35); the last worker's end hands the
    # rest on at once (p6 at 0.37, not 0.40). finished_at stays when each scrape ended.
    delays = {"p1": 0.10, "p2": 0.12, "p3": 0.13, "p4": 0.30, "p5": 0.31, "p6": 0.37}
    handed = []
    async with httpx.AsyncClient(transport=transport(delays)) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, hand_on_every_s=0.05,
                          on_result=lambda r: handed.append((r.provider, r.finished_at - start,
                                                             trio.current_time() - start)))
        start = trio.current_time()
        duration = await pool.run_pass(targets(*delays))
    assert handed == [
        ("p1", pytest.approx(0.10), pytest.approx(0.10)),
        ("p2", pytest.approx(0.12), pytest.approx(0.15)),
        ("p3", pytest.approx(0.13), pytest.approx(0.15)),
        ("p4", pytest.approx(0.30), pytest.approx(0.30)),
        ("p5", pytest.approx(0.31), pytest.approx(0.35)),
        ("p6", pytest.approx(0.37), pytest.approx(0.37)),
    ]
    assert duration == pytest.approx(0.37)


async def test_the_hand_on_gap_is_at_most_a_twentieth_of_the_scrape_interval(autojump_clock):
    async with httpx.AsyncClient(transport=transport({})) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=lambda r: None)
        gaps = {}
        for interval in (0.4, 5.0):
            with trio.move_on_after(interval / 2):
                await pool.run(lambda interval=interval: interval, lambda: targets("a"))
            gaps[interval] = pool.hand_on_gap_s
        await pool.run_pass(targets("a"))  # no interval: the pool's own bound
        gaps[None] = pool.hand_on_gap_s
    assert gaps == {0.4: pytest.approx(0.02), 5.0: 0.05, None: 0.05}


async def test_passes_start_one_interval_apart_and_never_overlap(autojump_clock):
    delays = {"a": 0.25}
    starts = []
    async with httpx.AsyncClient(transport=transport(delays)) as client:
        pool = ScrapePool(
            client,
            concurrency=16,
            body_cap=CAP,
            on_result=lambda r: None,
            on_pass=lambda start, duration: starts.append((start, duration)),
        )
        origin = trio.current_time()

        def next_targets():
            # the third pass is slow (1.75 s): the fourth starts when it ends, not before
            delays["a"] = 1.75 if len(starts) == 2 else 0.25
            return targets("a", timeout_s=5.0)

        with trio.move_on_after(6.0):
            await pool.run(lambda: 1.0, next_targets)
    assert [(s - origin, d) for s, d in starts] == [
        (0.0, 0.25),
        (1.0, 0.25),
        (2.0, 1.75),
        (3.75, 0.25),
        (4.75, 0.25),
    ]


@pytest.mark.parametrize(
    ("overrunning", "duration", "after"),
    [(False, 1.0, False), (False, 1.01, True), (True, 1.5, True), (True, 0.91, True), (True, 0.9, False),
     (False, 0.2, False)],
)
def test_passes_overrun_past_the_interval_and_fit_again_at_nine_tenths(overrunning, duration, after):
    assert overrunning_after(overrunning, duration, 1.0) is after


async def test_passes_overrunning_the_interval_log_one_warning_and_one_line_when_they_fit_again(
    autojump_clock, caplog
):
    caplog.set_level(logging.INFO, logger="gridd.scrape")
    delays = {"a": 0.25, "b": 0.1}
    # Pass by pass: fits, overruns (b slowest), still over, 0.95 s (over 9/10: no line), fits.
    a_delays = iter([0.25, 0.3, 0.3, 0.95, 0.25])
    b_delays = iter([0.1, 1.75, 1.5, 0.1, 0.1])
    async with httpx.AsyncClient(transport=transport(delays)) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=lambda r: None)

        def next_targets():
            delays["a"], delays["b"] = next(a_delays), next(b_delays)
            return targets("a", "b", timeout_s=5.0)

        with trio.move_on_after(1.0 + 1.75 + 1.5 + 0.95 + 0.5):
            await pool.run(lambda: 1.0, next_targets)
    assert pool.passes == 5 and not pool.overrunning
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "gridd.scrape"]
    assert lines == [
        (logging.WARNING, "scrape pass took 1.75 s, longer than timings.scrape_interval_s 1 (2 providers, at "
                          "most 16 at once; slowest scrape 1.75 s, provider b): each provider is read once a "
                          "pass, not once an interval; for many providers raise timings.scrape_concurrency, "
                          "for a slow one see its metrics.timeout_s (docs/scaling.md)"),
        (logging.INFO, "scrape passes fit the interval again: 0.25 s for timings.scrape_interval_s 1"),
    ]


async def test_passes_flapping_around_the_interval_log_at_most_four_lines_a_minute(autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="gridd.scrape")
    delays = {"a": 0.25}
    passes = iter(range(100))
    async with httpx.AsyncClient(transport=transport(delays)) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=lambda r: None)

        def next_targets():
            delays["a"] = 1.5 if next(passes) % 2 else 0.25  # over, then fits, pass after pass
            return targets("a", timeout_s=5.0)

        # A 1.5 s pass delays the next, which starts as it ends; a fitting one keeps the 1 s
        # schedule: after the first pass, a pair every 2.5 s. 35 passes end within 44 s, each from
        # the second on a change of state: four lines, the budget of a minute.
        with trio.move_on_after(44.0):
            await pool.run(lambda: 1.0, next_targets)
    lines = [r.getMessage() for r in caplog.records if r.name == "gridd.scrape"]
    assert pool.passes == 35
    assert len(lines) == 4
    assert lines[0].startswith("scrape pass took 1.50 s")
    assert lines[1].startswith("scrape passes fit the interval")


async def test_a_target_httpx_cannot_send_fails_alone_and_a_result_bug_stops_nothing(autojump_clock):
    results = {}

    def on_result(result):
        if result.provider == "buggy":
            raise RuntimeError("bug on one provider's result path")
        results[result.provider] = result

    async with httpx.AsyncClient(transport=transport({})) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=on_result)
        await pool.run_pass(
            [
                ScrapeTarget("bad-url", "http://[::1/metrics", 2.0),
                ScrapeTarget("bad-header", "http://ok/metrics", 2.0, {"authorization": "Bearer clé\u2603"}),
                ScrapeTarget("buggy", "http://ok/metrics", 2.0),
                ScrapeTarget("fine", "http://ok/metrics", 2.0),
            ]
        )
    assert results["bad-url"].failure_class == "connect"
    assert results["bad-header"].failure_class == "connect"
    assert results["fine"].failure_class is None
    assert pool.result_errors == 1


# --- the lean client: gridd.operator.http1 ----------------------------------------------------
#
# ResponseParser is sans-IO, so its framing is tested on bytes: whole, split at every byte
# boundary, split at random points (hypothesis), with trailing bytes. ScrapeClient is tested
# over in-memory streams on the MockClock (STYLE 12, 13): a fake provider serves each
# connection the client opens.

BODY = b'up 1\nreqs_total{code="200"} 7\n'
OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"

# (case, response bytes, body, connection reusable after it)
GOOD_RESPONSES = [
    ("content-length", OK_HEAD + b"content-length: %d\r\n\r\n" % len(BODY) + BODY, BODY, True),
    ("content-length, empty", OK_HEAD + b"content-length: 0\r\n\r\n", b"", True),
    (
        "repeated equal content-length",
        OK_HEAD + b"content-length: %d, %d\r\n\r\n" % (len(BODY), len(BODY)) + BODY,
        BODY,
        True,
    ),
    (
        "chunked with extension and trailers",
        OK_HEAD
        + b"transfer-encoding: chunked\r\n\r\n5;name=v\r\nup 1\n\r\n"
        + b"%x\r\n" % (len(BODY) - 5)
        + BODY[5:]
        + b"\r\n0\r\nx-trailer: 1\r\n\r\n",
        BODY,
        True,
    ),
    (
        "chunked wins over content-length",
        OK_HEAD
        + b"content-length: 3\r\ntransfer-encoding: Chunked\r\n\r\n"
        + b"%X\r\n" % len(BODY)
        + BODY
        + b"\r\n0\r\n\r\n",
        BODY,
        True,
    ),
    ("no content-length: read to close", OK_HEAD + b"\r\n" + BODY, BODY, False),
    ("LF line endings", b"HTTP/1.1 200 OK\ncontent-length: %d\n\n" % len(BODY) + BODY, BODY, True),
    (
        "interim 100 then 200, obs-fold header",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nx-folded: a\r\n b\r\ncontent-length: %d\r\n\r\n"
        % len(BODY)
        + BODY,
        BODY,
        True,
    ),
    ("204", b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
    (
        "connection: close",
        OK_HEAD + b"connection: keep-alive, close\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY,
        BODY,
        False,
    ),
    ("HTTP/1.0", b"HTTP/1.0 200 OK\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY, BODY, False),
    (
        "gzip anyway",
        OK_HEAD
        + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(gzip.compress(BODY))
        + gzip.compress(BODY),
        BODY,
        True,
    ),
    ("raw deflate", OK_HEAD + b"content-encoding: deflate\r\n\r\n" + zlib.compress(BODY)[2:-4], BODY, False),
]

# (case, response bytes, the ProtocolError's message contains)
MALFORMED_RESPONSES = [
    ("not HTTP", b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "malformed status line"),
    ("four-digit status", b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
    ("HTTP/2 status line", b"HTTP/2 200\r\n\r\n", "malformed status line"),
    ("header without colon", b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    ("space before colon", b"HTTP/1.1 200 OK\r\ncontent-length : 3\r\n\r\nabc", "malformed header line"),
    (
        "conflicting content-length",
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
        "malformed Content-Length",
    ),
    ("negative content-length", b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n", "malformed Content-Length"),
    (
        "transfer coding other than chunked",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
        "unsupported",
    ),
    (
        "bad chunk size",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        "malformed chunk-size",
    ),
    (
        "chunk longer than its size",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        "longer than its chunk-size",
    ),
    ("truncated body", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", "7 body bytes still expected"),
    (
        "truncated chunked body",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nab",
        "inside a chunked",
    ),
    ("truncated head", b"HTTP/1.1 200 OK\r\ncontent-le", "before a complete response head"),
    ("nothing at all", b"", "without a response"),
    ("switching protocols", b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"),
]


def feed(parts, cap: int = CAP) -> ResponseParser:
    """A parser fed ``parts`` in order, then the end of the connection if it is not done."""
    parser = ResponseParser(cap)
    for part in parts:
        parser.receive_data(part)
    if not parser.done:
        parser.receive_eof()
    return parser


def split_at(raw: bytes, cuts) -> list[bytes]:
    points = [0, *sorted(cuts), len(raw)]
    return [raw[a:b] for a, b in zip(points, points[1:], strict=False)]


def outcome(parts, cap: int = CAP):
    try:
        parser = feed(parts, cap)
    except (ProtocolError, BodyCapExceeded, UndecodableBody) as exc:
        return type(exc).__name__, str(exc)
    return parser.status, parser.body(), parser.reusable


@pytest.mark.parametrize(
    ("raw", "body", "reusable"), [c[1:] for c in GOOD_RESPONSES], ids=[c[0] for c in GOOD_RESPONSES]
)
def test_parser_reads_every_framing_whole_and_split_at_every_byte(raw, body, reusable):
    status = 204 if raw.startswith(b"HTTP/1.1 204") else 200
    assert outcome([raw]) == (status, body, reusable)
    for cut in range(len(raw) + 1):
        assert outcome(split_at(raw, [cut])) == (status, body, reusable), cut
    assert outcome([bytes([b]) for b in raw]) == (status, body, reusable)


@pytest.mark.parametrize(
    ("raw", "message"), [c[1:] for c in MALFORMED_RESPONSES], ids=[c[0] for c in MALFORMED_RESPONSES]
)
def test_parser_names_what_is_malformed_whole_and_split(raw, message):
    whole = outcome([raw])
    assert whole[0] == "ProtocolError" and message in whole[1]
    for cut in range(len(raw) + 1):
        assert outcome(split_at(raw, [cut])) == whole, cut


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_parser_gives_the_same_answer_for_any_byte_split(data):
    raw = data.draw(st.sampled_from([c[1] for c in GOOD_RESPONSES + MALFORMED_RESPONSES]))
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    cap = data.draw(st.sampled_from([CAP, len(BODY), len(BODY) - 1, 4]))
    assert outcome(split_at(raw, cuts), cap) == outcome([raw], cap)


def test_bytes_after_a_complete_response_make_the_connection_unusable():
    raw = GOOD_RESPONSES[0][1]
    assert outcome([raw + b"HTTP/1.1 200 OK\r\n"]) == (200, BODY, False)
    assert outcome([raw, b"junk"]) == (200, BODY, False)


def test_a_head_over_the_limit_is_malformed_without_waiting_for_its_end():
    parser = ResponseParser(CAP)
    with pytest.raises(ProtocolError, match="response head over"):
        parser.receive_data(b"HTTP/1.1 200 OK\r\nx: " + b"a" * HEAD_MAX)


def test_a_non_2xx_status_ends_the_response_at_its_head():
    parser = ResponseParser(CAP)
    parser.receive_data(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 100000000\r\n\r\n")
    assert (parser.done, parser.status, parser.reusable) == (True, 503, False)


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close", "gzip"])
def test_body_cap_exact_is_accepted_one_more_is_refused_and_nothing_past_it_is_kept(framing):
    def response(body: bytes) -> bytes:
        if framing == "content-length":
            return OK_HEAD + b"content-length: %d\r\n\r\n" % len(body) + body
        if framing == "chunked":
            chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)]
            return (
                OK_HEAD
                + b"transfer-encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
                + b"0\r\n\r\n"
            )
        if framing == "gzip":
            packed = gzip.compress(body)
            return OK_HEAD + b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n" % len(packed) + packed
        return OK_HEAD + b"\r\n" + body

    cap = 64 * 1024
    assert outcome([response(b"#" * cap)], cap) == (200, b"#" * cap, framing != "close")
    assert outcome([response(b"#" * (cap + 1))], cap)[0] == "BodyCapExceeded"
    # 10 MiB, arriving in 64 KiB reads: refused at the read that passes the cap, with at
    # most the cap's worth of body kept.
    raw = response(b"#" * (10 * 1024 * 1024))
    parser = ResponseParser(cap)
    with pytest.raises(BodyCapExceeded):
        for offset in range(0, len(raw), 64 * 1024):
            parser.receive_data(raw[offset : offset + 64 * 1024])
            assert sum(len(part) for part in parser._parts) <= cap
    assert offset < (cap + 2 * 64 * 1024 if framing != "gzip" else len(raw))


def test_content_length_over_the_cap_is_refused_before_any_body_byte():
    parser = ResponseParser(1000)
    with pytest.raises(BodyCapExceeded, match="Content-Length 10485760"):
        parser.receive_data(OK_HEAD + b"content-length: 10485760\r\n\r\n")


def test_a_body_that_does_not_decompress_is_undecodable():
    raw = OK_HEAD + b"content-encoding: gzip\r\ncontent-length: 9\r\n\r\nnot gzip!"
    assert outcome([raw])[0] == "UndecodableBody"


class FakeProviders:
    """``open_stream`` for ScrapeClient: each connection is an in-memory stream pair whose
    provider end runs ``serve(stream, host)`` in the test's nursery."""

    def __init__(self, nursery: trio.Nursery, serve) -> None:
        self.nursery = nursery
        self.serve = serve
        self.opened: list[tuple[str, int]] = []
        self.closed = 0

    async def open_stream(self, host: str, port: int):
        if host == "refused":
            raise ConnectionRefusedError(111, "Connection refused")
        if host == "empty..label":
            "empty..label".encode("idna")  # what trio's getaddrinfo does first: UnicodeError
        client_end, provider_end = trio.testing.memory_stream_pair()
        self.opened.append((host, port))
        self.nursery.start_soon(self._serve, provider_end, host)
        return client_end

    async def _serve(self, stream, host: str) -> None:
        try:
            await self.serve(stream, host)
        finally:
            self.closed += 1
            await trio.aclose_forcefully(stream)


async def read_request(stream) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
    return data


def answer(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return OK_HEAD + extra + b"content-length: %d\r\n\r\n" % len(body) + body


async def test_the_lean_client_keeps_one_connection_per_provider_alive_across_scrapes(autojump_clock):
    requests = []

    async def serve(stream, host):
        while (request := await read_request(stream)) is not None:
            requests.append(request)
            await trio.sleep(0.01)
            await stream.send_all(answer())

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream) as client:
            results = []
            pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=results.append)
            for _ in range(3):
                await pool.run_pass(targets("a", "b"))
            assert [r.body for r in results] == [BODY] * 6
            assert providers.opened == [("a", 80), ("b", 80)]
            assert (client.connections_opened, client.reused) == (2, 4)
        nursery.cancel_scope.cancel()
    assert requests[0].split(b"\r\n")[:2] == [b"GET /metrics HTTP/1.1", b"host: a"]
    assert b"accept-encoding: identity\r\n" in requests[0]


async def test_an_idle_connection_the_provider_closed_is_retried_once_on_a_new_one(autojump_clock):
    async def serve(stream, host):
        # Answers one request, then closes (as a provider's keep-alive timeout does).
        if await read_request(stream) is not None:
            await stream.send_all(answer())

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream) as client:
            for _ in range(3):
                assert await client.get_capped("http://a/metrics", {}, CAP) == (BODY, None, "")
                await trio.sleep(1.0)
            assert client.connections_opened == 3
        nursery.cancel_scope.cancel()


async def test_an_idle_connection_past_the_keepalive_expiry_is_not_used(autojump_clock):
    async def serve(stream, host):
        while await read_request(stream) is not None:
            await stream.send_all(answer())

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream, keepalive_expiry_s=5.0) as client:
            for pause in (5.0, 5.5, 1.0):
                assert (await client.get_capped("http://a/metrics", {}, CAP))[0] == BODY
                await trio.sleep(pause)
            # idle 5.0 s: reused; idle 5.5 s: a new connection; idle 1 s: reused.
            assert (client.connections_opened, client.reused) == (2, 1)
            await trio.sleep(0.0)
            assert providers.closed == 1
        nursery.cancel_scope.cancel()


async def test_the_lean_client_maps_failures_like_the_httpx_path_and_closes_the_connection(autojump_clock):
    responses = {
        "status5xx": b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy",
        "garbage": b"<html>not http</html>\r\n\r\n",
        "reset": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial",
        "huge": b"HTTP/1.1 200 OK\r\ncontent-length: 10485760\r\n\r\n",
        "chunked-huge": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    }

    async def serve(stream, host):
        await read_request(stream)
        if host == "hang":
            assert await stream.receive_some() == b""  # until the client closes
            return
        await stream.send_all(responses[host])
        if host == "chunked-huge":
            # 10 MiB in 64 KiB chunks, for as long as the client reads
            chunk = b"10000\r\n" + b"#" * 0x10000 + b"\r\n"
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for _ in range(160):
                    await stream.send_all(chunk)

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream) as client:
            got = {}
            for host in (
                "refused",
                "empty..label",
                "status5xx",
                "garbage",
                "reset",
                "huge",
                "chunked-huge",
                "hang",
            ):
                result = await scrape_one(client, ScrapeTarget(host, f"http://{host}/m", 2.0), CAP)
                got[host] = (result.failure_class, result.detail, result.duration_s)
            await trio.sleep(0.0)
            # Every connection that failed was closed, none kept idle.
            assert providers.closed == len(providers.opened) == 6
            assert client._idle_count == 0
        nursery.cancel_scope.cancel()
    # A host name IDNA refuses fails alone, like an unreachable one (the codec's wording varies).
    failure, detail, duration = got.pop("empty..label")
    assert (failure, duration) == ("connect", 0.0) and detail.startswith(
        "cannot send the request: UnicodeError"
    )
    assert got == {
        "refused": ("connect", "ConnectionRefusedError: [Errno 111] Connection refused", 0.0),
        "status5xx": ("http_status", "HTTP 503", 0.0),
        "garbage": ("connect", "malformed response: malformed status line b'<html>not http</html>'", 0.0),
        "reset": ("connect", "malformed response: connection closed with 93 body bytes still expected", 0.0),
        "huge": ("body_cap", f"body over {CAP} bytes", 0.0),
        "chunked-huge": ("body_cap", f"body over {CAP} bytes", 0.0),
        # the caller's timeout, exactly
        "hang": ("timeout", "no answer within 2 s", 2.0),
    }


async def test_a_target_the_lean_client_cannot_send_fails_alone(autojump_clock):
    async def serve(stream, host):
        raise AssertionError("nothing may be sent")

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream) as client:
            for url, headers in (
                ("http://[::1/metrics", {}),
                ("ftp://a/metrics", {}),
                ("http://a:99999/m", {}),
                ("http://ok/metrics", {"authorization": "Bearer clé\u2603"}),
                ("http://ok/metrics", {"x-injected": "a\r\nhost: evil"}),
            ):
                body, failure, detail = await client.get_capped(url, headers, CAP)
                assert (body, failure) == (None, "connect") and detail.startswith("cannot send the request")
        assert providers.opened == []
        nursery.cancel_scope.cancel()


@pytest.fixture(scope="module")
def provider_ca():
    return trustme.CA()


@pytest.mark.parametrize("trusted", [True, False])
async def test_tls_targets_verify_with_the_given_context_and_tls_failures_are_classified(
    provider_ca, trusted
):
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    provider_ca.issue_cert("provider.test").configure_cert(server_context)
    client_context = ssl.create_default_context()
    if trusted:
        provider_ca.configure_trust(client_context)

    async def serve(stream, host):
        tls = trio.SSLStream(stream, server_context, server_side=True)
        with contextlib.suppress(trio.BrokenResourceError):
            while await read_request(tls) is not None:
                await tls.send_all(answer())

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream, verify=client_context) as client:
            first = await client.get_capped("https://provider.test:8443/metrics", {}, CAP)
            second = await client.get_capped("https://provider.test:8443/metrics", {}, CAP)
        nursery.cancel_scope.cancel()
    if trusted:
        assert first == second == (BODY, None, "")
        assert (client.connections_opened, client.reused) == (1, 1)
    else:
        assert first[1] == "tls" and "certificate verify failed" in first[2]
        assert providers.opened == [("provider.test", 8443)] * 2


async def test_the_request_carries_path_query_host_port_and_credentials(autojump_clock):
    heads = {}

    async def serve(stream, host):
        heads[host] = await read_request(stream)
        await stream.send_all(answer())

    async with trio.open_nursery() as nursery:
        providers = FakeProviders(nursery, serve)
        async with ScrapeClient(open_stream=providers.open_stream) as client:
            for url, headers in (
                ("http://[::1]:9100/metrics?pool=a%20b", {"Authorization": "Bearer k"}),
                ("http://user:p%40ss@basic:80", {}),
            ):
                assert (await client.get_capped(url, headers, CAP))[0] == BODY
        nursery.cancel_scope.cancel()
    assert providers.opened == [("::1", 9100), ("basic", 80)]
    assert heads["::1"].split(b"\r\n")[:2] == [b"GET /metrics?pool=a%20b HTTP/1.1", b"host: [::1]:9100"]
    assert b"\r\nauthorization: Bearer k\r\n" in heads["::1"]
    # userinfo becomes Basic credentials (user:p@ss), the default port stays out of host
    assert heads["basic"].split(b"\r\n")[:2] == [b"GET / HTTP/1.1", b"host: basic"]
    assert b"\r\nauthorization: Basic dXNlcjpwQHNz\r\n" in heads["basic"]
