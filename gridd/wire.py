"""Signals-channel messages and their MessagePack codec.

Every frame on the signals channel (operator <-> peer operator, gateway <-> its own
operator; one WebSocket over mutual TLS) is one MessagePack-encoded ``Message``: a
tagged union of frozen msgspec Structs whose tag travels in the ``kind`` field.
The encoder and the decoder are built once here and reused for every frame.

Evolution rules (docs/wire.md has the full text):

- A new field always gets a default, and a default never changes once released, so
  an older sender's frame (which lacks the field, or omits it because it was at its
  default) decodes on a newer receiver, and a newer sender's extra field is ignored by
  an older receiver (unknown fields are not forbidden on the wire).
- ``array_like`` structs (``Cursor``, ``SourceKey``, ``SkewEvidence`` here; ``UnitLoad``
  and ``Revision`` in gridd.core.readings) only ever grow at the end.
- A tag is never reused or renamed; an unknown tag is a decode error, counted.
- ``protocol`` carries the major version. It is required (never defaulted, so never
  omitted), and a peer whose major version differs is refused with ``Error("protocol")``
  and the connection is closed. Compatible changes do not bump it.

Only wire shape is checked at decode. Payload rules (non-negative counts, fractions in
0..1, complete batches carrying all their samples) are checked by admission
(gridd.core.admission.validate_payload), after decode, so a batch whose payload fails
still yields its ordering metadata and advances its fence (DESIGN 5b).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from gridd.core.readings import BatchOrder, LatencyBlock, LoadSignals, Revision
from gridd.errors import GriddError

__all__ = [
    "ACK_ACCEPTED",
    "ERROR_REASONS",
    "FEEDBACK_EVIDENCE_MAX",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "WIRE_INT_MAX",
    "Batch",
    "Batches",
    "Cursor",
    "Error",
    "FeedbackAck",
    "FeedbackReport",
    "LocalProvider",
    "Message",
    "Poll",
    "ServingConfig",
    "SiteIngress",
    "SkewEvidence",
    "SourceKey",
    "WireDecodeError",
    "WireEncodeError",
    "WireError",
    "decode",
    "encode",
    "ordering",
    "protocol_refusal",
    "with_added_age",
]

# Major protocol version. Bumped only for a change an older peer cannot read safely.
PROTOCOL_VERSION: Final = 1

# decode() refuses a larger frame before parsing it; encode() refuses to produce one.
# The WebSocket layer must accept messages at least this large (trio-websocket's own
# max_message_size defaults to 1 MiB).
MAX_FRAME_BYTES: Final = 8 * 1024 * 1024

# The largest counter or sequence on the wire (int64, the widest msgspec bound checks).
# Counters and sequences latch here instead of wrapping (spec: "The highest sequence
# and counter values latch").
WIRE_INT_MAX: Final = 2**63 - 1

# A feedback report carries at most this many pending skew rejections.
FEEDBACK_EVIDENCE_MAX: Final = 64

# The one FeedbackAck.status that means the report was taken; anything else is counted
# as grid_signals_feedback_failures_total{reason="status"} (DESIGN 5b).
ACK_ACCEPTED: Final = "accepted"

# Error.reason values gridd sends. Receivers treat an unknown reason as a refusal too.
ERROR_REASONS: Final = frozenset({"protocol", "identity", "forbidden", "decode", "unexpected"})

_UInt = Annotated[int, msgspec.Meta(ge=0, le=WIRE_INT_MAX)]


# --- errors -------------------------------------------------------------------------


class WireError(GriddError):
    """A frame could not be encoded or decoded. ``reason`` is a bounded metric label."""

    reason: str = "wire"


class WireDecodeError(WireError):
    """An inbound frame was refused: oversize, malformed, wrong schema or unknown tag.

    Always ``reason == "decode"``, the grid_signals_ingest_dropped_total label; the
    message says which of those it was, for logs only.
    """

    reason = "decode"


class WireEncodeError(WireError):
    """An outbound message could not be encoded (a value out of range, or oversize)."""

    reason = "encode"


# --- shared parts -------------------------------------------------------------------


class SourceKey(msgspec.Struct, frozen=True, array_like=True):
    """One provider at one site: the key of every per-provider reading."""

    site: str
    provider: str


class Cursor(msgspec.Struct, frozen=True, array_like=True):
    """The (publisher_epoch, batch_sequence) of the batch a poller holds for one provider."""

    site: str
    provider: str
    publisher_epoch: int
    batch_sequence: int


class Batch(msgspec.Struct, frozen=True, omit_defaults=True):
    """One provider's publication from one scrape (DESIGN 5). Relays forward it whole.

    revision: None when the publication has no revision metadata; such a batch cannot
        be ordered and disables learning downstream, but its pressure signals are usable.
    complete: qualified and complete (DESIGN 5b): the scrape succeeded, was not cut at
        the body cap, and the batch carries revision metadata and all of its samples.
    ready: the operator's readiness verdict; None = unknown (no ready-endpoint series).
    ready_reason: the verdict's reason (the provider's Ready condition reason).
    load / latency: None when the scrape produced none (failed, or too few requests).
    probes: probe metadata, ``<prefix>.<name>`` -> value.
    probe_age_s: per probes key, how much older than the batch's sample the value is (the
        time since the probe tick that produced it; a failing probe keeps its last values,
        which age). A receiver's value age is ``age_s + probe_age_s[key]``; a key absent here
        (an older operator) is as old as the batch.
    published_ms: the operator's wall clock at publication, milliseconds.
    age_s: how old the sample is at send time, in seconds. Relative, so no receiver
        trusts a sender's monotonic clock; each relay adds its holding time.
    order: (publisher_epoch, batch_sequence) of a batch without revision metadata, so
        receivers order every batch by epoch and sequence (see ordering()). None on a
        batch with a revision (the revision carries them) and from older operators,
        whose revision-less batches are ordered by published_ms.
    """

    site: str
    provider: str
    model: str
    published_ms: int
    age_s: float
    revision: Revision | None = None
    complete: bool = False
    ready: bool | None = None
    ready_reason: str = ""
    load: LoadSignals | None = None
    latency: LatencyBlock | None = None
    probes: dict[str, float] = {}
    order: BatchOrder | None = None
    probe_age_s: dict[str, float] = {}


def ordering(batch: Batch) -> tuple[int, int] | None:
    """The (publisher_epoch, batch_sequence) a receiver orders ``batch`` by: its revision's,
    else its order's; None for a revision-less batch from an older operator."""
    if batch.revision is not None:
        return batch.revision.publisher_epoch, batch.revision.batch_sequence
    if batch.order is not None:
        return batch.order.publisher_epoch, batch.order.batch_sequence
    return None


_EvidenceName = Annotated[str, msgspec.Meta(max_length=253)]
"""Site and provider names are far shorter (config allows 63); the bound keeps a gateway's
reports, and the operator's durable ledger built from them, small."""


class SkewEvidence(msgspec.Struct, frozen=True, array_like=True):
    """A batch rejected because its publisher epoch was too far ahead of the receiver."""

    site: _EvidenceName
    provider: _EvidenceName
    publisher_epoch: int
    batch_sequence: int


class LocalProvider(msgspec.Struct, frozen=True, omit_defaults=True):
    """How a gateway forwards to one of its own site's providers. Carries a secret.

    No readiness verdict travels here (spec: "The serving config carries the same
    verdict for local providers as admission: none").
    """

    provider: str
    model: str
    endpoint_url: str
    auth_scheme: str = "none"
    api_key: str | None = None
    headers: dict[str, str] = {}
    timeout_s: float | None = None

    def __repr__(self) -> str:
        # Keep api_key and header values out of logs and tracebacks.
        key = None if self.api_key is None else "***REDACTED***"
        return (
            f"LocalProvider(provider={self.provider!r}, model={self.model!r}, "
            f"endpoint_url={self.endpoint_url!r}, auth_scheme={self.auth_scheme!r}, "
            f"api_key={key!r}, headers={sorted(self.headers)!r}, timeout_s={self.timeout_s!r})"
        )


class SiteIngress(msgspec.Struct, frozen=True):
    """Where another site's gateways take requests routed to that site."""

    site: str
    url: str


# --- messages -----------------------------------------------------------------------


class Poll(msgspec.Struct, frozen=True, tag="poll", tag_field="kind", omit_defaults=True):
    """Client -> server: send me what you hold. The first Poll doubles as the hello.

    cursors (optional): the batch the poller already holds per provider. The server
        may leave out a batch whose (publisher_epoch, batch_sequence) equals the
        cursor, listing its key in ``Batches.unchanged`` instead.
    """

    protocol: int
    sent_wall: float
    cursors: tuple[Cursor, ...] = ()


class Batches(msgspec.Struct, frozen=True, tag="batches", tag_field="kind", omit_defaults=True):
    """Server -> client: the batches the server holds, answering one Poll.

    To a peer operator only the sender's own site's batches; to a gateway of its own
    site, every site's. ``batches`` plus ``unchanged`` name every provider the server
    holds: a provider in neither is no longer held by the server.
    """

    protocol: int
    sent_wall: float
    batches: tuple[Batch, ...] = ()
    unchanged: tuple[SourceKey, ...] = ()
    removed: tuple[SourceKey, ...] = ()


class ServingConfig(msgspec.Struct, frozen=True, tag="serving", tag_field="kind", omit_defaults=True):
    """Operator -> its own site's gateways only: where to forward requests.

    Sent after a gateway's first Poll and again whenever it changes; never to a peer
    operator, since it carries local provider credentials.
    """

    providers: tuple[LocalProvider, ...] = ()
    ingresses: tuple[SiteIngress, ...] = ()


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


class Error(msgspec.Struct, frozen=True, tag="error", tag_field="kind", omit_defaults=True):
    """Either side: a refusal. The sender closes the connection after it.

    reason: one of ERROR_REASONS (a receiver treats any other value as a refusal too).
    detail: human-readable, for logs; never a metric label.
    """

    reason: str
    detail: str = ""


Message = Poll | Batches | ServingConfig | FeedbackReport | FeedbackAck | Error

# Built once, reused for every frame (msgspec perf-tips).
_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One message -> one frame. Raises WireEncodeError, never a msgspec error."""
    try:
        frame = _ENCODER.encode(msg)
    except (msgspec.MsgspecError, OverflowError, TypeError, ValueError) as exc:
        raise WireEncodeError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(frame) > MAX_FRAME_BYTES:
        raise WireEncodeError(
            f"{type(msg).__name__} frame is {len(frame)} bytes, over the {MAX_FRAME_BYTES}-byte limit"
        )
    return frame


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """One frame -> one message. Raises WireDecodeError, never a msgspec error."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        # A WebSocket text message arrives as str: not a signals-channel frame.
        raise WireDecodeError(f"frame is {type(frame).__name__}, not bytes")
    # Checked before parsing, so an oversize frame costs no decode work.
    if len(frame) > MAX_FRAME_BYTES:
        raise WireDecodeError(f"frame is {len(frame)} bytes, over the {MAX_FRAME_BYTES}-byte limit")
    try:
        return _DECODER.decode(frame)
    except msgspec.MsgspecError as exc:
        # DecodeError (malformed, truncated, trailing bytes) and its subclass
        # ValidationError (wrong schema, unknown tag, constraint) alike.
        raise WireDecodeError(str(exc)) from exc


def protocol_refusal(peer_protocol: int) -> Error | None:
    """The Error to send a peer speaking another major version, else None."""
    if peer_protocol == PROTOCOL_VERSION:
        return None
    return Error(
        reason="protocol",
        detail=f"protocol {peer_protocol} not supported; this side speaks {PROTOCOL_VERSION}",
    )


def with_added_age(batch: Batch, held_s: float) -> Batch:
    """The batch as a relay forwards it: its age plus the time the relay held it.

    held_s is a monotonic-clock difference taken by the relay itself; a negative value
    (impossible from a monotonic clock) is treated as 0 so age never runs backwards.
    """
    return msgspec.structs.replace(batch, age_s=batch.age_s + max(held_s, 0.0))
