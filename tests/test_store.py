"""The gateway store: admission into the store, exclusion, the ageing of a reading (fresh,
stale, silent, forgotten), unknown vs 503, pinned requests, the bounded retry, the knobs, and
shedding flips at exact times."""

from __future__ import annotations

import random

from support import WALL, BatchFeed, load, store

from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.core.knobs import RoutingKnobs
from gridd.core.readings import LoadSignals, UnitLoad
from gridd.core.store import GatewayStore


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
    feed = BatchFeed()
    s.ingest([feed.batch("a", ld=load(ready=0))], now=0.0, now_wall=WALL)
    assert isinstance(s.decide("other", now=0.0, rng=random.Random(1)), UnknownModel)
    d = s.decide("m", now=0.0, rng=random.Random(1))
    assert d == Unavailable(2.0, cause="excluded")  # a local exclusion: scrape + poll


def test_excluded_site_never_picked_while_a_healthy_one_exists():
    s = store()
    feed = BatchFeed()
    s.ingest([feed.batch("a", ready=False), feed.batch("b")], now=0.0, now_wall=WALL)
    assert sites_picked(s, 0.0) == {"b"}
    # per-unit series stopped while the ready count kept coming: excluded too
    s.ingest([feed.batch("a", ld=load(units=False)), feed.batch("b")], now=1.0, now_wall=WALL)
    assert sites_picked(s, 1.0) == {"b"}
    # a later reading says otherwise: rejoins at once
    s.ingest([feed.batch("a"), feed.batch("b")], now=2.0, now_wall=WALL)
    assert "a" in sites_picked(s, 2.0)
    d = next(d for d in (s.decide("m", now=2.0, rng=random.Random(i)) for i in range(50)) if d.site == "a")
    assert d.local is not None and d.local.endpoint_url == "http://a-llama/v1" and d.ingress_url is None
    d = s.decide("m", now=2.0, rng=random.Random(1), exclude=frozenset({("a", "llama")}))
    assert d.local is None and d.ingress_url == "http://b-gw"


def test_stale_reading_sorts_last_but_is_used_when_alone():
    s = store(signal_ttl_s=20.0)
    feed = BatchFeed()
    s.ingest([feed.batch("a"), feed.batch("b", age_s=19.0)], now=0.0, now_wall=WALL)
    assert {v.site for v in s.snapshots["m"].ordered} == {"a", "b"}
    s.rebuild(1.5)  # b's reading is now 20.5 s old: past the TTL
    order = [(v.site, v.stale) for v in s.snapshots["m"].ordered]
    assert order == [("a", False), ("b", True)]
    assert sites_picked(s, 1.5) == {"a"}
    only_b = store(signal_ttl_s=20.0)
    only_b.ingest([BatchFeed().batch("b", age_s=25.0)], now=0.0, now_wall=WALL)
    assert sites_picked(only_b, 0.0) == {"b"}


def test_replays_and_future_epochs_never_reach_the_store():
    s = store()
    feed = BatchFeed()
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


def test_a_reading_ages_through_stale_and_silent_and_is_forgotten_after_retention():
    # A recent window as long as the TTL, so the TTL alone decides when b goes stale (with
    # the default 10 s window, a candidate with no new sample is stale after 10 s).
    s = store(signal_ttl_s=20.0, recent_window_s=30.0, candidate_retention_s=100.0)
    feed = BatchFeed()
    s.ingest([feed.batch("a"), feed.batch("b")], now=0.0, now_wall=WALL)
    # one answer without b (e.g. a restarted operator before its first peer poll) is no
    # proof b is gone: kept, ageing, and stale once past the TTL
    s.ingest([], now=1.0, now_wall=WALL)
    assert s.models() == ["m"] and set(s.candidates) == {("a", "llama"), ("b", "llama")}
    s.ingest([feed.batch("a")], now=20.0, now_wall=WALL)  # exactly the TTL old: fresh
    assert [(v.site, v.stale) for v in s.snapshots["m"].ordered] == [("a", False), ("b", False)]
    s.ingest([feed.batch("a")], now=20.5, now_wall=WALL)
    assert [(v.site, v.stale) for v in s.snapshots["m"].ordered] == [("a", False), ("b", True)]
    s.ingest([feed.batch("a")], now=40.0, now_wall=WALL)  # exactly 2 x TTL old: stale, routable
    assert [v.site for v in s.snapshots["m"].ordered] == ["a", "b"]
    s.ingest([feed.batch("a")], now=40.5, now_wall=WALL)  # past 2 x TTL: silent, excluded
    assert [v.site for v in s.snapshots["m"].excluded] == ["b"]
    s.ingest([feed.batch("a")], now=100.0, now_wall=WALL)  # exactly the retention: kept
    assert ("b", "llama") in s.candidates
    s.ingest([feed.batch("a")], now=100.5, now_wall=WALL)  # past it: forgotten
    assert set(s.candidates) == {("a", "llama")}


def test_a_model_whose_every_candidate_went_silent_is_503_silent_until_forgotten():
    s = store(signal_ttl_s=20.0, candidate_retention_s=100.0)
    feed = BatchFeed()
    s.ingest([feed.batch("b")], now=0.0, now_wall=WALL)
    for t in (20.0, 40.0):
        s.ingest([], now=t, now_wall=WALL)
    d = s.decide("m", now=40.0, rng=random.Random(1))  # exactly 2 x TTL old: stale, still routed
    assert isinstance(d, Forward) and d.site == "b"
    s.ingest([], now=40.5, now_wall=WALL)
    # silent: 503 with the remote recheck hint, never 404
    assert s.decide("m", now=40.5, rng=random.Random(1)) == Unavailable(6.0, cause="silent")
    # another candidate excluded for what its fresh reading says: the cause is "excluded"
    s.ingest([feed.batch("a", ld=load(ready=0))], now=41.0, now_wall=WALL)
    assert s.decide("m", now=41.0, rng=random.Random(1)) == Unavailable(2.0, cause="excluded")
    s.ingest([], now=60.0, now_wall=WALL, removed=[("a", "llama")])
    for t in (80.0, 100.0):
        s.ingest([], now=t, now_wall=WALL)
    assert s.decide("m", now=100.0, rng=random.Random(1)) == Unavailable(6.0, cause="silent")
    s.ingest([], now=100.5, now_wall=WALL)  # past candidate_retention_s: forgotten
    assert s.decide("m", now=100.5, rng=random.Random(1)) == UnknownModel()


def test_a_removal_the_operator_announces_is_forgotten_at_once():
    s = store()
    feed = BatchFeed()
    s.ingest([feed.batch("a"), feed.batch("b")], now=0.0, now_wall=WALL)
    # a removal named in the same answer as a batch of it: the batch wins (re-added)
    s.ingest([feed.batch("b")], now=1.0, now_wall=WALL, removed=[("b", "llama")])
    assert ("b", "llama") in s.candidates
    s.ingest([], now=2.0, now_wall=WALL, removed=[("b", "llama"), ("c", "never-held")])
    assert set(s.candidates) == {("a", "llama")}
    s.ingest([], now=3.0, now_wall=WALL, removed=[("a", "llama")])
    assert s.decide("m", now=3.0, rng=random.Random(1)) == UnknownModel()
    # the fences forgot it too: its sequence may restart
    s.ingest([BatchFeed().batch("a")], now=4.0, now_wall=WALL)
    assert isinstance(s.decide("m", now=4.0, rng=random.Random(1)), Forward)


def test_no_routing_data_is_503_never_404():
    s = store(signal_ttl_s=20.0)
    assert s.decide("m", now=0.0, rng=random.Random(1)) == Unavailable(2.0, cause="no_operator_data")
    assert s.decide("other", now=0.0, rng=random.Random(1)) == Unavailable(2.0, cause="no_operator_data")
    assert s.routing_data_problem(0.0) == "no routing data from the operator: no poll has succeeded yet"
    assert not s.has_routing_data(0.0)
    s.ingest([BatchFeed().batch("b")], now=1.0, now_wall=WALL)
    assert s.routing_data_problem(21.0) is None and s.has_routing_data(21.0)
    assert isinstance(s.decide("m", now=21.0, rng=random.Random(1)), Forward)
    assert s.decide("other", now=21.0, rng=random.Random(1)) == UnknownModel()
    # no poll within the TTL: the gateway can no longer tell which models exist
    assert not s.has_routing_data(21.5)
    assert s.decide("m", now=21.5, rng=random.Random(1)) == Unavailable(2.0, cause="no_operator_data")
    assert s.decide("other", now=21.5, rng=random.Random(1)) == Unavailable(2.0, cause="no_operator_data")
    assert s.routing_data_problem(21.5) == ("no routing data from the operator: the last successful poll "
                                            "was 20 s ago (signal TTL 20 s)")


def test_an_answer_whose_every_batch_is_dropped_is_no_routing_data():
    """A gateway whose clock is far behind its operator's drops every batch as skew: it holds
    no routing data and must say so (503 naming the cause), not answer 404."""
    s = store(signal_ttl_s=20.0)
    ahead = int(WALL) + 3600  # publisher epochs an hour ahead of this gateway's clock
    s.ingest([BatchFeed().batch("a", epoch=ahead), BatchFeed().batch("b", epoch=ahead)],
             now=0.0, now_wall=WALL)
    assert s.decide("m", now=0.0, rng=random.Random(1)) == Unavailable(2.0, cause="no_operator_data")
    assert s.routing_data_problem(0.0) == (
        "no usable routing data from the operator: every batch of its answers was dropped (skew 2) (skew: "
        "their publisher epochs are more than timings.future_epoch_bound_s ahead of this gateway's clock; "
        "check both clocks)")
    # One usable batch in an answer is routing data again.
    s.ingest([BatchFeed().batch("a", epoch=ahead), BatchFeed().batch("b")], now=1.0, now_wall=WALL)
    assert s.routing_data_problem(1.0) is None
    assert isinstance(s.decide("m", now=1.0, rng=random.Random(1)), Forward)
    # An empty answer (an operator with no providers) is routing data: nothing is served.
    empty = store(signal_ttl_s=20.0)
    empty.ingest([], now=0.0, now_wall=WALL)
    assert empty.decide("m", now=0.0, rng=random.Random(1)) == UnknownModel()


def test_shedding_never_hides_a_503_and_applies_to_pinned_requests():
    s = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    feed = BatchFeed()
    busy = load(ready=2, running=4.0, waiting=4.0, kv=0.99)  # every queue as deep as its batch
    for t in range(0, 4):
        s.ingest([feed.batch("a", ld=busy), feed.batch("b", ld=busy)], now=float(t), now_wall=WALL)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Shed)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1), pinned_site="a"), Shed)
    s.ingest([feed.batch("a", ld=load(ready=0)), feed.batch("b", ready=False, ld=busy)],
             now=4.0, now_wall=WALL)
    assert isinstance(s.decide("m", now=4.0, rng=random.Random(1)), Unavailable)


def test_an_epp_that_never_exposed_unit_series_is_not_excluded_for_lacking_them():
    s = store()
    feed = BatchFeed()
    s.ingest([feed.batch("a", ld=load(units=False))], now=0.0, now_wall=WALL)
    assert [v.site for v in s.snapshots["m"].ordered] == ["a"]
    s.ingest([feed.batch("a")], now=1.0, now_wall=WALL)  # units appear ...
    s.ingest([feed.batch("a", ld=load(units=False))], now=2.0, now_wall=WALL)  # ... and stop
    assert [v.site for v in s.snapshots["m"].excluded] == ["a"]


def test_an_overflowing_reading_is_treated_as_missing_not_a_crash():
    s = store()
    feed = BatchFeed()
    huge = LoadSignals(ready_endpoints=2, units=(UnitLoad("u0"), UnitLoad("u1")), avg_running=1e308,
                       avg_waiting=0.0, kv_mean=0.1, kv_spread=0.0, in_flight=None)
    s.ingest([feed.batch("a", ld=huge), feed.batch("b")], now=0.0, now_wall=WALL)
    assert "a" in {v.site for v in s.snapshots["m"].ordered}
    assert isinstance(s.decide("m", now=0.0, rng=random.Random(1)), Forward)


def test_pinned_requests_are_served_locally_only_and_retry_excludes():
    s = store()
    feed = BatchFeed()
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
    feed = BatchFeed()
    # Full: every unit's queue as deep as its batch (a limit of 4 per unit, rho 2).
    busy = load(ready=2, running=4.0, waiting=4.0, kv=0.99)
    for t in range(0, 5):
        s.ingest([feed.batch("a", ld=busy), feed.batch("b", ld=busy)], now=float(t), now_wall=WALL)
        if t < 2:
            assert not isinstance(s.decide("m", now=float(t), rng=random.Random(1)), Shed), t
        if t == 2:  # full since t=0: sheds from t=2 (full_after_s) on
            assert isinstance(s.decide("m", now=2.0, rng=random.Random(1)), Shed)
    assert s.decide("m", now=4.0, rng=random.Random(1)) == Shed(5.0)  # every site full: a whole room timer
    idle = load(ready=2, running=0.0, waiting=0.0, kv=0.0)
    s.ingest([feed.batch("a", ld=idle), feed.batch("b", ld=idle)], now=5.0, now_wall=WALL)
    assert s.decide("m", now=7.5, rng=random.Random(1)) == Shed(2.5)
    # relief since t=5: routes again at 5 + room_after_s = 10
    assert isinstance(s.decide("m", now=9.999, rng=random.Random(1)), Shed)
    assert isinstance(s.decide("m", now=10.0, rng=random.Random(1)), Forward)


def test_reconfigure_applies_new_knobs_and_keeps_learned_state():
    s = store(shedding=False, signal_ttl_s=20.0)
    feed = BatchFeed()
    busy = load(ready=2, running=4.0, waiting=4.0, kv=0.99)
    for t in range(0, 4):
        s.ingest([feed.batch("a", ld=busy)], now=float(t), now_wall=WALL)
    learner = s.candidates[("a", "llama")].learner
    assert learner.bound == 8.0  # a limit of 4 per unit
    assert learner.unit_bounds(3.0) == (None, 4.0)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Forward)  # shedding off: route
    assert s.sends.since(("a", "llama"), 2.0) == 1
    knobs = RoutingKnobs(signal_ttl_s=5.0, future_epoch_bound_s=60.0, capacity_floor=10.0, unit_capacity=2.0,
                         evidence_window_s=120.0, pick_rule="spec_tiers", pending_weight=0.0, shedding=True,
                         full_after_s=2.0, room_after_s=5.0)
    s.reconfigure(knobs)
    assert s.knobs is knobs and s.signal_ttl_s == 5.0 and s.shedding_enabled
    assert s.candidates[("a", "llama")].learner is learner
    assert learner.unit_bounds(3.0) == (None, 4.0)  # the evidence is kept ...
    assert learner.bound == 10.0  # ... and read with the new knobs: 2 x min(2, 4) = 4, floor 10
    assert s.sends.since(("a", "llama"), 2.0) == 1  # own sends kept
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Shed)  # the run since t=0 counts
    assert s.fences.future_epoch_bound_s == 60.0
    s.rebuild(8.0)  # a's reading (received at 3.0) is exactly the new 5 s TTL old: fresh
    assert [v.stale for v in s.snapshots["m"].ordered] == [False]
    s.rebuild(8.5)
    assert [v.stale for v in s.snapshots["m"].ordered] == [True]
    # a new candidate learns with the new knobs from its first batch
    s.ingest([feed.batch("b", ld=load(ready=3, running=0.5))], now=9.0, now_wall=WALL)
    assert s.candidates[("b", "llama")].learner.bound == 10.0  # 3 x 2 = 6 under the floor


def test_knob_defaults():
    assert RoutingKnobs() == RoutingKnobs(
        signal_ttl_s=20.0, future_epoch_bound_s=600.0, capacity_floor=1.0, rho_smoothing=0.5,
        recent_window_s=10.0, unit_capacity=8.0, evidence_window_s=60.0, pick_rule="two_choices",
        pending_weight=4.0, candidate_retention_s=600.0, shedding=False, full_after_s=5.0, room_after_s=5.0)
    assert RoutingKnobs(unit_capacity=3.0).learner_args() == {
        "floor": 1.0, "alpha": 0.5, "recent_window_s": 10.0, "unit_capacity": 3.0, "evidence_window_s": 60.0}


def test_pick_rule_knob_reaches_the_pick():
    # Two sites with room and pending load off: two_choices always takes the lower rho (two
    # fresh sites are always both drawn); spec_tiers weights them by capacity / (1 + rho).
    picks = {}
    for rule in ("two_choices", "spec_tiers"):
        s = store(pick_rule=rule, pending_weight=0.0)
        feed = BatchFeed()
        s.ingest([feed.batch("b", ld=load(running=1.0)), feed.batch("c", ld=load(running=2.0))],
                 now=0.0, now_wall=WALL)
        picks[rule] = sites_picked(s, 0.0)
    assert picks == {"two_choices": {"b"}, "spec_tiers": {"b", "c"}}
