"""The scrape pool on trio's MockClock: the 16-at-once bound, per-provider timeouts, the
body cap, failure classes, and pass scheduling (no overlap, start-to-start interval)."""

from __future__ import annotations

import ssl

import httpx
import pytest
import trio

from gridd.operator.scrape import ScrapePool, ScrapeTarget, scrape_one

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
        pool = ScrapePool(client, concurrency=16, body_cap=CAP,
                          on_result=lambda r: results.__setitem__(r.provider, r))
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
            result = await scrape_one(client, ScrapeTarget(host, f"http://{host}/m", 5.0), CAP)
            got[host] = result.failure_class
    assert got == {"refused": "connect", "tls": "tls", "slow": "timeout", "reset": "connect",
                   "status5xx": "http_status"}


async def test_passes_start_one_interval_apart_and_never_overlap(autojump_clock):
    delays = {"a": 0.25}
    starts = []
    async with httpx.AsyncClient(transport=transport(delays)) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=lambda r: None,
                          on_pass=lambda start, duration: starts.append((start, duration)))
        origin = trio.current_time()

        def next_targets():
            # the third pass is slow (1.75 s): the fourth starts when it ends, not before
            delays["a"] = 1.75 if len(starts) == 2 else 0.25
            return targets("a", timeout_s=5.0)

        with trio.move_on_after(6.0):
            await pool.run(lambda: 1.0, next_targets)
    assert [(s - origin, d) for s, d in starts] == [
        (0.0, 0.25), (1.0, 0.25), (2.0, 1.75), (3.75, 0.25), (4.75, 0.25),
    ]


async def test_a_target_httpx_cannot_send_fails_alone_and_a_result_bug_stops_nothing(autojump_clock):
    results = {}

    def on_result(result):
        if result.provider == "buggy":
            raise RuntimeError("bug on one provider's result path")
        results[result.provider] = result

    async with httpx.AsyncClient(transport=transport({})) as client:
        pool = ScrapePool(client, concurrency=16, body_cap=CAP, on_result=on_result)
        await pool.run_pass([
            ScrapeTarget("bad-url", "http://[::1/metrics", 2.0),
            ScrapeTarget("bad-header", "http://ok/metrics", 2.0, {"authorization": "Bearer clé\u2603"}),
            ScrapeTarget("buggy", "http://ok/metrics", 2.0),
            ScrapeTarget("fine", "http://ok/metrics", 2.0),
        ])
    assert results["bad-url"].failure_class == "connect"
    assert results["bad-header"].failure_class == "connect"
    assert results["fine"].failure_class is None
    assert pool.result_errors == 1
