"""`qlayer queue ack --filter` and `qlayer queue reset --to` against the real services:
validation, dry runs, refusal with consumers attached, and both carried out by a
coordinator."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import Result

from layer.settings import Settings
from layer.store.store import Store
from tests.integration.cli.conftest import Completed, attach_consumer
from tests.support.coordinator import (
    produce,
    recovery_points,
    running_coordinator,
    wait_for_counters,
    wait_until,
)

pytestmark = pytest.mark.integration


def test_ack_checks_its_filter_and_queue_before_requesting_anything(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed]
) -> None:
    """Reference (amps-understanding-queues.txt): "AMPS allows an application to acknowledge
    messages by providing a filter on a sow_delete command." A filter that does not parse is
    refused before anything is recorded."""
    assert invoke("queue", "create", "Jobs").exit_code == 0
    bad = run_cli("queue", "ack", "Jobs", "--filter", "/kind = = 'x'")
    assert bad.code == 1
    assert bad.stderr.startswith("error: --filter \"/kind = = 'x'\" is not a valid expression")
    assert "nothing was requested" in bad.stderr
    with Store(settings.database_url) as store:
        record = store.get_queue("Jobs")
    assert record is not None and record.purge_requested_at is None and record.version == 1
    unknown = run_cli("queue", "ack", "Nope", "--filter", "/kind = 'x'")
    assert unknown.code == 1
    assert unknown.stderr == "error: no queue named Nope; see `qlayer queue list`\n"
    waited = run_cli("queue", "ack", "Jobs", "--filter", "/kind = 'x'", "--wait", "0.5")
    assert waited.code == 1
    assert "no coordinator completed it within 0.5s" in waited.stderr
    with Store(settings.database_url) as store:
        record = store.get_queue("Jobs")
    assert record is not None and record.purge_pending and record.purge_filter == "/kind = 'x'"


def test_ack_dry_run_counts_and_the_coordinator_acknowledges(
    settings: Settings, invoke: Callable[..., Result], journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "the sow_delete acknowledges all messages
    that match the filter"."""
    work = journal("work", partitions=1)
    assert invoke("queue", "create", "Work", "--underlying-topic", work).exit_code == 0
    produce(settings.bootstrap_servers, work,
            [json.dumps({"kind": k}).encode() for k in ("a", "b", "a", "a")], partition=0)
    with running_coordinator(settings):
        wait_for_counters(settings, "Work", enqueued=4)
        dry = invoke("queue", "ack", "Work", "--filter", "/kind = 'a'", "--dry-run", "--json")
        assert dry.exit_code == 0, dry.output
        answer = json.loads(dry.stdout)
        assert answer["dry_run"] is True and answer["matching"]["total"] == 3
        assert answer["matching"]["sample"] == [f"{work}/0/{o}" for o in (0, 2, 3)]
        done = invoke("queue", "ack", "Work", "--filter", "/kind = 'a'", "--wait", "20")
        assert done.exit_code == 0, done.output
        assert done.stdout.startswith("acknowledged 3 entries of queue Work matching")
        wait_for_counters(settings, "Work", acked=3)
        described = json.loads(invoke("queue", "describe", "Work", "--json").stdout)
        assert (described["purge_filter"], described["purge_acked"]) == ("/kind = 'a'", 3)


def test_reset_validates_refuses_with_consumers_and_dry_runs(
    settings: Settings, invoke: Callable[..., Result], run_cli: Callable[..., Completed],
    journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "begin queue recovery at the configured
    recovery point." A reset is checked, shown and refused under attached consumers."""
    work = journal("work", partitions=2)
    assert invoke("queue", "create", "Work", "--underlying-topic", work).exit_code == 0
    produce(settings.bootstrap_servers, work, [b"x"] * 5, partition=0)
    bad = run_cli("queue", "reset", "Work", "--to", "yesterday")
    assert bad.code == 1 and "--to must be beginning, end" in bad.stderr
    wrong = run_cli("queue", "reset", "Work", "--to", "7:3")
    assert wrong.code == 1
    assert f"the queue does not read {work} partition 7" in wrong.stderr
    dry = run_cli("queue", "reset", "Work", "--to", "0:3", "--dry-run")
    assert dry.code == 0, dry.stderr
    assert f"{work}[0]: - -> 3" in dry.stdout
    assert "moves 1 of 1 partitions; nothing was changed" in dry.stdout
    attach_consumer(settings, "worker-7", "Work")
    refused = run_cli("queue", "reset", "Work", "--to", "end")
    assert refused.code == 1
    assert "consumers are attached (Work: worker-7)" in refused.stderr
    with Store(settings.database_url) as store:
        record = store.get_queue("Work")
    assert record is not None and record.reset_to is None and record.version == 1


def test_reset_to_the_end_is_carried_out_by_the_coordinator(
    settings: Settings, invoke: Callable[..., Result], journal: Callable[..., str]
) -> None:
    """Reference (amps-understanding-queues.txt): "begin queue recovery at the configured
    recovery point." Moved to the end, every entry the queue held leaves it (ACKED)."""
    work = journal("work", partitions=2)
    assert invoke("queue", "create", "Work", "--underlying-topic", work).exit_code == 0
    produce(settings.bootstrap_servers, work, [b"x"] * 3, partition=0)
    produce(settings.bootstrap_servers, work, [b"y"] * 2, partition=1)
    with running_coordinator(settings):
        wait_for_counters(settings, "Work", enqueued=5)
        dry = invoke("queue", "reset", "Work", "--to", "end", "--dry-run", "--json")
        assert dry.exit_code == 0, dry.output
        parts = json.loads(dry.stdout)["partitions"]
        assert [(p["partition"], p["before"], p["after"], p["passed"]) for p in parts] == [
            (0, 0, 3, 3), (1, 0, 2, 2)]
        done = invoke("queue", "reset", "Work", "--to", "end", "--wait", "20")
        assert done.exit_code == 0, done.output
        assert "reset queue Work to end at" in done.stdout
        wait_until(lambda: recovery_points(settings, "Work") == {(work, 0): 3, (work, 1): 2}
                   or None, what="positions at the end")
        wait_for_counters(settings, "Work", acked=5)
