"""`qlayer pipeline`: help on every command and option, usage errors (2), definition errors
(1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from layer_cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("command", ["lifecycle", "reconcile", "views", "metrics"])
def test_every_command_explains_itself_and_its_options(command: str) -> None:
    result = runner.invoke(app, ["pipeline", command, "--help"])
    assert result.exit_code == 0
    assert "--output" in result.output and "--bootstrap-servers" in result.output
    group = typer.main.get_command(app).commands["pipeline"]  # type: ignore[attr-defined]
    params = group.commands[command].params
    assert params and all(p.help for p in params), [p.name for p in params if not p.help]


def test_the_group_lists_its_jobs() -> None:
    result = runner.invoke(app, ["pipeline", "--help"])
    assert result.exit_code == 0
    for command in ("lifecycle", "reconcile", "views", "metrics"):
        assert command in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["lifecycle", "--stream"], "--stream needs --checkpoint DIR"),
    (["metrics", "--available-now"], "--checkpoint and --available-now go with --stream"),
    (["metrics", "--start", "yesterday"], "neither epoch milliseconds, an ISO-8601 time"),
    (["views", "Orders", "--journal", "o", "--field", "/a", "--since", "soon"],
     "neither epoch milliseconds, an ISO-8601 time"),
    (["lifecycle", "--since", "1h", "--until", "2h"], "ends (2h) before it starts (1h)"),
    (["lifecycle", "--kafka-option", "security.protocol"], "takes KEY=VALUE"),
    (["metrics", "--window", "5m"], "give a length such as '1 minute'"),
])
def test_usage_errors_exit_2(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["pipeline", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.replace("│", " ").split())


def test_a_bad_view_definition_is_one_line_and_status_1() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "layer_cli.main", "pipeline", "views", "Orders", "--journal",
         "orders",
         "--field", "/region", "--field", "SUM(/price * ) AS /total", "--group-by", "/region"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    # Found before Spark starts: the one line is all there is.
    assert done.stderr.strip() == (
        "error: syntax error: unexpected ')' at column 14 in 'SUM(/price * ) AS /total'")
    assert done.stdout == ""


def test_a_stream_needs_an_output() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "layer_cli.main", "pipeline", "lifecycle", "--stream",
         "--checkpoint", "/tmp/x"],
        capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == "error: --stream needs --output: the table it keeps up to date"


def test_violations_exit_3_and_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    from layer.pipeline.jobs import JobResult, ReconcileJob, ReconcileReport, ViolationRow

    report = ReconcileReport("Orders", 7, 2, [ViolationRow("Orders", "orders/0/5",
                                                           "acked_twice")])
    seen: dict[str, object] = {}

    def fake_run_job(job: object, source: object, **options: object) -> JobResult:
        seen.update(job=job, source=source, **options)
        return JobResult("reconcile", [], None, report=report)

    monkeypatch.setattr("layer.pipeline.jobs.run_job", fake_run_job)
    monkeypatch.setenv("QLAYER_TOPIC_PREFIX", "audit.")
    result = runner.invoke(app, ["pipeline", "reconcile", "Orders", "--journal", "orders",
                                 "--start", "2026-01-01T00:00:00", "--end", "1767312000000",
                                 "--bootstrap-servers", "kafka:9092",
                                 "--database-url", "postgresql+psycopg://q@db/qlayer"])
    assert result.exit_code == 3
    assert result.output.splitlines() == ["Orders: 7 done, 2 pending, 1 violations",
                                          "acked_twice\tOrders\torders/0/5"]
    # Flags win, then QLAYER_*; times as epoch ms, ISO-8601 read as UTC.
    source = seen["source"]
    assert (source.bootstrap_servers, source.topic_prefix) == ("kafka:9092", "audit.")  # type: ignore[attr-defined]
    assert (seen["start_ms"], seen["end_ms"]) == (1767225600000, 1767312000000)
    # qlayer's own PostgreSQL is the audit's third source.
    assert seen["job"] == ReconcileJob("Orders", "orders", "postgresql+psycopg://q@db/qlayer")


def test_since_and_until_take_a_length_before_now(monkeypatch: pytest.MonkeyPatch) -> None:
    from layer.pipeline.jobs import JobResult

    seen: dict[str, object] = {}

    def fake_run_job(job: object, source: object, **options: object) -> JobResult:
        seen.update(options)
        return JobResult("lifecycle", [], None)

    monkeypatch.setattr("layer.pipeline.jobs.run_job", fake_run_job)
    monkeypatch.setattr("time.time", lambda: 1_767_225_600.0)
    result = runner.invoke(app, ["pipeline", "lifecycle", "--since", "2h", "--until", "30m",
                                 "--bootstrap-servers", "kafka:9092"])
    assert result.exit_code == 0, result.output
    assert (seen["start_ms"], seen["end_ms"]) == (1_767_225_600_000 - 7_200_000,
                                                  1_767_225_600_000 - 1_800_000)
