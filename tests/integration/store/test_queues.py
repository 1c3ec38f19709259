"""Queue definitions for `qlayer queue ...`: versioned, idempotent, soft-deleted, purgeable."""

from __future__ import annotations

import pytest

from layer.domain.errors import UnknownQueueError
from layer.store.batch import WriteBatch
from layer.store.errors import QueueVersionConflictError
from layer.store.rows import EntryRow, PartitionKey
from layer.store.store import Store

pytestmark = pytest.mark.integration

T0 = 1_700_000_000.0
WORK = {
    "name": "WorkToDo",
    "underlying_topic": "Work",
    "semantics": "at-least-once",
    "lease_period": 30.0,
    "max-deliveries": 0,
    "filter": "/region = 'EU' AND /note LIKE 'é%'",
    "fairness": "proportional",
    "dead_letter_topic": None,
    "tags": ["a", {"nested": True}],
}


def test_versions_count_changes_and_identical_writes_change_nothing(store: Store) -> None:
    assert store.get_queue("WorkToDo") is None
    assert store.put_queue("WorkToDo", WORK, T0) == 1
    assert store.put_queue("WorkToDo", dict(reversed(list(WORK.items()))), T0 + 1) == 1

    changed = {**WORK, "lease_period": 60.0}
    assert store.put_queue("WorkToDo", changed, T0 + 2) == 2
    assert store.put_queue("WorkToDo", WORK, T0 + 3) == 3

    record = store.get_queue("WorkToDo")
    assert record is not None
    assert record.definition == WORK
    assert (record.version, record.created_at, record.updated_at) == (3, T0, T0 + 3)
    assert not record.deleted and not record.purge_pending


def test_expected_version_guards_concurrent_edits(store: Store) -> None:
    store.put_queue("Jobs", WORK, T0)
    assert store.put_queue("Jobs", {**WORK, "max-deliveries": 3}, T0 + 1, expected_version=1) == 2
    with pytest.raises(QueueVersionConflictError) as conflict:
        store.put_queue("Jobs", {**WORK, "max-deliveries": 9}, T0 + 2, expected_version=1)
    assert (conflict.value.expected, conflict.value.actual) == (1, 2)
    stored = store.get_queue("Jobs")
    assert stored is not None and stored.definition["max-deliveries"] == 3
    with pytest.raises(QueueVersionConflictError):
        store.put_queue("Fresh", WORK, T0, expected_version=1)
    assert store.get_queue("Fresh") is None
    with pytest.raises(QueueVersionConflictError):
        store.delete_queue("Jobs", T0 + 3, expected_version=1)
    assert store.get_queue("Jobs") is not None


def test_list_queues_is_sorted_and_hides_deleted_ones(store: Store) -> None:
    for name in ("b", "c", "a"):
        store.put_queue(name, {"name": name}, T0)
    store.delete_queue("c", T0 + 1)
    assert [q.name for q in store.list_queues()] == ["a", "b"]
    assert [q.name for q in store.load_queues()] == ["a", "b"]
    assert [(q.name, q.deleted) for q in store.list_queues(include_deleted=True)] == [
        ("a", False), ("b", False), ("c", True),
    ]


def test_delete_and_recreate_make_a_new_queue_without_the_old_state(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    epoch = store.take_shard("Work", "a", T0)
    assert epoch is not None
    state = WriteBatch()
    state.put_entry(EntryRow("Work", "orders", 0, 5, "ACKED", delivery_count=1))
    state.set_recovery_point("Work", "orders", 0, 5)
    state.count("Work", "acked")
    store.commit(state, "Work", "a", epoch, T0)

    assert store.delete_queue("Work", T0 + 10) == 2
    assert store.get_queue("Work") is None
    deleted = store.get_queue("Work", include_deleted=True)
    assert deleted is not None and deleted.deleted_at == T0 + 10 and deleted.version == 2
    assert store.load_entries("Work") == [] and store.load_recovery_points("Work") == {}
    assert store.load_counters("Work") == {}
    with pytest.raises(UnknownQueueError):
        store.delete_queue("Work", T0 + 11)

    # The owner had not noticed yet and wrote once more before the queue came back.
    store.commit(state, "Work", "a", epoch, T0 + 12)
    assert store.put_queue("Work", WORK, T0 + 20) == 3
    record = store.get_queue("Work")
    assert record is not None
    assert (record.created_at, record.deleted_at, record.version) == (T0 + 20, None, 3)
    assert store.load_entries("Work") == [] and store.load_recovery_points("Work") == {}
    assert store.load_counters("Work") == {}


def test_a_purge_is_requested_by_the_cli_and_completed_by_the_owner(store: Store) -> None:
    store.put_queue("Work", WORK, T0)
    assert store.request_purge("Work", T0 + 5) == 2
    record = store.get_queue("Work")
    assert record is not None and record.purge_pending and record.purge_requested_at == T0 + 5

    epoch = store.take_shard("Work", "a", T0 + 6)
    assert epoch is not None
    done = WriteBatch()
    done.forget_queue("Work")
    done.set_recovery_point("Work", "orders", 0, 1234)  # the journal's end at purge time
    done.purge_done("Work", record.purge_requested_at)
    store.commit(done, "Work", "a", epoch, T0 + 6)

    after = store.get_queue("Work")
    assert after is not None and not after.purge_pending and after.version == 2
    assert store.load_recovery_points("Work") == {PartitionKey("Work", "orders", 0): 1234}

    assert store.request_purge("Work", T0 + 7) == 3  # a second purge is pending again
    again = store.get_queue("Work")
    assert again is not None and again.purge_pending
    with pytest.raises(UnknownQueueError):
        store.request_purge("Nope", T0)


def test_definitions_must_be_json_objects(store: Store) -> None:
    with pytest.raises(TypeError):
        store.put_queue("Bad", ["not", "an", "object"], T0)  # type: ignore[arg-type]

