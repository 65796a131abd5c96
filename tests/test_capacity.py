"""Capacity learning, rho and the recent-worst window (spec: Site Selection, Provider revisions)."""

from __future__ import annotations

import pytest

from gridd.core.capacity import (
    CapacityLearner,
    gateway_in_flight,
    nothing_queued,
    queue_depth,
    saturated_with_work_waiting,
    serving_units,
    work_waiting,
)
from gridd.core.readings import LoadSignals, Revision, UnitLoad


def rev(seq: int, *, uid: str = "u1", gen: int = 7, epoch: int = 1, samples: int = 3) -> Revision:
    return Revision(provider_uid=uid, generation=gen, publisher_epoch=epoch, batch_sequence=seq,
                    batch_samples=samples)


def epp(running: float, waiting: float = 0.0, *, ready: int = 2, flow: float = 0.0,
        kv: float | None = None, spread: float | None = None, queue_full: int = 0) -> LoadSignals:
    return LoadSignals(ready_endpoints=ready, avg_running=running, avg_waiting=waiting, flow_queue=flow,
                       kv_mean=kv, kv_spread=spread, queue_full_units=queue_full)


class Feed:
    """Drives one learner with consecutive sequences of one revision identity."""

    def __init__(self, learner: CapacityLearner) -> None:
        self.learner = learner
        self.seq = 0

    def __call__(self, now: float, load: LoadSignals, *, uid: str = "u1", gen: int = 7, epoch: int = 1,
                 samples: int = 3, complete: bool = True) -> None:
        self.seq += 1
        self.learner.observe(now, rev(self.seq, uid=uid, gen=gen, epoch=epoch, samples=samples), load,
                             complete=complete, new_sample=True)


# --- in-flight and the waiting tests ------------------------------------------------------

IN_FLIGHT_CASES = [
    # (case, load, expected in-flight)
    ("epp pool", epp(3.0, 1.0, ready=4, flow=2.0), (3.0 + 1.0) * 4 + 2.0),
    ("epp, nothing waiting", epp(2.5, 0.0, ready=2), 5.0),
    ("waiting not exposed counts as none", LoadSignals(ready_endpoints=2, avg_running=3.0), 6.0),
    ("vllm direct: engines sampled are the units",
     LoadSignals(units=(UnitLoad("e0", 2.0, 1.0), UnitLoad("e1", 4.0, 1.0)), avg_running=3.0, avg_waiting=1.0),
     8.0),
    ("zero ready endpoints: averages frozen", epp(3.0, 1.0, ready=0, flow=2.0), None),
    ("no running average", LoadSignals(ready_endpoints=2, avg_waiting=1.0), None),
    ("unit count unknown", LoadSignals(avg_running=3.0, avg_waiting=0.0), None),
]


@pytest.mark.parametrize(("case", "load", "expected"), IN_FLIGHT_CASES, ids=[c[0] for c in IN_FLIGHT_CASES])
def test_gateway_in_flight(case: str, load: LoadSignals, expected: float | None) -> None:
    assert gateway_in_flight(load) == expected


def test_serving_units_prefers_ready_endpoints_over_sampled_units() -> None:
    load = LoadSignals(ready_endpoints=5, units=(UnitLoad("a"), UnitLoad("b")))
    assert serving_units(load) == 5
    assert serving_units(LoadSignals(units=(UnitLoad("a"), UnitLoad("b")))) == 2
    assert serving_units(LoadSignals()) is None


WAITING_CASES = [
    # (case, load, work_waiting, nothing_queued)
    ("idle", epp(1.0, 0.0), False, True),
    ("unit queue", epp(1.0, 0.5), True, False),
    ("flow control holds work", epp(1.0, 0.0, flow=1.0), True, False),
    ("a unit queue at its limit", epp(1.0, 0.0, queue_full=1), True, False),
    ("per-unit waiting only", LoadSignals(units=(UnitLoad("a", 1.0, 0.0), UnitLoad("b", 1.0, 2.0))), True, False),
    ("waiting unexposed proves nothing", LoadSignals(ready_endpoints=2, avg_running=1.0), False, False),
]


@pytest.mark.parametrize(("case", "load", "waiting", "empty"), WAITING_CASES, ids=[c[0] for c in WAITING_CASES])
def test_work_waiting_and_nothing_queued(case: str, load: LoadSignals, waiting: bool, empty: bool) -> None:
    assert work_waiting(load) is waiting
    assert nothing_queued(load) is empty


def test_queue_depth_counts_unit_queues_and_flow_control() -> None:
    assert queue_depth(epp(1.0, 1.5, ready=4, flow=3.0)) == 9.0
    assert queue_depth(LoadSignals(units=(UnitLoad("a", waiting=2.0), UnitLoad("b")), flow_queue=1.0)) == 3.0
    assert queue_depth(None) == 0.0


def test_saturated_with_work_waiting_needs_both() -> None:
    assert saturated_with_work_waiting(1.0, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(0.99, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(1.5, epp(1.0, 0.0))
    assert not saturated_with_work_waiting(None, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(1.5, None)


# --- bounds -------------------------------------------------------------------------------

def test_soft_bound_is_the_most_in_flight_seen_with_nothing_queued() -> None:
    feed = Feed(CapacityLearner())
    feed(0.0, epp(4.0))  # 8
    feed(1.0, epp(6.0))  # 12
    feed(2.0, epp(5.0))  # 10
    feed(3.0, epp(9.0, 1.0))  # 20, but work waiting: not a soft sample
    assert feed.learner.soft_bound == 12.0
    assert feed.learner.hard_bound == 20.0
    assert feed.learner.bound == 12.0


def test_hard_bound_is_the_least_in_flight_seen_while_work_waited() -> None:
    feed = Feed(CapacityLearner())
    feed(0.0, epp(8.0, 2.0))  # 20
    feed(1.0, epp(6.0, 1.0))  # 14
    feed(2.0, epp(7.0, 1.0))  # 16
    feed(3.0, epp(3.0, 0.0, flow=1.0))  # 7: flow control held work
    assert feed.learner.hard_bound == 7.0
    assert feed.learner.soft_bound is None
    assert feed.learner.bound == 7.0


def test_bound_is_the_lesser_bound_never_below_the_floor() -> None:
    learner = CapacityLearner(floor=4.0)
    assert learner.bound == 4.0  # nothing learned: the floor
    feed = Feed(learner)
    feed(0.0, epp(1.0))  # soft 2
    assert learner.bound == 4.0  # 2 < floor
    feed(1.0, epp(10.0))  # soft 20
    assert learner.bound == 20.0  # soft alone
    feed(2.0, epp(6.0, 2.0))  # hard 16
    assert learner.bound == 16.0  # min(20, 16)
    feed(3.0, epp(1.0, 0.5))  # hard 3
    assert learner.bound == 4.0  # max(min(20, 3), 4)


# --- rho and smoothing --------------------------------------------------------------------

def test_rho_is_the_nearer_of_count_over_bound_and_kv_mean_plus_spread() -> None:
    learner = CapacityLearner(floor=1.0, alpha=1.0)  # alpha 1: no smoothing, raw rho visible
    feed = Feed(learner)
    feed(0.0, epp(8.0, kv=0.25, spread=0.25))  # soft 16: rho = max(16/16, 0.5)
    assert learner.in_flight == 16.0
    assert learner.rho == 1.0
    feed(1.0, epp(4.0, kv=0.5, spread=0.25))  # max(8/16, 0.75)
    assert learner.rho == 0.75
    feed(2.0, epp(2.0, kv=0.5))  # spread unexposed: max(4/16, 0.5)
    assert learner.rho == 0.5


def test_rho_is_read_against_the_bound_this_sample_just_taught() -> None:
    learner = CapacityLearner(alpha=1.0)
    feed = Feed(learner)
    feed(0.0, epp(10.0))  # soft 20
    feed(1.0, epp(7.0, 1.0))  # hard 16, read against min(20, 16)
    assert learner.rho == 1.0
    assert saturated_with_work_waiting(learner.rho, epp(7.0, 1.0))


def test_rho_smoothed_once_per_new_sample() -> None:
    learner = CapacityLearner(floor=8.0, alpha=0.5)
    load_a = epp(2.0)  # in-flight 4; floor 8 (soft 4 < floor): raw 0.5
    learner.observe(0.0, rev(1), load_a, complete=True, new_sample=True)
    assert learner.rho == 0.5  # first sample taken as is
    load_b = epp(4.0, kv=0.0)  # in-flight 8: raw 1.0
    learner.observe(1.0, rev(2), load_b, complete=True, new_sample=True)
    assert learner.rho == 0.75  # 0.5 * 1.0 + 0.5 * 0.5
    # The same publication again is not a new sample: nothing moves.
    learner.observe(2.0, rev(2), load_b, complete=True, new_sample=False)
    assert learner.rho == 0.75
    learner.observe(3.0, rev(3), load_b, complete=True, new_sample=True)
    assert learner.rho == 0.875


def test_delayed_batch_of_the_same_identity_is_not_taken() -> None:
    learner = CapacityLearner(alpha=1.0)
    learner.observe(0.0, rev(5), epp(2.0), complete=True, new_sample=True)
    learner.observe(1.0, rev(4), epp(50.0), complete=True, new_sample=True)
    learner.observe(2.0, rev(5), epp(50.0), complete=True, new_sample=True)
    assert learner.soft_bound == 4.0
    assert learner.in_flight == 4.0
    assert learner.rho == 1.0


def test_no_pressure_in_a_sample_leaves_rho_alone() -> None:
    learner = CapacityLearner(alpha=1.0)
    feed = Feed(learner)
    feed(0.0, epp(2.0))
    feed(1.0, LoadSignals(ready_endpoints=0))
    assert learner.in_flight is None
    assert learner.rho == 1.0
    assert learner.recent_worst_rho(1.0) == 1.0


# --- reset rules (spec: Provider revisions) -------------------------------------------------

def _learned(now: float = 0.0) -> Feed:
    feed = Feed(CapacityLearner(alpha=1.0))
    feed(now, epp(10.0))  # soft 20
    feed(now + 1.0, epp(8.0, 1.0))  # hard 18
    assert (feed.learner.soft_bound, feed.learner.hard_bound) == (20.0, 18.0)
    return feed


@pytest.mark.parametrize(
    "change",
    [{"uid": "u2"}, {"gen": 8}, {"epoch": 2}],
    ids=["provider_uid", "generation", "publisher_epoch"],
)
def test_changed_identity_resets_bounds_and_history(change: dict[str, object]) -> None:
    feed = _learned()
    assert feed.learner.recent_worst_rho(2.0) == 1.0
    feed.seq = 0  # a new identity may restart its sequence
    feed(2.0, epp(1.0, kv=0.125), **change)  # in-flight 2, nothing queued
    learner = feed.learner
    assert learner.soft_bound == 2.0
    assert learner.hard_bound is None
    assert learner.bound == 2.0
    # The congestion history went with the bounds: only this sample is in the window.
    assert learner.rho == 1.0
    feed(3.0, epp(0.5, kv=0.125), **change)  # in-flight 1 against 2
    assert learner.recent_worst_rho(3.0) == 1.0
    assert learner.rho == 0.5


def test_epoch_change_reset_does_not_apply_old_history_window() -> None:
    feed = _learned()
    feed(2.0, epp(1.0, kv=0.25), epoch=2)
    # Before the reset the window's worst was 1.0; after it, only the new sample counts.
    feed(3.0, epp(0.5, kv=0.25), epoch=2)
    assert feed.learner.soft_bound == 2.0
    assert feed.learner.recent_worst_rho(3.0) == 1.0


def test_missing_revision_disables_learning_but_pressure_still_counts() -> None:
    feed = _learned()
    learner = feed.learner
    # Far above the soft bound and well below the hard bound: would move both if learned.
    learner.observe(2.0, None, epp(20.0), complete=True, new_sample=True)  # in-flight 40
    learner.observe(3.0, None, epp(1.0, 1.0), complete=True, new_sample=True)  # in-flight 4, waiting
    assert (learner.soft_bound, learner.hard_bound) == (20.0, 18.0)
    assert not learner.learning
    assert learner.in_flight == 4.0
    assert learner.rho == 4.0 / 18.0  # read against the bound already held
    assert learner.recent_worst_rho(3.0) == 40.0 / 18.0
    learner.observe(4.0, None, epp(0.0, kv=0.5, spread=0.25), complete=True, new_sample=True)
    assert learner.rho == 0.75  # KV still used


def test_incomplete_batch_does_not_learn() -> None:
    feed = _learned()
    feed(2.0, epp(20.0), complete=False)
    assert feed.learner.soft_bound == 20.0
    assert not feed.learner.learning
    assert feed.learner.rho == 40.0 / 18.0


def test_zero_sample_revision_invalidates_learning() -> None:
    feed = _learned()
    feed(2.0, LoadSignals(), samples=0)
    learner = feed.learner
    assert learner.soft_bound is None
    assert learner.hard_bound is None
    assert learner.bound == 1.0
    assert not learner.learning
    # The burst seen before still weighs until it ages out.
    assert learner.recent_worst_rho(2.0) == 1.0


def test_newer_complete_batch_starts_fresh_learning_after_invalidation() -> None:
    feed = _learned()
    feed(2.0, LoadSignals(), samples=0)
    feed(3.0, epp(3.0, kv=0.0))  # in-flight 6, nothing queued
    learner = feed.learner
    assert learner.learning
    assert learner.soft_bound == 6.0
    assert learner.hard_bound is None  # the old 18 is gone, not restored
    assert learner.bound == 6.0


def test_learning_resumes_on_the_held_bounds_when_metadata_returns() -> None:
    feed = _learned()
    feed.learner.observe(2.0, None, epp(30.0), complete=True, new_sample=True)
    feed(3.0, epp(11.0))  # in-flight 22, nothing queued, same identity
    assert feed.learner.learning
    assert (feed.learner.soft_bound, feed.learner.hard_bound) == (22.0, 18.0)


# --- the recent-worst window ----------------------------------------------------------------

def test_recent_worst_holds_a_drained_burst_until_it_ages_out() -> None:
    learner = CapacityLearner(floor=10.0, alpha=1.0, recent_window_s=30.0)

    def sample(now: float, running: float) -> None:
        # No revision metadata: nothing is learned, so rho = in-flight / floor (10).
        learner.observe(now, None, epp(running, 1.0, ready=1), complete=True, new_sample=True)

    sample(100.0, 14.0)  # rho 1.5
    sample(101.0, 4.0)  # rho 0.5
    sample(102.0, 2.0)  # rho 0.3
    assert learner.rho == 0.3
    assert learner.recent_worst_rho(102.0) == 1.5
    # No more samples (peer silent): the burst still counts ...
    assert learner.recent_worst_rho(129.999) == 1.5
    # ... and ages out exactly 30 s after it was taken.
    assert learner.recent_worst_rho(130.0) == 0.5
    assert learner.recent_worst_rho(131.0) == 0.3
    assert learner.recent_worst_rho(131.999) == 0.3
    assert learner.recent_worst_rho(132.0) is None


def test_recent_worst_tracks_a_later_peak() -> None:
    learner = CapacityLearner(floor=10.0, alpha=1.0, recent_window_s=10.0)
    # No revision metadata: nothing is learned, so rho = in-flight / floor (10).
    for now, running in [(0.0, 5.0), (1.0, 2.0), (2.0, 8.0), (3.0, 1.0)]:
        learner.observe(now, None, epp(running, 1.0, ready=1), complete=True, new_sample=True)
    assert learner.recent_worst_rho(3.0) == 0.9
    assert learner.recent_worst_rho(11.999) == 0.9
    assert learner.recent_worst_rho(12.0) == 0.2
    # A sample taken later prunes what aged out and keeps only what can still be worst.
    learner.observe(20.0, None, epp(3.0, 1.0, ready=1), complete=True, new_sample=True)
    assert learner.recent_worst_rho(20.0) == 0.4


def test_smoothing_is_what_the_window_remembers() -> None:
    learner = CapacityLearner(floor=10.0, alpha=0.5)
    learner.observe(0.0, None, epp(19.0, 1.0, ready=1), complete=True, new_sample=True)  # raw 20/10
    learner.observe(1.0, None, epp(0.0, 0.0, ready=1), complete=True, new_sample=True)  # raw 0/10
    assert learner.rho == 1.0
    assert learner.recent_worst_rho(1.0) == 2.0


@pytest.mark.parametrize(
    "kwargs",
    [{"floor": 0.0}, {"floor": -1.0}, {"floor": float("inf")}, {"alpha": 0.0}, {"alpha": 1.5},
     {"recent_window_s": 0.0}, {"recent_window_s": float("nan")}],
)
def test_knob_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CapacityLearner(**kwargs)
