"""The operator's intake of gateway rejection reports, kept durably (docs/feedback.md).

Each gateway of this site reports the batches it dropped as skewed; the per-replica evidence
(gridd.core.feedback.GatewayEvidenceLedger) lives in ``<state_dir>/gateway_feedback.json``.
Writes are serialized, and a report is acknowledged as accepted only once what it changed is
on disk; otherwise the answer is ``not_stored`` and the gateway keeps its evidence for retry.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from gridd.core.feedback import GatewayEvidenceLedger, LedgerDecodeError
from gridd.errors import StateError
from gridd.probes.sinks import RunIO
from gridd.state import write_durably
from gridd.tls import PeerIdentity
from gridd.wire import ACK_ACCEPTED, FeedbackAck, FeedbackReport

log = logging.getLogger("gridd.operator")

# The gateway evidence ledger in the state directory (docs/feedback.md).
FEEDBACK_FILE = "gateway_feedback.json"
# The FeedbackAck status when the ledger could not be written durably: the gateway counts
# it as `status` and keeps its evidence for retry.
FEEDBACK_NOT_STORED = "not_stored"


class GatewayFeedbackIntake:
    """Gateway rejection reports (spec): per-replica evidence, kept durably in ``state_dir``."""

    def __init__(self, state_dir: pathlib.Path, registry: CollectorRegistry, *,
                 wall: Callable[[], float], state_io: RunIO) -> None:
        """state_io runs the ledger's blocking file IO off the event loop (tests on a MockClock
        pass one that stays on it, so virtual time does not leap while a thread runs)."""
        self.path = state_dir / FEEDBACK_FILE
        self._wall = wall
        self._state_io = state_io
        self.ledger = GatewayEvidenceLedger()
        self._lock = trio.Lock()
        self._version = 0  # bumped per change
        self._written = 0  # the version last written durably
        self.load_error: str | None = None
        self.reports_accepted = 0
        self._reports = Counter(
            "grid_signals_feedback_reports_accepted", "Gateway feedback reports acknowledged as accepted.",
            registry=registry)
        # Unlabelled: report contents (replicas included) never become metric labels.
        Gauge("grid_signals_gateway_replicas_rejecting",
              "Gateway replicas of this site with unresolved skew-rejection evidence (GatewayAgesRejected).",
              registry=registry).set_function(lambda: len(self.ledger.unresolved()))

    async def load(self) -> None:
        """Read the ledger back before the signals channel opens (spec: recovery rules
        "preserve unresolved replica evidence across ... operator restart"). An unreadable
        file is logged and shown in status, and the next write replaces it."""
        path = self.path

        def read() -> bytes | None:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

        try:
            data = await self._state_io(read)
            if data is not None:
                self.ledger = GatewayEvidenceLedger.from_bytes(data)
        except (OSError, LedgerDecodeError) as exc:
            self.load_error = f"{path}: {exc}"
            log.error("gateway feedback evidence unreadable, starting empty: %s", self.load_error)
            return
        unresolved = self.ledger.unresolved()
        if unresolved:
            log.warning("gateway replicas with unresolved skew rejections: %s", ", ".join(unresolved))

    async def _store(self) -> bool:
        """Write the ledger durably, off the event loop, if a change is not on disk yet.
        True once every change so far is written (by this call or a concurrent one)."""
        async with self._lock:
            if self._written >= self._version:
                return True
            version, data = self._version, self.ledger.to_bytes()
            try:
                await self._state_io(write_durably, self.path, data)
            except StateError as exc:
                log.error("gateway feedback evidence not stored: %s", exc)
                return False
            self._written = version
            return True

    async def take(self, identity: PeerIdentity, report: FeedbackReport) -> FeedbackAck:
        """The signals channel's feedback intake: one report from a verified gateway of this
        site, answered once its effect is durable."""
        result = self.ledger.apply(identity.replica or "", report, now_wall=self._wall())
        if result.changed:
            self._version += 1
        # A replayed report changes nothing but still waits for an earlier failed write.
        if not await self._store():
            return FeedbackAck(reporter_epoch=report.reporter_epoch, sequence=report.sequence,
                               status=FEEDBACK_NOT_STORED, detail="the evidence could not be written durably")
        self._reports.inc()
        self.reports_accepted += 1
        return FeedbackAck(reporter_epoch=report.reporter_epoch, sequence=report.sequence,
                           status=ACK_ACCEPTED)

    async def clear(self, replica: str | None) -> list[str]:
        """An administrator resolves GatewayAgesRejected for one replica (None: all)."""
        cleared = self.ledger.clear(replica, now_wall=self._wall())
        if cleared:
            self._version += 1
            if not await self._store():
                raise StateError("gateway feedback evidence cleared in memory but not written durably")
            log.info("gateway skew evidence cleared by an administrator: %s", ", ".join(cleared))
        return cleared

    def status(self) -> dict[str, Any]:
        """gridctl status's ``gateway_feedback``: independent of peer diagnostics (spec), it
        explains discarded signals and changes no network phase and no routing."""
        return {
            "conditions": self.ledger.conditions(self._wall()),
            "replicas_rejecting": self.ledger.unresolved(),
            "reports_accepted": self.reports_accepted,
            "evicted_replicas": self.ledger.evicted,
            "stored": self._written >= self._version,
            "load_error": self.load_error,
        }
