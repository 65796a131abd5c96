"""The simulator: pure model (exact numbers on explicit ``now``), /metrics rendering (promtool,
reference samples), the ASGI app on trio's MockClock, and the app over real loopback sockets."""

from __future__ import annotations

import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from gridd.sim import app as sim_app
from gridd.sim.app import SimApp, start_sim
from gridd.sim.cli import main as sim_main
from gridd.sim.metrics import (
    BODY_CAP_BYTES,
    go_float,
    pad_body,
    render_metrics,
)
from gridd.sim.model import SimModel, knobs_from

# -- helpers ---------------------------------------------------------------------------------


def model_with(now: float = 0.0, **knobs) -> SimModel:
    return SimModel(knobs_from(knobs), now)


def samples(body: bytes | str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)], read with prometheus_client's parser."""
    text = body.decode() if isinstance(body, bytes) else body
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(body: bytes | str, metric: str, /, **labels: str) -> float:
    """The one sample of ``metric`` whose labels include ``labels``."""
    found = [v for lab, v in samples(body).get(metric, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, f"{metric}{labels}: {len(found)} samples"
    return found[0]


def render(model: SimModel, now: float, latched=None, **overrides):
    knobs = knobs_from(overrides, model.knobs)
    return render_metrics(model.snapshot(now), knobs, latched=latched, created_unix=1.7e9)


# promtool 2.x lints the upstream names themselves ("_d_" reads as a day unit, vLLM uses ':');
# the reference samples show exactly these two lint lines and nothing else.
UPSTREAM_LINT = ("metric names should not contain abbreviated units", "metric names should not contain ':'")


def promtool_check(body: bytes) -> None:
    promtool = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
    if promtool is None:
        pytest.fail("promtool is not installed (needed to validate /metrics; CI installs it)")
    proc = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, timeout=60)
    lines = (proc.stdout + proc.stderr).decode().splitlines()
    problems = [line for line in lines if line.strip() and not line.endswith(UPSTREAM_LINT)]
    assert proc.returncode in (0, 3) and not problems, f"promtool rc={proc.returncode}: {problems[:5]}"


# -- model -----------------------------------------------------------------------------------


def test_admission_picks_least_loaded_then_queues_fifo():
    model = model_with(endpoints=2, max_seqs=4)
    outcomes = [model.admit(0.0, f"r{i}", output_tokens=10, stream=True) for i in range(10)]
    assert [(a.outcome, a.endpoint) for a in outcomes] == [
        ("running", 0), ("running", 1), ("running", 0), ("running", 1), ("running", 0), ("running", 1),
        ("running", 0), ("running", 1), ("waiting", 0), ("waiting", 1)]
    snap = model.snapshot(0.0)
    assert [(e.running, e.waiting, e.kv_usage) for e in snap.endpoints] == [(4, 1, 1.0), (4, 1, 1.0)]
    assert snap.in_flight == 10
    assert snap.pool.request_total == 10


def test_service_time_and_promotion_at_the_freeing_instant():
    model = model_with(endpoints=1, max_seqs=1, ttft_s=0.1, tpot_s=0.01)
    model.admit(0.0, "a", output_tokens=5, stream=True)
    assert model.admit(0.0, "b", output_tokens=5, stream=True).outcome == "waiting"
    a = model.timing("a")
    assert (a.started_at, a.first_token_at, a.finish_at) == (0.0, 0.1, pytest.approx(0.14))
    assert model.timing("b") is None
    assert model.advance(0.139) == []
    assert model.advance(0.14) == ["a"]
    b = model.timing("b")
    assert b.started_at == pytest.approx(0.14) and b.first_token_at == pytest.approx(0.24)
    assert model.advance(10.0) == ["b"]

    pool = dict(model.snapshot(10.0).pool.histograms)
    # TTFT includes the queue wait: 0.1 for a, 0.14 + 0.1 for b.
    assert pool["ttft_stream"].sum == pytest.approx(0.1 + 0.24)
    assert pool["duration"].sum == pytest.approx(0.14 + 0.28)
    # Streaming TPOT = (e2e - ttft) / (n - 1) is exactly tpot_s; ITL has n - 1 gaps each.
    assert pool["streaming_tpot"].sum == pytest.approx(0.02) and pool["streaming_tpot"].count == 2
    assert pool["streaming_itl"].count == 8
    engine = dict(model.snapshot(10.0).endpoints[0].engine.histograms)
    assert engine["request_queue_time_seconds"].sum == pytest.approx(0.14)
    assert engine["time_to_first_token_seconds"].sum == pytest.approx(0.34)


def test_histogram_buckets_are_cumulative_and_le_inclusive():
    model = model_with(endpoints=1, max_seqs=1, ttft_s=0.1, tpot_s=0.0)
    model.admit(0.0, "a", output_tokens=1, stream=True)
    model.advance(1.0)
    ttft = dict(model.snapshot(1.0).pool.histograms)["ttft_stream"]
    # 0.1 lands in le="0.1" (bounds 0.005, 0.025, 0.05, 0.1, ...), and every bucket after it.
    assert ttft.cumulative[:5] == (0, 0, 0, 1, 1) and ttft.cumulative[-1] == 1 and ttft.count == 1


def test_cancel_frees_the_slot_at_once_and_counts_an_abort():
    model = model_with(endpoints=1, max_seqs=1, ttft_s=0.1, tpot_s=0.1)
    model.admit(0.0, "a", output_tokens=100, stream=True)
    model.admit(0.0, "b", output_tokens=5, stream=True)
    model.admit(0.0, "c", output_tokens=5, stream=True)
    assert model.cancel(0.35, "a") == ["b"]
    assert model.timing("b").started_at == 0.35
    assert model.cancel(0.4, "c") == []  # waiting: just leaves the queue
    assert model.cancel(0.4, "c") == []  # idempotent
    snap = model.snapshot(0.4)
    assert (snap.endpoints[0].running, snap.endpoints[0].waiting) == (1, 0)
    engine = snap.endpoints[0].engine
    assert dict(engine.success)["abort"] == 2
    # a emitted tokens at 0.1, 0.2, 0.3 before it was cancelled at 0.35.
    assert engine.generation_tokens == 3
    # A cancelled request never completes: no latency observation.
    assert "ttft_stream" not in dict(snap.pool.histograms)


def test_kv_usage_is_running_over_max_seqs():
    model = model_with(endpoints=1, max_seqs=4)
    for i in range(3):
        model.admit(0.0, f"r{i}", output_tokens=10, stream=False)
    assert model.snapshot(0.0).endpoints[0].kv_usage == 0.75


def test_flow_control_holds_until_a_slot_frees_and_caps_at_queue_limit():
    model = model_with(endpoints=2, max_seqs=1, ttft_s=1.0, tpot_s=0.0, flow_control=True, queue_limit=1)
    assert [model.admit(0.0, f"r{i}", output_tokens=1, stream=False, body_bytes=10).outcome
            for i in range(5)] == ["running", "running", "held", "held", "rejected"]
    snap = model.snapshot(0.0)
    assert (snap.flow_held, snap.flow_held_bytes) == (2, 20)
    assert [e.waiting for e in snap.endpoints] == [0, 0]
    assert snap.pool.request_total == 2  # held requests are not scheduled yet
    assert model.advance(1.0) == ["r0", "r1"]
    assert model.timing("r2").started_at == 1.0 and model.timing("r3").started_at == 1.0
    pool = model.snapshot(1.0).pool
    assert dict(pool.flow_outcomes) == {"Dispatched": 4, "RejectedCapacity": 1}
    assert dict(pool.errors) == {"ResourceExhausted": 1}
    assert dict(pool.flow_queue)["Dispatched"].sum == 2.0
    assert pool.request_total == 4


def test_queue_limit_without_flow_control_rejects_429():
    model = model_with(endpoints=1, max_seqs=1, queue_limit=2)
    outcomes = [model.admit(0.0, f"r{i}", output_tokens=1, stream=False) for i in range(4)]
    assert [(a.outcome, a.status) for a in outcomes] == [
        ("running", 200), ("waiting", 200), ("waiting", 200), ("rejected", 429)]
    assert outcomes[-1].error_code == "ResourceExhausted"


def test_error_ratio_is_deterministic_and_status_5xx_maps_to_epp_codes():
    model = model_with(endpoints=4, max_seqs=10, error_ratio=0.25)
    statuses = [model.admit(0.0, f"r{i}", output_tokens=1, stream=False).status for i in range(8)]
    assert statuses == [200, 200, 200, 500, 200, 200, 200, 500]
    pool = model.snapshot(0.0).pool
    assert dict(pool.errors) == {"ModelServerError": 2}
    assert pool.request_total == 8  # a model-server failure was scheduled first

    model = model_with(status_5xx=503)
    adm = model.admit(0.0, "x", output_tokens=1, stream=False)
    assert (adm.status, adm.error_code) == (503, "ServiceUnavailable")
    assert model.snapshot(0.0).pool.request_total == 0


def test_no_endpoints_answers_503_and_counts_a_scheduling_failure():
    model = model_with(endpoints=0, flow_control=True)
    adm = model.admit(0.0, "x", output_tokens=1, stream=False)
    assert (adm.outcome, adm.status) == ("rejected", 503)
    pool = model.snapshot(0.0).pool
    assert pool.scheduling_failures == 1
    assert dict(pool.flow_outcomes) == {"RejectedNoEndpoints": 1}


def test_counter_reset_zeroes_cumulative_values_and_keeps_live_gauges():
    model = model_with(endpoints=1, max_seqs=2, ttft_s=0.1, tpot_s=0.0)
    for i in range(3):
        model.admit(0.0, f"r{i}", output_tokens=1, stream=True)
    model.advance(0.1)
    model.reset_counters(0.15)
    snap = model.snapshot(0.15)
    assert snap.pool.request_total == 0 and snap.pool.histograms == () and snap.pool.errors == ()
    assert snap.endpoints[0].engine.generation_tokens == 0 and snap.endpoints[0].scheduled == 0
    assert (snap.endpoints[0].running, snap.counters_reset_at) == (1, 0.15)
    model.advance(1.0)
    assert dict(model.snapshot(1.0).pool.histograms)["ttft_stream"].count == 1


def test_reconfigure_scales_endpoints_and_releases_flow_control():
    model = model_with(endpoints=2, max_seqs=1, ttft_s=1.0, tpot_s=0.0, flow_control=True)
    for i in range(4):
        model.admit(0.0, f"r{i}", output_tokens=1, stream=False)
    # Shrink: endpoint 1 drains its running request, takes nothing new, then leaves.
    assert model.reconfigure(0.5, knobs_from({"endpoints": 1}, model.knobs)) == []
    assert [(e.index, e.retired) for e in model.snapshot(0.5).endpoints] == [(0, False), (1, True)]
    assert model.advance(1.0) == ["r0", "r1"]
    snap = model.snapshot(1.0)
    assert [e.index for e in snap.endpoints] == [0] and snap.departed == (1,)
    assert model.phase("r2") == "running" and model.phase("r3") == "held"
    # Flow control off: the held request goes to an endpoint queue.
    assert model.reconfigure(1.0, knobs_from({"flow_control": False}, model.knobs)) == []
    assert model.phase("r3") == "waiting"
    # More slots start it at once.
    assert model.reconfigure(1.2, knobs_from({"max_seqs": 2}, model.knobs)) == ["r3"]
    # Growing again adds a new pod (a new name); the departed one keeps lingering.
    model.reconfigure(1.2, knobs_from({"endpoints": 2}, model.knobs))
    assert [e.index for e in model.snapshot(1.2).endpoints] == [0, 2]
    assert model.snapshot(1.2).departed == (1,)


def test_knobs_validation_names_the_field():
    with pytest.raises(ValueError, match=r"\$\.max_seqs"):
        knobs_from({"max_seqs": 0})
    with pytest.raises(ValueError, match=r"\$\.status_5xx"):
        knobs_from({"status_5xx": 404})
    with pytest.raises(ValueError, match="unknown field"):
        knobs_from({"max_seq": 3})
    assert knobs_from({"flavour": "vllm"}).flavour == "vllm"


# -- rendering -------------------------------------------------------------------------------


@pytest.mark.parametrize(("number", "text"), [
    (0, "0"), (1, "1"), (0.43, "0.43"), (11.5, "11.5"), (0.0005, "0.0005"), (1e-05, "1e-05"),
    (612455, "612455"), (1048576, "1.048576e+06"), (1.87392e08, "1.87392e+08"),
    (1.78730011842e09, "1.78730011842e+09"), (8690.767264, "8690.767264"), (-2.5, "-2.5"),
    (math.inf, "+Inf"), (-math.inf, "-Inf"),
])
def test_go_float_matches_client_golang(number, text):
    assert go_float(number) == text


def loaded_model(**knobs) -> SimModel:
    """Three endpoints with uneven load, finished streaming and non-streaming requests,
    errors, a cancel; the state every rendering test starts from."""
    base = {"endpoints": 3, "max_seqs": 4, "ttft_s": 0.2, "tpot_s": 0.05, "queue_limit": 1}
    model = model_with(**{**base, **knobs})
    for i in range(16):  # 12 run, 3 wait (or are held), the 16th is refused with 429
        model.admit(0.0, f"r{i}", output_tokens=4, stream=i % 3 != 0, prompt_tokens=10, body_bytes=200)
    model.cancel(0.1, "r0")
    model.advance(0.36)
    for i in range(3):
        model.admit(0.4, f"late{i}", output_tokens=2, stream=True)
    model.record_error("BadRequest")
    return model


@pytest.mark.parametrize("knobs", [
    {"flavour": "epp"}, {"flavour": "epp", "flow_control": True}, {"flavour": "vllm"},
    {"flavour": "epp", "zero_ready": True}, {"flavour": "epp", "stop_unit_series": True},
    {"flavour": "epp", "huge_body": True}, {"flavour": "vllm", "huge_body": True},
    {"flavour": "epp", "body_bytes": 300_001}, {"flavour": "epp", "endpoints": 0, "flow_control": True},
], ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_rendering_passes_promtool(knobs):
    model = loaded_model(**{k: v for k, v in knobs.items() if k in ("flow_control", "endpoints")})
    body, _ = render(model, 0.5, **knobs)
    promtool_check(body)


def test_epp_values_match_the_model():
    model = loaded_model()
    body, latched = render(model, 0.5)
    snap = model.snapshot(0.5)
    running = [e.running for e in snap.endpoints]
    waiting = [e.waiting for e in snap.endpoints]
    assert value(body, "llm_d_epp_ready_endpoints", name="sim-pool") == 3
    assert value(body, "inference_pool_ready_pods", name="sim-pool") == 3
    assert value(body, "llm_d_epp_average_running_requests") == round(sum(running) / 3, 2)
    assert value(body, "inference_pool_average_queue_size") == round(sum(waiting) / 3, 2)
    for e in snap.endpoints:
        eid = f"sim-pool-decode-{e.index}-rank-0"
        assert value(body, "llm_d_epp_per_endpoint_queue_size", model_server_endpoint=eid) == e.waiting
        assert value(body, "inference_pool_per_pod_queue_size", model_server_pod=eid) == e.waiting
        assert value(body, "llm_d_epp_inflight_requests", endpoint_name=eid,
                     producer_name="inflight-load") == e.running + e.waiting
    assert value(body, "llm_d_epp_request_total") == snap.pool.request_total
    assert value(body, "llm_d_epp_request_error_total", error_code="BadRequest") == 1
    assert value(body, "inference_objective_request_error_total", error_code="ResourceExhausted") == 1
    assert value(body, "llm_d_epp_request_running") == snap.in_flight
    ttft = dict(snap.pool.histograms)["ttft_stream"]
    assert value(body, "llm_d_epp_request_ttft_seconds_count", streaming="true") == ttft.count
    assert value(body, "llm_d_epp_request_ttft_seconds_bucket", streaming="true", le="+Inf") == ttft.count
    assert latched is not None and latched.avg_running == round(sum(running) / 3, 2)
    # Flow control off: none of its families.
    assert not any(name.startswith("llm_d_epp_flow_control") for name in samples(body))


def test_pool_stats_round_to_two_decimals_with_sample_std_dev():
    model = model_with(endpoints=3, max_seqs=8)
    for i in range(7):  # least-loaded spreads 3, 2, 2
        model.admit(0.0, f"r{i}", output_tokens=5, stream=False)
    model.cancel(0.0, "r1")
    model.cancel(0.0, "r2")  # running now 3, 1, 1
    body, _ = render(model, 0.0)
    assert value(body, "llm_d_epp_average_running_requests") == 1.67
    assert value(body, "llm_d_epp_std_dev_running_requests") == 1.15  # stdev(3, 1, 1) = 1.1547
    assert value(body, "llm_d_epp_average_kv_cache_utilization") == 0.21  # mean(3/8, 1/8, 1/8) = 0.2083


def test_zero_ready_keeps_stale_averages_and_drops_per_endpoint_queues():
    model = loaded_model()
    fresh_body, latched = render(model, 0.5)
    model.advance(10.0)  # everything finishes: a fresh refresh would read 0 running
    body, still = render(model, 10.0, latched=latched, zero_ready=True)
    assert still == latched
    assert value(body, "llm_d_epp_ready_endpoints") == 0
    assert value(body, "inference_pool_ready_pods") == 0
    for name in ("llm_d_epp_average_running_requests", "inference_pool_average_running_requests",
                 "llm_d_epp_average_kv_cache_utilization", "llm_d_epp_average_queue_size",
                 "llm_d_epp_std_dev_running_requests", "llm_d_epp_std_dev_kv_cache_utilization"):
        assert value(body, name) == value(fresh_body, name)
    assert value(body, "llm_d_epp_average_running_requests") == latched.avg_running > 0
    parsed = samples(body)
    assert "llm_d_epp_per_endpoint_queue_size" not in parsed
    assert "inference_pool_per_pod_queue_size" not in parsed
    # Request counters keep coming: the EPP is serving while it reads zero.
    assert value(body, "llm_d_epp_request_total") == model.snapshot(10.0).pool.request_total
    # Never having had a fresh endpoint, the averages are absent altogether.
    body, latched = render(model_with(), 0.0, zero_ready=True)
    assert latched is None and "llm_d_epp_average_running_requests" not in samples(body)


def test_stop_unit_series_keeps_the_ready_count_coming():
    model = loaded_model()
    body, _ = render(model, 0.5, stop_unit_series=True)
    parsed = samples(body)
    assert value(body, "llm_d_epp_ready_endpoints") == 3
    assert "llm_d_epp_average_running_requests" in parsed
    for name in ("llm_d_epp_per_endpoint_queue_size", "inference_pool_per_pod_queue_size",
                 "llm_d_epp_inflight_requests", "llm_d_epp_inflight_tokens"):
        assert name not in parsed


def test_flow_control_series():
    model = model_with(endpoints=2, max_seqs=1, flow_control=True, ttft_s=1.0)
    for i in range(5):
        model.admit(0.0, f"r{i}", output_tokens=2, stream=True, body_bytes=100)
    body, _ = render(model, 0.0)
    assert value(body, "llm_d_epp_flow_control_queue_size", inference_pool="sim-pool",
                 fairness_id="default-flow", priority="0") == 3
    assert value(body, "inference_extension_flow_control_queue_size") == 3
    assert value(body, "llm_d_epp_flow_control_queue_bytes") == 300
    assert value(body, "llm_d_epp_flow_control_requests_total", outcome="Dispatched") == 2
    # mean over endpoints of max(waiting / 5, kv / 0.8) = 1 / 0.8
    assert value(body, "llm_d_epp_flow_control_pool_saturation", stage="effective") == 1.25
    body, _ = render(model_with(endpoints=0, flow_control=True), 0.0)
    assert value(body, "llm_d_epp_flow_control_pool_saturation", stage="effective") == 1
    assert not [lab for lab, _ in samples(body)["llm_d_epp_flow_control_pool_saturation"]
                if lab["stage"] == "decode"]


def test_departed_endpoints_linger_at_zero_in_inflight_series():
    model = model_with(endpoints=2)
    model.reconfigure(0.0, knobs_from({"endpoints": 1}, model.knobs))
    body, _ = render(model, 0.0)
    assert value(body, "llm_d_epp_inflight_requests", endpoint_name="sim-pool-decode-1-rank-0") == 0
    assert value(body, "llm_d_epp_ready_endpoints") == 1


def test_vllm_values_match_the_model():
    model = loaded_model()
    body, _ = render(model, 0.5, flavour="vllm")
    snap = model.snapshot(0.5)
    for e in snap.endpoints:
        labels = {"engine": str(e.index), "model_name": "sim-model"}
        assert value(body, "vllm:num_requests_running", **labels) == e.running
        assert value(body, "vllm:num_requests_waiting", **labels) == e.waiting
        assert value(body, "vllm:kv_cache_usage_perc", **labels) == e.kv_usage
        success = dict(e.engine.success)
        for reason in ("stop", "length", "abort"):
            assert value(body, "vllm:request_success_total", finished_reason=reason, **labels) == success[reason]
        assert value(body, "vllm:request_success_created", finished_reason="stop", **labels) == 1.7e9
        ttft = dict(e.engine.histograms)["time_to_first_token_seconds"]
        assert value(body, "vllm:time_to_first_token_seconds_count", **labels) == ttft.count
    assert b'le="1.0"' in body and b"llm_d_epp" not in body


def _label_shapes(text: str) -> tuple[dict[str, set[frozenset[str]]], dict[str, tuple[str, str]]]:
    shapes: dict[str, set[frozenset[str]]] = {}
    meta: dict[str, tuple[str, str]] = {}
    for family in text_string_to_metric_families(text):
        meta[family.name] = (family.type, family.documentation)
        for s in family.samples:
            shapes.setdefault(s.name, set()).add(frozenset(s.labels))
    return shapes, meta


@pytest.mark.parametrize(("flavour", "sample_files"), [
    ("epp", ("epp-healthy.prom", "epp-saturated.prom", "epp-zero-ready.prom")),
    ("vllm", ("vllm-direct.prom",)),
])
def test_families_have_the_reference_samples_names_labels_and_help(samples_dir, flavour, sample_files):
    ref_shapes: dict[str, set[frozenset[str]]] = {}
    ref_meta: dict[str, tuple[str, str]] = {}
    for name in sample_files:
        shapes, meta = _label_shapes((samples_dir / name).read_text())
        for k, v in shapes.items():
            ref_shapes.setdefault(k, set()).update(v)
        ref_meta.update(meta)
    model = loaded_model(flow_control=True)
    body, _ = render(model, 0.5, flavour=flavour)
    ours, our_meta = _label_shapes(body.decode())
    shared = set(ours) & set(ref_shapes)
    assert len(shared) >= (40 if flavour == "epp" else 25)
    for name in shared:
        assert ours[name] <= ref_shapes[name], f"{name}: {ours[name]} not in {ref_shapes[name]}"
    for family in set(our_meta) & set(ref_meta):
        assert our_meta[family] == ref_meta[family], family


def test_huge_body_and_exact_body_sizes():
    model = loaded_model()
    body, _ = render(model, 0.5, huge_body=True)
    assert len(body) > BODY_CAP_BYTES
    # Padding sorts first, so a reader cut at the cap loses the real families.
    assert b"llm_d_epp_ready_endpoints" not in body[:BODY_CAP_BYTES]
    body, _ = render(model, 0.5, body_bytes=BODY_CAP_BYTES)
    assert len(body) == BODY_CAP_BYTES
    base = b"a 1\n"
    for target in (0, 4, 5, 6, 7, 4100, 4101, 8197, 10_000):
        padded = pad_body(base, target)
        assert len(padded) == max(target, len(base)) and padded.startswith(base)
        assert all(line == b"" or line.startswith(b"#") for line in padded[len(base):].split(b"\n"))


# -- the ASGI app on virtual time (no sockets) -----------------------------------------------


class FakeClient:
    """Drives one ASGI request: body in, timestamped messages out, disconnect on demand."""

    def __init__(self, app: SimApp, method: str, path: str, body: bytes = b"") -> None:
        self.app, self.method, self.path, self.body = app, method, path, body
        self.sent: list[tuple[float, dict]] = []
        self.gone = trio.Event()
        self.done = trio.Event()

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append((trio.current_time(), message))

    async def run(self) -> None:
        scope = {"type": "http", "method": self.method, "path": self.path, "headers": []}
        await self.app(scope, self.receive, self.send)
        self.done.set()

    def chunk_times(self) -> list[float]:
        return [t for t, msg in self.sent
                if msg["type"] == "http.response.body" and msg.get("body", b"").startswith(b"data: {")]


def chat(max_tokens: int, stream: bool = True, **extra) -> bytes:
    return msgspec.json.encode({"model": "sim-model", "messages": [{"role": "user", "content": "hello"}],
                                "max_tokens": max_tokens, "stream": stream, **extra})


async def test_stream_pacing_and_queueing_on_virtual_time(autojump_clock):
    app = SimApp(knobs_from({"endpoints": 1, "max_seqs": 1, "ttft_s": 1.0, "tpot_s": 0.5}))
    a = FakeClient(app, "POST", "/v1/chat/completions", chat(3))
    b = FakeClient(app, "POST", "/v1/chat/completions", chat(3))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(b.run)
    assert a.chunk_times() == [1.0, 1.5, 2.0]
    assert b.chunk_times() == [3.0, 3.5, 4.0]  # waited for a's slot
    assert a.sent[-1][1]["body"].endswith(b"data: [DONE]\n\n")
    body = app.metrics_body()
    assert value(body, "llm_d_epp_request_ttft_seconds_sum", streaming="true") == 1.0 + 3.0
    assert value(body, "llm_d_epp_request_streaming_tpot_seconds_sum") == 0.5 + 0.5
    assert value(body, "llm_d_epp_request_duration_seconds_sum") == 2.0 + 4.0


async def test_disconnect_cancels_at_once_on_virtual_time(autojump_clock):
    app = SimApp(knobs_from({"endpoints": 1, "max_seqs": 1, "ttft_s": 1.0, "tpot_s": 0.5}))
    long = FakeClient(app, "POST", "/v1/chat/completions", chat(100))
    short = FakeClient(app, "POST", "/v1/completions",
                       msgspec.json.encode({"prompt": "x", "max_tokens": 2}))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(long.run)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(short.run)
        await trio.sleep(1.2)
        long.gone.set()
        await long.done.wait()
        assert trio.current_time() == 1.2
        await short.done.wait()
    # The waiting request started at 1.2: first token 2.2, last (second) 2.7.
    assert short.sent[-1][0] == pytest.approx(2.7)
    assert long.chunk_times() == [1.0]
    snap = app.model.snapshot(trio.current_time())
    assert dict(snap.endpoints[0].engine.success) == {"stop": 0, "length": 1, "abort": 1}


async def test_metrics_delay_on_virtual_time(autojump_clock):
    app = SimApp(knobs_from({"metrics_delay_s": 2.5}))
    client = FakeClient(app, "GET", "/metrics")
    await client.run()
    assert client.sent[0][0] == 2.5 and client.sent[0][1]["status"] == 200


async def test_metrics_hang_answers_nothing_until_the_client_leaves(autojump_clock):
    app = SimApp(knobs_from({"metrics_hang": True}))
    client = FakeClient(app, "GET", "/metrics")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        await trio.sleep(3600)
        assert client.sent == []
        client.gone.set()
    assert client.sent == []


# -- over real loopback sockets (real clock: no autojump here) -------------------------------


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def test_non_stream_completions_embeddings_and_models(nursery, client):
    sim = await start_sim(nursery, ttft_s=0.01, tpot_s=0.001, max_tokens=5)
    r = await client.post(f"{sim.url}/v1/chat/completions", content=chat(3, stream=False))
    assert r.status_code == 200
    doc = r.json()
    assert doc["object"] == "chat.completion" and doc["choices"][0]["finish_reason"] == "length"
    assert doc["choices"][0]["message"]["content"] == "Lorem ipsum dolor"
    assert doc["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}

    r = await client.post(f"{sim.url}/v1/completions", json={"prompt": "abcdefgh"})
    doc = r.json()
    assert doc["object"] == "text_completion" and doc["choices"][0]["finish_reason"] == "stop"
    assert doc["usage"]["completion_tokens"] == 5  # the max_tokens knob when none is asked

    r = await client.post(f"{sim.url}/v1/embeddings", json={"input": ["a", "b"], "model": "sim-model"})
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1] and len(data[0]["embedding"]) == 8
    assert data[0]["embedding"] == sim_app.embedding_vector("a")

    r = await client.get(f"{sim.url}/v1/models")
    assert [m["id"] for m in r.json()["data"]] == ["sim-model"]

    metrics = (await client.get(f"{sim.url}/metrics")).content
    assert value(metrics, "llm_d_epp_request_total") == 3
    assert value(metrics, "llm_d_epp_request_ttft_seconds_count", streaming="false") == 3


async def test_stream_chunks_usage_and_done(nursery, client):
    sim = await start_sim(nursery, ttft_s=0.01, tpot_s=0.001)
    events = []
    async with client.stream("POST", f"{sim.url}/v1/chat/completions",
                             content=chat(4, stream_options={"include_usage": True})) as r:
        assert r.headers["content-type"] == "text/event-stream"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:4]] == ["Lorem", " ipsum", " dolor", " sit"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 4


async def _stream_to_end(client: httpx.AsyncClient, url: str, max_tokens: int) -> int:
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", content=chat(max_tokens)) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                tokens += 1
    return tokens


async def _poll_metrics(client: httpx.AsyncClient, url: str, ready) -> bytes:
    """Scrape until ``ready(body)`` holds; the caller bounds it with fail_after."""
    while True:
        body = (await client.get(f"{url}/metrics")).content
        if ready(body):
            return body
        await trio.sleep(0.01)


@pytest.mark.parametrize("flavour", ["epp", "vllm"])
async def test_twenty_concurrent_streams_move_the_load_series(nursery, client, flavour):
    # 2 endpoints x 4 sequences: 8 run, 12 wait; each wave takes 0.6 + 9 x 0.02 s.
    sim = await start_sim(nursery, endpoints=2, max_seqs=4, ttft_s=0.6, tpot_s=0.02, flavour=flavour)
    results = []

    async def one() -> None:
        results.append(await _stream_to_end(client, sim.url, 10))

    if flavour == "vllm":
        def in_flight(body):
            parsed = samples(body)
            return sum(v for _, v in parsed["vllm:num_requests_running"] + parsed["vllm:num_requests_waiting"])
    else:
        def in_flight(body):
            return value(body, "llm_d_epp_request_running") if "llm_d_epp_request_running" in samples(body) else 0

    async with trio.open_nursery() as load:
        for _ in range(20):
            load.start_soon(one)
        with trio.fail_after(0.5):  # well inside the first wave's 0.78 s
            body = await _poll_metrics(client, sim.url, lambda b: in_flight(b) == 20)
        if flavour == "vllm":
            for engine in ("0", "1"):
                assert value(body, "vllm:num_requests_running", engine=engine) == 4
                assert value(body, "vllm:num_requests_waiting", engine=engine) == 6
                assert value(body, "vllm:kv_cache_usage_perc", engine=engine) == 1
        else:
            assert value(body, "llm_d_epp_average_running_requests") == 4
            assert value(body, "llm_d_epp_average_queue_size") == 6
            assert value(body, "llm_d_epp_average_kv_cache_utilization") == 1
            assert value(body, "llm_d_epp_ready_endpoints") == 2
            for i in range(2):
                assert value(body, "llm_d_epp_per_endpoint_queue_size",
                             model_server_endpoint=f"sim-pool-decode-{i}-rank-0") == 6
                assert value(body, "llm_d_epp_inflight_requests", endpoint_name=f"sim-pool-decode-{i}-rank-0") == 10
    assert results == [10] * 20
    body = (await client.get(f"{sim.url}/metrics")).content
    assert in_flight(body) == 0
    if flavour == "vllm":
        assert sum(v for lab, v in samples(body)["vllm:request_success_total"] if lab["finished_reason"] == "length") == 20
        assert sum(v for _, v in samples(body)["vllm:num_requests_running"]) == 0
    else:
        assert value(body, "llm_d_epp_average_running_requests") == 0
        assert value(body, "llm_d_epp_average_queue_size") == 0
        assert value(body, "llm_d_epp_request_total") == 20
        assert value(body, "llm_d_epp_request_ttft_seconds_count", streaming="true") == 20
        # TTFT includes the wait: about 0.6 s (first wave), 1.38 s (second), 2.16 s (last four).
        for le, count in (("1", 8), ("1.5", 16), ("2", 16), ("3", 20)):
            assert value(body, "llm_d_epp_request_ttft_seconds_bucket", streaming="true", le=le) == count


async def test_client_disconnect_frees_the_sequence_within_a_second(nursery, client):
    sim = await start_sim(nursery, endpoints=1, max_seqs=1, ttft_s=0.01, tpot_s=0.05)
    async with client.stream("POST", f"{sim.url}/v1/chat/completions", content=chat(1000)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break
        assert sim.model.snapshot(trio.current_time()).endpoints[0].running == 1
        left_at = time.monotonic()
    # Leaving the block closed the connection mid-stream.
    with trio.fail_after(1.0):
        body = await _poll_metrics(client, sim.url, lambda b: value(b, "llm_d_epp_request_running") == 0)
    assert time.monotonic() - left_at < 1.0
    assert value(body, "llm_d_epp_inflight_requests") == 0
    assert sim.model.snapshot(trio.current_time()).endpoints[0].running == 0
    # The freed slot serves the next request at once.
    assert await _stream_to_end(client, sim.url, 3) == 3


async def test_error_ratio_status_5xx_and_queue_limit(nursery, client):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0, error_ratio=0.5)
    answers = [await client.post(f"{sim.url}/v1/completions", json={"prompt": "x"}) for _ in range(6)]
    assert [r.status_code for r in answers] == [200, 500] * 3
    assert answers[1].json()["error"]["code"] == "model_server_error"

    sim.set_knobs(error_ratio=0.0, status_5xx=503)
    r = await client.post(f"{sim.url}/v1/chat/completions", content=chat(2, stream=True))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    body = (await client.get(f"{sim.url}/metrics")).content
    assert value(body, "llm_d_epp_request_error_total", error_code="ModelServerError") == 3
    assert value(body, "llm_d_epp_request_error_total", error_code="ServiceUnavailable") == 1

    sim.set_knobs(status_5xx=0, endpoints=1, max_seqs=1, queue_limit=1, ttft_s=2.0)
    async def occupy() -> None:
        await client.post(f"{sim.url}/v1/completions", json={"prompt": "x"})

    async with trio.open_nursery() as load:
        for _ in range(2):  # one runs, one waits: the queue is at its limit
            load.start_soon(occupy)
        with trio.fail_after(1.0):
            await _poll_metrics(client, sim.url, lambda b: value(b, "llm_d_epp_request_running") == 2)
        r = await client.post(f"{sim.url}/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        load.cancel_scope.cancel()
    body = (await client.get(f"{sim.url}/metrics")).content
    assert value(body, "llm_d_epp_request_error_total", error_code="ResourceExhausted") == 1


async def test_bad_requests_get_openai_errors(nursery, client):
    sim = await start_sim(nursery)
    r = await client.post(f"{sim.url}/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    r = await client.post(f"{sim.url}/v1/chat/completions", json={"model": "other", "messages": []})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await client.post(f"{sim.url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert (await client.get(f"{sim.url}/v1/chat/completions")).status_code == 405
    assert (await client.get(f"{sim.url}/nope")).status_code == 404
    body = (await client.get(f"{sim.url}/metrics")).content
    assert value(body, "llm_d_epp_request_error_total", error_code="BadRequest") == 2
    assert value(body, "llm_d_epp_request_error_total", error_code="NotFound") == 1


async def test_admin_changes_knobs_at_run_time(nursery, client):
    sim = await start_sim(nursery, ttft_s=0.0, tpot_s=0.0)
    await client.post(f"{sim.url}/v1/completions", json={"prompt": "x"})
    r = await client.get(f"{sim.url}/admin")
    assert r.json()["knobs"]["flavour"] == "epp" and r.json()["request_total"] == 1

    r = await client.post(f"{sim.url}/admin", json={"flavour": "vllm", "endpoints": 3, "model": "m2"})
    assert r.status_code == 200 and len(r.json()["endpoints"]) == 3
    body = (await client.get(f"{sim.url}/metrics")).content
    assert {lab["engine"] for lab, _ in samples(body)["vllm:num_requests_running"]} == {"0", "1", "2"}
    assert (await client.get(f"{sim.url}/v1/models")).json()["data"][0]["id"] == "m2"

    r = await client.post(f"{sim.url}/admin", json={"max_seqs": 0})
    assert r.status_code == 400 and "$.max_seqs" in r.json()["error"]["message"]
    r = await client.post(f"{sim.url}/admin", json={"no_such_knob": 1})
    assert r.status_code == 400
    assert sim.knobs.max_seqs == 8  # a rejected change changes nothing

    # restart: counters from zero, and the zero-ready EPP then has no averages to keep.
    r = await client.post(f"{sim.url}/admin", json={"flavour": "epp", "restart": True, "zero_ready": True})
    assert r.json()["request_total"] == 0
    body = (await client.get(f"{sim.url}/metrics")).content
    assert value(body, "llm_d_epp_ready_endpoints") == 0
    assert "llm_d_epp_request_total" not in samples(body)
    assert "llm_d_epp_average_running_requests" not in samples(body)

    await client.post(f"{sim.url}/admin", json={"zero_ready": False, "huge_body": True})
    r = await client.get(f"{sim.url}/metrics")
    assert len(r.content) > BODY_CAP_BYTES

    await client.post(f"{sim.url}/admin", json={"huge_body": False, "metrics_hang": True})
    with pytest.raises(httpx.ReadTimeout):
        await client.get(f"{sim.url}/metrics", timeout=0.3)
    await client.post(f"{sim.url}/admin", json={"metrics_hang": False})
    assert (await client.get(f"{sim.url}/metrics")).status_code == 200


def test_cli_rejects_bad_settings(capsys):
    assert sim_main(["--max-seqs", "0"]) == 2
    assert "<3>gridd sim: invalid setting" in capsys.readouterr().err
    assert sim_main(["--flavour", "both"]) == 2
    assert sim_main(["--port", "70000"]) == 2


def test_cli_serves_until_sigterm():
    code = "import sys; from gridd.sim.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "--port", "0", "--flavour", "vllm", "--endpoints", "3"],
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 10.0)
        assert ready, "gridd sim printed no ready line within 10 s"
        line = proc.stderr.readline()
        assert line.startswith("<6>gridd sim listening on http://127.0.0.1:") and "flavour=vllm" in line
        url = line.split()[4]
        body = httpx.get(f"{url}/metrics", timeout=5.0).content
        assert len(samples(body)["vllm:num_requests_running"]) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert proc.stderr.read().startswith("<6>gridd sim stopping on SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
