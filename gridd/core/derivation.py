"""Load derivation: one provider scrape into its load reading (spec: Provider In-flight; DESIGN 5).

derive_load(expo, pool=..., queue_full_at=...) turns one parsed /metrics exposition into
a LoadSignals. It detects the source:

- an llm-d EPP: pool gauges labelled ``name`` (canonical ``llm_d_epp_*``, falling back to
  the legacy ``inference_pool_*`` twins an older EPP emits), the per-endpoint queue, the
  optional ``inflight-load-producer`` series and flow control;
- a plain vLLM server: ``vllm:*`` engine gauges, one serving unit per ``engine`` label;
- neither (e.g. a standby EPP replica, which reports no pool series): an empty
  LoadSignals, so readiness stays unknown and no load is published.

docs/signals.md has every rule with the sample arithmetic. Pure: no IO, no clock.

EppPlan is the EPP derivation with its label reads done once per Exposition.layout (which
rows are the pool's, which endpoint and producer each in-flight row is): the operator's
publisher keeps it while the layout comes back and feeds it each scrape's values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from gridd.core.exposition import Exposition
from gridd.core.readings import LoadSignals, UnitLoad

__all__ = [
    "WANTED_SAMPLES",
    "LOAD_SAMPLES",
    "Derivation",
    "EppPlan",
    "derive",
    "derive_load",
    "epp_plan",
    "has_vllm_series",
    "kind_mismatch",
    "mismatch_of",
    "pool_names",
]

Labels = dict[str, str]
Series = list[tuple[Labels, float]]

# Pool gauges: (canonical, legacy twin). The canonical family wins whenever it has a
# sample for the pool; the legacy one serves EPPs older than llm-d-router v0.9.
_READY = ("llm_d_epp_ready_endpoints", "inference_pool_ready_pods")
_AVG_RUNNING = ("llm_d_epp_average_running_requests", "inference_pool_average_running_requests")
_AVG_WAITING = ("llm_d_epp_average_queue_size", "inference_pool_average_queue_size")
_AVG_KV = ("llm_d_epp_average_kv_cache_utilization", "inference_pool_average_kv_cache_utilization")
# The std-dev gauges exist only from llm-d-router v0.10; they have no legacy twin.
_STD_KV = "llm_d_epp_std_dev_kv_cache_utilization"
# Per-endpoint waiting count and the label naming the endpoint in each family.
_PER_ENDPOINT = (
    ("llm_d_epp_per_endpoint_queue_size", "model_server_endpoint"),
    ("inference_pool_per_pod_queue_size", "model_server_pod"),
)
_INFLIGHT = "llm_d_epp_inflight_requests"
_FLOW_QUEUE = ("llm_d_epp_flow_control_queue_size", "inference_extension_flow_control_queue_size")

_POOL_FAMILIES = (*_READY, *_AVG_RUNNING, *_AVG_WAITING, *_AVG_KV, _STD_KV,
                  *(name for name, _ in _PER_ENDPOINT))

_VLLM_RUNNING = "vllm:num_requests_running"
_VLLM_WAITING = "vllm:num_requests_waiting"
# vllm:gpu_cache_usage_perc is the pre-0.10 name of vllm:kv_cache_usage_perc.
_VLLM_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")

_INF = math.inf

MAX_READY_ENDPOINTS = 1_000_000
"""Far above any pool; a larger exposed count is clamped here."""

# Every sample the load derivation reads.
LOAD_SAMPLES: frozenset[str] = frozenset({
    *_POOL_FAMILIES, _INFLIGHT, *_FLOW_QUEUE, _VLLM_RUNNING, _VLLM_WAITING, *_VLLM_KV,
})


def _sum_count(name: str) -> tuple[str, str]:
    return (f"{name}_sum", f"{name}_count")


# Every sample the latency window (gridd.core.latency) reads, and no more: a histogram
# contributes only the series the window uses (TTFT buckets, success counts, TPOT sum and
# count), so the parser skips the duration/TPOT bucket runs that make up most of a body.
# Kept here so the scraper passes one set to the parser.
_LATENCY_SAMPLES: frozenset[str] = frozenset({
    "llm_d_epp_request_ttft_seconds_bucket",
    "llm_d_epp_request_duration_seconds_count",
    *_sum_count("llm_d_epp_request_streaming_tpot_seconds"),
    "llm_d_epp_request_error_total",
    "inference_objective_request_duration_seconds_count",
    "inference_objective_request_error_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    *_sum_count("vllm:request_time_per_output_token_seconds"),
    *_sum_count("vllm:inter_token_latency_seconds"),
    *_sum_count("vllm:time_per_output_token_seconds"),
})

WANTED_SAMPLES: frozenset[str] = LOAD_SAMPLES | _LATENCY_SAMPLES


def pool_names(expo: Exposition) -> tuple[str, ...]:
    """The pools an EPP exposition reports (``name`` label of its pool gauges), sorted."""
    names: set[str] = set()
    for family in _POOL_FAMILIES:
        for labels, _ in expo.series(family):
            name = labels.get("name")
            if name is not None:
                names.add(name)
    return tuple(sorted(names))


def kind_mismatch(expo: Exposition, kind: str, *, pools: tuple[str, ...] | None = None) -> str | None:
    """Why a body is not of the configured metrics.kind, or None when it fits.

    "epp" needs the EPP's pool series and "vllm" the engine's vllm:* series; a body
    carrying only the other flavour's is refused. A body with neither (a standby EPP
    replica) fits any kind: it derives nothing, and readiness stays unknown. "auto"
    accepts everything. pools: pool_names(expo), when the caller has it already.
    """
    return mismatch_of(kind, has_epp=bool(pool_names(expo) if pools is None else pools),
                     has_vllm=has_vllm_series(expo))


def mismatch_of(kind: str, *, has_epp: bool, has_vllm: bool) -> str | None:
    """kind_mismatch from what it reads (pool_names non-empty, has_vllm_series), which only
    names decide: a caller keeping them per layout asks here."""
    if kind == "epp" and not has_epp and has_vllm:
        return "metrics.kind is epp but the body is a vLLM engine's (vllm:* series, no EPP pool series)"
    if kind == "vllm" and not has_vllm and has_epp:
        return "metrics.kind is vllm but the body is an EPP's (pool series, no vllm:* series)"
    return None


class Derivation(msgspec.Struct, frozen=True):
    """One scrape's load, and the fields left out of it because their values were out of
    range. invalid: field -> why (the first offending value), e.g. ``{"kv_mean":
    "llm_d_epp_average_kv_cache_utilization=87.5 is outside 0..1"}``; field names are
    LoadSignals' (``kv_usage``, ``running``, ``waiting``, ``in_flight`` also name the
    per-unit values), a bounded set."""

    load: LoadSignals
    invalid: dict[str, str] = {}


class _Checked:
    """Reads values against their range while a load is derived. A value out of range is
    read as absent, and so is every field computed from it ("keep the fields that are
    valid, publish the bad one as absent"); NaN and infinities stay silently absent, as a
    gauge with no value is NaN in Prometheus."""

    __slots__ = ("invalid",)

    def __init__(self) -> None:
        self.invalid: dict[str, str] = {}

    def _bad(self, field: str, where: str, value: float, rule: str) -> None:
        self.invalid.setdefault(field, f"{where}={value:g} {rule}")

    def count(self, field: str, where: str, value: float | None) -> float | None:
        value = _finite(value)
        if value is not None and value < 0:
            self._bad(field, where, value, "is negative")
            return None
        return value

    def fraction(self, field: str, where: str, value: float | None) -> float | None:
        value = _finite(value)
        if value is not None and not 0.0 <= value <= 1.0:
            # E.g. KV-cache usage on a 0-100 scale (seen on a third-party vLLM mock).
            self._bad(field, where, value, "is outside 0..1")
            return None
        return value


def derive(expo: Exposition, *, pool: str | None = None, queue_full_at: float | None = None,
           kind: str = "auto", pools: tuple[str, ...] | None = None) -> Derivation:
    """Derive one provider's load from one exposition (one instant), leaving out the fields
    whose values are out of range (see Derivation, _Checked).

    pool: the InferencePool name (the ``name`` label). None picks the only pool the
        exposition reports; with several pools and no name the reading is ambiguous and
        nothing is derived (an empty LoadSignals: readiness unknown, no load), because
        guessing would publish another pool's load under this provider.
    queue_full_at: a unit whose waiting count is at or above this is queue-full
        (shedding's "queue_full per serving unit"); None counts no unit as full.
    kind: the provider's metrics.kind. "epp" reads only the EPP families, "vllm" only the
        engine's; "auto" tells them apart (EPP pool series first). A body without the
        named flavour's series derives nothing (the caller refuses one of the other
        flavour first: see kind_mismatch).
    pools: pool_names(expo), when the caller has it already (kind_mismatch needed it too).
    """
    checked = _Checked()
    load = _derive(expo, pool, queue_full_at, kind, checked, pools)
    return Derivation(load, checked.invalid)


def derive_load(expo: Exposition, *, pool: str | None = None,
                queue_full_at: float | None = None, kind: str = "auto") -> LoadSignals:
    """The load of derive(...), without the account of what was left out."""
    return derive(expo, pool=pool, queue_full_at=queue_full_at, kind=kind).load


def _derive(expo: Exposition, pool: str | None, queue_full_at: float | None, kind: str,
            checked: _Checked, pools: tuple[str, ...] | None) -> LoadSignals:
    if kind == "vllm":
        return _derive_vllm(expo, queue_full_at, checked) if has_vllm_series(expo) else LoadSignals()
    if pools is None:
        pools = pool_names(expo)
    if pools:
        if pool is None:
            if len(pools) != 1:
                return LoadSignals()
            pool = pools[0]
        if pool not in pools:
            return LoadSignals()
        return _derive_epp(expo, pool, multi_pool=len(pools) > 1, queue_full_at=queue_full_at,
                           checked=checked)
    if kind == "auto" and has_vllm_series(expo):
        return _derive_vllm(expo, queue_full_at, checked)
    return LoadSignals()


def has_vllm_series(expo: Exposition) -> bool:
    """Whether the exposition carries any vLLM engine load series."""
    return any(expo.entries(name) for name in (_VLLM_RUNNING, _VLLM_WAITING, *_VLLM_KV))


def _first_for_pool(expo: Exposition, families: Iterable[str], pool: str) -> float | None:
    for family in families:
        for labels, value in expo.series(family):
            if labels.get("name") == pool:
                return value
    return None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _queue_full(units: Iterable[UnitLoad], queue_full_at: float | None) -> int:
    if queue_full_at is None:
        return 0
    return sum(1 for u in units if u.waiting is not None and u.waiting >= queue_full_at)


def _inflight_per_endpoint(expo: Exposition, checked: _Checked) -> dict[tuple[str, str], float]:
    """Each endpoint's in-flight count: sum over flows within a producer, max over producers.

    Series are keyed (endpoint_name, namespace, producer_name, fairness_id, priority). A
    producer counts every request it tracks on the endpoint once, split by flow, so the
    endpoint's count under one producer is the sum over its flows; two producer instances
    track the same requests, so the spec takes "each endpoint's largest count across
    producer instances" rather than adding them.
    """
    per_producer: dict[tuple[str, str], dict[str, float]] = {}
    for labels, raw in expo.series(_INFLIGHT):
        # A finite count of at least 0 is its own value; checked.count reads the others.
        value = raw if 0.0 <= raw < math.inf else checked.count("in_flight", _INFLIGHT, raw)
        if value is None:
            if not math.isfinite(raw):
                continue
            # One negative count makes the per-endpoint estimate (a sum) unknowable.
            return {}
        endpoint = (labels.get("namespace", ""), labels.get("endpoint_name", ""))
        producers = per_producer.setdefault(endpoint, {})
        producer = labels.get("producer_name", "")
        producers[producer] = producers.get(producer, 0.0) + value
    return {endpoint: max(by_producer.values()) for endpoint, by_producer in per_producer.items()}


def _derive_epp(expo: Exposition, pool: str, *, multi_pool: bool,
                queue_full_at: float | None, checked: _Checked) -> LoadSignals:
    ready_raw = checked.count("ready_endpoints", _READY[0], _first_for_pool(expo, _READY, pool))
    # Bounded: a wild value must not become an integer the wire cannot carry.
    ready = None if ready_raw is None else min(MAX_READY_ENDPOINTS, int(ready_raw))

    # Flow control labels its series with inference_pool (the --pool-name flag), which is
    # empty in endpoint-selector mode. A stock EPP serves one pool, so with one pool in the
    # exposition every flow-control series is that pool's; only a multi-pool exposition
    # needs the label to tell them apart.
    flow_family = next((f for f in _FLOW_QUEUE if expo.entries(f)), None)
    flow_queue = 0.0
    if flow_family is not None:
        for labels, raw in expo.series(flow_family):
            if multi_pool and labels.get("inference_pool") != pool:
                continue
            value = checked.count("flow_queue", flow_family, raw)
            if value is not None:
                flow_queue += value

    # "A site with no fresh endpoint publishes nothing, since its averages are frozen":
    # with ready_endpoints == 0 the EPP leaves every average and std-dev gauge at its last
    # value, and the per-endpoint queue still lists stale endpoints. Only the count itself
    # and the live flow-control queue are kept.
    if ready == 0:
        return LoadSignals(ready_endpoints=0, flow_queue=flow_queue)

    avg_running = checked.count("avg_running", _AVG_RUNNING[0], _first_for_pool(expo, _AVG_RUNNING, pool))
    avg_waiting = checked.count("avg_waiting", _AVG_WAITING[0], _first_for_pool(expo, _AVG_WAITING, pool))
    kv_mean = checked.fraction("kv_mean", _AVG_KV[0], _first_for_pool(expo, _AVG_KV, pool))
    # A spread of 0..1 fractions is itself within 0..1; one outside is on another scale.
    kv_spread = checked.fraction("kv_spread", _STD_KV, _first_for_pool(expo, (_STD_KV,), pool))
    if "kv_mean" in checked.invalid and kv_spread is not None:
        # The spread of the same per-endpoint values, so on the same wrong scale.
        kv_spread = None
        checked.invalid.setdefault("kv_spread", "left out with kv_mean (the same endpoints' values)")

    # "The per-endpoint count carries no pool label, so an EPP serving several pools falls
    # back to the averages alone."
    inflight = {} if multi_pool else _inflight_per_endpoint(expo, checked)

    waiting_by_endpoint: dict[str, float | None] = {}
    for family, endpoint_label in _PER_ENDPOINT:
        for labels, raw in expo.series(family):
            if labels.get("name") == pool and math.isfinite(raw):
                # A negative count leaves the endpoint listed, its waiting count absent.
                waiting_by_endpoint.setdefault(labels.get(endpoint_label, ""),
                                               checked.count("waiting", family, raw))
        if waiting_by_endpoint:
            break
    return _epp_load(ready, flow_queue, avg_running, avg_waiting, kv_mean, kv_spread, inflight,
                     waiting_by_endpoint, queue_full_at)


def _epp_load(ready: int | None, flow_queue: float, avg_running: float | None, avg_waiting: float | None,
              kv_mean: float | None, kv_spread: float | None, inflight: dict[tuple[str, str], float],
              waiting_by_endpoint: dict[str, float | None], queue_full_at: float | None) -> LoadSignals:
    """An EPP pool's load from the values _derive_epp (or an EppPlan) read for it."""
    inflight_by_name: dict[str, float] = {}
    for (_, name), count in inflight.items():
        inflight_by_name[name] = inflight_by_name.get(name, 0.0) + count
    # The EPP exposes no per-endpoint running count or KV usage: running and kv_usage stay
    # None (docs/signals.md explains why running is not inferred from in-flight - waiting).
    units = tuple(
        UnitLoad(unit=name, waiting=waiting, in_flight=inflight_by_name.get(name))
        for name, waiting in sorted(waiting_by_endpoint.items())
    )

    # Provider In-flight: the larger of the per-endpoint estimate and the averages
    # estimate, plus flow control. "The larger, so an EPP restart that zeroes its count
    # does not make the site look idle." An estimate whose inputs are absent is skipped
    # (no in-flight producer; no average-running gauge before GIE v1.5 or without a
    # ready count); with neither estimate there is no in_flight.
    estimates: list[float] = []
    if inflight:
        estimates.append(sum(inflight.values()))
    if avg_running is not None and avg_waiting is not None and ready is not None:
        estimates.append((avg_running + avg_waiting) * ready)
    in_flight = max(estimates) + flow_queue if estimates else None

    return LoadSignals(
        ready_endpoints=ready,
        units=units,
        avg_running=avg_running,
        avg_waiting=avg_waiting,
        kv_mean=kv_mean,
        kv_spread=kv_spread,
        flow_queue=flow_queue,
        in_flight=in_flight,
        queue_full_units=_queue_full(units, queue_full_at),
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sample_std_dev(values: list[float]) -> float | None:
    """Sample standard deviation (n - 1), as the EPP's std-dev gauges; 0 for one value."""
    if not values:
        return None
    if len(values) == 1:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _derive_vllm(expo: Exposition, queue_full_at: float | None, checked: _Checked) -> LoadSignals:
    """A provider pointed at vLLM's own /metrics: one unit per data-parallel engine.

    No ready-endpoint series exists, so ready_endpoints is None ("leaves readiness
    unknown, not false, and does not exclude"). An engine value out of range is absent
    for that engine, and the pool figure computed from it (mean, spread, in-flight) is
    absent too: a mean over the other engines would not describe the pool.
    """
    def per_engine(families: tuple[str, ...], field: str, *,
                   fraction: bool = False) -> dict[str, float | None]:
        read = checked.fraction if fraction else checked.count
        for family in families:
            found: dict[str, float | None] = {}
            for labels, raw in expo.series(family):
                if math.isfinite(raw):
                    found.setdefault(labels.get("engine", "0"), read(field, family, raw))
            if found:
                return found
        return {}

    running = per_engine((_VLLM_RUNNING,), "running")
    waiting = per_engine((_VLLM_WAITING,), "waiting")
    kv = per_engine(_VLLM_KV, "kv_usage", fraction=True)
    engines = sorted(set(running) | set(waiting) | set(kv), key=lambda e: (len(e), e))
    units = tuple(UnitLoad(unit=e, running=running.get(e), waiting=waiting.get(e), kv_usage=kv.get(e))
                  for e in engines)

    def complete(values: dict[str, float | None]) -> list[float] | None:
        """Every engine's value, or None when one of them was out of range."""
        kept = [v for v in values.values() if v is not None]
        return kept if len(kept) == len(values) else None

    running_values, waiting_values, kv_values = complete(running), complete(waiting), complete(kv)
    for values, source, figures in ((running_values, "running", ("avg_running", "in_flight")),
                                    (waiting_values, "waiting", ("avg_waiting", "in_flight")),
                                    (kv_values, "kv_usage", ("kv_mean", "kv_spread"))):
        if values is None:
            for figure in figures:
                checked.invalid.setdefault(
                    figure, f"left out with {source} (computed from every engine's value)")
    in_flight = None
    if (running or waiting) and running_values is not None and waiting_values is not None:
        in_flight = sum(running_values) + sum(waiting_values)
    return LoadSignals(
        ready_endpoints=None,
        units=units,
        avg_running=_mean(running_values or []),
        avg_waiting=_mean(waiting_values or []),
        kv_mean=_mean(kv_values or []),
        kv_spread=_sample_std_dev(kv_values or []),
        flow_queue=0.0,
        in_flight=in_flight,
        queue_full_units=_queue_full(units, queue_full_at),
    )


# --- the same derivation, its label reads kept per layout ------------------------------------

# Where a pool gauge's value is: (family, index in expo.series(family)), None when absent.
_Position = tuple[str, int] | None


def _position(expo: Exposition, families: Iterable[str], pool: str) -> _Position:
    """Where _first_for_pool finds its value."""
    for family in families:
        for index, (labels, _) in enumerate(expo.series(family)):
            if labels.get("name") == pool:
                return family, index
    return None


def _value_at(expo: Exposition, position: _Position) -> float | None:
    return None if position is None else expo.values(position[0])[position[1]]


class EppPlan:
    """What the derivation of one EPP pool reads from an exposition's names and labels alone:
    where each of the pool's gauges is, which flow-control rows count, which in-flight rows
    add up to which endpoint and producer, which per-endpoint rows name which endpoint.

    Built by epp_plan from one exposition, ``derive(expo)`` gives derive(...)'s Derivation
    for any exposition with the same names and labels in the same order (the same
    Exposition.layout): every read below picks, by position, the rows the plain path picks
    by label, and feeds their values to the same checks in the same order."""

    __slots__ = ("multi_pool", "ready", "avg_running", "avg_waiting", "avg_kv", "std_kv", "flow_family",
                 "flow_rows", "inflight_slots", "inflight_endpoints", "waiting")

    def __init__(self, expo: Exposition, pool: str, *, multi_pool: bool) -> None:
        self.multi_pool = multi_pool
        self.ready = _position(expo, _READY, pool)
        self.avg_running = _position(expo, _AVG_RUNNING, pool)
        self.avg_waiting = _position(expo, _AVG_WAITING, pool)
        self.avg_kv = _position(expo, _AVG_KV, pool)
        self.std_kv = _position(expo, (_STD_KV,), pool)
        self.flow_family = next((f for f in _FLOW_QUEUE if expo.entries(f)), None)
        self.flow_rows: tuple[int, ...] = ()
        if self.flow_family is not None:
            self.flow_rows = tuple(
                index for index, (labels, _) in enumerate(expo.series(self.flow_family))
                if not (multi_pool and labels.get("inference_pool") != pool))
        # In-flight: each row's (endpoint, producer) slot, and each endpoint's slots, both in
        # order of first appearance (the plain path's dict orders).
        slots: dict[tuple[str, str, str], int] = {}
        endpoints: dict[tuple[str, str], list[int]] = {}
        self.inflight_slots: list[int] = []
        for labels, _ in expo.series(_INFLIGHT) if not multi_pool else ():
            endpoint = (labels.get("namespace", ""), labels.get("endpoint_name", ""))
            key = (*endpoint, labels.get("producer_name", ""))
            if key not in slots:
                slots[key] = len(slots)
                endpoints.setdefault(endpoint, []).append(slots[key])
            self.inflight_slots.append(slots[key])
        self.inflight_endpoints = list(endpoints.items())
        # Per-endpoint queue: per family, the pool's rows and the endpoint each names.
        self.waiting = [
            (family, [(index, labels.get(endpoint_label, ""))
                      for index, (labels, _) in enumerate(expo.series(family)) if labels.get("name") == pool])
            for family, endpoint_label in _PER_ENDPOINT]

    def derive(self, expo: Exposition, queue_full_at: float | None) -> Derivation:
        """_derive_epp's reading of ``expo`` (same layout as the plan's), as derive returns it."""
        # checked.count(field, where, v) is v itself for a finite v >= 0 (0.0 <= v < inf), and
        # checked.fraction(...) for one within 0..1: those skip the call (it records nothing).
        checked = _Checked()
        raw = _value_at(expo, self.ready)
        ready_raw = (raw if raw is not None and 0.0 <= raw < _INF
                     else checked.count("ready_endpoints", _READY[0], raw))
        ready = None if ready_raw is None else min(MAX_READY_ENDPOINTS, int(ready_raw))
        flow_queue = 0.0
        if self.flow_family is not None:
            rows = expo.values(self.flow_family)
            for index in self.flow_rows:
                raw = rows[index]
                value = raw if 0.0 <= raw < _INF else checked.count("flow_queue", self.flow_family, raw)
                if value is not None:
                    flow_queue += value
        if ready == 0:
            return Derivation(LoadSignals(ready_endpoints=0, flow_queue=flow_queue), checked.invalid)
        raw = _value_at(expo, self.avg_running)
        avg_running = (raw if raw is not None and 0.0 <= raw < _INF
                       else checked.count("avg_running", _AVG_RUNNING[0], raw))
        raw = _value_at(expo, self.avg_waiting)
        avg_waiting = (raw if raw is not None and 0.0 <= raw < _INF
                       else checked.count("avg_waiting", _AVG_WAITING[0], raw))
        raw = _value_at(expo, self.avg_kv)
        kv_mean = (raw if raw is not None and 0.0 <= raw <= 1.0
                   else checked.fraction("kv_mean", _AVG_KV[0], raw))
        raw = _value_at(expo, self.std_kv)
        kv_spread = (raw if raw is not None and 0.0 <= raw <= 1.0
                     else checked.fraction("kv_spread", _STD_KV, raw))
        if "kv_mean" in checked.invalid and kv_spread is not None:
            kv_spread = None
            checked.invalid.setdefault("kv_spread", "left out with kv_mean (the same endpoints' values)")
        inflight = {} if self.multi_pool else self._inflight(expo, checked)
        waiting_by_endpoint: dict[str, float | None] = {}
        for family, picked in self.waiting:
            rows = expo.values(family)
            for index, endpoint in picked:
                raw = rows[index]
                if math.isfinite(raw):
                    waiting_by_endpoint.setdefault(
                        endpoint, raw if raw >= 0.0 else checked.count("waiting", family, raw))
            if waiting_by_endpoint:
                break
        load = _epp_load(ready, flow_queue, avg_running, avg_waiting, kv_mean, kv_spread, inflight,
                         waiting_by_endpoint, queue_full_at)
        return Derivation(load, checked.invalid)

    def _inflight(self, expo: Exposition, checked: _Checked) -> dict[tuple[str, str], float]:
        """_inflight_per_endpoint. When every count is a finite number of at least 0 (else the
        plain function decides), every slot gets its first count added to 0.0 and the rest in
        row order, and every endpoint appears in order of its first row, as there."""
        rows = expo.values(_INFLIGHT)
        sums = [0.0] * len(rows)
        for slot, raw in zip(self.inflight_slots, rows, strict=True):
            if not 0.0 <= raw < _INF:
                return _inflight_per_endpoint(expo, checked)
            sums[slot] += raw
        return {endpoint: sums[slots[0]] if len(slots) == 1 else max(map(sums.__getitem__, slots))
                for endpoint, slots in self.inflight_endpoints}


def epp_plan(expo: Exposition, *, pool: str | None, kind: str, pools: tuple[str, ...]) -> EppPlan | None:
    """The EppPlan derive(expo, pool=pool, kind=kind, pools=pools) reads through, or None
    when that derivation is not an EPP pool's (vLLM, no pool, an ambiguous or absent pool):
    those take the plain derive."""
    if kind == "vllm" or not pools:
        return None
    if pool is None:
        if len(pools) != 1:
            return None
        pool = pools[0]
    if pool not in pools:
        return None
    return EppPlan(expo, pool, multi_pool=len(pools) > 1)
