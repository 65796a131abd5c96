"""Shedding timers (spec: Site Selection, availability.shedding), with exact boundaries."""

from __future__ import annotations

import pytest

from gridd.core.shedding import DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS, ShedState

EPS = 1e-6
FULL = 2.0
ROOM = 5.0


def saturated(state: ShedState, now: float) -> None:
    state.observe(now, all_healthy_saturated=True, any_sample_saturated=True)


def partly(state: ShedState, now: float) -> None:
    """Some site saturated with work waiting, not every healthy one."""
    state.observe(now, all_healthy_saturated=False, any_sample_saturated=True)


def clear(state: ShedState, now: float) -> None:
    state.observe(now, all_healthy_saturated=False, any_sample_saturated=False)


def shedding_state(start: float = 100.0) -> ShedState:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    saturated(state, start)
    assert state.shedding(start + FULL)
    return state


def test_defaults() -> None:
    state = ShedState()
    assert (DEFAULT_FULL_AFTER_MS, DEFAULT_ROOM_AFTER_MS) == (2000, 5000)
    saturated(state, 0.0)
    assert not state.shedding(2.0 - EPS)
    assert state.shedding(2.0)


def test_sheds_exactly_full_after_s_into_a_saturated_run() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    assert not state.shedding(100.0)
    saturated(state, 100.0)
    assert not state.shedding(100.0)
    saturated(state, 101.0)
    assert not state.shedding(102.0 - EPS)
    assert state.shedding(102.0)


def test_the_transition_is_also_taken_by_an_observation_at_the_boundary() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    saturated(state, 100.0)
    saturated(state, 102.0)
    assert state.shedding(102.0)


def test_a_break_in_the_run_restarts_the_timer() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    saturated(state, 100.0)
    partly(state, 101.0)  # one healthy site had room or no work waiting
    saturated(state, 101.5)
    assert not state.shedding(103.5 - EPS)
    assert state.shedding(103.5)


def test_some_saturated_sites_never_shed() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    for t in range(100, 200):
        partly(state, float(t))
    assert not state.shedding(200.0)


def test_routes_again_exactly_room_after_s_after_the_last_saturated_sample() -> None:
    state = shedding_state()
    partly(state, 103.0)  # still a saturated sample, not every site: keeps shedding
    clear(state, 104.0)
    clear(state, 105.0)
    assert state.shedding(108.0 - EPS)
    assert not state.shedding(108.0)


def test_a_saturated_sample_while_shedding_extends_it() -> None:
    state = shedding_state()
    clear(state, 103.0)
    partly(state, 104.0)  # before the room timer (105) ran out
    assert state.shedding(105.0)
    assert state.shedding(109.0 - EPS)
    assert not state.shedding(109.0)


def test_silence_while_shedding_counts_as_no_saturated_sample() -> None:
    state = shedding_state()
    # No ingest at all after the run's single observation at 100.
    assert state.shedding(105.0 - EPS)
    assert not state.shedding(105.0)


def test_shedding_again_needs_a_new_full_run() -> None:
    state = shedding_state()
    assert not state.shedding(105.0)
    saturated(state, 120.0)
    assert not state.shedding(122.0 - EPS)
    assert state.shedding(122.0)


def test_observation_exactly_at_room_boundary_reenters_the_run() -> None:
    state = shedding_state()
    # At 105 the model routes again (no saturated sample in [100, 105)); the saturated
    # sample taken at 105 starts a new run.
    saturated(state, 105.0)
    assert not state.shedding(105.0)
    assert not state.shedding(107.0 - EPS)
    assert state.shedding(107.0)


def test_zero_full_after_sheds_on_the_first_saturated_ingest() -> None:
    state = ShedState(full_after_s=0.0, room_after_s=ROOM)
    saturated(state, 10.0)
    assert state.shedding(10.0)


def test_retry_after_is_the_time_until_the_state_can_change() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=ROOM)
    assert state.retry_after_s(0.0) == FULL  # no run under way
    saturated(state, 100.0)
    assert state.retry_after_s(100.5) == 1.5
    assert state.retry_after_s(101.5) == 1.0  # 0.5 clamped up to 1 s
    assert state.shedding(102.0)
    assert state.retry_after_s(102.0) == 3.0  # room at 105
    partly(state, 103.0)
    assert state.retry_after_s(103.0) == ROOM
    assert state.retry_after_s(107.5) == 1.0


def test_retry_after_clamped_to_a_minute() -> None:
    state = ShedState(full_after_s=FULL, room_after_s=600.0)
    saturated(state, 0.0)
    assert state.shedding(2.0)
    assert state.retry_after_s(2.0) == 60.0
    assert state.retry_after_s(550.0) == 50.0


@pytest.mark.parametrize(
    "kwargs",
    [{"full_after_s": -1.0}, {"room_after_s": 0.0}, {"room_after_s": float("inf")}, {"full_after_s": float("nan")}],
)
def test_knob_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ShedState(**kwargs)
