"""Gateway rejection reports: the gateway's reporter and the operator's evidence ledger.

Spec, "Gateway rejection reports": after each committed successful ingest and routing
refresh, a gateway reports its grid_signals_ingest_dropped_total{reason="skew"} evidence
to its local operator over the authenticated signals channel, in its own bounded
exchange. docs/feedback.md is the long form.

``FeedbackReporter`` (gateway side) is the state machine of one gateway process:

    observe(skew_drops_total, evidence)   one committed observation, once per successful poll
    next_report(after_failed_fetch=...)   the report to deliver now, or None
    on_ack(ack) / on_failure(reason)      the delivery's outcome, counted by reason

``GatewayEvidenceLedger`` (operator side) keeps, per gateway replica, the latest accepted
report per reporter epoch and the unresolved skew evidence behind the GatewayAgesRejected
condition, and serialises itself for the state directory.

Pure: no IO, no trio; wall-clock seconds come in as ``now_wall``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final, Literal

import msgspec

from gridd.core.batch import WIRE_INT_MAX
from gridd.core.feedback_values import (
    ACK_ACCEPTED,
    FEEDBACK_EVIDENCE_MAX,
    FeedbackAck,
    FeedbackReport,
    SkewEvidence,
)

__all__ = [
    "CONDITION_TYPE",
    "FAILURE_REASONS",
    "LEDGER_EPOCHS_MAX",
    "LEDGER_EVIDENCE_MAX",
    "LEDGER_REPLICAS_MAX",
    "RESOLVE_AFTER_CLEAN_REPORTS",
    "Delivery",
    "FailureReason",
    "FeedbackReporter",
    "GatewayEvidenceLedger",
    "IntakeResult",
    "LedgerDecodeError",
    "ReplicaRecord",
    "ReporterCursor",
]

FailureReason = Literal["timeout", "transport", "status", "acknowledgment"]

# Spec: "Its bounded reasons are timeout for an expired exchange budget, transport for
# connection, authentication, or HTTP errors, status for a non-204 response, and
# acknowledgment for missing, repeated, or mismatched acknowledgment metadata."
FAILURE_REASONS: Final[tuple[FailureReason, ...]] = ("timeout", "transport", "status", "acknowledgment")


def _latched_add(value: int, step: int = 1) -> int:
    # Spec: "The highest sequence and counter values latch ... instead of wrapping."
    return min(value + step, WIRE_INT_MAX)


class Delivery(msgspec.Struct, frozen=True):
    """The outcome of one delivery attempt. ``result`` is "delivered" or a FailureReason;
    ``detail`` is for logs only (report contents never become metric labels)."""

    result: Literal["delivered", "timeout", "transport", "status", "acknowledgment"]
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.result != "delivered"


# --- gateway side ---------------------------------------------------------------------


class FeedbackReporter:
    """The skew-rejection reporter of one gateway process.

    reporter_epoch: random, drawn once per process by the caller; with the sequence, the
        cumulative count and the pending evidence it lives as long as the process, so it
        survives committed poller and certificate reloads (the caller never rebuilds it).

    A "bad" observation is one whose cumulative skew-drop count rose since the last one
    observed (or whose count is latched at WIRE_INT_MAX: a latched counter cannot show a
    new drop, so every observation is taken as bad). A "clean" one did not rise.
    """

    def __init__(self, reporter_epoch: int) -> None:
        if not 0 <= reporter_epoch <= WIRE_INT_MAX:
            raise ValueError(f"reporter_epoch {reporter_epoch} is outside 0..{WIRE_INT_MAX}")
        self.reporter_epoch = reporter_epoch
        # The sequence of the report built last (0: none yet). Latches at WIRE_INT_MAX.
        self.sequence = 0
        # Cumulative grid_signals_ingest_dropped_total{reason="skew"} as last observed.
        self.skew_drops = 0
        # Unacknowledged skew evidence, oldest first, each with the number of the
        # observation that folded it last (an ack clears only what its report carried).
        self._evidence: OrderedDict[SkewEvidence, int] = OrderedDict()
        self._observations = 0
        # A bad observation folded that no built report carries yet.
        self._bad_folded = False
        # A clean observation folded that no built report carries yet.
        self._clean_folded = False
        # The exact report built last and not yet acknowledged, and what it carries.
        self._report: FeedbackReport | None = None
        self._report_bad = False
        self._report_observation = 0
        self._acked_sequence = 0
        self.delivered = 0
        self.failures: dict[FailureReason, int] = dict.fromkeys(FAILURE_REASONS, 0)
        self.last_failure: Delivery | None = None

    # --- observations ---------------------------------------------------------------

    def observe(self, skew_drops_total: int, evidence: tuple[SkewEvidence, ...]) -> bool:
        """Fold one committed observation: the store's cumulative skew-drop count and its
        recent skew evidence (oldest first). Returns True for a bad observation.

        Call it once per committed successful ingest, before anything can cancel (spec:
        "The reporter folds a committed observation before refresh and cancellation, so
        replacing a poller during refresh cannot lose a genuine skew drop"). Never after a
        failed fetch (spec: "Failed fetches create no clean observation").
        """
        self._observations += 1
        new_drops = skew_drops_total - self.skew_drops
        latched = self.skew_drops >= WIRE_INT_MAX
        if new_drops > 0 or latched:
            # Each skew drop moved its batch to the end of the store's evidence, so the
            # last `new_drops` entries are the ones rejected since the last observation.
            fresh = evidence[-new_drops:] if new_drops > 0 else ()
            for item in fresh:
                self._evidence.pop(item, None)
                self._evidence[item] = self._observations
            while len(self._evidence) > FEEDBACK_EVIDENCE_MAX:
                self._evidence.popitem(last=False)
            self.skew_drops = min(max(self.skew_drops, skew_drops_total), WIRE_INT_MAX)
            self._bad_folded = True
            self._clean_folded = False
            return True
        # Spec: "Later clean cycles cannot replace an unacknowledged bad report." While
        # bad evidence is pending a clean observation adds nothing to deliver.
        if not self.bad_pending:
            self._clean_folded = True
        return False

    @property
    def bad_pending(self) -> bool:
        """Bad evidence not yet acknowledged (folded, or in the report awaiting its ack)."""
        return self._bad_folded or (self._report is not None and self._report_bad)

    @property
    def pending_evidence(self) -> int:
        """Skew-rejected batches not yet acknowledged (the gauge)."""
        return len(self._evidence)

    # --- reports --------------------------------------------------------------------

    def next_report(self, *, after_failed_fetch: bool = False) -> FeedbackReport | None:
        """The report to deliver now, or None when nothing is pending (spec: "a cycle
        with no pending report adds no failure").

        after_failed_fetch: this cycle's poll failed, so it folded no observation; only
        pending bad evidence is retried (spec: "Failed fetches create no clean
        observation, but can retry pending bad evidence").
        """
        if self._bad_folded:
            # Spec: "New rejection can supersede an unacknowledged clean report." A new
            # report (new sequence) carries every unacknowledged piece of evidence, so it
            # supersedes an unacknowledged bad one too without dropping what that carried.
            return self._build(bad=True)
        if self._report is not None and self._report_bad:
            # Spec: "A bad observation is retained until its exact report is
            # acknowledged." Sent again as it was: same epoch, sequence and contents.
            return self._report
        if after_failed_fetch:
            return None
        if self._clean_folded:
            return self._build(bad=False)
        # An unacknowledged clean report with no newer observation (None: nothing pending).
        return self._report

    def _build(self, *, bad: bool) -> FeedbackReport:
        self.sequence = _latched_add(self.sequence)
        self._report = FeedbackReport(
            reporter_epoch=self.reporter_epoch,
            sequence=self.sequence,
            skew_drops=self.skew_drops,
            # Empty means a clean observation (gridd.wire.FeedbackReport).
            evidence=tuple(self._evidence) if bad else (),
        )
        self._report_bad = bad
        self._report_observation = self._observations
        self._bad_folded = self._clean_folded = False
        return self._report

    @property
    def pending_report(self) -> FeedbackReport | None:
        """The exact report built last and not yet acknowledged."""
        return self._report

    # --- outcomes -------------------------------------------------------------------

    def on_ack(self, ack: FeedbackAck | None) -> Delivery:
        """Judge the operator's answer to the pending report. ``ack`` None: the exchange
        ended without exactly one acknowledgment (missing metadata)."""
        report = self._report
        if ack is None:
            return self._fail("acknowledgment", "the answer carried no acknowledgment")
        if report is None or (ack.reporter_epoch, ack.sequence) != (report.reporter_epoch, report.sequence):
            # Spec: "acknowledgment for missing, repeated, or mismatched acknowledgment
            # metadata". Only the pending report's exact (epoch, sequence) acknowledges
            # anything, so a delayed acknowledgment for an older, superseded report
            # cannot clear newer evidence.
            repeated = ack.reporter_epoch == self.reporter_epoch and 0 < ack.sequence <= self._acked_sequence
            pending = "nothing" if report is None else f"({report.reporter_epoch}, {report.sequence})"
            return self._fail("acknowledgment",
                              f"{'repeated' if repeated else 'mismatched'} acknowledgment "
                              f"({ack.reporter_epoch}, {ack.sequence}); pending {pending}")
        if ack.status != ACK_ACCEPTED:
            # DESIGN 5b: anything but accepted is the spec's "non-204" (status).
            return self._fail("status", f"operator answered {ack.status!r}: {ack.detail}")
        self.delivered = _latched_add(self.delivered)
        self._acked_sequence = report.sequence
        if self._report_bad and (report.sequence >= WIRE_INT_MAX or report.skew_drops >= WIRE_INT_MAX):
            # Spec: "The highest sequence and counter values latch rejected evidence
            # instead of wrapping." A latched sequence names every later report alike
            # and a latched count hides new drops, so no acknowledgment can name the
            # exact report that carries a rejection: the evidence stays pending.
            return Delivery("delivered", "latched: rejected evidence is retained")
        # Clear exactly what this report carried; evidence folded after it was built
        # (a re-rejection of the same batch included) stays for the next report.
        for item in [e for e, seen in self._evidence.items() if seen <= self._report_observation]:
            del self._evidence[item]
        self._report = None
        self._report_bad = False
        return Delivery("delivered")

    def on_failure(self, reason: Literal["timeout", "transport"], detail: str = "") -> Delivery:
        """The exchange itself failed: its budget expired (timeout), or the channel
        failed: connection, authentication, refusal or protocol (transport). Spec:
        "Failed deliveries retain evidence for retry and do not fail scrapes"."""
        return self._fail(reason, detail)

    def _fail(self, reason: FailureReason, detail: str) -> Delivery:
        # Spec: "grid_signals_feedback_failures_total{reason} counts each failed
        # delivery attempt once." Evidence and the pending report are kept.
        self.failures[reason] = _latched_add(self.failures[reason])
        self.last_failure = Delivery(reason, detail)
        return self.last_failure

    def status(self) -> dict[str, object]:
        report = self._report
        return {
            "reporter_epoch": self.reporter_epoch,
            "sequence": self.sequence,
            "skew_drops": self.skew_drops,
            "pending_report": None if report is None else {
                "sequence": report.sequence, "bad": self._report_bad, "evidence": len(report.evidence)},
            "bad_pending": self.bad_pending,
            "pending_evidence": self.pending_evidence,
            "delivered": self.delivered,
            "failures": dict(self.failures),
            "last_failure": None if self.last_failure is None
            else f"{self.last_failure.result}: {self.last_failure.detail}",
        }


# --- operator side ----------------------------------------------------------------------

CONDITION_TYPE: Final = "GatewayAgesRejected"

# Recovery (docs/feedback.md): unresolved evidence of a replica resolves after this many
# accepted clean reports from it in a row, or when an administrator clears it. Nothing
# else does: not silence, not a new reporter epoch, not an operator restart.
RESOLVE_AFTER_CLEAN_REPORTS: Final = 5
# Bounds of the ledger (and so of the state file): replicas, evidence entries per replica,
# and reporter epochs remembered per replica.
LEDGER_REPLICAS_MAX: Final = 64
LEDGER_EVIDENCE_MAX: Final = FEEDBACK_EVIDENCE_MAX
LEDGER_EPOCHS_MAX: Final = 4
LEDGER_FORMAT: Final = 1


class ReporterCursor(msgspec.Struct, array_like=True):
    """The latest accepted report of one reporter epoch: its sequence and count."""

    reporter_epoch: int
    sequence: int
    skew_drops: int


class ReplicaRecord(msgspec.Struct, kw_only=True):
    """What the operator keeps about one gateway replica (verified identity)."""

    replica: str
    unresolved: bool = False
    # Distinct skew-rejected batches reported while unresolved, oldest first.
    evidence: list[SkewEvidence] = msgspec.field(default_factory=list)
    # Skew drops reported since the evidence became unresolved (latched).
    rejections: int = 0
    clean_streak: int = 0
    rejected_since_wall: float | None = None
    last_rejected_wall: float | None = None
    last_report_wall: float | None = None
    resolved_wall: float | None = None
    # "" (never rejected), "clean_reports" or "admin".
    resolved_by: str = ""
    # Most recently updated last.
    cursors: list[ReporterCursor] = msgspec.field(default_factory=list)

    def cursor(self, reporter_epoch: int) -> ReporterCursor | None:
        return next((c for c in self.cursors if c.reporter_epoch == reporter_epoch), None)

    def condition(self, now_wall: float) -> dict[str, object]:
        """The GatewayAgesRejected condition of this replica (status is a string, as in
        Kubernetes conditions). Counts travel in the message, never in metric labels."""
        heard = ("no report yet" if self.last_report_wall is None
                 else f"last report {max(0.0, now_wall - self.last_report_wall):.0f}s ago")
        if self.unresolved:
            latest = self.evidence[-1] if self.evidence else None
            example = ("" if latest is None else
                       f", latest {latest.site}/{latest.provider} publisher_epoch {latest.publisher_epoch}")
            return {
                "type": CONDITION_TYPE, "replica": self.replica, "status": "True", "reason": "SkewRejected",
                "message": (f"gateway {self.replica} rejected {self.rejections} batch(es) as too far "
                            f"ahead of its wall clock ({len(self.evidence)} distinct held{example}); "
                            f"{self.clean_streak} of {RESOLVE_AFTER_CLEAN_REPORTS} clean reports to resolve; "
                            f"{heard}"),
            }
        if self.resolved_by == "admin":
            reason, message = "ClearedByAdmin", (f"gateway {self.replica}: evidence cleared by an "
                                                 "administrator")
        elif self.resolved_by == "clean_reports":
            reason, message = "ReportsClean", (f"gateway {self.replica}: {RESOLVE_AFTER_CLEAN_REPORTS} clean "
                                               "reports in a row since its last skew rejection")
        else:
            reason, message = "NoRejections", f"gateway {self.replica} reported no skew rejections"
        return {"type": CONDITION_TYPE, "replica": self.replica, "status": "False", "reason": reason,
                "message": f"{message}; {heard}"}


class IntakeResult(msgspec.Struct, frozen=True):
    """changed: what the recovery rule depends on changed (unresolved or not, the evidence
    held, the clean streak): write the ledger before acknowledging. Counts and cursors
    alone do not call for a write; they ride along with the next one.
    stale: the report was behind the latest accepted one of its epoch (acknowledged,
    state untouched)."""

    changed: bool
    stale: bool = False


class _StoredLedger(msgspec.Struct):
    format: int = LEDGER_FORMAT
    replicas: list[ReplicaRecord] = msgspec.field(default_factory=list)


_LEDGER_ENCODER: Final = msgspec.json.Encoder()
_LEDGER_DECODER: Final = msgspec.json.Decoder(_StoredLedger)


class LedgerDecodeError(ValueError):
    """A stored ledger that cannot be read back."""


class GatewayEvidenceLedger:
    """Per-replica skew evidence reported by this operator's own gateways.

    Keyed by the replica the gateway's verified certificate names (DESIGN 2: feedback is
    accepted only from this site's gateways; the channel checks that before calling).
    """

    def __init__(self) -> None:
        # Insertion order = least recently reported first (eviction order).
        self.replicas: OrderedDict[str, ReplicaRecord] = OrderedDict()
        self.evicted = 0

    # --- intake ---------------------------------------------------------------------

    def apply(self, replica: str, report: FeedbackReport, *, now_wall: float) -> IntakeResult:
        """Take one report from gateway ``replica``; the caller acknowledges it as
        accepted (after writing the ledger durably when ``changed``)."""
        record = self.replicas.get(replica)
        if record is None:
            record = self._admit_replica(replica)
        cursor = record.cursor(report.reporter_epoch)
        if cursor is not None and (report.sequence < cursor.sequence
                                   or (report.sequence == cursor.sequence < WIRE_INT_MAX)):
            # A replay or a delayed report: acknowledged (idempotent), never rolling the
            # state back. At WIRE_INT_MAX the sequence is latched and every later report
            # of the epoch carries it, so such a report is taken.
            return IntakeResult(changed=False, stale=True)
        self.replicas.move_to_end(replica)
        previous = cursor.skew_drops if cursor is not None else 0
        rose = report.skew_drops > previous
        bad = rose or bool(report.evidence) or report.skew_drops >= WIRE_INT_MAX
        if cursor is None:
            cursor = ReporterCursor(report.reporter_epoch, report.sequence, report.skew_drops)
        else:
            record.cursors.remove(cursor)
            cursor.sequence = report.sequence
            cursor.skew_drops = max(cursor.skew_drops, report.skew_drops)
        record.cursors.append(cursor)
        del record.cursors[:-LEDGER_EPOCHS_MAX]
        record.last_report_wall = now_wall
        if bad:
            changed = not record.unresolved or record.clean_streak > 0
            if not record.unresolved:
                record.unresolved = True
                record.rejected_since_wall = now_wall
                record.rejections = 0
                record.resolved_wall, record.resolved_by = None, ""
            record.rejections = _latched_add(record.rejections, max(report.skew_drops - previous, 0))
            record.last_rejected_wall = now_wall
            record.clean_streak = 0
            held = OrderedDict.fromkeys(record.evidence)
            for item in report.evidence:
                held.pop(item, None)
                held[item] = None
            evidence = list(held)[-LEDGER_EVIDENCE_MAX:]
            changed = changed or set(evidence) != set(record.evidence)
            record.evidence = evidence
            return IntakeResult(changed=changed)
        if record.unresolved:
            record.clean_streak += 1
            if record.clean_streak >= RESOLVE_AFTER_CLEAN_REPORTS:
                self._resolve(record, now_wall, "clean_reports")
            return IntakeResult(changed=True)
        return IntakeResult(changed=False)

    def _admit_replica(self, replica: str) -> ReplicaRecord:
        while len(self.replicas) >= LEDGER_REPLICAS_MAX:
            # Evict the least recently reported resolved replica; only if every one is
            # unresolved, the least recently reported of those (counted in status).
            victim = next((r for r, rec in self.replicas.items() if not rec.unresolved), None)
            if victim is None:
                victim = next(iter(self.replicas))
            del self.replicas[victim]
            self.evicted = _latched_add(self.evicted)
        record = self.replicas[replica] = ReplicaRecord(replica=replica)
        return record

    @staticmethod
    def _resolve(record: ReplicaRecord, now_wall: float, by: str) -> None:
        record.unresolved = False
        record.evidence = []
        record.clean_streak = 0
        record.resolved_wall, record.resolved_by = now_wall, by

    def clear(self, replica: str | None, *, now_wall: float) -> list[str]:
        """An administrator resolves one replica's evidence (None: every replica's).
        Returns the replicas whose evidence was cleared."""
        cleared = []
        for name, record in self.replicas.items():
            if (replica is None or name == replica) and record.unresolved:
                self._resolve(record, now_wall, "admin")
                cleared.append(name)
        return cleared

    # --- reading --------------------------------------------------------------------

    def unresolved(self) -> list[str]:
        return sorted(r for r, rec in self.replicas.items() if rec.unresolved)

    def conditions(self, now_wall: float) -> list[dict[str, object]]:
        return [self.replicas[r].condition(now_wall) for r in sorted(self.replicas)]

    # --- storage --------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        return _LEDGER_ENCODER.encode(_StoredLedger(replicas=list(self.replicas.values())))

    @classmethod
    def from_bytes(cls, data: bytes) -> GatewayEvidenceLedger:
        """Read a stored ledger back, re-applying every bound (a file is not trusted to
        respect them). Raises LedgerDecodeError."""
        try:
            stored = _LEDGER_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise LedgerDecodeError(str(exc)) from None
        if stored.format != LEDGER_FORMAT:
            raise LedgerDecodeError(f"ledger format {stored.format}, this gridd reads {LEDGER_FORMAT}")
        ledger = cls()
        for record in stored.replicas[-LEDGER_REPLICAS_MAX:]:
            record.evidence = record.evidence[-LEDGER_EVIDENCE_MAX:]
            record.cursors = record.cursors[-LEDGER_EPOCHS_MAX:]
            ledger.replicas[record.replica] = record
        return ledger
