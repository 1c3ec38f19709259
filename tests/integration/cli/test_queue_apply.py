"""`qlayer queue apply -f FILE`: declarative, idempotent, all-or-nothing on bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from layer.domain.definitions import QueueDefinition
from layer.services import ApplyConflictError, QueueService
from layer.settings import Settings
from layer.store.rows import QueueRecord
from layer.store.store import Store
from tests.integration.cli.conftest import Completed, attach_consumer, stored

pytestmark = pytest.mark.integration

FIRST = """
queues:
  - name: Jobs
    lease_period: 30s
    max_deliveries: 5
    dead_letter_topic: FailedJobs
  - name: OrderPriority
    underlying_topic: Orders
    priority: /price * /qty
  - name: Old
"""

SECOND = """
queues:
  - name: Jobs
    lease_period: 1m
    max_deliveries: 5
    dead_letter_topic: FailedJobs
  - name: OrderPriority
    underlying_topic: Orders
    priority: /price * /qty
  - name: Fresh
    semantics: at-most-once
"""


def test_apply_creates_and_a_second_apply_changes_nothing(
    settings: Settings, run_cli: Callable[..., Completed], queue_file: Callable[[str], Path]
) -> None:
    path = queue_file(FIRST)
    first = run_cli("queue", "apply", "-f", str(path))
    assert first.code == 0, first.stderr
    assert "+ create Jobs (version 1)" in first.stdout
    assert "applied: 3 created" in first.stdout
    after_first = stored(settings)
    assert set(after_first) == {"Jobs", "OrderPriority", "Old"}
    jobs = QueueDefinition.from_mapping(after_first["Jobs"][1])
    assert (jobs.lease_period, jobs.max_deliveries) == (30.0, 5)
    # What the coordinator reads back is exactly what the file says, defaults resolved.
    assert after_first["Jobs"][1] == jobs.model_dump(mode="json")

    second = run_cli("queue", "apply", "-f", str(path))
    assert second.code == 0, second.stderr
    assert "no changes" in second.stdout
    assert "= unchanged Jobs (version 1)" in second.stdout
    assert stored(settings) == after_first


def test_dry_run_prints_the_diff_and_changes_nothing(
    settings: Settings, invoke: Callable[..., object], run_cli: Callable[..., Completed],
    queue_file: Callable[[str], Path]
) -> None:
    assert run_cli("queue", "apply", "-f", str(queue_file(FIRST))).code == 0
    before = stored(settings)
    second = queue_file(SECOND)

    dry = run_cli("queue", "apply", "-f", str(second), "--dry-run", "--prune")
    assert dry.code == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert "~ change Jobs (version 1)" in lines
    assert "    lease_period: 30s -> 1m" in lines
    assert "= unchanged OrderPriority (version 1)" in lines
    assert "+ create Fresh" in lines
    assert "- delete Old (version 1)" in lines
    assert "dry run: 1 to create, 1 to change, 1 to delete; nothing was changed" in lines
    assert stored(settings) == before

    applied = run_cli("queue", "apply", "-f", str(second), "--prune", "--json")
    assert applied.code == 0, applied.stderr
    document = json.loads(applied.stdout)
    by_name = {q["name"]: q for q in document["queues"]}
    assert by_name["Jobs"] == {"name": "Jobs", "action": "change", "version_before": 1,
                               "version_after": 2,
                               "fields": [{"field": "lease_period", "old": 30.0, "new": 60.0}]}
    assert by_name["Old"]["action"] == "delete"
    after = stored(settings)
    assert set(after) == {"Jobs", "OrderPriority", "Fresh"}
    assert after["Jobs"][0] == 2 and after["OrderPriority"][0] == 1
    assert after["Fresh"][1]["fairness"] == "round-robin"


def test_apply_keeps_queues_the_file_does_not_name_unless_asked_to_prune(
    settings: Settings, run_cli: Callable[..., Completed], queue_file: Callable[[str], Path]
) -> None:
    # Issue 16 item 2: on a shared database the getting-started file must not delete the
    # other queues (here: another team's, or the demo's).
    assert run_cli("queue", "apply", "-f", str(queue_file(FIRST))).code == 0
    only_jobs = queue_file("queues:\n  - name: Jobs\n    lease_period: 30s\n"
                           "    max_deliveries: 5\n    dead_letter_topic: FailedJobs\n")
    done = run_cli("queue", "apply", "-f", str(only_jobs))
    assert done.code == 0, done.stderr
    assert "no changes" in done.stdout
    assert ("kept 2 stored queue(s) the file does not name (Old, OrderPriority); --prune "
            "would delete them") in done.stdout
    assert set(stored(settings)) == {"Jobs", "OrderPriority", "Old"}
    assert run_cli("queue", "apply", "-f", str(only_jobs), "--no-prune").code == 0
    assert set(stored(settings)) == {"Jobs", "OrderPriority", "Old"}

    pruned = run_cli("queue", "apply", "-f", str(only_jobs), "--prune")
    assert pruned.code == 0, pruned.stderr
    assert "applied: 2 deleted" in pruned.stdout
    assert set(stored(settings)) == {"Jobs"}


def test_bad_yaml_is_one_clear_error_and_changes_nothing(
    settings: Settings, run_cli: Callable[..., Completed], queue_file: Callable[[str], Path]
) -> None:
    assert run_cli("queue", "apply", "-f", str(queue_file(FIRST))).code == 0
    before = stored(settings)
    broken = queue_file("queues:\n  - name: Jobs\n    lease_period: [30s\n")
    done = run_cli("queue", "apply", "-f", str(broken))
    assert done.code == 1
    assert done.stdout == ""
    assert done.stderr.startswith(f"error: {broken}: not valid YAML at line ")
    assert "nothing was changed" in done.stderr
    assert "Traceback" not in done.stderr
    assert stored(settings) == before


def test_invalid_combinations_are_all_reported_and_nothing_is_applied(
    settings: Settings, run_cli: Callable[..., Completed], queue_file: Callable[[str], Path]
) -> None:
    bad = queue_file("""
queues:
  - name: Good
  - name: Deep
    target_queue_depth: 100
    priority: /p
  - name: Once
    semantics: at-most-once
    fairness: proportional
  - name: Typo
    lease_perod: 30s
""")
    done = run_cli("queue", "apply", "-f", str(bad))
    assert done.code == 1
    assert "3 problems in queue file" in done.stderr
    assert "Deep.target_queue_depth: cannot be combined with priority; remove one of them" \
        in done.stderr
    assert "Once.fairness: at-most-once queues support only round-robin" in done.stderr
    assert "unknown field 'lease_perod' (did you mean 'lease_period'?)" in done.stderr
    assert stored(settings) == {}  # not even the valid queue


def test_apply_will_not_prune_a_queue_with_consumers_unless_forced(
    settings: Settings, invoke: Callable[..., object], run_cli: Callable[..., Completed],
    queue_file: Callable[[str], Path]
) -> None:
    assert run_cli("queue", "apply", "-f", str(queue_file(FIRST))).code == 0
    attach_consumer(settings, "worker-1", "Old")
    without_old = queue_file("queues:\n  - name: Jobs\n")
    # Without --prune the consumer is no obstacle: nothing would be deleted.
    kept = run_cli("queue", "apply", "-f", str(without_old), "--dry-run")
    assert kept.code == 0, kept.stderr
    assert "refused" not in kept.stdout

    # A dry run never fails for attached consumers: it says what would be refused.
    dry = run_cli("queue", "apply", "-f", str(without_old), "--prune", "--dry-run")
    assert dry.code == 0, dry.stderr
    assert "- delete Old (version 1): refused, consumers attached (worker-1)" in dry.stdout
    assert ("the apply would be refused: consumers are attached (Old: worker-1)"
            in dry.stdout)
    dry_json = run_cli("queue", "apply", "-f", str(without_old), "--prune", "--dry-run",
                       "--json")
    assert dry_json.code == 0, dry_json.stderr
    assert json.loads(dry_json.stdout)["refused"] == {"Old": ["worker-1"]}

    refused = run_cli("queue", "apply", "-f", str(without_old), "--prune")
    assert refused.code == 1
    assert "consumers are attached (Old: worker-1)" in refused.stderr
    assert "--force" in refused.stderr
    assert set(stored(settings)) == {"Jobs", "OrderPriority", "Old"}
    assert stored(settings)["Jobs"][0] == 1

    forced = run_cli("queue", "apply", "-f", str(without_old), "--prune", "--force")
    assert forced.code == 0, forced.stderr
    assert set(stored(settings)) == {"Jobs"}


def test_apply_reads_the_file_from_stdin(
    settings: Settings, run_cli: Callable[..., Completed]
) -> None:
    done = run_cli("queue", "apply", "-f", "-", input=FIRST)
    assert done.code == 0, done.stderr
    assert set(stored(settings)) == {"Jobs", "OrderPriority", "Old"}


class _ChangedMeanwhile(Store):
    """A store where another operator changes Jobs right after apply read the queues."""

    def list_queues(self, *, include_deleted: bool = False) -> list[QueueRecord]:
        found = super().list_queues(include_deleted=include_deleted)
        self.put_queue("Jobs", {"name": "Jobs", "lease_period": 7}, time.time())
        return found


def test_a_queue_changed_during_apply_stops_it_instead_of_being_overwritten(
    settings: Settings, run_cli: Callable[..., Completed], queue_file: Callable[[str], Path]
) -> None:
    assert run_cli("queue", "apply", "-f", str(queue_file(FIRST))).code == 0
    with _ChangedMeanwhile(settings.database_url) as store:
        service = QueueService(store=store, settings=settings)
        with pytest.raises(ApplyConflictError) as raised:
            service.apply(SECOND)
    assert "expected version 1, but it is at version 2" in str(raised.value)
    assert "`qlayer queue apply --dry-run`" in str(raised.value)
    version, definition = stored(settings)["Jobs"]
    assert (version, definition["lease_period"]) == (2, 7)  # the other operator's change stands
