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
