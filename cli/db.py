"""`qlayer db upgrade`: apply the PostgreSQL schema migrations (Alembic)."""

from __future__ import annotations

from typing import Annotated

import typer

from layer.domain.shards import DEFAULT_SHARD_COUNT, MAX_SHARD_COUNT

app = typer.Typer(help="Manage qlayer's PostgreSQL schema.", no_args_is_help=True)

DatabaseUrl = Annotated[str | None, typer.Option(
    "--database-url", help="SQLAlchemy URL [env: QLAYER_DATABASE_URL]")]


@app.command()
def upgrade(
    database_url: DatabaseUrl = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    shards: Annotated[int | None, typer.Option(
        "--shards", min=1, max=MAX_SHARD_COUNT,
        help=f"Shards of a new installation (default {DEFAULT_SHARD_COUNT}): at most this "
             "many coordinator processes share the work. Fixed once chosen; see "
             "docs/coordinator.md, 'How many shards'.")] = None,
) -> None:
    """Migrate the database to the newest schema (alembic upgrade head)."""
    from layer.settings import Settings  # pydantic: when the command runs
    from layer.store.migrate import upgrade as run_upgrade
    from layer.store.store import Store

    settings = Settings.load(database_url=database_url)
    at = run_upgrade(settings.database_url, revision, shard_count=shards)
    count: int | None = None
    if at is not None and at >= "0004":
        with Store(settings.database_url) as store:
            count = store.shard_count()
    if shards is not None and count is not None and count != shards:
        typer.echo(f"error: this installation already has {count} shards; the count is "
                   "chosen once, when the database is first migrated (see "
                   "docs/coordinator.md, 'How many shards')", err=True)
        raise typer.Exit(2)
    typer.echo(f"database at revision {at}" + (f", {count} shards" if count else ""))


@app.command()
def current(database_url: DatabaseUrl = None) -> None:
    """Print the schema revision the database is at."""
    from layer.settings import Settings  # pydantic: when the command runs
    from layer.store.migrate import current_revision

    settings = Settings.load(database_url=database_url)
    typer.echo(current_revision(settings.database_url) or "empty (no qlayer schema)")
