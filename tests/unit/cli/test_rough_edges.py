"""Issue 16 item 9, as a user meets it: help that says what the command prints, flags without
a value shown bare, usage errors exiting 2, duplicate keys in a queue file refused, the
pipeline finding a queue's journal itself, no dependency installed for nothing."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layer_cli.main import app

ROOT = Path(__file__).resolve().parents[3]
runner = CliRunner()
# A database no test here may reach: usage errors must come before any service call.
UNREACHABLE = {"QLAYER_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
               "QLAYER_BOOTSTRAP_SERVERS": "127.0.0.1:1", "QLAYER_CONFIG": "/dev/null",
               "COLUMNS": "200"}


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_consume_help_says_json_lines() -> None:
    result = runner.invoke(app, ["consume", "--help"], env=UNREACHABLE)
    assert result.exit_code == 0
    help_text = _flat(result.output)
    assert "--json Print one JSON object per message and line (JSON Lines)" in help_text
    assert "one JSON document" not in help_text


@pytest.mark.parametrize("command", [
    ["consume"], ["queue", "apply"], ["dlq", "list"], ["dlq", "redrive"], ["stats"],
    ["view"], ["pipeline", "views"],
])
def test_flags_that_take_no_value_show_no_metavar(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], env=UNREACHABLE)
    assert result.exit_code == 0
    assert "<bool>" not in result.output
    # Options that do take a value keep theirs.
    assert re.search(r"<(str|int|float)", result.output) or "PATH" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--deliver-at", "tomorrow"], "--deliver-at 'tomorrow' is neither +DURATION"),
    (["--deliver-at", "2030-01-01T09:00:00"], "has no time zone"),
    (["--expiration", "forever"], "--expiration 'forever'"),
    (["--header", "novalue"], "is not name=value"),
])
def test_publish_values_that_cannot_be_used_are_usage_errors(args: list[str],
                                                             message: str) -> None:
    result = runner.invoke(app, ["publish", "Jobs", *args], input="x\n", env=UNREACHABLE)
    assert result.exit_code == 2, result.output
    assert message in _flat(result.output)


def test_a_queue_file_with_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "queues.yaml"
    path.write_text("queues:\n  - name: Jobs\n    lease_period: 30s\n"
                    "    max_deliveries: 3\n    lease_period: 5m\n")
    result = runner.invoke(app, ["queue", "apply", "-f", str(path), "--dry-run"],
                           env=UNREACHABLE)
    assert result.exit_code == 1
    assert isinstance(result.exception, Exception)
    text = str(result.exception)
    assert "duplicate key 'lease_period' (first given at line 3)" in text
    assert "line 5" in text and "nothing was changed" in text


def test_a_duplicate_top_level_key_is_refused_too() -> None:
    from layer.domain.definitions import load_queue_file
    from layer.domain.errors import QueueConfigError

    with pytest.raises(QueueConfigError, match=r"line 3.*duplicate key 'queues'"):
        load_queue_file("queues:\n  - name: A\nqueues:\n  - name: B\n")
    # Distinct keys, and equal keys in different mappings, are fine.
    assert [d.name for d in load_queue_file(
        "queues:\n  - {name: A, lease_period: 1s}\n  - {name: B, lease_period: 1s}\n")] == [
        "A", "B"]


class _Journals:
    def __init__(self, journal: str) -> None:
        self.journal = journal
        self.asked: list[str] = []

    def __enter__(self) -> _Journals:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def journal_of(self, name: str) -> str:
        self.asked.append(name)
        return self.journal


@pytest.mark.parametrize("command", [
    ["reconcile", "Orders"],
    ["views", "Orders", "--field", "/region"],
])
def test_pipeline_takes_the_journal_from_the_stored_definition(
        command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from layer.pipeline.jobs import JobResult, ReconcileReport

    journals = _Journals("orders-journal")
    monkeypatch.setattr("layer.services.queues.QueueService.from_settings",
                        lambda settings: journals)
    jobs: list[object] = []

    def fake_run_job(job: object, source: object, **options: object) -> JobResult:
        jobs.append(job)
        return JobResult(command[0], [], None, report=ReconcileReport("Orders", 1, 0, []))

    monkeypatch.setattr("layer.pipeline.jobs.run_job", fake_run_job)
    result = runner.invoke(app, ["pipeline", *command], env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    assert journals.asked == ["Orders"]
    assert jobs[0].journal == "orders-journal"  # type: ignore[attr-defined]
    # --journal still wins, and then PostgreSQL is not asked.
    result = runner.invoke(app, ["pipeline", *command, "--journal", "other"], env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    assert journals.asked == ["Orders"]
    assert jobs[1].journal == "other"  # type: ignore[attr-defined]


def test_pipeline_without_journal_or_database_says_what_to_do() -> None:
    result = runner.invoke(app, ["pipeline", "reconcile", "Orders"], env=UNREACHABLE)
    assert result.exit_code == 1
    assert "or name the journal with --journal TOPIC" in str(result.exception)


def _imported_top_levels() -> set[str]:
    names: set[str] = set()
    for folder in ("layer", "cli", "migrations"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module.split(".")[0])
    return names


def test_every_runtime_dependency_is_used() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    imports = {"pyyaml": "yaml", "psycopg": "psycopg", "google-re2": "re2",
               "pydantic-settings": "pydantic_settings", "confluent-kafka": "confluent_kafka"}
    used = _imported_top_levels()
    for requirement in project["dependencies"]:
        dist = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()
        module = imports.get(dist, dist.replace("-", "_"))
        assert module in used, f"{dist} is a dependency but nothing imports {module}"
