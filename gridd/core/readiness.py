"""The provider readiness verdict (spec: Provider Readiness; DESIGN 5, 5b).

ReadinessTracker folds one provider's scrape outcomes into a Verdict, which is both
grid_provider_ready (absent when unknown) and the provider's Ready condition. The rules,
in the order they are applied (docs/conditions.md has the table):

1. Unavailable (an administrative state) -> not ready.
2. No scrape succeeded within stale_after_s -> not ready. A body_cap scrape counts as an
   answer here: "the endpoint answered, so the provider is not declared down".
3. The latest answering scrape hit the body cap -> unknown ("leaves readiness unknown").
4. No scrape has answered yet -> unknown.
5. The latest successful scrape had no ready-endpoint series -> unknown ("a provider
   pointed at vLLM's own /metrics carries no such series").
6. Zero ready endpoints for two scrapes running and no engine answer in 30 s -> not ready.
7. Otherwise ready.

Pure: ``now`` is a monotonic float of seconds passed in by the caller.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "DEFAULT_SIGNAL_TTL_S",
    "DEFAULT_STALE_METRICS_S",
    "FAILURE_CLASSES",
    "ReadinessTracker",
    "Verdict",
    "default_stale_metrics_s",
    "effective_stale_after_s",
    "measured_pass_s",
    "readiness_floor_s",
]

FAILURE_CLASSES: frozenset[str] = frozenset({"timeout", "connect", "tls", "http_status", "body_cap", "parse",
                                             "wrong_kind"})

DEFAULT_SIGNAL_TTL_S = 20.0
# "staleMetricsSeconds (half the signal TTL when unset)": 20 s / 2.
DEFAULT_STALE_METRICS_S = DEFAULT_SIGNAL_TTL_S / 2
DEFAULT_ENGINE_ANSWER_WINDOW_S = 30.0
# "zero ready endpoints for two scrapes running"
ZERO_READY_SCRAPES = 2


class Verdict(msgspec.Struct, frozen=True):
    """One readiness verdict.

    ready: True / False, or None for unknown (grid_provider_ready absent, Ready=Unknown).
    reason: the Ready condition's CamelCase reason.
    failure_class: the class of the latest scrape attempt when that attempt failed
        (one of FAILURE_CLASSES), else None.
    message: a human-readable sentence for the condition.
    """

    ready: bool | None
    reason: str
    failure_class: str | None = None
    message: str = ""


def default_stale_metrics_s(signal_ttl_s: float) -> float:
    """staleMetricsSeconds when unset: half the signal TTL."""
    return signal_ttl_s / 2


def readiness_floor_s(interval_s: float, last_pass_s: float) -> float:
    """A network's readiness floor: "one scrape interval plus the longer of one interval
    or the latest measured pass". The network is everything one operator scrapes in one
    pass (DESIGN 5b)."""
    return interval_s + max(interval_s, last_pass_s)


def measured_pass_s(last_pass_s: float | None, running_since: float | None, now: float) -> float:
    """The "latest measured pass" the floor uses: the latest finished pass, or the pass
    still running once it has been running longer than that.

    A pass that has not finished is still a measurement: when a provider first turns slow
    or hangs, the running pass is the slow one while the latest finished pass was fast.
    Using the finished pass alone would shrink the floor below what the running pass
    already took, and every provider it already scraped would read stale until it ends,
    which is what the floor exists to prevent ("keeps a successful sample valid until
    the next non-overlapping pass can refresh it").

    last_pass_s: duration of the latest finished pass, None before the first.
    running_since: when the running pass started, None between passes.
    """
    measured = last_pass_s if last_pass_s is not None else 0.0
    if running_since is not None:
        measured = max(measured, now - running_since)
    return measured


def effective_stale_after_s(stale_metrics_s: float, interval_s: float, last_pass_s: float) -> float:
    """The staleness bound a verdict uses: staleMetricsSeconds, raised to the readiness
    floor when the floor is longer.

    "This keeps a successful sample valid until the next non-overlapping pass can refresh
    it. The trade-off is that a slow pass widens the window for every provider on the
    network, so a real failure is reported later."
    """
    return max(stale_metrics_s, readiness_floor_s(interval_s, last_pass_s))


def probe_only_verdict(*, unavailable: bool) -> Verdict:
    """The verdict of a provider with no ``metrics`` block (spec 004 Example 1): nothing is
    scraped, so readiness is unknown; it is routed, least preferred, on its probes alone."""
    if unavailable:
        return Verdict(False, "Unavailable", None, "provider is administratively unavailable")
    return Verdict(None, "NoMetricsSource", None,
                   "no metrics block: readiness and load unknown; routed on its probe metadata")


class ReadinessTracker:
    """Readiness state of one provider.

    created_at: when the provider started being scraped; staleness before the first
        answering scrape counts from here.
    """

    __slots__ = ("_created_at", "_engine_answer_window_s", "_last_answer_at",
                 "_latest_answer", "_latest_failure", "_ready_endpoints", "_zero_streak",
                 "_last_engine_answer_at")

    def __init__(self, *, created_at: float,
                 engine_answer_window_s: float = DEFAULT_ENGINE_ANSWER_WINDOW_S) -> None:
        self._created_at = created_at
        self._engine_answer_window_s = engine_answer_window_s
        # Latest scrape in which the endpoint answered: a success or a body_cap.
        self._last_answer_at: float | None = None
        self._latest_answer: str | None = None  # "ok" | "body_cap"
        # Class of the latest attempt if it failed, None if it succeeded.
        self._latest_failure: str | None = None
        # Reading of the latest successful scrape.
        self._ready_endpoints: int | None = None
        self._zero_streak = 0
        self._last_engine_answer_at: float | None = None

    def retune(self, *, engine_answer_window_s: float) -> None:
        """A committed reload's window; the verdict's history is kept."""
        self._engine_answer_window_s = engine_answer_window_s

    def on_scrape(self, now: float, *, ready_endpoints: int | None, engine_answered: bool) -> None:
        """A successful scrape.

        ready_endpoints: the EPP's ready-endpoint count; None when the series is absent.
        engine_answered: this scrape showed an engine answer, i.e. the provider's success
            counter rose since the scrape before (LatencyWindow.answered_on_last_observe).
        """
        self._last_answer_at = now
        self._latest_answer = "ok"
        self._latest_failure = None
        self._ready_endpoints = ready_endpoints
        # Two scrapes running: consecutive successful scrapes that read a zero count. A
        # non-zero count or a scrape without the series breaks the run; failed scrapes
        # (body_cap included) read no count and neither extend nor break it.
        if ready_endpoints == 0:
            self._zero_streak += 1
        else:
            self._zero_streak = 0
        if engine_answered:
            self._last_engine_answer_at = now

    def on_scrape_failure(self, now: float, failure_class: str) -> None:
        """A failed scrape, classified as one of FAILURE_CLASSES."""
        if failure_class not in FAILURE_CLASSES:
            raise ValueError(f"unknown scrape failure class {failure_class!r}")
        self._latest_failure = failure_class
        if failure_class == "body_cap":
            # "Reaching that budget is counted as body_cap and leaves readiness unknown:
            # the endpoint answered, so the provider is not declared down."
            self._last_answer_at = now
            self._latest_answer = "body_cap"

    def engine_answered_within(self, now: float) -> bool:
        last = self._last_engine_answer_at
        return last is not None and now - last <= self._engine_answer_window_s

    def verdict(self, now: float, *, stale_after_s: float, unavailable: bool) -> Verdict:
        """The verdict at ``now``. stale_after_s: effective_stale_after_s(...).

        Staleness is exclusive of the bound: a scrape that answered exactly stale_after_s
        ago still counts ("within staleMetricsSeconds").
        """
        failure = self._latest_failure
        if unavailable:
            return Verdict(False, "Unavailable", failure, "provider is administratively unavailable")

        since = self._last_answer_at if self._last_answer_at is not None else self._created_at
        silent_s = now - since
        if silent_s > stale_after_s:
            what = ("no scrape answered" if self._last_answer_at is not None
                    else "no scrape answered since scraping started")
            # A body_cap is itself an answer, so when it is the latest attempt the
            # provider went stale because no scrape finished since, not because it failed.
            if failure is not None and failure != "body_cap":
                return Verdict(False, "ScrapeFailed", failure,
                               f"{what} for {silent_s:.1f}s (stale after {stale_after_s:.1f}s); "
                               f"latest scrape failed: {failure}")
            return Verdict(False, "MetricsStale", failure,
                           f"{what} for {silent_s:.1f}s (stale after {stale_after_s:.1f}s); "
                           "no scrape attempt finished since")

        if self._latest_answer == "body_cap":
            return Verdict(None, "BodyCap", failure,
                           "the /metrics body reached the read budget (body_cap); readiness unknown")
        if self._latest_answer is None:
            message = ("not scraped yet" if failure is None
                       else f"not scraped yet; latest scrape failed: {failure}")
            return Verdict(None, "NotYetScraped", failure, message)

        suffix = ("" if failure is None
                  else f"; latest scrape failed: {failure}, last success {silent_s:.1f}s ago")
        ready = self._ready_endpoints
        if ready is None:
            # "A scrape answering without the pool's ready-endpoint series leaves readiness
            # unknown, not false, and does not exclude."
            return Verdict(None, "NoReadySeries", failure,
                           "the scrape carries no ready-endpoint series; readiness unknown" + suffix)
        if ready == 0:
            # "The EPP counts endpoints with fresh metrics, so a saturated engine can read
            # zero while serving, which is why two scrapes and the engine answer both gate
            # the verdict."
            if self._zero_streak < ZERO_READY_SCRAPES:
                return Verdict(True, "ZeroReadyUnconfirmed", failure,
                               f"0 ready endpoints for {self._zero_streak} scrape(s); "
                               f"not ready after {ZERO_READY_SCRAPES} running" + suffix)
            window = self._engine_answer_window_s
            if self.engine_answered_within(now):
                return Verdict(True, "EngineAnswered", failure,
                               f"0 ready endpoints for {self._zero_streak} scrapes running, "
                               f"but the engine answered within {window:g}s" + suffix)
            return Verdict(False, "ZeroReadyEndpoints", failure,
                           f"0 ready endpoints for {self._zero_streak} scrapes running "
                           f"and no engine answer in {window:g}s" + suffix)
        return Verdict(True, "EndpointsReady", failure, f"{ready} ready endpoints" + suffix)
