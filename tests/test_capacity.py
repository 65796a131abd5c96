"""Capacity learning, rho and the recent-worst window (spec: Site Selection, Provider revisions;
what counts as evidence: the routing-quality issue, gridd/core/capacity.py)."""

from __future__ import annotations

import pytest
from support import LearnerFeed, epp, rev

from gridd.core.capacity import (
    DEFAULT_EVIDENCE_WINDOW_S,
    DEFAULT_UNIT_CAPACITY,
    SOFT_PROBE,
    CapacityLearner,
    backlogged,
    demonstrated_unit_limit,
    gateway_in_flight,
    nothing_queued,
    queue_depth,
    saturated_with_work_waiting,
    serving_units,
    work_waiting,
)
from gridd.core.readings import LoadSignals, UnitLoad


def vllm(*engines: tuple[float, float], kv: float | None = None) -> LoadSignals:
    """A provider pointed at vLLM's own /metrics: (running, waiting) per engine, no
    ready-endpoint series, pool means over the engines."""
    n = len(engines)
    return LoadSignals(units=tuple(UnitLoad(f"e{i}", r, w) for i, (r, w) in enumerate(engines)),
                       avg_running=sum(r for r, _ in engines) / n, avg_waiting=sum(w for _, w in engines) / n,
                       kv_mean=kv)


def endpoints(*units: tuple[float, float | None], avg_running: float) -> LoadSignals:
    """An EPP pool with per-endpoint series: (waiting, in-flight) per endpoint; in-flight None
    without the in-flight producer (the EPP exposes no per-endpoint running count)."""
    n = len(units)
    return LoadSignals(ready_endpoints=n, units=tuple(UnitLoad(f"u{i}", waiting=w, in_flight=f)
                                                      for i, (w, f) in enumerate(units)),
                       avg_running=avg_running, avg_waiting=sum(w for w, _ in units) / n)


# --- in-flight and the waiting tests ------------------------------------------------------

IN_FLIGHT_CASES = [
    # (case, load, expected in-flight)
    ("epp pool", epp(3.0, 1.0, ready=4, flow=2.0), (3.0 + 1.0) * 4 + 2.0),
    ("epp, nothing waiting", epp(2.5, 0.0, ready=2), 5.0),
    ("waiting not exposed counts as none", LoadSignals(ready_endpoints=2, avg_running=3.0), 6.0),
    ("vllm direct: engines sampled are the units",
     LoadSignals(units=(UnitLoad("e0", 2.0, 1.0), UnitLoad("e1", 4.0, 1.0)), avg_running=3.0,
                 avg_waiting=1.0),
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
    ("per-unit waiting only", LoadSignals(units=(UnitLoad("a", 1.0, 0.0), UnitLoad("b", 1.0, 2.0))),
     True, False),
    ("waiting unexposed proves nothing", LoadSignals(ready_endpoints=2, avg_running=1.0), False, False),
]


@pytest.mark.parametrize(("case", "load", "waiting", "empty"), WAITING_CASES,
                         ids=[c[0] for c in WAITING_CASES])
def test_work_waiting_and_nothing_queued(case: str, load: LoadSignals, waiting: bool, empty: bool) -> None:
    assert work_waiting(load) is waiting
    assert nothing_queued(load) is empty


def test_queue_depth_counts_unit_queues_and_flow_control() -> None:
    assert queue_depth(epp(1.0, 1.5, ready=4, flow=3.0)) == 9.0
    assert queue_depth(LoadSignals(units=(UnitLoad("a", waiting=2.0), UnitLoad("b")), flow_queue=1.0)) == 3.0
    assert queue_depth(None) == 0.0


# --- full: backlogged and saturated ---------------------------------------------------------

BACKLOG_CASES = [
    # (case, load, backlogged)
    ("idle", epp(1.0, 0.0), False),
    ("a short queue at every endpoint: a busy pool in passing", epp(4.0, 1.0), False),
    ("every endpoint's queue as deep as its batch", epp(4.0, 4.0), True),
    ("flow control holds work", epp(1.0, 0.0, flow=1.0), True),
    ("a unit queue at its limit (queue_full_at)", epp(1.0, 0.0, queue_full=1), True),
    ("one engine queued deep, the other idle", vllm((4.0, 4.0), (0.0, 0.0)), False),
    ("every engine queued at least as deep as it runs", vllm((4.0, 4.0), (3.0, 5.0)), True),
    ("one engine's queue shorter than its batch", vllm((4.0, 4.0), (4.0, 3.0)), False),
    ("in-flight producer: running = in-flight - waiting, every one deep",
     endpoints((3.0, 6.0), (3.0, 5.0), avg_running=2.5), True),
    ("in-flight producer: one endpoint runs more than it queues",
     endpoints((3.0, 6.0), (2.0, 6.0), avg_running=3.5), False),
    ("per-endpoint waiting only: read against the pool's mean running",
     endpoints((2.0, None), (2.0, None), avg_running=2.0), True),
    ("waiting unexposed proves nothing", LoadSignals(ready_endpoints=2, avg_running=1.0), False),
]


@pytest.mark.parametrize(("case", "load", "expected"), BACKLOG_CASES, ids=[c[0] for c in BACKLOG_CASES])
def test_backlogged(case: str, load: LoadSignals, expected: bool) -> None:
    assert backlogged(load) is expected


def test_full_is_saturated_and_backlogged() -> None:
    assert saturated_with_work_waiting(1.0, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(0.99, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(1.5, epp(1.0, 0.0))
    # Work waits, but a short queue is not a pool at its limit: not full.
    assert work_waiting(epp(4.0, 1.0)) and not saturated_with_work_waiting(1.5, epp(4.0, 1.0))
    assert not saturated_with_work_waiting(None, epp(1.0, 1.0))
    assert not saturated_with_work_waiting(1.5, None)


# --- a demonstrated limit ---------------------------------------------------------------------

LIMIT_CASES = [
    # (case, load, per-unit limit demonstrated)
    ("a vLLM engine with work waiting shows what it runs", vllm((6.0, 2.0), (3.0, 0.0)), 6.0),
    ("several queued engines: their mean", vllm((6.0, 2.0), (4.0, 1.0), (1.0, 0.0)), 5.0),
    ("no engine queued", vllm((6.0, 0.0), (4.0, 0.0)), None),
    ("in-flight producer: in-flight - waiting of the queued endpoint",
     endpoints((1.0, 5.0), (0.0, 2.0), avg_running=3.0), 4.0),
    ("one request waiting at one endpoint while the others idle",
     endpoints((1.0, None), (0.0, None), (0.0, None), (0.0, None), avg_running=1.0), None),
    ("every endpoint waits: the pool's mean running",
     endpoints((1.0, None), (2.0, None), avg_running=3.0), 3.0),
    ("pool means only, work waiting: the mean running", epp(3.0, 0.5), 3.0),
    ("flow control holds requests: the mean running", epp(3.0, 0.0, flow=2.0), 3.0),
    ("nothing running", epp(0.0, 1.0), None),
    ("idle", epp(2.0), None),
]


@pytest.mark.parametrize(("case", "load", "expected"), LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_demonstrated_unit_limit(case: str, load: LoadSignals, expected: float | None) -> None:
    assert demonstrated_unit_limit(load) == expected


# --- capacity: prior, soft side, demonstrated limit, floor ------------------------------------

CAPACITY_CASES = [
    # (case, learner knobs, samples fed at t = 0, 1, ..., capacity after the last)
    ("no unit count yet: the floor", {"floor": 3.0}, [LoadSignals(avg_running=1.0, avg_waiting=0.0)], 3.0),
    ("prior: ready endpoints x unit capacity", {}, [epp(1.0, ready=4)], 4 * DEFAULT_UNIT_CAPACITY),
    ("prior: vLLM engines x unit capacity", {}, [vllm((1.0, 0.0), (1.0, 0.0), (0.0, 0.0))], 24.0),
    ("prior: the unit_capacity knob", {"unit_capacity": 5.0}, [epp(1.0, ready=4)], 20.0),
    ("soft evidence below the prior: the prior", {}, [epp(4.0)], 16.0),
    ("soft evidence probes SOFT_PROBE above it", {}, [epp(10.0)], 2 * SOFT_PROBE * 10.0),
    ("soft is the most held with nothing queued", {}, [epp(10.0), epp(6.0), epp(14.0, queue_full=1)], 30.0),
    ("a demonstrated limit caps the prior", {}, [epp(3.0, 1.0)], 6.0),
    ("a demonstrated limit caps the soft side", {}, [epp(10.0), epp(12.0, 2.0)], 24.0),
    ("hard is the mean of the limits in the window, not the least", {}, [epp(8.0, 2.0), epp(4.0, 1.0)], 12.0),
    ("a vLLM engine's limit", {}, [vllm((6.0, 2.0), (3.0, 0.0))], 12.0),
    ("an EPP endpoint's limit from in-flight", {}, [endpoints((1.0, 5.0), (0.0, 2.0), avg_running=3.0)], 8.0),
    ("one endpoint waiting, others idle: no limit", {},
     [endpoints((1.0, None), (0.0, None), (0.0, None), (0.0, None), avg_running=1.0)], 32.0),
    ("evidence is per unit: a pool that doubles doubles", {},
     [epp(3.0, 1.0, ready=2), epp(1.0, ready=4)], 12.0),
    ("never below the floor", {"floor": 4.0}, [epp(1.0, 1.0)], 4.0),
    ("a floor above the prior", {"floor": 40.0}, [epp(1.0)], 40.0),
]


@pytest.mark.parametrize(("case", "knobs", "samples", "expected"), CAPACITY_CASES,
                         ids=[c[0] for c in CAPACITY_CASES])
def test_capacity(case: str, knobs: dict[str, float], samples: list[LoadSignals], expected: float) -> None:
    feed = LearnerFeed(CapacityLearner(**knobs))
    for t, load in enumerate(samples):
        feed(float(t), load)
    assert feed.learner.capacity(float(len(samples) - 1)) == expected
    assert feed.learner.bound == expected


def test_nothing_learned_without_revision_metadata_but_the_unit_count_is_read() -> None:
    learner = CapacityLearner(floor=2.0)
    assert learner.bound == 2.0 and learner.capacity(0.0) == 2.0 and learner.units is None
    learner.observe(0.0, None, epp(10.0, ready=3), complete=True, new_sample=True)
    assert learner.units == 3
    assert learner.unit_bounds(0.0) == (None, None)
    assert learner.capacity(0.0) == 24.0


def test_soft_and_hard_evidence_per_unit() -> None:
    feed = LearnerFeed(CapacityLearner())
    feed(0.0, epp(4.0))  # 4 per unit, nothing queued
    feed(1.0, epp(6.0))
    feed(2.0, epp(5.0))
    assert feed.learner.unit_bounds(2.0) == (6.0, None)
    feed(3.0, epp(12.0, 2.0))  # work waiting: not soft evidence; every unit waits: a limit of 12
    assert feed.learner.unit_bounds(3.0) == (6.0, 12.0)
    assert feed.learner.capacity(3.0) == 2 * min(SOFT_PROBE * 6.0, 12.0)


EVIDENCE_AGE_CASES = [
    # (case, sample at t = 0, window, capacity while it counts, capacity once it aged out)
    ("a demonstrated limit", epp(2.0, 1.0, ready=4), DEFAULT_EVIDENCE_WINDOW_S, 8.0, 32.0),
    ("soft evidence", epp(10.0, ready=4), DEFAULT_EVIDENCE_WINDOW_S, 60.0, 32.0),
    ("the evidence_window_s knob", epp(2.0, 1.0, ready=4), 10.0, 8.0, 32.0),
]


@pytest.mark.parametrize(("case", "sample", "window", "counting", "aged"), EVIDENCE_AGE_CASES,
                         ids=[c[0] for c in EVIDENCE_AGE_CASES])
def test_evidence_counts_until_exactly_the_evidence_window(case: str, sample: LoadSignals, window: float,
                                                           counting: float, aged: float) -> None:
    learner = CapacityLearner(evidence_window_s=window)
    LearnerFeed(learner)(0.0, sample)
    assert learner.capacity(0.0) == counting
    assert learner.capacity(window - 0.001) == counting
    assert learner.capacity(window) == aged
    assert learner.unit_bounds(window) == (None, None)


def test_the_mean_limit_follows_the_samples_still_in_the_window() -> None:
    learner = CapacityLearner()
    feed = LearnerFeed(learner)
    feed(0.0, epp(8.0, 2.0))  # a limit of 8 per unit
    feed(30.0, epp(4.0, 1.0))  # and of 4
    assert learner.unit_bounds(59.999) == (None, 6.0)
    assert learner.unit_bounds(60.0) == (None, 4.0)  # the 8 aged out
    assert learner.capacity(60.0) == 8.0
    assert learner.capacity(90.0) == 16.0  # both gone: the prior


def test_retune_keeps_the_evidence_and_applies_the_new_knobs() -> None:
    feed = LearnerFeed(CapacityLearner())
    feed(0.0, epp(4.0))  # soft 4: the prior 8 stands above 1.5 x 4
    assert feed.learner.capacity(0.0) == 16.0
    feed.learner.retune(floor=1.0, alpha=0.5, recent_window_s=10.0, unit_capacity=4.0,
                        evidence_window_s=120.0)
    assert feed.learner.unit_bounds(0.0) == (4.0, None)
    assert feed.learner.capacity(0.0) == 2 * SOFT_PROBE * 4.0
    assert feed.learner.capacity(119.0) == 12.0  # the longer window keeps it
    with pytest.raises(ValueError):
        feed.learner.retune(floor=1.0, alpha=0.5, recent_window_s=10.0, unit_capacity=0.0)


# --- rho and smoothing --------------------------------------------------------------------

def test_rho_is_the_nearer_of_count_over_bound_and_kv_mean_plus_spread() -> None:
    learner = CapacityLearner(floor=1.0, alpha=1.0)  # alpha 1: no smoothing, raw rho visible
    feed = LearnerFeed(learner)
    feed(0.0, epp(4.0, kv=0.125, spread=0.125))  # capacity 16 (prior): max(8/16, 0.25)
    assert learner.in_flight == 8.0
    assert learner.rho == 0.5
    feed(1.0, epp(2.0, kv=0.5, spread=0.25))  # max(4/16, 0.75)
    assert learner.rho == 0.75
    feed(2.0, epp(2.0, kv=0.5))  # spread unexposed: max(4/16, 0.5)
    assert learner.rho == 0.5


def test_rho_is_read_against_the_bound_this_sample_just_taught() -> None:
    learner = CapacityLearner(alpha=1.0)
    feed = LearnerFeed(learner)
    feed(0.0, epp(10.0))  # soft 10 per unit: capacity 30
    feed(1.0, epp(7.0, 7.0))  # a limit of 7 per unit: 28 in flight read against 14
    assert learner.rho == 2.0
    assert saturated_with_work_waiting(learner.rho, epp(7.0, 7.0))


def test_rho_smoothed_once_per_new_sample() -> None:
    learner = CapacityLearner(alpha=0.5)

    def unexposed_waiting(running: float) -> LoadSignals:
        # Waiting unexposed proves nothing: no evidence, so the capacity stays the prior 16.
        return LoadSignals(ready_endpoints=2, avg_running=running)

    learner.observe(0.0, rev(1), unexposed_waiting(4.0), complete=True, new_sample=True)  # raw 8/16
    assert learner.rho == 0.5  # first sample taken as is
    load_b = unexposed_waiting(8.0)  # raw 16/16
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
    assert learner.unit_bounds(2.0) == (2.0, None)
    assert learner.in_flight == 4.0
    assert learner.rho == 0.25


def test_no_pressure_in_a_sample_leaves_rho_alone() -> None:
    learner = CapacityLearner(alpha=1.0)
    feed = LearnerFeed(learner)
    feed(0.0, epp(2.0))
    feed(1.0, LoadSignals(ready_endpoints=0))
    assert learner.in_flight is None
    assert learner.rho == 0.25
    assert learner.recent_worst_rho(1.0) == 0.25
    assert learner.units == 2  # a zero count says nothing about the pool's size


# --- reset rules (spec: Provider revisions) -------------------------------------------------

def _learned(now: float = 0.0) -> LearnerFeed:
    feed = LearnerFeed(CapacityLearner(alpha=1.0))
    feed(now, epp(10.0))  # soft 10 per unit
    feed(now + 1.0, epp(8.0, 1.0))  # a limit of 8 per unit: capacity 2 x min(15, 8) = 16, rho 18/16
    assert feed.learner.unit_bounds(now + 1.0) == (10.0, 8.0)
    assert feed.learner.rho == 1.125
    return feed


@pytest.mark.parametrize(
    "change",
    [{"uid": "u2"}, {"gen": 8}, {"epoch": 2}],
    ids=["provider_uid", "generation", "publisher_epoch"],
)
def test_changed_identity_resets_bounds_and_history(change: dict[str, object]) -> None:
    feed = _learned()
    assert feed.learner.recent_worst_rho(2.0) == 1.125
    feed.seq = 0  # a new identity may restart its sequence
    feed(2.0, epp(1.0, kv=0.125), **change)  # in-flight 2, nothing queued
    learner = feed.learner
    assert learner.unit_bounds(2.0) == (1.0, None)
    assert learner.bound == 16.0  # the prior again: the limit of 8 is gone
    # The congestion history went with the bounds: only this sample is in the window.
    assert learner.rho == 0.125
    assert learner.recent_worst_rho(2.0) == 0.125
    feed(3.0, epp(0.5, kv=0.0625), **change)  # in-flight 1 against 16
    assert learner.recent_worst_rho(3.0) == 0.125
    assert learner.rho == 0.0625


def test_epoch_change_reset_does_not_apply_old_history_window() -> None:
    feed = _learned()
    feed(2.0, epp(1.0, kv=0.25), epoch=2)
    # Before the reset the window's worst was 1.125; after it, only the new samples count.
    feed(3.0, epp(0.5, kv=0.25), epoch=2)
    assert feed.learner.unit_bounds(3.0) == (1.0, None)
    assert feed.learner.recent_worst_rho(3.0) == 0.25


def test_missing_revision_disables_learning_but_pressure_still_counts() -> None:
    feed = _learned()
    learner = feed.learner
    # Far above the soft evidence, and queued below the limit: would move both if learned.
    learner.observe(2.0, None, epp(20.0), complete=True, new_sample=True)  # in-flight 40
    learner.observe(3.0, None, epp(1.0, 1.0), complete=True, new_sample=True)  # in-flight 4, waiting
    assert learner.unit_bounds(3.0) == (10.0, 8.0)
    assert not learner.learning
    assert learner.in_flight == 4.0
    assert learner.rho == 4.0 / 16.0  # read against the bound already held
    assert learner.recent_worst_rho(3.0) == 40.0 / 16.0
    learner.observe(4.0, None, epp(0.0, kv=0.5, spread=0.25), complete=True, new_sample=True)
    assert learner.rho == 0.75  # KV still used


def test_incomplete_batch_does_not_learn() -> None:
    feed = _learned()
    feed(2.0, epp(20.0), complete=False)
    assert feed.learner.unit_bounds(2.0) == (10.0, 8.0)
    assert not feed.learner.learning
    assert feed.learner.rho == 40.0 / 16.0


def test_zero_sample_revision_invalidates_learning() -> None:
    feed = _learned()
    feed(2.0, LoadSignals(), samples=0)
    learner = feed.learner
    assert learner.unit_bounds(2.0) == (None, None)
    assert learner.bound == 16.0  # the prior over the unit count last reported
    assert not learner.learning
    # The burst seen before still weighs until it ages out.
    assert learner.recent_worst_rho(2.0) == 1.125


def test_newer_complete_batch_starts_fresh_learning_after_invalidation() -> None:
    feed = _learned()
    feed(2.0, LoadSignals(), samples=0)
    feed(3.0, epp(6.0, kv=0.0))  # 6 per unit, nothing queued
    learner = feed.learner
    assert learner.learning
    assert learner.unit_bounds(3.0) == (6.0, None)  # the old limit of 8 is gone, not restored
    assert learner.bound == 2 * SOFT_PROBE * 6.0


def test_learning_resumes_on_the_held_bounds_when_metadata_returns() -> None:
    feed = _learned()
    feed.learner.observe(2.0, None, epp(30.0), complete=True, new_sample=True)
    feed(3.0, epp(11.0))  # 11 per unit, nothing queued, same identity
    assert feed.learner.learning
    assert feed.learner.unit_bounds(3.0) == (11.0, 8.0)


# --- the recent-worst window ----------------------------------------------------------------

def test_recent_worst_holds_a_drained_burst_until_it_ages_out() -> None:
    learner = CapacityLearner(floor=10.0, alpha=1.0, recent_window_s=30.0)

    def sample(now: float, running: float) -> None:
        # No revision metadata: nothing is learned, so rho = in-flight / floor (10, above
        # the prior of one unit, 8).
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
    # No revision metadata: nothing is learned, so rho = in-flight / floor (10, above the
    # prior of one unit, 8).
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
     {"recent_window_s": 0.0}, {"recent_window_s": float("nan")}, {"unit_capacity": 0.0},
     {"unit_capacity": float("inf")}, {"evidence_window_s": -1.0}, {"evidence_window_s": float("nan")}],
)
def test_knob_validation(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CapacityLearner(**kwargs)
