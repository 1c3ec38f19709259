"""Encoding and decoding of every record type, and what decoders do with bad bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.protocol import (
    HEADER_LENGTH,
    SINGLE_OBJECT_MAGIC,
    AcceptRecord,
    AckItem,
    AckItemResult,
    AckRecord,
    AckResult,
    AckStatus,
    AckType,
    Bookmark,
    Codec,
    ControlMessage,
    Event,
    EventBatch,
    EventType,
    ExpiryReason,
    GrantSemantics,
    Heartbeat,
    ProtocolError,
    ProtocolErrorKind,
    QueueGrant,
    Replace,
    ReplyMessage,
    RequestKind,
    SchemaKind,
    SessionEnded,
    SessionEndReason,
    Subscribe,
    SubscribeResult,
    SubscribeStatus,
    Unsubscribe,
    read_fingerprint,
)

from . import strategies

NOW = 1_767_225_600_000  # 2026-01-01T00:00:00Z

SUBSCRIBE = Subscribe(
    consumer_id="worker-1",
    session_id="5b0c9a1e-3f0e-4d8e-9c57-2f1f0f3f7a10",
    request_id="r1",
    queue="WorkToDo",
    max_backlog=10,
    filter="/region = 'EU'",
    delivery_topic="qlayer.delivery.worker-1",
    session_timeout_ms=30_000,
    client_name="qlayer-python",
    client_version="0.1.0",
    sent_at_ms=NOW,
)
CONTROL_EXAMPLES: list[ControlMessage] = [
    SUBSCRIBE,
    Subscribe(
        consumer_id="w2",
        session_id="s2",
        request_id="r",
        queue="Work.*",
        queue_is_regex=True,
        delivery_topic="qlayer.delivery.w2",
        session_timeout_ms=10_000,
        client_name="c",
        client_version="1",
        sent_at_ms=NOW,
    ),
    Replace(
        consumer_id="worker-1",
        session_id="s",
        request_id="r2",
        queue="WorkToDo",
        max_backlog=5,
        filter="/to = 'any'",
        delivery_topic="qlayer.delivery.worker-1",
        sent_at_ms=NOW + 1,
    ),
    Heartbeat(consumer_id="worker-1", session_id="s", sent_at_ms=NOW + 2),
    Unsubscribe(consumer_id="worker-1", session_id="s", reason="shutdown", sent_at_ms=NOW + 3),
    Unsubscribe(consumer_id="worker-1", session_id="s", sent_at_ms=NOW + 3),
]
ACK = AckRecord(
    consumer_id="worker-1",
    session_id="s",
    sent_at_ms=NOW,
    items=(
        AckItem(queue="WorkToDo", bookmark="orders/0/41", lease="t1", type=AckType.ACCEPT),
        AckItem(
            queue="WorkToDo", bookmark="orders/1/7", lease="t2", type=AckType.RELEASE, delay_ms=500
        ),
        AckItem(
            queue="Jobs", bookmark="jobs/2/9", lease="t3", type=AckType.REJECT, reason="bad input"
        ),
        AckItem(queue="Jobs", bookmark="jobs/2/10", lease="t4", type=AckType.RENEW),
    ),
)
REPLY_EXAMPLES: list[ReplyMessage] = [
    SubscribeResult(
        consumer_id="worker-1",
        session_id="s",
        request_id="r1",
        request=RequestKind.SUBSCRIBE,
        status=SubscribeStatus.OK,
        queues=(
            QueueGrant(
                queue="WorkToDo",
                max_backlog=10,
                lease_period_ms=60_000,
                semantics=GrantSemantics.AT_LEAST_ONCE,
            ),
        ),
        session_timeout_ms=30_000,
        heartbeat_interval_ms=10_000,
        coordinator_id="coord-a",
        sent_at_ms=NOW,
    ),
    SubscribeResult(
        consumer_id="worker-1",
        session_id="s",
        request_id="r1",
        request=RequestKind.SUBSCRIBE,
        status=SubscribeStatus.UNKNOWN_QUEUE,
        message="unknown queue 'Nope'",
        session_timeout_ms=30_000,
        heartbeat_interval_ms=10_000,
        coordinator_id="coord-a",
        sent_at_ms=NOW,
    ),
    AckResult(
        consumer_id="worker-1",
        session_id="s",
        items=(
            AckItemResult(
                queue="Jobs",
                bookmark="jobs/2/10",
                type=AckType.RENEW,
                status=AckStatus.OK,
                lease_expires_ms=NOW + 60_000,
            ),
            AckItemResult(
                queue="Jobs",
                bookmark="jobs/2/11",
                type=AckType.ACCEPT,
                status=AckStatus.WRONG_TOKEN,
                message="lease token does not match",
            ),
        ),
        sent_at_ms=NOW,
    ),
    SessionEnded(
        consumer_id="worker-1", session_id="s", reason=SessionEndReason.TIMED_OUT, sent_at_ms=NOW
    ),
]
EVENT_EXAMPLES = [
    Event(
        type=EventType.EXPIRED,
        timestamp_ms=NOW,
        coordinator_id="coord-a",
        coordinator_epoch=7,
        queue="Jobs",
        bookmark=Bookmark("jobs", 2, 9),
        consumer_id="worker-1",
        delivery_count=3,
        reason=ExpiryReason.MAX_DELIVERIES.value,
        record_timestamp_ms=NOW - 5_000,
    ),
    Event(
        type=EventType.OWNERSHIP_ACQUIRED,
        timestamp_ms=NOW,
        coordinator_id="coord-b",
        coordinator_epoch=8,
    ),
]


# --- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("message", CONTROL_EXAMPLES, ids=lambda m: type(m).__name__)
def test_control_round_trip(codec: Codec, message: ControlMessage) -> None:
    decoded = codec.decode_control(codec.encode_control(message))
    assert decoded == message
    assert type(decoded) is type(message)


def test_ack_round_trip_keeps_items_in_order(codec: Codec) -> None:
    decoded = codec.decode_ack(codec.encode_ack(ACK))
    assert decoded == ACK
    assert [item.type for item in decoded.items] == [
        AckType.ACCEPT,
        AckType.RELEASE,
        AckType.REJECT,
        AckType.RENEW,
    ]
    assert decoded.items[1].delay_ms == 500
    assert decoded.items[2].reason == "bad input"


def test_empty_ack_record_round_trips(codec: Codec) -> None:
    empty = AckRecord(consumer_id="c", session_id="s", sent_at_ms=0, items=())
    assert codec.decode_ack(codec.encode_ack(empty)) == empty


@pytest.mark.parametrize("message", REPLY_EXAMPLES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(codec: Codec, message: ReplyMessage) -> None:
    assert codec.decode_reply(codec.encode_reply(message)) == message


@pytest.mark.parametrize("event", EVENT_EXAMPLES, ids=lambda e: e.type.value)
def test_event_round_trip(codec: Codec, event: Event) -> None:
    assert codec.decode_event(codec.encode_event(event)) == event


def test_decode_picks_the_schema_from_the_fingerprint(codec: Codec) -> None:
    records: list[object] = [SUBSCRIBE, ACK, REPLY_EXAMPLES[0], EVENT_EXAMPLES[0]]
    encoded = [
        codec.encode_control(SUBSCRIBE),
        codec.encode_ack(ACK),
        codec.encode_reply(REPLY_EXAMPLES[0]),
        codec.encode_event(EVENT_EXAMPLES[0]),
    ]
    assert [codec.decode(data) for data in encoded] == records


def test_every_record_starts_with_magic_and_its_schema_fingerprint(codec: Codec) -> None:
    data = codec.encode_ack(ACK)
    assert data[:2] == SINGLE_OBJECT_MAGIC == b"\xc3\x01"
    assert read_fingerprint(data) == codec.schema(SchemaKind.ACK).fingerprint
    fingerprints = {codec.schema(kind).fingerprint for kind in SchemaKind}
    assert len(fingerprints) == len(SchemaKind) == 6


def test_two_codecs_encode_identically() -> None:
    # No hidden state: a consumer's codec and the coordinator's agree byte for byte.
    assert Codec().encode_ack(ACK) == Codec().encode_ack(ACK)


@given(strategies.control_messages)
def test_any_control_message_round_trips(codec: Codec, message: ControlMessage) -> None:
    assert codec.decode_control(codec.encode_control(message)) == message


@given(strategies.ack_records)
def test_any_ack_record_round_trips(codec: Codec, record: AckRecord) -> None:
    assert codec.decode_ack(codec.encode_ack(record)) == record


@given(strategies.reply_messages)
def test_any_reply_round_trips(codec: Codec, message: ReplyMessage) -> None:
    assert codec.decode_reply(codec.encode_reply(message)) == message


@given(strategies.events)
def test_any_event_round_trips(codec: Codec, event: Event) -> None:
    assert codec.decode_event(codec.encode_event(event)) == event


# --- encoding errors -------------------------------------------------------------------------


def test_encoding_a_value_avro_cannot_hold_raises_protocol_error(codec: Codec) -> None:
    too_big = Heartbeat(consumer_id="c", session_id="s", sent_at_ms=2**64)
    with pytest.raises(ProtocolError) as caught:
        codec.encode_control(too_big)
    assert caught.value.kind is ProtocolErrorKind.ENCODE
    assert "control" in str(caught.value)


def test_encoding_a_lone_surrogate_raises_protocol_error(codec: Codec) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.encode_control(Heartbeat(consumer_id="\ud800", session_id="s", sent_at_ms=0))
    assert caught.value.kind is ProtocolErrorKind.ENCODE


# --- decoding errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        (None, ProtocolErrorKind.EMPTY, "no value"),
        (b"", ProtocolErrorKind.EMPTY, "no value"),
        (b"\xc3\x01\x00", ProtocolErrorKind.TOO_SHORT, "too short"),
        (b"{" + b'"consumer_id": 1}', ProtocolErrorKind.WRONG_MAGIC, "magic"),
        (b"\x00\x00\x00\x00\x01" + bytes(20), ProtocolErrorKind.WRONG_MAGIC, "magic"),
        (b"\xc3\x01" + bytes(8) + b"\x02", ProtocolErrorKind.UNKNOWN_FINGERPRINT, "fingerprint"),
    ],
    ids=["none", "empty", "short", "json", "confluent-wire-format", "zero-fingerprint"],
)
def test_bad_header_is_named(
    codec: Codec, data: bytes | None, kind: ProtocolErrorKind, words: str
) -> None:
    for decode in (codec.decode_control, codec.decode_ack, codec.decode_reply, codec.decode_event):
        with pytest.raises(ProtocolError) as caught:
            decode(data)
        assert caught.value.kind is kind
        assert words in str(caught.value)


def test_record_on_the_wrong_topic_names_both_schemas(codec: Codec) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(codec.encode_control(SUBSCRIBE))
    assert caught.value.kind is ProtocolErrorKind.WRONG_SCHEMA
    assert str(caught.value) == (
        "expected a record of the ack schema, got one of the control schema"
    )


def test_truncated_body_is_named(codec: Codec) -> None:
    data = codec.encode_ack(ACK)
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(data[:-5])
    assert caught.value.kind is ProtocolErrorKind.TRUNCATED
    assert "truncated" in str(caught.value)


def test_header_without_body_is_truncated(codec: Codec) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(codec.schema(SchemaKind.ACK).header)
    assert caught.value.kind is ProtocolErrorKind.TRUNCATED


def test_trailing_bytes_are_refused(codec: Codec) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode_control(codec.encode_control(SUBSCRIBE) + b"\x00")
    assert caught.value.kind is ProtocolErrorKind.TRAILING_BYTES
    assert "1 bytes after its body" in str(caught.value)


def test_invalid_utf8_in_a_string_is_malformed(codec: Codec) -> None:
    header = codec.schema(SchemaKind.CONTROL).header
    # Heartbeat is union branch 2 (zigzag 4); consumer_id is 2 bytes that are not UTF-8.
    body = b"\x04" + b"\x04\xff\xfe" + b"\x02s" + b"\x00"
    with pytest.raises(ProtocolError) as caught:
        codec.decode_control(header + body)
    assert caught.value.kind is ProtocolErrorKind.MALFORMED


def test_event_with_an_invalid_bookmark_string_is_refused(codec: Codec) -> None:
    event = codec.encode_event(EVENT_EXAMPLES[0])
    tampered = event.replace(b"jobs/2/9", b"jobs/2/x")
    with pytest.raises(ProtocolError) as caught:
        codec.decode_event(tampered)
    assert caught.value.kind is ProtocolErrorKind.BAD_BOOKMARK


# --- union and enum indexes (issue 15 item 5) -------------------------------------------------
# fastavro reads an index with Python's list[index]: -1 was the last branch or symbol.


def hand_made_ack(codec: Codec, *, type_index: bytes = b"\x00", delay: bytes = b"\x00") -> bytes:
    """One item, byte by byte: consumer_id 'c', session_id 's', sent_at_ms 0, then the item
    queue 'Q', bookmark 't/0/1', lease 'L', type, delay_ms, reason null; the array's end."""
    return (codec.schema(SchemaKind.ACK).header + b"\x02c" + b"\x02s" + b"\x00"
            + b"\x02" + b"\x02Q" + b"\x0at/0/1" + b"\x02L" + type_index + delay + b"\x00"
            + b"\x00")


def test_the_hand_made_ack_is_a_valid_record(codec: Codec) -> None:
    # The baseline the tests below change one index of.
    def ack(item: AckItem) -> AckRecord:
        return AckRecord(consumer_id="c", session_id="s", sent_at_ms=0, items=(item,))

    assert codec.decode_ack(hand_made_ack(codec)) == ack(AckItem("Q", "t/0/1", "L",
                                                                 AckType.ACCEPT))
    assert codec.decode_ack(hand_made_ack(codec, type_index=b"\x06", delay=b"\x02\x0e")) \
        == ack(AckItem("Q", "t/0/1", "L", AckType.RENEW, delay_ms=7))
    # An index written in more bytes than it needs is still that index.
    assert codec.decode_ack(hand_made_ack(codec, delay=b"\x82\x00\x0e")).items[0].delay_ms == 7


@pytest.mark.parametrize(("delay", "index"), [
    (b"\x01\x0e", -1),  # was read as branch 1: delay_ms 7
    (b"\x03", -2),  # was read as branch 0: null
    (b"\x04\x0e", 2),
    (b"\x81\x80\x80\x80\x10", -2**31 - 1),
])
def test_a_union_branch_index_out_of_range_is_malformed(
    codec: Codec, delay: bytes, index: int
) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(hand_made_ack(codec, delay=delay))
    assert caught.value.kind is ProtocolErrorKind.MALFORMED
    assert str(caught.value) == (f"ack record: union branch index {index} at items[].delay_ms "
                                 "is not one of its 2 branches (0..1)")


@pytest.mark.parametrize(("type_index", "index"), [(b"\x01", -1), (b"\x07", -4), (b"\x08", 4)])
def test_an_enum_symbol_index_out_of_range_is_malformed(
    codec: Codec, type_index: bytes, index: int
) -> None:
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(hand_made_ack(codec, type_index=type_index))
    assert caught.value.kind is ProtocolErrorKind.MALFORMED
    assert str(caught.value) == (f"ack record: enum symbol index {index} at items[].type is not "
                                 "one of its 4 symbols (0..3)")


def test_a_control_body_index_of_minus_one_is_not_the_last_body(codec: Codec) -> None:
    heartbeat = codec.encode_control(Heartbeat(consumer_id="w", session_id="s", sent_at_ms=NOW))
    assert heartbeat[HEADER_LENGTH] == 0x04  # body: union branch 2, Heartbeat
    for index, byte in ((-1, 0x01), (-3, 0x05), (4, 0x08)):
        tampered = heartbeat[:HEADER_LENGTH] + bytes([byte]) + heartbeat[HEADER_LENGTH + 1:]
        with pytest.raises(ProtocolError, match=(
                rf"^control record: union branch index {index} at body is not one of its 4 "
                r"branches \(0\.\.3\)$")):
            codec.decode_control(tampered)


def test_an_event_type_of_minus_one_is_malformed(codec: Codec) -> None:
    event = codec.encode_event(EVENT_EXAMPLES[0])
    tampered = event[:HEADER_LENGTH] + b"\x01" + event[HEADER_LENGTH + 1:]
    with pytest.raises(ProtocolError, match=r"^event record: enum symbol index -1 at type is not"):
        codec.decode_event(tampered)


def test_a_truncated_record_is_still_named_truncated(codec: Codec) -> None:
    # The index check stops where the body ends and leaves the naming to the decoder.
    data = hand_made_ack(codec, delay=b"\x02\x0e")
    for cut in range(HEADER_LENGTH, len(data)):
        with pytest.raises(ProtocolError) as caught:
            codec.decode_ack(data[:cut])
        assert caught.value.kind is ProtocolErrorKind.TRUNCATED


RECORD_TYPES = (Subscribe, Replace, Heartbeat, Unsubscribe, AckRecord, Event)
RECORD_TYPES += (SubscribeResult, AckResult, SessionEnded, AcceptRecord, EventBatch)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_protocol_error(codec: Codec, data: bytes) -> None:
    for decode in (codec.decode, codec.decode_control, codec.decode_ack, codec.decode_reply):
        try:
            decoded = decode(data)
        except ProtocolError:
            continue
        assert isinstance(decoded, RECORD_TYPES)


@given(st.sampled_from(SchemaKind), st.binary(max_size=80))
def test_random_body_behind_a_valid_header_raises_only_protocol_error(
    codec: Codec, kind: SchemaKind, body: bytes
) -> None:
    try:
        decoded = codec.decode(codec.schema(kind).header + body)
    except ProtocolError:
        return
    assert isinstance(decoded, RECORD_TYPES)


@given(strategies.ack_records, st.data())
def test_every_proper_prefix_of_a_record_is_refused(
    codec: Codec, record: AckRecord, data: st.DataObject
) -> None:
    encoded = codec.encode_ack(record)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    with pytest.raises(ProtocolError):
        codec.decode_ack(encoded[:cut])


@given(strategies.control_messages, st.data())
def test_corrupted_records_decode_or_raise_protocol_error(
    codec: Codec, message: ControlMessage, data: st.DataObject
) -> None:
    encoded = bytearray(codec.encode_control(message))
    position = data.draw(st.integers(min_value=HEADER_LENGTH, max_value=len(encoded) - 1))
    encoded[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    try:
        decoded = codec.decode_control(bytes(encoded))
    except ProtocolError:
        return
    assert isinstance(decoded, Subscribe | Replace | Heartbeat | Unsubscribe)


@given(st.integers(min_value=2, max_value=9), st.integers(min_value=1, max_value=255))
def test_any_change_to_the_fingerprint_is_an_unknown_fingerprint(
    codec: Codec, position: int, flip: int
) -> None:
    encoded = bytearray(codec.encode_ack(ACK))
    encoded[position] ^= flip
    with pytest.raises(ProtocolError) as caught:
        codec.decode_ack(bytes(encoded))
    assert caught.value.kind is ProtocolErrorKind.UNKNOWN_FINGERPRINT
