"""Signals-channel messages and their MessagePack codec.

Every frame on the signals channel (operator <-> peer operator, gateway <-> its own
operator; one WebSocket over mutual TLS) is one MessagePack-encoded ``Message``: a
tagged union of frozen msgspec Structs whose tag travels in the ``kind`` field.
The encoder and the decoder are built once here and reused for every frame.

The messages carry the core's values (batches, cursors and keys from gridd.core.batch,
readings from gridd.core.readings, serving routes from gridd.core.serving, the rejection
report and its acknowledgment from gridd.core.feedback_values); this module defines the
envelopes around them and the codec, and re-exports the values it carries so one import
names the whole wire vocabulary. The core never imports this module.

Evolution rules (docs/wire.md has the full text):

- A new field always gets a default, and a default never changes once released, so
  an older sender's frame (which lacks the field, or omits it because it was at its
  default) decodes on a newer receiver, and a newer sender's extra field is ignored by
  an older receiver (unknown fields are not forbidden on the wire).
- ``array_like`` structs (``Cursor`` and ``SourceKey`` in gridd.core.batch, ``SkewEvidence``
  in gridd.core.feedback_values, ``UnitLoad``, ``Revision`` and ``BatchOrder`` in
  gridd.core.readings) only ever grow at the end.
- A tag is never reused or renamed; an unknown tag is a decode error, counted.
- ``protocol`` carries the major version. It is required (never defaulted, so never
  omitted), and a peer whose major version differs is refused with ``Error("protocol")``
  and the connection is closed. Compatible changes do not bump it.

Only wire shape is checked at decode. Payload rules (non-negative counts, fractions in
0..1, complete batches carrying all their samples) are checked by admission
(gridd.core.payload.validate_payload), after decode, so a batch whose payload fails
still yields its ordering metadata and advances its fence (DESIGN 5b).
"""

from __future__ import annotations

from typing import Final

import msgspec

from gridd.core.batch import WIRE_INT_MAX, Batch, Cursor, SourceKey, ordering, with_added_age
from gridd.core.feedback_values import (
    ACK_ACCEPTED,
    FEEDBACK_EVIDENCE_MAX,
    FeedbackAck,
    FeedbackReport,
    SkewEvidence,
)
from gridd.core.serving import LocalProvider, SiteIngress
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

# Error.reason values gridd sends. Receivers treat an unknown reason as a refusal too.
ERROR_REASONS: Final = frozenset({"protocol", "identity", "forbidden", "decode", "unexpected"})


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

