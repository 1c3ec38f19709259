"""Alembic environment: the target metadata is qlayer's SQLAlchemy Core metadata.

Run through `qlayer db upgrade` (layer.store.migrate), which passes the database URL in the
Alembic config; `alembic -c alembic.ini upgrade head` works too with QLAYER_DATABASE_URL set.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import URL, create_engine, pool

from layer.store.tables import metadata
from layer.store.url import parse_database_url

config = context.config
target_metadata = metadata


def _url() -> URL:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("QLAYER_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set QLAYER_DATABASE_URL or pass --database-url")
    # As `qlayer db upgrade` reads it: `postgres://` and `postgresql://` mean psycopg 3 (plain
    # `alembic` with such a URL would otherwise look for psycopg2).
    return parse_database_url(url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connectable = config.attributes.get("connection")
    if connectable is not None:
        context.configure(connection=connectable, target_metadata=target_metadata,
                          compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          compare_type=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
