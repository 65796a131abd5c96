"""Readiness verdict (gridd.core.readiness): table-driven event sequences with exact times.

Each case is a list of steps:
    ("ok", now, ready_endpoints, engine_answered)   a successful scrape
    ("fail", now, failure_class)                    a failed scrape
    ("v", now, ready, reason, failure_class)        expected verdict at now
Unless a case says otherwise the tracker starts at 0, stale_after_s is 10 (the default
staleMetricsSeconds, TTL 20 s / 2) and the provider is not Unavailable.
"""

from __future__ import annotations

import pytest

from gridd.core.derivation import WANTED_SAMPLES
from gridd.core.exposition import parse_exposition
from gridd.core.latency import LatencyWindow
from gridd.core.readiness import (
    DEFAULT_STALE_METRICS_S,
    ReadinessTracker,
    Verdict,
    default_stale_metrics_s,
    effective_stale_after_s,
    readiness_floor_s,
)


def run(steps, *, stale_after_s: float = DEFAULT_STALE_METRICS_S, unavailable: bool = False):
    tracker = ReadinessTracker(created_at=0.0)
    for step in steps:
        kind, now, *rest = step
        if kind == "ok":
            ready_endpoints, answered = rest
            tracker.on_scrape(now, ready_endpoints=ready_endpoints, engine_answered=answered)
        elif kind == "fail":
            tracker.on_scrape_failure(now, rest[0])
        else:
            ready, reason, failure_class = rest
            got = tracker.verdict(now, stale_after_s=stale_after_s, unavailable=unavailable)
            assert (now, got.ready, got.reason, got.failure_class) == (now, ready, reason, failure_class), got
            assert got.message
    return tracker


CASES = {
    "ready": [
        ("ok", 1.0, 4, False),
        ("v", 1.0, True, "EndpointsReady", None),
    ],
    "zero once is still ready": [
        ("ok", 1.0, 4, False),
        ("ok", 2.0, 0, False),
        ("v", 2.0, True, "ZeroReadyUnconfirmed", None),
        ("ok", 3.0, 4, False),
        ("v", 3.0, True, "EndpointsReady", None),
    ],
    "zero twice with no engine answer in 30 s is not ready, and rejoins on a count": [
        ("ok", 1.0, 0, False),
        ("v", 1.0, True, "ZeroReadyUnconfirmed", None),
        ("ok", 2.0, 0, False),
        ("v", 2.0, False, "ZeroReadyEndpoints", None),
        ("ok", 3.0, 2, False),
        ("v", 3.0, True, "EndpointsReady", None),
    ],
    "zero twice with an answer 29 s ago is ready until that answer is over 30 s old": [
        ("ok", 0.0, 4, True),    # engine answer recorded at 0
        ("ok", 28.0, 0, False),
        ("ok", 29.0, 0, False),
        ("v", 29.0, True, "EngineAnswered", None),   # answer 29 s old
        ("v", 30.0, True, "EngineAnswered", None),   # exactly 30 s: still "in 30s"
        ("v", 30.5, False, "ZeroReadyEndpoints", None),  # 30.5 s old
    ],
    "an answer during the zero run keeps it ready": [
        ("ok", 1.0, 0, False),
        ("ok", 2.0, 0, True),
        ("ok", 3.0, 0, False),
        ("v", 3.0, True, "EngineAnswered", None),
        ("ok", 31.0, 0, False),
        ("ok", 32.0, 0, False),
        ("v", 32.0, True, "EngineAnswered", None),   # 32 - 2 = 30
        ("v", 32.001, False, "ZeroReadyEndpoints", None),
    ],
    "a failed scrape between two zeros neither breaks nor extends the run": [
        ("ok", 1.0, 0, False),
        ("fail", 2.0, "timeout"),
        ("v", 2.0, True, "ZeroReadyUnconfirmed", "timeout"),
        ("ok", 3.0, 0, False),
        ("v", 3.0, False, "ZeroReadyEndpoints", None),
    ],
    "a scrape without the series between two zeros breaks the run": [
        ("ok", 1.0, 0, False),
        ("ok", 2.0, None, False),
        ("ok", 3.0, 0, False),
        ("v", 3.0, True, "ZeroReadyUnconfirmed", None),
    ],
    "stale boundary is exclusive: exactly stale_after_s since the last success is fresh": [
        ("ok", 0.0, 4, False),
        ("v", 10.0, True, "EndpointsReady", None),
        ("v", 10.001, False, "MetricsStale", None),
    ],
    "failed scrapes keep the last success valid until stale, then name their class": [
        ("ok", 0.0, 4, False),
        ("fail", 5.0, "timeout"),
        ("v", 5.0, True, "EndpointsReady", "timeout"),
        ("fail", 10.0, "connect"),
        ("v", 10.0, True, "EndpointsReady", "connect"),
        ("v", 10.5, False, "ScrapeFailed", "connect"),
        ("ok", 11.0, 4, False),
        ("v", 11.0, True, "EndpointsReady", None),
    ],
    "never scraped: unknown until stale, then not ready": [
        ("v", 0.0, None, "NotYetScraped", None),
        ("v", 10.0, None, "NotYetScraped", None),
        ("v", 10.5, False, "MetricsStale", None),
    ],
    "only failures since start: unknown until stale, then ScrapeFailed": [
        ("fail", 1.0, "tls"),
        ("v", 1.0, None, "NotYetScraped", "tls"),
        ("v", 10.5, False, "ScrapeFailed", "tls"),
    ],
    "body_cap leaves readiness unknown and counts as an answer": [
        ("ok", 0.0, 4, False),
        ("fail", 1.0, "body_cap"),
        ("v", 1.0, None, "BodyCap", "body_cap"),
        ("fail", 2.0, "timeout"),   # the endpoint answered at 1; a later timeout keeps it unknown
        ("v", 2.0, None, "BodyCap", "timeout"),
        ("v", 11.0, None, "BodyCap", "timeout"),     # 11 - 1 = 10: not yet stale
        ("v", 11.5, False, "ScrapeFailed", "timeout"),
    ],
    "repeated body_cap is never declared down": [
        *[("fail", float(t), "body_cap") for t in range(1, 41)],
        ("v", 40.0, None, "BodyCap", "body_cap"),
        ("v", 50.0, None, "BodyCap", "body_cap"),
        ("v", 50.5, False, "MetricsStale", "body_cap"),  # no scrape finished for 10.5 s
        ("ok", 51.0, 3, False),
        ("v", 51.0, True, "EndpointsReady", None),
    ],
    "a zero count is not read from a body_cap scrape": [
        ("ok", 1.0, 0, False),
        ("fail", 2.0, "body_cap"),
        ("v", 2.0, None, "BodyCap", "body_cap"),
        ("ok", 3.0, 0, False),
        ("v", 3.0, False, "ZeroReadyEndpoints", None),
    ],
    "vLLM without the series is unknown, never not ready, while it answers": [
        *[("ok", float(t), None, False) for t in range(0, 100)],
        *[("v", float(t), None, "NoReadySeries", None) for t in range(0, 100, 7)],
    ],
    "vLLM that stops answering goes stale like any provider": [
        ("ok", 0.0, None, False),
        ("fail", 3.0, "connect"),
        ("v", 3.0, None, "NoReadySeries", "connect"),
        ("v", 10.5, False, "ScrapeFailed", "connect"),
    ],
}


@pytest.mark.parametrize("steps", list(CASES.values()), ids=list(CASES))
def test_verdict_sequences(steps):
    run(steps)


@pytest.mark.parametrize("steps", [
    [("ok", 0.0, 4, False), ("v", 0.0, False, "Unavailable", None)],
    [("ok", 0.0, None, False), ("v", 0.0, False, "Unavailable", None)],
    [("fail", 0.0, "body_cap"), ("v", 0.0, False, "Unavailable", "body_cap")],
    [("v", 0.0, False, "Unavailable", None)],
], ids=["ready", "no-series", "body-cap", "never-scraped"])
def test_unavailable_is_not_ready_first(steps):
    run(steps, unavailable=True)


def test_floor_raises_staleness_when_a_pass_is_slow():
    # interval 1 s, latest pass 12 s: floor = 1 + max(1, 12) = 13 > staleMetricsSeconds 10.
    stale_after = effective_stale_after_s(10.0, 1.0, 12.0)
    assert stale_after == 13.0
    run([
        ("ok", 0.0, 4, False),
        ("fail", 12.0, "timeout"),
        ("v", 12.9, True, "EndpointsReady", "timeout"),
        ("v", 13.0, True, "EndpointsReady", "timeout"),
        ("v", 13.5, False, "ScrapeFailed", "timeout"),
    ], stale_after_s=stale_after)
    # The same history with staleMetricsSeconds alone (a fast pass) is stale at 10.5.
    assert effective_stale_after_s(10.0, 1.0, 0.4) == 10.0
    run([("ok", 0.0, 4, False), ("v", 10.5, False, "MetricsStale", None)],
        stale_after_s=effective_stale_after_s(10.0, 1.0, 0.4))


@pytest.mark.parametrize(("interval", "last_pass", "floor"), [
    (1.0, 0.4, 2.0),    # 1 + max(1, 0.4)
    (1.0, 1.0, 2.0),    # 1 + max(1, 1)
    (1.0, 12.0, 13.0),  # 1 + max(1, 12)
    (2.0, 3.5, 5.5),    # 2 + max(2, 3.5)
])
def test_readiness_floor(interval, last_pass, floor):
    assert readiness_floor_s(interval, last_pass) == floor


def test_stale_metrics_default_is_half_the_ttl():
    assert DEFAULT_STALE_METRICS_S == 10.0
    assert default_stale_metrics_s(20.0) == 10.0
    # A configured staleMetricsSeconds longer than the floor wins.
    assert effective_stale_after_s(30.0, 1.0, 12.0) == 30.0


def test_unknown_failure_class_is_rejected():
    with pytest.raises(ValueError, match="unknown scrape failure class"):
        ReadinessTracker(created_at=0.0).on_scrape_failure(1.0, "dns")


def test_verdict_struct_shape():
    verdict = ReadinessTracker(created_at=0.0).verdict(0.0, stale_after_s=10.0, unavailable=False)
    assert verdict == Verdict(ready=None, reason="NotYetScraped", failure_class=None,
                              message="not scraped yet")


def test_engine_answer_wired_from_the_latency_window():
    """The operator feeds LatencyWindow.answered_on_last_observe into on_scrape."""

    def expo(ready: int, successes: int):
        return parse_exposition(
            f'llm_d_epp_ready_endpoints{{name="p"}} {ready}\n'
            f'llm_d_epp_request_duration_seconds_count{{model_name="m"}} {successes}\n', WANTED_SAMPLES)

    window = LatencyWindow()
    tracker = ReadinessTracker(created_at=0.0)
    # A saturated engine reads zero ready endpoints while it keeps completing requests.
    for now, successes in ((0.0, 100), (1.0, 104), (2.0, 109)):
        window.observe(now, expo(0, successes))
        tracker.on_scrape(now, ready_endpoints=0, engine_answered=window.answered_on_last_observe)
    assert tracker.verdict(2.0, stale_after_s=10.0, unavailable=False).reason == "EngineAnswered"
    # It stops completing; the last answer was seen at 2.0.
    for now in (3.0, 4.0, 32.0, 33.0):
        window.observe(now, expo(0, 109))
        tracker.on_scrape(now, ready_endpoints=0, engine_answered=window.answered_on_last_observe)
    assert tracker.verdict(32.0, stale_after_s=10.0, unavailable=False).ready is True
    verdict = tracker.verdict(33.0, stale_after_s=10.0, unavailable=False)
    assert (verdict.ready, verdict.reason) == (False, "ZeroReadyEndpoints")
