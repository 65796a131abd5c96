"""Gateway rejection reports: the reporter's rules (one test per sentence of the spec's
section, named after it), the operator's evidence ledger and intake, and the whole path on
trio's MockClock with the in-memory grid of test_grid_mockclock.py."""

from __future__ import annotations

import math

import msgspec
import pytest
import trio
from prometheus_client import CollectorRegistry
from support import GATEWAY, TD, WALL0, Grid, memory_link_factory, operator_config, wall, write_certs

from gridd import wire
from gridd.config import load_config
from gridd.core.admission import AdmissionFences, Outcome
from gridd.core.batch import ordering
from gridd.core.feedback import (
    FAILURE_REASONS,
    LEDGER_EPOCHS_MAX,
    LEDGER_EVIDENCE_MAX,
    LEDGER_REPLICAS_MAX,
    RESOLVE_AFTER_CLEAN_REPORTS,
    FeedbackReporter,
    GatewayEvidenceLedger,
    LedgerDecodeError,
)
from gridd.core.readings import Revision
from gridd.errors import StateError
from gridd.link.session import ChannelError
from gridd.operator.gateway_feedback import FEEDBACK_FILE, FEEDBACK_NOT_STORED
from gridd.operator.service import OperatorService
from gridd.state import write_durably
from gridd.tls import PeerIdentity
from gridd.wire import (
    ACK_ACCEPTED,
    FEEDBACK_EVIDENCE_MAX,
    WIRE_INT_MAX,
    Batch,
    FeedbackAck,
    FeedbackReport,
    SkewEvidence,
)

EPOCH = 0x5EED_F00D  # the gateway process's reporter epoch
EV = tuple(SkewEvidence("b", "pool-b", 2_000_000_000, seq) for seq in range(1, 200))
EARLIER = SkewEvidence("c", "pool-c", 2_000_000_000, 1)  # rejected before any cycle a test runs


def ack(report: FeedbackReport, status: str = ACK_ACCEPTED, **changes) -> FeedbackAck:
    return msgspec.structs.replace(
        FeedbackAck(reporter_epoch=report.reporter_epoch, sequence=report.sequence, status=status), **changes)


def no_failures() -> dict[str, int]:
    return dict.fromkeys(FAILURE_REASONS, 0)


def bad_cycle(reporter: FeedbackReporter, *new: SkewEvidence) -> FeedbackReport:
    """A committed observation with len(new) fresh skew drops, and its report."""
    # The store's recent skew evidence, oldest first: a rejection from before, then the new ones.
    held = (EARLIER, *new)
    assert reporter.observe(reporter.skew_drops + len(new), held) is True
    report = reporter.next_report()
    assert report is not None
    return report


def clean_cycle(reporter: FeedbackReporter) -> FeedbackReport | None:
    assert reporter.observe(reporter.skew_drops, ()) is False
    return reporter.next_report()


# --- the reporter, sentence by sentence -------------------------------------------------


def test_after_each_committed_successful_ingest_the_gateway_reports_its_skew_evidence():
    # Driven by the store's own admission, as the gateway does: a batch more than ten
    # minutes ahead of the receiver's wall clock is a skew drop with evidence.
    fences, reporter = AdmissionFences(), FeedbackReporter(EPOCH)
    now_wall = 1_800_000_000.0
    ahead = Batch(site="b", provider="pool-b", model="m", published_ms=1, age_s=0.0,
                  revision=Revision("u", 1, int(now_wall) + 601, 9, 0))
    assert fences.admit(ahead, now_wall=now_wall, verified_site=None).reason == "skew"
    reporter.observe(fences.drops()["skew"], fences.skew_evidence())
    assert reporter.next_report() == FeedbackReport(
        reporter_epoch=EPOCH, sequence=1, skew_drops=1,
        evidence=(SkewEvidence("b", "pool-b", int(now_wall) + 601, 9),))
    # Exactly the bound ahead is admitted: the next cycle is clean and reports so.
    at_bound = msgspec.structs.replace(ahead, revision=Revision("u", 1, int(now_wall) + 600, 10, 0))
    assert fences.admit(at_bound, now_wall=now_wall, verified_site=None).outcome is Outcome.ACCEPTED
    assert reporter.on_ack(ack(reporter.pending_report)).result == "delivered"
    reporter.observe(fences.drops()["skew"], fences.skew_evidence())
    assert reporter.next_report() == FeedbackReport(reporter_epoch=EPOCH, sequence=2, skew_drops=1)


def test_only_the_drops_since_the_last_observation_are_new_evidence():
    reporter = FeedbackReporter(EPOCH)
    reporter.observe(2, EV[:2])
    first = reporter.next_report()
    reporter.on_ack(ack(first))
    # The store keeps its recent evidence (oldest first); one new drop adds the last one.
    reporter.observe(3, EV[:3])
    assert reporter.next_report().evidence == (EV[2],)


@pytest.mark.parametrize("outcome, reason", [
    (lambda r, rep: r.on_failure("timeout"), "timeout"),
    (lambda r, rep: r.on_failure("transport", "connect: refused"), "transport"),
    (lambda r, rep: r.on_ack(ack(rep, "not_implemented")), "status"),
    (lambda r, rep: r.on_ack(None), "acknowledgment"),
    (lambda r, rep: r.on_ack(ack(rep, sequence=rep.sequence + 1)), "acknowledgment"),
])
def test_failures_total_counts_each_failed_delivery_attempt_once(outcome, reason):
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    delivery = outcome(reporter, report)
    assert delivery.result == reason and delivery.failed
    assert reporter.failures == {**no_failures(), reason: 1}
    assert reporter.delivered == 0


@pytest.mark.parametrize("status", ["not_implemented", "not_stored", "rejected", "", "ACCEPTED", "accepted "])
def test_status_counts_any_answer_but_accepted(status):
    # DESIGN 5b: the reply carries an explicit status; anything but "accepted" is the
    # spec's non-204.
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    assert reporter.on_ack(ack(report, status)).result == "status"
    assert reporter.failures == {**no_failures(), "status": 1}
    assert reporter.next_report() is report  # retained for retry


@pytest.mark.parametrize("case, answer", [
    ("missing", lambda rep: None),
    ("mismatched epoch", lambda rep: ack(rep, reporter_epoch=rep.reporter_epoch + 1)),
    ("mismatched sequence", lambda rep: ack(rep, sequence=rep.sequence + 1)),
    ("mismatched older sequence", lambda rep: ack(rep, sequence=rep.sequence - 1)),
    ("mismatched with a bad status", lambda rep: ack(rep, "rejected", sequence=rep.sequence + 5)),
])
def test_acknowledgment_counts_missing_or_mismatched_metadata(case, answer):
    reporter = FeedbackReporter(EPOCH)
    reporter.on_ack(ack(clean_cycle(reporter)))  # sequence 1 delivered
    report = bad_cycle(reporter, EV[0])  # sequence 2
    delivery = reporter.on_ack(answer(report))
    assert delivery.result == "acknowledgment", case
    assert reporter.failures == {**no_failures(), "acknowledgment": 1}
    assert reporter.pending_evidence == 1 and reporter.next_report() is report


def test_acknowledgment_counts_a_repeated_acknowledgment():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    assert reporter.on_ack(ack(report)).result == "delivered"
    repeated = reporter.on_ack(ack(report))
    assert repeated.result == "acknowledgment" and repeated.detail.startswith("repeated")
    # A repeat while a newer report is pending does not acknowledge that one either.
    newer = bad_cycle(reporter, EV[1])
    assert reporter.on_ack(ack(report)).result == "acknowledgment"
    assert reporter.failures == {**no_failures(), "acknowledgment": 2}
    assert reporter.pending_report is newer and reporter.pending_evidence == 1


def test_a_successful_delivery_or_a_cycle_with_no_pending_report_adds_no_failure():
    reporter = FeedbackReporter(EPOCH)
    assert reporter.next_report() is None  # nothing observed yet
    assert reporter.next_report(after_failed_fetch=True) is None
    report = clean_cycle(reporter)
    assert reporter.on_ack(ack(report)).result == "delivered"
    assert reporter.next_report() is None  # delivered, nothing new
    assert reporter.next_report(after_failed_fetch=True) is None
    assert reporter.failures == no_failures() and reporter.delivered == 1


def test_failed_deliveries_retain_evidence_for_retry():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0], EV[1])
    for fail in (lambda: reporter.on_failure("timeout"), lambda: reporter.on_failure("transport"),
                 lambda: reporter.on_ack(ack(report, "rejected")), lambda: reporter.on_ack(None)):
        fail()
        assert reporter.pending_evidence == 2 and reporter.bad_pending
        assert reporter.next_report() is report  # the exact same report again
    assert reporter.on_ack(ack(report)).result == "delivered"
    assert reporter.pending_evidence == 0 and not reporter.bad_pending
    assert reporter.failures == {"timeout": 1, "transport": 1, "status": 1, "acknowledgment": 1}


def test_a_bad_observation_is_retained_until_its_exact_report_is_acknowledged():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    # An acknowledgment naming anything but (EPOCH, report.sequence) clears nothing.
    for wrong in (ack(report, reporter_epoch=EPOCH + 1), ack(report, sequence=report.sequence + 1)):
        reporter.on_ack(wrong)
        assert reporter.pending_evidence == 1 and reporter.pending_report is report
    reporter.on_ack(ack(report))
    assert reporter.pending_evidence == 0 and reporter.pending_report is None


def test_an_acknowledgment_clears_only_the_evidence_its_report_carried():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    # Before its acknowledgment arrives, a new batch and the same one again are rejected.
    reporter.observe(reporter.skew_drops + 2, (EV[1], EV[0]))
    assert reporter.on_ack(ack(report)).result == "delivered"
    assert reporter.pending_evidence == 2 and reporter.bad_pending  # both folded after it was built
    newer = reporter.next_report()
    assert newer.evidence == (EV[1], EV[0]) and newer.sequence == report.sequence + 1
    reporter.on_ack(ack(newer))
    assert reporter.pending_evidence == 0
    # Delivered evidence does not come back in later reports.
    assert bad_cycle(reporter, EV[2]).evidence == (EV[2],)


def test_later_clean_cycles_cannot_replace_an_unacknowledged_bad_report():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    reporter.on_failure("timeout")
    for _ in range(3):
        assert clean_cycle(reporter) is report  # same epoch, sequence and contents
        reporter.on_failure("transport")
    assert reporter.sequence == report.sequence
    reporter.on_ack(ack(report))
    # Once it is acknowledged, the next clean cycle is reported as clean.
    assert clean_cycle(reporter) == FeedbackReport(reporter_epoch=EPOCH, sequence=report.sequence + 1,
                                                   skew_drops=1)


def test_new_rejection_can_supersede_an_unacknowledged_clean_report():
    reporter = FeedbackReporter(EPOCH)
    clean = clean_cycle(reporter)
    reporter.on_failure("timeout")
    bad = bad_cycle(reporter, EV[0])
    assert bad.sequence == clean.sequence + 1 and bad.evidence == (EV[0],) and bad.skew_drops == 1
    assert reporter.pending_report is bad


def test_a_delayed_acknowledgment_for_that_old_clean_cannot_clear_the_newer_bad_evidence():
    reporter = FeedbackReporter(EPOCH)
    clean = clean_cycle(reporter)
    bad = bad_cycle(reporter, EV[0])  # supersedes the clean one before its ack arrives
    delayed = reporter.on_ack(ack(clean))
    assert delayed.result == "acknowledgment"
    assert reporter.pending_report is bad and reporter.pending_evidence == 1 and reporter.bad_pending
    # Later clean cycles still resend the bad report until its own acknowledgment.
    assert clean_cycle(reporter) is bad
    reporter.on_ack(ack(bad))
    assert not reporter.bad_pending


def test_a_newer_bad_report_keeps_the_evidence_of_the_bad_report_it_supersedes():
    reporter = FeedbackReporter(EPOCH)
    first = bad_cycle(reporter, EV[0])
    reporter.on_failure("timeout")
    second = bad_cycle(reporter, EV[1])
    assert second.evidence == (EV[0], EV[1]) and second.skew_drops == 2
    assert reporter.on_ack(ack(first)).result == "acknowledgment"  # too late: superseded
    assert reporter.pending_evidence == 2
    reporter.on_ack(ack(second))
    assert reporter.pending_evidence == 0


def test_failed_fetches_create_no_clean_observation_but_can_retry_pending_bad_evidence():
    reporter = FeedbackReporter(EPOCH)
    # A failed fetch observes nothing: with no pending report there is nothing to send.
    assert reporter.next_report(after_failed_fetch=True) is None
    # An unacknowledged clean report is not retried after a failed fetch.
    clean_cycle(reporter)
    reporter.on_failure("timeout")
    assert reporter.next_report(after_failed_fetch=True) is None
    # Pending bad evidence is.
    bad = bad_cycle(reporter, EV[0])
    reporter.on_failure("timeout")
    assert reporter.next_report(after_failed_fetch=True) is bad
    reporter.on_ack(ack(bad))
    assert reporter.next_report(after_failed_fetch=True) is None
    assert reporter.failures == {**no_failures(), "timeout": 2}


def test_the_highest_sequence_latches_rejected_evidence_instead_of_wrapping():
    reporter = FeedbackReporter(EPOCH)
    reporter.sequence = WIRE_INT_MAX - 1
    clean = clean_cycle(reporter)
    assert clean.sequence == WIRE_INT_MAX
    reporter.on_ack(ack(clean))
    bad = bad_cycle(reporter, EV[0])
    assert bad.sequence == WIRE_INT_MAX  # latched, not wrapped to 0
    # An acknowledgment at the latched sequence cannot name the exact report, so the
    # rejected evidence stays pending and keeps being reported.
    assert reporter.on_ack(ack(bad)).result == "delivered"
    assert reporter.pending_evidence == 1 and reporter.bad_pending
    again = clean_cycle(reporter)
    assert again.sequence == WIRE_INT_MAX and again.evidence == (EV[0],)
    assert wire.decode(wire.encode(again)) == again
    assert reporter.failures == no_failures()


def test_the_highest_counter_value_latches_rejected_evidence_instead_of_wrapping():
    reporter = FeedbackReporter(EPOCH)
    reporter.observe(WIRE_INT_MAX - 1, EV[:1])
    reporter.on_ack(ack(reporter.next_report()))
    # The store's counter latched at WIRE_INT_MAX: no new drop can show any more, so
    # every observation is taken as bad and its evidence is never cleared.
    assert reporter.observe(WIRE_INT_MAX, EV[:2]) is True
    report = reporter.next_report()
    assert report.skew_drops == WIRE_INT_MAX and report.evidence == (EV[1],)
    reporter.on_ack(ack(report))
    assert reporter.observe(WIRE_INT_MAX, EV[:2]) is True
    assert reporter.next_report().evidence == (EV[1],) and reporter.skew_drops == WIRE_INT_MAX


def test_failure_and_delivery_counters_latch_instead_of_wrapping():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, EV[0])
    reporter.failures["timeout"] = WIRE_INT_MAX
    reporter.on_failure("timeout")
    assert reporter.failures["timeout"] == WIRE_INT_MAX
    reporter.delivered = WIRE_INT_MAX
    reporter.on_ack(ack(report))
    assert reporter.delivered == WIRE_INT_MAX


def test_a_report_carries_at_most_the_newest_feedback_evidence_max_rejections():
    reporter = FeedbackReporter(EPOCH)
    report = bad_cycle(reporter, *EV[:FEEDBACK_EVIDENCE_MAX + 10])
    assert report.evidence == EV[10:FEEDBACK_EVIDENCE_MAX + 10]
    assert report.skew_drops == FEEDBACK_EVIDENCE_MAX + 10  # the count keeps every drop
    assert wire.decode(wire.encode(report)) == report


@pytest.mark.parametrize("epoch", [-1, WIRE_INT_MAX + 1])
def test_the_reporter_epoch_must_fit_the_wire(epoch):
    with pytest.raises(ValueError):
        FeedbackReporter(epoch)


# --- the operator's ledger ----------------------------------------------------------------


def report(sequence: int, skew_drops: int = 0, *evidence: SkewEvidence, epoch: int = EPOCH) -> FeedbackReport:
    return FeedbackReport(reporter_epoch=epoch, sequence=sequence, skew_drops=skew_drops, evidence=evidence)


def condition(ledger: GatewayEvidenceLedger, replica: str = "g1", now_wall: float = 1000.0) -> dict:
    return next(c for c in ledger.conditions(now_wall) if c["replica"] == replica)


def test_ledger_a_bad_report_makes_the_replica_unresolved_with_counts_in_the_message():
    ledger = GatewayEvidenceLedger()
    assert ledger.apply("g1", report(1), now_wall=990.0).changed is False  # clean, nothing to keep
    assert condition(ledger)["status"] == "False" and condition(ledger)["reason"] == "NoRejections"
    assert ledger.apply("g1", report(2, 3, EV[0], EV[1]), now_wall=995.0).changed is True
    cond = condition(ledger)
    assert (cond["type"], cond["status"], cond["reason"]) == ("GatewayAgesRejected", "True", "SkewRejected")
    assert cond["message"] == (
        "gateway g1 rejected 3 batch(es) as too far ahead of its wall clock (2 distinct held, latest "
        "b/pool-b publisher_epoch 2000000000); 0 of 5 clean reports to resolve; last report 5s ago")
    assert ledger.unresolved() == ["g1"]


def test_ledger_recovery_needs_consecutive_clean_reports():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(1, 1, EV[0]), now_wall=0.0)
    seq = 1
    for _ in range(RESOLVE_AFTER_CLEAN_REPORTS - 1):
        seq += 1
        assert ledger.apply("g1", report(seq, 1), now_wall=0.0).changed is True
    # One more rejection restarts the count.
    seq += 1
    ledger.apply("g1", report(seq, 2, EV[1]), now_wall=0.0)
    assert ledger.replicas["g1"].clean_streak == 0 and ledger.replicas["g1"].rejections == 2
    for i in range(RESOLVE_AFTER_CLEAN_REPORTS):
        seq += 1
        assert ledger.unresolved() == ["g1"], i
        ledger.apply("g1", report(seq, 2), now_wall=0.0)
    assert ledger.unresolved() == [] and condition(ledger)["reason"] == "ReportsClean"
    assert ledger.replicas["g1"].evidence == []
    # Clean reports on a resolved replica do not call for a write.
    assert ledger.apply("g1", report(seq + 1, 2), now_wall=0.0).changed is False


def test_ledger_a_rising_count_without_evidence_is_still_a_rejection():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(1, 4), now_wall=0.0)  # a first report of an epoch: 4 since 0
    assert ledger.unresolved() == ["g1"] and ledger.replicas["g1"].rejections == 4


def test_ledger_silence_does_not_resolve():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(1, 1, EV[0]), now_wall=0.0)
    cond = condition(ledger, now_wall=30 * 86400.0)  # a month without a word
    assert cond["status"] == "True" and cond["message"].endswith("last report 2592000s ago")


def test_ledger_a_replacement_gateway_does_not_clear_the_replicas_evidence():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(7, 5, EV[0]), now_wall=0.0)
    # A new process of replica g1: new epoch, count from 0, a clean first report.
    ledger.apply("g1", report(1, 0, epoch=EPOCH + 1), now_wall=1.0)
    assert ledger.unresolved() == ["g1"] and ledger.replicas["g1"].clean_streak == 1
    # It counts toward recovery like any clean report from that replica.
    for seq in range(2, RESOLVE_AFTER_CLEAN_REPORTS + 1):
        ledger.apply("g1", report(seq, 0, epoch=EPOCH + 1), now_wall=1.0)
    assert ledger.unresolved() == []


def test_ledger_a_lower_sequence_is_acknowledged_but_does_not_roll_state_back():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(5, 2, EV[0]), now_wall=0.0)
    before = msgspec.json.encode(ledger.replicas["g1"])
    for stale in (report(4, 1, EV[0]), report(5, 2, EV[0]), report(1, 0)):
        result = ledger.apply("g1", stale, now_wall=9.0)
        assert result.stale and not result.changed
    assert msgspec.json.encode(ledger.replicas["g1"]) == before
    # A report of another epoch has its own sequence.
    assert not ledger.apply("g1", report(1, 0, epoch=EPOCH + 1), now_wall=9.0).stale


def test_ledger_at_the_latched_sequence_every_report_is_taken():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(WIRE_INT_MAX, 1, EV[0]), now_wall=0.0)
    result = ledger.apply("g1", report(WIRE_INT_MAX, 2, EV[0], EV[1]), now_wall=0.0)
    assert not result.stale and ledger.replicas["g1"].rejections == 2
    assert ledger.replicas["g1"].evidence == [EV[0], EV[1]]


def test_ledger_keys_replicas_apart():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(1, 1, EV[0]), now_wall=0.0)
    ledger.apply("g2", report(1, 0), now_wall=0.0)
    assert ledger.unresolved() == ["g1"]
    assert [c["status"] for c in ledger.conditions(0.0)] == ["True", "False"]


def test_ledger_bounds_evidence_per_replica():
    ledger = GatewayEvidenceLedger()
    for i in range(3):
        chunk = EV[i * FEEDBACK_EVIDENCE_MAX // 2:(i + 1) * FEEDBACK_EVIDENCE_MAX // 2]
        ledger.apply("g1", report(i + 1, (i + 1) * len(chunk), *chunk), now_wall=0.0)
    half = FEEDBACK_EVIDENCE_MAX // 2
    assert ledger.replicas["g1"].evidence == list(EV[half:3 * half])
    assert len(ledger.replicas["g1"].evidence) == LEDGER_EVIDENCE_MAX


def test_ledger_bounds_reporter_epochs_per_replica():
    ledger = GatewayEvidenceLedger()
    for epoch in range(10):
        ledger.apply("g1", report(1, 0, epoch=epoch), now_wall=0.0)
    epochs = [c.reporter_epoch for c in ledger.replicas["g1"].cursors]
    assert epochs == list(range(10 - LEDGER_EPOCHS_MAX, 10))


def test_ledger_bounds_replicas_evicting_resolved_ones_first():
    ledger = GatewayEvidenceLedger()
    ledger.apply("bad-0", report(1, 1, EV[0]), now_wall=0.0)
    for i in range(1, LEDGER_REPLICAS_MAX):
        ledger.apply(f"ok-{i}", report(1, 0), now_wall=0.0)
    ledger.apply("bad-0", report(2, 2, EV[1]), now_wall=0.0)  # heard from again, most recent
    ledger.apply("new", report(1, 0), now_wall=0.0)
    assert len(ledger.replicas) == LEDGER_REPLICAS_MAX and ledger.evicted == 1
    assert "ok-1" not in ledger.replicas and "bad-0" in ledger.replicas
    # With every replica unresolved, the least recently heard from goes.
    full = GatewayEvidenceLedger()
    for i in range(LEDGER_REPLICAS_MAX + 1):
        full.apply(f"r{i}", report(1, 1, EV[0]), now_wall=0.0)
    assert "r0" not in full.replicas and len(full.unresolved()) == LEDGER_REPLICAS_MAX


def test_ledger_an_administrator_clears_evidence():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(1, 1, EV[0]), now_wall=0.0)
    ledger.apply("g2", report(1, 1, EV[1]), now_wall=0.0)
    assert ledger.clear("g1", now_wall=5.0) == ["g1"]
    assert condition(ledger)["reason"] == "ClearedByAdmin" and ledger.unresolved() == ["g2"]
    assert ledger.clear(None, now_wall=5.0) == ["g2"] and ledger.clear(None, now_wall=5.0) == []
    # A later rejection makes it unresolved again, counting from there.
    ledger.apply("g1", report(2, 3, EV[2]), now_wall=6.0)
    assert ledger.replicas["g1"].rejections == 2 and ledger.replicas["g1"].evidence == [EV[2]]


def test_ledger_round_trips_and_re_applies_its_bounds_on_load():
    ledger = GatewayEvidenceLedger()
    ledger.apply("g1", report(3, 2, EV[0], EV[1]), now_wall=7.0)
    ledger.apply("g2", report(1, 0), now_wall=8.0)
    back = GatewayEvidenceLedger.from_bytes(ledger.to_bytes())
    assert back.conditions(10.0) == ledger.conditions(10.0)
    assert back.apply("g1", report(2, 1, EV[0]), now_wall=11.0).stale  # cursors kept too
    oversized = msgspec.json.encode({"format": 1, "replicas": [
        {"replica": f"r{i}", "unresolved": True, "evidence": msgspec.to_builtins(EV[:100]),
         "cursors": [[e, 1, 1] for e in range(9)]} for i in range(LEDGER_REPLICAS_MAX + 3)]})
    loaded = GatewayEvidenceLedger.from_bytes(oversized)
    assert len(loaded.replicas) == LEDGER_REPLICAS_MAX and "r0" not in loaded.replicas
    assert all(len(r.evidence) == LEDGER_EVIDENCE_MAX and len(r.cursors) == LEDGER_EPOCHS_MAX
               for r in loaded.replicas.values())


@pytest.mark.parametrize("data", [b"", b"{", b'{"format": 2, "replicas": []}', b'{"replicas": [{"x": 1}]}',
                                  b'{"format": 1, "replicas": []} trailing'])
def test_ledger_refuses_an_unreadable_file(data):
    with pytest.raises(LedgerDecodeError):
        GatewayEvidenceLedger.from_bytes(data)


# --- the operator's intake ----------------------------------------------------------------

G1 = PeerIdentity(TD, "a", "gateway", "g1")


async def run_inline(fn, *args):
    """The operator's state IO, on the event loop: a worker thread would let an
    autojumping MockClock leap while it runs."""
    return fn(*args)


def make_operator(tmp_path, state_io=run_inline) -> OperatorService:
    path = tmp_path / "op-a.yaml"
    path.write_text(operator_config("a", "b"))
    return OperatorService(load_config(path, env={}), CollectorRegistry(),
                           wall=lambda: WALL0 + trio.current_time(), state_io=state_io)


async def test_intake_acknowledges_exactly_and_persists_before_answering(tmp_path):
    op = make_operator(tmp_path)
    bad = report(1, 2, EV[0], EV[1])
    assert await op.take_feedback(G1, bad) == FeedbackAck(reporter_epoch=EPOCH, sequence=1,
                                                          status=ACK_ACCEPTED)
    stored = GatewayEvidenceLedger.from_bytes((op.state.path / FEEDBACK_FILE).read_bytes())
    assert stored.unresolved() == ["g1"] and stored.replicas["g1"].evidence == [EV[0], EV[1]]
    # Replays are acknowledged again (idempotent) without rolling anything back.
    assert (await op.take_feedback(G1, bad)).status == ACK_ACCEPTED
    assert (await op.take_feedback(G1, report(0, 0))).status == ACK_ACCEPTED
    assert op.gateway_evidence.replicas["g1"].rejections == 2
    assert op.registry.get_sample_value("grid_signals_feedback_reports_accepted_total") == 3
    assert op.registry.get_sample_value("grid_signals_gateway_replicas_rejecting") == 1
    feedback = op.status()["gateway_feedback"]
    assert feedback["replicas_rejecting"] == ["g1"] and feedback["reports_accepted"] == 3
    assert feedback["stored"]
    assert feedback["conditions"][0]["status"] == "True"


async def test_intake_evidence_survives_an_operator_restart(tmp_path):
    op = make_operator(tmp_path)
    await op.take_feedback(G1, report(4, 1, EV[0]))
    await op.take_feedback(G1, report(5, 1))  # one clean report of the five
    restarted = make_operator(tmp_path)
    await restarted.load_gateway_evidence()
    cond = restarted.status()["gateway_feedback"]["conditions"][0]
    assert cond["replica"] == "g1" and cond["status"] == "True"
    assert "1 of 5 clean reports" in cond["message"]
    assert (await restarted.take_feedback(G1, report(3, 0))).status == ACK_ACCEPTED  # still stale
    assert restarted.gateway_evidence.replicas["g1"].clean_streak == 1
    for seq in range(6, 6 + RESOLVE_AFTER_CLEAN_REPORTS - 1):
        await restarted.take_feedback(G1, report(seq, 1))
    assert restarted.status()["gateway_feedback"]["replicas_rejecting"] == []
    # Resolved durably too.
    again = make_operator(tmp_path)
    await again.load_gateway_evidence()
    assert again.gateway_evidence.conditions(0.0)[0]["reason"] == "ReportsClean"


async def test_intake_an_unreadable_ledger_starts_empty_and_says_so(tmp_path):
    op = make_operator(tmp_path)
    (op.state.path / FEEDBACK_FILE).write_bytes(b"{not json")
    await op.load_gateway_evidence()
    feedback = op.status()["gateway_feedback"]
    assert feedback["conditions"] == [] and FEEDBACK_FILE in feedback["load_error"]
    await op.take_feedback(G1, report(1, 1, EV[0]))  # the next write replaces it
    stored = (op.state.path / FEEDBACK_FILE).read_bytes()
    assert GatewayEvidenceLedger.from_bytes(stored).unresolved() == ["g1"]


async def test_intake_a_failed_write_is_not_acknowledged_as_accepted(tmp_path):
    disk = {"full": True}

    async def state_io(fn, *args):
        if fn is write_durably and disk["full"]:
            raise StateError("no space left on device")
        return fn(*args)

    op = make_operator(tmp_path, state_io)
    bad = report(1, 1, EV[0])
    answer = await op.take_feedback(G1, bad)
    assert answer.status == FEEDBACK_NOT_STORED and (answer.reporter_epoch, answer.sequence) == (EPOCH, 1)
    assert op.status()["gateway_feedback"]["stored"] is False
    # The gateway retries the same report: nothing changes in memory, but the write is due.
    disk["full"] = False
    assert (await op.take_feedback(G1, bad)).status == ACK_ACCEPTED
    assert op.status()["gateway_feedback"]["stored"] is True
    assert op.registry.get_sample_value("grid_signals_feedback_reports_accepted_total") == 1
    assert not (op.state.path / f".{FEEDBACK_FILE}.tmp").exists()


async def test_intake_an_administrator_clears_evidence_durably(tmp_path):
    op = make_operator(tmp_path)
    await op.take_feedback(G1, report(1, 1, EV[0]))
    assert await op.clear_gateway_evidence("g1") == ["g1"]
    assert await op.clear_gateway_evidence(None) == []
    restarted = make_operator(tmp_path)
    await restarted.load_gateway_evidence()
    assert restarted.gateway_evidence.conditions(0.0)[0]["reason"] == "ClearedByAdmin"


async def test_intake_is_keyed_by_the_verified_gateway_identity_over_the_channel(tmp_path):
    op = make_operator(tmp_path)
    # The operator's real endpoint, through the wire codec: the report says nothing about
    # who sent it; the certificate's replica does.
    for who in ("g1", "g2"):
        open_link = memory_link_factory(op.endpoint, PeerIdentity(TD, "a", "gateway", who), {"up": True},
                                        PeerIdentity(TD, "a", "operator"))
        async with open_link() as link:
            replies = await link.exchange(report(1, 1, EV[0]) if who == "g2" else report(1, 0))
        assert replies == [FeedbackAck(reporter_epoch=EPOCH, sequence=1, status=ACK_ACCEPTED)]
    assert op.gateway_evidence.unresolved() == ["g2"] and sorted(op.gateway_evidence.replicas) == ["g1", "g2"]
    # A gateway of another site is refused before its report is read.
    open_link = memory_link_factory(op.endpoint, PeerIdentity(TD, "b", "gateway", "g1"), {"up": True},
                                    PeerIdentity(TD, "a", "operator"))
    async with open_link() as link:
        [refusal] = await link.exchange(report(2, 9, EV[1]))
    assert refusal.reason == "forbidden" and op.gateway_evidence.replicas["g1"].cursors[0].sequence == 1


# --- end to end on MockClock ------------------------------------------------------------


class FeedbackFault:
    """What gateway g1's link does with a FeedbackReport (polls pass untouched):
    ok, hang (never sent), lost_ack (taken by the operator, the answer lost),
    transport (the connection fails), mismatch (the answer names another sequence)."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.reports_sent: list[FeedbackReport] = []


class FaultyLink:
    def __init__(self, link, fault: FeedbackFault) -> None:
        self._link, self._fault = link, fault
        self.identity, self.connections_opened = link.identity, link.connections_opened

    async def exchange(self, msg: wire.Message) -> list[wire.Message]:
        if not isinstance(msg, FeedbackReport):
            return await self._link.exchange(msg)
        mode = self._fault.mode
        if mode == "hang":
            await trio.sleep_forever()
        if mode == "transport":
            raise ChannelError("op-a: connection reset", reason="connect")
        self._fault.reports_sent.append(msg)
        replies = await self._link.exchange(msg)
        if mode == "lost_ack":
            await trio.sleep_forever()
        if mode == "mismatch":
            return [msgspec.structs.replace(r, sequence=r.sequence + 1) for r in replies]
        return replies


class FeedbackGrid(Grid):
    """The grid with operator b's wall clock AHEAD_S ahead. Operator a's hub admits b's
    batches (its own future bound is raised to 900 s); gateway g1 keeps the default 600 s
    bound and so drops every one of them as skew until its own clock is within 600 s of b's
    epoch: at +100 s. Gateway g1's link to operator a goes through a FeedbackFault."""

    AHEAD_S = 700.0

    def __init__(self, tmp_path) -> None:
        self.fault = FeedbackFault()
        super().__init__(tmp_path, walls={"b": lambda: wall() + self.AHEAD_S},
                         operator_yaml={"a": "timings: {future_epoch_bound_s: 900}\n"}, state_io=run_inline,
                         wrap_operator_link=lambda link: FaultyLink(link, self.fault), reporter_epoch=EPOCH)
        self.registry = self.gateway.registry

    def failures(self) -> dict[str, float]:
        return {r: self.registry.get_sample_value("grid_signals_feedback_failures_total", {"reason": r})
                for r in FAILURE_REASONS}

    def skew_drops(self) -> float:
        return self.registry.get_sample_value("grid_signals_ingest_dropped_total", {"reason": "skew"})

    def condition(self) -> dict | None:
        conditions = self.operators["a"].status()["gateway_feedback"]["conditions"]
        return next((c for c in conditions if c["replica"] == "g1"), None)


@pytest.fixture
async def fgrid(tmp_path, autojump_clock):
    async with FeedbackGrid(tmp_path).running(autojump_clock) as grid:
        grid.epoch_b = grid.operators["b"].publisher_epoch
        yield grid


async def test_e2e_a_skewed_peer_is_reported_shown_and_resolved(fgrid, autojump_clock):
    o, gw, reg = fgrid.origin, fgrid.gateway, fgrid.registry
    # Every failure reason is exported from the start, at 0.
    assert fgrid.failures() == dict.fromkeys(FAILURE_REASONS, 0.0)
    assert fgrid.epoch_b == int(WALL0 + o + FeedbackGrid.AHEAD_S)
    # Operator a polls b at +0 (nothing scraped yet) and +5; the gateway's +5.5 poll is the
    # first to carry b's batch, and drops it. Polls +0.5 .. +4.5 were clean, reported, taken.
    await trio.sleep_until(o + 5.4)
    assert fgrid.skew_drops() == 0 and gw.reporter.sequence == 5 and gw.reporter.delivered == 5
    assert fgrid.condition()["status"] == "False"
    await trio.sleep_until(o + 5.6)
    assert fgrid.skew_drops() == 1
    # The evidence names the batch dropped: b's latest when a polled it at +5, which a still
    # holds (its next poll of b is at +10). b's +5 scrape falls on the same instant as that
    # poll, and either may run first, so that batch is b's fifth (the +4 scrape) or sixth.
    held = fgrid.operators["a"].holdings.get("b", "pool-b")
    assert held is not None and ordering(held.batch) in {(fgrid.epoch_b, 5), (fgrid.epoch_b, 6)}
    assert fgrid.fault.reports_sent[-1] == FeedbackReport(
        reporter_epoch=EPOCH, sequence=6, skew_drops=1,
        evidence=(SkewEvidence("b", "pool-b", *ordering(held.batch)),))
    cond = fgrid.condition()
    assert cond["status"] == "True" and cond["reason"] == "SkewRejected"
    assert "rejected 1 batch(es)" in cond["message"]
    assert fgrid.operators["a"].registry.get_sample_value("grid_signals_gateway_replicas_rejecting") == 1
    assert reg.get_sample_value("grid_signals_feedback_pending_evidence") == 0  # delivered
    # Every poll drops b's batch again, until the gateway's clock is within 600 s of b's
    # epoch: the last drop at +99.5, b admitted at +100.5 (exactly the bound is accepted).
    await trio.sleep_until(o + 100.4)
    assert fgrid.skew_drops() == 95 and "b" not in {c.site for c in gw.store.candidates.values()}
    assert "rejected 95 batch(es)" in fgrid.condition()["message"]
    await trio.sleep_until(o + 100.6)
    assert fgrid.skew_drops() == 95 and ("b", "pool-b") in gw.store.candidates
    assert "1 of 5 clean reports" in fgrid.condition()["message"]
    # Five clean reports in a row (+100.5 .. +104.5) resolve it.
    await trio.sleep_until(o + 104.4)
    assert fgrid.condition()["status"] == "True"
    await trio.sleep_until(o + 104.6)
    assert fgrid.condition()["reason"] == "ReportsClean"
    assert fgrid.operators["a"].registry.get_sample_value("grid_signals_gateway_replicas_rejecting") == 0
    # 105 polls, one report each, all delivered; no poll failed because of reporting.
    assert gw.poll_results == {"ok": 105} and gw.reporter.delivered == 105
    assert fgrid.failures() == dict.fromkeys(FAILURE_REASONS, 0.0)
    # Report contents never become metric labels.
    for family in reg.collect():
        if "feedback" in family.name:
            assert all(set(s.labels) <= {"reason"} for s in family.samples), family.name


async def test_e2e_failed_deliveries_are_counted_by_reason_and_evidence_is_retried(fgrid, autojump_clock):
    o, gw = fgrid.origin, fgrid.gateway
    op_a = fgrid.operators["a"]
    await trio.sleep_until(o + 10.25)  # skew drops since +5.5, each one delivered
    assert gw.reporter.delivered == 10 and fgrid.skew_drops() == 5

    # The operator takes the report but its answer never arrives: the report's own 2 s
    # budget expires. The poll itself succeeded; the next one starts when the report
    # gave up, so polls run 2 s apart (+10.5, +12.5, ...), each successful.
    fgrid.fault.mode = "lost_ack"
    await trio.sleep_until(o + 12.499)
    assert fgrid.failures()["timeout"] == 0
    await trio.sleep_until(o + 12.501)
    assert fgrid.failures() == {"timeout": 1, "transport": 0, "status": 0, "acknowledgment": 0}
    assert gw.reporter.pending_evidence == 1 and gw.reporter.bad_pending
    await trio.sleep_until(o + 20.4)  # timeouts at +14.5, +16.5, +18.5 too
    assert fgrid.failures()["timeout"] == 4 and gw.poll_results == {"ok": 15}
    assert gw.operator_state == "up"

    # The connection fails on every report: one transport failure per poll, 1 s apart again.
    fgrid.fault.mode = "transport"  # the +18.5 report, already hanging, times out at +20.5
    await trio.sleep_until(o + 24.6)  # polls at +20.5 .. +24.5: five failed reports
    assert fgrid.failures() == {"timeout": 5, "transport": 5, "status": 0, "acknowledgment": 0}

    # The operator answers without accepting (an endpoint without a feedback intake).
    fgrid.fault.mode = "ok"
    op_a.endpoint.feedback = None
    await trio.sleep_until(o + 27.6)  # +25.5, +26.5, +27.5
    assert fgrid.failures() == {"timeout": 5, "transport": 5, "status": 3, "acknowledgment": 0}

    # The answer names another sequence.
    op_a.endpoint.feedback = op_a.take_feedback
    fgrid.fault.mode = "mismatch"
    await trio.sleep_until(o + 29.6)  # +28.5, +29.5
    assert fgrid.failures() == {"timeout": 5, "transport": 5, "status": 3, "acknowledgment": 2}
    # All that time the evidence was kept, and every report carried it.
    assert gw.reporter.pending_evidence >= 1
    assert all(r.evidence for r in fgrid.fault.reports_sent[10:])

    # Delivered again: the evidence is acknowledged and cleared, the counts stay.
    fgrid.fault.mode = "ok"
    await trio.sleep_until(o + 30.6)
    assert gw.reporter.pending_evidence == 0 and not gw.reporter.bad_pending
    assert fgrid.failures() == {"timeout": 5, "transport": 5, "status": 3, "acknowledgment": 2}
    assert gw.poll_results == {"ok": 26}  # +0.5..+10.5 (11), +12.5..+18.5 (4), +20.5..+30.5 (11)
    assert fgrid.condition()["status"] == "True"
    status = gw.status()["feedback"]
    assert status["reporter_epoch"] == EPOCH and status["failures"] == {
        "timeout": 5, "transport": 5, "status": 3, "acknowledgment": 2}


async def test_e2e_failed_polls_retry_only_pending_bad_evidence(fgrid, autojump_clock):
    o, gw = fgrid.origin, fgrid.gateway
    await trio.sleep_until(o + 6.25)
    # Operator a stops answering anything. The pending bad report is retried after each
    # failed poll: poll timeout (2 s) then report timeout (2 s), cycles 4 s apart.
    fgrid.fault.mode = "hang"  # the +6.5 report hangs first, so one bad report is pending
    await trio.sleep_until(o + 6.75)
    fgrid.up["a"]["up"] = False
    await trio.sleep_until(o + 16.6)  # report timeout +8.5; poll +8.5 fails +10.5, report +12.5; ...
    assert gw.poll_results == {"ok": 7, "timeout": 2}
    assert fgrid.failures() == {"timeout": 3, "transport": 0, "status": 0, "acknowledgment": 0}
    pending = gw.reporter.pending_report
    assert pending.evidence and pending.sequence == 7  # the same report, never rebuilt
    # The operator is back: the next successful poll folds a new drop and delivers it all.
    fgrid.up["a"]["up"] = True
    fgrid.fault.mode = "ok"
    await trio.sleep_until(o + 20.6)
    assert gw.reporter.pending_evidence == 0 and gw.reporter.sequence > 7
    assert fgrid.operators["a"].gateway_evidence.replicas["g1"].cursors[-1].sequence == gw.reporter.sequence


async def test_e2e_a_clean_pending_report_is_not_retried_after_a_failed_poll(tmp_path, autojump_clock):
    async with FeedbackGrid(tmp_path).running(autojump_clock) as grid:
        o, gw = grid.origin, grid.gateway
        await trio.sleep_until(o + 2.25)  # clean reports at +0.5 and +1.5, taken
        grid.fault.mode = "transport"
        await trio.sleep_until(o + 2.75)  # the +2.5 clean report failed
        grid.up["a"]["up"] = False
        await trio.sleep_until(o + 12.0)
        # Polls at +3.5, +5.5, +7.5 and +9.5 timed out (+11.5's is still waiting); no
        # report followed any of them: the pending report is clean.
        assert gw.poll_results == {"ok": 3, "timeout": 4}
        assert grid.failures() == {"timeout": 0, "transport": 1, "status": 0, "acknowledgment": 0}
        assert not gw.reporter.bad_pending and gw.reporter.pending_report.sequence == 3


async def test_e2e_reporter_state_survives_reloads_and_replacing_the_poller_loses_no_drop(
        fgrid, autojump_clock, tmp_path):
    o, gw = fgrid.origin, fgrid.gateway
    reporter = gw.reporter
    await trio.sleep_until(o + 6.25)
    # A staged reload, and a rejected one, publish nothing and touch no reporter state.
    # The gateway opened its link to operator a once, when its poller started at +0.5.
    before = reporter.status()
    assert fgrid.operator_links_opened == [o + 0.5]
    autojump_clock.autojump_threshold = math.inf  # stage() checks files in a worker thread
    await gw.stage(load_config(tmp_path / "gw-a.yaml", env={}))
    (tmp_path / "gw-bad.yaml").write_text(GATEWAY.replace("a-gateway-g1-key.pem", "missing-key.pem"))
    with pytest.raises(Exception, match="missing-key.pem"):
        await gw.stage(load_config(tmp_path / "gw-bad.yaml", env={}))
    autojump_clock.autojump_threshold = 0
    assert reporter.status() == before and fgrid.operator_links_opened == [o + 0.5]  # no new poller

    # The +6.5 cycle folds its skew drop, then its report hangs. Operator a stops relaying
    # b's batch (until its +10 peer poll), so every cycle after this one is clean.
    fgrid.fault.mode = "hang"
    await trio.sleep_until(o + 6.75)
    fgrid.operators["a"].holdings.forget("b", "pool-b")
    pending = reporter.pending_report
    assert (pending.sequence, pending.skew_drops, reporter.bad_pending) == (7, 2, True)
    # A certificate rotation is committed mid-exchange: the poller is cancelled and a new
    # one starts at once.
    write_certs(tmp_path / "certs", WALL0 + 6.75)
    autojump_clock.autojump_threshold = math.inf
    gw.commit(await gw.stage(load_config(tmp_path / "gw-a.yaml", env={})))
    autojump_clock.autojump_threshold = 0
    fgrid.fault.mode = "ok"
    await trio.sleep_until(o + 6.8)
    assert fgrid.operator_links_opened == [o + 0.5, o + 6.75]  # the new poller's link
    # The cancelled exchange counted nothing. The same reporter (epoch, sequence, count,
    # evidence) went on with the new poller, whose first cycle was clean and so sent the
    # retained bad report again, exactly, and had it acknowledged.
    assert gw.reporter is reporter and reporter.reporter_epoch == EPOCH
    assert fgrid.failures() == dict.fromkeys(FAILURE_REASONS, 0.0)
    assert fgrid.fault.reports_sent[-1] == pending
    assert reporter.pending_evidence == 0 and not reporter.bad_pending
    record = fgrid.operators["a"].gateway_evidence.replicas["g1"]
    assert record.rejections == 2 and msgspec.to_builtins(record.cursors[-1]) == [EPOCH, 7, 2]
    # The next cycle is clean and reported as such.
    await trio.sleep_until(o + 7.8)
    assert fgrid.fault.reports_sent[-1] == FeedbackReport(reporter_epoch=EPOCH, sequence=8, skew_drops=2)
