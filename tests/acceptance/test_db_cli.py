"""`qlayer db upgrade` as a subprocess: migrates a real database; a dead one is one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from layer.store.migrate import current_revision, head_revision

pytestmark = pytest.mark.acceptance


def qlayer(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "layer_cli.main", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def test_upgrade_migrates_to_head_and_is_idempotent(empty_database_url: str) -> None:
    for _ in range(2):
        result = qlayer("db", "upgrade", "--database-url", empty_database_url)
        assert result.returncode == 0, result.stderr
        assert f"database at revision {head_revision()}" in result.stdout
    assert current_revision(empty_database_url) == head_revision()


def test_unreachable_database_is_one_line_with_the_fix_and_no_password() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = qlayer("db", "upgrade", "--database-url",
                    f"postgresql+psycopg://postgres:hunter2@127.0.0.1:{port}/nowhere")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: migrating") and "qlayer dev up" in lines[0]
    assert "hunter2" not in result.stderr


def test_plain_alembic_from_a_checkout_takes_a_postgres_url(empty_database_url: str) -> None:
    """`alembic -c alembic.ini upgrade head` with QLAYER_DATABASE_URL in the `postgres://` form
    `qlayer db upgrade` accepts (plain alembic looked for a 'postgres' dialect)."""
    import os
    from pathlib import Path

    from sqlalchemy.engine import make_url

    url = make_url(empty_database_url).set(drivername="postgres").render_as_string(
        hide_password=False)
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "alembic", "-c", "alembic.ini", "upgrade",
                             "head"], capture_output=True, text=True, timeout=120, check=False,
                            cwd=root, env={**os.environ, "QLAYER_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    assert current_revision(empty_database_url) == head_revision()
