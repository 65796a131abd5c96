"""Pending load: this gateway's own sends that a candidate's reading cannot show yet
(gridd/core/pending.py), how GatewayStore.decide records them, and how the two_choices pick
reads them: a candidate's rho is raised by pending_weight x sends since its reading / capacity.
"""

from __future__ import annotations

import random

import pytest
from support import WALL, BatchFeed, load, store, view

from gridd.core.decisions import Forward, Unavailable
from gridd.core.ordering import build_snapshot
from gridd.core.pending import DEFAULT_PENDING_WEIGHT, RecentSends
from gridd.core.selection import pick
from gridd.core.store import GatewayStore

KEY = ("b", "llama")


def test_default_weight() -> None:
    assert DEFAULT_PENDING_WEIGHT == 4.0


SINCE_CASES = [
    # (t, sends strictly after t) for sends at 1.0, 2.0, 2.0, 3.5
    (0.0, 4), (1.0, 3), (1.999, 3), (2.0, 1), (3.499, 1), (3.5, 0), (10.0, 0),
]


@pytest.mark.parametrize(("t", "expected"), SINCE_CASES)
def test_since_counts_sends_strictly_after_t(t: float, expected: int) -> None:
    sends = RecentSends(horizon_s=20.0)
    for at in (1.0, 2.0, 2.0, 3.5):
        sends.record(KEY, at)
    assert sends.since(KEY, t) == expected
    assert sends.since(("c", "llama"), t) == 0


def test_sends_past_the_horizon_are_dropped_once_the_oldest_is_twice_that_old() -> None:
    sends = RecentSends(horizon_s=10.0)
    for at in (0.0, 5.0, 15.0, 20.0):  # at 20 the oldest is exactly 2 x 10 old: kept
        sends.record(KEY, at)
    assert sends.since(KEY, -1.0) == 4
    sends.record(KEY, 20.5)  # now older than 2 x 10: everything at or before 10.5 goes
    assert sends.since(KEY, -1.0) == 3
    assert sends.since(KEY, 14.999) == 3


def test_forget_and_retune() -> None:
    sends = RecentSends(horizon_s=10.0)
    sends.record(KEY, 0.0)
    sends.record(("c", "llama"), 0.0)
    sends.forget(KEY)
    sends.forget(("never", "sent"))
    assert sends.since(KEY, -1.0) == 0 and sends.since(("c", "llama"), -1.0) == 1
    sends.retune(1.0)
    sends.record(("c", "llama"), 2.5)  # the oldest is past 2 x the new horizon: pruned
    assert sends.since(("c", "llama"), -1.0) == 1


# --- through the store ------------------------------------------------------------------------

def two_sites(feed: BatchFeed | None = None, **knobs: object) -> GatewayStore:
    """b and c, two endpoints each (capacity 16, the prior), in flight 4 and 6: rho 0.25 and
    0.375, exact in binary so the picks below never tie."""
    s = store(**knobs)
    feed = feed or BatchFeed()
    s.ingest([feed.batch("b", ld=load(running=2.0)), feed.batch("c", ld=load(running=3.0))],
             now=0.0, now_wall=WALL)
    assert [(v.site, v.capacity, v.rho) for v in s.snapshots["m"].ordered] == [("b", 16.0, 0.25),
                                                                               ("c", 16.0, 0.375)]
    return s


def picks(s: GatewayStore, times: list[float]) -> list[str]:
    rng = random.Random(7)
    out = []
    for t in times:
        d = s.decide("m", now=t, rng=rng)
        assert isinstance(d, Forward), d
        out.append(d.site)
    return out


def test_decide_records_each_forward_and_nothing_else() -> None:
    s = two_sites()
    sites = picks(s, [0.1 * i for i in range(1, 11)])
    assert s.sends.since(("b", "llama"), 0.0) == sites.count("b")
    assert s.sends.since(("c", "llama"), 0.0) == sites.count("c")


def test_two_choices_reads_each_send_as_pending_weight_over_capacity() -> None:
    """rho + 4 x sends / 16: b 0.25, 0.5, 0.75 ... against c 0.375, 0.625 ...: they alternate,
    whatever the draw order (two fresh sites are always both drawn)."""
    s = two_sites()
    assert picks(s, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == ["b", "c", "b", "c", "b", "c"]
    b = s.snapshots["m"].ordered[0]
    assert s.pending_rho(0.6)(b) == DEFAULT_PENDING_WEIGHT * 3 / 16.0


def test_pending_weight_zero_turns_it_off() -> None:
    s = two_sites(pending_weight=0.0)
    assert picks(s, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == ["b"] * 6
    assert s.sends.since(("b", "llama"), 0.0) == 6  # still recorded


def test_pending_weight_scales_the_count() -> None:
    # Weight 1.5: each send adds 1.5 / 16 = 0.09375; b 0.25, 0.34375 stay below c 0.375, then
    # b 0.4375 against c 0.375, c 0.46875 against b 0.4375, ...
    s = two_sites(pending_weight=1.5)
    assert picks(s, [0.1, 0.2, 0.3, 0.4, 0.5]) == ["b", "b", "c", "b", "c"]


def test_only_sends_after_the_reading_was_taken_count() -> None:
    feed = BatchFeed()
    s = two_sites(feed)
    assert picks(s, [0.5, 1.0, 1.5]) == ["b", "c", "b"]
    b = s.snapshots["m"].ordered[0]
    assert s.pending_rho(1.5)(b) == 4 * 2 / 16.0
    # A new reading of b, taken at 1.2 (2.8 s old when it arrives at 4.0): the send at 0.5 is
    # in it, the one at 1.5 is not.
    s.ingest([feed.batch("b", ld=load(running=2.0), age_s=2.8)], now=4.0, now_wall=WALL)
    b = next(v for v in s.snapshots["m"].ordered if v.site == "b")
    assert b.capacity == 16.0
    assert s.pending_rho(4.0)(b) == 4 * 1 / 16.0
    # A send exactly at the instant the reading was taken is counted as in it.
    assert s.sends.since(("b", "llama"), 1.5) == 0


def test_a_forgotten_candidate_has_no_pending_sends() -> None:
    s = two_sites()
    assert picks(s, [0.1]) == ["b"]
    b = s.snapshots["m"].ordered[0]
    assert s.pending_rho(0.1)(b) == 4 / 16.0
    s.ingest([], now=1.0, now_wall=WALL, removed=[("b", "llama")])
    assert s.sends.since(("b", "llama"), 0.0) == 0
    assert s.pending_rho(1.0)(b) == 0.0


def test_spec_tiers_keeps_the_specs_rule_without_pending_load() -> None:
    snap = build_snapshot("m", [view("a", 30.0, 0.5), view("b", 10.0, 0.0)])
    with_pending = [pick(snap, random.Random(seed), rule="spec_tiers", extra_rho=lambda v: 10.0)
                    for seed in range(200)]
    without = [pick(snap, random.Random(seed), rule="spec_tiers") for seed in range(200)]
    assert with_pending == without
    assert [pick(snap, random.Random(seed), extra_rho=lambda v: 10.0 if v.site == "b" else 0.0).site
            for seed in range(50)] == ["a"] * 50  # two_choices reads it


def test_no_pending_for_an_answer_that_is_not_a_forward() -> None:
    s = store()
    s.ingest([BatchFeed().batch("b", ready=False)], now=0.0, now_wall=WALL)
    assert isinstance(s.decide("m", now=0.5, rng=random.Random(1)), Unavailable)
    assert s.sends.since(KEY, -1.0) == 0
