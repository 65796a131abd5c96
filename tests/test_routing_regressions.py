"""Regression tests for the six causes of issue 9 ("Routing quality"), one or more per cause.

Each test failed on d003190 (the routing core before the fix) and passes now. They drive the
gateway through what both versions have, ``CapacityLearner.observe``/``bound`` and
``GatewayStore.ingest``/``decide`` (with the helpers of test_capacity.py and test_store.py),
so the assertion that fails is about behaviour, not about an API that changed. Times are exact.
"""

from __future__ import annotations

import random
from collections import Counter

from support import WALL, BatchFeed, LearnerFeed, epp, load, store

from gridd.core.capacity import CapacityLearner
from gridd.core.decisions import Forward, Shed, Unavailable, UnknownModel
from gridd.core.readings import LoadSignals, UnitLoad
from gridd.core.store import GatewayStore


def vllm_backend(*running: float) -> LoadSignals:
    """A provider pointed at vLLM's own /metrics: running and waiting per engine, nothing
    queued, no ready-endpoint series (so readiness is unknown and the engines are the units)."""
    units = tuple(UnitLoad(f"e{i}", r, 0.0) for i, r in enumerate(running))
    return LoadSignals(units=units, avg_running=sum(running) / len(running), avg_waiting=0.0,
                       kv_mean=0.1, kv_spread=0.0)


def shares(s: GatewayStore, times: list[float]) -> Counter[str]:
    """Where one decide() per instant goes (the store's own sends count as they would)."""
    rng = random.Random(7)
    counts: Counter[str] = Counter()
    for t in times:
        d = s.decide("m", now=t, rng=rng)
        assert isinstance(d, Forward), d
        counts[d.site] += 1
    return counts


# --- cause 1: the hard bound ratchets down for ever -------------------------------------------

def test_cause1_one_request_waiting_at_one_endpoint_is_not_a_demonstrated_limit() -> None:
    """Cause 1. An EPP pool of 4 endpoints (per-endpoint waiting, no per-endpoint running):
    one request waits at one endpoint behind a long one while the other three idle. That is
    not the pool's limit: the capacity stays 4 x 8 (the prior), not the 5 in flight.
    d003190: bound 5.0 (the least in-flight ever seen with work waiting)."""
    learner = CapacityLearner()
    one_queued = LoadSignals(ready_endpoints=4,
                             units=(UnitLoad("u0", waiting=1.0), UnitLoad("u1", waiting=0.0),
                                    UnitLoad("u2", waiting=0.0), UnitLoad("u3", waiting=0.0)),
                             avg_running=1.0, avg_waiting=0.25)
    LearnerFeed(learner)(0.0, one_queued)
    assert learner.bound == 32.0


def test_cause1_a_demonstrated_limit_ages_out_after_the_evidence_window() -> None:
    """Cause 1. A real limit (every endpoint with work waiting at 2 running each) counts for
    evidence_window_s (60 s) and no longer: from t = 60 the pool is read against its prior
    again, though it never showed more than 1 per endpoint since.
    d003190: (4.0, 4.0), the low bounds held for ever."""
    learner = CapacityLearner()
    feed = LearnerFeed(learner)
    feed(0.0, epp(2.0, 1.0, ready=4))
    bounds = {}
    for t in range(1, 61):
        feed(float(t), epp(1.0, ready=4))  # 1 per endpoint, nothing queued
        bounds[t] = learner.bound
    assert (bounds[59], bounds[60]) == (8.0, 32.0)


# --- cause 2: cold start is all-or-nothing ----------------------------------------------------

def test_cause2_two_identical_vllm_backends_split_at_cold_start() -> None:
    """Cause 2. Two identical vLLM backends (2 engines, 4 running each) at their first batch:
    200 decide() calls over the next second split within 40/60.
    d003190: 200 to b, 0 to c (a loaded first sample read rho 1; the tie went to the name
    that sorts first)."""
    s = store()
    feed = BatchFeed()
    s.ingest([feed.batch("b", ld=vllm_backend(4.0, 4.0)), feed.batch("c", ld=vllm_backend(4.0, 4.0))],
             now=0.0, now_wall=WALL)
    counts = shares(s, [0.005 * i for i in range(1, 201)])
    assert 80 <= counts["b"] <= 120, counts


def test_cause2_the_busier_backend_does_not_take_everything() -> None:
    """Cause 2. Two backends of 2 engines holding 4 and 17 requests at their first batch: the
    first request goes to the less busy b, and over 200 requests the busier c does not get
    them all (b takes at least a quarter).
    d003190: all 200 to c (the higher learned soft bound, 17, both read at rho 1)."""
    s = store()
    feed = BatchFeed()
    s.ingest([feed.batch("b", ld=vllm_backend(2.0, 2.0)), feed.batch("c", ld=vllm_backend(8.0, 9.0))],
             now=0.0, now_wall=WALL)
    counts = shares(s, [0.005])
    assert counts == Counter({"b": 1})
    counts += shares(s, [0.005 * i for i in range(2, 201)])
    assert counts["b"] >= 50, counts


# --- cause 3: capacity follows traffic history, not the site ----------------------------------

def test_cause3_a_two_to_one_site_pair_at_light_load_routes_about_two_to_one() -> None:
    """Cause 3. Sites of 4 and 2 endpoints at light load (0.5 per endpoint, nothing queued),
    a new reading every second for 6 s, 100 requests a second: capacity counts the serving
    units from the first batch (4 x 8 against 2 x 8), so the bigger site takes about 2/3.
    d003190: 600 of 600 to b (capacity learned from the traffic seen: 2 and 1, both at rho 1)."""
    s = store()
    feed = BatchFeed()
    counts: Counter[str] = Counter()
    for second in range(6):
        s.ingest([feed.batch("b", ld=load(ready=4, running=0.5)),
                  feed.batch("c", ld=load(ready=2, running=0.5))],
                 now=float(second), now_wall=WALL)
        counts += shares(s, [second + 0.01 * i for i in range(1, 101)])
    assert abs(counts["b"] / 600 - 2 / 3) <= 0.05, counts


# --- cause 4: shedding clears only when no site has been full for room_after ------------------

def test_cause4_shedding_ends_room_after_s_into_relief_while_another_site_stays_full() -> None:
    """Cause 4. b and c full (queues as deep as their batches) from t = 0: the model sheds
    from t = 2 (full_after_s). From t = 4 c drains while b stays full: shedding ends exactly
    room_after_s (5 s) later, at t = 9, and the request goes to c.
    d003190: still Shed at 9.0 (and for as long as b stays full)."""
    s = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    feed = BatchFeed()
    busy = load(ready=2, running=4.0, waiting=4.0, kv=0.99)
    idle = load(ready=2, running=0.0, waiting=0.0, kv=0.0)
    for t in range(0, 4):
        s.ingest([feed.batch("b", ld=busy), feed.batch("c", ld=busy)], now=float(t), now_wall=WALL)
        if t == 1:
            assert isinstance(s.decide("m", now=1.999, rng=random.Random(1)), Forward)
    assert isinstance(s.decide("m", now=3.0, rng=random.Random(1)), Shed)
    for t in range(4, 9):
        s.ingest([feed.batch("b", ld=busy), feed.batch("c", ld=idle)], now=float(t), now_wall=WALL)
    assert isinstance(s.decide("m", now=8.999, rng=random.Random(1)), Shed)
    d = s.decide("m", now=9.0, rng=random.Random(1))
    assert isinstance(d, Forward) and d.site == "c", d


# --- cause 5: a site with no fresh signal before fresh full sites, blocking shedding ----------

def test_cause5_a_stale_site_is_not_chosen_before_a_full_one_nor_blocks_shedding() -> None:
    """Cause 5. b is full at every poll; c's only reading (idle) arrives 19 s old at t = 0 and
    is stale from t = 2 (past the 20 s TTL). From then b is the only fresh site and it is full:
    requests go to b, not to c, and the model sheds exactly full_after_s later, at t = 4.
    d003190: every request to the stale c, and never a shed."""
    s = store(shedding=True, full_after_s=2.0, room_after_s=5.0)
    feed = BatchFeed()
    busy = load(ready=2, running=4.0, waiting=4.0, kv=0.99)
    s.ingest([feed.batch("b", ld=busy), feed.batch("c", ld=load(running=0.0), age_s=19.0)], now=0.0,
             now_wall=WALL)
    for t in (1.0, 2.0, 3.0):
        s.ingest([feed.batch("b", ld=busy)], now=t, now_wall=WALL)
    assert shares(s, [2.0, 3.0, 3.999]) == Counter({"b": 3})
    assert isinstance(s.decide("m", now=4.0, rng=random.Random(1)), Shed)


# --- cause 6: candidates vanish after 2 x TTL -> 404 ------------------------------------------

def test_cause6_a_model_served_only_by_a_silent_site_is_503_until_the_retention() -> None:
    """Cause 6. b alone serves m and its readings stop at t = 0 (the operator keeps answering,
    without b). Past 2 x TTL (40 s) b is silent: 503 with Retry-After and cause "silent",
    until candidate_retention_s (600 s); past that, 404.
    d003190: UnknownModel (404 model_not_found) from t = 40.5."""
    s = store()
    s.ingest([BatchFeed().batch("b")], now=0.0, now_wall=WALL)
    s.ingest([], now=20.0, now_wall=WALL)
    s.ingest([], now=40.0, now_wall=WALL)
    assert isinstance(s.decide("m", now=40.0, rng=random.Random(1)), Forward)  # stale, still routed
    s.ingest([], now=40.5, now_wall=WALL)
    d = s.decide("m", now=40.5, rng=random.Random(1))
    assert isinstance(d, Unavailable), d
    assert (d.retry_after_s, d.cause) == (6.0, "silent")
    for t in range(60, 601, 20):
        s.ingest([], now=float(t), now_wall=WALL)
    assert isinstance(s.decide("m", now=600.0, rng=random.Random(1)), Unavailable)
    s.ingest([], now=600.5, now_wall=WALL)
    assert isinstance(s.decide("m", now=600.5, rng=random.Random(1)), UnknownModel)


def test_cause6_a_gateway_with_no_routing_data_answers_503_not_404() -> None:
    """Cause 6. Before any answer from its operator the gateway cannot tell a model that
    exists from one that does not: 503 "no_operator_data", never 404.
    d003190: UnknownModel (404) for every model."""
    s = store()
    for model in ("m", "anything"):
        d = s.decide(model, now=0.0, rng=random.Random(1))
        assert isinstance(d, Unavailable), d
        assert d.cause == "no_operator_data"
