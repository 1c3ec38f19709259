"""Delivery batches and AcceptRecords (protocol 3): what is written reads back, and anything
that is not a whole batch is refused with a ProtocolError, never misread."""

from __future__ import annotations

import pytest
import qlayer_native as native
from hypothesis import given
from hypothesis import strategies as st

from layer.protocol import AckType, Codec, ProtocolError
from layer.protocol.batch import (
    DeliveryFormat,
    decode_delivery_batch,
    decode_delivery_batch_fields,
    delivery_format,
    encode_delivery_batch,
    encode_entry,
)
from layer.protocol.records import AcceptGroup, AcceptRecord, EventRun

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


def _run_datum(run: EventRun) -> dict[str, object]:
    return {"type": run.type.value, "timestamp_ms": run.timestamp_ms,
            "coordinator_id": run.coordinator_id, "coordinator_epoch": run.coordinator_epoch,
            "queue": run.queue, "topic": run.topic, "partition": run.partition,
            "offsets": list(run.offsets), "consumer_id": run.consumer_id,
            "session_id": run.session_id, "delivery_count": run.delivery_count,
            "reason": run.reason, "lease_expires_ms": run.lease_expires_ms,
            "record_timestamps_ms": (list(run.record_timestamps_ms)
                                     if run.record_timestamps_ms is not None else None)}


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
    run = EventRun(type=EventType.ENQUEUED, timestamp_ms=7, coordinator_id="c",
                   coordinator_epoch=3, queue="Q", topic="orders", partition=2,
                   offsets=(10, 11, 9_000_000_000), record_timestamps_ms=(1_700_000_000_000,
                                                                         None, 3))
    items = [codec.event_item(codec.encode_event(e)) for e in events] + [codec.run_item(run)]
    data = codec.encode_event_batch(12, 3, codec.event_array(items))
    schema = codec.schema(SchemaKind.EVENT_BATCH)
    out = io.BytesIO()
    out.write(schema.header)
    fastavro.schemaless_writer(out, schema.parsed, {
        "batch_id": 12, "shard": 3,
        "events": [*(("io.qlayer.v1.Event", codec.event_datum(e)) for e in events),
                   ("io.qlayer.v1.EventRun", _run_datum(run))]})
    assert data == out.getvalue()
    batch = codec.decode_event_batch(data)
    # The run reads back as one event per offset, with its record's timestamp.
    expanded = [Event(type=EventType.ENQUEUED, timestamp_ms=7, coordinator_id="c",
                      coordinator_epoch=3, queue="Q", bookmark=Bookmark("orders", 2, o),
                      record_timestamp_ms=t)
                for o, t in ((10, 1_700_000_000_000), (11, None), (9_000_000_000, 3))]
    assert (batch.batch_id, batch.shard, batch.events) == (12, 3, tuple(events + expanded))
    assert codec.decode_events(data) == events + expanded
    assert codec.decode_events(codec.encode_event(events[0])) == events[:1]
    assert codec.decode_event_batch(codec.encode_event_batch(1, 0, codec.event_array([]))
                                    ).events == ()


@given(st.lists(st.integers(0, 2**63 - 1), max_size=20),
       st.sampled_from(["LEASED", "ACKED", "ENQUEUED"]), st.booleans())
def test_run_items_are_fastavros_bytes(offsets: list[int], kind: str, timestamps: bool) -> None:
    import io

    import fastavro

    from layer.protocol import EventType, SchemaKind

    codec = Codec()
    run = EventRun(type=EventType(kind), timestamp_ms=2**40, coordinator_id="coord",
                   coordinator_epoch=2**33, queue="Jobs", topic="t.x", partition=2**20,
                   offsets=tuple(offsets), consumer_id="w" if kind != "ENQUEUED" else None,
                   session_id="s" if kind == "LEASED" else None,
                   delivery_count=3 if kind == "LEASED" else None,
                   reason="consumer" if kind == "ACKED" else None,
                   lease_expires_ms=-5 if kind == "LEASED" else None,
                   record_timestamps_ms=tuple(range(len(offsets))) if timestamps else None)
    schema = codec.schema(SchemaKind.EVENT_BATCH)
    out = io.BytesIO()
    fastavro.schemaless_writer(out, schema.parsed, {
        "batch_id": 0, "shard": 0, "events": [("io.qlayer.v1.EventRun", _run_datum(run))]})
    assert codec.event_array([codec.run_item(run)]) == out.getvalue()[2:]  # past ids 0, 0
    assert codec.decode_event_batch(codec.encode_event_batch(
        0, 0, codec.event_array([codec.run_item(run)]))).events == tuple(run.events())


def test_the_coordinators_run_encoders_write_what_the_generic_one_writes() -> None:
    from layer.protocol import EventType
    from layer.protocol.eventwire import EntryEventEncoder

    codec = Codec()
    fast = EntryEventEncoder(codec.event_encoder, "coord", 7)
    common = {"timestamp_ms": 1_700_000_000_123, "coordinator_id": "coord",
              "coordinator_epoch": 7, "queue": "Jobs", "topic": "orders", "partition": 3,
              "offsets": (5, 6, 200_000)}
    assert fast.enqueued_run(1_700_000_000_123, "Jobs", "orders", 3, [5, 6, 200_000],
                             [1, None, 2**41]) == codec.run_item(EventRun(
        type=EventType.ENQUEUED, record_timestamps_ms=(1, None, 2**41), **common))
    assert fast.leased_run(1_700_000_000_123, "Jobs", "orders", 3, [5, 6, 200_000], "w", "s",
                           2, 1_700_000_060_000) == codec.run_item(EventRun(
        type=EventType.LEASED, consumer_id="w", session_id="s", delivery_count=2,
        lease_expires_ms=1_700_000_060_000, **common))
    assert fast.acked_run(1_700_000_000_123, "Jobs", "orders", 3, [5, 6, 200_000], "w",
                          "consumer") == codec.run_item(EventRun(
        type=EventType.ACKED, consumer_id="w", reason="consumer", **common))
    # An ACKED run says after how many deliveries its entries were acked (all the same).
    assert fast.acked_run(1_700_000_000_123, "Jobs", "orders", 3, [5, 6, 200_000], "w",
                          "consumer", 3) == codec.run_item(EventRun(
        type=EventType.ACKED, consumer_id="w", delivery_count=3, reason="consumer", **common))


def test_a_run_whose_timestamps_do_not_match_its_offsets_is_malformed() -> None:
    from layer.protocol import EventType

    codec = Codec()
    run = EventRun(type=EventType.ENQUEUED, timestamp_ms=1, coordinator_id="c",
                   coordinator_epoch=1, queue="Q", topic="t", partition=0, offsets=(1, 2),
                   record_timestamps_ms=(5,))
    data = codec.encode_event_batch(1, 0, codec.event_array([codec.run_item(run)]))
    with pytest.raises(ProtocolError, match="2 offsets but 1 record timestamps"):
        codec.decode_event_batch(data)


def test_many_events_are_split_into_batches_that_read_back_in_order() -> None:
    from layer.protocol import Event, EventType

    codec = Codec()
    events = [Event(type=EventType.ENQUEUED, timestamp_ms=n, coordinator_id="c",
                    coordinator_epoch=1, queue="Q") for n in range(1000)]
    records = [codec.event_item(codec.encode_event(e)) for e in events]
    arrays = codec.event_arrays(records, max_bytes=2000)
    assert len(arrays) > 5
    assert all(len(a) <= 2000 + 64 for a in arrays)
    read = [e for i, a in enumerate(arrays)
            for e in codec.decode_event_batch(codec.encode_event_batch(i, 0, a)).events]
    assert read == events
    assert codec.event_arrays([]) == []
    assert len(codec.event_arrays(records)) == 1  # the default: 256 KiB per batch



def _reference_or_error(value: bytes) -> list[tuple] | None:  # type: ignore[type-arg]
    from layer.protocol.batch import _decode_delivery_batch
    try:
        return [tuple(e) for e in _decode_delivery_batch(value)]
    except ProtocolError:
        return None


def _native_or_error(value: bytes) -> list[tuple] | None:  # type: ignore[type-arg]
    try:
        return [tuple(e) for e in native.decode_delivery_batch(value)]
    except ValueError:
        return None


@given(st.lists(entries, max_size=6), st.data())
def test_the_native_decoder_reads_what_the_reference_reads_and_refuses_what_it_refuses(
    messages: list[tuple], data: st.DataObject,  # type: ignore[type-arg]
) -> None:
    """The SDK decodes with the native extension when it is installed: on whole batches and
    on the same batch cut, padded or with a byte changed, it answers exactly the reference's
    messages, or refuses where the reference raises (the reference then says why)."""
    value = encode_delivery_batch([
        encode_entry(q.encode(), t.encode(), p, o, lease.encode(), exp, dc, barrier, ts, k, v, h)
        for q, t, p, o, lease, exp, dc, barrier, ts, k, v, h in messages])
    variants = [value, value[:data.draw(st.integers(0, len(value)))], value + b"\x00"]
    if value:
        at = data.draw(st.integers(0, len(value) - 1))
        variants.append(value[:at] + bytes([data.draw(st.integers(0, 255))]) + value[at + 1:])
    for variant in variants:
        assert _native_or_error(variant) == _reference_or_error(variant)
    assert [tuple(e) for e in decode_delivery_batch(value)] == _reference_or_error(value)
    assert [tuple(e) for e in decode_delivery_batch_fields(value)] == _reference_or_error(value)


def test_a_refused_batch_is_explained_by_the_reference_decoder() -> None:
    value = encode_delivery_batch([encode_entry(b"Q", b"t", 0, 1, b"ab", 5, 1, False, None,
                                                None, b"v", None)])
    with pytest.raises(ValueError):
        native.decode_delivery_batch(value[:-1])
    with pytest.raises(ProtocolError, match="cut or garbled"):
        decode_delivery_batch(value[:-1])
    with pytest.raises(ProtocolError, match="1 bytes after the last of 1 messages"):
        decode_delivery_batch(value + b"\x00")
    with pytest.raises(ProtocolError, match="cut or garbled"):
        decode_delivery_batch_fields(value[:-1])
