"""Engine events as events-topic records: what the audit trail says, and that the coordinator's
fast path (fields straight to bytes) writes the same records as the `Event` path."""

from __future__ import annotations

from layer.coordinator.translate import event_fields, wire_events
from layer.domain import events as ev
from layer.domain.states import AckSource, Bookmark, ExpiryReason, LeaveReason
from layer.protocol import Bookmark as WireBookmark
from layer.protocol import Codec, EventType

T = 1_795_000_000.25
B = Bookmark("orders", 1, 41)

ENGINE_EVENTS: list[ev.Event] = [
    ev.EntriesEnqueued("Work", "orders", 1, (40, 41), T),
    ev.EntryLeased("Work", B, "worker-1", "qlayer.deliver.worker-1", "t0k3n", T + 30, 1, T),
    ev.EntryReleased("Work", B, "worker-1", 1, T + 5, T + 1),
    ev.EntryLeased("Work", B, "worker-2", "qlayer.deliver.worker-2", "t0k4n", T + 32, 2, T + 2),
    ev.LeaseRenewed("Work", B, "worker-2", T + 60, T + 3),
    ev.LeaseExpired("Work", B, "worker-2", None, T + 61),
    ev.LeaseBroken("Work", B, "worker-3", LeaveReason.SESSION_TIMEOUT, T + 62),
    ev.EntryAcked("Work", B, "worker-4", AckSource.CONSUMER, T + 63, 3),
    ev.EntryExpired("Work", Bookmark("orders", 1, 40), ExpiryReason.REJECTED, True, 1, 0,
                    "worker-1", "bad input", T + 64),
    ev.EntryDelayed("Work", B, T + 99, T),  # bookkeeping: no event
]


def test_each_change_becomes_the_documented_events() -> None:
    events = wire_events(ENGINE_EVENTS, "coordinator-a", 3,
                         session_of=lambda consumer: f"session-of-{consumer}",
                         record_time_of=lambda b: 1_795_000_000_000 + b.offset)
    assert [(e.type, str(e.bookmark)) for e in events] == [
        (EventType.ENQUEUED, "orders/1/40"), (EventType.ENQUEUED, "orders/1/41"),
        (EventType.LEASED, "orders/1/41"), (EventType.RELEASED, "orders/1/41"),
        (EventType.LEASED, "orders/1/41"), (EventType.RENEWED, "orders/1/41"),
        (EventType.LEASE_EXPIRED, "orders/1/41"), (EventType.LEASE_EXPIRED, "orders/1/41"),
        (EventType.ACKED, "orders/1/41"),
        (EventType.REJECTED, "orders/1/40"), (EventType.DEAD_LETTERED, "orders/1/40"),
        (EventType.EXPIRED, "orders/1/40"),
    ]
    enqueued, leased = events[1], events[2]
    assert enqueued.record_timestamp_ms == 1_795_000_000_041
    assert enqueued.bookmark == WireBookmark("orders", 1, 41)
    assert (leased.consumer_id, leased.session_id, leased.delivery_count,
            leased.lease_expires_ms, leased.timestamp_ms) == (
        "worker-1", "session-of-worker-1", 1, 1_795_000_030_250, 1_795_000_000_250)
    assert {(e.coordinator_id, e.coordinator_epoch, e.queue) for e in events} == {
        ("coordinator-a", 3, "Work")}
    assert events[7].reason == "session_timed_out"
    # ACKED says after how many deliveries (docs/protocol.md §11).
    assert (events[8].consumer_id, events[8].delivery_count) == ("worker-4", 3)
    assert (events[9].reason, events[10].reason, events[11].reason) == (
        "bad input", "rejected", "rejected")


def test_the_fast_path_writes_the_same_bytes_as_the_event_path() -> None:
    codec = Codec()
    sessions = {"worker-1": "s1", "worker-2": "s2"}
    expected = [codec.encode_event(e) for e in wire_events(
        ENGINE_EVENTS, "coordinator-a", 3, session_of=sessions.get,
        record_time_of=lambda b: b.offset * 7)]
    encode = codec.event_encoder.encode_fields
    fast = [encode("coordinator-a", 3, *f) for f in event_fields(
        ENGINE_EVENTS, session_of=sessions.get, record_time_of=lambda b: b.offset * 7)]
    assert fast == expected
    assert [codec.decode_event(b).type for b in fast][:3] == [
        EventType.ENQUEUED, EventType.ENQUEUED, EventType.LEASED]


def test_output_writes_every_kind_of_event_as_the_field_encoder_does_in_order() -> None:
    from layer.coordinator.catalog import Catalog
    from layer.coordinator.core import ShardCore
    from layer.coordinator.options import CoordinatorOptions
    from layer.coordinator.output import Output
    from layer.coordinator.ports import FakeTopicAdmin
    from layer.coordinator.translate import event_fields
    from layer.domain.states import AckSource, Bookmark, ExpiryReason
    from layer.kafka import JournalRecord
    from layer.protocol import TopicNames

    core = ShardCore(0, CoordinatorOptions(owner_id="o"), topics=TopicNames("q."),
                     catalog=lambda: Catalog.of(1, [], [], now=0.0), admin=FakeTopicAdmin({}),
                     tokens=lambda: "t", owner_id="o")
    core.epoch = 4
    b = Bookmark("orders", 2, 41)
    events: list[ev.Event] = [
        ev.EntriesEnqueued("Q", "orders", 2, (40, 41), 1.0),
        ev.EntryLeased("Q", b, "c1", "d", "tok", 31.5, 2, 1.5),
        ev.EntryReleased("Q", b, "c1", 1, 9.0, 2.0),
        ev.EntryAcked("Q", b, "c1", AckSource.CONSUMER, 3.0),
        ev.EntryAcked("Q", b, None, AckSource.DELIVERY, 3.0),
        ev.EntryExpired("Q", b, ExpiryReason.REJECTED, True, 2, 0, "c1", "bad", 4.0),
    ]
    fresh = {Bookmark("orders", 2, 41): JournalRecord("orders", 2, 41, None, b"v", 777, None)}
    encoder = core.codec.event_encoder
    expected = [core.codec.decode_event(encoder.encode_fields("o", 4, *f))
                for f in event_fields(events, session_of=core.session_id_of,
                                      record_time_of=lambda k: 777 if k in fresh else None)]
    items = Output(core).event_records(events, fresh)
    # ENQUEUED (one run of two), LEASED (a run of one), RELEASED, ACKED (a run of one), ...
    assert len(items) == len(expected) - 1
    written = core.codec.encode_event_batch(1, 0, core.codec.event_array(items))
    assert list(core.codec.decode_event_batch(written).events) == expected
