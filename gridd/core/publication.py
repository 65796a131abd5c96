"""The operator's per-provider pipeline: one scrape in, one Batch out. Pure: time comes in.

scrape body -> parse (WANTED_SAMPLES only) -> derive load -> latency window -> readiness
verdict -> Batch. Every batch takes the next sequence number of the operator's epoch. Only
a *qualified* batch (the scrape succeeded, was not cut at the body cap, and parsed) carries
revision metadata (spec: Provider revisions; DESIGN 5b). A failed scrape still publishes
the readiness verdict, in a batch without revision metadata but with its (epoch, sequence)
as ``order``: receivers order it like any other batch and use it for readiness, but never
learn from it.
"""

from __future__ import annotations

from collections.abc import Callable

from gridd.core.batch import Batch
from gridd.core.derivation import (
    WANTED_SAMPLES,
    EppPlan,
    derive,
    epp_plan,
    has_vllm_series,
    kind_mismatch,
    mismatch_of,
    pool_names,
)
from gridd.core.exposition import Exposition, SeriesCache, TooManyLines, parse_exposition
from gridd.core.latency import LatencyWindow
from gridd.core.payload import validate_payload
from gridd.core.readiness import ReadinessTracker, Verdict, probe_only_verdict
from gridd.core.readings import BatchOrder, LatencyBlock, LoadSignals, Revision, sample_count

MAX_EXPOSITION_LINES = 50_000
"""A body over this many lines fails as ``parse`` before any line of it is read one by one.
1 MiB of real EPP metrics is about 5 500 lines (labelled lines run to ~200 bytes); 50 000
one-character junk lines that the scan picks cost the line loop ~25 ms on the event loop
(each one malformed), and ~40 ms is the most a scrape may take there.

One body is not counted (parse_exposition's max_lines): one whose picked lines are those of
the provider's previous scrape with new values, read through its _Shape (the steady state).
That parse reads no line one by one, only as many lines as the previous scrape picked (at
most 4 x SeriesCache.limit), in C-level steps; the rest of the body costs the decode and the
scan, in C: ~13 ms for a 1 MiB body of empty lines around the picked ones. A body whose
picked lines differ from the shape's is counted after the scan and refused as before: ~31 ms
at most for 1 MiB (the scan picks 500 000 one-character lines, then the count). Both stay
within the bound (tests/test_scrape_path_oracle.py measures them against the 50 000 junk
lines), and a steady scrape no longer pays the count's pass over the body (~6 us warm,
~10 us cache-cold per 75 KB EPP body)."""


class ScrapeSummary:
    """What gridctl and the exporter show about a provider's scraping."""

    __slots__ = ("scrapes", "failures", "malformed_lines", "unpublishable", "invalid_fields",
                 "last_success_at", "last_failure_class", "last_failure_detail", "last_scrape_at")

    def __init__(self) -> None:
        self.scrapes = 0
        self.failures: dict[str, int] = {}
        self.malformed_lines = 0
        # Readings with something receivers would reject, by reason: a field name (that
        # field was published as absent) or "payload" (the verdict travelled alone).
        self.unpublishable: dict[str, int] = {}
        # The latest successful scrape's fields left out: field -> why.
        self.invalid_fields: dict[str, str] = {}
        self.last_success_at: float | None = None
        self.last_scrape_at: float | None = None
        self.last_failure_class: str | None = None
        self.last_failure_detail = ""


class _LayoutReads:
    """What on_scrape reads from an exposition's names and labels alone, under the provider's
    pool and kind: its pools, whether it has vLLM series, the EppPlan of its derivation.
    Exposition.layout: every exposition with the same layout object has the same names
    with the same labels in the same order, so these hold for it too (only values differ);
    a new layout, pool or kind reads them again."""

    __slots__ = ("layout", "pool", "kind", "pools", "has_vllm", "epp")

    def __init__(self, expo: Exposition, *, pool: str | None, kind: str) -> None:
        self.layout = expo.layout
        self.pool, self.kind = pool, kind
        self.pools = pool_names(expo)
        self.has_vllm = has_vllm_series(expo)
        self.epp: EppPlan | None = epp_plan(expo, pool=pool, kind=kind, pools=self.pools)


class ProviderPublisher:
    def __init__(
        self,
        *,
        site: str,
        provider: str,
        model: str,
        provider_uid: str,
        generation: int,
        publisher_epoch: int,
        created_at: float,
        next_sequence: Callable[[], int],
        pool: str | None = None,
        queue_full_at: float | None = None,
        kind: str = "auto",
        adapters: tuple[str, ...] = (),
        latency_window_s: float = 30.0,
        latency_min_completed: int = 20,
        engine_answer_window_s: float = 30.0,
        metrics_source: bool = True,
    ) -> None:
        self.site = site
        self.metrics_source = metrics_source
        """False for a provider with no ``metrics`` block: never scraped, published by
        :meth:`on_probe_only` (spec 004 Example 1)."""
        self.provider = provider
        self.model = model
        self.provider_uid = provider_uid
        self.generation = generation
        self.publisher_epoch = publisher_epoch
        self.pool = pool
        self.queue_full_at = queue_full_at
        self.kind = kind
        self.adapters = adapters
        # Receivers fence per (site, provider) on (publisher_epoch, batch_sequence), so a
        # provider's sequence must keep rising within an epoch even across a delete and
        # re-create under the same name (a new uid): the operator hands out one counter.
        self._next_sequence = next_sequence
        self.sequence = 0
        self.readiness = ReadinessTracker(created_at=created_at,
                                          engine_answer_window_s=engine_answer_window_s)
        self.latency = self._latency_window(latency_window_s, latency_min_completed)
        self.summary = ScrapeSummary()
        # This provider's series from its latest scrape: a line that repeats is not parsed again.
        self._series = SeriesCache()
        # What the readers took from the latest exposition with a layout, by label.
        self._reads: _LayoutReads | None = None
        self.last_load: LoadSignals | None = None
        self.last_latency: LatencyBlock | None = None
        self.last_verdict: Verdict | None = None
        self.probes: dict[str, float] = {}
        # When (monotonic) each probes value was produced by its probe's tick; batches carry
        # the difference as probe_age_s, so receivers can tell a value older than the TTL.
        self.probes_at: dict[str, float] = {}
        self._last_published_ms = 0
        # Whether the latest successful scrape left out a different set of fields than the
        # one before (summary.invalid_fields): the operator logs it.
        self.invalid_fields_changed = False

    def _latency_window(self, window_s: float, min_completed: int) -> LatencyWindow:
        # Spec: latency is "never borrowed": only the rows of this provider's model and its
        # configured adapters count, out of everything one EPP serves.
        return LatencyWindow(window_s=window_s, min_completed=min_completed, kind=self.kind,
                             models=frozenset((self.model, *self.adapters)))

    def retune(self, *, latency_window_s: float, latency_min_completed: int,
               engine_answer_window_s: float) -> None:
        """A committed reload's windows: readiness history kept; the latency window starts
        over when its length or threshold changed (its baseline meant the old window)."""
        self.readiness.retune(engine_answer_window_s=engine_answer_window_s)
        if (latency_window_s, latency_min_completed) != (self.latency.window_s, self.latency.min_completed):
            self.latency = self._latency_window(latency_window_s, latency_min_completed)

    def reconfigure(self, *, model: str, provider_uid: str, generation: int, pool: str | None,
                    queue_full_at: float | None, kind: str = "auto", adapters: tuple[str, ...] = (),
                    metrics_source: bool = True) -> None:
        """A committed reload. A new uid (delete + re-create) restarts the latency window and
        readiness history with the object; a new generation keeps them (same provider),
        unless what the window reads changed (model, adapters, kind)."""
        restart_latency = (provider_uid != self.provider_uid
                           or (model, kind, adapters) != (self.model, self.kind, self.adapters))
        self.model, self.provider_uid, self.generation = model, provider_uid, generation
        self.pool, self.queue_full_at, self.kind, self.adapters = pool, queue_full_at, kind, adapters
        self.metrics_source = metrics_source
        if restart_latency:
            self.latency = self._latency_window(self.latency.window_s, self.latency.min_completed)

    def on_scrape(
        self,
        *,
        now: float,
        wall_now: float,
        body: bytes | None,
        failure_class: str | None,
        failure_detail: str = "",
        stale_after_s: float,
        unavailable: bool,
    ) -> Batch:
        summary = self.summary
        summary.scrapes += 1
        summary.last_scrape_at = now
        self.invalid_fields_changed = False
        load: LoadSignals | None = None
        latency: LatencyBlock | None = None
        if failure_class is None and body is not None:
            try:
                expo = parse_exposition(body, WANTED_SAMPLES, self._series, max_lines=MAX_EXPOSITION_LINES)
            except TooManyLines:
                # No real exposition has this many lines in 1 MiB (its lines run to tens of
                # bytes); parsing such a body would hold the event loop for a noticeable time.
                failure_class, failure_detail = "parse", f"more than {MAX_EXPOSITION_LINES} lines"
        if failure_class is None and body is not None:  # parsed (expo)
            summary.malformed_lines += expo.malformed_lines
            reads = self._layout_reads(expo)
            if reads is None:
                pools = pool_names(expo)  # read once, for both
                mismatch = kind_mismatch(expo, self.kind, pools=pools)
            else:
                pools = reads.pools
                mismatch = mismatch_of(self.kind, has_epp=bool(pools), has_vllm=reads.has_vllm)
            if expo.malformed_lines and not expo.samples:
                # Nothing usable came out of a body that did not parse: a failed scrape.
                failure_class, failure_detail = "parse", f"{expo.malformed_lines} malformed lines, no samples"
            elif mismatch is not None:
                # metrics.kind names what the URL serves; a body of the other flavour is a
                # misconfiguration (or the wrong URL), not a reading of this provider.
                failure_class, failure_detail = "wrong_kind", mismatch
            else:
                if reads is not None and reads.epp is not None:
                    derived = reads.epp.derive(expo, self.queue_full_at)
                else:
                    derived = derive(expo, pool=self.pool, queue_full_at=self.queue_full_at, kind=self.kind,
                                     pools=pools)
                load = derived.load
                self._note_invalid_fields(derived.invalid)
                latency = self.latency.observe(now, expo)
                self.readiness.on_scrape(now, ready_endpoints=load.ready_endpoints,
                                         engine_answered=self.latency.answered_on_last_observe)
        if failure_class is not None:
            summary.failures[failure_class] = summary.failures.get(failure_class, 0) + 1
            summary.last_failure_class, summary.last_failure_detail = failure_class, failure_detail
            self.readiness.on_scrape_failure(now, failure_class)
        else:
            summary.last_success_at = now
            summary.last_failure_class, summary.last_failure_detail = None, ""
        verdict = self.readiness.verdict(now, stale_after_s=stale_after_s, unavailable=unavailable)
        self.last_verdict = verdict
        # Never backwards for a provider within a process, even if the wall clock steps
        # back (older receivers order revision-less batches by it). Receivers of this
        # version order every batch by (publisher_epoch, batch_sequence) instead, which a
        # restart under a clock set back cannot lower: every batch takes the next sequence
        # number, and the one without a revision carries it as its order.
        published_ms, sequence = self._stamp(wall_now)
        if load is not None:
            # The qualified batch is built whole (not as the unrevised one plus a replace):
            # the same fields, revision and load instead of order.
            revision = Revision(self.provider_uid, self.generation, self.publisher_epoch, sequence,
                                sample_count(load))
            full = self._batch(now, verdict, published_ms, revision=revision, load=load, latency=latency)
            problem = validate_payload(full)
            if problem is None:
                self.sequence = revision.batch_sequence
                self.last_load, self.last_latency = load, latency
                return full
            # A backstop: derivation already left out every out-of-range load value, so
            # this is a payload no field-level rule covers. Publish the verdict alone, so
            # readiness still travels, and count it.
            self._count_unpublishable("payload")
            summary.last_failure_detail = f"unpublishable reading: {problem}"
        return self._batch(now, verdict, published_ms, order=BatchOrder(self.publisher_epoch, sequence))

    def _layout_reads(self, expo: Exposition) -> _LayoutReads | None:
        """The label reads of ``expo``: kept while its layout, the pool and the kind stay the
        same, read again when one changes; None for an exposition without a layout (read the
        plain way)."""
        if expo.layout is None:
            self._reads = None  # nor keep an old layout (a body's worth of line prefixes) alive
            return None
        reads = self._reads
        if (reads is None or reads.layout is not expo.layout or reads.pool != self.pool
                or reads.kind != self.kind):
            reads = self._reads = _LayoutReads(expo, pool=self.pool, kind=self.kind)
        return reads

    def _stamp(self, wall_now: float) -> tuple[int, int]:
        """The next batch's published_ms (never backwards: see on_scrape) and sequence."""
        published_ms = max(int(wall_now * 1000), self._last_published_ms + 1)
        self._last_published_ms = published_ms
        return published_ms, self._next_sequence()

    def _batch(self, now: float, verdict: Verdict, published_ms: int, *, order: BatchOrder | None = None,
               revision: Revision | None = None, load: LoadSignals | None = None,
               latency: LatencyBlock | None = None) -> Batch:
        """The verdict and the probe metadata, with ``order`` (a batch without revision
        metadata), or with the revision, load and latency of a qualified scrape (complete)."""
        return Batch(
            site=self.site,
            provider=self.provider,
            model=self.model,
            published_ms=published_ms,
            age_s=0.0,
            revision=revision,
            complete=revision is not None,
            ready=verdict.ready,
            ready_reason=verdict.reason,
            load=load,
            latency=latency,
            probes=dict(self.probes),
            order=order,
            probe_age_s={key: round(max(0.0, now - self.probes_at.get(key, now)), 3) for key in self.probes},
        )

    def on_probe_only(self, *, now: float, wall_now: float, unavailable: bool) -> Batch:
        """One publication of a provider with no ``metrics`` block, every scrape interval
        (spec 004 Example 1): readiness unknown (NoMetricsSource), no load, its probe
        metadata. Without load it is never learned from; gateways route it as a candidate
        with no load signal, or rank it on its probe values under a strategy."""
        verdict = self.last_verdict = probe_only_verdict(unavailable=unavailable)
        published_ms, sequence = self._stamp(wall_now)
        return self._batch(now, verdict, published_ms, order=BatchOrder(self.publisher_epoch, sequence))

    def _count_unpublishable(self, reason: str) -> None:
        counts = self.summary.unpublishable
        counts[reason] = counts.get(reason, 0) + 1

    def _note_invalid_fields(self, invalid: dict[str, str]) -> None:
        """Count each field left out, and flag a change in which fields are left out, so the
        operator says why once per transition rather than once per scrape."""
        for field in invalid:
            self._count_unpublishable(field)
        summary = self.summary
        self.invalid_fields_changed = invalid.keys() != summary.invalid_fields.keys()
        summary.invalid_fields = invalid

    def current_verdict(self, now: float, *, stale_after_s: float, unavailable: bool) -> Verdict:
        """The verdict now, between scrapes (staleness moves with time)."""
        if not self.metrics_source:
            return probe_only_verdict(unavailable=unavailable)
        return self.readiness.verdict(now, stale_after_s=stale_after_s, unavailable=unavailable)
