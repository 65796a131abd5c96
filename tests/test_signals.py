"""Load derivation (gridd.core.signals) against the reference samples and synthetic cases.

Every expected figure is worked out by hand from the sample files in the comment next to
it (tests/data/samples/*.prom).
"""

from __future__ import annotations

import math

import pytest

from gridd.core.exposition import parse_exposition
from gridd.core.readings import LoadSignals, UnitLoad
from gridd.core.signals import LOAD_SAMPLES, WANTED_SAMPLES, derive_load, pool_names, sample_count

POD = "llama3-8b-decode-7d9c8f6b5-{}-rank-0"
QWEN = "qwen3-32b-decode-5b7f9c6d8-{}-rank-0"
SAMPLE_FILES = ["epp-healthy", "epp-saturated", "epp-zero-ready", "epp-multi-pool", "vllm-direct"]


def load_sample(samples_dir, name, **kwargs) -> LoadSignals:
    expo = parse_exposition((samples_dir / f"{name}.prom").read_bytes(), WANTED_SAMPLES)
    return derive_load(expo, **kwargs)


def derive_text(text: str, **kwargs) -> LoadSignals:
    return derive_load(parse_exposition(text, WANTED_SAMPLES), **kwargs)


def test_epp_healthy(samples_dir):
    load = load_sample(samples_dir, "epp-healthy", queue_full_at=2)
    assert load.ready_endpoints == 4  # llm_d_epp_ready_endpoints{name="llama3-8b-pool"} 4
    # Per endpoint: for each producer sum over flows (default-flow + team-a), then the max
    # over producers (inflight-load, inflight-load-with-output):
    #   2xkqp: inflight-load 11 + 2 = 13, with-output 11 + 2 = 13 -> 13
    #   8hfzt: 7 + 2 = 9, 7 + 2 = 9 -> 9
    #   c4nwm: 13 + 3 = 16, 13 + 3 = 16 -> 16
    #   tq7lr: 10 + 2 = 12, 10 + 2 = 12 -> 12
    # Waiting from llm_d_epp_per_endpoint_queue_size: 1, 0, 2, 1.
    assert load.units == (
        UnitLoad(unit=POD.format("2xkqp"), waiting=1.0, in_flight=13.0),
        UnitLoad(unit=POD.format("8hfzt"), waiting=0.0, in_flight=9.0),
        UnitLoad(unit=POD.format("c4nwm"), waiting=2.0, in_flight=16.0),
        UnitLoad(unit=POD.format("tq7lr"), waiting=1.0, in_flight=12.0),
    )
    assert load.avg_running == 11.5
    assert load.avg_waiting == 1.0
    assert load.kv_mean == 0.43
    assert load.kv_spread == 0.07  # llm_d_epp_std_dev_kv_cache_utilization
    # Flow control for the pool: default-flow 0 + team-a 1 = 1 (the legacy
    # inference_extension_ twin carries the same two series and is not added again).
    assert load.flow_queue == 1.0
    # Per-endpoint estimate: 13 + 9 + 16 + 12 = 50.
    # Averages estimate: (11.5 running + 1 waiting) x 4 ready = 50.
    # in_flight = max(50, 50) + 1 flow-control = 51.
    assert load.in_flight == 51.0
    # queue_full_at=2: only c4nwm (waiting 2 >= 2).
    assert load.queue_full_units == 1
    # One sample per serving unit: 4 endpoints.
    assert sample_count(load) == 4


def test_epp_healthy_queue_full_unset_counts_none(samples_dir):
    assert load_sample(samples_dir, "epp-healthy").queue_full_units == 0


def test_epp_saturated(samples_dir):
    load = load_sample(samples_dir, "epp-saturated", queue_full_at=15)
    assert load.ready_endpoints == 4
    # One producer (inflight-load); per endpoint the sum over batch-eval, default-flow, team-a:
    #   2xkqp: 4 + 47 + 11 = 62;  8hfzt: 4 + 53 + 13 = 70
    #   c4nwm: 4 + 42 + 10 = 56;  tq7lr: 4 + 50 + 12 = 66
    assert [(u.waiting, u.in_flight) for u in load.units] == [
        (14.0, 62.0), (18.0, 70.0), (11.0, 56.0), (16.0, 66.0)]
    assert (load.avg_running, load.avg_waiting) == (48.75, 14.75)
    assert (load.kv_mean, load.kv_spread) == (0.96, 0.03)
    # Flow control: batch-eval 112 + default-flow 37 + team-a 9 = 158.
    assert load.flow_queue == 158.0
    # Per-endpoint: 62 + 70 + 56 + 66 = 254. Averages: (48.75 + 14.75) x 4 = 63.5 x 4 = 254.
    # in_flight = max(254, 254) + 158 = 412.
    assert load.in_flight == 412.0
    # queue_full_at=15: 8hfzt (18) and tq7lr (16); 2xkqp (14) and c4nwm (11) are below.
    assert load.queue_full_units == 2
    assert sample_count(load) == 4


def test_epp_zero_ready_publishes_no_load(samples_dir):
    load = load_sample(samples_dir, "epp-zero-ready", queue_full_at=1)
    # ready_endpoints 0 with stale averages (22.5 running, 3.5 waiting, KV 0.61): frozen,
    # so none of them is used; "a site with no fresh endpoint publishes nothing".
    assert load == LoadSignals(ready_endpoints=0, flow_queue=6.0)
    assert load.in_flight is None
    assert load.units == ()
    assert sample_count(load) == 0


def test_epp_multi_pool_without_pool_is_ambiguous(samples_dir):
    expo = parse_exposition((samples_dir / "epp-multi-pool.prom").read_bytes(), WANTED_SAMPLES)
    assert pool_names(expo) == ("llama3-8b-pool", "qwen3-32b-pool")
    assert derive_load(expo) == LoadSignals()
    assert derive_load(expo, pool="absent-pool") == LoadSignals()


def test_epp_multi_pool_llama_uses_averages_only(samples_dir):
    load = load_sample(samples_dir, "epp-multi-pool", pool="llama3-8b-pool")
    assert load.ready_endpoints == 4
    # Per-endpoint in-flight has no pool label: not usable with two pools.
    assert [(u.unit, u.waiting, u.in_flight) for u in load.units] == [
        (POD.format("2xkqp"), 1.0, None), (POD.format("8hfzt"), 0.0, None),
        (POD.format("c4nwm"), 2.0, None), (POD.format("tq7lr"), 1.0, None)]
    # Flow control for inference_pool="llama3-8b-pool": 0.
    assert load.flow_queue == 0.0
    # (11.5 + 1) x 4 + 0 = 50.
    assert load.in_flight == 50.0
    assert (load.kv_mean, load.kv_spread) == (0.43, 0.07)


def test_epp_multi_pool_qwen_uses_averages_only(samples_dir):
    load = load_sample(samples_dir, "epp-multi-pool", pool="qwen3-32b-pool", queue_full_at=8)
    assert load.ready_endpoints == 2
    assert [(u.unit, u.waiting, u.in_flight) for u in load.units] == [
        (QWEN.format("kx2mv"), 6.0, None), (QWEN.format("wp9hn"), 9.0, None)]
    # Flow control for inference_pool="qwen3-32b-pool": 4.
    assert load.flow_queue == 4.0
    # (32.5 running + 7.5 waiting) x 2 ready = 80; + 4 flow-control = 84.
    assert load.in_flight == 84.0
    assert (load.avg_running, load.avg_waiting, load.kv_mean, load.kv_spread) == (32.5, 7.5, 0.86, 0.04)
    assert load.queue_full_units == 1  # wp9hn: 9 >= 8
    assert sample_count(load) == 2  # 2 units


def test_vllm_direct(samples_dir):
    load = load_sample(samples_dir, "vllm-direct", queue_full_at=1)
    # No pool series: readiness unknown.
    assert load.ready_endpoints is None
    assert load.units == (UnitLoad(unit="0", running=12.0, waiting=1.0, kv_usage=0.4117647058823529),)
    # One engine: the means are its values, the sample std dev is 0.
    assert (load.avg_running, load.avg_waiting) == (12.0, 1.0)
    assert load.kv_mean == 0.4117647058823529
    assert load.kv_spread == 0.0
    assert load.flow_queue == 0.0
    assert load.in_flight == 13.0  # 12 running + 1 waiting
    assert load.queue_full_units == 1  # waiting 1 >= 1
    assert sample_count(load) == 1  # 1 engine


@pytest.mark.parametrize("name", SAMPLE_FILES)
def test_wanted_samples_cover_derivation(samples_dir, name):
    body = (samples_dir / f"{name}.prom").read_bytes()
    pools = pool_names(parse_exposition(body, None)) or (None,)
    for pool in pools:
        assert (derive_load(parse_exposition(body, WANTED_SAMPLES), pool=pool, queue_full_at=5)
                == derive_load(parse_exposition(body, None), pool=pool, queue_full_at=5))


def test_wanted_samples_lists_canonical_legacy_and_vllm_names():
    assert LOAD_SAMPLES <= WANTED_SAMPLES
    for name in ("llm_d_epp_ready_endpoints", "inference_pool_ready_pods",
                 "llm_d_epp_inflight_requests", "inference_extension_flow_control_queue_size",
                 "llm_d_epp_request_ttft_seconds_bucket", "inference_objective_request_error_total",
                 "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket"):
        assert name in WANTED_SAMPLES


LEGACY_ONLY = """\
inference_pool_ready_pods{name="p"} 3
inference_pool_average_running_requests{name="p"} 4
inference_pool_average_queue_size{name="p"} 2
inference_pool_average_kv_cache_utilization{name="p"} 0.5
inference_pool_per_pod_queue_size{model_server_pod="a-rank-0",name="p"} 3
inference_pool_per_pod_queue_size{model_server_pod="b-rank-0",name="p"} 1
inference_pool_per_pod_queue_size{model_server_pod="c-rank-0",name="p"} 2
inference_extension_flow_control_queue_size{fairness_id="f",inference_pool="p",priority="0"} 5
"""


def test_legacy_twins_serve_an_older_epp():
    load = derive_text(LEGACY_ONLY, queue_full_at=2)
    assert load.ready_endpoints == 3
    assert [(u.unit, u.waiting) for u in load.units] == [("a-rank-0", 3.0), ("b-rank-0", 1.0), ("c-rank-0", 2.0)]
    assert load.kv_spread is None  # no std-dev gauge before llm-d-router v0.10
    # No in-flight producer: averages only, (4 + 2) x 3 = 18, + 5 flow-control = 23.
    assert load.in_flight == 23.0
    assert load.queue_full_units == 2  # a (3) and c (2)


def test_no_average_running_and_no_producer_gives_no_in_flight():
    # GIE before v1.5 has no average-running gauge: running + queued cannot be formed.
    text = LEGACY_ONLY.replace('inference_pool_average_running_requests{name="p"} 4\n', "")
    load = derive_text(text)
    assert load.avg_running is None
    assert load.in_flight is None
    assert sample_count(load) == 3  # 3 units


def epp_text(*, ready: int, avg_running: float, avg_waiting: float, inflight: dict[str, float],
             flow_pool_label: str = "p") -> str:
    lines = [f'llm_d_epp_ready_endpoints{{name="p"}} {ready}',
             f'llm_d_epp_average_running_requests{{name="p"}} {avg_running}',
             f'llm_d_epp_average_queue_size{{name="p"}} {avg_waiting}',
             f'llm_d_epp_flow_control_queue_size{{fairness_id="f",inference_pool="{flow_pool_label}",'
             f'priority="0"}} 2']
    for endpoint, count in inflight.items():
        lines.append(f'llm_d_epp_per_endpoint_queue_size{{model_server_endpoint="{endpoint}",name="p"}} 0')
        lines.append(f'llm_d_epp_inflight_requests{{endpoint_name="{endpoint}",fairness_id="f",'
                     f'namespace="ns",priority="0",producer_name="x"}} {count}')
    return "\n".join(lines) + "\n"


def test_in_flight_takes_averages_when_epp_restart_zeroed_the_count():
    # Restarted EPP: per-endpoint counts 0 + 1 = 1; averages (5 + 1) x 2 = 12 -> 12 + 2 = 14.
    load = derive_text(epp_text(ready=2, avg_running=5, avg_waiting=1, inflight={"a": 0, "b": 1}))
    assert load.in_flight == 14.0


def test_in_flight_takes_per_endpoint_count_when_larger():
    # Per-endpoint 9 + 8 = 17; averages (5 + 1) x 2 = 12 -> 17 + 2 flow-control = 19.
    load = derive_text(epp_text(ready=2, avg_running=5, avg_waiting=1, inflight={"a": 9, "b": 8}))
    assert load.in_flight == 19.0


def test_single_pool_counts_flow_control_with_empty_pool_label():
    # Endpoint-selector mode leaves inference_pool empty; one pool owns every series.
    load = derive_text(epp_text(ready=1, avg_running=1, avg_waiting=0, inflight={"a": 1},
                                flow_pool_label=""))
    assert load.flow_queue == 2.0
    assert load.in_flight == 3.0  # max(1, (1 + 0) x 1) + 2


def test_standby_replica_without_pool_series_derives_nothing():
    load = derive_text('llm_d_epp_info{build_ref="v0.9.0",commit="abc"} 1\ngo_goroutines 97\n')
    assert load == LoadSignals()
    assert sample_count(load) == 0


def test_vllm_two_engines_and_old_kv_name():
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.75
"""
    load = derive_text(text)
    assert load.ready_endpoints is None
    assert load.units == (UnitLoad("0", 3.0, 1.0, 0.25), UnitLoad("1", 5.0, 0.0, 0.75))
    assert (load.avg_running, load.avg_waiting) == (4.0, 0.5)  # (3 + 5) / 2, (1 + 0) / 2
    assert load.kv_mean == 0.5  # (0.25 + 0.75) / 2
    # Sample std dev: sqrt(((0.25 - 0.5)^2 + (0.75 - 0.5)^2) / (2 - 1)) = sqrt(0.125)
    assert load.kv_spread == pytest.approx(math.sqrt(0.125), abs=1e-15)
    assert load.in_flight == 9.0  # (3 + 1) + (5 + 0)
    assert sample_count(load) == 2  # 2 engines
