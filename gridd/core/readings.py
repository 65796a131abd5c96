"""What one provider's scrape says, as it travels from operator to gateway.

These frozen msgspec structs are produced by load derivation (gridd.core.derivation),
carried whole inside signals-channel batches (gridd.wire) and read by the gateway's
learning and selection. New fields always get defaults (schema evolution).
"""

from __future__ import annotations

import msgspec


class UnitLoad(msgspec.Struct, frozen=True, array_like=True):
    """One serving unit (an EPP endpoint, or one vLLM engine) at one instant.

    A field the source does not expose for that unit is None (the EPP exposes a
    per-endpoint waiting count and in-flight count, but no per-endpoint KV usage).

    in_flight: the EPP's per-endpoint llm_d_epp_inflight_requests (summed over flows,
        largest across producer instances); None without an in-flight producer, for a
        multi-pool EPP (the series has no pool label) and for vLLM engines.
    """

    unit: str
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    in_flight: float | None = None


class LatencyBlock(msgspec.Struct, frozen=True):
    """Recent latency over the window; only built when >= min_completed requests completed."""

    window_s: float
    completed: int
    ttft_p50_s: float | None = None
    ttft_p90_s: float | None = None
    tpot_s: float | None = None
    error_ratio: float | None = None


class LoadSignals(msgspec.Struct, frozen=True):
    """Pool-level load read from one scrape (one instant). None = not exposed / not fresh.

    ready_endpoints: the EPP's fresh-endpoint count; None when the exposition has no
        pool ready-endpoint series (e.g. plain vLLM), which leaves readiness unknown.
    units: per-serving-unit samples; empty when the per-unit series are absent.
    avg_running / avg_waiting: pool averages (vLLM direct: means over engines).
    kv_mean / kv_spread: KV-cache usage mean and spread (std dev), 0..1 fractions.
    flow_queue: what the EPP's flow control holds for the pool (0 when absent).
    in_flight: the operator's published estimate (spec: Provider In-flight); None when
        the provider has no fresh endpoint (averages are frozen then).
    queue_full_units: serving units whose waiting queue is at its limit (for shedding).
    """

    ready_endpoints: int | None = None
    units: tuple[UnitLoad, ...] = ()
    avg_running: float | None = None
    avg_waiting: float | None = None
    kv_mean: float | None = None
    kv_spread: float | None = None
    flow_queue: float = 0.0
    in_flight: float | None = None
    queue_full_units: int = 0


class Revision(msgspec.Struct, frozen=True, array_like=True):
    """Revision metadata of one qualified provider batch (spec: Provider revisions)."""

    provider_uid: str
    generation: int
    publisher_epoch: int
    batch_sequence: int
    batch_samples: int


class BatchOrder(msgspec.Struct, frozen=True, array_like=True):
    """Ordering metadata of a batch without revision metadata (a verdict-only batch).

    Receivers order every batch by (publisher_epoch, batch_sequence): a qualified batch by
    its Revision, any other by this. Its sequence comes from the same per-epoch counter,
    so both kinds interleave in publication order even after the wall clock stepped back.
    It carries no learning metadata: a batch with only an order still disables learning.
    """

    publisher_epoch: int
    batch_sequence: int


def sample_count(load: LoadSignals) -> int:
    """The batch's load-sample count (``batch_samples``): one per serving unit.

    DESIGN 5: a batch "carries its sample count", and its load samples are per serving
    unit. So the count is ``len(load.units)``; a batch that has fresh pool-level load
    (avg_running, avg_waiting, kv_mean or in_flight) but no per-unit series counts the
    pool as its one sample. A provider with no fresh endpoint carries neither and counts
    0, which is what the spec's "A zero-sample revision invalidates learning" needs.
    ready_endpoints and flow_queue are not load samples: they are stamped even when
    nothing is fresh.
    """
    if load.units:
        return len(load.units)
    return 1 if _has_pool_sample(load) else 0


def legacy_sample_count(load: LoadSignals) -> int:
    """The count operators published before it was per serving unit: the units plus one
    for the pool-level load. Receivers still accept it on a complete batch, so a fleet
    upgraded one site at a time keeps admitting the older sites' batches."""
    return len(load.units) + (1 if _has_pool_sample(load) else 0)


def _has_pool_sample(load: LoadSignals) -> bool:
    return (load.avg_running is not None or load.avg_waiting is not None or load.kv_mean is not None
            or load.in_flight is not None)
