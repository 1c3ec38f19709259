"""The hand-written event encoder writes exactly what a generic Avro library writes."""

from __future__ import annotations

from io import BytesIO

import fastavro
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layer.protocol import (
    AckItem,
    AckRecord,
    AckType,
    Bookmark,
    Codec,
    Event,
    EventType,
    ProtocolError,
    ProtocolErrorKind,
    SchemaKind,
)
from layer.protocol.eventwire import encode_long
from tests.support.examples import examples

_LONGS = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_INTS = st.integers(min_value=-(2**31), max_value=2**31 - 1)
_TEXT = st.text(max_size=40)
_TOPICS = st.from_regex(r"[A-Za-z0-9._-]{1,60}", fullmatch=True).filter(
    lambda t: t not in {".", ".."})
_BOOKMARKS = st.builds(Bookmark, _TOPICS, st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1))
_EVENTS = st.builds(
    Event,
    type=st.sampled_from(list(EventType)),
    timestamp_ms=_LONGS,
    coordinator_id=_TEXT,
    coordinator_epoch=_LONGS,
    queue=st.none() | _TEXT,
    bookmark=st.none() | _BOOKMARKS,
    consumer_id=st.none() | _TEXT,
    session_id=st.none() | _TEXT,
    delivery_count=st.none() | _INTS,
    reason=st.none() | _TEXT,
    lease_expires_ms=st.none() | _LONGS,
    available_at_ms=st.none() | _LONGS,
    record_timestamp_ms=st.none() | _LONGS,
)


def _fastavro(codec: Codec, event: Event) -> bytes:
    schema = codec.schema(SchemaKind.EVENT)
    out = BytesIO()
    out.write(schema.header)
    fastavro.schemaless_writer(out, schema.parsed, codec.event_datum(event))
    return out.getvalue()


@settings(max_examples=examples(400))
@given(st.lists(_EVENTS, min_size=1, max_size=5))
def test_the_encoder_writes_fastavros_bytes_and_they_decode_back(events: list[Event]) -> None:
    # Several events through one codec: the encoder's caches must not leak one event's
    # values into the next.
    codec = Codec()
    for event in events:
        encoded = codec.encode_event(event)
        assert encoded == _fastavro(codec, event)
        assert codec.decode_event(encoded) == event


def test_the_first_event_of_coordinator_empty_at_epoch_minus_one_is_written_whole() -> None:
    """The encoder caches the coordinator's id and epoch; its empty cache once passed for
    coordinator "" at epoch -1, so such an event came out without those two fields."""
    codec = Codec()
    event = Event(type=EventType.CONSUMER_UNSUBSCRIBED, timestamp_ms=-39687, coordinator_id="",
                  coordinator_epoch=-1, queue=None, bookmark=Bookmark("Br", 5501, 3390),
                  consumer_id="w", session_id="s", delivery_count=None, reason=None,
                  lease_expires_ms=None, available_at_ms=None, record_timestamp_ms=None)
    encoded = codec.encode_event(event)
    assert encoded == _fastavro(codec, event)
    assert codec.decode_event(encoded) == event


@given(_LONGS)
def test_longs_are_zigzag_varints(n: int) -> None:
    out = BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    assert encode_long(n) == out.getvalue()


def test_a_leased_event_costs_about_a_hundred_bytes() -> None:
    # What a user sizing the events topic would check: the size of the commonest event.
    codec = Codec()
    event = Event(type=EventType.LEASED, timestamp_ms=1_795_316_326_489,
                  coordinator_id="coordinator-host-1234", coordinator_epoch=3, queue="Work",
                  bookmark=Bookmark("orders", 2, 123_456), consumer_id="worker-1",
                  session_id="3f2a9c", delivery_count=1, lease_expires_ms=1_795_316_356_489)
    assert 60 < len(codec.encode_event(event)) < 110


_ACK_ITEMS = st.builds(
    AckItem, queue=_TEXT, bookmark=_TEXT, lease=_TEXT, type=st.sampled_from(list(AckType)),
    delay_ms=st.none() | _LONGS, reason=st.none() | _TEXT)
_ACKS = st.builds(AckRecord, consumer_id=_TEXT, session_id=_TEXT, sent_at_ms=_LONGS,
                  items=st.lists(_ACK_ITEMS, max_size=6).map(tuple))


@settings(max_examples=examples(300))
@given(_ACKS)
def test_ack_records_are_fastavros_bytes_and_decode_back(record: AckRecord) -> None:
    codec = Codec()
    schema = codec.schema(SchemaKind.ACK)
    out = BytesIO()
    out.write(schema.header)
    fastavro.schemaless_writer(out, schema.parsed, codec.ack_datum(record))
    encoded = codec.encode_ack(record)
    assert encoded == out.getvalue()
    assert codec.decode_ack(encoded) == record


@pytest.mark.parametrize("n", [2**63, -(2**63) - 1, 2**64])
def test_values_beyond_64_bits_are_refused_as_avro_does(n: int) -> None:
    codec = Codec()
    with pytest.raises(ProtocolError) as caught:
        codec.encode_ack(AckRecord(consumer_id="c", session_id="s", sent_at_ms=n, items=()))
    assert caught.value.kind is ProtocolErrorKind.ENCODE
    event = Event(type=EventType.ACKED, timestamp_ms=n, coordinator_id="c",
                  coordinator_epoch=1)
    with pytest.raises(ProtocolError):
        codec.encode_event(event)


@given(_TEXT, _LONGS, _LONGS, _TEXT, _BOOKMARKS, _TEXT, st.none() | _TEXT, _INTS, _LONGS,
       st.none() | _LONGS, st.none() | _TEXT)
def test_the_entry_event_encoder_writes_what_the_field_encoder_writes(
        coordinator: str, epoch: int, at: int, queue: str, b: Bookmark, consumer: str,
        session: str | None, deliveries: int, expires: int, record_ms: int | None,
        acked_by: str | None) -> None:
    from layer.protocol.eventwire import EntryEventEncoder

    codec = Codec()
    base = codec.event_encoder
    fast = EntryEventEncoder(base, coordinator, epoch)
    where = (b.topic, b.partition, b.offset)
    assert fast.enqueued(at, queue, *where, record_ms) == base.encode_fields(
        coordinator, epoch, EventType.ENQUEUED, at, queue, b, record_timestamp_ms=record_ms)
    assert fast.leased(at, queue, *where, consumer, session, deliveries, expires) == (
        base.encode_fields(coordinator, epoch, EventType.LEASED, at, queue, b, consumer,
                           session, deliveries, None, expires))
    reason = acked_by or "consumer"
    assert fast.acked(at, queue, *where, consumer, reason) == base.encode_fields(
        coordinator, epoch, EventType.ACKED, at, queue, b, consumer, reason=reason)
    assert fast.acked(at, queue, *where, consumer, reason, deliveries) == base.encode_fields(
        coordinator, epoch, EventType.ACKED, at, queue, b, consumer, None, deliveries, reason)
    decoded = codec.decode_event(fast.leased(at, queue, *where, consumer, session, deliveries,
                                             expires))
    assert (decoded.type, decoded.bookmark, decoded.lease_expires_ms) == (
        EventType.LEASED, b, expires)
