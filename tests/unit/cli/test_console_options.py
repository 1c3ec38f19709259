"""`qlayer console`'s options that are refused before anything starts (no server, no service)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from layer_cli.main import app


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str | None]:
    """No config file, and the console's auth variables unset (None unsets in the runner)."""
    config = tmp_path / "none.yaml"
    config.write_text("{}\n")
    return {"QLAYER_CONFIG": str(config), "QLAYER_CONSOLE_USER": None,
            "QLAYER_CONSOLE_PASSWORD": None}


def run(env: dict[str, str | None], *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["console", *args], env=env)
    return result.exit_code, result.output


def test_a_user_without_a_password_is_a_usage_error(env: dict[str, str | None]) -> None:
    code, output = run(env, "--user", "ops")
    assert code == 2
    assert "basic auth needs both a user" in output


def test_a_password_file_that_cannot_be_read_or_is_empty_is_a_usage_error(
        env: dict[str, str | None], tmp_path: Path) -> None:
    code, output = run(env, "--user", "ops", "--password-file", str(tmp_path / "missing"))
    assert code == 2 and "cannot read" in output
    empty = tmp_path / "empty"
    empty.write_text("\n")
    code, output = run(env, "--user", "ops", "--password-file", str(empty))
    assert code == 2 and "the password is empty" in output


def test_a_password_without_a_user_is_a_usage_error(env: dict[str, str | None], tmp_path: Path
                                                     ) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    code, output = run(env, "--password-file", str(secret))
    assert code == 2 and "basic auth needs both" in output


def test_a_history_shorter_than_the_charts_window_is_a_usage_error(
        env: dict[str, str | None]) -> None:
    code, output = run(env, "--window", "7200", "--history-retention", "3600")
    assert code == 2
    said = " ".join(output.replace("│", " ").split())
    assert "(3600s) must be at least --window (7200s)" in said
