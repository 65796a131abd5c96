"""Shedding timers (spec: Site Selection, availability.shedding; the end-of-shedding rule of the
routing-quality issue), with exact boundaries."""

from __future__ import annotations

import pytest

from gridd.core.shedding import DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS, ShedState

EPS = 1e-6
FULL = 2.0
ROOM = 5.0


def full(state: ShedState, now: float) -> None:
    """Every fresh healthy site full."""
    state.observe(now, all_full=True)


def relief(state: ShedState, now: float) -> None:
    """Some fresh healthy site not full (others may still be full)."""
    state.observe(now, all_full=False)


def shedding_state(start: float = 100.0) -> ShedState:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    full(state, start)
    assert state.shedding(start + FULL)
    return state


def test_defaults() -> None:
    state = ShedState()
    assert (DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS) == (5000, 5000)
    full(state, 0.0)
    assert not state.shedding(5.0 - EPS)
    assert state.shedding(5.0)


def test_sheds_exactly_full_after_s_into_a_full_run() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    assert not state.shedding(100.0)
    full(state, 100.0)
    assert not state.shedding(100.0)
    full(state, 101.0)
    assert not state.shedding(102.0 - EPS)
    assert state.shedding(102.0)


def test_the_transition_is_also_taken_by_an_observation_at_the_boundary() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    full(state, 100.0)
    full(state, 102.0)
    assert state.shedding(102.0)


def test_a_break_in_the_run_restarts_the_timer() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    full(state, 100.0)
    relief(state, 101.0)  # one healthy site was not full
    full(state, 101.5)
    assert not state.shedding(103.5 - EPS)
    assert state.shedding(103.5)


def test_some_full_sites_never_shed() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    for t in range(100, 200):
        relief(state, float(t))
    assert not state.shedding(200.0)


def test_routes_again_exactly_room_after_s_into_relief_while_another_site_stays_full() -> None:
    """Cause 4 of the routing-quality issue: one site full throughout no longer keeps the
    model shedding. Relief (some fresh healthy site not full) observed from 103 on ends
    shedding at 108, though a full site was seen at every observation (the old rule, "no
    sample full for room_after_s", would shed for as long as that site stayed full)."""
    state = shedding_state()
    for t in (103.0, 104.0, 105.0, 106.0, 107.0):
        relief(state, t)
    assert state.shedding(108.0 - EPS)
    assert not state.shedding(108.0)


def test_an_all_full_observation_ends_the_relief_run() -> None:
    state = shedding_state()
    relief(state, 103.0)
    full(state, 104.0)  # before the room timer (108) ran out: every site full again
    relief(state, 105.0)  # a new relief run
    assert state.shedding(108.0)
    assert state.shedding(110.0 - EPS)
    assert not state.shedding(110.0)


def test_silence_is_not_relief() -> None:
    """Without an observation nothing is known to have room: the model keeps shedding. (The
    store re-scores after every poll, failed ones too, so a silent site goes stale and an
    observation without any fresh full site follows; see test_store.py.)"""
    state = shedding_state()
    assert state.shedding(1000.0)
    assert state.retry_after_s(1000.0) == ROOM
    relief(state, 1000.0)
    assert state.shedding(1005.0 - EPS)
    assert not state.shedding(1005.0)


def test_shedding_again_needs_a_new_full_run() -> None:
    state = shedding_state()
    relief(state, 103.0)
    assert not state.shedding(108.0)
    full(state, 120.0)
    assert not state.shedding(122.0 - EPS)
    assert state.shedding(122.0)


def test_observation_exactly_at_room_boundary_reenters_the_run() -> None:
    state = shedding_state()
    relief(state, 103.0)
    # At 108 the model routes again (relief since 103); the full observation taken at 108
    # starts a new run.
    full(state, 108.0)
    assert not state.shedding(108.0)
    assert not state.shedding(110.0 - EPS)
    assert state.shedding(110.0)


def test_zero_full_after_sheds_on_the_first_full_ingest() -> None:
    state = ShedState(full_after_s=0.0, room_after_s=ROOM)
    full(state, 10.0)
    assert state.shedding(10.0)


def test_retry_after_is_the_time_until_the_state_can_change() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    assert state.retry_after_s(0.0) == FULL  # no run under way
    full(state, 100.0)
    assert state.retry_after_s(100.5) == 1.5
    assert state.retry_after_s(101.5) == 1.0  # 0.5 clamped up to 1 s
    assert state.shedding(102.0)
    assert state.retry_after_s(102.0) == ROOM  # every site still full: a whole room timer
    full(state, 103.0)
    assert state.retry_after_s(103.0) == ROOM
    relief(state, 104.0)
    assert state.retry_after_s(104.0) == ROOM
    assert state.retry_after_s(106.5) == 2.5
    assert state.retry_after_s(108.5) == 1.0


def test_retry_after_clamped_to_a_minute() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=600.0)
    full(state, 0.0)
    assert state.shedding(2.0)
    assert state.retry_after_s(2.0) == 60.0
    relief(state, 2.0)
    assert state.retry_after_s(552.0) == 50.0


def test_retune_keeps_the_runs() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    full(state, 100.0)
    state.retune(full_after_s=1.0, room_after_s=10.0)
    assert not state.shedding(101.0 - EPS)
    assert state.shedding(101.0)  # the run since 100 counts against the new timer
    relief(state, 102.0)
    assert state.shedding(112.0 - EPS)
    assert not state.shedding(112.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"full_after_s": -1.0}, {"room_after_s": 0.0}, {"room_after_s": float("inf")}, {"full_after_s": float("nan")}],
)
def test_knob_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ShedState(**kwargs)
