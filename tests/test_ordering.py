"""Ordering: views into one immutable least-loaded-first snapshot (spec: The Poll Path)."""

from __future__ import annotations

import math

import pytest

from gridd.core.capacity import CapacityLearner
from gridd.core.ordering import CandidateView, build_snapshot, candidate_view
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
    assert sites(snap.room) == ["idle", "mid"]


def test_stale_sorts_last_whatever_rho_it_carries() -> None:
    snap = build_snapshot("m", [view("stale", rho=0.0, stale=True), view("loaded", rho=3.0)])
    assert sites(snap.ordered) == ["loaded", "stale"]
    assert snap.room == ()


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
    assert snap.room_capacity == (2.0, 3.0, 5.0)
    assert snap.room_cum == (2.0, 5.0, 10.0)
    assert snap.room_total == 10.0


def test_pair_weight_is_capacity_over_one_plus_rho() -> None:
    snap = build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.0)])
    # room[0] is the less loaded b. w_b = 10 / (1 + 0) = 10, w_a = 30 / (1 + 0.5) = 20.
    assert sites(snap.room) == ["b", "a"]
    assert snap.pair_first_p == pytest.approx(10.0 / 30.0, abs=1e-15)


def test_no_room_fallback_prefers_fresh_not_full_then_stale() -> None:
    snap = build_snapshot("m", [
        view("full-big", 100.0, 1.5, full=True),
        view("busy-small", 5.0, 1.1),
        view("busy-big", 20.0, 1.2),
        view("stale", 200.0, math.inf, stale=True),
    ])
    assert snap.room == ()
    assert snap.fallback is not None and snap.fallback.site == "busy-big"
    assert not snap.fallback_stale
    assert snap.overflow is None
    assert not snap.all_full
    assert snap.any_full

    only_stale_left = build_snapshot("m", [view("full", 100.0, 1.5, full=True),
                                           view("stale", 1.0, math.inf, stale=True)])
    assert only_stale_left.fallback is not None and only_stale_left.fallback.site == "stale"
    assert only_stale_left.fallback_stale
    assert not only_stale_left.all_full


def test_every_healthy_full_sets_overflow_by_capacity_then_queue_depth() -> None:
    snap = build_snapshot("m", [
        view("a", 20.0, 1.5, full=True, queue_depth=4.0),
        view("b", 20.0, 1.2, full=True, queue_depth=2.0),
        view("c", 10.0, 1.1, full=True, queue_depth=0.0),
        view("down", 99.0, 0.0, healthy=False),
    ])
    assert snap.all_full and snap.any_full
    assert snap.fallback is None
    assert snap.overflow is not None and snap.overflow.site == "b"


def test_stale_full_flag_is_ignored() -> None:
    snap = build_snapshot("m", [view("s", 1.0, math.inf, stale=True, full=True)])
    assert not snap.any_full
    assert not snap.all_full
    assert snap.fallback is not None and snap.fallback.site == "s"


def test_no_healthy_candidate_is_never_all_full() -> None:
    snap = build_snapshot("m", [view("down", full=True, rho=2.0, healthy=False)])
    assert snap.ordered == ()
    assert not snap.all_full and not snap.any_full
    assert snap.overflow is None and snap.fallback is None


def test_snapshot_is_immutable() -> None:
    snap = build_snapshot("m", [view("a")])
    with pytest.raises(AttributeError):
        snap.ordered = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        view("a").rho = 0.0  # type: ignore[misc]


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
    learner = _learner_with(load)  # in-flight 10 with work waiting: hard 10, rho 1
    v = candidate_view(site="a", provider="p", model="m", learner=learner, load=load, now=1.0,
                       healthy=True, local=True)
    assert v == CandidateView(site="a", provider="p", model="m", capacity=10.0, rho=1.0, healthy=True,
                              full=True, queue_depth=4.0, stale=False, local=True)


@pytest.mark.parametrize(
    ("fresh", "has_load", "now"),
    [(False, True, 1.0), (True, False, 1.0), (True, True, 30.0)],
    ids=["reading not fresh", "no reading", "every sample aged out"],
)
def test_candidate_view_stale(fresh: bool, has_load: bool, now: float) -> None:
    load = LoadSignals(ready_endpoints=2, avg_running=3.0, avg_waiting=1.0)
    learner = _learner_with(load)
    v = candidate_view(site="a", provider="p", model="m", learner=learner, load=load if has_load else None,
                       now=now, healthy=True, local=False, fresh=fresh)
    assert v.stale
    assert v.rho == math.inf
    assert not v.full
    assert v.capacity == 8.0
