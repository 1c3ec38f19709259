"""Delivery batches and AcceptRecords (protocol 3): what is written reads back, and anything
that is not a whole batch is refused with a ProtocolError, never misread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from layer.protocol import AckType, Codec, ProtocolError
from layer.protocol.batch import (
    DeliveryFormat,
    decode_delivery_batch,
    delivery_format,
    encode_delivery_batch,
    encode_entry,
)
from layer.protocol.records import AcceptGroup, AcceptRecord

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
maybe_bytes = st.none() | st.binary(max_size=300)
entries = st.tuples(
    names, st.from_regex(r"[a-zA-Z0-9._-]{1,40}", fullmatch=True),
    st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1),
    st.from_regex(r"[0-9a-f]{0,32}", fullmatch=True), st.integers(0, 2**63 - 1),
    st.integers(1, 2**31), st.booleans(), st.none() | st.integers(0, 2**63 - 1),
    maybe_bytes, maybe_bytes,
    st.lists(st.tuples(names, maybe_bytes), max_size=5),
)


@given(st.lists(entries, max_size=8))
def test_every_message_reads_back_as_written(messages: list[tuple]) -> None:  # type: ignore[type-arg]
    value = encode_delivery_batch([
        encode_entry(q.encode(), t.encode(), p, o, lease.encode(), exp, dc, barrier, ts, k, v, h)
        for q, t, p, o, lease, exp, dc, barrier, ts, k, v, h in messages])
    decoded = decode_delivery_batch(value)
    assert [(e.queue, e.topic, e.partition, e.offset, e.lease, e.lease_expires_ms,
             e.delivery_count, e.barrier, e.timestamp_ms, e.key, e.value, e.headers)
            for e in decoded] == [(*m[:11], list(m[11])) for m in messages]


def _one() -> bytes:
    return encode_delivery_batch([encode_entry(b"Q", b"orders", 0, 5, b"tok", 9, 1, False,
                                               None, b"k", b"v", [("h", None)])])


@pytest.mark.parametrize("garbage", [b"", b"qB", b"xx\x01\x00\x00\x00\x00",
                                     b"qB\x02\x00\x00\x00\x00"])
def test_a_record_that_is_not_a_batch_is_refused(garbage: bytes) -> None:
    with pytest.raises(ProtocolError, match="delivery batch"):
        decode_delivery_batch(garbage)


def test_a_cut_or_padded_batch_is_refused() -> None:
    whole = _one()
    assert len(decode_delivery_batch(whole)) == 1
    for cut in range(7, len(whole)):
        with pytest.raises(ProtocolError):
            decode_delivery_batch(whole[:cut])
    with pytest.raises(ProtocolError, match="after the last"):
        decode_delivery_batch(whole + b"\x00")
    # A count larger than the messages that follow.
    with pytest.raises(ProtocolError):
        decode_delivery_batch(whole[:3] + b"\x00\x00\x00\x02" + whole[7:])


def test_the_delivery_format_header_defaults_to_records() -> None:
    assert delivery_format(None) == DeliveryFormat.RECORD
    assert delivery_format([("qlayer.delivery-format", b"batch")]) == DeliveryFormat.BATCH
    assert delivery_format([("qlayer.delivery-format", b"batch"),
                            ("qlayer.delivery-format", b"record")]) == DeliveryFormat.RECORD
    assert delivery_format([("qlayer.delivery-format", b"BATCHES")]) == DeliveryFormat.RECORD


def test_an_accept_record_reads_back_as_ack_items_in_order() -> None:
    codec = Codec()
    record = AcceptRecord(consumer_id="w1", session_id="s1", sent_at_ms=7, groups=(
        AcceptGroup(queue="Q", topic="orders", partition=2, offsets=(9, 4), leases=("a", "b")),
        AcceptGroup(queue="R", topic="jobs", partition=0, offsets=(1,), leases=("c",)),
    ))
    data = codec.encode_accept(record)
    assert codec.decode_accept(data) == record
    acks = codec.decode_ack_topic(data)
    assert [(i.queue, i.bookmark, i.lease, i.type) for i in acks.items] == [
        ("Q", "orders/2/9", "a", AckType.ACCEPT), ("Q", "orders/2/4", "b", AckType.ACCEPT),
        ("R", "jobs/0/1", "c", AckType.ACCEPT)]
    # The ack topic's other schema still reads through the same door.
    plain = codec.encode_ack(acks)
    assert codec.decode_ack_topic(plain) == acks


def test_an_accept_record_whose_tokens_do_not_match_its_offsets_is_refused() -> None:
    codec = Codec()
    with pytest.raises(ProtocolError):
        codec.encode_accept(AcceptRecord(consumer_id="w", session_id="s", sent_at_ms=0, groups=(
            AcceptGroup(queue="Q", topic="t", partition=0, offsets=(1, 2), leases=("a",)),)))
    with pytest.raises(ProtocolError, match="','"):
        codec.encode_accept(AcceptRecord(consumer_id="w", session_id="s", sent_at_ms=0, groups=(
            AcceptGroup(queue="Q", topic="t", partition=0, offsets=(1,), leases=("a,b",)),)))
    good = codec.encode_accept(AcceptRecord(consumer_id="w", session_id="s", sent_at_ms=0,
                                            groups=(AcceptGroup(queue="Q", topic="t",
                                                                partition=0, offsets=(1, 2),
                                                                leases=("a", "b")),)))
    forged = good.replace(b"a,b", b"a;b")  # one token for two offsets
    with pytest.raises(ProtocolError, match="2 offsets but 1 leases"):
        codec.decode_ack_topic(forged)


def test_an_event_batch_is_byte_for_byte_what_fastavro_writes_and_reads_back() -> None:
    import io

    import fastavro

    from layer.protocol import Bookmark, Event, EventType, SchemaKind

    codec = Codec()
    events = [
        Event(type=EventType.LEASED, timestamp_ms=5, coordinator_id="c", coordinator_epoch=3,
              queue="Q", bookmark=Bookmark("orders", 1, 41), consumer_id="w",
              session_id="s", delivery_count=1, lease_expires_ms=99),
        Event(type=EventType.OWNERSHIP_ACQUIRED, timestamp_ms=6, coordinator_id="c",
              coordinator_epoch=3, queue="Q"),
    ]
    array = codec.event_array([codec.encode_event(e) for e in events])
    data = codec.encode_event_batch(12, 3, array)
    schema = codec.schema(SchemaKind.EVENT_BATCH)
    out = io.BytesIO()
    out.write(schema.header)
    fastavro.schemaless_writer(out, schema.parsed, {
        "batch_id": 12, "shard": 3, "events": [codec.event_datum(e) for e in events]})
    assert data == out.getvalue()
    batch = codec.decode_event_batch(data)
    assert (batch.batch_id, batch.shard, batch.events) == (12, 3, tuple(events))
    assert codec.decode_events(data) == events
    assert codec.decode_events(codec.encode_event(events[0])) == events[:1]
    assert codec.decode_event_batch(codec.encode_event_batch(1, 0, codec.event_array([]))
                                    ).events == ()


def test_many_events_are_split_into_batches_that_read_back_in_order() -> None:
    from layer.protocol import Event, EventType

    codec = Codec()
    events = [Event(type=EventType.ENQUEUED, timestamp_ms=n, coordinator_id="c",
                    coordinator_epoch=1, queue="Q") for n in range(1000)]
    records = [codec.encode_event(e) for e in events]
    arrays = codec.event_arrays(records, max_bytes=2000)
    assert len(arrays) > 5
    assert all(len(a) <= 2000 + 64 for a in arrays)
    read = [e for i, a in enumerate(arrays)
            for e in codec.decode_event_batch(codec.encode_event_batch(i, 0, a)).events]
    assert read == events
    assert codec.event_arrays([]) == []
    assert len(codec.event_arrays(records)) == 1  # the default: 256 KiB per batch
