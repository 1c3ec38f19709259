"""`qlayer queue create | list | describe | delete | purge` against the real services."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import Result

from layer.domain.definitions import QueueDefinition
from layer.services import NoSuchQueueError, QueueExistsError
from layer.settings import Settings
from layer.store.store import Store
from tests.integration.cli.conftest import Completed, attach_consumer, stored
from tests.support.coordinator import (
    RawConsumer,
    produce,
    recovery_points,
    running_coordinator,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_create_stores_a_valid_definition_from_flags(
    settings: Settings, invoke: Callable[..., Result]
) -> None:
    result = invoke("queue", "create", "Jobs", "--underlying-topic", "jobs-in",
                    "--lease-period", "30s", "--max-deliveries", "3", "--max-backlog", "4",
                    "--priority", "/urgency", "--key-groups", "--set", "leasing=permissive",
                    "--set", "redelivery_backoff={initial: 1s}", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["version"] == 1
    version, raw = stored(settings)["Jobs"]
    definition = QueueDefinition.from_mapping(raw)
    assert version == 1
    assert (definition.underlying_topic, definition.lease_period, definition.max_deliveries,
            definition.max_per_subscription_backlog, definition.priority,
            definition.key_groups, definition.leasing.value,
            definition.redelivery_backoff.initial) == (
        "jobs-in", 30.0, 3, 4, "/urgency", True, "permissive", 1.0)


def test_create_refuses_bad_values_and_existing_names(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    bad = run_cli("queue", "create", "Jobs", "--lease-period", "forever",
                  "--target-queue-depth", "5", "--barrier", "/b = 1")
    assert bad.code == 1
    assert bad.stderr.startswith("error: queue create: 2 problems in queue definition")
    assert "lease_period: cannot read duration 'forever'" in bad.stderr
    assert "target_queue_depth: cannot be combined with barrier_expression" in bad.stderr
    assert stored(settings) == {}

    assert invoke("queue", "create", "Jobs").exit_code == 0
    again = invoke("queue", "create", "Jobs", "--lease-period", "1m")
    assert again.exit_code == 1
    assert isinstance(again.exception, QueueExistsError)
    assert "`qlayer queue apply -f FILE`" in str(again.exception)
    assert stored(settings)["Jobs"][0] == 1


def test_list_shows_queues_and_attached_consumers(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    assert invoke("queue", "create", "Jobs").exit_code == 0
    assert invoke("queue", "create", "Orders", "--underlying-topic", "^ORDERS",
                  "--semantics", "at-most-once").exit_code == 0
    attach_consumer(settings, "w1", "Jobs")
    attach_consumer(settings, "any", "Jo.*|Orders", is_regex=True)
    listed = run_cli("queue", "list", "--json")
    assert listed.code == 0, listed.stderr
    assert json.loads(listed.stdout) == [
        {"name": "Jobs", "underlying_topic": "Jobs", "semantics": "at-least-once",
         "version": 1, "consumers": 2},
        {"name": "Orders", "underlying_topic": "^ORDERS", "semantics": "at-most-once",
         "version": 1, "consumers": 1},
    ]
    table = run_cli("queue", "list")
    assert table.code == 0
    assert "Orders" in table.stdout and "^ORDERS" in table.stdout


def test_unknown_queue_is_one_line_that_says_what_to_do(
    run_cli: Callable[..., Completed], invoke: Callable[..., Result]
) -> None:
    for command in (["describe", "Nope"], ["delete", "Nope"], ["purge", "Nope"]):
        done = run_cli("queue", *command)
        assert done.code == 1
        assert done.stderr == "error: no queue named Nope; see `qlayer queue list`\n"
    result = invoke("queue", "describe", "Nope", "--json")
    assert isinstance(result.exception, NoSuchQueueError)


def test_a_database_without_the_schema_says_to_migrate_it(
    empty_database_url: str, run_cli: Callable[..., Completed]
) -> None:
    done = run_cli("queue", "list", env={"QLAYER_DATABASE_URL": empty_database_url})
    assert done.code == 1
    assert done.stderr.startswith("error: ")
    assert done.stderr.endswith("run `qlayer db upgrade`\n")
    assert len(done.stderr.splitlines()) == 1


def test_delete_refuses_while_consumers_are_attached_unless_forced(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    assert invoke("queue", "create", "Jobs").exit_code == 0
    attach_consumer(settings, "worker-7", "Jobs")
    refused = run_cli("queue", "delete", "Jobs")
    assert refused.code == 1
    assert "consumers are attached (Jobs: worker-7)" in refused.stderr
    assert "Jobs" in stored(settings)
    forced = run_cli("queue", "delete", "Jobs", "--force")
    assert forced.code == 0, forced.stderr
    assert "deleted queue Jobs (version 2)" in forced.stdout
    assert stored(settings) == {}


def test_purge_is_recorded_and_wait_times_out_without_a_coordinator(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    assert invoke("queue", "create", "Jobs").exit_code == 0
    done = run_cli("queue", "purge", "Jobs")
    assert done.code == 0, done.stderr
    with Store(settings.database_url) as store:
        record = store.get_queue("Jobs")
    assert record is not None and record.purge_pending and record.version == 2
    waited = run_cli("queue", "purge", "Jobs", "--wait", "--timeout", "0.5")
    assert waited.code == 1
    assert "no coordinator completed it within 0.5s" in waited.stderr


def test_describe_shows_live_figures_and_purge_waits_for_the_coordinator(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed],
    journal: Callable[..., str], tmp_path: Path
) -> None:
    work = journal("work", partitions=2)
    assert invoke("queue", "create", "Work", "--underlying-topic", work,
                  "--lease-period", "60s").exit_code == 0
    produce(settings.bootstrap_servers, work, [f"job {i}".encode() for i in range(6)],
            partition=0)
    produce(settings.bootstrap_servers, work, [b"job 6"], partition=1)
    # Before any coordinator: the shard is said, and that nobody serves it.
    unserved = json.loads(run_cli("queue", "describe", "Work", "--json").stdout)
    assert unserved["owner"] is None and isinstance(unserved["shard"], int)
    assert "no coordinator holds the shard" in run_cli("queue", "describe", "Work").stdout
    with running_coordinator(settings) as process:
        wait_until(lambda: len(recovery_points(settings, "Work")) == 2 or None,
                   what="recovery points of both partitions")
        # It sends no heartbeat while the CLI runs (seconds a command on a loaded machine; its
        # default 10 s session timed out once): a minute keeps it attached throughout.
        holder = RawConsumer(settings.bootstrap_servers, settings.topic_prefix, "Work",
                             max_backlog=2, consumer_id="holder-1", session_timeout_ms=60_000)
        try:
            holder.subscribe()
            assert len(holder.receive(2)) == 2
            described = run_cli("queue", "describe", "Work", "--json")
            assert described.code == 0, described.stderr
            document = json.loads(described.stdout)
            assert document["definition"]["lease_period"] == 60.0
            assert document["journal_backlog"] == 7
            assert {(p["topic"], p["partition"], p["end_offset"], p["backlog"])
                    for p in document["partitions"]} == {(work, 0, 6, 6), (work, 1, 1, 1)}
            assert [c["consumer_id"] for c in document["consumers"]] == ["holder-1"]
            assert document["counters"]["delivered"] >= 2
            assert document["kafka_problem"] is None
            # Which shard serves it and which process runs that shard (issue 33).
            assert document["shard"] == unserved["shard"]
            assert document["owner"]["owner_id"] == process.options.owner_id
            assert document["owner"]["running"] is True
            assert document["owner"]["pid"] == os.getpid()

            people = run_cli("queue", "describe", "Work")
            assert people.code == 0, people.stderr
            assert "journal backlog" in people.stdout and "holder-1" in people.stdout
            assert "served by" in people.stdout

            purged = run_cli("queue", "purge", "Work", "--wait", "--timeout", "30")
            assert purged.code == 0, purged.stderr
            assert purged.stdout.startswith("purged queue Work at ")
            after = json.loads(run_cli("queue", "describe", "Work", "--json").stdout)
            assert after["journal_backlog"] == 0
            assert after["purge_pending"] is False
        finally:
            holder.close()
