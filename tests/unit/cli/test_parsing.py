"""Argument parsing, dispatch and rendering of `qlayer queue` / `qlayer consumers`, through
typer's runner with the services replaced (no database, no Kafka)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from layer.domain.definitions import load_queue_file
from layer.services.consumers import EvictionResult
from layer.services.queues import ApplyResult, plan_apply, stored_form
from layer.store.rows import QueueRecord
from layer_cli.main import app
from layer_cli.output import age_text, value_text

# A database no test here may reach: parsing errors must come before any service call.
UNREACHABLE = {"QLAYER_DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
               "QLAYER_CONFIG": "/dev/null"}


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@dataclass
class FakeService:
    calls: list[tuple[str, Any]] = field(default_factory=list)
    answer: Any = None

    def __enter__(self) -> FakeService:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, (args, kwargs)))
            return self.answer
        return call


@pytest.fixture
def fake_consumers(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeService]:
    fake = FakeService()
    monkeypatch.setattr("layer.services.consumers.ConsumerService.from_settings",
                        lambda settings: fake)
    yield fake


@pytest.fixture
def fake_queues(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeService]:
    fake = FakeService()
    monkeypatch.setattr("layer.services.queues.QueueService.from_settings", lambda settings: fake)
    yield fake


@pytest.mark.parametrize("args", [
    ["queue", "apply"],
    ["queue", "create"],
    ["queue", "create", "Jobs", "--max-deliveries", "many"],
    ["queue", "create", "Jobs", "--set", "no-equals-sign"],
    ["queue", "delete"],
    ["consumers", "evict"],
    ["queue", "purge", "Jobs", "--timeout", "soon"],
])
def test_usage_errors_exit_2_before_any_service_call(runner: CliRunner,
                                                     args: list[str]) -> None:
    result = runner.invoke(app, args, env=UNREACHABLE)
    assert result.exit_code == 2, result.output


def test_apply_of_a_missing_file_is_a_usage_error(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["queue", "apply", "-f", str(tmp_path / "nope.yaml")],
                           env=UNREACHABLE)
    assert result.exit_code == 2
    assert "cannot read" in result.output


def test_consumers_evict_id_is_the_subcommand_not_a_queue_named_evict(
    runner: CliRunner, fake_consumers: FakeService
) -> None:
    fake_consumers.answer = EvictionResult("w1", 0.0, gone=True)
    result = runner.invoke(app, ["consumers", "evict", "w1", "--wait", "--timeout", "5"],
                           env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    assert fake_consumers.calls == [("evict", (("w1",), {"wait": 5.0}))]
    assert result.stdout == "evicted consumer w1; its leases were broken\n"


def test_consumers_queue_takes_options_after_the_argument(
    runner: CliRunner, fake_consumers: FakeService
) -> None:
    fake_consumers.answer = []
    result = runner.invoke(app, ["consumers", "Jobs", "--json"], env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    assert fake_consumers.calls == [("list_consumers", (("Jobs",), {}))]
    assert json.loads(result.stdout) == []


def test_create_passes_only_the_given_fields(runner: CliRunner,
                                             fake_queues: FakeService) -> None:
    definition = load_queue_file("queues:\n  - {name: Jobs, max_cancels: 2}\n")[0]
    fake_queues.answer = (definition, 1)
    result = runner.invoke(app, ["queue", "create", "Jobs", "--max-cancels", "2", "--barrier",
                                 "/kind = 'stop'", "--set", "key_groups=true"],
                           env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    ((name, (args, _)),) = fake_queues.calls
    assert name == "create"
    assert args[0] == {"name": "Jobs", "max_cancels": 2,
                       "barrier_expression": "/kind = 'stop'", "key_groups": True}


def test_the_dry_run_diff_reads_like_a_change_list(runner: CliRunner,
                                                   fake_queues: FakeService) -> None:
    before = load_queue_file("queues:\n  - {name: A, lease_period: 30s}\n  - {name: Gone}\n")
    stored = [QueueRecord(d.name, stored_form(d), 4, 0.0, 0.0) for d in before]
    wanted = load_queue_file("queues:\n  - {name: A, lease_period: 5m, expiration: 1h}\n"
                             "  - {name: New}\n")
    plan = plan_apply(wanted, stored, prune=True)
    fake_queues.answer = ApplyResult(plan, True, {"A": 4})
    result = runner.invoke(app, ["queue", "apply", "-f", "-", "--dry-run"], input="queues: []",
                           env=UNREACHABLE)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        "~ change A (version 4)",
        "    lease_period: 30s -> 5m",
        "    expiration: - -> 1h",
        "+ create New",
        "- delete Gone (version 4)",
        "dry run: 1 to create, 1 to change, 1 to delete; nothing was changed",
    ]


def test_values_and_ages_read_as_people_write_them() -> None:
    assert value_text("lease_period", 90.0) == "1m30s"
    assert value_text("expiration", None) == "-"
    assert value_text("key_groups", True) == "true"
    assert value_text("redelivery_backoff", {"initial": 1.0, "multiplier": 2.0,
                                             "maximum": 300.0}) == \
        "initial: 1s, multiplier: 2.0, maximum: 5m"
    assert age_text(2.25) == "2.2s"
    assert age_text(125.4) == "2m5s"
