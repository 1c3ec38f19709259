"""The write path: one transaction per loop iteration, a handful of statements per batch.

Statement counts come from the engine's ``before_cursor_execute`` event (an executemany counts
once per parameter set), i.e. what PostgreSQL actually executes, BEGIN and COMMIT aside.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import ConsumerRow, EntryKey, EntryRow, PartitionKey
from layer.store.store import Store, recording_statements
from layer.store.tables import entries, entry_runs

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
SHARD = "Work"
OWNER = "coordinator-a"
PARTITIONS = 3


@pytest.fixture
def epoch(store: Store) -> int:
    taken = store.take_shard(SHARD, OWNER, T0)
    assert taken is not None
    return taken


def _leased(partition: int, offset: int, now: float = T0, deliveries: int = 1) -> EntryRow:
    return EntryRow(
        queue="Work", topic="orders", partition=partition, offset=offset, state="LEASED",
        delivery_count=deliveries, lease_consumer=f"consumer-{offset % 3}",
        lease_token=f"token-{partition}-{offset}", lease_deadline=now + 30,
    )


def _acked(partition: int, offset: int, deliveries: int = 1) -> EntryRow:
    return EntryRow(
        queue="Work", topic="orders", partition=partition, offset=offset, state="ACKED",
        delivery_count=deliveries,
    )


def _consumer(consumer_id: str, heartbeat: float = T0) -> ConsumerRow:
    return ConsumerRow(
        consumer_id=consumer_id, session_id=f"session-{consumer_id}", queue="Work",
        is_regex=False, delivery_topic=f"qlayer.deliver.{consumer_id}",
        session_timeout_ms=10_000, subscribed_at=T0, last_heartbeat_at=heartbeat,
        max_backlog=10,
    )


def _count_entries(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(entries)).scalar_one()


def _count_runs(engine: Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(entry_runs)).scalar_one()


def test_a_thousand_leases_and_a_thousand_acks_are_a_handful_of_statements(
    store: Store, engine: Engine, epoch: int
) -> None:
    # Iteration 1: 1,000 new leases over three partitions, recovery points, consumers, counters.
    first = WriteBatch()
    for offset in range(1000):
        first.put_entry(_leased(offset % PARTITIONS, offset))
    for partition in range(PARTITIONS):
        first.set_recovery_point("Work", "orders", partition, 0)
    for consumer_id in ("consumer-0", "consumer-1", "consumer-2"):
        first.put_consumer(_consumer(consumer_id))
    first.count("Work", "delivered", 1000)
    with recording_statements(engine) as sent:
        result = store.commit(first, SHARD, OWNER, epoch, T0 + 1)
    # guard, run insert, recovery point upsert, the two prunes, consumer upsert, counters
    assert len(sent) == result.statements == 7
    # One run per partition (each partition's leases share a consumer and a deadline here):
    # three rows for a thousand leases.
    assert result.entries_written == 1000 and result.rows_written == PARTITIONS
    assert _count_entries(engine) == 0 and _count_runs(engine) == PARTITIONS

    # Iteration 2: acks for all 1,000 leases and 1,000 new leases; the recovery points move past
    # part of the acked range (those acks write nothing: the prune takes what is below).
    second = WriteBatch()
    for offset in range(1000):
        second.put_entry(_acked(offset % PARTITIONS, offset))
    for offset in range(1000, 2000):
        second.put_entry(_leased(offset % PARTITIONS, offset, T0 + 2))
    for partition in range(PARTITIONS):
        second.set_recovery_point("Work", "orders", partition, 600)
    second.count("Work", "acked", 1000)
    second.count("Work", "delivered", 1000)
    for consumer_id in ("consumer-0", "consumer-1", "consumer-2"):
        second.heartbeat(consumer_id, T0 + 2)
    with recording_statements(engine) as sent:
        result = store.commit(second, SHARD, OWNER, epoch, T0 + 2)
    # guard, run insert, recovery points, the two prunes, heartbeats, counters
    assert len(sent) == result.statements == 7
    below = sum(1 for offset in range(1000) if offset < 600)
    assert result.entries_deleted == 0
    assert result.entries_written == 2000 - below
    assert result.rows_written == 2 * PARTITIONS  # acked runs and leased runs

    stored = store.load_entries("Work")
    assert len(stored) == 2000 - below
    assert _count_entries(engine) == 0
    assert {row.offset for row in stored if row.state == "ACKED"} == set(range(600, 1000))
    assert {row.offset for row in stored if row.state == "LEASED"} == set(range(1000, 2000))
    assert store.load_counters("Work")["Work"].acked == 1000
    assert store.load_counters("Work")["Work"].delivered == 2000


def test_statement_count_does_not_grow_with_the_batch(
    store: Store, engine: Engine, epoch: int
) -> None:
    counts = []
    for size, start in ((10, 0), (5000, 10)):
        batch = WriteBatch()
        for offset in range(start, start + size):
            batch.put_entry(_leased(0, offset))
        batch.set_recovery_point("Work", "orders", 0, 0)
        with recording_statements(engine) as sent:
            store.commit(batch, SHARD, OWNER, epoch, T0 + 1)
        counts.append(len(sent))
    assert counts[0] == counts[1] == 5  # guard, run insert, recovery point, two prunes
    assert len(store.load_entries("Work")) == 5010


def test_the_recovery_point_prunes_done_entries_and_keeps_the_rest(
    store: Store, engine: Engine, epoch: int
) -> None:
    leases = WriteBatch()
    for offset in range(10):
        leases.put_entry(_leased(0, offset))
    leases.set_recovery_point("Work", "orders", 0, 0)
    store.commit(leases, SHARD, OWNER, epoch, T0 + 1)

    # Out-of-order acks: 0-3 and 6-7 are acked, 5 is dead-lettered; 4, 8, 9 still leased.
    acks = WriteBatch()
    for offset in (0, 1, 2, 3, 6, 7):
        acks.put_entry(_acked(0, offset))
    acks.put_entry(
        EntryRow(queue="Work", topic="orders", partition=0, offset=5, state="EXPIRED",
                 delivery_count=5, reason="max-deliveries")
    )
    acks.set_recovery_point("Work", "orders", 0, 4)
    result = store.commit(acks, SHARD, OWNER, epoch, T0 + 2)
    # 0-3 are passed: nothing written for them. 6 and 7 are one run, 5 a row of its own.
    assert result.entries_deleted == 0 and result.entries_pruned == 0
    assert result.entries_written == 3 and result.rows_written == 2
    assert [(row.offset, row.state) for row in store.load_entries("Work")] == [
        (4, "LEASED"), (5, "EXPIRED"), (6, "ACKED"), (7, "ACKED"), (8, "LEASED"), (9, "LEASED"),
    ]

    # 4 is acked: the recovery point jumps to 8, past the rows written in the last batch.
    finish = WriteBatch()
    finish.put_entry(_acked(0, 4))
    finish.set_recovery_point("Work", "orders", 0, 8)
    result = store.commit(finish, SHARD, OWNER, epoch, T0 + 3)
    assert result.entries_deleted == 0 and result.rows_written == 0
    assert result.entries_pruned == 1  # 5 (EXPIRED); the runs ending below 8 went too
    assert [(row.offset, row.state) for row in store.load_entries("Work")] == [
        (8, "LEASED"), (9, "LEASED"),
    ]
    # Left: the two lease runs holding 8 and 9 (their offsets below 8 are not read).
    assert _count_entries(engine) == 0 and _count_runs(engine) == 2


def test_maintenance_deletes_every_row_below_recovery_points(
    store: Store, epoch: int
) -> None:
    # Recovery points first; then, in a later batch that moves none, entries below them.
    points = WriteBatch()
    points.set_recovery_point("Work", "orders", 0, 10)
    points.set_recovery_point("Other", "orders", 0, 10)
    store.commit(points, SHARD, OWNER, epoch, T0 + 1)
    rows = WriteBatch()
    for offset in range(5):
        rows.put_entry(_acked(0, offset))
    # Below the recovery point everything is done: a LEASED row there is an older write that a
    # run (or the point itself) superseded, and goes too.
    rows.put_entry(_leased(0, 7))
    rows.put_entry(_acked(0, 12))  # with 0-4: one run, kept while it reaches the point
    other = EntryRow(queue="Other", topic="orders", partition=0, offset=3, state="ACKED")
    rows.put_entry(other)
    store.commit(rows, SHARD, OWNER, epoch, T0 + 2)

    assert store.delete_done_below_recovery_points("Work") == 1  # the row of 7
    assert [(row.offset, row.state) for row in store.load_entries("Work")] == [(12, "ACKED")]
    # Another queue over the same journal keeps its own rows until asked.
    assert store.load_entries("Other") == []  # below its recovery point: not needed on restart
    assert store.delete_done_below_recovery_points() == 1
    assert store.delete_done_below_recovery_points() == 0


def test_queues_over_one_journal_keep_separate_entries_and_recovery_points(
    store: Store, epoch: int
) -> None:
    batch = WriteBatch()
    for queue in ("Work", "Audit"):
        batch.put_entry(
            EntryRow(queue=queue, topic="orders", partition=1, offset=42, state="LEASED",
                     delivery_count=1, lease_consumer="c", lease_token=queue,
                     lease_deadline=T0 + 30)
        )
    batch.set_recovery_point("Work", "orders", 1, 40)
    batch.set_recovery_point("Audit", "orders", 1, 42)
    store.commit(batch, SHARD, OWNER, epoch, T0 + 1)

    ack = WriteBatch()
    ack.put_entry(_acked(1, 42))
    ack.set_recovery_point("Work", "orders", 1, 43)
    store.commit(ack, SHARD, OWNER, epoch, T0 + 2)

    assert store.load_entries("Work") == []
    assert [(row.queue, row.state, row.lease_token) for row in store.load_entries("Audit")] == [
        ("Audit", "LEASED", "Audit")
    ]
    assert store.load_recovery_points() == {
        PartitionKey("Audit", "orders", 1): 42,
        PartitionKey("Work", "orders", 1): 43,
    }


def test_the_last_write_of_a_row_in_a_batch_wins(store: Store, epoch: int) -> None:
    batch = WriteBatch()
    batch.put_entry(_leased(0, 1))
    batch.put_entry(_acked(0, 1))  # leased and acked within one iteration: one row write
    batch.put_entry(_leased(0, 2))
    batch.delete_entry(EntryKey("Work", "orders", 0, 2))
    batch.delete_entry(EntryKey("Work", "orders", 0, 3))
    batch.put_entry(_leased(0, 3))
    batch.set_recovery_point("Work", "orders", 0, 0)
    batch.set_recovery_point("Work", "orders", 0, 1)
    result = store.commit(batch, SHARD, OWNER, epoch, T0 + 1)
    assert result.entries_written == 2
    assert store.load_entries("Work") == [_acked(0, 1), _leased(0, 3)]
    assert store.load_recovery_points("Work") == {PartitionKey("Work", "orders", 0): 1}


def test_consumers_are_upserted_heartbeated_and_deleted(store: Store, epoch: int) -> None:
    batch = WriteBatch()
    batch.put_consumer(_consumer("c1"))
    batch.put_consumer(_consumer("c2"))
    store.commit(batch, SHARD, OWNER, epoch, T0)

    beats = WriteBatch()
    beats.heartbeat("c1", T0 + 5)
    beats.heartbeat("c1", T0 + 3)  # arrived late: the newer time stays
    beats.heartbeat("c2", T0 + 4)
    beats.heartbeat("gone", T0 + 4)  # unknown consumer: nothing to update, nothing breaks
    store.commit(beats, SHARD, OWNER, epoch, T0 + 5)
    assert [(c.consumer_id, c.last_heartbeat_at) for c in store.load_consumers()] == [
        ("c1", T0 + 5), ("c2", T0 + 4),
    ]

    stale = WriteBatch()
    stale.heartbeat("c1", T0 + 1)  # older than the stored one: time never goes back
    stale.delete_consumer("c2")
    stale.put_consumer(_consumer("c3", heartbeat=T0 + 6))
    store.commit(stale, SHARD, OWNER, epoch, T0 + 6)
    assert [(c.consumer_id, c.last_heartbeat_at) for c in store.load_consumers()] == [
        ("c1", T0 + 5), ("c3", T0 + 6),
    ]


def test_a_session_delete_leaves_a_newer_session_of_the_consumer_alone(
    store: Store, epoch: int
) -> None:
    """A shard ending its old session must not delete the consumer's row once another shard
    stored a newer session for it."""
    first = WriteBatch()
    first.put_consumer(replace(_consumer("c1", heartbeat=T0), session_id="new"))
    first.put_consumer(replace(_consumer("c2", heartbeat=T0), session_id="s2"))
    store.commit(first, SHARD, OWNER, epoch, T0 + 1)

    ended = WriteBatch()
    ended.delete_consumer("c1", "old")  # the old session: the row has moved on
    ended.delete_consumer("c2", "s2")  # the current session: the row goes
    store.commit(ended, SHARD, OWNER, epoch, T0 + 2)
    assert [(c.consumer_id, c.session_id) for c in store.load_consumers()] == [("c1", "new")]


def test_counters_accumulate_across_batches(store: Store, epoch: int) -> None:
    for _ in range(3):
        batch = WriteBatch()
        batch.count("Work", "enqueued", 10)
        batch.count("Work", "delivered", 4)
        batch.count("Work", "acked", 3)
        batch.count("Work", "redelivered")
        batch.count("Jobs", "dead_lettered", 2)
        store.commit(batch, SHARD, OWNER, epoch, T0 + 1)
    counters = store.load_counters()
    work, jobs = counters["Work"], counters["Jobs"]
    assert (work.enqueued, work.delivered, work.acked, work.redelivered) == (30, 12, 9, 3)
    assert (work.released, work.dead_lettered) == (0, 0)
    assert jobs.dead_lettered == 6 and jobs.enqueued == 0
    assert work.updated_at == T0 + 1

    with pytest.raises(ValueError, match="unknown counter"):
        WriteBatch().count("Work", "ackd")
    with pytest.raises(ValueError, match="only grow"):
        WriteBatch().count("Work", "acked", -1)


def test_forgetting_a_queue_drops_its_state_before_the_rest_of_the_batch(
    store: Store, epoch: int
) -> None:
    batch = WriteBatch()
    batch.put_entry(_leased(0, 1))
    batch.set_recovery_point("Work", "orders", 0, 1)
    batch.count("Work", "delivered", 1)
    batch.put_entry(EntryRow(queue="Jobs", topic="jobs", partition=0, offset=1, state="ACKED"))
    store.commit(batch, SHARD, OWNER, epoch, T0 + 1)

    purge = WriteBatch()
    purge.put_entry(_leased(0, 2))  # collected before the forget: dropped with the queue
    purge.forget_queue("Work")
    purge.set_recovery_point("Work", "orders", 0, 500)  # after: the fresh start is written
    store.commit(purge, SHARD, OWNER, epoch, T0 + 2)

    assert store.load_entries("Work") == []
    assert store.load_recovery_points("Work") == {PartitionKey("Work", "orders", 0): 500}
    assert "Work" not in store.load_counters()
    assert len(store.load_entries("Jobs")) == 1


@pytest.mark.parametrize("text", ['plain', '', 'NULL', 'with "quotes"', "back\\slash\\", "a,b",
                                  "{braces}", " spaces ", "ünïcödé ✓", "new\nline", "'single'"])
def test_any_text_survives_the_array_literal_a_batch_is_sent_as(
        store: Store, epoch: int, text: str) -> None:
    # Batches travel as PostgreSQL array literals ('{"a","b",NULL}'): whatever a consumer id,
    # lease token or reason holds must come back unchanged, and None must stay NULL.
    leased = EntryRow(queue="Work", topic="orders", partition=0, offset=7, state="LEASED",
                      delivery_count=2, cancel_count=1, lease_consumer=text, lease_token=text,
                      lease_deadline=T0 + 30.25, available_at=None)
    expired = EntryRow(queue="Work", topic="orders", partition=0, offset=8, state="EXPIRED",
                       delivery_count=3, available_at=T0 + 1.5, reason=text)
    batch = WriteBatch()
    batch.put_entry(leased)
    batch.put_entry(expired)
    store.commit(batch, SHARD, OWNER, epoch, T0)
    assert store.load_entries("Work") == [leased, expired]


def test_the_commit_leaves_its_connection_transactional_and_idle(database_url: str) -> None:
    """The commit runs on a connection in autocommit mode (its pipeline sends BEGIN and
    COMMIT itself); the pool must get it back as every other caller expects it: not in
    autocommit mode and outside any transaction, after a commit and after a refused one."""
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    store = Store(engine)
    try:
        epoch = store.take_shard(SHARD, "a", T0)
        batch = WriteBatch()
        batch.put_entry(_leased(0, 1))
        store.commit(batch, SHARD, "a", epoch, T0 + 1)
        with pytest.raises(FencedError):
            store.commit(WriteBatch(), SHARD, "a", epoch + 1, T0 + 2)
        with engine.connect() as conn:  # the one pooled connection, used by both commits
            driver = conn.connection.driver_connection
            assert driver is not None
            assert driver.autocommit is False
            assert driver.info.transaction_status == 0  # IDLE
        # And a transaction of another caller still rolls back as a whole.
        with pytest.raises(RuntimeError), engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM entries"))
            raise RuntimeError("give up")
        assert [row.offset for row in store.load_entries("Work")] == [1]
    finally:
        engine.dispose()
