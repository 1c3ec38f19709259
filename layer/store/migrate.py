"""Schema migrations (Alembic) as a service: `qlayer db upgrade`, the tests' template database."""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from layer.store.errors import translate_errors
from layer.store.url import parse_database_url


def _where(database_url: str) -> str:
    """The database for messages, without its password; `DatabaseUrlError` if it is no URL."""
    return parse_database_url(database_url).render_as_string(hide_password=True)


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the `migrations` package shipped with qlayer."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("layer_migrations")))
    # ConfigParser interpolation would choke on '%' in passwords.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head", *,
            shard_count: int | None = None) -> str | None:
    """Apply migrations up to revision; returns the revision the database is at afterwards.

    ``shard_count`` is used by the revision that creates the installation (0004); a database
    past it keeps the count it has (`Store.shard_count`)."""
    cfg = alembic_config(database_url)
    if shard_count is not None:
        cfg.attributes["qlayer_shard_count"] = shard_count
    with translate_errors(f"migrating {_where(database_url)} (is PostgreSQL running? "
                          "`qlayer dev up` starts a local one)"):
        command.upgrade(cfg, revision)
    return current_revision(database_url)


def downgrade(database_url: str, revision: str = "base") -> str | None:
    with translate_errors(f"migrating {_where(database_url)} down"):
        command.downgrade(alembic_config(database_url), revision)
    return current_revision(database_url)


def current_revision(database_url: str) -> str | None:
    engine = create_engine(parse_database_url(database_url), poolclass=pool.NullPool)
    try:
        with translate_errors(f"reading the schema revision of {_where(database_url)}"), \
                engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision(database_url: str = "postgresql+psycopg://") -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
