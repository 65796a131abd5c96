"""Operator failure paths (issue 11): a slow provider next to healthy ones, a staged reload
that must write nothing, metrics.kind, latency per model, one bad field in a reading,
batch_samples per serving unit, and batch ordering across clock steps and restarts.

Timings run on trio's MockClock against in-process simulators (no sockets)."""

from __future__ import annotations

import httpx
import trio
from prometheus_client import CollectorRegistry

from gridd.config import load_config
from gridd.operator.service import OperatorService
from gridd.sim.app import SimApp
from gridd.sim.model import knobs_from

WALL_ORIGIN = 1_800_000_000

TWO_PROVIDERS = """
role: operator
site: a
state_dir: state
timings: {{stale_metrics_s: 1}}
providers:
  - name: healthy
    model: sim-model
    settings: {{endpoint: "http://healthy/v1"}}
    metrics: {{url: "http://healthy/metrics", timeout_s: 5}}
  - name: hung
    model: sim-model
    settings: {{endpoint: "http://hung/v1"}}
    metrics: {{url: "http://hung/metrics", timeout_s: 5{extra}}}
"""


class TwoRig:
    """An operator scraping two in-process simulators, ``healthy`` and ``hung``."""

    def __init__(self, tmp_path, *, extra: str = "") -> None:
        (tmp_path / "operator.yaml").write_text(TWO_PROVIDERS.format(extra=extra))
        self.sims = {name: SimApp(knobs_from({"endpoints": 2})) for name in ("healthy", "hung")}
        self.client = httpx.AsyncClient(mounts={
            f"http://{name}": httpx.ASGITransport(app=sim) for name, sim in self.sims.items()})
        self.registry = CollectorRegistry()
        self.loaded = load_config(tmp_path / "operator.yaml", env={})
        self.operator = OperatorService(self.loaded, self.registry, client=self.client,
                                        wall=lambda: WALL_ORIGIN + trio.current_time())

    def sample(self, name: str, provider: str):
        return self.registry.get_sample_value(name, {"grid_site": "a", "grid_provider": provider})


async def test_a_hanging_provider_never_makes_a_healthy_one_stale(tmp_path, autojump_clock):
    rig = TwoRig(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()  # passes at +0, +1, +2, +3 (1 s interval)
        await trio.sleep_until(origin + 3.5)
        rig.sims["hung"].set_knobs(metrics_hang=True)
        # The pass starting at +4 waits for the hung scrape's 5 s timeout: it ends at +9 and
        # the next starts at once. The healthy provider answers at the start of each pass.
        # The floor counts the running pass once it exceeds the last (about 0 s), so at +8.5
        # it is 1 + max(1, 4.5) = 5.5 s; with the finished pass alone it stayed 2 s and the
        # healthy provider read stale from +6 (2 s after its +4 answer) to +9.
        checks = 0
        t = origin + 3.5
        while t <= origin + 20.0:
            await trio.sleep_until(t)
            assert rig.sample("grid_provider_ready", "healthy") == 1.0, t - origin
            assert rig.sample("grid_provider_in_flight_requests", "healthy") == 0.0, t - origin
            assert rig.sample("grid_provider_ready_endpoints", "healthy") == 2.0, t - origin
            checks += 1
            t += 0.25
        assert checks == 67
        nursery.cancel_scope.cancel()


async def test_the_hung_provider_goes_not_ready_after_the_floor(tmp_path, autojump_clock):
    rig = TwoRig(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 3.5)
        rig.sims["hung"].set_knobs(metrics_hang=True)  # last answer at +3
        await trio.sleep_until(origin + 6.5)
        # Pass running since +4 for 2.5 s: floor 1 + max(1, 2.5) = 3.5 s; silent 3.5 s.
        assert rig.operator.status()["stale_after_s"] == 3.5
        assert rig.sample("grid_provider_ready", "hung") == 1.0
        await trio.sleep_until(origin + 8.5)
        assert rig.operator.status()["stale_after_s"] == 5.5
        assert rig.sample("grid_provider_ready", "hung") == 1.0
        # The pass ended at +9 (5 s); the next runs from +9: floor 1 + 5 = 6 s, and the hung
        # provider has been silent 6.5 s.
        await trio.sleep_until(origin + 9.5)
        assert rig.sample("grid_provider_ready", "hung") == 0.0
        verdict = rig.operator.publishers["hung"].current_verdict(
            trio.current_time(), stale_after_s=rig.operator.status()["stale_after_s"], unavailable=False)
        assert (verdict.reason, verdict.failure_class) == ("ScrapeFailed", "timeout")
        assert verdict.message == ("no scrape answered for 6.5s (stale after 6.0s); "
                                   "latest scrape failed: timeout")
        assert rig.sample("grid_provider_ready", "healthy") == 1.0
        nursery.cancel_scope.cancel()


def test_measured_pass_counts_the_running_pass_once_it_is_longer():
    from gridd.core.readiness import effective_stale_after_s, measured_pass_s

    assert measured_pass_s(None, None, 5.0) == 0.0
    assert measured_pass_s(0.25, None, 5.0) == 0.25
    assert measured_pass_s(3.0, 4.0, 5.0) == 3.0  # running 1 s: the finished pass is longer
    assert measured_pass_s(0.25, 4.0, 8.5) == 4.5  # running 4.5 s
    assert effective_stale_after_s(1.0, 1.0, measured_pass_s(0.25, 4.0, 8.5)) == 5.5


# -- batch_samples: one per serving unit -------------------------------------------------


async def test_batch_samples_counts_serving_units_and_zero_without_a_fresh_endpoint(tmp_path, autojump_clock):
    rig = TwoRig(tmp_path)
    rig.sims["healthy"].set_knobs(endpoints=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 1.5)
        batch = rig.operator.holdings.get("a", "healthy").batch
        assert len(batch.load.units) == 4 and batch.complete
        assert batch.revision.batch_samples == 4  # 4 endpoints: 4 samples (it was 5)
        rig.sims["healthy"].set_knobs(zero_ready=True)
        await trio.sleep_until(origin + 2.5)
        batch = rig.operator.holdings.get("a", "healthy").batch
        # No fresh endpoint: nothing to learn from, a zero-sample revision.
        assert batch.load.ready_endpoints == 0 and batch.complete
        assert batch.revision.batch_samples == 0
        nursery.cancel_scope.cancel()


def test_sample_count_rules():
    from gridd.core.readings import LoadSignals, UnitLoad, legacy_sample_count, sample_count

    units = tuple(UnitLoad(unit=f"u{i}", waiting=0.0) for i in range(4))
    assert sample_count(LoadSignals(ready_endpoints=4, units=units, avg_running=1.0, in_flight=4.0)) == 4
    assert legacy_sample_count(LoadSignals(ready_endpoints=4, units=units, avg_running=1.0,
                                           in_flight=4.0)) == 5
    # Pool-level load without per-unit series: the pool is the one sample.
    assert sample_count(LoadSignals(ready_endpoints=2, avg_running=1.0, avg_waiting=0.0)) == 1
    assert sample_count(LoadSignals(ready_endpoints=0, flow_queue=3.0)) == 0
    assert sample_count(LoadSignals()) == 0


# -- a staged reload writes nothing ----------------------------------------------------------


async def test_staging_a_reload_writes_no_state_and_commit_writes_it(tmp_path, autojump_clock):
    import math

    import pytest

    from gridd.errors import StateError

    rig = TwoRig(tmp_path)
    providers_file = tmp_path / "state" / "providers.json"
    config = tmp_path / "operator.yaml"
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        before = providers_file.read_bytes()
        generation = rig.operator.publishers["hung"].generation
        config.write_text(TWO_PROVIDERS.format(extra=", queue_full_at: 4"))  # a spec change
        autojump_clock.autojump_threshold = math.inf  # stage() checks TLS in a thread
        staged = await rig.operator.stage(load_config(config, env={}))
        autojump_clock.autojump_threshold = 0
        assert staged.revisions["hung"].generation == generation + 1
        # Staged, not committed (a reload rejected after staging): nothing durable changed.
        assert providers_file.read_bytes() == before
        # The next staging plans from the committed revisions, not from the dropped one.
        autojump_clock.autojump_threshold = math.inf
        staged = await rig.operator.stage(load_config(config, env={}))
        autojump_clock.autojump_threshold = 0
        assert staged.revisions["hung"].generation == generation + 1
        assert providers_file.read_bytes() == before

        # A commit whose write fails is rejected before anything is swapped.
        state_dir = providers_file.parent
        state_dir.rename(tmp_path / "state-moved")
        state_dir.write_text("not a directory")
        with pytest.raises(StateError):
            rig.operator.commit(staged)
        assert rig.operator.revisions["hung"].generation == generation
        assert rig.operator.publishers["hung"].generation == generation
        assert rig.operator.config.providers[1].metrics.queue_full_at is None
        state_dir.unlink()
        (tmp_path / "state-moved").rename(state_dir)

        rig.operator.commit(staged)
        assert rig.operator.publishers["hung"].generation == generation + 1
        assert providers_file.read_bytes() != before
        assert b'"generation":%d' % (generation + 1) in providers_file.read_bytes()
        nursery.cancel_scope.cancel()


# -- ordering across clock steps and restarts -------------------------------------------------

EPP_BODY = (b'llm_d_epp_ready_endpoints{name="p"} 2\nllm_d_epp_average_running_requests{name="p"} 1\n'
            b'llm_d_epp_average_queue_size{name="p"} 0\n'
            b'llm_d_epp_average_kv_cache_utilization{name="p"} 0.2\n'
            b'llm_d_epp_per_endpoint_queue_size{name="p",model_server_endpoint="e0"} 0\n')


def _publisher(epoch: int, sequences):
    from gridd.core.publication import ProviderPublisher

    return ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                             publisher_epoch=epoch, created_at=0.0, next_sequence=sequences.__next__)


def test_a_verdict_after_a_restart_with_the_clock_set_back_is_admitted():
    from gridd.core.admission import AdmissionFences, Outcome

    wall = 1_800_000_000.0
    receiver = AdmissionFences()
    before = _publisher(1_799_990_000, iter(range(1, 100)))
    for i in range(3):
        batch = before.on_scrape(now=float(i), wall_now=wall + i, body=EPP_BODY, failure_class=None,
                                 stale_after_s=2.0, unavailable=False)
        assert receiver.admit(batch, now_wall=wall + i, verified_site=None).outcome is Outcome.ACCEPTED
    # A failed scrape's verdict-only batch: ordered by (epoch, sequence) like the rest.
    failed = before.on_scrape(now=3.0, wall_now=wall + 3, body=None, failure_class="connect",
                              stale_after_s=2.0, unavailable=False)
    assert failed.revision is None and failed.order.batch_sequence == 4
    assert receiver.admit(failed, now_wall=wall + 3, verified_site=None).outcome is Outcome.ACCEPTED

    # Restart under the next epoch (the high-water mark + 1) with the clock 1 h back.
    after = _publisher(1_799_990_001, iter(range(1, 100)))
    set_back = wall - 3600
    verdict = after.on_scrape(now=100.0, wall_now=set_back, body=None, failure_class="timeout",
                              stale_after_s=2.0, unavailable=False)
    assert (verdict.ready, verdict.ready_reason) == (False, "ScrapeFailed")
    assert verdict.published_ms < failed.published_ms  # published_ms went back with the clock
    # Ordered by published_ms this was stale_order, and the gateway kept "ready".
    assert receiver.admit(verdict, now_wall=wall + 5, verified_site=None).outcome is Outcome.ACCEPTED
    assert receiver.fence("a", "p") == (1_799_990_001, 1)
    # A delayed batch of the old epoch stays out, verdict-only or not.
    assert receiver.admit(failed, now_wall=wall + 6, verified_site=None).reason == "stale_order"


def test_revision_less_batches_of_older_operators_still_order_by_published_ms():
    import msgspec

    from gridd.core.admission import AdmissionFences, Outcome

    receiver = AdmissionFences()
    old = _publisher(7, iter(range(1, 9)))
    first = old.on_scrape(now=0.0, wall_now=1000.0, body=None, failure_class="connect", stale_after_s=2.0,
                          unavailable=False)
    first = msgspec.structs.replace(first, order=None)  # as an older operator sends it
    second = msgspec.structs.replace(first, published_ms=first.published_ms - 1, ready_reason="x")
    assert receiver.admit(first, now_wall=1000.0, verified_site=None).outcome is Outcome.ACCEPTED
    assert receiver.admit(second, now_wall=1000.0, verified_site=None).reason == "stale_order"


def test_order_beside_a_revision_is_refused():
    import msgspec

    from gridd.core.payload import validate_payload
    from gridd.core.readings import BatchOrder

    batch = _publisher(7, iter(range(1, 9))).on_scrape(now=0.0, wall_now=1000.0, body=EPP_BODY,
                                                       failure_class=None,
                                                       stale_after_s=2.0, unavailable=False)
    assert batch.revision is not None and batch.order is None
    beside = msgspec.structs.replace(batch, order=BatchOrder(7, 1))
    assert validate_payload(beside) == "order beside revision metadata"


def test_a_high_water_mark_beyond_the_skew_bound_is_not_claimed(tmp_path):
    from gridd.state import EpochClaim, StateDir

    state = StateDir(tmp_path / "state")
    now = 1_800_000_000.0
    assert state.claim_publisher_epoch(now + 3600, future_bound_s=600) == EpochClaim(1_800_003_600)
    # The clock was an hour ahead and is corrected: the mark is 3600 s > 600 s ahead.
    assert state.claim_publisher_epoch(now, future_bound_s=600) == EpochClaim(1_800_000_000,
                                                                              discarded=1_800_003_600)
    assert state.read_epoch_high_water() == 1_800_000_000
    # Within the bound the mark is honoured (a clock set back 10 min: exactly the bound).
    assert state.claim_publisher_epoch(now - 599, future_bound_s=600) == EpochClaim(1_800_000_001)
    assert state.claim_publisher_epoch(now + 1, future_bound_s=600) == EpochClaim(1_800_000_002)


async def test_a_clock_corrected_while_running_restarts_the_epoch_and_receivers_follow(tmp_path,
                                                                                       autojump_clock):
    """The clock runs an hour ahead, then is corrected while the operator runs. A receiver
    whose clock was right all along dropped the future epoch as skew; one whose clock was
    ahead too (a gateway on the same host) admitted it. Both admit the epoch the operator
    restarts from the clock."""
    from gridd.core.admission import AdmissionFences

    ahead = {"s": 3600.0}

    def wall() -> float:
        return WALL_ORIGIN + ahead["s"] + trio.current_time()

    async def inline(fn, *args):
        return fn(*args)

    (tmp_path / "operator.yaml").write_text(TWO_PROVIDERS.format(extra=""))
    sims = {name: SimApp(knobs_from({"endpoints": 2})) for name in ("healthy", "hung")}
    mounts = {f"http://{n}": httpx.ASGITransport(app=sim) for n, sim in sims.items()}
    client = httpx.AsyncClient(mounts=mounts)
    registry = CollectorRegistry()
    operator = OperatorService(load_config(tmp_path / "operator.yaml", env={}), registry, client=client,
                               wall=wall, state_io=inline)
    right, same_host = AdmissionFences(), AdmissionFences()

    def deliver() -> tuple[str, str]:
        batch = operator.holdings.get("a", "healthy").batch
        now = trio.current_time()
        outcomes = []
        for receiver, receiver_wall in ((right, WALL_ORIGIN + now), (same_host, wall())):
            verdict = receiver.admit(batch, now_wall=receiver_wall, verified_site=None)
            outcomes.append(verdict.reason or verdict.outcome.value)
        return tuple(outcomes)

    async with trio.open_nursery() as nursery:
        await nursery.start(operator.run)
        origin = trio.current_time()
        future_epoch = operator.publisher_epoch
        assert future_epoch == WALL_ORIGIN + 3600 + int(origin)
        await trio.sleep_until(origin + 0.5)
        assert deliver() == ("skew", "accepted")
        ahead["s"] = 0.0  # the clock is corrected (for the operator and the same-host receiver)
        await trio.sleep_until(origin + 1.5)  # the scrape at +1 re-claims
        assert operator.publisher_epoch == WALL_ORIGIN + int(origin) + 1
        revision = operator.holdings.get("a", "healthy").batch.revision
        assert revision.publisher_epoch == operator.publisher_epoch
        assert registry.get_sample_value("grid_operator_publisher_epoch_clock_resets_total") == 1.0
        # The same-host receiver's fence (the future epoch) is beyond its corrected clock's
        # bound, so it is released rather than locking the provider out as stale_order.
        assert deliver() == ("accepted", "accepted")
        await trio.sleep_until(origin + 2.5)
        assert deliver() == ("accepted", "accepted")
        assert registry.get_sample_value("grid_operator_publisher_epoch_clock_resets_total") == 1.0
        nursery.cancel_scope.cancel()
    assert (tmp_path / "state" / "publisher_epoch").read_text() == f"{WALL_ORIGIN + int(origin) + 1}\n"


# -- metrics.kind ------------------------------------------------------------------------------

VLLM_BODY = (b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
             b'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
             b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


def _kind_publisher(kind: str):
    from gridd.core.publication import ProviderPublisher

    return ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                             publisher_epoch=7,
                             created_at=0.0, next_sequence=iter(range(1, 100)).__next__, kind=kind)


def _scrape(pub, body: bytes, now: float = 1.0):
    return pub.on_scrape(now=now, wall_now=1000.0 + now, body=body, failure_class=None, stale_after_s=2.0,
                         unavailable=False)


def test_metrics_kind_refuses_a_body_of_the_other_flavour():
    epp = _kind_publisher("epp")
    batch = _scrape(epp, VLLM_BODY)
    assert batch.revision is None and batch.load is None
    assert epp.summary.failures == {"wrong_kind": 1}
    assert epp.summary.last_failure_detail == (
        "metrics.kind is epp but the body is a vLLM engine's (vllm:* series, no EPP pool series)")
    assert epp.readiness.verdict(1.0, stale_after_s=2.0, unavailable=False).failure_class == "wrong_kind"
    assert _scrape(epp, EPP_BODY, now=2.0).load.ready_endpoints == 2

    vllm = _kind_publisher("vllm")
    assert _scrape(vllm, EPP_BODY).load is None
    assert vllm.summary.last_failure_detail == (
        "metrics.kind is vllm but the body is an EPP's (pool series, no vllm:* series)")
    # A body carrying both flavours is read as the configured one.
    both = _scrape(vllm, EPP_BODY + VLLM_BODY, now=2.0)
    assert both.load.ready_endpoints is None and [u.unit for u in both.load.units] == ["0"]
    assert _scrape(_kind_publisher("epp"), EPP_BODY + VLLM_BODY).load.ready_endpoints == 2
    # auto tells them apart; a body with neither flavour derives nothing under any kind.
    assert _scrape(_kind_publisher("auto"), VLLM_BODY).load.units[0].running == 3.0
    for kind in ("auto", "epp", "vllm"):
        pub = _kind_publisher(kind)
        standby = _scrape(pub, b'llm_d_epp_info{build_ref="v0.9.0"} 1\n')
        assert standby.ready_reason == "NoReadySeries" and pub.summary.failures == {}


async def test_metrics_kind_in_the_daemon_fails_scrapes_and_turns_not_ready(tmp_path, autojump_clock):
    rig = TwoRig(tmp_path, extra=", kind: vllm")  # "hung" is pointed at an EPP simulator
    async with trio.open_nursery() as nursery:
        await nursery.start(rig.operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 0.5)
        assert rig.registry.get_sample_value("grid_provider_scrape_failures_total",
                                             {"grid_site": "a", "grid_provider": "hung",
                                              "reason": "wrong_kind"}) == 1
        assert rig.operator.status()["providers"][1]["failure_class"] == "wrong_kind"
        # Never answered: not ready once the 2 s floor has passed since scraping started.
        await trio.sleep_until(origin + 2.5)
        assert rig.sample("grid_provider_ready", "hung") == 0.0
        assert rig.sample("grid_provider_ready", "healthy") == 1.0
        nursery.cancel_scope.cancel()


# -- latency per model -------------------------------------------------------------------------


def _two_model_body(ours: int, theirs: int, adapter: int = 0, errors: int = 0) -> bytes:
    lines = [
        'llm_d_epp_ready_endpoints{name="p"} 1',
        f'llm_d_epp_request_duration_seconds_count{{fairness_id="f",model_name="m",priority="0",'
        f'target_model_name="m"}} {ours}',
        f'llm_d_epp_request_duration_seconds_count{{fairness_id="f",model_name="other",priority="0",'
        f'target_model_name="other"}} {theirs}',
        f'llm_d_epp_request_duration_seconds_count{{fairness_id="f",model_name="m-lora",priority="0",'
        f'target_model_name="m"}} {adapter}',
        f'llm_d_epp_request_error_total{{error_code="ModelServerError",fairness_id="f",model_name="other",'
        f'priority="0",target_model_name="other"}} {errors}',
    ]
    for le, ours_le, theirs_le in (("0.1", 0, theirs), ("1", ours, theirs), ("+Inf", ours, theirs)):
        for model, count in (("m", ours_le), ("other", theirs_le)):
            lines.append(f'llm_d_epp_request_ttft_seconds_bucket{{fairness_id="f",model_name="{model}",'
                         f'priority="0",streaming="true",target_model_name="{model}",le="{le}"}} {count}')
    return ("\n".join(lines) + "\n").encode()


def test_latency_counts_only_the_providers_model_and_its_adapters():
    from gridd.core.publication import ProviderPublisher

    def publisher(adapters=()):
        return ProviderPublisher(site="a", provider="p", model="m", provider_uid="u", generation=1,
                                 publisher_epoch=7, created_at=0.0,
                                 next_sequence=iter(range(1, 100)).__next__, adapters=adapters)

    pub = publisher()
    assert _scrape(pub, _two_model_body(ours=0, theirs=0)).latency is None
    # 19 of ours (one short of 20) beside 500 of another model's, 50 of them failed.
    assert _scrape(pub, _two_model_body(ours=19, theirs=500, errors=50), now=2.0).latency is None
    block = _scrape(pub, _two_model_body(ours=20, theirs=900, errors=90), now=3.0).latency
    # Only our 20: all successes, TTFT in the 0.1..1 s bucket; the other model's errors
    # and its sub-100 ms TTFTs are not ours.
    assert (block.completed, block.error_ratio) == (20, 0.0)
    # Interpolated in the (0.1, 1] bucket holding all 20: rank 10 and rank 18 of 20.
    assert block.ttft_p50_s == 0.1 + (1 - 0.1) * 10 / 20
    assert block.ttft_p90_s == 0.1 + (1 - 0.1) * 18 / 20

    with_adapter = publisher(adapters=("m-lora",))
    _scrape(with_adapter, _two_model_body(ours=0, theirs=0))
    scraped = _scrape(with_adapter, _two_model_body(ours=10, theirs=500, adapter=10), now=2.0)
    assert scraped.latency.completed == 20


# -- one bad field -----------------------------------------------------------------------------

VLLM_KV_PERCENT = (b'vllm:num_requests_running{engine="0",model_name="sim-model"} 3.0\n'
                   b'vllm:num_requests_running{engine="1",model_name="sim-model"} 2.0\n'
                   b'vllm:num_requests_waiting{engine="0",model_name="sim-model"} 1.0\n'
                   b'vllm:num_requests_waiting{engine="1",model_name="sim-model"} 0.0\n'
                   b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 87.5\n'
                   b'vllm:kv_cache_usage_perc{engine="1",model_name="sim-model"} 40.0\n')


def test_one_bad_field_is_left_out_and_the_rest_published():
    from gridd.core.derivation import derive
    from gridd.core.payload import validate_payload

    derived = derive(_parse(VLLM_KV_PERCENT))
    load = derived.load
    assert derived.invalid == {
        "kv_usage": "vllm:kv_cache_usage_perc=87.5 is outside 0..1",
        "kv_mean": "left out with kv_usage (computed from every engine's value)",
        "kv_spread": "left out with kv_usage (computed from every engine's value)",
    }
    assert [(u.unit, u.running, u.waiting, u.kv_usage) for u in load.units] == [("0", 3.0, 1.0, None),
                                                                              ("1", 2.0, 0.0, None)]
    assert (load.in_flight, load.avg_running, load.avg_waiting) == (6.0, 2.5, 0.5)
    assert (load.kv_mean, load.kv_spread) == (None, None)

    # EPP: a KV mean on a 0-100 scale takes its spread with it; a negative waiting count
    # leaves the endpoint listed without it; everything else stays.
    body = EPP_BODY.replace(b'kv_cache_utilization{name="p"} 0.2', b'kv_cache_utilization{name="p"} 20') + (
        b'llm_d_epp_std_dev_kv_cache_utilization{name="p"} 0.05\n'
        b'llm_d_epp_per_endpoint_queue_size{name="p",model_server_endpoint="e1"} -2\n')
    derived = derive(_parse(body))
    assert derived.invalid == {
        "kv_mean": "llm_d_epp_average_kv_cache_utilization=20 is outside 0..1",
        "kv_spread": "left out with kv_mean (the same endpoints' values)",
        "waiting": "llm_d_epp_per_endpoint_queue_size=-2 is negative",
    }
    assert [(u.unit, u.waiting) for u in derived.load.units] == [("e0", 0.0), ("e1", None)]
    assert (derived.load.in_flight, derived.load.ready_endpoints) == (2.0, 2)  # (1 + 0) x 2

    pub = _publisher(7, iter(range(1, 99)))
    batch = pub.on_scrape(now=1.0, wall_now=1000.0, body=body, failure_class=None, stale_after_s=2.0,
                          unavailable=False)
    assert batch.complete and validate_payload(batch) is None and batch.load.in_flight == 2.0
    assert pub.summary.unpublishable == {"kv_mean": 1, "kv_spread": 1, "waiting": 1}


def _parse(body: bytes):
    from gridd.core.derivation import WANTED_SAMPLES
    from gridd.core.exposition import parse_exposition

    return parse_exposition(body, WANTED_SAMPLES)


async def test_a_kv_percent_vllm_keeps_in_flight_and_says_why_once(tmp_path, autojump_clock, caplog):
    import logging

    from gridd.cli import _provider_row

    body = {"value": VLLM_KV_PERCENT}
    (tmp_path / "operator.yaml").write_text(TWO_PROVIDERS.format(extra=""))
    sim = SimApp(knobs_from({"endpoints": 2}))
    client = httpx.AsyncClient(mounts={
        "http://healthy": httpx.ASGITransport(app=sim),
        "http://hung": httpx.MockTransport(lambda request: httpx.Response(200, content=body["value"]))})
    registry = CollectorRegistry()
    operator = OperatorService(load_config(tmp_path / "operator.yaml", env={}), registry, client=client,
                               wall=lambda: WALL_ORIGIN + trio.current_time())

    def sample(name: str, **labels):
        return registry.get_sample_value(name, {"grid_site": "a", "grid_provider": "hung", **labels})

    caplog.set_level(logging.INFO, logger="gridd.operator")
    async with trio.open_nursery() as nursery:
        await nursery.start(operator.run)
        origin = trio.current_time()
        await trio.sleep_until(origin + 2.5)  # scrapes at +0, +1, +2
        assert sample("grid_provider_in_flight_requests") == 6.0
        assert sample("grid_provider_unpublishable_readings_total", reason="kv_usage") == 3.0
        assert sample("grid_provider_unpublishable_readings_total", reason="kv_mean") == 3.0
        assert sample("grid_provider_unpublishable_readings_total", reason="payload") is None
        held = operator.holdings.get("a", "hung").batch
        assert held.complete and held.load.kv_mean is None and held.load.units[0].running == 3.0
        row = next(p for p in operator.status()["providers"] if p["name"] == "hung")
        assert row["in_flight"] == 6.0 and row["kv_mean"] is None
        assert _provider_row(row)[-1] == "invalid:kv_usage,kv_mean,kv_spread"
        body["value"] = VLLM_KV_PERCENT.replace(b"87.5", b"0.875").replace(b"40.0", b"0.4")
        await trio.sleep_until(origin + 4.5)
        assert sample("grid_provider_unpublishable_readings_total", reason="kv_usage") == 3.0
        assert operator.holdings.get("a", "hung").batch.load.kv_mean == (0.875 + 0.4) / 2
        hung = next(p for p in operator.status()["providers"] if p["name"] == "hung")
        assert _provider_row(hung)[-1] == "-"
        nursery.cancel_scope.cancel()
    # The invalid-field lines only (readiness and scrape transitions log lines of their own).
    lines = [r.getMessage() for r in caplog.records if r.name == "gridd.operator" and "hung" in r.getMessage()
             and ("reading published without" in r.getMessage()
                  or "every field of the reading" in r.getMessage())]
    assert lines == [
        "provider hung: reading published without kv_usage, kv_mean, kv_spread: kv_usage: "
        "vllm:kv_cache_usage_perc=87.5 is outside 0..1; kv_mean: left out with kv_usage (computed from every "
        "engine's value); kv_spread: left out with kv_usage (computed from every engine's value)",
        "provider hung: every field of the reading is valid again",
    ]


# -- the wall-clock seam ---------------------------------------------------------------------


def test_wall_clock_offset_is_read_from_the_environment_and_refused_when_malformed(tmp_path):
    import os
    import subprocess
    import sys

    from gridd.clock import _read_offset

    assert _read_offset(None) == (0.0, None)
    assert _read_offset(" ") == (0.0, None)
    assert _read_offset("-3600") == (-3600.0, None)
    assert _read_offset("1h") == (0.0, "GRIDD_WALL_CLOCK_OFFSET_S='1h': expected a finite number of seconds")
    assert _read_offset("inf")[1] == "GRIDD_WALL_CLOCK_OFFSET_S='inf': expected a finite number of seconds"

    code = ("import time; from gridd.clock import wall_clock, wall_clock_offset_s; "
            "print(wall_clock_offset_s(), round(wall_clock() - time.time()))")
    shifted = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "GRIDD_WALL_CLOCK_OFFSET_S": "-240"})
    assert shifted.stdout.split() == ["-240.0", "-240"]
    (tmp_path / "operator.yaml").write_text(TWO_PROVIDERS.format(extra=""))
    refused = subprocess.run([sys.executable, "-m", "gridd", "run", "--config",
                              str(tmp_path / "operator.yaml")],
                             capture_output=True, text=True, timeout=30,
                             env={**os.environ, "GRIDD_WALL_CLOCK_OFFSET_S": "soon"})
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith(
        "cannot start: GRIDD_WALL_CLOCK_OFFSET_S='soon': expected a finite number of seconds")
