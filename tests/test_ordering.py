"""Ordering: views into one immutable least-loaded-first snapshot (spec: The Poll Path)."""

from __future__ import annotations

import math

import pytest

from gridd.core.capacity import CapacityLearner
from gridd.core.ordering import CandidateView, OrderedSnapshot, Tier, build_snapshot, candidate_view
from gridd.core.readings import LoadSignals, Revision


def view(site: str, capacity: float = 10.0, rho: float = 0.5, **kw: object) -> CandidateView:
    return CandidateView(site=site, provider="p", model="m", capacity=capacity, rho=rho, **kw)


def sites(views: tuple[CandidateView, ...]) -> list[str]:
    return [v.site for v in views]


def test_least_loaded_first_stale_last_excluded_apart() -> None:
    snap = build_snapshot("m", [
        view("stale", 100.0, math.inf, stale=True),
        view("busy", 10.0, 1.25),
        view("down", 50.0, 0.0, healthy=False),
        view("idle", 10.0, 0.1),
        view("mid", 10.0, 0.5),
    ])
    assert sites(snap.ordered) == ["idle", "mid", "busy", "stale"]
    assert sites(snap.excluded) == ["down"]
    assert sites(snap.room.candidates) == ["idle", "mid"]
    assert sites(snap.fresh.candidates) == ["idle", "mid", "busy"]


def test_stale_sorts_last_whatever_rho_it_carries() -> None:
    snap = build_snapshot("m", [view("stale", rho=0.0, stale=True), view("loaded", rho=3.0)])
    assert sites(snap.ordered) == ["loaded", "stale"]
    assert len(snap.room) == 0


def test_equal_load_breaks_on_capacity_then_queue_depth_then_name() -> None:
    snap = build_snapshot("m", [
        view("c", 10.0, 0.5, queue_depth=1.0),
        view("b", 10.0, 0.5, queue_depth=0.0),
        view("a", 10.0, 0.5, queue_depth=1.0),
        view("big", 20.0, 0.5, queue_depth=9.0),
    ])
    assert sites(snap.ordered) == ["big", "b", "a", "c"]


def test_precomputed_room_weights() -> None:
    snap = build_snapshot("m", [view("a", 2.0, 0.1), view("b", 3.0, 0.2), view("c", 5.0, 0.3),
                                view("full", 50.0, 1.0)])
    assert snap.room == Tier(snap.ordered[:3], (2.0, 3.0, 5.0), (2.0, 5.0, 10.0), 10.0)
    assert snap.fresh.capacities == (2.0, 3.0, 5.0, 50.0)
    assert snap.fresh.cum == (2.0, 5.0, 10.0, 60.0) and snap.fresh.total == 60.0
    assert Tier.of([]) == Tier() and len(Tier()) == 0


def test_pair_weight_is_capacity_over_one_plus_rho() -> None:
    snap = build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.0)])
    # room[0] is the less loaded b. w_b = 10 / (1 + 0) = 10, w_a = 30 / (1 + 0.5) = 20.
    assert sites(snap.room.candidates) == ["b", "a"]
    assert snap.pair_first_p == pytest.approx(10.0 / 30.0, abs=1e-15)


# Preference tiers (routing-quality issue): room, then fresh and not full, then fresh and
# full (only when every fresh one is), then no fresh signal (only when no fresh one is left).
TIER_CASES = [
    # (case, views, room, not_full, full, stale, all_full)
    ("no room: fresh not full form the no-room tier; the stale one waits",
     [view("full-big", 100.0, 1.5, full=True), view("busy-small", 5.0, 1.1), view("busy-big", 20.0, 1.2),
      view("stale", 200.0, math.inf, stale=True)],
     [], ["busy-small", "busy-big"], [], [], False),
    ("room and full side by side: not all full",
     [view("room", 10.0, 0.5), view("full", 100.0, 1.5, full=True)],
     ["room"], [], [], [], False),
    ("every fresh site full: the full tier, before the stale one",
     [view("full", 100.0, 1.5, full=True), view("stale", 1.0, math.inf, stale=True)],
     [], [], ["full"], [], True),
    ("every healthy fresh site full, an excluded one aside",
     [view("a", 20.0, 1.5, full=True, queue_depth=4.0), view("b", 20.0, 1.2, full=True, queue_depth=2.0),
      view("c", 10.0, 1.1, full=True), view("down", 99.0, 0.0, healthy=False)],
     [], [], ["c", "b", "a"], [], True),
    ("no fresh site left: the stale tier",
     [view("s1", 1.0, math.inf, stale=True), view("s2", 5.0, math.inf, stale=True),
      view("down", 50.0, 0.0, healthy=False)],
     [], [], [], ["s2", "s1"], False),
    ("a stale one's full flag is ignored",
     [view("s", 1.0, math.inf, stale=True, full=True)],
     [], [], [], ["s"], False),
    ("no healthy candidate is never all full",
     [view("down", full=True, rho=2.0, healthy=False)],
     [], [], [], [], False),
]


@pytest.mark.parametrize(("case", "views", "room", "not_full", "full", "stale", "all_full"), TIER_CASES,
                         ids=[c[0] for c in TIER_CASES])
def test_preference_tiers(case: str, views: list[CandidateView], room: list[str], not_full: list[str],
                          full: list[str], stale: list[str], all_full: bool) -> None:
    snap = build_snapshot("m", views)
    assert sites(snap.room.candidates) == room
    assert sites(snap.not_full.candidates) == not_full
    assert sites(snap.full.candidates) == full
    assert sites(snap.stale.candidates) == stale
    assert snap.all_full is all_full
    for tier in (snap.room, snap.not_full, snap.full, snap.stale):
        assert tier.capacities == tuple(v.capacity for v in tier.candidates)
        assert tier.total == sum(tier.capacities)


def test_snapshot_is_immutable() -> None:
    # Shared by every request task: nothing may change it after build_snapshot (a frozen
    # struct, its tiers and views too), and a misspelled field is an error, never dropped.
    snap = build_snapshot("m", [view("a")])
    with pytest.raises(AttributeError):
        snap.ordered = ()  # type: ignore[misc]  # assigning to a frozen field must fail at runtime
    with pytest.raises(AttributeError):
        snap.room.total = 0.0  # type: ignore[misc]  # assigning to a frozen field must fail at runtime
    with pytest.raises(AttributeError):
        view("a").rho = 0.0  # type: ignore[misc]  # assigning to a frozen field must fail at runtime
    fields = {f: getattr(snap, f) for f in snap.__struct_fields__}
    assert OrderedSnapshot(**fields) == snap
    with pytest.raises(TypeError, match="Unexpected keyword argument 'ordred'"):
        OrderedSnapshot(**fields, ordred=())
    with pytest.raises(TypeError, match="Unexpected keyword argument 'hot'"):
        view("a", hot=True)


@pytest.mark.parametrize("capacity", [0.0, -1.0, math.inf, math.nan])
def test_capacity_must_be_positive(capacity: float) -> None:
    with pytest.raises(ValueError, match="capacity"):
        build_snapshot("m", [view("a", capacity)])


def test_views_must_serve_the_model() -> None:
    with pytest.raises(ValueError, match="serves"):
        build_snapshot("other", [view("a")])


# --- candidate_view: from a learner and its latest load ------------------------------------

def _learner_with(load: LoadSignals, now: float = 0.0) -> CapacityLearner:
    learner = CapacityLearner(floor=4.0, alpha=1.0, recent_window_s=30.0)
    learner.observe(now, Revision("u", 1, 1, 1, 3), load, complete=True, new_sample=True)
    return learner


def test_candidate_view_reads_bound_recent_worst_and_full() -> None:
    load = LoadSignals(ready_endpoints=2, avg_running=3.0, avg_waiting=1.0, flow_queue=2.0)
    # Every unit waits and flow control holds work: a limit of 3 per unit, capacity 6;
    # in-flight (3 + 1) x 2 + 2 = 10, rho 10 / 6; backlogged (flow control), so full.
    learner = _learner_with(load)
    v = candidate_view(site="a", provider="p", model="m", learner=learner, load=load, now=1.0,
                       healthy=True, local=True)
    assert v == CandidateView(site="a", provider="p", model="m", capacity=6.0, rho=10.0 / 6.0, healthy=True,
                              full=True, queue_depth=4.0, stale=False, local=True)


def test_candidate_view_saturated_but_not_backlogged_is_not_full() -> None:
    load = LoadSignals(ready_endpoints=2, avg_running=3.0, avg_waiting=1.0)  # a short queue everywhere
    v = candidate_view(site="a", provider="p", model="m", learner=_learner_with(load), load=load, now=1.0,
                       healthy=True, local=True)
    assert v.rho == 8.0 / 6.0 and not v.full


def test_a_fresh_reading_whose_rho_samples_left_the_window_reads_its_latest_rho() -> None:
    # The signal TTL decides staleness, not the recent window (10 s, shorter than the 20 s TTL):
    # a repeated publication adds no sample, yet the reading is still fresh.
    load = LoadSignals(ready_endpoints=2, avg_running=3.0, avg_waiting=1.0)
    learner = _learner_with(load)
    assert learner.recent_worst_rho(30.0) is None
    v = candidate_view(site="a", provider="p", model="m", learner=learner, load=load, now=30.0,
                       healthy=True, local=False, fresh=True)
    assert not v.stale and v.rho == learner.rho == 8.0 / 6.0


@pytest.mark.parametrize(
    ("fresh", "has_load", "now"),
    [(False, True, 1.0), (True, False, 1.0)],
    ids=["reading not fresh", "no reading"],
)
def test_candidate_view_stale(fresh: bool, has_load: bool, now: float) -> None:
    load = LoadSignals(ready_endpoints=2, avg_running=3.0, avg_waiting=1.0)
    learner = _learner_with(load)
    v = candidate_view(site="a", provider="p", model="m", learner=learner, load=load if has_load else None,
                       now=now, healthy=True, local=False, fresh=fresh)
    assert v.stale
    assert v.rho == math.inf
    assert not v.full
    assert v.capacity == 6.0

