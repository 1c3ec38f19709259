"""The Alembic revision creates exactly the schema `layer.store.tables` describes, and undoes it."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from layer.store import migrate
from layer.store.tables import metadata

pytestmark = pytest.mark.integration

QLAYER_TABLES = {table.name for table in metadata.sorted_tables}


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return set(sa.inspect(conn).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_on_an_empty_database(empty_database_url: str) -> None:
    assert _tables(empty_database_url) == set()
    head = migrate.head_revision()

    assert migrate.upgrade(empty_database_url) == head
    assert _tables(empty_database_url) == QLAYER_TABLES

    assert migrate.downgrade(empty_database_url, "base") is None
    assert _tables(empty_database_url) == set()

    assert migrate.upgrade(empty_database_url) == head
    assert _tables(empty_database_url) == QLAYER_TABLES


def test_migrated_database_matches_the_metadata(database_url: str) -> None:
    engine = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            assert compare_metadata(context, metadata) == []

            # Autogenerate does not compare CHECK constraints; compare their names ourselves.
            inspector = sa.inspect(conn)
            for table in metadata.sorted_tables:
                in_database = {c["name"] for c in inspector.get_check_constraints(table.name)}
                in_metadata = {
                    str(c.name)
                    for c in table.constraints
                    if isinstance(c, sa.CheckConstraint)
                }
                assert in_database == in_metadata, table.name
    finally:
        engine.dispose()


def test_0007_counts_input_faults_from_zero_and_its_downgrade_drops_them(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0006_operator_requests")
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO queue_counters (queue, enqueued, updated_at) "
                "VALUES ('Work', 5, now())"))
        assert migrate.upgrade(empty_database_url, "0007_input_counters") == "0007_input_counters"
        with engine.begin() as conn:
            assert conn.execute(sa.text(
                "SELECT enqueued, unparseable, deletes, malformed_headers FROM queue_counters"
            )).one() == (5, 0, 0, 0)
        assert migrate.downgrade(empty_database_url, "0006_operator_requests") == (
            "0006_operator_requests")
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("queue_counters")}
        assert "unparseable" not in columns and "enqueued" in columns
    finally:
        engine.dispose()


def test_0008_gives_existing_shards_and_queues_empty_counters_and_its_downgrade_drops_them(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0007_input_counters")
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO ownership (shard, owner_id, epoch, acquired_at, heartbeat_at) "
                "VALUES ('0', 'c-1', 7, now(), now())"))
            conn.execute(sa.text(
                "INSERT INTO queue_counters (queue, enqueued, updated_at) "
                "VALUES ('Work', 5, now())"))
        assert migrate.upgrade(empty_database_url, "0008_shard_counters") == (
            "0008_shard_counters")
        with engine.begin() as conn:
            assert conn.execute(sa.text(
                "SELECT epoch, counters FROM ownership")).one() == (7, {})
            assert conn.execute(sa.text(
                "SELECT enqueued, journal_deleted FROM queue_counters")).one() == (5, 0)
            conn.execute(sa.text(
                "UPDATE ownership SET counters = '{\"too_large\": 2}'::jsonb"))
            assert conn.execute(sa.text(
                "SELECT counters FROM ownership")).scalar_one() == {"too_large": 2}
        assert migrate.downgrade(empty_database_url, "0007_input_counters") == (
            "0007_input_counters")
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("ownership")}
            counted = {c["name"] for c in sa.inspect(conn).get_columns("queue_counters")}
            assert conn.execute(sa.text("SELECT epoch FROM ownership")).scalar_one() == 7
        assert "counters" not in columns and "epoch" in columns
        assert "journal_deleted" not in counted and "enqueued" in counted
        # And up again: the shard's counters start over from empty.
        assert migrate.upgrade(empty_database_url, "0008_shard_counters") == (
            "0008_shard_counters")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT counters FROM ownership")).scalar_one() == {}
    finally:
        engine.dispose()


def test_0009_leaves_existing_sessions_unproven_and_its_downgrade_drops_the_hashes(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0008_shard_counters")
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO consumers (consumer_id, session_id, queue, is_regex, "
                "delivery_topic, session_timeout_ms, subscribed_at, last_heartbeat_at) "
                "VALUES ('w-1', 's-1', 'Work', false, 'q.delivery.w-1', 30000, now(), now())"))
        assert migrate.upgrade(empty_database_url, "0009_session_secrets") == (
            "0009_session_secrets")
        with engine.begin() as conn:
            assert conn.execute(sa.text(
                "SELECT consumer_id, secret_sha256 FROM consumers")).one() == ("w-1", None)
            conn.execute(sa.text("UPDATE consumers SET secret_sha256 = '\\x00ff'::bytea"))
        assert migrate.downgrade(empty_database_url, "0008_shard_counters") == (
            "0008_shard_counters")
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("consumers")}
            assert conn.execute(sa.text("SELECT session_id FROM consumers")).scalar_one() == "s-1"
        assert "secret_sha256" not in columns
    finally:
        engine.dispose()


def test_0010_counts_rejections_apart_and_its_downgrade_adds_them_back_to_expired(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0009_session_secrets")
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO queue_counters (queue, expired, dead_lettered, "
                                 "updated_at) VALUES ('Work', 5, 4, now())"))
        assert migrate.upgrade(empty_database_url, "0010_rejected_counter") == (
            "0010_rejected_counter")
        with engine.begin() as conn:
            # What was counted before stays where it was: the two cannot be told apart.
            assert conn.execute(sa.text(
                "SELECT expired, rejected, dead_lettered FROM queue_counters")).one() == (5, 0, 4)
            conn.execute(sa.text("UPDATE queue_counters SET rejected = 2"))
        assert migrate.downgrade(empty_database_url, "0009_session_secrets") == (
            "0009_session_secrets")
        with engine.connect() as conn:
            assert conn.execute(sa.text(
                "SELECT expired, dead_lettered FROM queue_counters")).one() == (7, 4)
            columns = {c["name"] for c in sa.inspect(conn).get_columns("queue_counters")}
        assert "rejected" not in columns
    finally:
        engine.dispose()


def _storage(conn: sa.Connection, column: str) -> str:
    """PostgreSQL's storage strategy of an entry_runs column: 'x' extended (compressed, the
    default for arrays and text), 'e' external (out of line, uncompressed)."""
    return str(conn.execute(sa.text(
        "SELECT attstorage FROM pg_attribute WHERE attrelid = 'entry_runs'::regclass "
        "AND attname = :column"), {"column": column}).scalar_one())


def test_0011_stores_runs_uncompressed_and_keeps_the_runs_already_written(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0010_rejected_counter")
    engine = sa.create_engine(empty_database_url)
    tokens = ",".join(f"{i:032x}" for i in range(200))  # past the 2 kB TOAST threshold
    insert = sa.text(
        "INSERT INTO entry_runs (queue, topic, partition, first_offset, last_offset, offsets, "
        "state, delivery_count, cancel_count, lease_consumer, lease_tokens, lease_deadline, "
        "updated_at) VALUES ('Work', 'work', :partition, 0, 199, "
        "ARRAY(SELECT generate_series(0, 199))::bigint[], 'LEASED', 1, 0, 'w-1', :tokens, "
        "now(), now())")
    try:
        with engine.begin() as conn:
            assert (_storage(conn, "offsets"), _storage(conn, "lease_tokens")) == ("x", "x")
            conn.execute(insert, {"partition": 0, "tokens": tokens})
        assert migrate.upgrade(empty_database_url, "0011_runs_stored_uncompressed") == (
            "0011_runs_stored_uncompressed")
        with engine.begin() as conn:
            assert (_storage(conn, "offsets"), _storage(conn, "lease_tokens")) == ("e", "e")
            conn.execute(insert, {"partition": 1, "tokens": tokens})
            # Both runs read back whole, the one compressed before the upgrade and the new one.
            rows = conn.execute(sa.text(
                "SELECT partition, lease_tokens, cardinality(offsets), "
                "pg_column_compression(lease_tokens) FROM entry_runs ORDER BY partition")).all()
        assert [(p, t, n) for p, t, n, _ in rows] == [(0, tokens, 200), (1, tokens, 200)]
        assert rows[0][3] == "pglz" and rows[1][3] is None
        assert migrate.downgrade(empty_database_url, "0010_rejected_counter") == (
            "0010_rejected_counter")
        with engine.connect() as conn:
            assert (_storage(conn, "offsets"), _storage(conn, "lease_tokens")) == ("x", "x")
    finally:
        engine.dispose()


def test_0012_adds_the_guard_function_a_commit_needs_and_an_older_schema_says_upgrade(
    empty_database_url: str,
) -> None:
    from layer.store.batch import WriteBatch
    from layer.store.errors import FencedError, StoreError
    from layer.store.store import Store

    migrate.upgrade(empty_database_url, "0011_runs_stored_uncompressed")
    store = Store(empty_database_url)
    try:
        epoch = store.take_shard("0", "a", 1_700_000_000.0)
        # A coordinator newer than its database: one line that says what to do.
        with pytest.raises(StoreError, match="qlayer db upgrade") as refused:
            store.commit(WriteBatch(), "0", "a", epoch, 1_700_000_001.0)
        assert not isinstance(refused.value, FencedError)
        assert migrate.upgrade(empty_database_url, "0012_hold_shard_function") == (
            "0012_hold_shard_function")
        store.commit(WriteBatch(), "0", "a", epoch, 1_700_000_002.0)
        with pytest.raises(FencedError):
            store.commit(WriteBatch(), "0", "a", epoch + 1, 1_700_000_003.0)
        assert migrate.downgrade(empty_database_url, "0011_runs_stored_uncompressed") == (
            "0011_runs_stored_uncompressed")
        with pytest.raises(StoreError, match="qlayer db upgrade"):
            store.commit(WriteBatch(), "0", "a", epoch, 1_700_000_004.0)
    finally:
        store.close()


def test_0013_opens_existing_installations_places_stored_sessions_and_downgrades(
    empty_database_url: str,
) -> None:
    migrate.upgrade(empty_database_url, "0012_hold_shard_function", shard_count=4)
    engine = sa.create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                "INSERT INTO queues (name, definition, version, created_at, updated_at, shard) "
                "VALUES ('Work', '{}', 1, now(), now(), 3)"))
            for consumer, queue, regex in (("w-1", "Work", False), ("w-2", "W.*", True),
                                           ("w-3", "Gone", False)):
                conn.execute(sa.text(
                    "INSERT INTO consumers (consumer_id, session_id, queue, is_regex, "
                    "delivery_topic, session_timeout_ms, subscribed_at, last_heartbeat_at) "
                    "VALUES (:c, 's', :q, :r, 'q.delivery.x', 30000, now(), now())"),
                    {"c": consumer, "q": queue, "r": regex})
        assert migrate.upgrade(empty_database_url, "0013_authorization") == "0013_authorization"
        with engine.begin() as conn:
            # Open: nothing changes for existing consumers until something is granted.
            assert conn.execute(sa.text(
                "SELECT authorization_mode FROM installation")).scalar_one() == "open"
            # A named queue's session is its shard's; a regex's, and one of a queue that
            # is gone, are taken by the first shard that writes them.
            assert dict(conn.execute(sa.text(
                "SELECT consumer_id, shard FROM consumers ORDER BY 1")).all()) == {
                "w-1": 3, "w-2": None, "w-3": None}
            conn.execute(sa.text(
                "INSERT INTO principals VALUES ('alice', '\\x00'::bytea, now(), now())"))
            conn.execute(sa.text(
                "INSERT INTO grants VALUES ('alice', 'queue', 'Work', now())"))
            with pytest.raises(sa.exc.IntegrityError), conn.begin_nested():
                conn.execute(sa.text(
                    "INSERT INTO grants VALUES ('alice', 'topic', 'Work', now())"))
            conn.execute(sa.text("DELETE FROM principals"))  # grants go with it
            assert conn.execute(sa.text("SELECT count(*) FROM grants")).scalar_one() == 0
        assert migrate.downgrade(empty_database_url, "0012_hold_shard_function") == (
            "0012_hold_shard_function")
        assert {"principals", "grants"} & _tables(empty_database_url) == set()
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns("consumers")}
        assert {"shard", "principal", "credential_sha256"} & columns == set()
    finally:
        engine.dispose()
