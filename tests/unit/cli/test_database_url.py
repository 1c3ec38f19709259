"""A database URL that cannot be used is one line on stderr and exit status 1, never a
traceback (issue 15 item 5): as a real `qlayer` process, the way an operator meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from layer.store.errors import StoreError
from layer.store.url import DatabaseUrlError, parse_database_url, redacted

EXPECTED = "expected postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE"


def qlayer(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    config = tmp_path / "empty.yaml"  # no ./qlayer.yaml or QLAYER_CONFIG of the caller's
    config.write_text("{}\n")
    environment = {k: v for k, v in os.environ.items() if not k.startswith("QLAYER_")}
    environment.update({"QLAYER_CONFIG": str(config), **(env or {})})
    done = subprocess.run([sys.executable, "-m", "layer_cli.main", *args], capture_output=True,
                          text=True, env=environment, cwd=tmp_path, timeout=120, check=False)
    return done.returncode, done.stdout, done.stderr


def test_a_malformed_database_url_is_one_line(tmp_path: Path) -> None:
    code, out, err = qlayer(tmp_path, "stats", "--database-url", "not a url")
    assert (code, out) == (1, "")
    assert err == (f"error: database URL 'not a url' cannot be parsed: {EXPECTED} (set by "
                   "--database-url, QLAYER_DATABASE_URL or database_url in the config file)\n")


def test_a_database_nobody_listens_on_is_one_line(tmp_path: Path) -> None:
    code, out, err = qlayer(tmp_path, "stats", "--database-url",
                            "postgresql://x:secret@127.0.0.1:1/db")
    assert (code, out) == (1, "")
    [line] = err.splitlines()
    assert line.startswith("error: ")
    assert 'connection to server at "127.0.0.1", port 1 failed: Connection refused' in line
    assert "secret" not in err


@pytest.mark.parametrize("command", [
    ["stats"], ["queue", "list"], ["queue", "ack", "Q", "--filter", "/a = 1"], ["view", "Q"],
    ["db", "upgrade"], ["db", "current"], ["coordinators"], ["consumers", "list"],
])
def test_every_command_refuses_a_url_for_another_database_in_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    code, out, err = qlayer(tmp_path, *command, "--database-url", "mysql://admin:secret@db/app")
    assert (code, out) == (1, "")
    assert err == (
        "error: database URL 'mysql://admin:***@db/app': qlayer runs on PostgreSQL with "
        f"psycopg, not 'mysql': {EXPECTED} (set by --database-url, QLAYER_DATABASE_URL or "
        "database_url in the config file)\n")


def test_a_malformed_url_from_the_environment_is_one_line_too(tmp_path: Path) -> None:
    code, out, err = qlayer(tmp_path, "queue", "list",
                            env={"QLAYER_DATABASE_URL": "postgresql://u:pw@host:port/db"})
    assert (code, out) == (1, "")
    assert err.startswith("error: database URL 'postgresql://u:***@host:port/db' cannot be "
                          "parsed")
    assert len(err.splitlines()) == 1


def test_with_debug_the_traceback_is_shown(tmp_path: Path) -> None:
    code, _, err = qlayer(tmp_path, "--debug", "stats", "--database-url", "not a url")
    assert code == 1
    assert "Traceback" in err
    assert "DatabaseUrlError: database URL 'not a url' cannot be parsed" in err


@pytest.mark.parametrize("url", [
    "postgresql+psycopg://postgres@127.0.0.1:15432/qlayer",
    "postgresql://u:p%40ss@[::1]:5432/db?sslmode=require",
])
def test_postgresql_urls_are_accepted_as_given(url: str) -> None:
    parsed = parse_database_url(url)
    assert parsed.render_as_string(hide_password=False) == url.replace(
        "postgresql://", "postgresql+psycopg://")


@pytest.mark.parametrize("scheme", ["postgres", "postgresql", "postgres+psycopg"])
def test_postgres_and_postgresql_are_aliases_of_postgresql_psycopg(scheme: str) -> None:
    parsed = parse_database_url(f"{scheme}://u:p%40ss@db.example:5433/app?sslmode=require")
    assert parsed.render_as_string(hide_password=False) == (
        "postgresql+psycopg://u:p%40ss@db.example:5433/app?sslmode=require")


def test_a_postgres_url_reaches_the_server(tmp_path: Path) -> None:
    # Accepted and used (issue 16 item 4; it was a traceback, then refused): the error is the
    # server's, not the URL's.
    code, out, err = qlayer(tmp_path, "stats", "--database-url",
                            "postgres://x:secret@127.0.0.1:1/db")
    assert (code, out) == (1, "")
    [line] = err.splitlines()
    assert 'connection to server at "127.0.0.1", port 1 failed: Connection refused' in line
    assert "secret" not in err


@pytest.mark.parametrize(("url", "why"), [
    ("", "no database URL"),
    ("   ", "no database URL"),
    ("localhost/qlayer", "cannot be parsed"),
    ("postgresql://h:notaport/db", "cannot be parsed"),
    ("mysql+pymysql://u@h/db", "not 'mysql+pymysql'"),
    ("postgresql+psycopg2://u@h/db", "not 'postgresql+psycopg2'"),
    ("sqlite:///tmp/x.db", "not 'sqlite'"),
])
def test_unusable_urls_are_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(DatabaseUrlError) as caught:
        parse_database_url(url)
    assert why in str(caught.value)
    assert EXPECTED in str(caught.value)
    assert isinstance(caught.value, StoreError) and not caught.value.retryable


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql://u:secret@h/db", "postgresql://u:***@h/db"),
    ("postgresql://u:secret@h:port/db", "postgresql://u:***@h:port/db"),  # does not parse
    ("u:secret@h/db", "u:***@h/db"),
    ("not a url", "not a url"),
])
def test_passwords_are_not_shown(url: str, shown: str) -> None:
    assert redacted(url) == shown
