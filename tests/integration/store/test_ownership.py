"""Shard ownership with an epoch: every take counts up and fences the old owner's writes."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, event

from layer.store.batch import WriteBatch
from layer.store.errors import FencedError
from layer.store.rows import EntryKey, EntryRow, PartitionKey
from layer.store.store import Store
from layer.store.tables import metadata

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
TTL = 10.0
SHARD = "Work"


def _leased(offset: int, consumer: str, now: float) -> EntryRow:
    return EntryRow(
        queue="Work", topic="orders", partition=0, offset=offset, state="LEASED",
        delivery_count=1, lease_consumer=consumer, lease_token=f"tok-{offset}",
        lease_deadline=now + 30,
    )


def _snapshot(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every qlayer table, to prove a refused write changed nothing at all."""
    with engine.connect() as conn:
        return {
            table.name: sorted(tuple(row) for row in conn.execute(sa.select(table)))
            for table in metadata.sorted_tables
        }


@pytest.fixture
def other_store(database_url: str) -> Iterator[Store]:
    """A second coordinator: its own engine and connections, same database."""
    store = Store(database_url)
    yield store
    store.close()


def test_first_take_gets_epoch_one_and_every_take_counts_up(
    store: Store, other_store: Store
) -> None:
    assert store.owner(SHARD) is None
    assert store.take_shard(SHARD, "a", T0) == 1
    owner = other_store.owner(SHARD)
    assert owner is not None
    assert (owner.owner_id, owner.epoch, owner.acquired_at) == ("a", 1, T0)
    assert (owner.lag, owner.reported_at) == (None, None)
    # The group protocol decides who runs a shard: a take is unconditional.
    assert other_store.take_shard(SHARD, "b", T0 + 1) == 2


def test_a_take_fences_the_old_owner(
    store: Store, other_store: Store, engine: Engine
) -> None:
    epoch_a = store.take_shard(SHARD, "a", T0)
    assert epoch_a == 1
    written = WriteBatch()
    written.put_entry(_leased(0, "c1", T0))
    written.set_recovery_point("Work", "orders", 0, 0)
    store.commit(written, SHARD, "a", epoch_a, T0 + 1)

    # A's group membership was revoked (a GC pause, a partition); the group gave B the shard.
    epoch_b = other_store.take_shard(SHARD, "b", T0 + TTL)
    assert epoch_b == 2
    before = _snapshot(engine)

    zombie = WriteBatch()
    zombie.put_entry(_leased(1, "c2", T0 + TTL))
    zombie.delete_entry(EntryKey("Work", "orders", 0, 0))
    zombie.set_recovery_point("Work", "orders", 0, 1)
    zombie.count("Work", "delivered", 1)
    with pytest.raises(FencedError) as fenced:
        store.commit(zombie, SHARD, "a", epoch_a, T0 + TTL + 1)
    assert (fenced.value.shard, fenced.value.owner_id, fenced.value.epoch) == (SHARD, "a", 1)
    assert _snapshot(engine) == before

    assert store.report_shard(SHARD, "a", epoch_a, 5, T0 + TTL + 2) is False
    assert store.release(SHARD, "a", epoch_a, T0 + TTL + 2) is False
    owner = store.owner(SHARD)
    assert owner is not None
    assert (owner.owner_id, owner.epoch) == ("b", 2)

    # The new owner sees what A committed before the takeover, and can write.
    assert other_store.load_entries("Work") == [_leased(0, "c1", T0)]
    mine = WriteBatch()
    mine.put_entry(_leased(1, "c2", T0 + TTL))
    other_store.commit(mine, SHARD, "b", 2, T0 + TTL + 1)
    assert [row.offset for row in other_store.load_entries("Work")] == [0, 1]


def test_reports_record_the_lag_and_release_leaves_no_owner(
    store: Store, other_store: Store
) -> None:
    assert store.take_shard(SHARD, "a", T0) == 1
    assert store.report_shard(SHARD, "a", 1, 42, T0 + 3) is True
    owner = other_store.owner(SHARD)
    assert owner is not None
    assert (owner.lag, owner.reported_at, owner.heartbeat_at) == (42, T0 + 3, T0 + 3)

    assert store.release(SHARD, "a", 1, T0 + 4) is True
    assert store.owner(SHARD) is None
    assert store.owners() == []
    # The epoch keeps counting past a release.
    assert other_store.take_shard(SHARD, "b", T0 + 5) == 2


def test_reacquiring_with_the_same_owner_id_fences_the_previous_incarnation(
    store: Store,
) -> None:
    assert store.take_shard(SHARD, "a", T0) == 1
    assert store.take_shard(SHARD, "a", T0 + 1) == 2  # a restarted process, same id
    with pytest.raises(FencedError):
        store.commit(WriteBatch(), SHARD, "a", 1, T0 + 2)
    store.commit(WriteBatch(), SHARD, "a", 2, T0 + 2)


def test_shards_are_independent(store: Store, other_store: Store) -> None:
    assert store.take_shard("Work", "a", T0) == 1
    assert other_store.take_shard("Jobs", "b", T0) == 1
    assert [(o.shard, o.owner_id) for o in store.owners()] == [("Jobs", "b"), ("Work", "a")]
    with pytest.raises(FencedError):
        store.commit(WriteBatch(), "Jobs", "a", 1, T0 + 1)


def test_a_takeover_waits_for_the_owners_transaction_in_flight(
    store: Store, other_store: Store, engine: Engine
) -> None:
    """The guard's row lock orders a takeover after a commit that already passed the guard.

    The commit sends its whole transaction at once (guard, batch, COMMIT in one pipeline), so
    the pause is taken later in the pipeline, once the server shows the guard's row lock."""
    assert store.take_shard(SHARD, "a", T0) == 1
    guard_passed = threading.Event()
    may_continue = threading.Event()

    def ownership_row_locked() -> bool:
        with engine.connect() as probe:
            try:
                probe.execute(sa.text("SELECT 1 FROM ownership WHERE shard = :s FOR UPDATE "
                                      "NOWAIT"), {"s": SHARD})
            except sa.exc.OperationalError as error:  # 55P03 lock_not_available
                assert getattr(error.orig, "sqlstate", None) == "55P03", error
                return True
            finally:
                probe.rollback()
        return False

    def pause_after_guard(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("INSERT INTO recovery_points") and not guard_passed.is_set():
            for _ in range(200):
                if ownership_row_locked():
                    guard_passed.set()
                    break
                threading.Event().wait(0.05)
            assert guard_passed.is_set(), "the guard never took the ownership row's lock"
            assert may_continue.wait(10)

    event.listen(engine, "before_cursor_execute", pause_after_guard)
    batch = WriteBatch()
    batch.put_entry(_leased(0, "c1", T0))
    batch.set_recovery_point("Work", "orders", 0, 0)
    commit = threading.Thread(
        target=store.commit, args=(batch, SHARD, "a", 1, T0 + TTL + 1)
    )
    commit.start()
    try:
        assert guard_passed.wait(15)
        epochs: list[int | None] = []
        takeover = threading.Thread(
            target=lambda: epochs.append(other_store.take_shard(SHARD, "b", T0 + TTL + 1))
        )
        takeover.start()
        takeover.join(0.5)
        assert takeover.is_alive(), "the takeover must wait for A's transaction"
        may_continue.set()
        takeover.join(10)
        commit.join(10)
    finally:
        may_continue.set()
        event.remove(engine, "before_cursor_execute", pause_after_guard)
    assert epochs == [2]
    # A's batch committed before the takeover, so B finds it on recovery.
    assert other_store.load_entries("Work") == [_leased(0, "c1", T0)]
    assert other_store.load_recovery_points("Work") == {PartitionKey("Work", "orders", 0): 0}

