"""The gateway store: admission into the store, exclusion, staleness, unknown vs 503,
pinned requests, the bounded retry, and shedding flips at exact times."""

from __future__ import annotations

import random

from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.core.readings import LoadSignals, Revision, UnitLoad
from gridd.core.store import GatewayStore
from gridd.wire import Batch, LocalProvider, ServingConfig, SiteIngress

WALL = 1_800_000_000.0
SERVING = ServingConfig(
    providers=(LocalProvider("llama", "m", "http://a-llama/v1"),),
    ingresses=(SiteIngress("b", "http://b-gw"), SiteIngress("c", "http://c-gw")),
)


def load(*, ready=2, running=1.0, waiting=0.0, units=True, kv=0.2, flow=0.0) -> LoadSignals:
    unit_list = tuple(UnitLoad(f"u{i}", waiting=waiting) for i in range(ready)) if units else ()
    return LoadSignals(ready_endpoints=ready, units=unit_list, avg_running=running, avg_waiting=waiting,
                       kv_mean=kv, kv_spread=0.0, flow_queue=flow, in_flight=(running + waiting) * ready + flow)


class Feed:
    """Publishes per-(site, provider) batches with increasing sequences, like an operator."""

    def __init__(self) -> None:
        self.seq: dict[tuple[str, str], int] = {}

    def batch(self, site: str, provider: str = "llama", *, ready=True, ld: LoadSignals | None = None,
              epoch: int = int(WALL) - 100, age_s: float = 0.0) -> Batch:
        key = (site, provider)
        self.seq[key] = self.seq.get(key, 0) + 1
        ld = ld if ld is not None else load()
        from gridd.core.signals import sample_count

        rev = Revision(f"uid-{site}", 1, epoch, self.seq[key], sample_count(ld))
        return Batch(site=site, provider=provider, model="m", published_ms=int(WALL * 1000), age_s=age_s,
                     revision=rev, complete=True, ready=ready, ready_reason="", load=ld)


def store(**kw) -> GatewayStore:
    s = GatewayStore(site="a", **kw)
    s.set_serving(SERVING)
    return s


def sites_picked(s: GatewayStore, now: float, n: int = 400) -> set[str]:
    rng = random.Random(7)
    out = set()
    for _ in range(n):
        d = s.decide("m", now=now, rng=rng)
        assert isinstance(d, Forward), d
        out.add(d.site)
    return out


def test_unknown_model_is_404_and_excluded_only_is_503():
    s = store()
    feed = Feed()
    s.ingest([feed.batch("a", ld=load(ready=0))], now=0.0, now_wall=WALL)
    assert isinstance(s.decide("other", now=0.0, rng=random.Random(1)), UnknownModel)
    d = s.decide("m", now=0.0, rng=random.Random(1))
    assert isinstance(d, Unavailable) and d.retry_after_s == 2.0  # a local exclusion: scrape + poll


def test_excluded_site_never_picked_while_a_healthy_one_exists():
    s = store()
    feed = Feed()
    s.ingest([feed.batch("a", ready=False), feed.batch("b")], now=0.0, now_wall=WALL)
    assert sites_picked(s, 0.0) == {"b"}
    # per-unit series stopped while the ready count kept coming: excluded too
    s.ingest([feed.batch("a", ld=load(units=False)), feed.batch("b")], now=1.0, now_wall=WALL)
    assert sites_picked(s, 1.0) == {"b"}
    # a later reading says otherwise: rejoins at once (b now sits at its learned soft bound,
    # rho 1, no room; a is picked: the point is that a is routable again)
    s.ingest([feed.batch("a"), feed.batch("b")], now=2.0, now_wall=WALL)
    assert "a" in sites_picked(s, 2.0)
    d = next(d for d in (s.decide("m", now=2.0, rng=random.Random(i)) for i in range(50)) if d.site == "a")
    assert d.local is not None and d.local.endpoint_url == "http://a-llama/v1" and d.ingress_url is None
    d = s.decide("m", now=2.0, rng=random.Random(1), exclude=frozenset({("a", "llama")}))
    assert d.local is None and d.ingress_url == "http://b-gw"


def test_stale_reading_sorts_last_but_is_used_when_alone():
    s = store(signal_ttl_s=20.0)
    feed = Feed()
    s.ingest([feed.batch("a"), feed.batch("b", age_s=19.0)], now=0.0, now_wall=WALL)
    assert {v.site for v in s.snapshots["m"].ordered} == {"a", "b"}
    s.rebuild(1.5)  # b's reading is now 20.5 s old: past the TTL
    order = [(v.site, v.stale) for v in s.snapshots["m"].ordered]
    assert order == [("a", False), ("b", True)]
    assert sites_picked(s, 1.5) == {"a"}
    only_b = store(signal_ttl_s=20.0)
    only_b.ingest([Feed().batch("b", age_s=25.0)], now=0.0, now_wall=WALL)
    assert sites_picked(only_b, 0.0) == {"b"}


def test_replays_and_future_epochs_never_reach_the_store():
    s = store()
    feed = Feed()
    first = feed.batch("b")
    s.ingest([first], now=0.0, now_wall=WALL)
    newer = feed.batch("b", ld=load(running=5.0))
    s.ingest([newer], now=1.0, now_wall=WALL)
    s.ingest([first], now=2.0, now_wall=WALL)  # delayed: stale_order
    assert s.candidates[("b", "llama")].batch is newer
    s.ingest([newer], now=3.0, now_wall=WALL)  # exact repeat: idempotent, age unchanged
    assert s.candidates[("b", "llama")].received_at == 1.0
    future = feed.batch("b", epoch=int(WALL) + 601)
    s.ingest([future], now=4.0, now_wall=WALL)
    drops = s.fences.drops()
    assert (drops["stale_order"], drops["skew"]) == (1, 1)
    assert s.candidates[("b", "llama")].batch is newer


def test_candidates_the_operator_no_longer_holds_age_then_are_forgotten():
    s = store(signal_ttl_s=20.0)
    feed = Feed()
    s.ingest([feed.batch("a"), feed.batch("b")], now=0.0, now_wall=WALL)
    # one answer without b (e.g. a restarted operator before its first peer poll) is no
    # proof b is gone: kept, ageing, and stale once past the TTL
    s.ingest([], now=1.0, now_wall=WALL)
    assert s.models() == ["m"] and set(s.candidates) == {("a", "llama"), ("b", "llama")}
    s.ingest([feed.batch("a")], now=30.0, now_wall=WALL)
    assert [(v.site, v.stale) for v in s.snapshots["m"].ordered] == [("a", False), ("b", True)]
    s.ingest([feed.batch("a")], now=40.0, now_wall=WALL)  # exactly 2 x TTL old: kept
    assert ("b", "llama") in s.candidates
    s.ingest([feed.batch("a")], now=40.5, now_wall=WALL)  # past 2 x TTL: forgotten
    assert set(s.candidates) == {("a", "llama")}


def test_shedding_never_hides_a_503_and_applies_to_pinned_requests():
    s = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    feed = Feed()
    busy = load(ready=2, running=4.0, waiting=2.0, kv=0.99)
    for t in range(0, 4):
        s.ingest([feed.batch("a", ld=busy), feed.batch("b", ld=busy)], now=float(t), now_wall=WALL)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Shed)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1), pinned_site="a"), Shed)
    s.ingest([feed.batch("a", ld=load(ready=0)), feed.batch("b", ready=False, ld=busy)], now=4.0, now_wall=WALL)
    assert isinstance(s.decide("m", now=4.0, rng=random.Random(1)), Unavailable)


def test_an_epp_that_never_exposed_unit_series_is_not_excluded_for_lacking_them():
    s = store()
    feed = Feed()
    s.ingest([feed.batch("a", ld=load(units=False))], now=0.0, now_wall=WALL)
    assert [v.site for v in s.snapshots["m"].ordered] == ["a"]
    s.ingest([feed.batch("a")], now=1.0, now_wall=WALL)  # units appear ...
    s.ingest([feed.batch("a", ld=load(units=False))], now=2.0, now_wall=WALL)  # ... and stop
    assert [v.site for v in s.snapshots["m"].excluded] == ["a"]


def test_an_overflowing_reading_is_treated_as_missing_not_a_crash():
    s = store()
    feed = Feed()
    huge = LoadSignals(ready_endpoints=2, units=(UnitLoad("u0"), UnitLoad("u1")), avg_running=1e308,
                       avg_waiting=0.0, kv_mean=0.1, kv_spread=0.0, in_flight=None)
    s.ingest([feed.batch("a", ld=huge), feed.batch("b")], now=0.0, now_wall=WALL)
    assert "a" in {v.site for v in s.snapshots["m"].ordered}
    assert isinstance(s.decide("m", now=0.0, rng=random.Random(1)), Forward)


def test_pinned_requests_are_served_locally_only_and_retry_excludes():
    s = store()
    feed = Feed()
    s.ingest([feed.batch("a", ld=load(running=9.0, kv=0.9)), feed.batch("b", ld=load(running=0.1))],
             now=0.0, now_wall=WALL)
    rng = random.Random(3)
    assert all(s.decide("m", now=0.0, rng=rng, pinned_site="a").site == "a" for _ in range(50))
    assert isinstance(s.decide("m", now=0.0, rng=rng, pinned_site="b"), UnknownModel)
    tried = frozenset({("b", "llama")})
    assert all(s.decide("m", now=0.0, rng=rng, exclude=tried).site == "a" for _ in range(50))
    assert isinstance(s.decide("m", now=0.0, rng=rng, exclude=tried | {("a", "llama")}), UnknownModel)


def test_shedding_flips_after_full_after_and_back_after_room_after():
    s = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    feed = Feed()
    # Learn a hard bound: 8 in flight with work waiting on both sites.
    busy = load(ready=2, running=4.0, waiting=2.0, kv=0.99)
    for t in range(0, 5):
        s.ingest([feed.batch("a", ld=busy), feed.batch("b", ld=busy)], now=float(t), now_wall=WALL)
        if t < 2:
            assert not isinstance(s.decide("m", now=float(t), rng=random.Random(1)), Shed), t
    # saturated with work waiting since t=0: sheds from t=2 (full_after_s) on
    d = s.decide("m", now=4.0, rng=random.Random(1))
    assert isinstance(d, Shed) and 1.0 <= d.retry_after_s <= 60.0
    idle = load(ready=2, running=0.0, waiting=0.0, kv=0.0)
    s.ingest([feed.batch("a", ld=idle), feed.batch("b", ld=idle)], now=5.0, now_wall=WALL)
    # last saturated sample at t=4: routes again at 4 + room_after_s = 9
    assert isinstance(s.decide("m", now=8.999, rng=random.Random(1)), Shed)
    assert isinstance(s.decide("m", now=9.0, rng=random.Random(1)), Forward)


def test_reconfigure_applies_new_knobs_and_keeps_learned_state():
    s = store(shedding=False, signal_ttl_s=20.0)
    feed = Feed()
    busy = load(ready=2, running=4.0, waiting=2.0, kv=0.99)
    for t in range(0, 4):
        s.ingest([feed.batch("a", ld=busy)], now=float(t), now_wall=WALL)
    learner = s.candidates[("a", "llama")].learner
    bound_before = learner.bound
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Forward)  # shedding off: route
    s.reconfigure(signal_ttl_s=5.0, future_epoch_bound_s=60.0, capacity_floor=1.0, rho_smoothing=0.5,
                  recent_window_s=30.0, shedding=True, full_after_s=2.0, room_after_s=5.0)
    assert s.candidates[("a", "llama")].learner is learner and learner.bound == bound_before
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Shed)  # the run since t=0 counts
    assert s.fences.future_epoch_bound_s == 60.0
    s.rebuild(9.5)  # a's reading (received at 3.0) is now older than the new 5 s TTL
    assert [v.stale for v in s.snapshots["m"].ordered] == [True]
