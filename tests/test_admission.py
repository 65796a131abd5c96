"""Admission and fences: the spec's ordering, skew and repeat rules with exact numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import msgspec
import pytest
import support

from gridd.core import admission
from gridd.core.admission import (
    ACCEPTED,
    DROP_REASONS,
    FUTURE_EPOCH_BOUND_S,
    REPEAT,
    SKEW_EVIDENCE_MAX,
    Admission,
    AdmissionFences,
    Outcome,
)
from gridd.core.batch import Batch, Cursor, with_added_age
from gridd.core.feedback_values import SkewEvidence
from gridd.core.payload import validate_payload
from gridd.core.readings import LatencyBlock, LoadSignals, UnitLoad, sample_count

NOW = 1_790_000_000.0  # the receiver's wall clock, seconds
E = 1_789_990_000  # a publisher epoch taken at operator start, before NOW

LOAD = LoadSignals(
    ready_endpoints=2,
    units=(UnitLoad("e1", 2.0, 0.0, 0.3, 2.0), UnitLoad("e2", 1.0, 1.0, 0.5)),
    avg_running=1.5,
    avg_waiting=0.5,
    kv_mean=0.4,
    kv_spread=0.1,
    flow_queue=0.0,
    in_flight=4.0,
)


# Every batch here is a complete reading of LOAD with a latency block and one probe value
# unless a test says otherwise.
batch = partial(
    support.batch,
    model="Qwen/Qwen3.5-9B",
    ready_reason="Ready",
    load=LOAD,
    latency=LatencyBlock(30.0, 25, 0.1, 0.2, 0.01, 0.0),
    probes={"performance.num_requests_waiting": 1.0},
)


def dropped(reason: str) -> str:
    return f"dropped:{reason}"


@dataclass
class Step:
    batch: Batch
    expect: str  # "accepted", "repeat" or "dropped:<reason>"
    now: float = NOW
    verified_site: str | None = None


@dataclass
class Scenario:
    name: str
    steps: list[Step]
    drops: dict[str, int] = field(default_factory=dict)
    fence: tuple[int, int] | None = None


def _verdict(a: Admission) -> str:
    return a.outcome.value if a.reason is None else f"{a.outcome.value}:{a.reason}"


SCENARIOS = [
    Scenario(
        "epoch 600 s + 1 s ahead is rejected as skew",
        [Step(batch(int(NOW) + 601, 1), dropped("skew"))],
        drops={"skew": 1},
        fence=None,
    ),
    Scenario(
        "epoch exactly 600 s ahead is accepted",
        [Step(batch(int(NOW) + 600, 1), "accepted")],
        fence=(int(NOW) + 600, 1),
    ),
    Scenario(
        "bound measured against the receiver's clock passed in",
        [
            Step(batch(int(NOW) + 900, 1), dropped("skew")),
            Step(batch(int(NOW) + 900, 1), "accepted", now=NOW + 300),
        ],
        drops={"skew": 1},
        fence=(int(NOW) + 900, 1),
    ),
    Scenario(
        "a delayed sequence is stale_order",
        [Step(batch(E, 5), "accepted"), Step(batch(E, 4), dropped("stale_order"))],
        drops={"stale_order": 1},
        fence=(E, 5),
    ),
    Scenario(
        "an exact repeat (relay aged it) is REPEAT and uncounted",
        [
            Step(batch(E, 5), "accepted"),
            Step(with_added_age(batch(E, 5), 3.0), "repeat"),
            Step(batch(E, 5), "repeat"),
        ],
        fence=(E, 5),
    ),
    Scenario(
        "same (epoch, sequence) with a different payload is stale_order",
        [Step(batch(E, 5), "accepted"), Step(batch(E, 5, ready=False), dropped("stale_order"))],
        drops={"stale_order": 1},
        fence=(E, 5),
    ),
    Scenario(
        "operator restart: higher epoch, sequence back at 1, is accepted; the old epoch is then stale",
        [
            Step(batch(E, 100), "accepted"),
            Step(batch(E + 50, 1), "accepted"),
            Step(batch(E, 101), dropped("stale_order")),
            Step(batch(E + 50, 2), "accepted"),
        ],
        drops={"stale_order": 1},
        fence=(E + 50, 2),
    ),
    Scenario(
        "a direct peer's batch for another site is an identity drop",
        [
            Step(batch(E, 1, site="c"), dropped("identity"), verified_site="b"),
            Step(batch(E, 1), "accepted", verified_site="b"),
        ],
        drops={"identity": 1},
        fence=(E, 1),
    ),
    Scenario(
        "relayed data (verified_site None) is taken for any site",
        [Step(batch(E, 1), "accepted", verified_site=None)],
        fence=(E, 1),
    ),
    Scenario(
        "identity is checked before skew",
        [Step(batch(int(NOW) + 601, 1, site="c"), dropped("identity"), verified_site="b")],
        drops={"identity": 1},
    ),
    Scenario(
        "invalid payload is dropped but advances the fence; the older valid batch is then stale",
        [
            Step(batch(E, 5), "accepted"),
            Step(batch(E, 7, load=None), dropped("invalid")),
            Step(batch(E, 6), dropped("stale_order")),
            Step(batch(E, 7), dropped("stale_order")),
            Step(batch(E, 7, load=None), dropped("invalid")),
            Step(batch(E, 8), "accepted"),
        ],
        drops={"invalid": 2, "stale_order": 2},
        fence=(E, 8),
    ),
    Scenario(
        "a skew-rejected batch leaves the fence untouched",
        [
            Step(batch(E, 5), "accepted"),
            Step(batch(int(NOW) + 700, 1), dropped("skew")),
            Step(batch(E, 6), "accepted"),
        ],
        drops={"skew": 1},
        fence=(E, 6),
    ),
    Scenario(
        "a skew-rejected first batch creates no fence: a later lower epoch is accepted",
        [Step(batch(int(NOW) + 700, 9), dropped("skew")), Step(batch(E, 1), "accepted")],
        drops={"skew": 1},
        fence=(E, 1),
    ),
    Scenario(
        "an incomplete batch with a revision is fenced and repeats idempotently",
        [
            Step(batch(E, 3, complete=False, load=None, samples=2), "accepted"),
            Step(batch(E, 3, complete=False, load=None, samples=2, age_s=1.0), "repeat"),
            Step(batch(E, 2), dropped("stale_order")),
        ],
        drops={"stale_order": 1},
        fence=(E, 3),
    ),
    Scenario(
        "negative ordering metadata is invalid and fences nothing",
        [Step(batch(-1, 5), dropped("invalid")), Step(batch(E, 1), "accepted")],
        drops={"invalid": 1},
        fence=(E, 1),
    ),
    Scenario(
        "missing revision: accepted without a fence; repeat; older publication is stale",
        [
            Step(batch(None, complete=False, published_ms=5_000), "accepted"),
            Step(batch(None, complete=False, published_ms=5_000, age_s=2.0), "repeat"),
            Step(batch(None, complete=False, published_ms=4_000), dropped("stale_order")),
            Step(batch(None, complete=False, published_ms=5_000, ready=False), dropped("stale_order")),
            Step(batch(None, complete=False, published_ms=6_000), "accepted"),
        ],
        drops={"stale_order": 2},
        fence=None,
    ),
    Scenario(
        "missing revision neither moves nor is checked against a fence",
        [
            Step(batch(E, 5, published_ms=10_000), "accepted"),
            Step(batch(None, complete=False, published_ms=11_000), "accepted"),
            Step(batch(E, 6, published_ms=12_000), "accepted"),
            Step(batch(E, 4, published_ms=13_000), dropped("stale_order")),
        ],
        drops={"stale_order": 1},
        fence=(E, 6),
    ),
    Scenario(
        "a delayed revision-less batch cannot replace a newer fenced reading",
        [
            Step(batch(E, 5, published_ms=10_000), "accepted"),
            Step(batch(None, complete=False, published_ms=9_000), dropped("stale_order")),
        ],
        drops={"stale_order": 1},
        fence=(E, 5),
    ),
    Scenario(
        "a revision-less batch claiming to be complete is invalid",
        [Step(batch(None, complete=True, published_ms=5_000), dropped("invalid"))],
        drops={"invalid": 1},
    ),
    Scenario(
        "a revision-less batch published beyond the future bound is invalid and blocks nothing",
        [
            Step(batch(None, complete=False, published_ms=int((NOW + 601) * 1000)), dropped("invalid")),
            Step(batch(None, complete=False, published_ms=int(NOW * 1000)), "accepted"),
        ],
        drops={"invalid": 1},
    ),
    Scenario(
        "providers are fenced independently",
        [
            Step(batch(E, 9, provider="m"), "accepted"),
            Step(batch(E, 1, provider="n"), "accepted"),
            Step(batch(E, 1, site="c"), "accepted"),
        ],
        fence=(E, 9),
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_admission_scenarios(scenario: Scenario):
    fences = AdmissionFences()
    for i, step in enumerate(scenario.steps):
        verdict = fences.admit(step.batch, now_wall=step.now, verified_site=step.verified_site)
        assert _verdict(verdict) == step.expect, f"step {i}: {verdict.detail}"
    assert fences.drops() == {reason: scenario.drops.get(reason, 0) for reason in DROP_REASONS}
    assert fences.fence("b", "m") == scenario.fence


def test_verdict_singletons_and_detail():
    fences = AdmissionFences()
    assert fences.admit(batch(E, 1), now_wall=NOW, verified_site=None) is ACCEPTED
    assert fences.admit(batch(E, 1), now_wall=NOW, verified_site=None) is REPEAT
    stale = fences.admit(batch(E, 0), now_wall=NOW, verified_site=None)
    assert stale.outcome is Outcome.DROPPED and stale.reason == "stale_order"
    assert str((E, 1)) in stale.detail


def test_future_bound_is_configurable():
    fences = AdmissionFences(future_epoch_bound_s=60.0)
    assert fences.future_epoch_bound_s == 60.0
    assert fences.admit(batch(int(NOW) + 61, 1), now_wall=NOW, verified_site=None).reason == "skew"
    assert fences.admit(batch(int(NOW) + 60, 1), now_wall=NOW, verified_site=None) is ACCEPTED
    assert FUTURE_EPOCH_BOUND_S == 600.0


def test_skew_evidence_records_the_rejected_batch():
    fences = AdmissionFences()
    fences.admit(batch(int(NOW) + 601, 3), now_wall=NOW, verified_site=None)
    fences.admit(batch(E, 4), now_wall=NOW, verified_site=None)
    assert fences.skew_evidence() == (SkewEvidence("b", "m", int(NOW) + 601, 3),)


def test_skew_evidence_is_bounded_and_deduplicated():
    fences = AdmissionFences()
    ahead = int(NOW) + 1000
    for seq in range(SKEW_EVIDENCE_MAX + 6):
        fences.admit(batch(ahead, seq), now_wall=NOW, verified_site=None)
    evidence = fences.skew_evidence()
    assert len(evidence) == SKEW_EVIDENCE_MAX == 64
    assert evidence[0] == SkewEvidence("b", "m", ahead, 6)
    assert evidence[-1] == SkewEvidence("b", "m", ahead, SKEW_EVIDENCE_MAX + 5)
    # The same rejected batch again (every relay poll resends it): one entry, now newest,
    # while every delivery is still counted.
    fences.admit(batch(ahead, 10), now_wall=NOW, verified_site=None)
    evidence = fences.skew_evidence()
    assert len(evidence) == SKEW_EVIDENCE_MAX
    assert evidence[-1] == SkewEvidence("b", "m", ahead, 10)
    assert evidence.count(SkewEvidence("b", "m", ahead, 10)) == 1
    assert fences.drops()["skew"] == SKEW_EVIDENCE_MAX + 7


def test_drop_counters_latch_instead_of_wrapping(monkeypatch):
    # The counters latch at the wire's integer maximum (2**53 - 1), lowered here to 2 so
    # that three drops pass it.
    monkeypatch.setattr(admission, "WIRE_INT_MAX", 2)
    fences = AdmissionFences()
    fences.admit(batch(E, 2), now_wall=NOW, verified_site=None)
    for _ in range(3):
        fences.admit(batch(E, 1), now_wall=NOW, verified_site=None)
    assert fences.drops()["stale_order"] == 2


def test_decode_errors_are_counted():
    fences = AdmissionFences()
    verdict = fences.note_decode_error()
    assert verdict.outcome is Outcome.DROPPED and verdict.reason == "decode"
    fences.note_decode_error()
    assert fences.drops()["decode"] == 2


def test_drops_returns_a_copy():
    fences = AdmissionFences()
    fences.drops()["skew"] = 5
    assert fences.drops()["skew"] == 0


def test_forget_lets_a_recreated_provider_start_fresh():
    fences = AdmissionFences()
    fences.admit(batch(E, 50), now_wall=NOW, verified_site=None)
    fences.admit(batch(E, 1, provider="n"), now_wall=NOW, verified_site=None)
    assert len(fences) == 2
    fences.forget("b", "m")
    fences.forget("b", "never-seen")
    assert len(fences) == 1
    assert fences.fence("b", "m") is None
    assert fences.admit(batch(E, 1), now_wall=NOW, verified_site=None) is ACCEPTED
    assert fences.fence("b", "n") == (E, 1)


def test_cursors_list_every_fence():
    fences = AdmissionFences()
    fences.admit(batch(E, 5), now_wall=NOW, verified_site=None)
    fences.admit(batch(E, 2, site="c"), now_wall=NOW, verified_site=None)
    fences.admit(batch(E, 9, site="c", load=None), now_wall=NOW, verified_site=None)  # invalid, fenced
    fences.admit(batch(None, provider="u", complete=False), now_wall=NOW, verified_site=None)
    assert set(fences.cursors()) == {Cursor("b", "m", E, 5), Cursor("c", "m", E, 9)}


def test_memory_is_one_entry_per_provider():
    fences = AdmissionFences()
    for seq in range(1, 200):
        fences.admit(batch(E, seq), now_wall=NOW, verified_site=None)
        fences.admit(batch(E, seq - 1), now_wall=NOW, verified_site=None)
    assert len(fences) == 1


# --- payload validation ----------------------------------------------------------------


def _with_load(**changes) -> Batch:
    load = msgspec.structs.replace(LOAD, **changes)
    return batch(E, 1, load=load, samples=sample_count(load))


def _with_unit(unit: UnitLoad) -> Batch:
    load = msgspec.structs.replace(LOAD, units=(unit,))
    return batch(E, 1, load=load, samples=sample_count(load))


def _with_latency(**changes) -> Batch:
    b = batch(E, 1)
    return msgspec.structs.replace(b, latency=msgspec.structs.replace(b.latency, **changes))


def _with_revision(**changes) -> Batch:
    b = batch(E, 1)
    return msgspec.structs.replace(b, revision=msgspec.structs.replace(b.revision, **changes))


VALIDATION = [
    ("a valid complete batch", batch(E, 1), None),
    ("an incomplete batch without load", batch(E, 1, complete=False, load=None), None),
    ("an incomplete batch carrying fewer samples", batch(E, 1, complete=False, samples=9), None),
    ("a zero-sample complete revision", batch(E, 1, load=LoadSignals(), samples=0), None),
    ("unknown readiness", batch(E, 1, ready=None), None),
    ("a revision-less incomplete batch", batch(None, complete=False), None),
    ("empty model", msgspec.structs.replace(batch(E, 1), model=""), "empty model"),
    ("negative published_ms", batch(E, 1, published_ms=-1), "published_ms"),
    ("NaN age", batch(E, 1, age_s=math.nan), "age_s"),
    ("negative age", batch(E, 1, age_s=-0.5), "age_s"),
    ("complete without revision", batch(None, complete=True), "without revision"),
    ("complete without load", batch(E, 1, load=None), "without load"),
    # An older operator counted the pool-level load as one more sample (2 units + 1).
    ("complete with the legacy sample count", batch(E, 1, samples=3), None),
    ("complete with a sample count mismatch", batch(E, 1, samples=5), "carries 2 samples"),
    ("incomplete with more samples than stated", batch(E, 1, complete=False, samples=1), "carries 2"),
    ("empty provider uid", _with_revision(provider_uid=""), "provider_uid"),
    ("negative generation", _with_revision(generation=-1), "generation"),
    ("negative ready endpoints", _with_load(ready_endpoints=-1), "ready_endpoints"),
    ("negative queue_full_units", _with_load(queue_full_units=-2), "queue_full_units"),
    ("NaN avg_running", _with_load(avg_running=math.nan), "avg_running"),
    ("infinite in_flight", _with_load(in_flight=math.inf), "in_flight"),
    ("negative flow_queue", _with_load(flow_queue=-1.0), "flow_queue"),
    ("kv_mean above 1", _with_load(kv_mean=1.01), "kv_mean"),
    ("negative kv_spread", _with_load(kv_spread=-0.1), "kv_spread"),
    ("unit with empty name", _with_unit(UnitLoad("", 1.0)), "empty name"),
    ("unit with negative waiting", _with_unit(UnitLoad("e1", 1.0, -1.0)), "units[0]"),
    ("unit with NaN in_flight", _with_unit(UnitLoad("e1", 1.0, 0.0, None, math.nan)), "units[0]"),
    ("unit with kv_usage above 1", _with_unit(UnitLoad("e1", 1.0, 0.0, 1.5)), "kv_usage"),
    (
        "duplicate unit",
        _with_load(units=(UnitLoad("e1", 1.0), UnitLoad("e1", 2.0))),
        "repeats unit 'e1'",
    ),
    ("zero latency window", _with_latency(window_s=0.0), "window_s"),
    ("negative completed", _with_latency(completed=-1), "completed"),
    ("NaN ttft", _with_latency(ttft_p50_s=math.nan), "ttft_p50_s"),
    ("error ratio above 1", _with_latency(error_ratio=1.2), "error_ratio"),
    ("p50 above p90", _with_latency(ttft_p50_s=0.5, ttft_p90_s=0.4), "exceeds"),
    ("NaN probe value", batch(E, 1, probes={"performance.x": math.nan}), "probe"),
    ("empty probe name", batch(E, 1, probes={"": 1.0}), "empty name"),
]


@pytest.mark.parametrize(("case", "b", "problem"), VALIDATION, ids=[c[0] for c in VALIDATION])
def test_validate_payload(case, b, problem):
    found = validate_payload(b)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_every_validation_failure_with_a_revision_advances_the_fence():
    for case, b, problem in VALIDATION:
        if problem is None or b.revision is None:
            continue
        fences = AdmissionFences()
        verdict = fences.admit(b, now_wall=NOW, verified_site=None)
        assert verdict.reason == "invalid", case
        assert fences.fence("b", "m") == (E, 1), case
        assert fences.admit(batch(E, 0), now_wall=NOW, verified_site=None).reason == "stale_order", case


def test_empty_site_or_provider_is_invalid_and_fences_nothing():
    fences = AdmissionFences()
    assert fences.admit(batch(E, 1, site=""), now_wall=NOW, verified_site=None).reason == "invalid"
    assert fences.admit(batch(E, 1, provider=""), now_wall=NOW, verified_site=None).reason == "invalid"
    assert len(fences) == 0
