"""grid_provider_* and grid_probe_* on the operator's /metrics: collectors over what it holds.

Families are built at scrape time from the holdings (STYLE 11), so a series the operator
does not hold is absent, not 0: unknown readiness has no grid_provider_ready; a provider
with no fresh endpoint has no in-flight; latency needs 20 completed requests in 30 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gridd.core.admission import DropReason
from gridd.core.holdings import Holdings
from gridd.core.publication import ProviderPublisher
from gridd.core.readiness import Verdict
from gridd.metrics_app import labelled_counter

LABELS = ["grid_site", "grid_provider"]


class ProviderCollector(Collector):
    def __init__(
        self,
        holdings: Holdings,
        publishers: Callable[[], Iterable[ProviderPublisher]],
        now: Callable[[], float],
        last_pass_s: Callable[[], float | None],
        ingest_drops: Callable[[], dict[DropReason, int]] | None = None,
        *,
        own_site: str | None = None,
        signal_ttl_s: Callable[[], float] = lambda: 20.0,
        own_verdict: Callable[[ProviderPublisher], Verdict] | None = None,
        stale_after_s: Callable[[], float] | None = None,
    ) -> None:
        self.holdings = holdings
        self.publishers = publishers
        self.now = now
        self.last_pass_s = last_pass_s
        self.ingest_drops = ingest_drops
        self.own_site = own_site
        self.signal_ttl_s = signal_ttl_s
        self.own_verdict = own_verdict
        self.stale_after_s = stale_after_s

    def describe(self):
        return []

    def collect(self):
        ready = GaugeMetricFamily("grid_provider_ready", "1 when the provider can serve, 0 when not; "
                                  "absent when readiness is unknown.", labels=LABELS)
        endpoints = GaugeMetricFamily("grid_provider_ready_endpoints",
                                      "The EPP's ready (fresh) endpoint count.", labels=LABELS)
        in_flight = GaugeMetricFamily("grid_provider_in_flight_requests",
                                      "Requests in flight at the provider (spec: Provider In-flight).",
                                      labels=LABELS)
        ttft50 = GaugeMetricFamily("grid_provider_ttft_p50_seconds",
                                   "Median time to first token over the latency window.", labels=LABELS)
        ttft90 = GaugeMetricFamily("grid_provider_ttft_p90_seconds",
                                   "90th percentile time to first token over the latency window.",
                                   labels=LABELS)
        tpot = GaugeMetricFamily("grid_provider_tpot_seconds",
                                 "Mean time per output token over the latency window.", labels=LABELS)
        errors = GaugeMetricFamily("grid_provider_error_ratio",
                                   "Failed over completed requests over the latency window.", labels=LABELS)
        generation = GaugeMetricFamily(
            "grid_provider_config_generation",
            "Provider generation, once per qualified batch, stamped with its publication time.",
            labels=[*LABELS, "provider_uid", "publisher_epoch", "batch_sequence", "batch_samples"],
        )
        age = GaugeMetricFamily("grid_provider_sample_age_seconds",
                                "Age of the held reading (relays add their holding time).", labels=LABELS)
        now = self.now()
        ttl = self.signal_ttl_s()
        publishers = {pub.provider: pub for pub in self.publishers()}
        stale_after = self.stale_after_s() if self.stale_after_s is not None else ttl
        for held, qualified in self.holdings.latest():
            b = held.batch
            held_age = held.age_s(now)
            load, latency, verdict_ready = b.load, b.latency, b.ready
            if b.site == self.own_site:
                pub = publishers.get(b.provider)
                if pub is not None and self.own_verdict is not None:
                    # Our own provider's verdict moves with time between scrapes (no scrape
                    # within staleMetricsSeconds -> not ready), so read it now.
                    verdict_ready = self.own_verdict(pub).ready
                if held_age > stale_after:
                    load = latency = None  # no reading held within the stale bound
            elif held_age > ttl:
                continue  # a peer's reading past the TTL: relayed as stale, not exported
            labels = [b.site, b.provider]
            age.add_metric(labels, held_age)
            if verdict_ready is not None:
                ready.add_metric(labels, 1.0 if verdict_ready else 0.0)
            # Load and latency come from the latest batch only: after a failed scrape the
            # operator holds no current reading, so those series are absent until the next
            # qualified batch (the verdict still shows why).
            if load is not None and load.ready_endpoints is not None:
                endpoints.add_metric(labels, float(load.ready_endpoints))
            if load is not None and load.in_flight is not None:
                in_flight.add_metric(labels, load.in_flight)
            if latency is not None:
                for family, value in ((ttft50, latency.ttft_p50_s), (ttft90, latency.ttft_p90_s),
                                      (tpot, latency.tpot_s), (errors, latency.error_ratio)):
                    if value is not None:
                        family.add_metric(labels, value)
            source = qualified.batch if qualified is not None else None
            if source is not None and source.revision is not None:
                r = source.revision
                # Only the latest qualified batch's series per provider, stamped with that
                # batch's publication time in milliseconds (DESIGN 5b).
                generation.add_metric(
                    [*labels, r.provider_uid, str(r.publisher_epoch), str(r.batch_sequence),
                     str(r.batch_samples)],
                    float(r.generation), timestamp=source.published_ms / 1000.0,
                )
        yield from (ready, endpoints, in_flight, ttft50, ttft90, tpot, errors, generation, age)

        scrapes = CounterMetricFamily("grid_provider_scrapes", "Scrapes of the provider's /metrics.",
                                      labels=LABELS)
        failures = CounterMetricFamily("grid_provider_scrape_failures",
                                       "Failed scrapes by failure class.", labels=[*LABELS, "reason"])
        malformed = CounterMetricFamily("grid_provider_parse_dropped_lines",
                                        "Exposition lines skipped as malformed.", labels=LABELS)
        unpublishable = CounterMetricFamily(
            "grid_provider_unpublishable_readings",
            "Readings with values receivers would reject, by reason: a field name (published "
            "without that field) or payload (published as a verdict alone).", labels=[*LABELS, "reason"])
        for pub in self.publishers():
            labels = [pub.site, pub.provider]
            s = pub.summary
            scrapes.add_metric(labels, s.scrapes)
            for reason, count in sorted(s.failures.items()):
                failures.add_metric([*labels, reason], count)
            malformed.add_metric(labels, s.malformed_lines)
            for reason, count in sorted(s.unpublishable.items()):
                unpublishable.add_metric([*labels, reason], count)
        yield from (scrapes, failures, malformed, unpublishable)
        last = self.last_pass_s()
        if last is not None:
            yield GaugeMetricFamily("grid_operator_scrape_pass_duration_seconds",
                                    "Duration of the latest scrape pass (it waits for its slowest scrape).",
                                    value=last)
        if self.ingest_drops is not None:
            yield labelled_counter("grid_signals_ingest_dropped", "Batches not admitted, by reason.",
                                   ["reason"], sorted(self.ingest_drops().items()))


PROBE_LABELS = ["grid_site", "grid_provider", "probe"]


class ProbeCollector(Collector):
    """grid_probe_* (spec 004): per configured probe, from the runner's counters at scrape
    time. Probe names come from config, so the label set is bounded; a probe that is not
    running (removed, disabled, drained) has no series."""

    def __init__(self, snapshot: Callable[[], Iterable[tuple[tuple[str, str], Any]]], *,
                 own_site: str) -> None:
        self.snapshot = snapshot
        self.own_site = own_site

    def describe(self):
        return []

    def collect(self):
        ticks = CounterMetricFamily("grid_probe_ticks", "Probe ticks run (each is one request).",
                                    labels=PROBE_LABELS)
        failures = CounterMetricFamily("grid_probe_failures", "Failed probe ticks by failure class.",
                                       labels=[*PROBE_LABELS, "reason"])
        skipped = CounterMetricFamily("grid_probe_skipped_ticks",
                                      "Scheduled ticks skipped because the previous tick overran them.",
                                      labels=PROBE_LABELS)
        dropped = CounterMetricFamily("grid_probe_dropped_series",
                                      "Extracted names dropped because the probe held max_series series "
                                      "(counted every tick they appear).", labels=PROBE_LABELS)
        sink_errors = CounterMetricFamily("grid_probe_sink_errors", "Failed sink writes by sink.",
                                          labels=[*PROBE_LABELS, "sink"])
        series = GaugeMetricFamily("grid_probe_series", "Series the probe holds a window for.",
                                   labels=PROBE_LABELS)
        for (provider, probe), stats in self.snapshot():
            labels = [self.own_site, provider, probe]
            ticks.add_metric(labels, stats.ticks)
            for reason, count in sorted(stats.failures.items()):
                failures.add_metric([*labels, reason], count)
            skipped.add_metric(labels, stats.skipped_ticks)
            dropped.add_metric(labels, stats.dropped_series)
            for sink, count in sorted(stats.sink_errors.items()):
                sink_errors.add_metric([*labels, sink], count)
            series.add_metric(labels, stats.series)
        yield from (ticks, failures, skipped, dropped, sink_errors, series)
