"""The front's series: plain counters on the request path, families built at scrape time
(STYLE 11). Names and labels: docs/front.md and docs/metrics.md."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from gridd.metrics_app import labelled_counter

__all__ = ["LATENCY_BUCKETS", "NO_SITE", "OTHER_MODEL", "FrontMetrics", "LatencyHistogram"]

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
OTHER_MODEL = "other"
NO_SITE = "none"



@runtime_checkable
class CountsPool(Protocol):
    """An upstream client that counts its pool (upstream_client.UpstreamClient and
    SwappableUpstream): connections opened and requests sent, for grid_gateway_upstream_*."""

    def pool_counts(self) -> tuple[int, int]: ...

class LatencyHistogram:
    """Counts per LATENCY_BUCKETS bucket and their sum, as Prometheus histograms want them."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*LATENCY_BUCKETS, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


class FrontMetrics:
    """The front's series. Labels are bounded: ``model`` is a model the router knows (any
    other name is ``other``), ``site`` a site a decision named (``none`` when no site took the
    request), ``outcome`` and ``reason`` come from fixed sets (docs/front.md)."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}
        self.retries: dict[str, int] = {}
        self.sheds: dict[str, int] = {}
        self.unavailable: dict[str, int] = {}
        self.upstream_latency: dict[str, LatencyHistogram] = {}
        self.first_byte: dict[str, LatencyHistogram] = {}
        self.pools: dict[str, CountsPool] = {}
        """Upstream clients by ``upstream`` label (provider, ingress) whose pool_counts()
        give connections opened and requests sent (upstream_client.UpstreamClient)."""

    def request(self, model: str, site: str, outcome: str) -> None:
        key = (model, site, outcome)
        self.requests[key] = self.requests.get(key, 0) + 1

    def retry(self, reason: str) -> None:
        self.retries[reason] = self.retries.get(reason, 0) + 1

    def shed(self, model: str) -> None:
        self.sheds[model] = self.sheds.get(model, 0) + 1

    def unavailable_answer(self, model: str) -> None:
        self.unavailable[model] = self.unavailable.get(model, 0) + 1

    def observe_upstream_latency(self, site: str, seconds: float) -> None:
        hist = self.upstream_latency.get(site)
        if hist is None:
            hist = self.upstream_latency[site] = LatencyHistogram()
        hist.observe(seconds)

    def observe_first_byte(self, site: str, seconds: float) -> None:
        hist = self.first_byte.get(site)
        if hist is None:
            hist = self.first_byte[site] = LatencyHistogram()
        hist.observe(seconds)

    def collect(self) -> Iterator[Metric]:
        yield labelled_counter(
            "gridd_gateway_requests", "Inference requests answered by this gateway's front, by outcome.",
            ["model", "site", "outcome"], list(self.requests.items()))
        yield labelled_counter(
            "gridd_gateway_retries", "Requests sent to a second candidate after the first failed before "
            "any byte reached the client, by the first failure's reason.", ["reason"],
            list(self.retries.items()))
        yield labelled_counter("gridd_gateway_sheds", "Requests answered 429 because the model sheds.",
                               ["model"], list(self.sheds.items()))
        yield labelled_counter(
            "gridd_gateway_unavailable", "Requests answered 503 because no candidate of the model can serve.",
            ["model"], list(self.unavailable.items()))
        opened = CounterMetricFamily(
            "gridd_gateway_upstream_connections_opened",
            "Connections opened to upstreams (providers, or other "
            "sites' ingress); compare with gridd_gateway_upstream_requests_sent for the reuse.",
            labels=["upstream"])
        sent = CounterMetricFamily("gridd_gateway_upstream_requests_sent", "Requests sent to upstreams.",
                                   labels=["upstream"])
        for upstream, pool in list(self.pools.items()):
            connections_opened, requests_sent = pool.pool_counts()
            opened.add_metric([upstream], connections_opened)
            sent.add_metric([upstream], requests_sent)
        yield opened
        yield sent
        for name, doc, hists in (
            ("gridd_gateway_upstream_latency_seconds",
             "From sending a request upstream to its response headers, per site that answered.",
             self.upstream_latency),
            ("gridd_gateway_time_to_first_byte_seconds",
             "From the request's arrival to the first response body byte sent to the client, per site.",
             self.first_byte),
        ):
            family = HistogramMetricFamily(name, doc, labels=["site"])
            for site, hist in list(hists.items()):
                family.add_metric([site], hist.buckets(), hist.total)
            yield family
