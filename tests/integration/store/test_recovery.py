"""Restart: a coordinator that starts afresh loads exactly what its predecessor committed."""

from __future__ import annotations

import pytest

from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import ConsumerRow, EntryRow, PartitionKey
from layer.store.store import Store

pytestmark = pytest.mark.integration

# Quarter seconds are exact in both float and timestamptz (microseconds), so round trips compare
# with ==.
T0 = 1_700_000_000.25


def _written_state() -> tuple[list[EntryRow], dict[PartitionKey, int], list[ConsumerRow]]:
    rows = [
        # Work over three journal partitions, every state and every optional field.
        EntryRow("Work", "orders", 0, 10, "LEASED", delivery_count=2, cancel_count=1,
                 lease_consumer="c1", lease_token="7f3a", lease_deadline=T0 + 30.5),
        EntryRow("Work", "orders", 0, 11, "AVAILABLE", delivery_count=1, cancel_count=1,
                 available_at=T0 + 60.25),
        EntryRow("Work", "orders", 0, 12, "ACKED", delivery_count=1),
        EntryRow("Work", "orders", 1, 3, "EXPIRED", delivery_count=5,
                 reason="max-deliveries"),
        EntryRow("Work", "orders", 1, 4, "LEASED", delivery_count=1, lease_consumer="c2",
                 lease_token="t-ü", lease_deadline=T0 + 0.75),
        EntryRow("Work", "orders", 2, 2**40, "ACKED", delivery_count=1),
        EntryRow("Work", "orders-eu", 0, 0, "AVAILABLE"),
        # Another queue over the same journal partition and offset.
        EntryRow("Audit", "orders", 0, 10, "ACKED", delivery_count=1),
    ]
    points = {
        PartitionKey("Work", "orders", 0): 10,
        PartitionKey("Work", "orders", 1): 3,
        PartitionKey("Work", "orders", 2): 2**40 - 5,
        PartitionKey("Work", "orders-eu", 0): 0,
        PartitionKey("Audit", "orders", 0): 0,
    }
    consumers = [
        ConsumerRow("c1", "s-1", "Work", False, "qlayer.deliver.c1", 10_000, T0, T0 + 4.5,
                    max_backlog=10, filter="/region = 'EU'",
                    client_info={"sdk": "python", "pid": 4242, "host": "w1", "tags": ["a"]}),
        ConsumerRow("c2", "s-2", "Work|Audit", True, "qlayer.deliver.c2", 30_000, T0, T0),
    ]
    return rows, points, consumers


def test_a_fresh_store_loads_exactly_what_was_committed(
    store: Store, database_url: str
) -> None:
    rows, points, consumers = _written_state()
    epoch = store.take_shard("Work", "old", T0)
    assert epoch is not None
    batch = WriteBatch()
    for row in rows:
        batch.put_entry(row)
    for (queue, topic, partition), offset in points.items():
        batch.set_recovery_point(queue, topic, partition, offset)
    for consumer in consumers:
        batch.put_consumer(consumer)
    store.commit(batch, "Work", "old", epoch, T0 + 1)

    with Store(database_url) as restarted:
        assert restarted.take_shard("Work", "new", T0 + 20) == epoch + 1
        assert restarted.load_entries("Work") == sorted(
            (row for row in rows if row.queue == "Work"), key=lambda row: row.key
        )
        assert restarted.load_entries("Audit") == [rows[-1]]
        assert restarted.load_entries("Nobody") == []
        assert restarted.load_recovery_points() == points
        assert restarted.load_recovery_points("Audit") == {PartitionKey("Audit", "orders", 0): 0}
        assert restarted.load_consumers() == consumers


def test_entries_below_the_recovery_point_are_not_loaded(store: Store) -> None:
    epoch = store.take_shard("Work", "a", T0)
    assert epoch is not None
    points = WriteBatch()
    points.set_recovery_point("Work", "orders", 0, 100)
    store.commit(points, "Work", "a", epoch, T0)
    below = WriteBatch()  # written without moving the recovery point, so nothing is pruned
    below.put_entry(EntryRow("Work", "orders", 0, 50, "ACKED", delivery_count=1))
    below.put_entry(EntryRow("Work", "orders", 0, 60, "EXPIRED", reason="rejected"))
    stray = EntryRow("Work", "orders", 0, 70, "AVAILABLE", delivery_count=1)
    below.put_entry(stray)
    above = EntryRow("Work", "orders", 0, 100, "ACKED", delivery_count=1)
    below.put_entry(above)
    no_point = EntryRow("Work", "orders", 9, 5, "ACKED", delivery_count=1)
    below.put_entry(no_point)
    store.commit(below, "Work", "a", epoch, T0)

    # Below the recovery point everything is done (the engine moves it past done entries only),
    # so 50, 60 and 70 are not read, whatever their rows say: with runs a row there may be an
    # older write that a later one superseded. 100 is at the recovery point (50 and 100 are one
    # run, read from 100 on); partition 9 has no recovery point yet, so all of it counts.
    assert store.load_entries("Work") == [above, no_point]


def test_input_positions_are_committed_with_the_batch_per_shard(store: Store) -> None:
    epoch = store.take_shard("default", "a", T0)
    assert epoch is not None
    assert store.load_input_positions("default") == {}
    first = WriteBatch()
    first.set_input_position("qlayer.ack", 0, 120)
    first.set_input_position("qlayer.ack", 5, 2**40)
    first.set_input_position("qlayer.control", 1, 7)
    store.commit(first, "default", "a", epoch, T0)
    later = WriteBatch()
    later.set_input_position("qlayer.ack", 0, 130)
    store.commit(later, "default", "a", epoch, T0 + 1)
    assert store.load_input_positions("default") == {
        ("qlayer.ack", 0): 130, ("qlayer.ack", 5): 2**40, ("qlayer.control", 1): 7}
    assert store.load_input_positions("other-shard") == {}

    # A fenced owner's positions are not written, like the rest of its batch.
    taken = store.take_shard("default", "b", T0 + 100)
    assert taken is not None
    stale = WriteBatch()
    stale.set_input_position("qlayer.ack", 0, 999)
    with pytest.raises(FencedError):
        store.commit(stale, "default", "a", epoch, T0 + 101)
    assert store.load_input_positions("default")[("qlayer.ack", 0)] == 130
    with pytest.raises(ValueError, match="input position"):
        stale.set_input_position("qlayer.ack", 0, -1)
