"""Operator requests on a queue's row (0006): ack by filter, reset, and a changed
recovery_point recorded as a reset; the revision's upgrade backfill and its downgrade."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from layer.domain.errors import UnknownQueueError
from layer.store import migrate
from layer.store.batch import WriteBatch
from layer.store.rows import PartitionKey
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0
WORK = {"name": "Work", "underlying_topic": "orders", "recovery_point": "beginning"}


def _complete_purge(store: Store, requested_at: float, acked: int, now: float) -> None:
    epoch = store.take_shard("0", "a", now)
    batch = WriteBatch()
    batch.purge_done("Work", requested_at, acked)
    store.commit(batch, "0", "a", epoch, now)


def test_an_ack_by_filter_is_stored_and_completed_with_its_count(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    assert store.request_purge("Work", T0 + 1, "/kind = 'x'") == 2
    record = store.get_queue("Work")
    assert record is not None and record.purge_pending
    assert record.purge_filter == "/kind = 'x'"
    _complete_purge(store, T0 + 1, 3, T0 + 2)
    # Carried out again before the catalog showed it done: both counts are the request's.
    _complete_purge(store, T0 + 1, 2, T0 + 3)
    done = store.get_queue("Work")
    assert done is not None and not done.purge_pending and done.purge_acked == 5
    # A new request starts its own filter and count.
    store.request_purge("Work", T0 + 4, "/kind = 'y'")
    _complete_purge(store, T0 + 4, 1, T0 + 5)
    again = store.get_queue("Work")
    assert again is not None and (again.purge_filter, again.purge_acked) == ("/kind = 'y'", 1)


def test_requests_made_while_one_is_pending_are_joined(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    store.request_purge("Work", T0 + 1, "/a = 1")
    store.request_purge("Work", T0 + 2, "/b = 2")
    record = store.get_queue("Work")
    assert record is not None and record.purge_filter == "(/a = 1) OR (/b = 2)"
    store.request_purge("Work", T0 + 3)  # a purge of everything covers both
    record = store.get_queue("Work")
    assert record is not None and record.purge_filter is None
    store.request_purge("Work", T0 + 4, "/c = 3")
    record = store.get_queue("Work")
    assert record is not None and record.purge_filter is None
    with pytest.raises(UnknownQueueError):
        store.request_purge("Nope", T0, "/a = 1")


def test_a_reset_is_requested_and_completed(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    assert store.request_reset("Work", "0:5", T0 + 1) == 2
    record = store.get_queue("Work")
    assert record is not None and record.reset_pending and record.reset_to == "0:5"
    epoch = store.take_shard("0", "a", T0 + 2)
    batch = WriteBatch()
    batch.reset_done("Work", T0 + 1)
    store.commit(batch, "0", "a", epoch, T0 + 2)
    done = store.get_queue("Work")
    assert done is not None and not done.reset_pending and done.reset_done_at == T0 + 1
    with pytest.raises(UnknownQueueError):
        store.request_reset("Nope", "end", T0)


def test_a_changed_recovery_point_requests_a_reset_to_it(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    created = store.get_queue("Work")
    assert created is not None
    assert (created.positions_from, created.reset_to) == ("beginning", None)
    store.put_queue("Work", {**WORK, "lease_period": 30.0}, T0 + 1)
    other = store.get_queue("Work")
    assert other is not None and other.reset_to is None  # other changes move nothing
    store.put_queue("Work", {**WORK, "recovery_point": "end"}, T0 + 2)
    moved = store.get_queue("Work")
    assert moved is not None and moved.reset_pending
    assert (moved.positions_from, moved.reset_to, moved.reset_requested_at) == (
        "end", "end", T0 + 2)
    # Re-created: a new queue starts at its setting; nothing is pending.
    store.delete_queue("Work", T0 + 3)
    store.put_queue("Work", {**WORK, "recovery_point": "end"}, T0 + 4)
    again = store.get_queue("Work")
    assert again is not None and not again.reset_pending and again.positions_from == "end"


def test_a_moved_back_partition_forgets_its_entry_rows(store: Store) -> None:
    from layer.store.rows import EntryRow

    store.put_queue("Work", WORK, T0)
    epoch = store.take_shard("0", "a", T0)
    batch = WriteBatch()
    batch.set_recovery_point("Work", "orders", 0, 2)
    batch.set_recovery_point("Work", "orders", 1, 2)
    for partition in (0, 1):
        for offset in (2, 3):
            batch.put_entry(EntryRow("Work", "orders", partition, offset, "ACKED"))
    store.commit(batch, "0", "a", epoch, T0)
    back = WriteBatch()
    back.forget_partition("Work", "orders", 0)
    back.set_recovery_point("Work", "orders", 0, 0)
    store.commit(back, "0", "a", epoch, T0 + 1)
    assert {(r.partition, r.offset) for r in store.load_entries("Work")} == {(1, 2), (1, 3)}
    assert store.load_recovery_points("Work")[PartitionKey("Work", "orders", 0)] == 0


def test_0006_backfills_positions_and_its_downgrade_drops_pending_filtered_acks(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0005_batch_shapes")
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO queues (name, definition, version, created_at, updated_at, shard) "
                "VALUES ('Work', '{\"recovery_point\": \"end\"}', 1, now(), now(), 0)"))
        assert migrate.upgrade(empty_database_url, "0006_operator_requests") == (
            "0006_operator_requests")
        with engine.begin() as conn:
            assert conn.execute(sa.text(
                "SELECT positions_from FROM queues")).scalar_one() == "end"
            conn.execute(sa.text(
                "UPDATE queues SET purge_requested_at = now(), purge_filter = '/a = 1'"))
        assert migrate.downgrade(empty_database_url, "0005_batch_shapes") == "0005_batch_shapes"
        with engine.begin() as conn:
            # The previous coordinator would purge everything: the request is dropped.
            assert conn.execute(sa.text(
                "SELECT purged_at = purge_requested_at FROM queues")).scalar_one() is True
    finally:
        engine.dispose()
