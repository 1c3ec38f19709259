"""Schema migrations (Alembic) as a service: `qlayer db upgrade`, the tests' template database."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the `migrations` package shipped with qlayer."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("migrations")))
    # ConfigParser interpolation would choke on '%' in passwords.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> str | None:
    """Apply migrations up to revision; returns the revision the database is at afterwards."""
    command.upgrade(alembic_config(database_url), revision)
    return current_revision(database_url)


def downgrade(database_url: str, revision: str = "base") -> str | None:
    command.downgrade(alembic_config(database_url), revision)
    return current_revision(database_url)


def current_revision(database_url: str) -> str | None:
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision(database_url: str = "postgresql+psycopg://") -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
