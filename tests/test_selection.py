"""Site selection (spec: Site Selection; DESIGN 5b; the two_choices rule of the routing-quality
issue), checked against exact probabilities.

Frequencies come from DRAWS seeded picks with random.Random(1234). Each observed frequency
must lie within 4 binomial standard deviations of its theoretical probability:
|f - p| <= 4 * sqrt(p * (1 - p) / DRAWS)  (about 0.014 at p = 0.5 for 20 000 draws).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import view

from gridd.core.capacity import CapacityLearner
from gridd.core.ordering import CandidateView, OrderedSnapshot, build_snapshot, candidate_view
from gridd.core.readings import LoadSignals, Revision
from gridd.core.selection import (
    PICK_RULES,
    Full,
    NoCandidates,
    NoneHealthy,
    PickRule,
    Route,
    pick,
    pick_chances,
)
from gridd.core.shedding import ShedState

DRAWS = 20_000


def frequencies(snap: OrderedSnapshot, draws: int = DRAWS,
                rule: PickRule = "two_choices") -> dict[str, float]:
    """How often each site is routed to (a Full pick counts its route)."""
    rng = random.Random(1234)
    counts: Counter[str] = Counter()
    for _ in range(draws):
        outcome = pick(snap, rng, rule=rule)
        if isinstance(outcome, Full):
            outcome = outcome.route
        assert isinstance(outcome, Route)
        counts[outcome.site] += 1
    return {site: n / draws for site, n in counts.items()}


def assert_matches(observed: dict[str, float], expected: dict[str, float], draws: int = DRAWS) -> None:
    assert set(observed) <= {s for s, p in expected.items() if p > 0}
    for site, p in expected.items():
        tolerance = 4 * math.sqrt(p * (1 - p) / draws)
        assert abs(observed.get(site, 0.0) - p) <= tolerance, (site, observed.get(site, 0.0), p, tolerance)


Rank = Callable[[CandidateView], tuple[float, ...]]


def by_rho(v: CandidateView) -> tuple[float, ...]:
    """spec_tiers among sites with room: the lower rho."""
    return (v.rho,)


def by_tier_then_rho(v: CandidateView) -> tuple[float, ...]:
    """two_choices (no pending load): room 0, not full 1, full 2, then the lower rho the
    candidate would read with this request (rho + 1 / capacity)."""
    return (2 if v.full else 0 if v.rho < 1.0 else 1, v.rho + 1.0 / v.capacity)


def less_backlogged(v: CandidateView) -> tuple[float, ...]:
    """spec_tiers with no room ("tied on queue depth"): less waiting per unit of capacity,
    then the lower rho."""
    return (v.queue_depth / v.capacity, v.rho)


def two_choice_probabilities(views: list[CandidateView], rank: Rank = by_rho) -> dict[str, float]:
    """Exact win probabilities of "two by capacity, take the better by ``rank``".

    Draws are ordered and without replacement, each proportional to capacity among the
    sites not yet drawn, so with T = sum of capacities:
        P(first = a, second = b) = (c_a / T) * (c_b / (T - c_a))
    The lower rank wins; on a tie the first drawn wins. Hence
        P(k) = sum_{j != k} [ P(k, j) * [rank_k <= rank_j] + P(j, k) * [rank_k < rank_j] ]
    and for distinct ranks, P(k) = sum_{j: rank_j > rank_k} (c_k c_j / T) (1/(T - c_k) + 1/(T - c_j)).
    """
    total = sum(v.capacity for v in views)
    p = dict.fromkeys((v.site for v in views), 0.0)
    for a in views:
        for b in views:
            if a is b:
                continue
            pair = (a.capacity / total) * (b.capacity / (total - a.capacity))
            winner = b if rank(b) < rank(a) else a
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


@pytest.mark.parametrize("rule", PICK_RULES)
@pytest.mark.parametrize("case", list(THREE_PLUS))
def test_three_or_more_two_by_capacity_lower_rho(case: str, rule: PickRule) -> None:
    """Every site with room: both rules draw two by capacity and take the lower rho (the
    spec's rule), two_choices the lower rho after this request (rho + 1 / capacity)."""
    views = THREE_PLUS[case]
    snap = build_snapshot("m", views)
    assert len(snap.room) == len(views)
    rank = by_rho if rule == "spec_tiers" else by_tier_then_rho
    assert_matches(frequencies(snap, rule=rule), two_choice_probabilities(views, rank))


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


@pytest.mark.parametrize("rule", PICK_RULES)
def test_the_most_loaded_of_three_or_more_is_never_picked(rule: PickRule) -> None:
    snap = build_snapshot("m", THREE_PLUS["five, mixed"])
    assert "a" not in frequencies(snap, rule=rule)


ROOM_AND_MORE = [view("a", 10.0, 0.2), view("b", 20.0, 0.5), view("c", 30.0, 0.8),
                 view("no-room", 500.0, 1.0), view("stale", 500.0, math.inf, stale=True),
                 view("down", 500.0, 0.0, healthy=False)]


def test_spec_tiers_only_sites_with_room_take_part() -> None:
    views = ROOM_AND_MORE
    assert_matches(frequencies(build_snapshot("m", views), rule="spec_tiers"),
                   two_choice_probabilities(views[:3]))


def test_two_choices_draws_over_every_fresh_site_and_a_site_with_room_wins() -> None:
    """A fresh site without room is drawn by its capacity but loses to any site with room:
    it is never picked, yet it changes the odds of the others. Stale and excluded sites are
    not drawn at all."""
    views = ROOM_AND_MORE
    expected = two_choice_probabilities(views[:4], by_tier_then_rho)
    assert expected["no-room"] == 0.0
    assert_matches(frequencies(build_snapshot("m", views)), expected)


@pytest.mark.parametrize(("rule", "via"), [("two_choices", "two_choices"), ("spec_tiers", "two_choices")])
def test_routes_name_the_rule(rule: PickRule, via: str) -> None:
    rng = random.Random(1234)
    outcome = pick(build_snapshot("m", THREE_PLUS["three, distinct rho"]), rng, rule=rule)
    assert isinstance(outcome, Route) and outcome.via == via and outcome.model == "m"


# --- two with room -----------------------------------------------------------------------

PAIRS = [((30.0, 0.5), (10.0, 0.0)), ((10.0, 0.9), (10.0, 0.1)), ((1.0, 0.0), (100.0, 0.99))]


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_spec_tiers_two_weighted_by_capacity_over_one_plus_rho(a: tuple[float, float],
                                                               b: tuple[float, float]) -> None:
    views = [view("a", *a), view("b", *b), view("no-room", 100.0, 1.5)]
    w_a = a[0] / (1 + a[1])
    w_b = b[0] / (1 + b[1])
    expected = {"a": w_a / (w_a + w_b), "b": w_b / (w_a + w_b)}
    assert_matches(frequencies(build_snapshot("m", views), rule="spec_tiers"), expected)


@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_two_choices_with_two_with_room(a: tuple[float, float], b: tuple[float, float]) -> None:
    views = [view("a", *a), view("b", *b), view("no-room", 100.0, 1.5)]
    assert_matches(frequencies(build_snapshot("m", views)), two_choice_probabilities(views, by_tier_then_rho))


def test_two_choices_with_exactly_two_fresh_takes_the_lower_rho_after_the_pick() -> None:
    # Two fresh sites are always both drawn: the lower rho after this request always wins
    # (0.1 + 1/10 = 0.2 against 0.5 + 1/30) ...
    assert frequencies(build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.1)]), 2000) == {"b": 1.0}
    # ... at equal rho the larger site (one request moves it less: 0.5 + 1/30 < 0.5 + 1/10) ...
    assert frequencies(build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.5)]), 2000) == {"a": 1.0}
    # ... and on a full tie (0.5 + 1/4 = 0.25 + 1/2) the first drawn, by capacity: 2 to 1.
    assert_matches(frequencies(build_snapshot("m", [view("a", 4.0, 0.5), view("b", 2.0, 0.25)])),
                   {"a": 2 / 3, "b": 1 / 3})


def test_spec_tiers_two_exact_weights_example() -> None:
    # 30 / 1.5 = 20 against 10 / 1 = 10: a two thirds, b one third.
    observed = frequencies(build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.0)]),
                           rule="spec_tiers")
    assert_matches(observed, {"a": 2 / 3, "b": 1 / 3})


# --- one with room ----------------------------------------------------------------------------

@pytest.mark.parametrize(("rule", "via"), [("two_choices", "two_choices"), ("spec_tiers", "single")])
def test_single_site_with_room_is_taken(rule: PickRule, via: str) -> None:
    snap = build_snapshot("m", [view("only", 1.0, 0.99, local=True), view("big", 100.0, 1.0),
                                view("stale", 100.0, math.inf, stale=True)])
    rng = random.Random(1234)
    outcomes = {pick(snap, rng, rule=rule) for _ in range(1000)}
    assert outcomes == {Route("only", "p", "m", True, via)}


# --- no site with room ----------------------------------------------------------------------

NO_ROOM = [
    view("full-biggest", 100.0, 2.0, full=True, queue_depth=50.0),
    view("deep", 40.0, 1.1, queue_depth=8.0),
    view("shallow", 40.0, 1.9, queue_depth=2.0),
    view("small", 10.0, 1.0, queue_depth=0.0),
]


def test_spec_tiers_no_room_two_not_full_by_capacity_the_less_backlogged() -> None:
    """"By capacity among sites not full, tied on queue depth": two drawn by capacity, the
    one with less waiting per unit of capacity (small 0, shallow 0.05, deep 0.2)."""
    snap = build_snapshot("m", NO_ROOM)
    expected = two_choice_probabilities(NO_ROOM[1:], less_backlogged)
    assert expected["deep"] == 0.0
    assert_matches(frequencies(snap, rule="spec_tiers"), expected)
    outcome = pick(snap, random.Random(1234), rule="spec_tiers")
    assert isinstance(outcome, Route) and outcome.via == "not_full"


def test_spec_tiers_no_room_equal_backlog_goes_to_the_lower_rho() -> None:
    snap = build_snapshot("m", [view("busier", 40.0, 1.9, queue_depth=4.0),
                                view("busy", 20.0, 1.2, queue_depth=2.0)])
    assert frequencies(snap, 2000, rule="spec_tiers") == {"busy": 1.0}


def test_two_choices_no_room_draws_over_every_fresh_site_a_full_one_never_wins() -> None:
    """No room: two fresh sites drawn by capacity, the one not full before the full one, then
    the lower rho (small 1.0, deep 1.1, shallow 1.9). The full site is drawn by its capacity
    but never wins a pair."""
    expected = two_choice_probabilities(NO_ROOM, by_tier_then_rho)
    assert expected["full-biggest"] == 0.0 and expected["shallow"] > 0.0
    assert_matches(frequencies(build_snapshot("m", NO_ROOM)), expected)


@pytest.mark.parametrize(
    ("views", "winner", "vias"),
    [
        ([view("f1", 50.0, 1.5, full=True), view("f2", 50.0, 1.2, full=True), view("r", 1.0, 0.5)],
         "r", {"two_choices"}),
        ([view("f1", 50.0, 1.5, full=True), view("f2", 50.0, 1.2, full=True), view("n", 1.0, 1.3)],
         "n", {"two_choices", "not_full"}),
    ],
    ids=["redraw from room", "redraw from not full"],
)
def test_two_choices_both_drawn_full_while_one_is_not_draws_again(views: list[CandidateView], winner: str,
                                                                  vias: set[str]) -> None:
    snap = build_snapshot("m", views)
    rng = random.Random(1234)
    outcomes = [pick(snap, rng) for _ in range(2000)]
    assert {o.site for o in outcomes if isinstance(o, Route)} == {winner}
    assert {o.via for o in outcomes if isinstance(o, Route)} == vias


EVERY_FULL = [
    view("a", 40.0, 1.5, full=True, queue_depth=5.0),
    view("b", 40.0, 1.2, full=True, queue_depth=3.0),
    view("c", 10.0, 1.0, full=True, queue_depth=1.0),
    view("down", 400.0, 0.0, healthy=False),
]


@pytest.mark.parametrize(("rule", "rank"),
                         [("spec_tiers", less_backlogged), ("two_choices", by_tier_then_rho)])
def test_every_healthy_site_full(rule: PickRule, rank: Rank) -> None:
    """Full, with the route to use when the model does not shed, drawn the same way."""
    snap = build_snapshot("m", EVERY_FULL)
    assert_matches(frequencies(snap, rule=rule), two_choice_probabilities(EVERY_FULL[:3], rank))
    outcome = pick(snap, random.Random(1234), rule=rule)
    assert isinstance(outcome, Full) and outcome.route.via == "full"


# --- health and staleness --------------------------------------------------------------------

@pytest.mark.parametrize("rule", PICK_RULES)
def test_excluded_site_never_picked_while_a_healthy_one_is_left(rule: PickRule) -> None:
    views = [view("down-best", 1000.0, 0.0, healthy=False), view("down-too", 1000.0, 0.0, healthy=False),
             view("a", 10.0, 0.5), view("b", 10.0, 0.6), view("c", 1.0, 0.99)]
    for keep in (views, views[:4], views[:3], [views[0], views[4]]):
        assert not {"down-best", "down-too"} & set(frequencies(build_snapshot("m", keep), 5000, rule=rule))
    every_full = [views[0], view("f", 1.0, 3.0, full=True)]
    outcome = pick(build_snapshot("m", every_full), random.Random(1234), rule=rule)
    assert isinstance(outcome, Full) and outcome.route.site == "f"


@pytest.mark.parametrize("rule", PICK_RULES)
def test_none_healthy_is_503_and_no_candidates_is_404(rule: PickRule) -> None:
    snap = build_snapshot("m", [view("x", healthy=False), view("y", healthy=False)],
                          none_healthy_retry_after_s=7.0)
    assert pick(snap, random.Random(1234), rule=rule) == NoneHealthy(retry_after_s=7.0, excluded=2)
    assert pick(build_snapshot("m", []), random.Random(1234), rule=rule) == NoCandidates()


@pytest.mark.parametrize("rule", PICK_RULES)
def test_stale_sites_are_drawn_by_capacity_when_no_fresh_one_is_left(rule: PickRule) -> None:
    snap = build_snapshot("m", [view("stale", 5.0, math.inf, stale=True), view("down", healthy=False)])
    assert pick(snap, random.Random(1234), rule=rule) == Route("stale", "p", "m", False, "stale")
    two = build_snapshot("m", [view("s1", 30.0, math.inf, stale=True),
                               view("s2", 10.0, math.inf, stale=True)])
    assert_matches(frequencies(two, rule=rule), {"s1": 0.75, "s2": 0.25})


@pytest.mark.parametrize("rule", PICK_RULES)
def test_stale_site_loses_to_every_fresh_site_even_a_full_one(rule: PickRule) -> None:
    """Preference: room, not full, full, then no fresh signal (routing-quality issue, cause 5)."""
    stale = view("stale", 500.0, math.inf, stale=True)
    with_room = build_snapshot("m", [stale, view("a", 1.0, 0.9)])
    assert frequencies(with_room, 2000, rule=rule) == {"a": 1.0}
    busy = build_snapshot("m", [stale, view("busy", 1.0, 4.0)])
    assert frequencies(busy, 2000, rule=rule) == {"busy": 1.0}
    # A site known full is preferred to one with no reading: Full, routed to the full site
    # when the model does not shed.
    full = build_snapshot("m", [stale, view("full", 100.0, 4.0, full=True)])
    assert pick(full, random.Random(1234), rule=rule) == Full(Route("full", "p", "m", False, "full"))


# --- from raw batches to a pick and a shed decision -------------------------------------------

def test_learned_state_drives_pick_and_shedding() -> None:
    """Two sites (4 and 2 endpoints) route 2:1 from their first batch, saturate with queues as
    deep as their batches, and the model sheds; it routes again room_after_s after one site
    stopped being full, while the other still is."""
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
        shed.observe(now, all_full=snap.all_full)
        return snap

    def epp(endpoints: int, running: float, waiting: float) -> LoadSignals:
        return LoadSignals(ready_endpoints=endpoints, avg_running=running, avg_waiting=waiting)

    # Light load, one request per endpoint: capacities 4 x 8 and 2 x 8 (the prior), rho 1/8
    # each; equal rho, so the one request moves the larger site less: a (without pending
    # sends; with them, a store routes 2:1, test_routing_regressions cause 3).
    snap = ingest(0.0, {"a": epp(4, 1.0, 0.0), "b": epp(2, 1.0, 0.0)})
    assert [v.capacity for v in snap.ordered] == [32.0, 16.0]
    assert len(snap.room) == 2
    assert frequencies(snap, 2000) == {"a": 1.0}
    # Queues as deep as the batches everywhere: limits of 6 and 5 per unit, rho 2, full.
    ingest(40.0, {"a": epp(4, 6.0, 6.0), "b": epp(2, 5.0, 5.0)})
    assert not shed.shedding(41.999)
    snap = ingest(42.0, {"a": epp(4, 6.0, 6.0), "b": epp(2, 5.0, 5.0)})
    assert snap.all_full
    assert [v.capacity for v in snap.ordered] == [24.0, 10.0]
    assert isinstance(pick(snap, random.Random(1234)), Full)
    assert shed.shedding(42.0)
    # b drains while a stays full: b is no longer full (still no room: its rho-2 sample is
    # in the window), so picks go to b and shedding ends 5 s into the relief.
    snap = ingest(43.0, {"a": epp(4, 6.0, 6.0), "b": epp(2, 0.0, 0.0)})
    assert not snap.all_full and [v.site for v in snap.not_full.candidates] == ["b"]
    assert frequencies(snap, 2000) == {"b": 1.0}
    ingest(44.0, {"a": epp(4, 6.0, 6.0), "b": epp(2, 0.0, 0.0)})
    assert shed.shedding(47.999)
    assert not shed.shedding(48.0)


# -- pick_chances (gridctl explain) is pick() in closed form ------------------------------------


class _GridRng:
    """Feeds each pick() the midpoint of one cell of an n x n grid over [0, 1)^2 as its first
    two draws (any further draw, a second pair, comes from a seeded generator): the
    frequencies converge on pick()'s exact probabilities as n grows."""

    def __init__(self) -> None:
        self.draws: list[float] = []
        self._more = random.Random(7)

    def random(self) -> float:
        return self.draws.pop(0) if self.draws else self._more.random()


def _grid_frequencies(snapshot: OrderedSnapshot, rule: PickRule, extra, n: int = 100) -> dict:
    rng = _GridRng()
    counts: Counter = Counter()
    for i in range(n):
        for j in range(n):
            rng.draws = [(i + 0.5) / n, (j + 0.5) / n]
            outcome = pick(snapshot, rng, rule=rule, extra_rho=extra)  # type: ignore[arg-type]
            if isinstance(outcome, Full):
                outcome = outcome.route
            counts[(outcome.site, outcome.provider)] += 1
    return {key: c / (n * n) for key, c in counts.items()}


_view = st.builds(
    lambda i, capacity, rho, full: CandidateView(f"s{i}", "p", "m", capacity, rho, full=full and rho >= 1.0),
    st.integers(0, 0), st.sampled_from([1.0, 2.0, 4.0, 8.0, 16.0]),
    st.sampled_from([0.1, 0.5, 0.9, 1.2, 2.0]), st.booleans())


@settings(max_examples=15, deadline=None)
@given(views=st.lists(_view, min_size=1, max_size=5), rule=st.sampled_from(PICK_RULES),
       pending=st.sampled_from([0.0, 0.3]))
def test_pick_chances_are_the_frequencies_pick_draws(views, rule, pending) -> None:
    views = [CandidateView(f"s{i}", v.provider, v.model, v.capacity, v.rho, full=v.full)
             for i, v in enumerate(views)]
    snapshot = build_snapshot("m", views)
    extra = (lambda view: pending if view.site == "s0" else 0.0) if pending else None
    chances = pick_chances(snapshot, rule=rule, extra_rho=extra)
    assert sum(chances.values()) == pytest.approx(1.0)
    frequencies = _grid_frequencies(snapshot, rule, extra)
    assert set(frequencies) <= set(chances)
    for key, p in chances.items():
        assert frequencies.get(key, 0.0) == pytest.approx(p, abs=0.02), key
