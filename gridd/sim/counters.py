"""What the simulated pool counts, and the snapshot of it that /metrics renders.

The model (gridd.sim.model) keeps one ``EngineTally`` per serving unit (a vLLM engine's
counters and histograms) and one ``PoolTally`` for the pool (the EPP's); ``view()`` turns each
into frozen counters, and ``ModelSnapshot`` carries them with the model's instant state to
gridd.sim.metrics. Histogram buckets are the real exporters' (docs: reference/epp-metrics.md
sections 5 and 9). Pure: no trio, no IO.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

# EPP bucket boundaries (docs: reference/epp-metrics.md section 5).
EPP_TTFT_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 1.25, 1.5, 2, 3, 4, 5, 6, 8,
                    10, 15, 20, 30, 45, 60, 120)
EPP_DURATION_BUCKETS = EPP_TTFT_BUCKETS + (180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
EPP_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10)
EPP_STREAMING_TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15,
                              0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1, 2)
EPP_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)
EPP_FLOW_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                          5, 10, 30, 60)
# vLLM bucket boundaries (section 9).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5,
                     7.5, 10, 20, 40, 80, 160, 640, 2560)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5,
                    10, 20, 40, 80)
VLLM_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480,
                      960, 1920, 7680)

# Per-engine (vLLM) histograms: name -> buckets.
ENGINE_HISTOGRAMS = {
    "time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "inter_token_latency_seconds": VLLM_ITL_BUCKETS,
    "request_time_per_output_token_seconds": VLLM_ITL_BUCKETS,
    "e2e_request_latency_seconds": VLLM_PHASE_BUCKETS,
    "request_queue_time_seconds": VLLM_PHASE_BUCKETS,
    "request_inference_time_seconds": VLLM_PHASE_BUCKETS,
    "request_prefill_time_seconds": VLLM_PHASE_BUCKETS,
    "request_decode_time_seconds": VLLM_PHASE_BUCKETS,
}
FINISHED_REASONS = ("stop", "length", "abort")


class Histogram:
    """A cumulative histogram with fixed upper bounds (+Inf implied)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        if times <= 0:
            return
        i = 0
        while i < len(self.bounds) and value > self.bounds[i]:
            i += 1
        self.counts[i] += times
        self.sum += value * times
        self.count += times

    def view(self) -> HistogramView:
        cumulative, running = [], 0
        for c in self.counts:
            running += c
            cumulative.append(running)
        return HistogramView(self.bounds, tuple(cumulative), self.sum, self.count)


class HistogramView(msgspec.Struct, frozen=True, array_like=True):
    """bounds: upper bounds without +Inf; cumulative: one count per bound, then +Inf."""

    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    sum: float
    count: int


class EngineCounters(msgspec.Struct, frozen=True):
    """Cumulative per-endpoint (vLLM engine) counters since the last reset."""

    success: tuple[tuple[str, int], ...]
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    histograms: tuple[tuple[str, HistogramView], ...]


class EndpointSnapshot(msgspec.Struct, frozen=True):
    index: int
    running: int
    waiting: int
    kv_usage: float
    inflight_tokens: int
    scheduled: int
    retired: bool
    engine: EngineCounters


class PoolCounters(msgspec.Struct, frozen=True):
    """Cumulative pool-level (EPP) counters since the last reset.

    histograms keys: ttft_stream, ttft_nonstream, duration, ntpot, streaming_tpot,
    streaming_itl; flow_queue maps a flow-control outcome to its queue-duration histogram.
    """

    request_total: int
    errors: tuple[tuple[str, int], ...]
    flow_outcomes: tuple[tuple[str, int], ...]
    scheduling_failures: int
    histograms: tuple[tuple[str, HistogramView], ...]
    flow_queue: tuple[tuple[str, HistogramView], ...]


class ModelSnapshot(msgspec.Struct, frozen=True):
    """The model at one instant: what /metrics renders."""

    now: float
    max_seqs: int
    flow_control: bool
    endpoints: tuple[EndpointSnapshot, ...]
    departed: tuple[int, ...]
    flow_held: int
    flow_held_bytes: int
    in_flight: int
    counters_reset_at: float
    pool: PoolCounters


def _new_engine_histograms() -> dict[str, Histogram]:
    return {name: Histogram(bounds) for name, bounds in ENGINE_HISTOGRAMS.items()}


@dataclass(slots=True)
class EngineTally:
    success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    histograms: dict[str, Histogram] = field(default_factory=_new_engine_histograms)

    def view(self) -> EngineCounters:
        return EngineCounters(
            success=tuple(self.success.items()),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            preemptions=self.preemptions,
            histograms=tuple((k, h.view()) for k, h in self.histograms.items()),
        )


def _new_pool_histograms() -> dict[str, Histogram]:
    return {
        "ttft_nonstream": Histogram(EPP_TTFT_BUCKETS),
        "ttft_stream": Histogram(EPP_TTFT_BUCKETS),
        "duration": Histogram(EPP_DURATION_BUCKETS),
        "ntpot": Histogram(EPP_NTPOT_BUCKETS),
        "streaming_tpot": Histogram(EPP_STREAMING_TPOT_BUCKETS),
        "streaming_itl": Histogram(EPP_ITL_BUCKETS),
    }


@dataclass(slots=True)
class PoolTally:
    request_total: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    flow_outcomes: dict[str, int] = field(default_factory=dict)
    scheduling_failures: int = 0
    histograms: dict[str, Histogram] = field(default_factory=_new_pool_histograms)
    flow_queue: dict[str, Histogram] = field(default_factory=dict)

    def flow(self, outcome: str, waited: float) -> None:
        self.flow_outcomes[outcome] = self.flow_outcomes.get(outcome, 0) + 1
        hist = self.flow_queue.setdefault(outcome, Histogram(EPP_FLOW_QUEUE_BUCKETS))
        hist.observe(waited)

    def error(self, code: str) -> None:
        self.errors[code] = self.errors.get(code, 0) + 1

    def view(self) -> PoolCounters:
        return PoolCounters(
            request_total=self.request_total,
            errors=tuple(sorted(self.errors.items())),
            flow_outcomes=tuple(sorted(self.flow_outcomes.items())),
            scheduling_failures=self.scheduling_failures,
            # Histograms with no observation are absent, like an EPP vector with no child.
            histograms=tuple((k, h.view()) for k, h in self.histograms.items() if h.count),
            flow_queue=tuple(sorted((k, h.view()) for k, h in self.flow_queue.items())),
        )
