"""The apply diff and the consumer matching, pure: no database, no Kafka."""

from __future__ import annotations

from typing import Any

from layer.domain.definitions import QueueDefinition, load_queue_file
from layer.services.queues import attached_consumers, plan_apply, stored_form
from layer.store.rows import ConsumerRow, QueueRecord


def record(name: str, definition: dict[str, Any], version: int = 1) -> QueueRecord:
    return QueueRecord(name=name, definition=definition, version=version, created_at=0.0,
                       updated_at=0.0)


def stored_as(text: str, version: int = 1) -> list[QueueRecord]:
    return [record(d.name, stored_form(d), version) for d in load_queue_file(text)]


def consumer(consumer_id: str, queue: str, is_regex: bool = False) -> ConsumerRow:
    return ConsumerRow(consumer_id=consumer_id, session_id="s", queue=queue, is_regex=is_regex,
                       delivery_topic="d", session_timeout_ms=1000, subscribed_at=0.0,
                       last_heartbeat_at=0.0)


def test_plan_creates_changes_deletes_and_keeps() -> None:
    stored = stored_as("queues:\n  - {name: A, lease_period: 30s}\n  - {name: B}\n"
                       "  - {name: C}\n", version=3)
    wanted = load_queue_file("queues:\n  - {name: A, lease_period: 1m, max_deliveries: 2}\n"
                             "  - {name: B}\n  - {name: D}\n")
    plan = plan_apply(wanted, stored, prune=True)
    actions = {c.name: c.action for c in plan.changes}
    assert actions == {"A": "change", "B": "unchanged", "D": "create", "C": "delete"}
    (change,) = plan.of("change")
    assert change.version == 3
    assert [(f.field, f.old, f.new) for f in change.fields] == [
        ("lease_period", 30.0, 60.0), ("max_deliveries", 0, 2)]
    assert plan.has_changes


def test_without_prune_nothing_is_deleted() -> None:
    stored = stored_as("queues:\n  - {name: A}\n  - {name: Extra}\n")
    plan = plan_apply(load_queue_file("queues:\n  - {name: A}\n"), stored, prune=False)
    assert [(c.name, c.action) for c in plan.changes] == [("A", "unchanged")]
    assert not plan.has_changes


def test_a_stored_definition_with_defaults_left_out_is_unchanged_when_it_means_the_same() -> None:
    # Written by another tool (e.g. a test's put_queues) with only the fields it set.
    stored = [record("A", {"name": "A", "lease_period": "30s"})]
    wanted = load_queue_file("queues:\n  - {name: A, lease_period: 30}\n")
    assert [c.action for c in plan_apply(wanted, stored, prune=True).changes] == ["unchanged"]


def test_a_stored_definition_that_no_longer_validates_is_rewritten() -> None:
    stored = [record("A", {"name": "A", "lease_period": "soon"})]
    (change,) = plan_apply(load_queue_file("queues:\n  - {name: A}\n"), stored,
                           prune=True).changes
    assert change.action == "change"
    assert ("lease_period", "soon", 300.0) in [(f.field, f.old, f.new) for f in change.fields]
    assert change.definition == stored_form(QueueDefinition.from_mapping({"name": "A"}))


def test_an_empty_file_with_prune_deletes_everything() -> None:
    stored = stored_as("queues:\n  - {name: A}\n  - {name: B}\n")
    plan = plan_apply(load_queue_file("queues: []\n"), stored, prune=True)
    assert [(c.name, c.action) for c in plan.changes] == [("A", "delete"), ("B", "delete")]


def test_consumers_attach_by_name_or_by_a_whole_name_regex() -> None:
    rows = [consumer("exact", "Jobs"), consumer("other", "Mail"),
            consumer("regex", "Jo.*", is_regex=True), consumer("prefix", "J", is_regex=True),
            consumer("broken", "(", is_regex=True)]
    assert [c.consumer_id for c in attached_consumers("Jobs", rows)] == ["exact", "regex"]
