"""Render the simulator's /metrics body from a model snapshot (pure: no trio, no IO).

Two flavours, one per real backend a provider can point at:

* ``epp``: what an llm-d EPP v0.10 (llm-d-router) serves for one pool: the canonical
  ``llm_d_epp_*`` families and the legacy twins it still dual-emits
  (``inference_pool_*``, ``inference_objective_*``, ``inference_extension_*``), in
  client_golang text 0.0.4 form: families sorted by name, label names sorted, ``le``
  last, numbers in Go's shortest form.
* ``vllm``: what one vLLM server with ``endpoints`` data-parallel engines (label
  ``engine``) serves, written by prometheus_client itself (counters with ``_total`` and
  ``_created``, floats like ``12.0``).

There is no mixed flavour: a real endpoint serves one or the other, and a provider
pointed at either must be tested against exactly what that endpoint would say.

EPP behaviours mirrored (docs/simulator.md, reference/epp-metrics.md s4):

* Pool gauges are computed over fresh endpoints at scrape time. With no fresh endpoint
  (``zero_ready`` or an empty pool) ``ready_endpoints`` is 0 and every average/std-dev
  gauge keeps the value of the last scrape that had one (the caller passes it in as
  ``latched``); never having had one, the gauges are absent.
* Means and sample (n-1) standard deviations are rounded to 2 decimals (v0.10).
* A family with no child (no request yet, flow control off) prints nothing at all.
"""

from __future__ import annotations

import decimal
import math
import statistics

import msgspec
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from gridd.sim.counters import HistogramView, ModelSnapshot
from gridd.sim.model import SimKnobs

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BODY_CAP_BYTES = 1 << 20
HUGE_BODY_BYTES = BODY_CAP_BYTES + 64 * 1024

EPP_NAMESPACE = "gridd-sim"
EPP_PORT = "8000"
EPP_BUILD = {"build_ref": "v0.10.0", "commit": "gridd-sim"}
FLOW_LABELS = {"fairness_id": "default-flow", "priority": "0"}
INFLIGHT_PRODUCER = "inflight-load"
SATURATION_DETECTOR = "utilization-detector"
# Utilization detector defaults: queue threshold 5 requests, KV threshold 0.8.
SATURATION_QUEUE_THRESHOLD = 5.0
SATURATION_KV_THRESHOLD = 0.8


class PoolStats(msgspec.Struct, frozen=True):
    """The EPP's pool gauges from one refresh (means and std devs, rounded)."""

    avg_kv: float
    avg_queue: float
    avg_running: float
    sd_kv: float
    sd_queue: float
    sd_running: float


def endpoint_pod(pool: str, index: int) -> str:
    """The simulated pod name of endpoint ``index`` (``model_server_endpoint`` adds ``-rank-0``)."""
    return f"{pool}-decode-{index}"


def endpoint_id(pool: str, index: int) -> str:
    return f"{endpoint_pod(pool, index)}-rank-0"


def _round2(x: float) -> float:
    # Go's math.Round(x*100)/100: halves away from zero (Python's round() is half-even).
    return math.copysign(math.floor(abs(x) * 100 + 0.5), x) / 100


def _sd(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def pool_stats(snapshot: ModelSnapshot) -> PoolStats | None:
    """Means and sample std devs over the snapshot's endpoints; None with no endpoint."""
    eps = snapshot.endpoints
    if not eps:
        return None
    kv = [e.kv_usage for e in eps]
    queue = [float(e.waiting) for e in eps]
    running = [float(e.running) for e in eps]
    return PoolStats(
        avg_kv=_round2(statistics.fmean(kv)),
        avg_queue=_round2(statistics.fmean(queue)),
        avg_running=_round2(statistics.fmean(running)),
        sd_kv=_round2(_sd(kv)),
        sd_queue=_round2(_sd(queue)),
        sd_running=_round2(_sd(running)),
    )


def render_metrics(snapshot: ModelSnapshot, knobs: SimKnobs, *, latched: PoolStats | None,
                   created_unix: float) -> tuple[bytes, PoolStats | None]:
    """The /metrics body, and the pool stats to latch for the next scrape.

    latched: pool stats of the last scrape with a fresh endpoint (None after a restart).
    created_unix: wall-clock time of the last (simulated) process start.
    """
    if knobs.flavour == "vllm":
        body = render_vllm(snapshot, knobs, created_unix=created_unix)
    else:
        fresh = None if knobs.zero_ready else pool_stats(snapshot)
        if fresh is not None:
            latched = fresh
        body = render_epp(snapshot, knobs, stats=latched, fresh=fresh is not None,
                          created_unix=created_unix)
    target = max(knobs.body_bytes, HUGE_BODY_BYTES if knobs.huge_body else 0)
    return pad_body(body, target), latched


# -- Go text format --------------------------------------------------------------------------


def go_float(value: float) -> str:
    """strconv.FormatFloat(v, 'g', -1, 64) as client_golang writes sample values."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    # repr() is the shortest round-trip form, the digits Go's shortest mode picks too.
    _, digit_tuple, exponent = decimal.Decimal(repr(abs(value))).normalize().as_tuple()
    assert isinstance(exponent, int)  # finite: NaN and infinities were answered above
    digits = "".join(map(str, digit_tuple))
    nd = len(digits)
    dp = nd + exponent  # value = 0.<digits> x 10^dp
    exp10 = dp - 1
    if exp10 < -4 or exp10 >= 6:
        # Shortest 'g' switches to %e when the exponent is < -4 or >= 6 (eprec = 6).
        mantissa = digits[0] + ("." + digits[1:] if nd > 1 else "")
        return f"{sign}{mantissa}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    if dp <= 0:
        return f"{sign}0.{'0' * -dp}{digits}"
    if dp >= nd:
        return f"{sign}{digits}{'0' * (dp - nd)}"
    return f"{sign}{digits[:dp]}.{digits[dp:]}"


def _escape_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict[str, str], le: str | None = None) -> str:
    parts = [f'{k}="{_escape_value(labels[k])}"' for k in sorted(labels)]
    if le is not None:
        parts.append(f'le="{le}"')
    return "{" + ",".join(parts) + "}" if parts else ""


SampleValue = float | HistogramView
"""A sample's value: a number, or a whole histogram (its family's type is "histogram")."""


class _GoFamilies:
    """Collects families, then writes them the way client_golang does."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[tuple[dict[str, str], SampleValue]]]] = {}

    def add(self, name: str, typ: str, help_text: str, labels: dict[str, str], value: SampleValue) -> None:
        fam = self._families.setdefault(name, (typ, help_text, []))
        fam[2].append((labels, value))

    def render(self) -> str:
        out: list[str] = []
        for name in sorted(self._families):
            typ, help_text, series = self._families[name]
            out.append(f"# HELP {name} {_escape_help(help_text)}\n# TYPE {name} {typ}\n")
            for labels, value in sorted(series, key=lambda s: [s[0][k] for k in sorted(s[0])]):
                if isinstance(value, HistogramView):
                    for bound, count in zip(value.bounds, value.cumulative, strict=False):
                        out.append(f"{name}_bucket{_labels(labels, go_float(bound))} {count}\n")
                    out.append(f"{name}_bucket{_labels(labels, '+Inf')} {value.cumulative[-1]}\n")
                    out.append(f"{name}_sum{_labels(labels)} {go_float(value.sum)}\n")
                    out.append(f"{name}_count{_labels(labels)} {value.count}\n")
                else:
                    out.append(f"{name}{_labels(labels)} {go_float(value)}\n")
        return "".join(out)


_ALPHA = "[ALPHA] "


def _deprecated(canonical: str) -> str:
    return f"{_ALPHA}[Deprecated: Use {canonical}] "


_HELP = {
    "ready": "The number of ready endpoints in the inference server pool.",
    "ready_pods": "The number of ready pods in the inference server pool.",
    "avg_kv": "The average kv cache utilization for an inference server pool.",
    "avg_queue": "The average number of requests pending in the model server queue.",
    "avg_running": "The average number of running requests across model servers in the pool.",
    "sd_kv": "The standard deviation kv cache utilization for an inference server pool.",
    "sd_queue": "The standard deviation number of requests pending in the model server queue.",
    "sd_running": "The standard deviation number of running requests across model servers in the pool.",
    "per_endpoint": "The total number of requests pending in the model server queue for each underlying "
                    "endpoint.",
    "per_pod": "The total number of requests pending in the model server queue for each underlying pod.",
    "request_total": "Total number of processed requests.",
    "request_total_legacy": "Counter of inference objective requests broken out for each model and target "
                            "model.",
    "error_total": "Total number of request errors.",
    "error_total_legacy": "Counter of inference objective requests errors broken out for each model and "
                          "target model.",
    "running": "Current number of active running requests.",
    "running_legacy": "Inference objective number of running requests in each model.",
    "ttft": "Time to first token in seconds, measured from request received to first response byte. "
            "For non-streaming requests, this equals total request duration.",
    "duration": "End-to-end request latency distribution in seconds.",
    "ntpot": "Normalized time per output token in seconds (end-to-end latency divided by output token "
             "count).",
    "streaming_tpot": "Average time per output token in seconds for streaming requests, computed as "
                      "(e2e - TTFT) / (output_tokens - 1).",
    "streaming_itl": "Inter-token latency in seconds for streaming requests, measured as the time "
                     "between consecutive response body chunks.",
    "attempts": "Total number of scheduling attempts.",
    "info": "General information of the current build of Inference Extension.",
    "inflight_requests": "Current number of in-flight requests per endpoint, as tracked by the in-flight "
                         "load producer.",
    "inflight_tokens": "Current number of in-flight tokens per endpoint (uncached prompt tokens, optionally "
                       "plus estimated output), as tracked by the in-flight load producer.",
    "fc_queue_size": "Current number of requests actively held in the Flow Control queue.",
    "fc_queue_bytes": "Current total size in bytes of requests actively held in the Flow Control queue.",
    "fc_requests": "Total number of requests processed by the Flow Control layer.",
    "fc_queue_duration": "Distribution of total time requests spend in the Flow Control layer "
                         "(from enqueue to final outcome).",
    "fc_saturation": "Pool saturation signal gating Flow Control dispatch. The stage label partitions by "
                     "pipeline role: 'prefill' and 'decode' are per-stage signals, 'effective' is "
                     "max(prefill, decode) and is the value used for gating. 1.0 is the gating set point; "
                     "values above 1.0 indicate the magnitude of oversubscription past it. An empty pool "
                     "reads as 1.0. With the default utilization detector, endpoints with missing or stale "
                     "metrics score as fully saturated (fail-closed; see flow_control_stale_endpoints).",
    "fc_stale": "Number of candidate endpoints whose metrics are missing or older than the staleness "
                "threshold, as of the most recent saturation evaluation. Recorded by the utilization "
                "saturation detector, which scores these endpoints as fully saturated in "
                "flow_control_pool_saturation (fail-closed): a nonzero value during a dispatch stall "
                "indicates a metrics collection problem rather than genuine overload. This gauge carries "
                "no stage label and is written on every detector call, so it reflects the most recently "
                "evaluated stage; a reading of 0 does not rule out stale metrics in another stage. "
                "Per-stage stale accounting is tracked in #2475.",
    "process_start": "Start time of the process since unix epoch in seconds.",
    "padding": "Padding series of the gridd simulator (huge_body knob); carries no load.",
}


def render_epp(snapshot: ModelSnapshot, knobs: SimKnobs, *, stats: PoolStats | None, fresh: bool,
               created_unix: float) -> bytes:
    """The EPP exposition. stats: pool gauges to print (fresh or latched); fresh: whether
    they come from this scrape (ready_endpoints is the endpoint count) or not (0)."""
    f = _GoFamilies()
    pool = {"name": knobs.pool}
    model = {"model_name": knobs.model, "target_model_name": knobs.model}
    flow = {**FLOW_LABELS, **model}
    per_unit = not knobs.stop_unit_series
    eps = snapshot.endpoints
    counters = snapshot.pool

    # Pool gauges (+ legacy twins).
    ready = len(eps) if fresh else 0
    f.add("llm_d_epp_ready_endpoints", "gauge", _ALPHA + _HELP["ready"], pool, ready)
    f.add("inference_pool_ready_pods", "gauge",
          _deprecated("llm_d_epp_ready_endpoints") + _HELP["ready_pods"], pool, ready)
    if stats is not None:
        for key, value, twin in (("avg_kv", stats.avg_kv, "average_kv_cache_utilization"),
                                 ("avg_queue", stats.avg_queue, "average_queue_size"),
                                 ("avg_running", stats.avg_running, "average_running_requests")):
            f.add(f"llm_d_epp_{twin}", "gauge", _ALPHA + _HELP[key], pool, value)
            f.add(f"inference_pool_{twin}", "gauge", _deprecated(f"llm_d_epp_{twin}") + _HELP[key], pool,
                  value)
        for key, value, name in (("sd_kv", stats.sd_kv, "kv_cache_utilization"),
                                 ("sd_queue", stats.sd_queue, "queue_size"),
                                 ("sd_running", stats.sd_running, "running_requests")):
            f.add(f"llm_d_epp_std_dev_{name}", "gauge", _ALPHA + _HELP[key], pool, value)
    if fresh and per_unit:
        for e in eps:
            eid = endpoint_id(knobs.pool, e.index)
            f.add("llm_d_epp_per_endpoint_queue_size", "gauge", _ALPHA + _HELP["per_endpoint"],
                  {**pool, "model_server_endpoint": eid}, e.waiting)
            f.add("inference_pool_per_pod_queue_size", "gauge", _ALPHA + _HELP["per_pod"],
                  {**pool, "model_server_pod": eid}, e.waiting)

    # In-flight load producer: one series per endpoint; departed endpoints linger at 0.
    if per_unit:
        inflight = [(e.index, e.running + e.waiting, e.inflight_tokens) for e in eps]
        inflight += [(i, 0, 0) for i in snapshot.departed]
        for index, requests, tokens in inflight:
            labels = {"endpoint_name": endpoint_id(knobs.pool, index), "namespace": EPP_NAMESPACE,
                      "producer_name": INFLIGHT_PRODUCER, **FLOW_LABELS}
            f.add("llm_d_epp_inflight_requests", "gauge", _ALPHA + _HELP["inflight_requests"], labels,
                  requests)
            f.add("llm_d_epp_inflight_tokens", "gauge", _ALPHA + _HELP["inflight_tokens"], labels, tokens)

    # Request families: present from the first sample on.
    if counters.request_total:
        f.add("llm_d_epp_request_total", "counter", _ALPHA + _HELP["request_total"], flow,
              counters.request_total)
        f.add("inference_objective_request_total", "counter",
              _deprecated("llm_d_epp_request_total") + _HELP["request_total_legacy"],
              {**model, "priority": FLOW_LABELS["priority"]}, counters.request_total)
    if counters.request_total or snapshot.in_flight:
        f.add("llm_d_epp_request_running", "gauge", _ALPHA + _HELP["running"], flow, snapshot.in_flight)
        f.add("inference_objective_running_requests", "gauge",
              _deprecated("llm_d_epp_request_running") + _HELP["running_legacy"],
              {"model_name": knobs.model}, snapshot.in_flight)
    for code, count in counters.errors:
        f.add("llm_d_epp_request_error_total", "counter", _ALPHA + _HELP["error_total"],
              {**flow, "error_code": code}, count)
        f.add("inference_objective_request_error_total", "counter",
              _deprecated("llm_d_epp_request_error_total") + _HELP["error_total_legacy"],
              {**model, "error_code": code}, count)
    hists = dict(counters.histograms)
    for key, streaming in (("ttft_nonstream", "false"), ("ttft_stream", "true")):
        if key in hists:
            f.add("llm_d_epp_request_ttft_seconds", "histogram", _ALPHA + _HELP["ttft"],
                  {**flow, "streaming": streaming}, hists[key])
    for key, name in (("duration", "request_duration_seconds"), ("ntpot", "request_ntpot_seconds"),
                      ("streaming_tpot", "request_streaming_tpot_seconds"),
                      ("streaming_itl", "request_streaming_itl_seconds")):
        if key in hists:
            f.add(f"llm_d_epp_{name}", "histogram", _ALPHA + _HELP[key], flow, hists[key])

    # Scheduler attempts: successes name the chosen pod, failures carry empty endpoint labels.
    attempts = [(endpoint_pod(knobs.pool, e.index), EPP_NAMESPACE, EPP_PORT, "success", e.scheduled)
                for e in eps if e.scheduled]
    if counters.scheduling_failures:
        attempts.append(("", "", "", "failure", counters.scheduling_failures))
    for pod, namespace, port, status, count in attempts:
        common = {"namespace": namespace, "port": port, "status": status, "target_model_name": knobs.model}
        f.add("llm_d_epp_scheduler_attempts_total", "counter", _ALPHA + _HELP["attempts"],
              {**common, "endpoint_name": pod}, count)
        f.add("inference_extension_scheduler_attempts_total", "counter",
              _deprecated("llm_d_epp_scheduler_attempts_total") + _HELP["attempts"],
              {**common, "pod_name": pod}, count)

    if snapshot.flow_control:
        _flow_control_families(f, snapshot, knobs, fresh)

    f.add("llm_d_epp_info", "gauge", _ALPHA + _HELP["info"], EPP_BUILD, 1)
    f.add("inference_extension_info", "gauge", _ALPHA + _HELP["info"], EPP_BUILD, 1)
    f.add("process_start_time_seconds", "gauge", _HELP["process_start"], {}, created_unix)
    if knobs.huge_body:
        _padding_series(f, HUGE_BODY_BYTES)
    return f.render().encode()


def _flow_control_families(f: _GoFamilies, snapshot: ModelSnapshot, knobs: SimKnobs, fresh: bool) -> None:
    model = {"model_name": knobs.model, "target_model_name": knobs.model}
    fc_pool = {"inference_pool": knobs.pool}
    queue = {**FLOW_LABELS, **model, **fc_pool}
    f.add("llm_d_epp_flow_control_queue_size", "gauge", _ALPHA + _HELP["fc_queue_size"], queue,
          snapshot.flow_held)
    f.add("inference_extension_flow_control_queue_size", "gauge",
          _deprecated("llm_d_epp_flow_control_queue_size") + _HELP["fc_queue_size"], queue,
          snapshot.flow_held)
    f.add("llm_d_epp_flow_control_queue_bytes", "gauge", _ALPHA + _HELP["fc_queue_bytes"], queue,
          snapshot.flow_held_bytes)
    for outcome, count in snapshot.pool.flow_outcomes:
        f.add("llm_d_epp_flow_control_requests_total", "counter", _ALPHA + _HELP["fc_requests"],
              {**fc_pool, "outcome": outcome, "priority": FLOW_LABELS["priority"]}, count)
    for outcome, hist in snapshot.pool.flow_queue:
        f.add("llm_d_epp_flow_control_request_queue_duration_seconds", "histogram",
              _ALPHA + _HELP["fc_queue_duration"], {**queue, "outcome": outcome}, hist)
    eps = snapshot.endpoints
    # Mean over candidate endpoints of max(waiting/queueThreshold, kv/kvThreshold); an empty
    # pool reads exactly 1 and has no per-stage series; stale endpoints score as saturated (1).
    stale = 0 if fresh else len(eps)
    if eps:
        if fresh:
            saturation = statistics.fmean(
                max(e.waiting / SATURATION_QUEUE_THRESHOLD, e.kv_usage / SATURATION_KV_THRESHOLD)
                for e in eps)
        else:
            saturation = 1.0
        f.add("llm_d_epp_flow_control_pool_saturation", "gauge", _ALPHA + _HELP["fc_saturation"],
              {**fc_pool, "stage": "decode"}, saturation)
    else:
        saturation = 1.0
    f.add("llm_d_epp_flow_control_pool_saturation", "gauge", _ALPHA + _HELP["fc_saturation"],
          {**fc_pool, "stage": "effective"}, saturation)
    f.add("llm_d_epp_flow_control_stale_endpoints", "gauge", _ALPHA + _HELP["fc_stale"],
          {"detector": SATURATION_DETECTOR}, stale)


_PAD_FILLER = "x" * 200


def _padding_series(f: _GoFamilies, at_least: int) -> None:
    # Sorts before every inference_*/llm_d_* family, so a scraper that stops at a body cap
    # loses the real series, as it would behind a fairness_id cardinality blow-up.
    line = len(f'gridd_sim_padding_info{{filler="{_PAD_FILLER}",series="000000"}} 1\n')
    for i in range(at_least // line + 1):
        f.add("gridd_sim_padding_info", "gauge", _HELP["padding"],
              {"filler": _PAD_FILLER, "series": f"{i:06d}"}, 1)


def pad_body(body: bytes, target: int) -> bytes:
    """Append comment lines (still valid exposition) until ``body`` is exactly ``target``
    bytes; a body already that long is returned unchanged."""
    missing = target - len(body)
    if missing <= 0:
        return body
    if missing == 1:
        return body + b"\n"
    chunks = []
    while missing:
        size = min(missing, 4096)
        if missing - size == 1:
            size -= 1  # never leave a single byte, which only a blank line could fill
        chunks.append(b"#" + b"." * (size - 2) + b"\n")
        missing -= size
    return body + b"".join(chunks)


# -- vLLM (prometheus_client) ----------------------------------------------------------------


class _Collected:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


_VLLM_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "Cumulative number of preemption from the engine."),
    ("prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "Number of generation tokens processed."),
)
_VLLM_HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token_seconds",
     "Histogram of time to first token in seconds."),
    ("time_per_output_token_seconds", "inter_token_latency_seconds",
     "Histogram of time per output token in seconds."
     "DEPRECATED: Use vllm:inter_token_latency_seconds instead."),
    ("inter_token_latency_seconds", "inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds."),
    ("request_time_per_output_token_seconds", "request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("e2e_request_latency_seconds", "e2e_request_latency_seconds",
     "Histogram of e2e request latency in seconds."),
    ("request_queue_time_seconds", "request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request."),
    ("request_inference_time_seconds", "request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("request_prefill_time_seconds", "request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request."),
    ("request_decode_time_seconds", "request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request."),
)


def render_vllm(snapshot: ModelSnapshot, knobs: SimKnobs, *, created_unix: float) -> bytes:
    """One vLLM server; each endpoint of the model is a data-parallel engine."""
    fams: list[Metric] = []
    if knobs.huge_body:
        pad = Metric("gridd_sim_padding_info", _HELP["padding"], "gauge")
        line = len(f'gridd_sim_padding_info{{filler="{_PAD_FILLER}",series="000000"}} 1.0\n')
        for i in range(HUGE_BODY_BYTES // line + 1):
            pad.add_sample("gridd_sim_padding_info", {"filler": _PAD_FILLER, "series": f"{i:06d}"}, 1)
        fams.append(pad)
    eps = snapshot.endpoints
    engines = [({"engine": str(e.index), "model_name": knobs.model}, e) for e in eps]

    def gauge(name: str, doc: str, value_of) -> None:
        m = Metric(f"vllm:{name}", doc, "gauge")
        for labels, e in engines:
            m.add_sample(f"vllm:{name}", labels, value_of(e))
        fams.append(m)

    gauge("num_requests_running", "Number of requests in model execution batches.", lambda e: e.running)
    gauge("num_requests_waiting", "Number of requests waiting to be processed.", lambda e: e.waiting)
    gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", lambda e: e.kv_usage)

    counter_values = {
        "prefix_cache_queries": lambda e: e.engine.prompt_tokens,
        "prefix_cache_hits": lambda e: 0,
        "num_preemptions": lambda e: e.engine.preemptions,
        "prompt_tokens": lambda e: e.engine.prompt_tokens,
        "generation_tokens": lambda e: e.engine.generation_tokens,
    }
    for name, doc in _VLLM_COUNTERS:
        m = Metric(f"vllm:{name}", doc, "counter")
        for labels, e in engines:
            m.add_sample(f"vllm:{name}_total", labels, counter_values[name](e))
            m.add_sample(f"vllm:{name}_created", labels, created_unix)
        fams.append(m)
    m = Metric("vllm:request_success", "Count of successfully processed requests.", "counter")
    for labels, e in engines:
        for reason, count in e.engine.success:
            m.add_sample("vllm:request_success_total", {**labels, "finished_reason": reason}, count)
            m.add_sample("vllm:request_success_created", {**labels, "finished_reason": reason}, created_unix)
    fams.append(m)

    for name, source, doc in _VLLM_HISTOGRAMS:
        m = Metric(f"vllm:{name}", doc, "histogram")
        for labels, e in engines:
            hist = dict(e.engine.histograms)[source]
            for bound, count in zip(hist.bounds, hist.cumulative, strict=False):
                m.add_sample(f"vllm:{name}_bucket", {**labels, "le": floatToGoString(bound)}, count)
            m.add_sample(f"vllm:{name}_bucket", {**labels, "le": "+Inf"}, hist.cumulative[-1])
            m.add_sample(f"vllm:{name}_count", labels, hist.count)
            m.add_sample(f"vllm:{name}_sum", labels, hist.sum)
            m.add_sample(f"vllm:{name}_created", labels, created_unix)
        fams.append(m)

    m = Metric("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
    for labels, _ in engines:
        m.add_sample("vllm:cache_config_info", {
            "block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True",
            "engine": labels["engine"], "gpu_memory_utilization": "0.9", "num_cpu_blocks": "None",
            "num_gpu_blocks": str(snapshot.max_seqs * 128), "prefix_caching_hash_algo": "sha256"}, 1)
    fams.append(m)
    return generate_latest(_Collected(fams))
