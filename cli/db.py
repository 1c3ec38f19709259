"""`qlayer db upgrade`: apply the PostgreSQL schema migrations (Alembic)."""

from __future__ import annotations

from typing import Annotated

import typer

from layer.settings import Settings

app = typer.Typer(help="Manage qlayer's PostgreSQL schema.", no_args_is_help=True)

DatabaseUrl = Annotated[str | None, typer.Option(
    "--database-url", help="SQLAlchemy URL [env: QLAYER_DATABASE_URL]")]


@app.command()
def upgrade(database_url: DatabaseUrl = None,
            revision: Annotated[str, typer.Option(help="Target revision.")] = "head") -> None:
    """Migrate the database to the newest schema (alembic upgrade head)."""
    from layer.store.migrate import upgrade as run_upgrade

    settings = Settings.load(database_url=database_url)
    at = run_upgrade(settings.database_url, revision)
    typer.echo(f"database at revision {at}")


@app.command()
def current(database_url: DatabaseUrl = None) -> None:
    """Print the schema revision the database is at."""
    from layer.store.migrate import current_revision

    settings = Settings.load(database_url=database_url)
    typer.echo(current_revision(settings.database_url) or "empty (no qlayer schema)")
