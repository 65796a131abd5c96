"""What a batch's payload must hold before it may become a reading (DESIGN 5b).

Admission (gridd.core.admission) checks every batch a receiver takes off the signals
channel with ``validate_payload`` after its ordering metadata; the operator's publisher
(gridd.core.publication) checks its own batch with it before publishing, so a reading a
receiver would reject is published without the offending part. Pure: no IO, no clock.
"""

from __future__ import annotations

import math

from gridd.core.batch import Batch
from gridd.core.readings import LatencyBlock, LoadSignals, legacy_sample_count, sample_count

__all__ = ["validate_payload"]


# A count is absent (None) or finite and >= 0; a fraction absent or within 0..1. Written as one
# chained comparison, `0.0 <= value < inf`, which NaN and both infinities fail as isfinite does.
_INF = math.inf


def _bad_count(value: float | None) -> bool:
    return value is not None and not 0.0 <= value < _INF


def _bad_fraction(value: float | None) -> bool:
    return value is not None and not 0.0 <= value <= 1.0


_LOAD_COUNTS = ("avg_running", "avg_waiting", "kv_spread", "flow_queue", "in_flight")
_LATENCY_COUNTS = ("ttft_p50_s", "ttft_p90_s", "tpot_s")


def _load_problem(load: LoadSignals) -> str | None:
    if load.ready_endpoints is not None and load.ready_endpoints < 0:
        return f"load.ready_endpoints={load.ready_endpoints} is negative"
    if load.queue_full_units < 0:
        return f"load.queue_full_units={load.queue_full_units} is negative"
    counts = (load.avg_running, load.avg_waiting, load.kv_spread, load.flow_queue, load.in_flight)
    for name, value in zip(_LOAD_COUNTS, counts, strict=True):
        if value is not None and not 0.0 <= value < _INF:  # _bad_count
            return f"load.{name}={value!r} is not a finite non-negative number"
    if _bad_fraction(load.kv_mean):
        return f"load.kv_mean={load.kv_mean!r} is outside 0..1"
    seen: set[str] = set()
    for i, unit in enumerate(load.units):
        name = unit.unit
        if not name:
            return f"load.units[{i}] has an empty name"
        if name in seen:
            return f"load.units[{i}] repeats unit {name!r}"
        seen.add(name)
        running, waiting, in_flight, kv_usage = unit.running, unit.waiting, unit.in_flight, unit.kv_usage
        if ((running is not None and not 0.0 <= running < _INF)  # _bad_count of each
                or (waiting is not None and not 0.0 <= waiting < _INF)
                or (in_flight is not None and not 0.0 <= in_flight < _INF)):
            return f"load.units[{i}] running/waiting/in_flight is not a finite non-negative number"
        if kv_usage is not None and not 0.0 <= kv_usage <= 1.0:  # _bad_fraction
            return f"load.units[{i}].kv_usage={kv_usage!r} is outside 0..1"
    return None


def _latency_problem(latency: LatencyBlock) -> str | None:
    if not (math.isfinite(latency.window_s) and latency.window_s > 0):
        return f"latency.window_s={latency.window_s!r} is not a finite positive number"
    if latency.completed < 0:
        return f"latency.completed={latency.completed} is negative"
    counts = (latency.ttft_p50_s, latency.ttft_p90_s, latency.tpot_s)
    for name, value in zip(_LATENCY_COUNTS, counts, strict=True):
        if value is not None and not 0.0 <= value < _INF:  # _bad_count
            return f"latency.{name}={value!r} is not a finite non-negative number"
    if _bad_fraction(latency.error_ratio):
        return f"latency.error_ratio={latency.error_ratio!r} is outside 0..1"
    p50, p90 = latency.ttft_p50_s, latency.ttft_p90_s
    if p50 is not None and p90 is not None and p50 > p90:
        return f"latency.ttft_p50_s={p50} exceeds ttft_p90_s={p90}"
    return None


def validate_payload(batch: Batch) -> str | None:
    """What is wrong with a batch's payload, or None when it may become a reading.

    Ordering metadata (site, provider, publisher_epoch, batch_sequence) is checked by
    ``AdmissionFences.admit`` itself; this covers everything a reading is built from.
    """
    if not batch.model:
        return "empty model"
    if batch.published_ms < 0:
        return f"published_ms={batch.published_ms} is negative"
    if _bad_count(batch.age_s):
        return f"age_s={batch.age_s!r} is not a finite non-negative number"
    revision, load = batch.revision, batch.load
    if revision is not None and batch.order is not None:
        # Two sets of ordering metadata; a publisher stamps an order only without a revision.
        return "order beside revision metadata"
    if revision is not None:
        if not revision.provider_uid:
            return "revision.provider_uid is empty"
        if revision.generation < 0:
            return f"revision.generation={revision.generation} is negative"
        if revision.batch_samples < 0:
            return f"revision.batch_samples={revision.batch_samples} is negative"
    if batch.complete:
        # DESIGN 5b: complete = carries revision metadata and all of that scrape's samples.
        if revision is None:
            return "complete batch without revision metadata"
        if load is None:
            return "complete batch without load"
    if load is not None:
        problem = _load_problem(load)
        if problem is not None:
            return problem
        # batch_samples is the scrape's load-sample count (gridd.core.readings.sample_count,
        # one per serving unit): a complete batch carries exactly that many, an incomplete
        # one no more. An older operator counted the pool-level load as one more sample;
        # its complete batches are still admitted (legacy_sample_count).
        if revision is not None:
            carried = sample_count(load)
            if (batch.complete and revision.batch_samples != carried
                    and revision.batch_samples != legacy_sample_count(load)):
                return f"complete batch carries {carried} samples, revision says {revision.batch_samples}"
            if carried > revision.batch_samples:
                return f"batch carries {carried} samples, revision says {revision.batch_samples}"
    if batch.latency is not None:
        problem = _latency_problem(batch.latency)
        if problem is not None:
            return problem
    for name, value in batch.probes.items():
        if not name:
            return "probe metadata with an empty name"
        if not math.isfinite(value):
            return f"probe {name!r}={value!r} is not finite"
    for name, age in batch.probe_age_s.items():
        if not (math.isfinite(age) and age >= 0):
            return f"probe {name!r} age {age!r} is not a finite age >= 0"
    return None
