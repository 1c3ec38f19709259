"""The commit's pipeline (`layer/store/pipeline.py`) on a real server: statements are prepared
once per connection and reused; a pipeline the server cut short (a fence, a constraint, a
killed connection) writes nothing, leaves no statement wrongly taken as prepared, and leaves the
store usable."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine

from layer.store.batch import WriteBatch
from layer.store.errors import FencedError, StoreError
from layer.store.rows import ConsumerRow, EntryRow
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
SHARD = "Work"


@pytest.fixture
def one_connection(database_url: str) -> Iterator[Engine]:
    """An engine whose pool holds one connection, so every commit uses the same session."""
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _owner(engine: Engine) -> tuple[Store, int]:
    """A store on the one-connection engine that holds the shard, and its epoch."""
    store = Store(engine)
    epoch = store.take_shard(SHARD, "a", T0)
    assert epoch is not None
    return store, epoch


def _leased(offset: int) -> EntryRow:
    return EntryRow(queue="Work", topic="orders", partition=0, offset=offset, state="LEASED",
                    delivery_count=1, lease_consumer="c1", lease_token=f"t{offset}",
                    lease_deadline=T0 + 30)


def _batch(offset: int) -> WriteBatch:
    batch = WriteBatch()
    batch.put_entry(_leased(offset))
    batch.set_recovery_point("Work", "orders", 0, 1)
    batch.count("Work", "delivered", 1)
    batch.set_input_position("qlayer.ack", 0, offset)
    batch.put_events([b"event-%d" % offset])
    return batch


def _prepared(engine: Engine) -> list[str]:
    with engine.connect() as conn:  # the pool's one connection: its session's statements
        return list(conn.exec_driver_sql(
            "SELECT name FROM pg_prepared_statements ORDER BY name").scalars())


def _offsets(store: Store) -> list[int]:
    return [row.offset for row in store.load_entries("Work")]


def test_statements_are_prepared_once_per_connection(one_connection: Engine) -> None:
    store, epoch = _owner(one_connection)
    store.commit(_batch(1), SHARD, "a", epoch, T0 + 1)
    first = _prepared(one_connection)
    assert first and all(name.startswith("qlayer_") for name in first)
    for offset in range(2, 12):
        store.commit(_batch(offset), SHARD, "a", epoch, T0 + offset)
    assert _prepared(one_connection) == first  # reused, not prepared again
    assert _offsets(store) == list(range(1, 12))


def test_statements_a_fenced_pipeline_skipped_are_prepared_by_the_next(
    one_connection: Engine,
) -> None:
    store, epoch = _owner(one_connection)
    # The guard refuses first, so the server skips every PREPARE queued behind it ...
    with pytest.raises(FencedError):
        store.commit(_batch(1), SHARD, "a", epoch + 1, T0 + 1)
    # ... and the next commit on the same session must not take them as prepared.
    store.commit(_batch(2), SHARD, "a", epoch, T0 + 2)
    assert _offsets(store) == [2]


def test_a_statement_the_server_refuses_fails_the_commit_and_writes_nothing(
    one_connection: Engine,
) -> None:
    store, epoch = _owner(one_connection)
    batch = _batch(1)
    batch.put_consumer(ConsumerRow(
        consumer_id="c1", session_id="s1", queue="Work", is_regex=False,
        delivery_topic="qlayer.deliver.c1", session_timeout_ms=10_000, subscribed_at=T0,
        last_heartbeat_at=T0, max_backlog=-1))  # violates max_backlog_not_negative
    with pytest.raises(StoreError, match="max_backlog_not_negative") as failed:
        store.commit(batch, SHARD, "a", epoch, T0 + 1)
    assert failed.value.retryable is False
    assert _offsets(store) == []  # the entry before the refused statement rolled back too
    assert store.load_outbox(SHARD) == []
    store.commit(_batch(2), SHARD, "a", epoch, T0 + 2)
    assert _offsets(store) == [2]
    assert [events for _, events in store.load_outbox(SHARD)] == [b"event-2"]


def test_a_killed_connection_fails_one_commit_then_the_store_reconnects(
    one_connection: Engine, database_url: str,
) -> None:
    store, epoch = _owner(one_connection)
    store.commit(_batch(1), SHARD, "a", epoch, T0 + 1)  # the session has prepared statements
    admin = sa.create_engine(database_url)
    try:
        with admin.connect() as conn:
            killed = conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()")).scalar_one()
    finally:
        admin.dispose()
    assert killed == 1
    with pytest.raises(StoreError) as failed:
        store.commit(_batch(2), SHARD, "a", epoch, T0 + 2)
    assert failed.value.retryable is True
    # A new session: nothing of the old one's prepared statements is assumed.
    store.commit(_batch(3), SHARD, "a", epoch, T0 + 3)
    assert _offsets(store) == [1, 3]


def test_a_rollback_on_the_session_keeps_the_commit_s_statements(
    one_connection: Engine,
) -> None:
    """psycopg deallocates every statement of a session after a rollback once it has prepared
    some of its own; the store turns its preparing off, so the commit's statements stay."""
    store, epoch = _owner(one_connection)
    store.commit(_batch(1), SHARD, "a", epoch, T0 + 1)
    prepared = _prepared(one_connection)
    with one_connection.connect() as conn:  # a caller repeating a query in one checkout
        for _ in range(8):  # psycopg prepares a query with parameters from its 5th run
            conn.execute(sa.text("SELECT CAST(:x AS integer)"), {"x": 1})
    # The pool's reset on return was a rollback, after which psycopg would have sent
    # DEALLOCATE ALL had it prepared anything.
    assert _prepared(one_connection) == prepared
    store.commit(_batch(2), SHARD, "a", epoch, T0 + 2)
    assert _offsets(store) == [1, 2]


def test_statements_deallocated_behind_the_store_s_back_are_prepared_again(
    one_connection: Engine,
) -> None:
    store, epoch = _owner(one_connection)
    store.commit(_batch(1), SHARD, "a", epoch, T0 + 1)
    with one_connection.connect() as conn:
        conn.exec_driver_sql("DEALLOCATE ALL")
    assert _prepared(one_connection) == []
    store.commit(_batch(2), SHARD, "a", epoch, T0 + 2)  # no error: prepared again, once more
    assert _prepared(one_connection)
    assert _offsets(store) == [1, 2]
    assert [events for _, events in store.load_outbox(SHARD)] == [b"event-1", b"event-2"]
