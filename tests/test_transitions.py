"""gridd.core.transitions: one log line per state change, at most `burst` per target per
window, and the first line allowed again reports the current state and what went unlogged."""

from __future__ import annotations

import pytest

from gridd.core.transitions import Transition, TransitionLog


def run(log: TransitionLog, observations: list[tuple[float, str]], *, baseline: str | None = None):
    return [(now, line) for now, state in observations
            if (line := log.observe("t", state, now, baseline=baseline)) is not None]


def test_one_line_per_change_never_per_observation():
    log = TransitionLog()
    lines = run(log, [(0, "up"), (1, "up"), (2, "down (timeout)"), (3, "down (timeout)"),
                      (4, "down (identity)"), (5, "up"), (6, "up")])
    assert lines == [
        (0, Transition("t", None, "up")),
        (2, Transition("t", "up", "down (timeout)")),
        (4, Transition("t", "down (timeout)", "down (identity)")),
        (5, Transition("t", "down (identity)", "up")),
    ]


def test_the_baseline_needs_no_line_at_first_sight():
    assert run(TransitionLog(), [(0, "ok"), (1, "ok")], baseline="ok") == []
    assert run(TransitionLog(), [(0, "failing (timeout)"), (1, "ok")], baseline="ok") == [
        (0, Transition("t", "ok", "failing (timeout)")),
        (1, Transition("t", "failing (timeout)", "ok")),
    ]


def test_a_flapping_target_logs_burst_lines_per_window_then_one_summary():
    log = TransitionLog(burst=4, window_s=60.0)
    # Up/down every 5 s for two minutes: 24 changes.
    flaps = [(5.0 * i, "down (connect)" if i % 2 else "up") for i in range(25)]
    lines = run(log, flaps)
    assert [now for now, _ in lines] == [0.0, 5.0, 10.0, 15.0, 60.0, 65.0, 70.0, 75.0, 120.0]
    assert [line.unlogged for _, line in lines] == [0, 0, 0, 0, 8, 0, 0, 0, 8]
    # +60: the +0 line left the window. The +15 line said "down"; +60 is "up", after 9
    # changes (+20 ... +60), of which this line reports one: 8 went unlogged.
    assert lines[4][1] == Transition("t", "down (connect)", "up", 8)
    assert lines[4][1].suffix() == " (8 more changes not logged: flapping)"


def test_the_log_ends_on_the_truth_even_when_the_state_came_back():
    log = TransitionLog(burst=1, window_s=10.0)
    lines = run(log, [(0, "down"), (1, "up"), (2, "down"), (9.9, "down"), (10.0, "down"), (11, "down")])
    # +1 and +2 held back; at +10 the window has room: still "down" as last logged, and the
    # two changes in between are reported.
    assert lines == [(0, Transition("t", None, "down")), (10.0, Transition("t", "down", "down", 2))]


def test_targets_have_their_own_budgets_and_can_be_forgotten():
    log = TransitionLog(burst=1, window_s=60.0)
    assert log.observe("a", "down", 0) is not None
    assert log.observe("b", "down", 0) is not None
    assert log.observe("a", "up", 1) is None
    log.forget("a")
    assert log.observe("a", "up", 2) == Transition("a", None, "up")


@pytest.mark.parametrize(("burst", "window_s"), [(0, 60.0), (1, 0.0), (1, -1.0)])
def test_a_budget_must_allow_a_line(burst, window_s):
    with pytest.raises(ValueError, match="burst must be >= 1 and window_s > 0"):
        TransitionLog(burst=burst, window_s=window_s)


def test_a_transition_is_frozen_and_has_no_room_for_other_fields():
    line = Transition("peer b", "up", "down")
    with pytest.raises(AttributeError):
        line.new = "up"  # type: ignore[misc]  # assigning to a frozen field must fail at runtime
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        Transition("peer b", "up", "down", unlogged=0, extra=1)  # type: ignore[call-arg]  # the point
    assert not hasattr(line, "__dict__")  # slots: no attribute can be added either
