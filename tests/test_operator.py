"""The operator against the simulator: readiness rules at the defaults (1 s scrape) on trio's
MockClock, the body cap, vLLM-direct providers, the exported series (checked by promtool),
and strictly increasing (publisher_epoch, batch_sequence) across real restarts."""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from gridd.childprocs import free_ports
from gridd.config import load_config
from gridd.operator.service import OperatorService
from gridd.sim.app import SimApp
from gridd.sim.model import knobs_from

CONFIG = """
role: operator
site: a
state_dir: state
providers:
  - name: llama
    model: sim-model
    settings: {{endpoint: "http://sim/v1"}}
    metrics: {{url: "http://sim/metrics", timeout_s: 2{extra}}}
"""


class SimOperator:
    """An operator whose scrapes reach an in-process simulator (no sockets, virtual time)."""

    def __init__(self, tmp_path, *, extra: str = "", **knobs) -> None:
        (tmp_path / "operator.yaml").write_text(CONFIG.format(extra=extra))
        self.sim = SimApp(knobs_from(knobs))
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.sim))
        self.registry = CollectorRegistry()
        self.loaded = load_config(tmp_path / "operator.yaml", env={})
        self.operator = OperatorService(self.loaded, self.registry, client=self.client,
                                        wall=lambda: 1_800_000_000 + trio.current_time())

    def latest(self):
        held = self.operator.holdings.get("a", "llama")
        return None if held is None else held.batch

    def sample(self, name: str, **labels):
        return self.registry.get_sample_value(name, {"grid_site": "a", "grid_provider": "llama", **labels})

    async def complete(self, *, stream: bool = False) -> None:
        """One completion through the simulator: an engine answer."""
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.sim)) as c:
            r = await c.post("http://sim/v1/completions", json={"model": "sim-model", "prompt": "x",
                                                                  "max_tokens": 2, "stream": stream})
            assert r.status_code == 200


async def test_zero_ready_twice_without_engine_answer_is_not_ready(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()  # passes run at origin + 0, 1, 2, ... (1 s scrape)
        await trio.sleep_until(origin + 3.5)
        assert rig.latest().ready is True and rig.latest().ready_reason == "EndpointsReady"
        rig.sim.set_knobs(zero_ready=True)
        await trio.sleep_until(origin + 4.5)  # first zero scrape at +4: not yet
        assert rig.latest().load.ready_endpoints == 0
        assert rig.latest().ready is True
        await trio.sleep_until(origin + 5.5)  # second zero scrape at +5, no answer in 30 s
        assert (rig.latest().ready, rig.latest().ready_reason) == (False, "ZeroReadyEndpoints")
        assert rig.sample("grid_provider_ready") == 0.0
        rig.sim.set_knobs(zero_ready=False)
        await trio.sleep_until(origin + 6.5)  # one non-zero scrape rejoins
        assert rig.latest().ready is True
        nursery.cancel_scope.cancel()


async def test_zero_ready_with_a_recent_engine_answer_stays_ready_for_30_s(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=2, ttft_s=0.05, tpot_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 2.2)
        await rig.complete()  # finishes at +2.26; the scrape at +3 sees the success counter rise
        rig.sim.set_knobs(zero_ready=True)  # zero scrapes at +3, +4, ...
        await trio.sleep_until(origin + 5.5)
        assert rig.latest().load.ready_endpoints == 0
        assert (rig.latest().ready, rig.latest().ready_reason) == (True, "EngineAnswered")
        # The answer was recorded at the +3 scrape; it counts for 30 s (inclusive): through
        # the scrape at +33, and no longer at +34.
        await trio.sleep_until(origin + 33.5)
        assert rig.latest().ready is True
        await trio.sleep_until(origin + 34.5)
        assert (rig.latest().ready, rig.latest().ready_reason) == (False, "ZeroReadyEndpoints")
        nursery.cancel_scope.cancel()


async def test_body_over_cap_is_body_cap_and_unknown(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 1.5)
        assert rig.sample("grid_provider_ready") == 1.0
        rig.sim.set_knobs(huge_body=True)
        await trio.sleep_until(origin + 2.5)
        batch = rig.latest()
        assert (batch.ready, batch.ready_reason) == (None, "BodyCap")
        assert batch.revision is None and batch.complete is False
        assert rig.sample("grid_provider_scrape_failures_total", reason="body_cap") == 1.0
        # unknown readiness: the series is absent, not 0, and it stays so (not declared down)
        assert rig.sample("grid_provider_ready") is None
        await trio.sleep_until(origin + 30.5)
        assert rig.latest().ready is None
        assert rig.sample("grid_provider_scrape_failures_total", reason="body_cap") == 29.0
        nursery.cancel_scope.cancel()


async def test_body_of_exactly_the_cap_is_accepted(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=1, body_bytes=1024 * 1024)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        await trio.sleep(0.5)
        assert rig.latest().complete is True and rig.latest().ready is True
        rig.sim.set_knobs(body_bytes=1024 * 1024 + 1)
        await trio.sleep(1.0)
        assert rig.latest().ready_reason == "BodyCap"
        nursery.cancel_scope.cancel()


async def test_vllm_direct_is_never_not_ready_for_lack_of_pool_series(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, flavour="vllm", endpoints=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        for t in range(1, 40):
            await trio.sleep_until(origin + t + 0.5)
            batch = rig.latest()
            assert batch.ready is None and batch.ready_reason == "NoReadySeries"
            assert batch.complete is True and len(batch.load.units) == 2
        assert rig.sample("grid_provider_ready") is None
        nursery.cancel_scope.cancel()


async def test_stale_after_scrapes_stop_answering(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 0.5)
        rig.sim.set_knobs(metrics_hang=True)
        # Last answer at +0. staleMetricsSeconds = TTL/2 = 10 s; the floor is 1 + max(1, 2)
        # = 3 s (the hanging passes take the 2 s timeout), lower, so 10 s wins: stale once
        # more than 10 s passed, i.e. at the verdict of the scrape that times out at +12.
        await trio.sleep_until(origin + 9.5)
        assert rig.latest().ready is True
        await trio.sleep_until(origin + 12.5)
        batch = rig.latest()
        assert (batch.ready, batch.ready_reason) == (False, "ScrapeFailed")
        assert rig.sample("grid_provider_scrape_failures_total", reason="timeout") >= 5
        nursery.cancel_scope.cancel()


async def test_exported_series_pass_promtool(tmp_path, autojump_clock):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install Debian's 'prometheus' package (scripts/bootstrap does)")
    rig = SimOperator(tmp_path, endpoints=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        await trio.sleep(1.5)
        for _ in range(25):  # >= 20 completed in the window; TTFT counts streamed requests
            await rig.complete(stream=True)
        await trio.sleep(2.0)
        body = generate_latest(rig.registry)
        nursery.cancel_scope.cancel()
    text = body.decode()
    for family in ("grid_provider_ready", "grid_provider_ready_endpoints", "grid_provider_in_flight_requests",
                   "grid_provider_ttft_p50_seconds", "grid_provider_ttft_p90_seconds",
                   "grid_provider_tpot_seconds", "grid_provider_error_ratio",
                   "grid_provider_config_generation"):
        assert re.search(rf"^{family}\{{", text, re.M), family
    gen = re.search(r"^grid_provider_config_generation\{(.*)\} 1\.0 (\d+)$", text, re.M)
    assert gen is not None and 'batch_samples="2"' in gen.group(1)  # 2 endpoints
    proc = await trio.run_process([promtool, "check", "metrics"], stdin=body, capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- real processes: the publisher epoch across restarts ----------------------------------------


def _generation_series(metrics_url: str, deadline_s: float = 20.0) -> tuple[int, int]:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            text = httpx.get(metrics_url, timeout=2).text
        except httpx.HTTPError:
            text = ""
        m = re.search(r'grid_provider_config_generation\{[^}]*batch_sequence="(\d+)"[^}]*'
                      r'publisher_epoch="(\d+)"', text)
        if m:
            return int(m.group(2)), int(m.group(1))
        time.sleep(0.2)
    raise AssertionError(f"no grid_provider_config_generation on {metrics_url}")


@pytest.mark.realproc
def test_restarts_publish_strictly_increasing_epoch_and_sequence(tmp_path):
    sim_port, metrics_port = free_ports(2)
    sim = subprocess.Popen([sys.executable, "-m", "gridd", "sim", "--port", str(sim_port)],
                           stderr=subprocess.DEVNULL)
    config = tmp_path / "operator.yaml"
    config.write_text(
        CONFIG.format(extra="").replace("http://sim", f"http://127.0.0.1:{sim_port}")
        + f'listen: {{metrics: "127.0.0.1:{metrics_port}"}}\ncontrol_socket: op.sock\n'
    )
    seen: list[tuple[int, int]] = []
    try:
        for _ in range(4):  # the first start and 3 restarts
            op = subprocess.Popen([sys.executable, "-m", "gridd", "run", "--config", str(config)],
                                  stderr=subprocess.DEVNULL, env={**os.environ})
            try:
                first = _generation_series(f"http://127.0.0.1:{metrics_port}/metrics")
                time.sleep(1.2)
                second = _generation_series(f"http://127.0.0.1:{metrics_port}/metrics")
                seen += [first, second]
            finally:
                op.send_signal(signal.SIGTERM)
                assert op.wait(timeout=15) == 0
    finally:
        sim.kill()
        sim.wait()
    assert all(a < b for a, b in zip(seen, seen[1:], strict=False)), seen
    epochs = [e for e, _ in seen[::2]]
    assert len(set(epochs)) == 4, seen  # a restart never reuses an epoch, even within one second


async def test_recreated_provider_keeps_a_rising_sequence_that_receivers_admit(tmp_path, autojump_clock):
    from gridd.core.admission import AdmissionFences, Outcome

    rig = SimOperator(tmp_path, endpoints=1)
    fences = AdmissionFences()
    seen = []
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()

        def admit_latest():
            batch = rig.latest()
            seen.append((batch.revision.provider_uid, batch.revision.batch_sequence))
            now_wall = 1_800_000_000 + trio.current_time()
            return fences.admit(batch, now_wall=now_wall, verified_site=None).outcome

        async def reload():
            # stage() persists revisions in a worker thread; hold virtual time still meanwhile
            # (an autojumping clock would leap over scrape passes while the thread runs).
            autojump_clock.autojump_threshold = math.inf
            rig.operator.commit(await rig.operator.stage(load_config(config, env={})))
            autojump_clock.autojump_threshold = 0

        await trio.sleep_until(origin + 2.5)
        assert admit_latest() is Outcome.ACCEPTED
        config = tmp_path / "operator.yaml"
        text = config.read_text()
        config.write_text(text.split("providers:")[0] + "providers: []\n")  # delete
        await reload()
        assert rig.latest() is None
        await trio.sleep_until(origin + 4.5)
        config.write_text(text)  # re-create under the same name: a new uid, same epoch
        await reload()
        await trio.sleep_until(origin + 5.5)
        assert admit_latest() is Outcome.ACCEPTED
        nursery.cancel_scope.cancel()
    (uid1, seq1), (uid2, seq2) = seen
    assert uid1 != uid2 and seq2 > seq1


def test_unpublishable_values_travel_as_a_verdict_alone_and_time_never_goes_back():
    from gridd.core.payload import validate_payload
    from gridd.core.publication import ProviderPublisher

    pub = ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                            publisher_epoch=7, created_at=0.0, next_sequence=iter(range(1, 100)).__next__)
    good = (b'llm_d_epp_ready_endpoints{name="p"} 2\nllm_d_epp_average_running_requests{name="p"} 1\n'
            b'llm_d_epp_average_queue_size{name="p"} 0\n'
            b'llm_d_epp_average_kv_cache_utilization{name="p"} 0.2\n'
            b'llm_d_epp_per_endpoint_queue_size{name="p",model_server_endpoint="e0"} 0\n')
    first = pub.on_scrape(now=1.0, wall_now=1000.0, body=good, failure_class=None, stale_after_s=10,
                          unavailable=False)
    assert first.complete and validate_payload(first) is None
    # A payload no field-level rule covers (here a probe value that is not finite): the
    # verdict travels alone. (An out-of-range load value only leaves that field out:
    # tests/test_failure_paths.py.)
    pub.probes = {"attributes.probe.x": math.nan}
    # ... and the wall clock stepped back 5 s
    second = pub.on_scrape(now=2.0, wall_now=995.0, body=good, failure_class=None, stale_after_s=10,
                           unavailable=False)
    assert second.revision is None and second.load is None and second.ready is True
    assert pub.summary.unpublishable == {"payload": 1}
    assert second.published_ms > first.published_ms


async def test_own_series_go_stale_on_metrics_when_scraping_stops(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 2.5)
        assert rig.sample("grid_provider_ready") == 1.0
        assert rig.sample("grid_provider_in_flight_requests") == 0.0
        await rig.operator.drain()  # passes scrape nothing from here on; last scrape at +2
        # staleMetricsSeconds = 10 s: still ready 10 s after the last answer, not after
        await trio.sleep_until(origin + 12.0)
        assert rig.sample("grid_provider_ready") == 1.0
        await trio.sleep_until(origin + 12.5)
        assert rig.sample("grid_provider_ready") == 0.0
        assert rig.sample("grid_provider_in_flight_requests") is None
        assert rig.sample("grid_provider_ready_endpoints") is None
        nursery.cancel_scope.cancel()


def test_a_body_of_too_many_lines_fails_as_parse_before_parsing():
    from gridd.core.publication import MAX_EXPOSITION_LINES, ProviderPublisher

    pub = ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                            publisher_epoch=7, created_at=0.0, next_sequence=iter(range(1, 9)).__next__)
    batch = pub.on_scrape(now=1.0, wall_now=1000.0, body=b"a\n" * (MAX_EXPOSITION_LINES + 1),
                          failure_class=None, stale_after_s=10, unavailable=False)
    assert batch.revision is None and pub.summary.failures == {"parse": 1}
    assert pub.summary.malformed_lines == 0  # never parsed


async def test_scrape_and_readiness_transitions_are_logged_once_each(tmp_path, autojump_clock, caplog):
    caplog.set_level(logging.INFO, logger="gridd.operator")
    rig = SimOperator(tmp_path, endpoints=1)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 0.5)
        rig.sim.set_knobs(metrics_hang=True)  # the scrapes from +1 time out after 2 s
        await trio.sleep_until(origin + 20.5)
        rig.sim.set_knobs(metrics_hang=False)
        await trio.sleep_until(origin + 40.5)
        nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records
             if r.name == "gridd.operator" and r.getMessage().startswith("provider llama:")]
    assert lines == [
        "provider llama: ready (EndpointsReady): 1 ready endpoints",
        # The first timed-out scrape (+1 to +3); the nine after it add no line.
        "provider llama: scrape failing (timeout): no answer within 2 s",
        "provider llama: not ready (ScrapeFailed): no scrape answered for 11.0s (stale after 10.0s); "
        "latest scrape failed: timeout",
        "provider llama: scrape recovered, was failing (timeout)",
        "provider llama: ready (EndpointsReady): 1 ready endpoints",
    ]
    levels = [r.levelno for r in caplog.records if r.getMessage().startswith("provider llama:")]
    assert levels == [logging.INFO, logging.WARNING, logging.WARNING, logging.INFO, logging.INFO]


def test_scrape_target_sends_the_providers_key_to_its_own_origin_only():
    """docs/security.md: the issue's leak (metrics.url moved to another host got
    `authorization: Bearer <key>` on every scrape) ends; metrics.auth names an EPP's token."""
    from gridd.config_schema import ProviderConfig
    from gridd.operator.service import scrape_target

    def target(metrics):
        p = msgspec.convert({"name": "p", "model": "m", "metrics": metrics,
                             "settings": {"endpoint": "http://127.0.0.1:8000/v1",
                                          "auth": {"scheme": "bearer", "api_key": "sk-provider"}}},
                            ProviderConfig)
        return scrape_target(p).headers

    assert target({"url": "http://127.0.0.1:8000/metrics"}) == {"authorization": "Bearer sk-provider"}
    assert target({"url": "http://evil.example:8000/metrics"}) == {}
    assert target({"url": "http://127.0.0.1:9090/metrics"}) == {}
    epp_auth = {"scheme": "bearer", "api_key": "epp-token"}
    assert target({"url": "http://127.0.0.1:9090/metrics", "auth": epp_auth}) == {
        "authorization": "Bearer epp-token"}


async def test_the_pass_observer_hears_each_pass_after_its_work(tmp_path, autojump_clock):
    rig = SimOperator(tmp_path, endpoints=2)
    heard: list[tuple[float, bool]] = []

    def observer(started: float, duration: float) -> None:
        # Told after the pass's scrapes were handed on: the reading of this pass is held.
        heard.append((started, rig.latest() is not None))

    operator = OperatorService(rig.loaded, CollectorRegistry(), client=rig.client,
                               wall=lambda: 1_800_000_000 + trio.current_time(), pass_observer=observer)
    rig.operator = operator
    async with trio.open_nursery() as nursery:
        await nursery.start(operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 2.5)
        nursery.cancel_scope.cancel()
    assert heard == [(origin, True), (origin + 1.0, True), (origin + 2.0, True)]
