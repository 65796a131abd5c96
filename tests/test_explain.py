"""gridctl explain's pure core (gridd/core/explain.py) on a GatewayStore fed with batches:
exact pick chances, each tier and exclusion, the capacity's evidence, and every outcome a
request can get, checked against GatewayStore.decide on the same store."""

from __future__ import annotations

import random

import msgspec
import pytest
from support import SERVING, THREE_SITES, WALL, BatchFeed, load, store

from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.core.explain import CAPACITY_BOUNDS, TIERS, explain_model
from gridd.core.knobs import RoutingKnobs
from gridd.core.readings import LoadSignals
from gridd.core.store import GatewayStore


def by_site(explained) -> dict[str, object]:
    return {c.site: c for c in explained.candidates}


def decided_kind(s: GatewayStore, model: str, now: float) -> tuple:
    """decide()'s answer as (kind, cause, retry_after_s), the way explain names it."""
    d = s.decide(model, now=now, rng=random.Random(3))
    match d:
        case Forward():
            return ("forward", None, None)
        case Shed(retry_after_s=r):
            return ("shed", None, r)
        case Unavailable(retry_after_s=r, cause=cause):
            return ("unavailable", cause, r)
        case UnknownModel():
            return ("unknown_model", None, None)
    raise AssertionError(d)


def same_as_decide(s: GatewayStore, model: str, now: float):
    explained = explain_model(s, model, now=now)
    o = explained.outcome
    assert (o.kind, None if o.kind == "forward" else o.cause, o.retry_after_s) == decided_kind(s, model, now)
    return explained


def test_exact_pick_chances_of_two_choices_on_a_known_snapshot():
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch(site, ld=ld) for site, ld in THREE_SITES.items()], now=0.0, now_wall=WALL)
    e = same_as_decide(s, "m", 0.5)
    assert [c.site for c in e.candidates] == ["a", "c", "b"]  # least loaded first
    c = by_site(e)
    assert [c[x].weight for x in "abc"] == [32.0, 16.0, 16.0]
    assert [c[x].ordered_rho for x in "abc"] == [0.125, 0.5, 0.25]
    # a wins every pair it is drawn in; only the pair {b, c} leaves it out:
    # P({b, c}) = 2 x (16/64) x (16/48) = 1/6, and c (lower rho) takes it.
    assert c["a"].chance == pytest.approx(5 / 6, abs=1e-12)
    assert c["c"].chance == pytest.approx(1 / 6, abs=1e-12)
    assert c["b"].chance == 0.0
    assert e.outcome.kind == "forward" and e.outcome.status is None
    assert e.outcome.message == "a/llama 83.3%, c/llama 16.7%"
    assert all(x.tier == "room" and x.excluded is None and x.signal == "fresh" for x in e.candidates)
    assert c["a"].local and not c["b"].local
    assert c["a"].reason.startswith("room (rho 0.12 < 1); capacity 32.0 from the prior 8/unit x 4 units")


def test_pending_sends_since_the_reading_move_the_chances():
    s, feed = store(pending_weight=4.0), BatchFeed()
    s.ingest([feed.batch(site, ld=ld) for site, ld in THREE_SITES.items()], now=0.0, now_wall=WALL)
    for _ in range(8):
        s.sends.record(("a", "llama"), 0.5)  # made after a's reading was taken (at 0.0, age 0)
    c = by_site(explain_model(s, "m", now=1.0))
    assert c["a"].pending_sends == 8
    assert c["a"].pending_rho == pytest.approx(4.0 * 8 / 32)  # weight x sends / capacity = 1.0
    # a's rho 0.125 + 1.0 >= 1 ranks it below b and c in every pair:
    # P({a, b}) = (32/64)(16/32) + (16/64)(32/48) = 5/12 -> b; {a, c} -> c (5/12); {b, c} -> c (1/6).
    assert c["a"].chance == 0.0
    assert c["b"].chance == pytest.approx(5 / 12, abs=1e-12)
    assert c["c"].chance == pytest.approx(7 / 12, abs=1e-12)
    assert "8 send(s) since its reading add rho 1.00" in c["a"].reason
    # With pending_weight 0 the sends are still counted but add nothing.
    s.reconfigure(RoutingKnobs(pending_weight=0.0))
    c = by_site(explain_model(s, "m", now=1.0))
    assert (c["a"].pending_sends, c["a"].pending_rho, c["a"].chance) == (8, 0.0, pytest.approx(5 / 6))


def test_each_tier_and_exclusion_is_shown():
    s, feed = store(), BatchFeed()
    kv_full = load(ready=2, running=1.0, kv=1.0)                    # rho 1, nothing waiting
    backlog = load(ready=2, running=2.0, waiting=3.0, kv=1.0)       # rho >= 1, every unit waits >= running
    batches = [
        feed.batch("a", "room", ld=load(ready=2, running=1.0, kv=0.0)),
        feed.batch("a", "notfull", ld=kv_full),
        feed.batch("a", "full", ld=backlog),
        feed.batch("b", "stale", ld=load(), age_s=25.0),           # past the 20 s TTL
        feed.batch("b", "silent", ld=load(), age_s=45.0),          # past 2 x TTL
        feed.batch("c", "notready", ready=False),
        feed.batch("c", "zero", ld=load(ready=0)),
        feed.batch("d", "noroute"),                                # site d: no ingress
        feed.batch("a", "stopped"),
    ]
    serving = msgspec.structs.replace(SERVING, providers=tuple(
        msgspec.structs.replace(SERVING.providers[0], provider=name)
        for name in ("room", "notfull", "full", "stopped")))
    s.set_serving(serving)
    s.ingest(batches, now=0.0, now_wall=WALL)
    s.ingest([feed.batch("a", "stopped", ld=load(units=False))], now=0.5, now_wall=WALL, complete_view=False)
    e = same_as_decide(s, "m", 1.0)
    c = {x.provider: x for x in e.candidates}
    assert {p: (c[p].tier, c[p].excluded, c[p].signal) for p in c} == {
        "room": ("room", None, "fresh"),
        "notfull": ("not_full", None, "fresh"),
        "full": ("full", None, "fresh"),
        "stale": ("stale", None, "stale"),
        "silent": (None, "silent", "silent"),
        "notready": (None, "not_ready", "fresh"),
        "zero": (None, "zero_ready_endpoints", "fresh"),
        "noroute": (None, "no_route", "fresh"),
        "stopped": (None, "unit_series_stopped", "fresh"),
    }
    assert {x.tier for x in e.candidates} - {None} == set(TIERS)
    assert (c["full"].full, c["full"].backlogged) == (True, True)
    assert (c["notfull"].full, c["notfull"].backlogged) == (False, False)
    assert c["full"].queue_depth == 6.0 and c["room"].queue_depth == 0.0
    assert c["stale"].ordered_rho is None and c["stale"].chance == 0.0
    assert (c["stale"].arrived_age_s, c["stale"].held_s, c["stale"].age_s) == (25.0, 1.0, 26.0)
    assert c["room"].chance + c["notfull"].chance == pytest.approx(1.0)
    assert all(c[p].chance == 0.0 for p in ("full", "silent", "notready", "zero", "noroute", "stopped"))
    assert c["notready"].reason.startswith("excluded (not_ready): not ready")
    assert c["stale"].reason.startswith("stale: no fresh reading")
    assert c["full"].reason.startswith("full: rho ")
    assert c["notfull"].reason.startswith("no room (rho 1.00 >= 1) but not full")
    assert "(arrived 25.0 s old, held here 1.0 s)" in c["stale"].reason
    # Order: healthy least loaded first (stale last among them), then the excluded ones.
    assert [x.provider for x in e.candidates][:4] == ["room", "notfull", "full", "stale"]


@pytest.mark.parametrize(("ld", "bound", "capacity"), [
    (load(ready=4, running=1.0, kv=0.0), "prior", 32.0),                 # held 1/unit: below the prior
    (load(ready=4, running=8.0, kv=0.0), "soft", 4 * 1.5 * 8.0),           # held 8/unit, nothing queued
    (load(ready=4, running=3.0, waiting=1.0, kv=0.0), "hard", 4 * 3.0),  # every unit waits: limit 3
    (LoadSignals(kv_mean=0.5), "floor", 1.0),                             # no unit count
])
def test_capacity_names_the_bound_in_force_and_its_evidence(ld, bound, capacity):
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch("a", ld=ld)], now=0.0, now_wall=WALL)
    cand = explain_model(s, "m", now=0.5).candidates[0]
    ev = cand.capacity
    assert ev.bound == bound and bound in CAPACITY_BOUNDS
    assert ev.capacity == capacity == s.candidates[("a", "llama")].learner.capacity(0.5)
    # The laid-out terms give the learner's own figure.
    per_unit = {"prior": ev.unit_capacity, "soft": ev.soft_side, "hard": ev.hard_per_unit}.get(bound)
    assert ev.capacity == (ev.floor if bound == "floor" else ev.units * per_unit)


def test_no_routing_data_is_503_with_the_cause_and_no_pick():
    s = store()
    e = same_as_decide(s, "m", 0.0)
    assert (e.outcome.kind, e.outcome.status, e.outcome.cause) == ("unavailable", 503, "no_operator_data")
    assert e.outcome.message == "no routing data from the operator: no poll has succeeded yet"
    assert e.candidates == [] and e.known_models == []
    feed = BatchFeed()
    s.ingest([feed.batch("a")], now=0.0, now_wall=WALL)
    e = same_as_decide(s, "m", 21.0)  # the last poll is older than the 20 s TTL
    assert e.outcome.cause == "no_operator_data" and "last successful poll was 21 s ago" in e.outcome.message
    assert [(c.site, c.signal, c.chance) for c in e.candidates] == [("a", "stale", 0.0)]


def test_unknown_model_is_404():
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch("a")], now=0.0, now_wall=WALL)
    e = same_as_decide(s, "other", 0.5)
    assert (e.outcome.kind, e.outcome.status) == ("unknown_model", 404)
    assert e.candidates == [] and e.known_models == ["m"]


def test_every_candidate_excluded_is_503_excluded_or_silent():
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch("a", ld=load(ready=0)), feed.batch("b", ready=False)], now=0.0, now_wall=WALL)
    e = same_as_decide(s, "m", 0.5)
    assert (e.outcome.status, e.outcome.cause, e.outcome.retry_after_s) == (503, "excluded", 2.0)
    s2 = store()
    s2.ingest([feed.batch("b", age_s=41.0), feed.batch("c", age_s=50.0)], now=0.0, now_wall=WALL)
    e = same_as_decide(s2, "m", 0.5)
    assert (e.outcome.status, e.outcome.cause, e.outcome.retry_after_s) == (503, "silent", 6.0)
    assert all(c.excluded == "silent" and c.chance == 0.0 for c in e.candidates)


def test_shedding_runs_and_the_429():
    s, feed = store(shedding=True, full_after_s=2.0, room_after_s=5.0), BatchFeed()
    full = load(ready=2, running=2.0, waiting=3.0, kv=1.0)
    s.ingest([feed.batch("a", ld=full), feed.batch("b", ld=full)], now=0.0, now_wall=WALL)
    e = same_as_decide(s, "m", 0.5)
    # Every fresh healthy site full, not yet for full_after: forwarded, a full run under way.
    assert (e.outcome.kind, e.outcome.cause) == ("forward", "full")
    assert "forwarded (not yet full for full_after)" in e.outcome.message
    assert (e.shedding.enabled, e.shedding.shedding, e.shedding.run, e.shedding.next_change_s,
            e.shedding.run_for_s) == (True, False, "full", 1.5, 0.5)
    s.ingest([feed.batch("a", ld=full), feed.batch("b", ld=full)], now=2.0, now_wall=WALL)
    e = same_as_decide(s, "m", 2.0)
    assert (e.outcome.kind, e.outcome.status, e.outcome.retry_after_s) == ("shed", 429, 5.0)
    assert (e.shedding.shedding, e.shedding.run) == (True, None)
    assert all(c.chance == 0.0 for c in e.candidates)
    s.ingest([feed.batch("a", ld=load(kv=0.0)), feed.batch("b", ld=full)], now=3.0, now_wall=WALL)
    e = same_as_decide(s, "m", 4.0)  # relief run from 3.0: routes again at 8.0
    assert (e.outcome.kind, e.shedding.run, e.shedding.next_change_s, e.shedding.run_for_s) == (
        "shed", "relief", 4.0, 1.0)
    # Shedding off: the same all-full model is forwarded, and no run is reported.
    off = store(shedding=False)
    off.ingest([feed.batch("a", ld=full), feed.batch("b", ld=full)], now=0.0, now_wall=WALL)
    e = same_as_decide(off, "m", 5.0)
    assert (e.outcome.kind, e.outcome.cause) == ("forward", "full")
    assert "(shedding is off)" in e.outcome.message
    assert (e.shedding.enabled, e.shedding.run, e.shedding.next_change_s) == (False, None, None)


def test_the_json_form_round_trips():
    s, feed = store(), BatchFeed()
    s.ingest([feed.batch(site, ld=ld) for site, ld in THREE_SITES.items()], now=0.0, now_wall=WALL)
    e = explain_model(s, "m", now=0.5)
    data = msgspec.to_builtins(e)
    assert data["candidates"][0]["capacity"]["bound"] == "prior"
    assert msgspec.convert(data, type(e)) == e
