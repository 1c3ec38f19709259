"""Lease state as runs (DESIGN §3 version 2): leases and acks written as one row per group,
exceptions as rows of their own, and a restart that restores every entry as its latest write
left it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from layer.store import migrate
from layer.store.batch import WriteBatch
from layer.store.rows import EntryRow
from layer.store.store import Store, runs_of
from layer.store.tables import entries, entry_runs

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
SHARD = "Work"
OWNER = "coordinator-a"


@pytest.fixture
def epoch(store: Store) -> int:
    taken = store.take_shard(SHARD, OWNER, T0)
    assert taken is not None
    return taken


def _leased(offset: int, consumer: str, *, deliveries: int = 1, deadline: float = T0 + 30,
            partition: int = 0) -> EntryRow:
    return EntryRow(queue="Work", topic="orders", partition=partition, offset=offset,
                    state="LEASED", delivery_count=deliveries, lease_consumer=consumer,
                    lease_token=f"tok-{consumer}-{offset}-{deliveries}", lease_deadline=deadline)


def _rows(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(entries)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(entry_runs)).scalar_one())


def _commit(store: Store, epoch: int, rows: list[EntryRow], now: float,
            point: int | None = None) -> None:
    batch = WriteBatch()
    for row in rows:
        batch.put_entry(row)
    if point is not None:
        batch.set_recovery_point("Work", "orders", 0, point)
    store.commit(batch, SHARD, OWNER, epoch, now)


def test_interleaved_leases_are_one_run_per_consumer_with_every_token(
        store: Store, engine: Engine, epoch: int) -> None:
    # Fairness hands entries out one by one, so a consumer's offsets are not contiguous.
    leases = [_leased(offset, f"c{offset % 2}") for offset in range(100)]
    _commit(store, epoch, leases, T0 + 1)
    assert _rows(engine) == (0, 2)
    assert store.load_entries("Work") == leases


def test_the_latest_write_of_each_entry_wins_on_restart(
        store: Store, database_url: str, epoch: int) -> None:
    first = [_leased(offset, "c1") for offset in range(1, 6)]
    _commit(store, epoch, first, T0 + 1)
    # 3 is released with a delay (a row of its own), then 2..4 go to c2 as redeliveries.
    released = EntryRow("Work", "orders", 0, 3, "AVAILABLE", delivery_count=1,
                        available_at=T0 + 5)
    _commit(store, epoch, [released], T0 + 2)
    assert store.load_entries("Work") == [first[0], first[1], released, first[3], first[4]]
    again = [_leased(offset, "c2", deliveries=2, deadline=T0 + 40) for offset in (2, 3, 4)]
    _commit(store, epoch, again, T0 + 3)
    assert store.load_entries("Work") == [first[0], *again, first[4]]
    # 1 and 5 are acked (a run), and the recovery point stays at 1: 2..4 are still leased.
    acked = [EntryRow("Work", "orders", 0, o, "ACKED", delivery_count=1) for o in (1, 5)]
    _commit(store, epoch, acked, T0 + 4, point=1)
    assert store.load_entries("Work") == [acked[0], *again, acked[1]]
    # A restarted store (another process) reads the same.
    with Store(database_url) as restarted:
        assert restarted.load_entries("Work") == [acked[0], *again, acked[1]]


def test_a_recovery_point_past_a_run_deletes_it_and_every_older_row(
        store: Store, engine: Engine, epoch: int) -> None:
    _commit(store, epoch, [_leased(offset, "c1") for offset in range(10)], T0 + 1, point=0)
    _commit(store, epoch, [EntryRow("Work", "orders", 0, 4, "AVAILABLE", delivery_count=1,
                                    available_at=T0 + 9)], T0 + 2)
    assert _rows(engine) == (1, 1)
    # Everything acked and passed: nothing is written for the acks, and the prune takes the
    # run and the released row.
    _commit(store, epoch, [EntryRow("Work", "orders", 0, o, "ACKED", delivery_count=1)
                           for o in range(10)], T0 + 3, point=10)
    assert _rows(engine) == (0, 0)
    assert store.load_entries("Work") == []


def test_what_a_run_cannot_hold_stays_a_row_of_its_own() -> None:
    rows = [
        _leased(1, "c1"), _leased(2, "c1"),
        _leased(3, "c1", deadline=T0 + 31),  # another deadline
        EntryRow("Work", "orders", 0, 4, "EXPIRED", delivery_count=3, reason="rejected"),
        EntryRow("Work", "orders", 0, 5, "AVAILABLE", delivery_count=1),
        EntryRow("Work", "orders", 0, 6, "LEASED", delivery_count=1, lease_consumer="c1",
                 lease_token="a,b", lease_deadline=T0 + 30),  # cannot be joined by commas
    ]
    runs, singles = runs_of(rows)
    assert [(run.offsets, run.tokens) for run in runs] == [
        ([1, 2], ["tok-c1-1-1", "tok-c1-2-1"])]
    assert sorted(row.offset for row in singles) == [3, 4, 5, 6]


@pytest.mark.parametrize("text", ['plain', 'with "quotes"', "back\\slash\\", "{braces}",
                                  "ünïcödé ✓", "new\nline", "'single'", "NULL"])
def test_a_runs_consumer_and_tokens_survive_any_text(
        store: Store, epoch: int, text: str) -> None:
    leases = [EntryRow("Work", "orders", 0, o, "LEASED", delivery_count=1, lease_consumer=text,
                       lease_token=f"{text}{o}", lease_deadline=T0 + 30.25) for o in (7, 9)]
    _commit(store, epoch, leases, T0)
    assert store.load_entries("Work") == leases


def test_upgrade_from_version_1_rows_and_downgrade_writes_runs_back_as_rows(
        empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url, "0004_shards")
    engine = sa.create_engine(empty_database_url)
    now = datetime.fromtimestamp(T0, UTC)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO entries (queue, topic, partition, \"offset\", state, delivery_count,"
                " lease_consumer, lease_token, lease_deadline, updated_at) VALUES "
                "('Work', 'orders', 0, 1, 'LEASED', 1, 'c0', 'old', :t, :t)"), {"t": now})
        migrate.upgrade(empty_database_url)
        with Store(empty_database_url) as store:
            # A version-1 row reads back as it was.
            assert [(r.offset, r.lease_token) for r in store.load_entries("Work")] == [(1, "old")]
            epoch = store.take_shard(SHARD, OWNER, T0)
            assert epoch is not None
            # Offset 1 again, later, in a run; 2 and 3 with it.
            _commit(store, epoch, [_leased(o, "c1", deliveries=2) for o in (1, 2, 3)], T0 + 1)
            expected = store.load_entries("Work")
            assert [r.lease_consumer for r in expected] == ["c1"] * 3
        migrate.downgrade(empty_database_url, "0004_shards")
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT \"offset\", state, delivery_count, lease_consumer, lease_token "
                "FROM entries ORDER BY \"offset\"")).all()
        assert [tuple(r) for r in rows] == [
            (r.offset, r.state, r.delivery_count, r.lease_consumer, r.lease_token)
            for r in expected]
    finally:
        engine.dispose()
