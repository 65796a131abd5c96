"""Site selection (spec: Site Selection; DESIGN 5b), checked against exact probabilities.

Frequencies come from DRAWS seeded picks with random.Random(1234). Each observed frequency
must lie within 4 binomial standard deviations of its theoretical probability:
|f - p| <= 4 * sqrt(p * (1 - p) / DRAWS)  (about 0.014 at p = 0.5 for 20 000 draws).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from gridd.core.capacity import CapacityLearner
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot, candidate_view
from gridd.core.readings import LoadSignals, Revision
from gridd.core.selection import Full, NoCandidates, NoneHealthy, Route, pick
from gridd.core.shedding import ShedState

DRAWS = 20_000


def view(site: str, capacity: float = 10.0, rho: float = 0.5, **kw: object) -> CandidateView:
    return CandidateView(site=site, provider="p", model="m", capacity=capacity, rho=rho, **kw)


def frequencies(snap: OrderedSnapshot, draws: int = DRAWS) -> dict[str, float]:
    rng = random.Random(1234)
    counts: Counter[str] = Counter()
    for _ in range(draws):
        outcome = pick(snap, rng)
        assert isinstance(outcome, Route)
        counts[outcome.site] += 1
    return {site: n / draws for site, n in counts.items()}


def assert_matches(observed: dict[str, float], expected: dict[str, float], draws: int = DRAWS) -> None:
    assert set(observed) <= {s for s, p in expected.items() if p > 0}
    for site, p in expected.items():
        tolerance = 4 * math.sqrt(p * (1 - p) / draws)
        assert abs(observed.get(site, 0.0) - p) <= tolerance, (site, observed.get(site, 0.0), p, tolerance)


def two_choice_probabilities(views: list[CandidateView]) -> dict[str, float]:
    """Exact win probabilities of "two by capacity, take the lower rho".

    Draws are ordered and without replacement, each proportional to capacity among the
    sites not yet drawn, so with T = sum of capacities:
        P(first = a, second = b) = (c_a / T) * (c_b / (T - c_a))
    The lower rho wins; on a tie the first drawn wins. Hence
        P(k) = sum_{j != k} [ P(k, j) * [rho_k <= rho_j] + P(j, k) * [rho_k < rho_j] ]
    and for distinct rhos, P(k) = sum_{j: rho_j > rho_k} (c_k c_j / T) (1/(T - c_k) + 1/(T - c_j)).
    """
    total = sum(v.capacity for v in views)
    p = dict.fromkeys((v.site for v in views), 0.0)
    for a in views:
        for b in views:
            if a is b:
                continue
            pair = (a.capacity / total) * (b.capacity / (total - a.capacity))
            winner = b if b.rho < a.rho else a
            p[winner.site] += pair
    assert math.isclose(sum(p.values()), 1.0)
    return p


# --- three or more with room -----------------------------------------------------------------

THREE_PLUS = {
    "three, distinct rho": [view("a", 10.0, 0.2), view("b", 20.0, 0.5), view("c", 30.0, 0.8)],
    "five, mixed": [view("a", 5.0, 0.9), view("b", 40.0, 0.7), view("c", 10.0, 0.1), view("d", 25.0, 0.4),
                    view("e", 20.0, 0.3)],
    "dominant capacity": [view("big", 97.0, 0.6), view("s1", 1.0, 0.1), view("s2", 2.0, 0.2)],
    "rho ties go to the first drawn": [view("a", 10.0, 0.5), view("b", 30.0, 0.5), view("c", 60.0, 0.5)],
}


@pytest.mark.parametrize("case", list(THREE_PLUS))
def test_three_or_more_two_by_capacity_lower_rho(case: str) -> None:
    views = THREE_PLUS[case]
    snap = build_snapshot("m", views)
    assert len(snap.room) == len(views)
    assert_matches(frequencies(snap), two_choice_probabilities(views))


def test_three_or_more_exact_values() -> None:
    views = THREE_PLUS["three, distinct rho"]
    p = two_choice_probabilities(views)
    # T = 60. a (lowest rho) wins every pair it is in: 1 - P({b, c}),
    # P({b, c}) = (20/60)(30/40) + (30/60)(20/30) = 1/4 + 1/3 = 7/12.
    assert p["a"] == pytest.approx(5 / 12)
    assert p["b"] == pytest.approx(7 / 12)
    assert p["c"] == 0.0
    # Equal rho: the first draw decides alone, so P(k) = c_k / T.
    tied = two_choice_probabilities(THREE_PLUS["rho ties go to the first drawn"])
    assert tied == pytest.approx({"a": 0.1, "b": 0.3, "c": 0.6})


def test_the_most_loaded_of_three_or_more_is_never_picked() -> None:
    snap = build_snapshot("m", THREE_PLUS["five, mixed"])
    assert "a" not in frequencies(snap)


def test_only_sites_with_room_take_part() -> None:
    views = [view("a", 10.0, 0.2), view("b", 20.0, 0.5), view("c", 30.0, 0.8),
             view("no-room", 500.0, 1.0), view("stale", 500.0, math.inf, stale=True),
             view("down", 500.0, 0.0, healthy=False)]
    assert_matches(frequencies(build_snapshot("m", views)), two_choice_probabilities(views[:3]))


def test_routes_name_the_rule() -> None:
    rng = random.Random(1234)
    outcome = pick(build_snapshot("m", THREE_PLUS["three, distinct rho"]), rng)
    assert isinstance(outcome, Route) and outcome.via == "two_choices" and outcome.model == "m"


# --- two with room -----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("a", "b"),
    [((30.0, 0.5), (10.0, 0.0)), ((10.0, 0.9), (10.0, 0.1)), ((1.0, 0.0), (100.0, 0.99))],
)
def test_two_weighted_by_capacity_over_one_plus_rho(a: tuple[float, float], b: tuple[float, float]) -> None:
    views = [view("a", *a), view("b", *b), view("no-room", 100.0, 1.5)]
    w_a = a[0] / (1 + a[1])
    w_b = b[0] / (1 + b[1])
    expected = {"a": w_a / (w_a + w_b), "b": w_b / (w_a + w_b)}
    assert_matches(frequencies(build_snapshot("m", views)), expected)


def test_two_exact_weights_example() -> None:
    # 30 / 1.5 = 20 against 10 / 1 = 10: a two thirds, b one third.
    observed = frequencies(build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.0)]))
    assert_matches(observed, {"a": 2 / 3, "b": 1 / 3})


# --- one with room ----------------------------------------------------------------------------

def test_single_site_with_room_is_taken() -> None:
    snap = build_snapshot("m", [view("only", 1.0, 0.99, local=True), view("big", 100.0, 1.0),
                                view("stale", 100.0, math.inf, stale=True)])
    rng = random.Random(1234)
    outcomes = {pick(snap, rng) for _ in range(1000)}
    assert outcomes == {Route("only", "p", "m", True, "single")}


# --- no site with room ----------------------------------------------------------------------

def test_no_room_picks_highest_capacity_not_full() -> None:
    snap = build_snapshot("m", [
        view("full-biggest", 100.0, 2.0, full=True),
        view("small", 10.0, 1.0),
        view("bigger", 40.0, 1.5),
    ])
    assert pick(snap, random.Random(1234)) == Route("bigger", "p", "m", False, "not_full")


def test_no_room_capacity_tie_goes_to_lower_queue_depth() -> None:
    snap = build_snapshot("m", [
        view("deep", 40.0, 1.1, queue_depth=7.0),
        view("shallow", 40.0, 1.9, queue_depth=2.0),
        view("small", 10.0, 1.0, queue_depth=0.0),
    ])
    assert pick(snap, random.Random(1234)) == Route("shallow", "p", "m", False, "not_full")


def test_every_healthy_site_full() -> None:
    snap = build_snapshot("m", [
        view("a", 40.0, 1.5, full=True, queue_depth=5.0),
        view("b", 40.0, 1.2, full=True, queue_depth=3.0),
        view("c", 10.0, 1.0, full=True, queue_depth=0.0),
        view("down", 400.0, 0.0, healthy=False),
    ])
    assert pick(snap, random.Random(1234)) == Full(Route("b", "p", "m", False, "full"))


# --- health and staleness --------------------------------------------------------------------

def test_excluded_site_never_picked_while_a_healthy_one_is_left() -> None:
    views = [view("down-best", 1000.0, 0.0, healthy=False), view("down-too", 1000.0, 0.0, healthy=False),
             view("a", 10.0, 0.5), view("b", 10.0, 0.6), view("c", 1.0, 0.99)]
    for keep in (views, views[:4], views[:3], [views[0], views[4]]):
        assert not {"down-best", "down-too"} & set(frequencies(build_snapshot("m", keep), 5000))
    every_full = [views[0], view("f", 1.0, 3.0, full=True)]
    outcome = pick(build_snapshot("m", every_full), random.Random(1234))
    assert isinstance(outcome, Full) and outcome.route.site == "f"


def test_none_healthy_is_503_and_no_candidates_is_404() -> None:
    snap = build_snapshot("m", [view("x", healthy=False), view("y", healthy=False)],
                          none_healthy_retry_after_s=7.0)
    assert pick(snap, random.Random(1234)) == NoneHealthy(retry_after_s=7.0, excluded=2)
    assert pick(build_snapshot("m", []), random.Random(1234)) == NoCandidates()


def test_stale_site_is_used_when_it_is_the_only_one() -> None:
    snap = build_snapshot("m", [view("stale", 5.0, math.inf, stale=True), view("down", healthy=False)])
    assert pick(snap, random.Random(1234)) == Route("stale", "p", "m", False, "stale")


def test_stale_site_loses_to_any_site_with_a_reading_not_full() -> None:
    stale = view("stale", 500.0, math.inf, stale=True)
    with_room = build_snapshot("m", [stale, view("a", 1.0, 0.9)])
    assert frequencies(with_room, 2000) == {"a": 1.0}
    busy = build_snapshot("m", [stale, view("busy", 1.0, 4.0)])
    assert pick(busy, random.Random(1234)) == Route("busy", "p", "m", False, "not_full")
    # A known-full site is worse than an unknown one: the stale site takes the request.
    full = build_snapshot("m", [stale, view("full", 100.0, 4.0, full=True)])
    assert pick(full, random.Random(1234)) == Route("stale", "p", "m", False, "stale")


# --- from raw batches to a pick and a shed decision -------------------------------------------

def test_learned_state_drives_pick_and_shedding() -> None:
    """Two sites learn their bounds, saturate with work waiting, and the model sheds."""
    learners = {"a": CapacityLearner(alpha=1.0), "b": CapacityLearner(alpha=1.0)}
    seq = {"a": 0, "b": 0}
    shed = ShedState(full_after_s=2.0, room_after_s=5.0)

    def ingest(now: float, loads: dict[str, LoadSignals]) -> OrderedSnapshot:
        views = []
        for site, load in loads.items():
            seq[site] += 1
            learners[site].observe(now, Revision(f"uid-{site}", 1, 1, seq[site], 2), load,
                                   complete=True, new_sample=True)
            views.append(candidate_view(site=site, provider="p", model="m", learner=learners[site], load=load,
                                        now=now, healthy=True, local=site == "a"))
        snap = build_snapshot("m", views)
        shed.observe(now, all_healthy_saturated=snap.all_full, any_sample_saturated=snap.any_full)
        return snap

    def epp(running: float, waiting: float) -> LoadSignals:
        return LoadSignals(ready_endpoints=2, avg_running=running, avg_waiting=waiting)

    # Idle: a learns soft 16, b soft 8; window worst = 1 at the peak itself, then both drop.
    ingest(0.0, {"a": epp(8.0, 0.0), "b": epp(4.0, 0.0)})
    snap = ingest(1.0, {"a": epp(4.0, 0.0), "b": epp(2.0, 0.0)})
    assert [v.capacity for v in snap.ordered] == [16.0, 8.0]
    assert snap.room == ()  # both still carry the rho-1 peak within the window
    assert pick(snap, random.Random(1234)) == Route("a", "p", "m", True, "not_full")
    # Work waits at both: hard bounds 12 and 6, rho 1, full.
    ingest(40.0, {"a": epp(5.0, 1.0), "b": epp(2.0, 1.0)})
    assert not shed.shedding(41.999)
    snap = ingest(42.0, {"a": epp(5.0, 1.0), "b": epp(2.0, 1.0)})
    assert snap.all_full
    assert pick(snap, random.Random(1234)) == Full(Route("a", "p", "m", True, "full"))
    assert shed.shedding(42.0)
