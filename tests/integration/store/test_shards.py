"""Shards in PostgreSQL: the installation's count, each queue's placement, moving a queue
(fenced), the coordinator-process registry, and the upgrade of a version-1 database."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from layer.domain.errors import QueueConfigError, UnknownQueueError
from layer.domain.shards import DEFAULT_SHARD_COUNT
from layer.store import migrate
from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import PartitionKey
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0


def _definition(name: str, **extra: object) -> dict[str, object]:
    return {"name": name, "underlying_topic": name, **extra}


@pytest.fixture
def store(empty_database_url: str) -> Iterator[Store]:
    """A database of the default sixteen shards (the suite's template has four)."""
    migrate.upgrade(empty_database_url)
    with Store(empty_database_url) as store:
        yield store


def test_queues_are_placed_by_name_group_or_explicit_shard(store: Store) -> None:
    assert store.shard_count() == DEFAULT_SHARD_COUNT
    store.put_queue("Work", _definition("Work"), T0)
    store.put_queue("A", _definition("A", shard_group="orders"), T0)
    store.put_queue("B", _definition("B", shard_group="orders"), T0)
    store.put_queue("Pinned", _definition("Pinned", shard=3), T0)
    placed = {q.name: q.shard for q in store.list_queues()}
    assert placed["Work"] == zlib.crc32(b"Work") % DEFAULT_SHARD_COUNT
    assert placed["A"] == placed["B"] == zlib.crc32(b"orders") % DEFAULT_SHARD_COUNT
    assert placed["Pinned"] == 3


def test_a_shard_that_does_not_exist_is_refused_with_the_range(store: Store) -> None:
    with pytest.raises(QueueConfigError, match=r"shard 16 does not exist.*0\.\.15"):
        store.put_queue("Pinned", _definition("Pinned", shard=16), T0)
    assert store.list_queues() == []


def test_moving_a_queue_fences_the_old_shard_and_keeps_its_state(store: Store) -> None:
    store.put_queue("Work", _definition("Work", shard=2), T0)
    epoch = store.take_shard("2", "a", T0)
    written = WriteBatch()
    written.set_recovery_point("Work", "Work", 0, 7)
    store.commit(written, "2", "a", epoch, T0 + 1)

    moved = store.move_queue("Work", 5, T0 + 2)
    assert (moved.from_shard, moved.to_shard) == (2, 5)
    record = store.get_queue("Work")
    assert record is not None and (record.shard, record.version) == (5, moved.version)
    # The old owner's next write fails: it must rebuild without the queue.
    with pytest.raises(FencedError):
        store.commit(WriteBatch(), "2", "a", epoch, T0 + 3)
    owner = store.owner("2")
    assert owner is not None and owner.epoch == epoch + 1
    # The state went with the queue: the new shard's owner loads it.
    assert store.load_recovery_points("Work") == {PartitionKey("Work", "Work", 0): 7}

    again = store.move_queue("Work", 5, T0 + 4)
    assert again.version == moved.version  # already there: nothing changes
    with pytest.raises(QueueConfigError, match="does not exist"):
        store.move_queue("Work", 99, T0 + 5)
    with pytest.raises(UnknownQueueError):
        store.move_queue("Nope", 1, T0 + 5)


def test_changing_shard_in_the_queue_file_is_a_fenced_move(store: Store) -> None:
    store.put_queue("Work", _definition("Work", shard=1), T0)
    epoch = store.take_shard("1", "a", T0)
    store.put_queue("Work", _definition("Work", shard=4), T0 + 1)
    record = store.get_queue("Work")
    assert record is not None and record.shard == 4
    with pytest.raises(FencedError):
        store.commit(WriteBatch(), "1", "a", epoch, T0 + 2)
    # Another change of the definition leaves the placement alone.
    store.put_queue("Work", _definition("Work", shard=4, lease_period=10), T0 + 3)
    record = store.get_queue("Work")
    assert record is not None and record.shard == 4


def test_a_move_by_hand_survives_definition_changes(store: Store) -> None:
    store.put_queue("Work", _definition("Work"), T0)
    store.move_queue("Work", 9, T0 + 1)
    store.put_queue("Work", _definition("Work", lease_period=10), T0 + 2)
    record = store.get_queue("Work")
    assert record is not None and record.shard == 9


def test_the_process_registry(store: Store) -> None:
    assert store.processes() == []
    store.report_process("p1", "host-a", 101, T0, [3, 1], T0 + 1)
    store.report_process("p2", "host-b", 202, T0, [], T0 + 1)
    store.report_process("p1", "host-a", 101, T0, [1, 3, 5], T0 + 2)
    rows = store.processes()
    assert [(r.owner_id, r.shards, r.seen_at) for r in rows] == [
        ("p1", (1, 3, 5), T0 + 2), ("p2", (), T0 + 1)]
    assert store.forget_processes_seen_before(T0 + 1.5) == 1
    store.forget_process("p1")
    assert store.processes() == []


def test_a_process_reports_itself_and_its_shards_in_one_go(store: Store) -> None:
    one, two = store.take_shard("1", "p1", T0), store.take_shard("2", "p1", T0)
    store.take_shard("2", "p2", T0 + 1)  # shard 2 moved on: p1's report must not touch it
    store.report_process("gone", "host-z", 303, T0, [], T0)
    store.report("p1", "host-a", 101, T0, [1, 2], {"1": (one, 17), "2": (two, 99)}, T0 + 5,
                 forget_before=T0 + 1)
    owners = {o.shard: o for o in store.owners()}
    assert (owners["1"].owner_id, owners["1"].lag, owners["1"].reported_at) == ("p1", 17, T0 + 5)
    assert (owners["2"].owner_id, owners["2"].lag) == ("p2", None)
    assert [(r.owner_id, r.shards, r.seen_at) for r in store.processes()] == [
        ("p1", (1, 2), T0 + 5)]  # and the silent one is forgotten


def test_upgrading_a_version_one_database_places_its_queues(empty_database_url: str) -> None:
    """0003 → 0004: queues get a shard by hash, the single shard's input positions go to the
    shard that reads each partition, and the version-1 ownership row is dropped."""
    migrate.upgrade(empty_database_url, "0003_input_positions")
    engine = sa.create_engine(empty_database_url)
    now = datetime.fromtimestamp(T0, UTC)
    try:
        with engine.begin() as conn:
            for name in ("Work", "Jobs"):
                conn.execute(sa.text(
                    "INSERT INTO queues (name, definition, version, created_at, updated_at) "
                    "VALUES (:n, CAST(:d AS jsonb), 1, :t, :t)"),
                    {"n": name, "d": f'{{"name": "{name}", "underlying_topic": "{name}"}}',
                     "t": now})
            conn.execute(sa.text(
                "INSERT INTO ownership (shard, owner_id, epoch, acquired_at, heartbeat_at, "
                "expires_at) VALUES ('default', 'v1', 7, :t, :t, :t)"), {"t": now})
            for partition, offset in ((0, 10), (5, 50)):
                conn.execute(sa.text(
                    "INSERT INTO input_positions (shard, topic, partition, next_offset, "
                    "updated_at) VALUES ('default', 'qlayer.ack', :p, :o, :t)"),
                    {"p": partition, "o": offset, "t": now})
        migrate.upgrade(empty_database_url, shard_count=4)
        with Store(empty_database_url) as store:
            assert store.shard_count() == 4
            placed = {q.name: q.shard for q in store.list_queues()}
            assert placed == {"Work": zlib.crc32(b"Work") % 4, "Jobs": zlib.crc32(b"Jobs") % 4}
            assert store.owners() == []
            assert store.load_input_positions("0") == {("qlayer.ack", 0): 10}
            assert store.load_input_positions("1") == {("qlayer.ack", 5): 50}
            assert store.take_shard("0", "v2", T0) == 1
        # And back: one shard again, every position kept.
        migrate.downgrade(empty_database_url, "0003_input_positions")
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT shard, partition, next_offset FROM input_positions ORDER BY partition"
            )).all()
        assert [tuple(r) for r in rows] == [("default", 0, 10), ("default", 5, 50)]
    finally:
        engine.dispose()
