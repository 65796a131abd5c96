"""Signals-channel codec: round trips, every failure mapped to WireDecodeError, evolution."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gridd import wire
from gridd.core.readings import LatencyBlock, LoadSignals, Revision, UnitLoad
from gridd.errors import GriddError
from gridd.wire import (
    ACK_ACCEPTED,
    FEEDBACK_EVIDENCE_MAX,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    WIRE_INT_MAX,
    Batch,
    Batches,
    Cursor,
    Error,
    FeedbackAck,
    FeedbackReport,
    LocalProvider,
    Poll,
    ServingConfig,
    SiteIngress,
    SkewEvidence,
    SourceKey,
    WireDecodeError,
    WireEncodeError,
    decode,
    encode,
    protocol_refusal,
    with_added_age,
)

FULL_BATCH = Batch(
    site="b",
    provider="m",
    model="Qwen/Qwen3.5-9B",
    published_ms=1_790_000_000_123,
    age_s=0.25,
    revision=Revision("u1", 7, 1_790_000_000, 11, 3),
    complete=True,
    ready=True,
    ready_reason="Ready",
    load=LoadSignals(
        ready_endpoints=2,
        units=(UnitLoad("10.0.0.1:8000", 3.0, 1.0, None, 4.0), UnitLoad("10.0.0.2:8000", 2.0, 0.0)),
        avg_running=2.5,
        avg_waiting=0.5,
        kv_mean=0.4,
        kv_spread=0.1,
        flow_queue=1.0,
        in_flight=7.0,
        queue_full_units=0,
    ),
    latency=LatencyBlock(30.0, 42, 0.12, 0.3, 0.02, 0.0),
    probes={"performance.num_requests_waiting": 1.0, "probe.kv": 0.4},
)

MESSAGES = [
    Poll(protocol=PROTOCOL_VERSION, sent_wall=1_790_000_000.5),
    Poll(
        protocol=PROTOCOL_VERSION,
        sent_wall=1_790_000_000.5,
        cursors=(Cursor("a", "m", 1_790_000_000, 4), Cursor("b", "m", 1_790_000_100, 1)),
    ),
    Batches(protocol=PROTOCOL_VERSION, sent_wall=1.0),
    Batches(
        protocol=PROTOCOL_VERSION,
        sent_wall=1_790_000_001.0,
        batches=(
            FULL_BATCH,
            Batch(site="a", provider="v", model="m", published_ms=5, age_s=0.0),
        ),
        unchanged=(SourceKey("c", "m"),),
    ),
    ServingConfig(),
    ServingConfig(
        providers=(
            LocalProvider("m", "Qwen/Qwen3.5-9B", "http://10.0.0.1:8000/v1"),
            LocalProvider(
                "n", "llama", "https://n.local/v1", "bearer", "sk-secret", {"x-org": "grid"}, 300.0
            ),
        ),
        ingresses=(SiteIngress("b", "https://gw.b.example:8443"),),
    ),
    FeedbackReport(reporter_epoch=2**62 + 5, sequence=3, skew_drops=0),
    FeedbackReport(
        reporter_epoch=1,
        sequence=WIRE_INT_MAX,
        skew_drops=WIRE_INT_MAX,
        evidence=(SkewEvidence("b", "m", 1_790_000_900, 2),),
    ),
    FeedbackAck(reporter_epoch=1, sequence=3, status=ACK_ACCEPTED),
    FeedbackAck(reporter_epoch=1, sequence=3, status="rejected", detail="not a gateway of site a"),
    Error(reason="protocol", detail="protocol 2 not supported"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_from_bytearray_and_memoryview(msg):
    frame = encode(msg)
    assert decode(bytearray(frame)) == msg
    assert decode(memoryview(frame)) == msg


def test_tag_travels_in_kind_field():
    raw = msgspec.msgpack.decode(encode(Poll(protocol=PROTOCOL_VERSION, sent_wall=2.0)))
    assert raw == {"kind": "poll", "protocol": PROTOCOL_VERSION, "sent_wall": 2.0}
    tags = {type(m).__name__: msgspec.msgpack.decode(encode(m))["kind"] for m in MESSAGES}
    assert tags == {
        "Poll": "poll",
        "Batches": "batches",
        "ServingConfig": "serving",
        "FeedbackReport": "report",
        "FeedbackAck": "ack",
        "Error": "error",
    }


def test_protocol_is_encoded_even_though_it_equals_the_current_version():
    # Omitting it would let a future major version read its own default in its place.
    raw = msgspec.msgpack.decode(encode(Batches(protocol=PROTOCOL_VERSION, sent_wall=0.0)))
    assert raw["protocol"] == PROTOCOL_VERSION


def _expect_decode_error(frame) -> WireDecodeError:
    with pytest.raises(WireDecodeError) as info:
        decode(frame)
    assert info.value.reason == "decode"
    assert isinstance(info.value, GriddError)
    return info.value


BAD_FRAMES = {
    "empty": b"",
    "never-used byte": b"\xc1",
    "junk": b"\xff\xfe\xfd\x00\x01",
    "unknown tag": msgspec.msgpack.encode({"kind": "gossip", "protocol": 1}),
    "no tag": msgspec.msgpack.encode({"protocol": 1, "sent_wall": 1.0}),
    "tag not a string": msgspec.msgpack.encode({"kind": 7, "protocol": 1, "sent_wall": 1.0}),
    "not a map": msgspec.msgpack.encode(["poll", 1, 1.0]),
    "a bare int": msgspec.msgpack.encode(5),
    "missing required field": msgspec.msgpack.encode({"kind": "poll", "sent_wall": 1.0}),
    "wrong field type": msgspec.msgpack.encode({"kind": "poll", "protocol": "1", "sent_wall": 1.0}),
    "batch missing site": msgspec.msgpack.encode(
        {
            "kind": "batches",
            "protocol": 1,
            "sent_wall": 1.0,
            "batches": [{"provider": "m", "model": "x", "published_ms": 1, "age_s": 0.0}],
        }
    ),
    "revision too short": msgspec.msgpack.encode(
        {
            "kind": "batches",
            "protocol": 1,
            "sent_wall": 1.0,
            "batches": [
                {
                    "site": "b",
                    "provider": "m",
                    "model": "x",
                    "published_ms": 1,
                    "age_s": 0.0,
                    "revision": ["u1", 7, 1],
                },
            ],
        }
    ),
    "negative report sequence": msgspec.msgpack.encode(
        {"kind": "report", "reporter_epoch": 1, "sequence": -1, "skew_drops": 0}
    ),
    "report sequence above int64": msgspec.msgpack.encode(
        {"kind": "report", "reporter_epoch": 1, "sequence": 2**64 - 1, "skew_drops": 0}
    ),
    "too much evidence": msgspec.msgpack.encode(
        {
            "kind": "report",
            "reporter_epoch": 1,
            "sequence": 1,
            "skew_drops": 65,
            "evidence": [["b", "m", 10, i] for i in range(FEEDBACK_EVIDENCE_MAX + 1)],
        }
    ),
    "trailing junk": encode(MESSAGES[1]) + b"\x00",
    "two frames glued": encode(MESSAGES[0]) + encode(MESSAGES[0]),
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frames_raise_wire_decode_error(frame):
    _expect_decode_error(frame)


def test_unknown_tag_names_the_tag():
    err = _expect_decode_error(msgspec.msgpack.encode({"kind": "gossip"}))
    assert "gossip" in str(err)


def test_text_frame_is_refused():
    err = _expect_decode_error("poll")
    assert "str" in str(err)


def test_evidence_at_its_bound_decodes():
    report = FeedbackReport(
        reporter_epoch=1,
        sequence=1,
        skew_drops=FEEDBACK_EVIDENCE_MAX,
        evidence=tuple(SkewEvidence("b", "m", 10, i) for i in range(FEEDBACK_EVIDENCE_MAX)),
    )
    assert decode(encode(report)) == report


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_a_decode_error(msg):
    frame = encode(msg)
    for split in range(len(frame)):
        with pytest.raises(WireDecodeError):
            decode(frame[:split])


def _error_frame_of_size(size: int) -> bytes:
    # Error(reason, detail): the frame grows one byte per detail character once the
    # detail is long enough for a fixed-width string header.
    overhead = len(msgspec.msgpack.encode(Error(reason="decode", detail="x" * 100_000))) - 100_000
    return msgspec.msgpack.encode(Error(reason="decode", detail="x" * (size - overhead)))


def test_frame_at_the_size_limit_decodes():
    frame = _error_frame_of_size(MAX_FRAME_BYTES)
    assert len(frame) == MAX_FRAME_BYTES
    msg = decode(frame)
    assert isinstance(msg, Error)
    assert len(msg.detail) > MAX_FRAME_BYTES - 100


def test_frame_one_byte_over_the_limit_is_refused_before_decoding():
    frame = _error_frame_of_size(MAX_FRAME_BYTES + 1)
    assert len(frame) == MAX_FRAME_BYTES + 1
    err = _expect_decode_error(frame)
    assert "limit" in str(err)
    # Not parsed: an oversize frame of pure junk gets the same refusal.
    assert "limit" in str(_expect_decode_error(b"\xc1" * (MAX_FRAME_BYTES + 1)))


def test_encode_refuses_an_oversize_frame():
    with pytest.raises(WireEncodeError) as info:
        encode(Error(reason="decode", detail="x" * MAX_FRAME_BYTES))
    assert info.value.reason == "encode"


def test_encode_maps_msgspec_errors():
    with pytest.raises(WireEncodeError):
        encode(FeedbackReport(reporter_epoch=1, sequence=2**64, skew_drops=0))


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_never_raise_anything_but_wire_decode_error(data):
    try:
        msg = decode(data)
    except WireDecodeError as err:
        assert err.reason == "decode"
    else:
        assert isinstance(msg, Poll | Batches | ServingConfig | FeedbackReport | FeedbackAck | Error)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_flipped_bytes_never_raise_anything_but_wire_decode_error(msg):
    frame = encode(msg)
    for i in range(len(frame)):
        corrupt = frame[:i] + bytes([frame[i] ^ 0xFF]) + frame[i + 1 :]
        try:
            back = decode(corrupt)
        except WireDecodeError as err:
            assert err.reason == "decode"
        else:
            assert isinstance(back, Poll | Batches | ServingConfig | FeedbackReport | FeedbackAck | Error)


# --- hypothesis round trip for Batch ------------------------------------------------

_text = st.text(max_size=12)
_float = st.floats(allow_nan=False)
_opt_float = st.none() | _float
_int = st.integers(min_value=-(2**63), max_value=2**63 - 1)

_units = st.builds(UnitLoad, _text, _opt_float, _opt_float, _opt_float, _opt_float)
_load = st.builds(
    LoadSignals,
    ready_endpoints=st.none() | _int,
    units=st.lists(_units, max_size=4).map(tuple),
    avg_running=_opt_float,
    avg_waiting=_opt_float,
    kv_mean=_opt_float,
    kv_spread=_opt_float,
    flow_queue=_float,
    in_flight=_opt_float,
    queue_full_units=_int,
)
_latency = st.builds(LatencyBlock, _float, _int, _opt_float, _opt_float, _opt_float, _opt_float)
_revision = st.builds(Revision, _text, _int, _int, _int, _int)
_batch = st.builds(
    Batch,
    site=_text,
    provider=_text,
    model=_text,
    published_ms=_int,
    age_s=_float,
    revision=st.none() | _revision,
    complete=st.booleans(),
    ready=st.none() | st.booleans(),
    ready_reason=_text,
    load=st.none() | _load,
    latency=st.none() | _latency,
    probes=st.dictionaries(_text, _float, max_size=4),
)


@given(st.lists(_batch, max_size=3), _float)
@settings(max_examples=150, deadline=None)
def test_batch_round_trip_property(batches, sent_wall):
    msg = Batches(protocol=PROTOCOL_VERSION, sent_wall=sent_wall, batches=tuple(batches))
    assert decode(encode(msg)) == msg


# --- frozen, helpers ----------------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen(msg):
    field = msg.__struct_fields__[0]
    with pytest.raises(AttributeError):
        setattr(msg, field, getattr(msg, field))


def test_batch_and_parts_are_frozen():
    with pytest.raises(AttributeError):
        FULL_BATCH.age_s = 1.0
    with pytest.raises(AttributeError):
        SkewEvidence("b", "m", 1, 2).batch_sequence = 3
    with pytest.raises(AttributeError):
        LocalProvider("m", "x", "http://h/v1").api_key = "k"


def test_with_added_age_adds_holding_time_and_keeps_the_rest():
    aged = with_added_age(FULL_BATCH, 1.5)
    assert aged.age_s == 1.75
    assert msgspec.structs.replace(aged, age_s=FULL_BATCH.age_s) == FULL_BATCH
    assert FULL_BATCH.age_s == 0.25
    assert with_added_age(with_added_age(FULL_BATCH, 1.0), 2.0).age_s == 3.25


def test_with_added_age_never_runs_backwards():
    assert with_added_age(FULL_BATCH, -3.0).age_s == 0.25


def test_protocol_refusal():
    assert protocol_refusal(PROTOCOL_VERSION) is None
    refusal = protocol_refusal(PROTOCOL_VERSION + 1)
    assert refusal == Error(reason="protocol", detail=refusal.detail)
    assert str(PROTOCOL_VERSION + 1) in refusal.detail
    assert protocol_refusal(0).reason == "protocol"


def test_local_provider_repr_hides_secrets():
    lp = LocalProvider("n", "llama", "https://n.local/v1", "bearer", "sk-secret", {"x-token": "hdr-secret"})
    text = repr(lp)
    assert "sk-secret" not in text and "hdr-secret" not in text
    assert "***REDACTED***" in text and "x-token" in text
    assert "sk-secret" not in repr(ServingConfig(providers=(lp,)))


def test_defaults_are_omitted_from_frames():
    small = Batch(site="a", provider="v", model="m", published_ms=5, age_s=0.0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(small))
    assert set(raw) == {"site", "provider", "model", "published_ms", "age_s"}


# --- schema evolution ----------------------------------------------------------------


class _PollV0(msgspec.Struct, frozen=True, tag="poll", tag_field="kind"):
    """Poll as a release before cursors existed."""

    protocol: int
    sent_wall: float


class _BatchV0(msgspec.Struct, frozen=True):
    """Batch before latency and probe metadata were added."""

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


class _BatchesV0(msgspec.Struct, frozen=True, tag="batches", tag_field="kind"):
    protocol: int
    sent_wall: float
    batches: list[_BatchV0] = []


class _UnitLoadV0(msgspec.Struct, frozen=True, array_like=True):
    """UnitLoad before in_flight was appended."""

    unit: str
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None


class _LoadSignalsV0(msgspec.Struct, frozen=True):
    ready_endpoints: int | None = None
    units: tuple[_UnitLoadV0, ...] = ()


class _PollV2(msgspec.Struct, frozen=True, tag="poll", tag_field="kind"):
    """A later, compatible Poll with a field this release does not know."""

    protocol: int
    sent_wall: float
    cursors: tuple[Cursor, ...] = ()
    max_batches: int = 0


def test_older_poll_decodes_with_new_field_defaulted():
    frame = msgspec.msgpack.encode(_PollV0(protocol=1, sent_wall=3.0))
    assert decode(frame) == Poll(protocol=1, sent_wall=3.0, cursors=())


def test_older_batch_decodes_with_new_fields_defaulted():
    old = _BatchesV0(
        protocol=1,
        sent_wall=4.0,
        batches=[
            _BatchV0(
                site="b",
                provider="m",
                model="x",
                published_ms=9,
                age_s=0.5,
                revision=Revision("u1", 7, 100, 11, 1),
                complete=True,
                ready=True,
                load=LoadSignals(units=(UnitLoad("e1", 1.0, 0.0),)),
            )
        ],
    )
    msg = decode(msgspec.msgpack.encode(old))
    assert isinstance(msg, Batches)
    (batch,) = msg.batches
    assert batch.latency is None and batch.probes == {}
    assert batch.revision == Revision("u1", 7, 100, 11, 1)
    assert batch.load is not None and batch.load.units == (UnitLoad("e1", 1.0, 0.0),)


def test_array_like_struct_from_older_release_gets_appended_default():
    old_load = _LoadSignalsV0(ready_endpoints=1, units=(_UnitLoadV0("e1", 2.0, 1.0, 0.5),))
    frame = msgspec.msgpack.encode(
        {
            "kind": "batches",
            "protocol": 1,
            "sent_wall": 0.0,
            "batches": [
                {
                    "site": "b",
                    "provider": "m",
                    "model": "x",
                    "published_ms": 1,
                    "age_s": 0.0,
                    "load": old_load,
                },
            ],
        }
    )
    (batch,) = decode(frame).batches
    assert batch.load.units == (UnitLoad("e1", 2.0, 1.0, 0.5, None),)
    assert math.isclose(batch.load.flow_queue, 0.0)


def test_newer_message_with_unknown_field_decodes_on_this_release():
    frame = msgspec.msgpack.encode(_PollV2(protocol=1, sent_wall=5.0, max_batches=10))
    assert decode(frame) == Poll(protocol=1, sent_wall=5.0)


def test_newer_array_like_struct_with_trailing_field_decodes():
    frame = msgspec.msgpack.encode(
        {
            "kind": "report",
            "reporter_epoch": 1,
            "sequence": 2,
            "skew_drops": 1,
            "evidence": [["b", "m", 10, 4, 612.5]],
        }
    )
    assert decode(frame).evidence == (SkewEvidence("b", "m", 10, 4),)


def test_major_version_mismatch_decodes_then_is_refused():
    msg = decode(msgspec.msgpack.encode(_PollV0(protocol=PROTOCOL_VERSION + 1, sent_wall=0.0)))
    assert isinstance(msg, Poll)
    assert protocol_refusal(msg.protocol).reason == "protocol"


def test_skew_evidence_names_are_bounded_on_decode():
    big = wire.FeedbackReport(reporter_epoch=1, sequence=1, skew_drops=1,
                              evidence=(wire.SkewEvidence("s" * 254, "p", 1, 1),))
    frame = msgspec.msgpack.encode(big)
    with pytest.raises(wire.WireDecodeError):
        wire.decode(frame)
    ok = msgspec.structs.replace(big, evidence=(wire.SkewEvidence("s" * 253, "p", 1, 1),))
    assert wire.decode(wire.encode(ok)) == ok
