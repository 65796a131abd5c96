"""The values of a gateway rejection report exchange (spec: Gateway rejection reports).

A gateway's reporter (gridd.core.feedback) builds a ``FeedbackReport`` of its skew
rejections (``SkewEvidence``, which admission remembers); its operator's ledger answers with
a ``FeedbackAck``. gridd.wire carries both as signals-channel messages: each is tagged in
the ``kind`` field, so a tag here is part of the wire format and is never reused or renamed
(docs/wire.md); ``SkewEvidence`` is ``array_like`` and only ever grows at the end.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from gridd.core.batch import WIRE_INT_MAX

__all__ = [
    "ACK_ACCEPTED",
    "FEEDBACK_EVIDENCE_MAX",
    "FeedbackAck",
    "FeedbackReport",
    "SkewEvidence",
]

# A feedback report carries at most this many pending skew rejections.
FEEDBACK_EVIDENCE_MAX: Final = 64

# The one FeedbackAck.status that means the report was taken; anything else is counted
# as grid_signals_feedback_failures_total{reason="status"} (DESIGN 5b).
ACK_ACCEPTED: Final = "accepted"

_UInt = Annotated[int, msgspec.Meta(ge=0, le=WIRE_INT_MAX)]

_EvidenceName = Annotated[str, msgspec.Meta(max_length=253)]
"""Site and provider names are far shorter (config allows 63); the bound keeps a gateway's
reports, and the operator's durable ledger built from them, small."""


class SkewEvidence(msgspec.Struct, frozen=True, array_like=True):
    """A batch rejected because its publisher epoch was too far ahead of the receiver."""

    site: _EvidenceName
    provider: _EvidenceName
    publisher_epoch: int
    batch_sequence: int


class FeedbackReport(msgspec.Struct, frozen=True, tag="report", tag_field="kind", omit_defaults=True):
    """Gateway -> its own operator: skew rejections (spec: Gateway rejection reports).

    reporter_epoch: random, drawn once per gateway process; survives reloads.
    sequence: report sequence within reporter_epoch; latches at WIRE_INT_MAX.
    skew_drops: cumulative grid_signals_ingest_dropped_total{reason="skew"}; latches.
    evidence: pending skew-rejected batches, at most FEEDBACK_EVIDENCE_MAX; empty means
        a clean observation.
    """

    reporter_epoch: _UInt
    sequence: _UInt
    skew_drops: _UInt
    evidence: Annotated[tuple[SkewEvidence, ...], msgspec.Meta(max_length=FEEDBACK_EVIDENCE_MAX)] = ()


class FeedbackAck(msgspec.Struct, frozen=True, tag="ack", tag_field="kind", omit_defaults=True):
    """Operator -> gateway: the answer to one FeedbackReport, echoing its identity.

    status: ACK_ACCEPTED, or anything else for not accepted (counted as ``status``).
    """

    reporter_epoch: _UInt
    sequence: _UInt
    status: str
    detail: str = ""
